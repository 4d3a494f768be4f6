"""Report at scale: a synthetic run of RANKS ranks x STEPS steps, rendered to HTML.

Prints, per size, the time to build the report data, the time to render the page and the
page size; with --browser, also the time headless Chromium takes to open the page and draw
every chart, best of three, and the CPU seconds of the page's main thread (the goal: under
5 MB, drawn in under 2 s at 1,024 ranks x 10,000 steps; on a machine shared with other jobs
the wall time waits for a core, and the main thread's CPU time is the page's own cost).

The per-step charts (step time, loss, time in collectives, memory; their bands, outliers
and heatmaps) are built from per-step series of all STEPS steps, computed lazily rank by
rank (:class:`Formula`), as compact per-rank summaries would hand them to
``build_report_data(per_step=...)``. The records behind the other charts (memory samples,
collectives, phases; the detectors read them) are built in memory as the reader's own
RunData for the first --record-steps steps only: 1,024 ranks x 10,000 steps of records
would not fit in memory, and would measure the reader, not the report. Per rank: a memory
sample at three points of every step, a step record, two collectives per step, an eval
phase every 500 steps; rank 0 holds more memory, rank 17 is a straggler (its peers wait
for it in their collectives), rank 300 has one slow step (step 5,000), and at the end rank
0 enters an all_reduce that the others answer with a barrier (a planted hang to highlight).

    python benchmarks/report_scale.py [--ranks 64,256,1024] [--steps 10000] [--record-steps 200]
        [--out /tmp/scale-RANKS.html] [--browser]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import overload

from lorascope.detect.registry import run_detectors
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.report.data import build_report_data
from lorascope.report.render import render
from lorascope.report.spread import PerStep
from lorascope.rundir.loading.reader import Collective, RankData, RunData, recount

T0 = 1_800_000_000.0
MIB = 2**20


def step_time(rank: int, step: int) -> float:
    """Seconds of one step (steps from 1): a slow wave, the straggler 1.3x, one slow step."""
    dur = (0.25 + 0.02 * math.sin((step - 1) / 50 + rank)) * (1.3 if rank == 17 else 1.0)
    return dur + (3.0 if (rank, step) == (300, 5_000) else 0.0)


def wait_time(rank: int, step: int) -> float:
    """Seconds in collectives: everyone but the straggler waits for it."""
    slowest = step_time(17, step) if rank != 17 else step_time(rank, step)
    return max(0.004, slowest - step_time(rank, step) + 0.004)


def memory_mib(rank: int, step: int) -> float:
    """The highest CUDA allocated of a step (MiB), as the samples below have it."""
    return (
        30_000
        + (6_000 if rank == 0 else 0)
        + 2_000 * (0.5 + 0.5 * math.sin((step - 1) / 7))
        + (rank * 3 + step - 1) % 97
    )


def loss(rank: int, step: int) -> float:
    return 2.0 * math.exp(-(step - 1) / 3000) + 0.01 * math.sin(step - 1 + rank)


class Formula(Sequence[tuple[int, float]]):
    """One rank's per-step series, (step, f(rank, step)) for steps 1..steps, computed when read."""

    def __init__(self, rank: int, steps: int, f: Callable[[int, int], float]) -> None:
        self.rank, self.steps, self.f = rank, steps, f

    def __len__(self) -> int:
        return self.steps

    @overload
    def __getitem__(self, i: int) -> tuple[int, float]: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[tuple[int, float]]: ...
    def __getitem__(self, i: int | slice) -> tuple[int, float] | Sequence[tuple[int, float]]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.steps))]
        j = i + self.steps if i < 0 else i
        if not 0 <= j < self.steps:
            raise IndexError(i)
        return (j + 1, self.f(self.rank, j + 1))

    def __iter__(self) -> Iterator[tuple[int, float]]:
        f, rank = self.f, self.rank
        return ((s, f(rank, s)) for s in range(1, self.steps + 1))


