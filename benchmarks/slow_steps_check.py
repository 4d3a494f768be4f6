#!/usr/bin/env python3
"""The what-if checked (a script, not a test): each planting (``probes/slowness.py``) runs
under ``lorascope run``, is analysed, and the finding that names the slow rank (or group)
predicts the step time had it done the median rank's work; the same job runs without the
planting just before and just after the planted run, and its step time over the same
steps is measured (the mean of the two: a load drifting across the three runs cancels to
first order; each run's figure is printed). Prints, per finding, what was named (id,
ranks, since when, where), the predicted and the measured step time, the error, and the
prediction of the replay that keeps the others' waiting as their work, the prediction
with the time blocked on async collectives' handles unread (as from probes that did not
record it), and each rank's median time blocked on handles a step. Where the planting
begins after step 3, the runs' steps before it are compared too and the measurement scaled
by their ratio (the "load" figure: the planted run's steps before the planting over the
runs without), an error under the same load.

    python benchmarks/slow_steps_check.py                 # ~15 min on 2 cores
    python benchmarks/slow_steps_check.py --only data     # a subset (by name)
    python benchmarks/slow_steps_check.py --analyze-only  # the kept runs, current detectors

The plantings: extra compute in the forward on one rank of 4 from step 8 of 30; CPU hogs
(3 busy loops, each in its own session) pinned to one rank's core (2 ranks, each pinned to its
own core); one rank of 3 slow in its data preparation from step 20 of 40 on (the case
``analyze`` once called "no problem found"); one rank of 4 slow in its forward from step 15
of 30 on. The first four became the rules' tuning cases; the last two (one rank of 4 slow
in its data loading in steps 10-17 and 28-35 of 40; two ranks of 4 slow in their forward
from step 12 of 30) were written after the rules were last changed (untuned). The two
``partitioned`` ones (``--partition``: ZeRO-3 partitions every parameter, so the forward
gathers them by async all-gathers waited on by handle; 2 ranks, one +150 ms a step all run
long, in its forward, or in its data preparation, before the forward's first all-gather)
were written once the waits on handles were recorded (untuned).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # this checkout's lorascope
from healthy_runs import REPO, Config, analyze, run_one  # the same runner

from lorascope.analysis import analyze as load
from lorascope.detect import pace

JOB = REPO / "probes" / "slowness.py"


@dataclass(frozen=True)
class Planting:
    name: str
    nproc: int
    steps: int
    #: The job's flags with the planting; without it, ``--slow-rank -1`` replaces the ranks.
    args: tuple[str, ...]
    ranks: tuple[int, ...]
    #: CPU hogs pinned to this core while the planted run runs (None: none).
    hog_core: int | None = None
    hogs: int = 1
    #: Written after the rules were last changed (reported apart: "untuned").
    untuned: bool = False

    def planted_steps(self) -> list[tuple[int, int]]:
        """The planted stretches of steps, first and last (10**9: to the end)."""
        if "--slow-steps" in self.args:
            spec = self.args[self.args.index("--slow-steps") + 1]
            return [(int(a), int(b)) for a, b in (part.split("-") for part in spec.split(","))]
        start = int(self.args[self.args.index("--slow-from") + 1]) if "--slow-from" in self.args else 1
        return [(start, 10**9)]


PLANTINGS = [
    Planting("compute-4ranks", 4, 30, ("--slow-where", "forward", "--slow-ms", "300", "--slow-from", "8"), (1,)),
    Planting("hog-pinned", 2, 24, ("--pin", "--slow-ms", "0"), (1,), hog_core=1, hogs=3),
    Planting("data-from-20", 3, 40, ("--slow-where", "data", "--slow-ms", "250", "--slow-from", "20"), (1,)),
    Planting("forward-from-15", 4, 30, ("--slow-where", "forward", "--slow-ms", "200", "--slow-from", "15"), (2,)),
    # written after the rules were last changed
    # written after the waits on handles were recorded: the others wait inside their forward
    Planting(
        "partitioned-whole-run",
        2,
        24,
        ("--partition", "--slow-where", "forward", "--slow-ms", "150"),
        (1,),
        untuned=True,
    ),
    Planting(
        "partitioned-data-whole-run",
        2,
        24,
        ("--partition", "--slow-where", "data", "--slow-ms", "150"),
        (1,),
        untuned=True,
    ),
    Planting(
        "comes-and-goes",
        4,
        40,
        ("--slow-where", "data", "--slow-ms", "250", "--slow-steps", "10-17,28-35"),
        (3,),
        untuned=True,
    ),
    Planting(
        "pair-of-4", 4, 30, ("--slow-where", "forward", "--slow-ms", "250", "--slow-from", "12"), (2, 3), untuned=True
    ),
]

HOG = "import os, sys, time\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    sum(range(10_000))\n"


def run(p: Planting, out: Path, planted: bool) -> int:
    ranks = ",".join(map(str, p.ranks)) if planted else "-1"
    cfg = Config(p.name, (*p.args, "--slow-rank", ranks), nproc=p.nproc, job=JOB)
    hogs = []
    if planted and p.hog_core is not None:
        # each in its own session: with the kernel's autogroup scheduling a core is shared
        # between sessions, and torchrun starts each rank in its own, so hogs sharing this
        # script's session took half the rank's core together, not hogs/(hogs+1) of it
        hogs = [
            subprocess.Popen([sys.executable, "-c", HOG, str(p.hog_core)], start_new_session=True)
            for _ in range(p.hogs)
        ]
    try:
        rc, _ = run_one(cfg, out, p.steps, hog=False, timeout=600)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    return rc


def named(data: dict[str, Any], ranks: tuple[int, ...]) -> list[dict[str, Any]]:
    """The findings with a what-if that name any of ``ranks``, in step order."""
    return [
        dict(f)
        for f in data.get("findings", [])
        if set(ranks) & set(f["ranks"]) and f["id"] in ("slow-steps", "straggler") and f["details"].get("what_if")
    ]


def table(out: Path) -> pace.PaceTable:
    t = pace.table(load(out).bundle.run)  # type: ignore[arg-type]
    assert t is not None
    return t


def blind_table(out: Path) -> pace.PaceTable:
    """:func:`table` with the time blocked on async collectives' handles unread (as a run
    whose probes did not record it): what the new data changed."""
    run = load(out).bundle.run
    assert run is not None
    for rank in run.ranks.values():
        rank.handle_wait, rank.handle_wait_phases = {}, {}
    for key in ("pace", "step_work"):
        run.derived.pop(key, None)
    t = pace.table(run)
    assert t is not None
    return t


def blocked_ms(out: Path, idx: list[int]) -> str:
    """Per rank, its median time blocked on async collectives' handles a step over ``idx`` (ms)."""
    t = table(out)
    assert t.run is not None
    return ", ".join(
        f"r{r} {statistics.median(t.run.ranks[r].handle_wait.get(t.steps[i], 0.0) for i in idx) * 1000:.0f}"
        for r in t.ranks
    )


