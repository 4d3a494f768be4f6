"""Time from `lorascope hang` to the printed verdict on a planted hang (not a test).

Starts the real 2-rank job (CPU, gloo) under `lorascope run` with the rank-conditional
collective planted, waits until both ranks are stuck in it, then runs `lorascope hang`
REPS times and prints the wall time of each (the anchor: torch's default watchdog waits
30 minutes, and a manual `py-spy dump` of every rank is minutes of an on-call's time).

    python benchmarks/hang_latency.py --reps 5
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from lorascope.rundir.loading.reader import load_run

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stuck(out: Path) -> bool:
    try:
        run = load_run(out)
    except Exception:
        return False
    return len(run.ranks) == 2 and all(
        any(c.pending and c.site and "rank_conditional_collective" in c.site for c in r.collectives)
        for r in run.ranks.values()
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="lorascope-hang-bench-")) / "run"
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lorascope",
            "run",
            "--no-summary",
            "--out",
            str(out),
            "--",
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            str(REPO / "probes" / "train_lora.py"),
            "--steps",
            "20",
            "--fault",
            "rank-conditional-hang",
            "--fault-step",
            "3",
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 300
        while not stuck(out):
            if time.time() > deadline or job.poll() is not None:
                sys.exit("the planted hang did not happen")
            time.sleep(0.5)
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            res = subprocess.run(
                [sys.executable, "-m", "lorascope", "hang", str(out), "--no-html"], capture_output=True, text=True
            )
            times.append(time.perf_counter() - start)
            verdict = next((line for line in res.stdout.splitlines() if line.startswith("verdict:")), res.stderr)
        print(f"lorascope hang, 2 ranks, planted rank-conditional collective: {verdict}")
        print(
            "seconds to verdict: "
            + ", ".join(f"{t:.2f}" for t in times)
            + f"  (median {statistics.median(times):.2f}, goal < 5)"
        )
    finally:
        for proc in [job, *(psutil.Process(job.pid).children(recursive=True) if job.poll() is None else [])]:
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


if __name__ == "__main__":
    main()