def synthetic_per_step(ranks: int, steps: int) -> PerStep:
    series = lambda f: {r: Formula(r, steps, f) for r in range(ranks)}
    return PerStep(
        step_time=series(step_time),
        loss=series(loss),
        wait=series(wait_time),
        memory={"CUDA allocated": series(memory_mib)},
    )


def synthetic_rank(rank: int, world: int, steps: int) -> RankData:
    start = {
        "k": "start",
        "t": T0,
        "rank": rank,
        "world_size": world,
        "local_rank": rank % 8,
        "pid": 1000 + rank,
        "host": f"node{rank // 8}",
        "argv": ["train.py", "--steps", str(steps)],
        "versions": {"torch": "2.13.0"},
        "device": f"cuda:{rank % 8}",
    }
    data = RankData(rank=rank, start=start, files=[f"ranks/rank-{rank}/node-{1000 + rank}.0000.jsonl"])
    data.groups[0] = {"gid": 0, "name": "default_pg", "ranks": list(range(world)), "backend": "nccl"}
    slow = 1.3 if rank == 17 else 1.0
    t, seq = T0 + 5.0, 0
    base = (30_000 + (6_000 if rank == 0 else 0)) * MIB
    for step in range(steps):
        dur = step_time(rank, step + 1)
        wave = int(2_000 * MIB * (0.5 + 0.5 * math.sin(step / 7)))
        for frac, src, extra in ((0.0, "forward.begin", 0), (0.5, "backward.begin", wave), (0.95, "step", 0)):
            alloc = base + extra + (rank * 3 + step) % 97 * MIB
            data.mem.append(
                {
                    "k": "mem",
                    "t": t + frac * dur,
                    "src": src,
                    "step": step,
                    "rss": 4_000 * MIB,
                    "cuda": {
                        "device": rank % 8,
                        "alloc": alloc,
                        "reserved": alloc + 2_000 * MIB,
                        "max_alloc": alloc + 500 * MIB,
                    },
                }
            )
        for op, nbytes in (("all_gather_into_tensor", 1 << 20), ("reduce_scatter_tensor", 1 << 22)):
            seq += 1
            data.collectives.append(
                Collective(
                    seq=seq,
                    group="default_pg",
                    op=op,
                    bytes=nbytes,
                    dtype="bfloat16",
                    is_async=False,
                    site="engine.py:120 in step",
                    step=step,
                    start=t + 0.6 * dur,
                    end=t + 0.6 * dur + 0.002 * slow,
                )
            )
        if step % 500 == 499:
            data.phases += [
                {"k": "phase", "t": t + dur, "name": "eval", "edge": "begin", "step": step + 1},
                {"k": "phase", "t": t + dur + 2.0, "name": "eval", "edge": "end", "step": step + 1},
            ]
            t += 2.0
        t += dur
        data.steps.append(
            {
                "k": "step",
                "t": t,
                "step": step + 1,
                "dur": round(dur, 6),
                "loss": loss(rank, step + 1),
                "src": "deepspeed",
            }
        )
    hang_op = "all_reduce" if rank == 0 else "barrier"
    data.collectives.append(
        Collective(
            seq=seq + 1,
            group="default_pg",
            op=hang_op,
            bytes=4 if rank == 0 else 0,
            dtype="float32" if rank == 0 else None,
            is_async=False,
            site="train.py:171 in evaluate" if rank == 0 else "train.py:180 in main",
            step=steps,
            start=t + 0.1,
        )
    )
    data.last_time = t + 0.1
    return recount(data)


def synthetic_run(ranks: int, steps: int) -> RunData:
    manifest = {
        "format": "lorascope-run",
        "version": 1,
        "launches": [
            {
                "id": "node0-1",
                "host": "node0",
                "pid": 1,
                "cwd": "/job",
                "start": T0,
                "end": None,
                "exit_status": None,
                "command": ["srun", "torchrun", "--nproc_per_node", "8", "train.py"],
            }
        ],
    }
    return RunData(
        path=Path("synthetic"),
        manifest=manifest,
        ranks={r: synthetic_rank(r, ranks, steps) for r in range(ranks)},
        warnings=[],
    )


