"""Report at scale: a synthetic run of RANKS ranks x STEPS steps, rendered to HTML.

Prints the time to build the report data, the time to render the page and the page size;
with --browser, also the time headless Chromium takes to open the page and draw every
chart. The run is built in memory as the reader's own RunData (writing and re-reading
millions of records would measure the reader, not the report). Per rank: a memory sample at
three points of every step, a step record, two collectives per step, an eval phase every
500 steps; rank 0 holds more memory, rank 17 is a straggler, and at the end rank 0 enters
an all_reduce that the others answer with a barrier (a planted hang to highlight).

    python benchmarks/report_scale.py [--ranks 64] [--steps 10000] [--out /tmp/scale.html] [--browser]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from lorascope.detect.registry import run_detectors
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.report.data import build_report_data
from lorascope.report.render import render
from lorascope.rundir.reader import Collective, RankData, RunData, recount

T0 = 1_800_000_000.0
MIB = 2**20


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
        dur = (0.25 + 0.02 * math.sin(step / 50 + rank)) * slow
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
                "loss": 2.0 * math.exp(-step / 3000) + 0.01 * math.sin(step + rank),
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


def browser_load(page_path: Path) -> tuple[float, float, dict[str, int]]:
    """In headless Chromium: seconds from navigation until the page's text is shown
    (DOMContentLoaded; charts draw after it), until every chart is drawn, and the
    milliseconds each chart took."""
    from playwright.sync_api import sync_playwright

    from tests.helpers import CHROMIUM_ARGS, chromium_path

    exe = chromium_path()
    if exe is None:
        raise SystemExit("--browser needs chromium on PATH")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        started = time.perf_counter()
        page.goto(page_path.resolve().as_uri())
        page.wait_for_selector("body[data-charts-drawn]", state="attached", timeout=60_000)
        elapsed = time.perf_counter() - started
        draw_ms = page.evaluate("window.lorascopeReport.drawMs")
        text_ms = page.evaluate("performance.getEntriesByType('navigation')[0].domContentLoadedEventEnd")
        browser.close()
    return text_ms / 1000, elapsed, draw_ms


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--out", type=Path, default=Path("/tmp/lorascope-report-scale.html"))
    parser.add_argument("--browser", action="store_true", help="also time opening the page in headless Chromium")
    args = parser.parse_args()
    t = time.perf_counter()
    run = synthetic_run(args.ranks, args.steps)
    bundle = EvidenceBundle(path=run.path, run=run)
    made = time.perf_counter() - t
    t = time.perf_counter()
    data = build_report_data(bundle, run_detectors(bundle))
    built = time.perf_counter() - t
    t = time.perf_counter()
    page = render(data).encode()
    rendered = time.perf_counter() - t
    args.out.write_bytes(page)
    records = sum(len(r.mem) + len(r.steps) + len(r.collectives) for r in run.ranks.values())
    print(f"synthetic run: {args.ranks} ranks x {args.steps} steps, {records:,} records (made in {made:.1f} s)")
    print(
        f"build_report_data: {built:.2f} s   render: {rendered:.2f} s   page: {len(page) / 2**20:.2f} MiB"
        f"  -> {args.out}"
    )
    if args.browser:
        text_s, elapsed, draw_ms = browser_load(args.out)
        per_chart = ", ".join(f"{name.removeprefix('chart-')} {ms}" for name, ms in sorted(draw_ms.items()))
        print(
            f"headless Chromium: text shown after {text_s:.2f} s, every chart drawn after {elapsed:.2f} s "
            f"(ms per chart: {per_chart})"
        )
    return 0 if len(page) < 5 * 2**20 else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.helpers
    sys.exit(main())
