#!/usr/bin/env python3
"""Bytes a rank writes per step, and what a long run holds on disk (a script, not a test).

Runs the CPU test job (``probes/train_lora.py``, 2 ranks) under ``lorascope run`` for
``--steps`` steps with a small call-file ring (``LORASCOPE_CALL_SLOTS``, default
``1024,4096``: the ring comes round within the run, as it does after ~5,000 steps with
the default slots), then prints for each rank, over the steps past ``--from-step``:
the stream's bytes a step by record kind, the steps file's (its steps and phase edges)
and the memory file's (its readings), the call file's size, the bytes per rank-step in all, and the projections for a
1,000,000-step run (per rank) and a 1,024-rank x 10,000-step run (in all), with the
default slots (layout.DEFAULT_HEAD, DEFAULT_RING).

    python benchmarks/rundir_bytes.py --steps 150
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lorascope.rundir.format.layout import (  # noqa: E402
    CALL,
    COUNT_OFFSET,
    DEFAULT_HEAD,
    DEFAULT_RING,
    MEM,
    STEP,
    file_size,
)
from lorascope.rundir.loading.mem import read_mem  # noqa: E402
from lorascope.rundir.loading.steps import read_steps  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--from-step", type=int, default=60, help="steady state from this step (default 60)")
    p.add_argument("--slots", default="1024,4096", help="HEAD,RING of the call file for this run")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(REPO / "probes" / "train_lora.py"), "--steps", str(args.steps)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "LORASCOPE_CALL_SLOTS": args.slots}
        subprocess.run([sys.executable, "-m", "lorascope", "run", "--no-summary", "--out", str(out), "--", *cmd],
                       env=env, check=True, capture_output=True, timeout=1800)  # fmt: skip
        steps = args.steps - args.from_step - 5  # the last steps' records come with the end
        for rank_dir in sorted((out / "ranks").iterdir()):
            sizes: collections.Counter[str] = collections.Counter()
            calls = 0
            for stream in rank_dir.glob("*.jsonl"):
                for line in stream.read_bytes().splitlines(keepends=True):
                    rec = json.loads(line)
                    step = rec.get("step")
                    if isinstance(step, int) and args.from_step <= step < args.steps - 5:
                        sizes[rec["k"]] += len(line)
            for path in rank_dir.glob("*.calls"):
                calls = int.from_bytes(path.read_bytes()[COUNT_OFFSET : COUNT_OFFSET + 8], "little")
            stream_step = sum(sizes.values()) / steps
            in_file = 0
            for path in rank_dir.glob("*.steps"):
                numbers = read_steps(path, rank_dir.name, []).records["step"]
                in_file += int(((numbers >= args.from_step) & (numbers < args.steps - 5)).sum())
            file_step = in_file * STEP.size / steps
            readings = 0
            for path in rank_dir.glob("*.mem"):
                numbers = read_mem(path, rank_dir.name, []).records["step"]
                readings += int(((numbers >= args.from_step) & (numbers < args.steps - 5)).sum())
            mem_step = readings * MEM.size / steps
            per_step = stream_step + file_step + mem_step
            print(f"{rank_dir.name}: {stream_step:.0f} B a step of stream records past step {args.from_step}, by kind:")
            for kind, size in sizes.most_common():
                print(f"  {kind:<12} {size / steps:7.0f} B")
            print(f"  steps file   {file_step:7.0f} B ({in_file / steps:.1f} steps and phase edges a step)")
            print(f"  memory file  {mem_step:7.0f} B ({readings / steps:.1f} readings a step)")
            print(f"  in all past the ring: {per_step:.0f} B a rank-step")
            calls_per_step = calls / args.steps
            ring_bytes = file_size(DEFAULT_HEAD, DEFAULT_RING)
            ring_steps = (DEFAULT_HEAD + DEFAULT_RING) / calls_per_step
            print(
                f"  calls: {calls_per_step:.1f} a step, {calls_per_step * CALL.size:.0f} B a step in the call file "
                f"until its default ring is full (~{ring_steps:,.0f} steps, {ring_bytes / 2**20:.1f} MiB), then none"
            )
            million = ring_bytes + per_step * 1_000_000
            print(f"  1,000,000 steps: {million / 2**30:.2f} GiB for this rank")
            total = 1024 * (min(ring_bytes, calls_per_step * CALL.size * 10_000) + per_step * 10_000)
            print(f"  1,024 ranks x 10,000 steps: {total / 2**30:.1f} GiB in all")


if __name__ == "__main__":
    main()