def browser_load(page_path: Path) -> tuple[float, float, float, dict[str, int]]:
    """In headless Chromium: seconds from navigation until the page's text is shown
    (DOMContentLoaded; charts draw after it), until every chart is drawn, the CPU seconds
    of the page's main thread over that time (Chrome's own ``ThreadTime``: on a machine
    shared with other jobs the wall time is mostly waiting for a core; the main thread's CPU
    time is what the page costs, and about its wall time on an idle core), and the
    milliseconds each chart took."""
    from playwright.sync_api import sync_playwright

    from tests.helpers import CHROMIUM_ARGS, chromium_path

    exe = chromium_path()
    if exe is None:
        raise SystemExit("--browser needs chromium on PATH")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        cdp = page.context.new_cdp_session(page)
        cdp.send("Performance.enable", {"timeDomain": "threadTicks"})
        started = time.perf_counter()
        page.goto(page_path.resolve().as_uri())
        page.wait_for_selector("body[data-charts-drawn]", state="attached", timeout=60_000)
        elapsed = time.perf_counter() - started
        metrics = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
        draw_ms = page.evaluate("window.lorascopeReport.drawMs")
        text_ms = page.evaluate("performance.getEntriesByType('navigation')[0].domContentLoadedEventEnd")
        browser.close()
    if errors:
        raise SystemExit(f"the page raised: {errors[0]}")
    return text_ms / 1000, elapsed, float(metrics["ThreadTime"]), draw_ms


def one_size(ranks: int, steps: int, record_steps: int, out: Path, browser: bool) -> bool:
    """Build, render (and open) the report of one size; True when the page meets the goal."""
    t = time.perf_counter()
    run = synthetic_run(ranks, min(steps, record_steps))
    bundle = EvidenceBundle(path=run.path, run=run)
    per_step = synthetic_per_step(ranks, steps)
    made = time.perf_counter() - t
    t = time.perf_counter()
    data = build_report_data(bundle, run_detectors(bundle), per_step=per_step)
    built = time.perf_counter() - t
    t = time.perf_counter()
    page = render(data).encode()
    rendered = time.perf_counter() - t
    out.write_bytes(page)
    records = sum(len(r.mem) + len(r.steps) + len(r.collectives) for r in run.ranks.values())
    print(
        f"{ranks} ranks x {steps:,} steps ({ranks * steps * 4:,} per-step points; records for "
        f"{min(steps, record_steps)} steps: {records:,}, made in {made:.1f} s)"
    )
    print(
        f"  build_report_data: {built:.2f} s   render: {rendered:.2f} s   page: {len(page) / 2**20:.2f} MiB  -> {out}"
    )
    ok = len(page) < 5 * 2**20
    if browser:
        runs = [browser_load(out) for _ in range(3)]
        text_s, elapsed, cpu, draw_ms = min(runs, key=lambda r: r[1])
        per_chart = ", ".join(f"{name.removeprefix('chart-')} {ms}" for name, ms in sorted(draw_ms.items()))
        print(
            f"  headless Chromium (best of 3): text shown after {text_s:.2f} s, every chart drawn after "
            f"{elapsed:.2f} s, main-thread CPU {cpu:.2f} s (ms per chart: {per_chart})"
        )
        ok = ok and min(elapsed, cpu) < 2.0
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="64,256,1024", help="comma-separated sizes")
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--record-steps", type=int, default=200, help="steps of in-memory records (see above)")
    parser.add_argument("--out", default="/tmp/lorascope-report-scale-RANKS.html", help="RANKS is replaced")
    parser.add_argument("--browser", action="store_true", help="also time opening the page in headless Chromium")
    args = parser.parse_args()
    results = [
        one_size(n, args.steps, args.record_steps, Path(args.out.replace("RANKS", str(n))), args.browser)
        for n in (int(x) for x in args.ranks.split(","))
    ]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.helpers
    sys.exit(main())
