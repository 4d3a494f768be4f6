"""Reading time against stream length, for step numbers in odd orders: a stream that is
twice as long must take about twice as long to read, whatever order its step numbers
come in (issue 13: "time grows with bytes read, not worse").

One rank stream in the real format (the steady step of fixtures/rank-conditional-hang
repeated, as `rundir_scale.py` writes it, without its calls: they are in the call file,
read as columns whatever their steps), its step numbers mapped:

* ``rising``: 1, 2, 3, ... (a run);
* ``falling``: N, N-1, ..., 1 (hostile, or a writer gone wrong; a sorted list's inserts
  made it quadratic until stop 30);
* ``restarting``: 1..50 over and over (a job restarted from a checkpoint, step numbers
  repeating);
* ``falling, step records only``: 100 x N step records and nothing else, falling (what a
  hostile stream packs into the 512 MiB limit: ~5 million steps).

Each is read by `read_process` at a 1,024-rank budget (128 steps), at N and 2N steps;
prints seconds and the ratio (~2 is linear).

    python benchmarks/stream_shapes.py [--steps 2000]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rundir_scale import DROPPED, _line, _records, _template

from lorascope.rundir.format import limits
from lorascope.rundir.loading import reader
from lorascope.rundir.loading.reduce import steps_per_rank

#: name -> (step number of the j-th of n steps, step records only, steps as a multiple of N).
SHAPES: dict[str, tuple[Callable[[int, int], int], bool, int]] = {
    "rising": (lambda j, n: j + 1, False, 1),
    "falling": (lambda j, n: n - j, False, 1),
    "restarting": (lambda j, n: j % 50 + 1, False, 1),
    "falling, step records only": (lambda j, n: n - j, True, 100),
}


def write(path: Path, steps: int, step_of: Callable[[int, int], int], only_steps: bool) -> int:
    """Rank 1's stream of the template, ``steps`` steady steps numbered by ``step_of``
    (``only_steps``: of each step, its step record only)."""
    recs = [r for r in _records(1)[0] if r["k"] != "coll"]
    first, second = [i for i, r in enumerate(recs) if r["k"] == "step"][:2]
    prologue, block = recs[: first + 1], recs[first + 1 : second + 1]
    if only_steps:
        block = block[-1:]
    t1, period = recs[first]["t"], recs[second]["t"] - recs[first]["t"]
    templates = [_template(r) for r in block]
    closes = recs[second]["step"]  # the step record ends the block; the rest: the step before
    with open(path, "w") as f:
        for r in prologue:
            if r["k"] not in DROPPED:
                f.write(_line(r))
        for j in range(steps):
            base = t1 + j * period
            step = step_of(j, steps)
            for r, tmpl in zip(block, templates, strict=True):
                f.write(
                    tmpl.format(
                        t=base + r["t"] - t1,
                        end=base + r.get("end", 0) - t1,
                        step=step + r.get("step", closes) - closes,
                        seq=r.get("seq", 0),
                        rss=r.get("rss", 0),
                        heap=r.get("heap", 0),
                    )
                )
    return path.stat().st_size


def read_seconds(path: Path) -> float:
    """Best of two readings of the stream (CPU seconds)."""
    best = float("inf")
    for _ in range(2):
        start = time.process_time()
        data, _warnings = reader.read_process((1, [(0, path)], steps_per_rank(1024), None), limits.current())
        best = min(best, time.process_time() - start)
        if isinstance(data, str):
            raise SystemExit(f"{path}: {data}")
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="N: the shorter stream's steps (the longer has 2N)")
    args = parser.parse_args()
    print(f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; budget {steps_per_rank(1024)} steps; CPU seconds")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (step_of, only_steps, times_n) in SHAPES.items():
            n = times_n * args.steps
            sizes: list[Any] = []
            times: list[float] = []
            for steps in (n, 2 * n):
                path = Path(tmp) / f"shape-{steps}.0000.jsonl"
                sizes.append(write(path, steps, step_of, only_steps) / 1e6)
                times.append(read_seconds(path))
                path.unlink()
            short, long = times
            print(
                f"{name:26s} {n:,} steps ({sizes[0]:.0f} MB) {short:6.2f} s, "
                f"{2 * n:,} ({sizes[1]:.0f} MB) {long:6.2f} s: x{long / short:.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
