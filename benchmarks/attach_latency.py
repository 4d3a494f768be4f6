"""What `lorascope attach` costs a running job, and how long it takes (not a test).

Starts the real job (CPU, gloo, DeepSpeed ZeRO-3, ``--nproc`` ranks) WITHOUT lorascope,
lets it train, then runs `lorascope attach --launcher PID --json` and prints, per rank:
how long gdb held the process stopped (``stopped_ms``: from just before gdb's attach
to its script's end, an upper bound), the main thread's time in the injected
script (``pause_ms``: the probes' start), and the time from the request to the rank's
result (``took_ms``); the wall time of the whole command (every rank, in parallel); and
the job's own view: rank 0's step times (from ``--print-losses``, timestamped here)
before the attach, during it, and after it. With ``--hung`` the job is hung first
(``--fault rank-conditional-hang``): gdb's direct path, and the time to a verdict.

    python benchmarks/attach_latency.py
    python benchmarks/attach_latency.py --nproc 2 --hung
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--warm-steps", type=int, default=15, help="steps the job makes before the attach")
    parser.add_argument("--hung", action="store_true", help="attach to a job already hung")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lorascope-attach-bench-"))
    fault = ["--fault", "rank-conditional-hang", "--fault-step", str(args.warm_steps)] if args.hung else []
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(args.nproc),
        "--master_port",
        str(free_port()),
        str(REPO / "probes" / "train_lora.py"),
        "--steps",
        "100000",
        "--print-losses",
        "--pg-timeout",
        "900",
        *fault,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    stamps: list[tuple[int, float]] = []

    def read() -> None:
        assert job.stdout is not None
        for line in job.stdout:
            found = re.match(r"step (\d+) loss", line)
            if found:
                stamps.append((int(found[1]), time.perf_counter()))

    threading.Thread(target=read, daemon=True).start()
    try:
        while not stamps or stamps[-1][0] < args.warm_steps - (1 if args.hung else 0):
            if job.poll() is not None:
                sys.exit("the job ended before the attach")
            time.sleep(0.2)
        time.sleep(3.0 if args.hung else 0.0)
        began = time.perf_counter()
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "lorascope",
                "attach",
                "--out",
                str(work / "run"),
                "--launcher",
                str(job.pid),
                "--json",
            ],
            capture_output=True,
            text=True,
        )
        ended = time.perf_counter()
        if res.returncode != 0:
            sys.exit(f"attach failed:\n{res.stdout}{res.stderr}")
        entry = json.loads(res.stdout)
        print(
            f"attach of {args.nproc} ranks ({'hung job' if args.hung else 'training job'}): {ended - began:.2f} s wall"
        )
        for p in entry["processes"]:
            print(
                f"  rank {p['rank']}: {' -> '.join(p['how'])}; stopped by gdb <= {p['stopped_ms']:.0f} ms, "
                f"main thread in the bootstrap {p['pause_ms']:.0f} ms, request to result {p['took_ms']:.0f} ms"
            )
        if args.hung:
            t0 = time.perf_counter()
            verdict = subprocess.run(
                [sys.executable, "-m", "lorascope", "hang", str(work / "run"), "--no-html"],
                capture_output=True,
                text=True,
            )
            print(f"hang verdict in {time.perf_counter() - t0:.2f} s: {verdict.stdout.strip().splitlines()[-2:-1]}")
            return
        time.sleep(8.0)
        durations = [(b[0], b[1] - a[1]) for a, b in zip(stamps, stamps[1:], strict=False)]
        before = [d for (n, d), (_, t) in zip(durations, stamps[1:], strict=True) if t < began]
        during = [d for (n, d), (_, t) in zip(durations, stamps[1:], strict=True) if began <= t <= ended + 0.5]
        after = [d for (n, d), (_, t) in zip(durations, stamps[1:], strict=True) if t > ended + 0.5]
        print(
            f"rank 0's steps: median before {statistics.median(before[-10:]) * 1e3:.0f} ms; "
            f"during the attach {', '.join(f'{d * 1e3:.0f}' for d in during)} ms; "
            f"median after {statistics.median(after) * 1e3:.0f} ms ({len(after)} steps)"
        )
    finally:
        try:
            tree = [job.pid] + [c.pid for c in psutil.Process(job.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        job.wait()


if __name__ == "__main__":
    main()
