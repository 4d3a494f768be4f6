"""What `lorascope watch` costs the on-call machine (not a test): its CPU, as a share of
one core, and its peak memory, on a synthetic run directory that grows while it runs.

A writer process writes for every rank what a rank of the probes/ job writes in a step
(the stream lines between two steps' ends of a real recorded run, fixtures/diff/r8's
rank 0, that step's calls into the rank's call file and its phase edges and end into the
rank's steps file, with their times made now),
every ``--step-s`` seconds on every rank; one rank stops stepping after a third of the
time (a stall, so the checks have something to say). `lorascope watch` runs under a
pseudo-terminal of 80x24, refreshing every second, for ``--seconds`` after a warm-up;
its CPU time (user + system, from psutil) over that window and its peak RSS (VmHWM)
are printed. Goal (issue 43): < 5% of one core and < 200 MB at 1,024 ranks.

    python benchmarks/watch_cost.py --ranks 1024 --seconds 60 --step-s 1.0
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pty
import re
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from lorascope.rundir.format.callfile import CallFile, calls_path, mem_file, mem_path, step_file, steps_path
from lorascope.rundir.format.layout import CALL, COUNT_OFFSET, HEADER, MEM, STEP, STEP_END
from lorascope.rundir.loading.mem import read_mem
from lorascope.rundir.loading.steps import read_steps

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "fixtures" / "diff" / "r8" / "ranks" / "rank-0"
_T = re.compile(rb'"t":[0-9.]+')


def _template() -> tuple[list[bytes], list[bytes], list[tuple[Any, ...]], list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """The template stream's head (up to its first step's end), one step's lines (those
    after its second step's end up to its third), that step's calls (its call file's
    records of the step, in order), its steps-file records (its phase edges and end) and
    its memory readings."""
    lines = next(TEMPLATE.glob("*.0000.jsonl")).read_bytes().splitlines(keepends=True)
    table = read_steps(next(TEMPLATE.glob("*.steps")), "template", []).records
    ends = table[table["kind"] == STEP_END]
    (t1, t2, t3), step_no = ends["t"][:3].tolist(), int(ends["step"][1])
    times = [json.loads(line)["t"] for line in lines]
    head = [line for line, t in zip(lines, times, strict=True) if t <= t1]
    block = [line for line, t in zip(lines, times, strict=True) if t2 < t <= t3]
    steps = [tuple(r) for r in table[(table["t"] > t2) & (table["t"] <= t3)].tolist()]
    readings = read_mem(next(TEMPLATE.glob("*.mem")), "template", []).records
    mem = [tuple(r) for r in readings[(readings["t"] > t2) & (readings["t"] <= t3)].tolist()]
    data = next(TEMPLATE.glob("*.calls")).read_bytes()
    count = int.from_bytes(data[COUNT_OFFSET : COUNT_OFFSET + 8], "little")
    records = [CALL.unpack_from(data, HEADER.size + i * CALL.size) for i in range(count)]
    return head, block, [r for r in records if r[4] == step_no], steps, mem


def _write(run_dir: Path, ranks: int, step_s: float, seconds: float, stalled: int) -> None:
    """The growing run: every rank's head, then a step every ``step_s`` seconds: the step's
    stream lines appended, its calls, steps-file records and memory readings written as the
    probes do."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 3 * ranks + 256)), hard))
    head, step, calls, step_records, readings = _template()
    paths, files, step_files, mem_files = [], [], [], []
    for r in range(ranks):
        folder = run_dir / "ranks" / f"rank-{r}"
        folder.mkdir(parents=True)
        path = folder / f"node{r // 8}-{10000 + r}.0000.jsonl"
        files.append(CallFile(calls_path(path.with_name(path.name.split(".")[0]))))
        step_files.append(step_file(steps_path(path.with_name(path.name.split(".")[0]))))
        mem_files.append(mem_file(mem_path(path.with_name(path.name.split(".")[0]))))
        start = b"".join(head).replace(b'"rank":0,"world_size":2', f'"rank":{r},"world_size":{ranks}'.encode())
        path.write_bytes(_T.sub(f'"t":{time.time():.6f}'.encode(), start))
        paths.append(path)
    began, n, seq = time.time(), 0, 0
    while time.time() - began < seconds:
        n += 1
        now = time.time()
        block = _T.sub(f'"t":{now:.6f}'.encode(), b"".join(step))
        for r, path in enumerate(paths):
            if r == stalled and now - began > seconds / 3:
                continue
            file = files[r]
            for k, (t0, end, _, nbytes, _, gid, shape, _) in enumerate(calls):
                index = file.begin(now + (t0 - calls[0][0]), seq + k + 1, nbytes, n - 1, gid, shape)
                file.end(index, now + (end - calls[0][0]))
            for t, dur, loss, waited, _, label, kind, _ in step_records:  # its phase edges and its end
                step_files[r].put(
                    now + (t - step_records[0][0]), dur, loss, waited, n if kind == STEP_END else n - 1, label, kind
                )
            for t, *figures, _, device, src, _ in readings:  # rss .. max_alloc, step, device, src, stamp
                mem_files[r].put(now + (t - readings[0][0]), *figures, n - 1, device, src)
            with open(path, "ab") as f:
                f.write(block)
        seq += len(calls)
        time.sleep(max(0.0, step_s - (time.time() - now)))