def work_ratio(t: pace.PaceTable, ranks: tuple[int, ...], idx: list[int]) -> float:
    """The ranks' most work over the others' median, median over the steps ``idx``."""
    return statistics.median(max(t.work[r][i] for r in ranks) / t.others_median(ranks, t.work, i) for i in idx)


def measured_step_s(out: Path, first: int, last: int) -> float:
    """The median rank's step time, averaged over steps first..last of a run."""
    t = table(out)
    values = [c for s, c in zip(t.steps, t.median_cycle, strict=True) if first <= s <= last]
    return statistics.fmean(values)


def rows(p: Planting, slow: Path, fixed: list[Path]) -> list[str]:
    """One row per finding naming a planted rank (or one "not named" row per planted
    stretch): predicted step time against the one measured without the planting (the
    mean of the runs without it, one before and one after the planted run where both
    were run: the machine's load drifting in between cancels to first order)."""
    t = table(slow)
    found = named(analyze(slow), p.ranks)
    cases: list[tuple[dict[str, Any], dict[str, Any], dict[str, float], list[int]]] = []
    for f in found:
        d = f["details"]
        first, last = d.get("first_step", t.steps[0]), d.get("last_step", t.steps[-1])
        idx = [i for i, s in enumerate(t.steps) if first <= s <= last]
        cases.append((f, d, d["what_if"], idx))
    if not found:
        for a, b in p.planted_steps():
            idx = [i for i, s in enumerate(t.steps) if max(a, 2) <= s <= b]
            outside = [i for i in range(len(t.steps)) if i not in idx]
            base = outside if len(outside) >= 5 else []
            d = {"first_step": t.steps[idx[0]], "last_step": t.steps[idx[-1]], "part": ""}
            d["part"] = f"ratio {work_ratio(t, p.ranks, idx):.2f}x"
            f = {"id": "**not named**", "severity": "-", "ranks": list(p.ranks)}
            cases.append((f, d, pace.what_if_summary(t, p.ranks, idx, base), idx))
    out = []
    first_planted = p.planted_steps()[0][0]
    for f, d, w, idx in cases:
        first, last = t.steps[idx[0]], t.steps[idx[-1]]
        each = [measured_step_s(f, first, last) for f in fixed]
        actual = statistics.fmean(each)
        err = (w["predicted_step_s"] - actual) / actual
        # the replay keeping the others' waiting as work (no baseline): what the correction changed
        kept = pace.what_if_summary(t, f["ranks"], idx)["predicted_step_s"]
        # the same replay with the waits on handles unread: what recording them changed
        base = [i for i in range(len(t.steps)) if i not in idx] if w.get("baseline_steps") else []
        blind = pace.what_if_summary(blind_table(slow), f["ranks"], idx, base)["predicted_step_s"]
        drift = ""
        if first_planted > 3:
            # the machine's load between the two runs: their steps before the planting compared
            before = statistics.fmean(measured_step_s(f, 2, first_planted - 1) for f in fixed)
            ratio = measured_step_s(slow, 2, first_planted - 1) / before
            adjusted = actual * ratio
            drift = f"; load {ratio - 1:+.0%}: {adjusted:.3f}, {(w['predicted_step_s'] - adjusted) / adjusted:+.1%}"
        runs = " / ".join(f"{v:.3f}" for v in each)
        out.append(
            f"| {p.name}{' (untuned)' if p.untuned else ''} | {f['id']} {f['severity'][0].upper()} ranks {f['ranks']} | "
            f"steps {first}-{last}, {d.get('part', '')} | {w['step_s']:.3f} -> {w['predicted_step_s']:.3f} "
            f"(others' waiting kept: {kept:.3f}; handle waits unread: {blind:.3f}) | {actual:.3f} ({runs}) | "
            f"{err:+.1%}{drift} | {w['saved_per_step_s']:.3f} / {w['step_s'] - actual:.3f} | {blocked_ms(slow, idx)} |"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/lorascope-slow-steps"))
    ap.add_argument("--only", default="", help="run the plantings whose name contains this")
    ap.add_argument("--analyze-only", action="store_true")
    args = ap.parse_args(argv)
    os.environ["PYTHONPATH"] = f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    print(
        "| planting | named | since / where | predicted step (s) | measured without (s) | error "
        "| speed-up predicted / measured | blocked on handles (ms a step) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for p in PLANTINGS:
        if args.only not in p.name:
            continue
        slow, before, after = (args.out / p.name / n for n in ("planted", "without", "without-after"))
        if not args.analyze_only:
            for d, planted in ((before, False), (slow, True), (after, False)):
                subprocess.run(["rm", "-rf", str(d)], check=True)
                rc = run(p, d, planted)
                if rc:
                    print(f"| {p.name} | job failed rc={rc} ({d.name}) | | | | | | |")
        fixed = [d for d in (before, after) if (d / "manifest.json").exists()]
        for line in rows(p, slow, fixed):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
