#!/usr/bin/env python3
"""Overhead of lorascope's always-on probes on a real 2-rank LoRA job (a script, not a test).

Runs ``probes/train_lora.py`` under torchrun bare and under ``lorascope run --no-summary``
(by default with ``--trace-window off``: the always-on probes; the bounded kernel-trace
window profiles two steps and exports a trace, a one-off cost measured with
``--trace-window 5:2``),
alternating (bare/probed, then probed/bare, ...) ``--reps`` pairs (default 20), and prints
every pair's median step times and ratio as it goes, then the headline figure: the
median over pairs of the per-pair overhead (probed median / bare median - 1) with its
interquartile range, the pooled median step times, and whether rank 0's losses were
identical with and without probes. ``--json FILE`` writes every number.

Both variants are timed the same way, from outside the job: the job prints
``step N loss X`` on rank 0 after each step (``--print-losses``, flushed), and the time
between two consecutive such lines, read as they arrive, is that step's wall time.
The first ``--warmup`` steps of every run are discarded. The job's own
``mean_step_s`` (which skips only its first 2 steps) is reported as a cross-check.

Wall time on a loaded machine swings with what else runs; the CPU time the ranks spend
per step does much less. So the ranks' CPU time (user + system, every thread, read from
/proc through psutil when the warm-up's last step line and the run's last step line
arrive) is reported too, per pair and as the same median over pairs: it is what the
probes add to the job's work, whatever the machine's load.

And what each probed job measured itself (its ``cost`` records: `analyze`'s "probes'
cost"): the time its threads spent in probe code a step, as a share of its step, which
no other run's noise enters (wall time in probe code: the hooks' dispatch and what the
probes' own threads take from the job outside it are not in it); printed per pair and
as IN-JOB. It is measured from the end of the probes' warm-up (step 20, `analyze`'s window:
through it the C heap is read at every phase edge) to the run's end; the same from the
first step's end is printed beside it ("from step 1"), the window earlier versions used.

Step times of the tiny CPU job vary by +-50% between runs on a small machine: resolve a
few percent only with many repetitions (20 pairs or more), and say what else the
machine was running (the load average is printed before and after). With ``taskset`` on the
machine every run is pinned to the same CPUs (``--cpus``; default: the CPUs this script
may use), so that both variants see the same cores.

``--baseline DIR`` adds a third variant to every repetition, probed by the lorascope of
another checkout (e.g. ``git worktree add /tmp/base HEAD~3``), in rotating order: a
change's before and after measured under the same load.

    python benchmarks/probe_overhead.py --reps 20 --steps 30 [--baseline DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import psutil

from lorascope.analysis.cost import rank_cost
from lorascope.analysis.summary import build_summary
from lorascope.rundir.loading.reader import RunData, load_run

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "probes" / "train_lora.py"
STEP_LINE = re.compile(r"^step (\d+) loss (\S+)$")
DONE_LINE = re.compile(r"^train_lora: done .*mean_step_s=([0-9.eE+-]+)")


@dataclass
class Run:
    variant: str  # "bare", "probed" or "baseline" (probed by --baseline's checkout)
    port: int
    wall_s: float = 0.0
    step_s: list[float] = field(default_factory=list)  # post-warm-up per-step seconds
    losses: list[str] = field(default_factory=list)  # repr of rank 0's loss, per step
    mean_step_s: float | None = None  # what the job itself prints
    rc: int = 0
    cpu_step_s: float | None = None  # the ranks' CPU seconds per post-warm-up step, all ranks together
    #: what the probed job measured itself (its ``cost`` records, `analyze`'s "probes' cost"):
    #: the median over its ranks of the time a step spent in probe code, ms and share of the step
    in_job_ms: float | None = None
    in_job_share: float | None = None
    #: the same from the end of the first step (the median over ranks of its share)
    in_job_share_from_1: float | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.step_s)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=20, help="bare/probed pairs (default 20)")
    p.add_argument("--steps", type=int, default=30, help="training steps per run (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="first steps of each run discarded (default 5)")
    p.add_argument(
        "--port", type=int, default=29800, help="first torchrun master port; run i uses port+i (default 29800)"
    )
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument(
        "--cpus", default=None, help="taskset CPU list for every run (default: the CPUs this process may use)"
    )
    p.add_argument("--no-pin", action="store_true", help="do not pin runs with taskset")
    p.add_argument(
        "--trace-window",
        default="off",
        help="the probed runs' kernel-trace window (default off: always-on probes only)",
    )
    p.add_argument("--keep", action="store_true", help="keep the probed runs' directories")
    p.add_argument(
        "--baseline", type=Path, help="also run probed with the lorascope checkout in this folder (a before)"
    )
    p.add_argument("--json", type=Path, help="also write the figures (every pair's) to this JSON file")
    p.add_argument("job_args", nargs="*", help="extra arguments for train_lora.py (after --)")
    args = p.parse_args()
    if args.reps < 1:
        p.error("--reps must be >= 1")
    if args.warmup < 1:
        p.error("--warmup must be >= 1 (step 1 has no preceding step line to time it from)")
    if args.steps < args.warmup + 2:
        p.error("--steps must exceed --warmup by at least 2")
    return args


def pin_prefix(args: argparse.Namespace) -> list[str]:
    taskset = shutil.which("taskset")
    if args.no_pin or taskset is None:
        return []
    cpus = args.cpus or ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    return [taskset, "-c", cpus]


class RunFailed(Exception):
    """A run exited non-zero or printed fewer steps than asked."""


def run_once(variant: str, port: int, args: argparse.Namespace, work: Path, index: int, pin: list[str]) -> Run:
    job = [
        "torchrun",
        "--nproc_per_node",
        str(args.nproc),
        "--master_port",
        str(port),
        str(JOB),
        "--steps",
        str(args.steps),
        "--print-losses",
        *args.job_args,
    ]
    env = None
    if variant == "baseline":
        env = {**os.environ, "PYTHONPATH": str(args.baseline.resolve())}
    if variant != "bare":
        out = work / f"{variant}-{index:02d}"
        cmd = [
            *pin,
            sys.executable,
            "-m",
            "lorascope",
            "run",
            "--no-summary",
            "--trace-window",
            args.trace_window,
            "--out",
            str(out),
            "--",
            *job,
        ]
    else:
        cmd = [*pin, *job]
    run = Run(variant, port)
    log = work / f"{variant}-{index:02d}.stderr"
    arrivals: dict[int, float] = {}
    cpu_at: dict[int, float] = {}
    ranks: list[psutil.Process] = []
    start = time.perf_counter()
    with open(log, "wb") as err:
        # not the repository: `python -m` puts the working directory first on sys.path, and
        # the launcher must be --baseline's lorascope as the ranks are
        cwd = tempfile.gettempdir()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1, env=env)
        assert proc.stdout is not None
        for line in proc.stdout:
            now = time.perf_counter()
            line = line.rstrip("\n")
            if m := STEP_LINE.match(line):
                step = int(m.group(1))
                arrivals[step] = now
                run.losses.append(m.group(2))
                if step in (args.warmup, args.steps):
                    ranks = ranks or rank_processes(proc.pid, args.nproc)
                    cpu_at[step] = ranks_cpu(ranks)
            elif m := DONE_LINE.match(line):
                run.mean_step_s = float(m.group(1))
        run.rc = proc.wait()
    run.wall_s = time.perf_counter() - start
    if run.rc != 0 or len(arrivals) != args.steps:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise RunFailed(
            f"the {variant} run on port {port} failed (exit {run.rc}, "
            f"{len(arrivals)}/{args.steps} steps); its stderr ends:\n" + "\n".join(tail)
        )
    run.step_s = [arrivals[s] - arrivals[s - 1] for s in range(args.warmup + 1, args.steps + 1)]
    if len(cpu_at) == 2 and len(ranks) == args.nproc:
        run.cpu_step_s = (cpu_at[args.steps] - cpu_at[args.warmup]) / (args.steps - args.warmup)
    if variant != "bare" and not list((work / f"{variant}-{index:02d}" / "ranks").glob("rank-*/*.jsonl")):
        print(f"  warning: the {variant} run {index} wrote no rank stream (probes not attached?)")
    elif variant == "baseline":
        pass  # its run directory is its checkout's format (maybe one this reader refuses): wall and CPU only
    elif variant != "bare":
        loaded = load_run(work / f"{variant}-{index:02d}")
        cost = build_summary(loaded)["probe_cost"]  # None from a --baseline checkout that writes no cost records
        if cost is not None:
            run.in_job_ms, run.in_job_share = cost["job_ms_per_step"], cost["share_of_step"]
            run.in_job_share_from_1 = share_from_first_step(loaded)
    return run


def share_from_first_step(loaded: RunData) -> float | None:
    """The probes' cost as a share of the step from the first ``cost`` record a rank wrote
    (the reader keeps the one past the warm-up), the median over ranks."""
    shares = []
    for rank in loaded.ranks.values():
        first = None
        for name in rank.files if rank.costs else []:  # its stream's segments, in order
            with open(name) as lines:
                records = (json.loads(line) for line in lines if '"k":"cost"' in line)
                first = next((r for r in records if r.get("k") == "cost"), None)  # not a site's text
            if first is not None:
                break
        cost = rank_cost(replace(rank, costs=[first, rank.costs[-1]])) if first is not None else None
        if cost is not None and cost["share_of_step"] is not None:
            shares.append(cost["share_of_step"])
    return statistics.median(shares) if shares else None


def in_job_text(run: Run) -> str:
    if run.in_job_ms is None:
        return "-"
    share = f" ({run.in_job_share * 100:.2f}%)" if run.in_job_share is not None else ""
    return f"{run.in_job_ms:.2f} ms{share}"


def in_job_text_of(runs: list[Run]) -> str | None:
    """The in-job cost over probed runs (their cost records), or None without them."""
    in_job = [(r.in_job_ms, r.in_job_share) for r in runs if r.in_job_ms is not None]
    if not in_job:
        return None
    shares = [share for _, share in in_job if share is not None]
    text = (
        f"(median of {len(in_job)} probed runs, each the median of its ranks): "
        f"{statistics.median(m for m, _ in in_job):.2f} ms a step in probe code on the job's threads"
    )
    if shares:
        iqr = " .. ".join(f"{q * 100:.2f}%" for q in quartiles(shares)[::2])
        text += f", {statistics.median(shares) * 100:.2f}% of the step (IQR {iqr})"
    from_1 = [r.in_job_share_from_1 for r in runs if r.in_job_share_from_1 is not None]
    if from_1:
        iqr = " .. ".join(f"{q * 100:.2f}%" for q in quartiles(from_1)[::2])
        text += f"; from step 1: {statistics.median(from_1) * 100:.2f}% (IQR {iqr})"
    return text


def rank_processes(root: int, nproc: int) -> list[psutil.Process]:
    """The job's rank processes: descendants of the launch running the job script."""
    found = []
    try:
        for child in psutil.Process(root).children(recursive=True):
            try:
                cmd = child.cmdline()
            except psutil.Error:
                continue
            if any(part.endswith("train_lora.py") for part in cmd) and not any("torchrun" in c for c in cmd[:2]):
                found.append(child)
    except psutil.Error:
        return []
    return found if len(found) == nproc else []