def _sigint_default() -> None:
    """Ctrl-C's default in watch: a benchmark started in the background of a script (``&``)
    has SIGINT ignored, which watch would inherit and never quit."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _hwm(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--seconds", type=float, default=60.0, help="measured window (after --warm-up)")
    parser.add_argument("--warm-up", type=float, default=10.0)
    parser.add_argument("--step-s", type=float, default=1.0, help="seconds between a rank's steps")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="watch-cost-") as tmp:
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        (run_dir / "manifest.json").write_text(json.dumps({"format": "lorascope-run", "version": 3, "launches": []}))
        total = args.warm_up + args.seconds + 5
        writer = mp.Process(target=_write, args=(run_dir, args.ranks, args.step_s, total, args.ranks // 2 + 3))
        writer.start()
        while not (run_dir / "ranks" / f"rank-{args.ranks - 1}").exists():
            time.sleep(0.1)
        master, slave = pty.openpty()
        env = {**os.environ, "COLUMNS": "80", "LINES": "24", "TERM": "xterm-256color"}
        watch = subprocess.Popen(
            [sys.executable, "-m", "lorascope", "watch", str(run_dir)],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            cwd=REPO,
            preexec_fn=_sigint_default,
        )
        os.close(slave)
        screen: list[bytes] = []

        def drain() -> None:
            while True:
                try:
                    data = os.read(master, 65536)
                except OSError:
                    return
                if not data:
                    return
                screen.append(data)
                del screen[:-50]

        threading.Thread(target=drain, daemon=True).start()
        proc = psutil.Process(watch.pid)
        time.sleep(args.warm_up)
        cpu0, t0 = proc.cpu_times(), time.monotonic()
        time.sleep(args.seconds)
        cpu1, t1 = proc.cpu_times(), time.monotonic()
        peak = _hwm(watch.pid)
        watch.send_signal(signal.SIGINT)
        code = watch.wait(timeout=30)
        writer.join()
        streams = sum(p.stat().st_size for p in (run_dir / "ranks").rglob("*") if p.is_file())
    used = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    share = used / (t1 - t0) * 100
    _, lines, calls, steps, mem = _template()
    per_step = len(b"".join(lines)) + len(calls) * CALL.size + len(steps) * STEP.size + len(mem) * MEM.size
    print(f"ranks {args.ranks}, a step every {args.step_s} s a rank ({per_step:,} bytes), window {t1 - t0:.0f} s")
    print(
        f"run directory at the end: {streams / 2**20:.0f} MiB ({per_step * args.ranks / args.step_s / 2**20:.1f} MiB/s)"
    )
    print(f"watch CPU: {share:.1f}% of one core ({used:.2f} CPU-s); peak RSS {peak / 2**20:.0f} MiB; exit {code}")
    print(f"goal: < 5% of one core and < 200 MB: {'met' if share < 5 and peak < 200 * 10**6 else 'NOT met'}")


if __name__ == "__main__":
    main()