def ranks_cpu(ranks: list[psutil.Process]) -> float:
    """CPU seconds (user + system, all threads) the ranks have used so far."""
    total = 0.0
    for rank in ranks:
        try:
            times = rank.cpu_times()
        except psutil.Error:
            return float("nan")
        total += times.user + times.system
    return total


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """First quartile, median, third quartile (statistics' "inclusive" method)."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" (1/5/15 min, {os.cpu_count()} CPUs)"
    except OSError:
        return "unknown"


def cpu_overhead(bare: Run, probed: Run) -> float | None:
    if bare.cpu_step_s and probed.cpu_step_s:
        return (probed.cpu_step_s / bare.cpu_step_s - 1) * 100
    return None


def cpu_overhead_text(bare: Run, probed: Run) -> str:
    value = cpu_overhead(bare, probed)
    return "n/a" if value is None else f"{value:+.2f}%"


def cpu_text(run: Run) -> str:
    return "n/a" if run.cpu_step_s is None else f"{run.cpu_step_s * 1000:.1f} ms"


def ms(seconds: float) -> str:
    return f"{seconds * 1000:7.1f} ms"


def main() -> None:
    args = parse_args()
    pin = pin_prefix(args)
    work = Path(tempfile.mkdtemp(prefix="lorascope-overhead-"))
    print(
        f"probe_overhead: {args.reps} pairs, {args.steps} steps/run, first {args.warmup} discarded, "
        f"{args.nproc} ranks; pinned to CPUs: {pin[-1] if pin else 'no'}; work dir {work}"
    )
    load_before = load_average()
    print(f"load average before: {load_before}")
    pairs: list[tuple[Run, Run]] = []
    baseline_pairs: list[tuple[Run, Run]] = []
    variants = ["bare", "probed"] + (["baseline"] if args.baseline else [])
    port = args.port
    try:
        for rep in range(args.reps):
            if len(variants) == 2:
                order = tuple(variants if rep % 2 == 0 else variants[::-1])
            else:  # every variant first, second and last equally often
                order = tuple(variants[(rep + i) % 3] for i in range(3))
                order = order if rep % 6 < 3 else order[::-1]
            done: dict[str, Run] = {}
            for variant in order:
                try:
                    done[variant] = run_once(variant, port, args, work, rep, pin)
                except RunFailed as exc:  # once: gloo's teardown aborts now and then on a loaded machine
                    print(f"  retrying: {str(exc).splitlines()[0]}", flush=True)
                    port += 1
                    try:
                        done[variant] = run_once(variant, port, args, work, rep, pin)
                    except RunFailed as again:
                        sys.exit(f"probe_overhead: {again}")
                port += 1
            bare, probed = done["bare"], done["probed"]
            pairs.append((bare, probed))
            if "baseline" in done:
                base = done["baseline"]
                baseline_pairs.append((bare, base))
                print(
                    f"  pair {rep + 1:2d} baseline: {ms(base.median)} overhead "
                    f"{(base.median / bare.median - 1) * 100:+6.2f}%; CPU/step {cpu_text(base)} "
                    f"({cpu_overhead_text(bare, base)}); in-job {in_job_text(base)}",
                    flush=True,
                )
            print(
                f"  pair {rep + 1:2d} ({''.join(v[0] for v in order)}): bare {ms(bare.median)} probed {ms(probed.median)} "
                f"overhead {(probed.median / bare.median - 1) * 100:+6.2f}%; "
                f"CPU/step {cpu_text(bare)} / {cpu_text(probed)} ({cpu_overhead_text(bare, probed)}); "
                f"in-job {in_job_text(probed)}   "
                f"(wall {bare.wall_s:.1f} s / {probed.wall_s:.1f} s; load {os.getloadavg()[0]:.2f})",
                flush=True,
            )
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    bare_runs = [b for b, _ in pairs]
    probed_runs = [p for _, p in pairs]
    bare_med = statistics.median(s for r in bare_runs for s in r.step_s)
    probed_med = statistics.median(s for r in probed_runs for s in r.step_s)
    overheads = [(p.median / b.median - 1) * 100 for b, p in pairs]
    q1, q2, q3 = quartiles(overheads)
    job_ratio = (
        statistics.median(p.mean_step_s / b.mean_step_s for b, p in pairs if b.mean_step_s and p.mean_step_s)
        if all(b.mean_step_s and p.mean_step_s for b, p in pairs)
        else None
    )
    reference = bare_runs[0].losses
    same_losses = all(r.losses == reference for r in bare_runs + probed_runs)
    bare_vs_probed = all(p.losses == b.losses for b, p in pairs)
    load_after = load_average()

    print()
    print(f"per-pair overhead, %:     {' '.join(f'{o:+.2f}' for o in overheads)}")
    print(
        f"OVERHEAD (median of {len(pairs)} pairs): {q2:+.2f}%   "
        f"IQR {q1:+.2f}% .. {q3:+.2f}% ({q3 - q1:.2f} points), min {min(overheads):+.2f}%, max {max(overheads):+.2f}%"
    )
    cpu = [c for b, p in pairs if (c := cpu_overhead(b, p)) is not None]
    if cpu:
        c1, c2, c3 = quartiles(cpu)
        print(f"per-pair CPU overhead, %: {' '.join(f'{o:+.2f}' for o in cpu)}")
        print(
            f"CPU OVERHEAD (median of {len(cpu)} pairs): {c2:+.2f}%   IQR {c1:+.2f}% .. {c3:+.2f}% "
            f"(ranks' CPU seconds per step, all ranks: bare "
            f"{statistics.median(b.cpu_step_s for b, _ in pairs if b.cpu_step_s) * 1000:.1f} ms, probed "
            f"{statistics.median(p.cpu_step_s for _, p in pairs if p.cpu_step_s) * 1000:.1f} ms)"
        )
    if in_job := in_job_text_of(probed_runs):
        print(f"IN-JOB {in_job}")
    print(f"median step time, bare:   {ms(bare_med)}  ({len(bare_runs)} runs x {len(bare_runs[0].step_s)} steps)")
    print(f"median step time, probed: {ms(probed_med)}")
    print(f"pooled ratio probed/bare: {probed_med / bare_med:.3f}  ({(probed_med / bare_med - 1) * 100:+.2f}%)")
    if job_ratio is not None:
        print(f"job's own mean_step_s ratio (median over pairs; it skips 2 steps): {job_ratio:.3f}")
    print(
        f"wall time per run, median: bare {statistics.median(r.wall_s for r in bare_runs):.1f} s, "
        f"probed {statistics.median(r.wall_s for r in probed_runs):.1f} s"
    )
    print(f"load average before: {load_before}; after: {load_after}")
    print(
        f"losses identical bare vs probed: {'yes' if bare_vs_probed else 'NO'}"
        f" (all {len(pairs) * 2} runs identical: {'yes' if same_losses else 'no'}; "
        f"{len(reference)} steps, last {reference[-1]})"
    )
    baseline = None
    if baseline_pairs:
        base_wall = [(p.median / b.median - 1) * 100 for b, p in baseline_pairs]
        base_cpu = [c for b, p in baseline_pairs if (c := cpu_overhead(b, p)) is not None]
        w1, w2, w3 = quartiles(base_wall)
        print(f"baseline ({args.baseline}), the same {len(baseline_pairs)} repetitions:")
        print(f"  per-pair overhead, %:     {' '.join(f'{o:+.2f}' for o in base_wall)}")
        print(f"  OVERHEAD (median): {w2:+.2f}%   IQR {w1:+.2f}% .. {w3:+.2f}%")
        baseline = {"overhead_pct": base_wall, "overhead_median_pct": w2, "overhead_iqr_pct": [w1, w3]}
        if base_cpu:
            b1, b2, b3 = quartiles(base_cpu)
            print(f"  per-pair CPU overhead, %: {' '.join(f'{o:+.2f}' for o in base_cpu)}")
            print(f"  CPU OVERHEAD (median): {b2:+.2f}%   IQR {b1:+.2f}% .. {b3:+.2f}%")
            baseline.update(cpu_overhead_pct=base_cpu, cpu_overhead_median_pct=b2, cpu_overhead_iqr_pct=[b1, b3])
        if in_job := in_job_text_of([b for _, b in baseline_pairs]):
            print(f"  IN-JOB {in_job}")
            baseline["in_job_ms"] = [b.in_job_ms for _, b in baseline_pairs]
            baseline["in_job_share"] = [b.in_job_share for _, b in baseline_pairs]
        same = all(p.losses == b.losses for b, p in baseline_pairs)
        baseline["losses_identical"] = same
        print(f"  losses identical bare vs baseline: {'yes' if same else 'NO'}")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "pairs": [
                        {
                            "bare_ms": b.median * 1e3,
                            "probed_ms": p.median * 1e3,
                            "overhead_pct": o,
                            "bare_cpu_ms": b.cpu_step_s and b.cpu_step_s * 1e3,
                            "probed_cpu_ms": p.cpu_step_s and p.cpu_step_s * 1e3,
                            "cpu_overhead_pct": cpu_overhead(b, p),
                            "bare_first": i % 2 == 0,
                        }
                        for i, ((b, p), o) in enumerate(zip(pairs, overheads, strict=True))
                    ],
                    "overhead_median_pct": q2,
                    "overhead_iqr_pct": [q1, q3],
                    "cpu_overhead_median_pct": quartiles(cpu)[1] if cpu else None,
                    "cpu_overhead_iqr_pct": [quartiles(cpu)[0], quartiles(cpu)[2]] if cpu else None,
                    "in_job_ms": [r.in_job_ms for r in probed_runs],
                    "in_job_share": [r.in_job_share for r in probed_runs],
                    "in_job_share_from_step_1": [r.in_job_share_from_1 for r in probed_runs],
                    "bare_median_ms": bare_med * 1e3,
                    "probed_median_ms": probed_med * 1e3,
                    "losses_identical": bare_vs_probed,
                    "load_before": load_before,
                    "load_after": load_after,
                    "steps": args.steps,
                    "warmup": args.warmup,
                    "trace_window": args.trace_window,
                    "baseline": baseline,
                },
                indent=2,
            )
            + "\n"
        )
    if not bare_vs_probed:
        sys.exit("probe_overhead: the probes changed the losses")


if __name__ == "__main__":
    main()
