"""`lorascope hang` on a 1,024-rank job spread over 128 hosts: the time to the verdict and
whether the output fits one screen (not a test).

Writes a run directory as the probes write it (the real writer; 1,024 ranks on hosts
node000-node127, 8 each, none of them this host): every rank's start, group, call sites,
steps (their phase edges and memory readings in the steps and memory files) and
collectives, all of them waiting in the same all_gather except one rank stuck
in its data loader. Then runs `lorascope hang` while a responder thread stands in for
the ranks' probe threads: each rank answers the dump request in the run directory at a
random moment within the probes' one-second look (a ``dump`` record with the request's
id, its stacks and the collectives it made, then its flight-recorder dump, a pickle of plain data as torch writes
it, of torch's size by default, with its tail as the probes write it, and the
``flight_dump`` record). Prints the verdict's wall time (the goal: under 2 s
here), its CPU time and the bytes it read a rank, when the request was out, how long the
answers took from there (the responder writes every rank's answer on this machine's cores,
and may take longer than the ranks' one second), how long after the last answer the
verdict came, hang's own time (the verdict's less the answering), and whether the text
output fits 24 lines; then again with two ranks that never answer (``--wait 1.2``: the wait bounds it;
a wait of just the probes' one-second look would leave the last answers, the responder's
poll later, to chance), and checks that ``--json`` keeps every rank.

    python benchmarks/hang_scale.py                  # 1,024 ranks
    python benchmarks/hang_scale.py --steps 1000     # dumps of 2,000 collectives (50 steps hold 100)
    python benchmarks/hang_scale.py --no-tails       # dumps as probes <= 0.3.0 wrote them
    python benchmarks/hang_scale.py --ranks 128 --hosts 16 --steps 10000 --sums   # a long run's cost
    python benchmarks/hang_scale.py --ranks 4096 --hosts 512
    python benchmarks/hang_scale.py --read-all       # every rank read whole (no alike ranks told by others)
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's tests.helpers

from lorascope.probes.flight import flight_tail
from lorascope.rundir.format.schema import DUMP_REQUEST
from lorascope.rundir.format.writer import Stream, record_launch, stream_prefix
from lorascope.rundir.loading.reader import load_run
from tests.helpers import Calls, Steps

SCREEN_LINES = 24
TRAIN = "/job/train.py"
FORWARD = f"{TRAIN}:88 in forward"
PHASES = ("forward", "backward", "step")
STEP_CALLS = (("all_gather_into_tensor", 32768, FORWARD), ("reduce_scatter_tensor", 65536, f"{TRAIN}:120 in step"))


def _stacks(stuck: bool) -> str:
    """A thread dump as the probes write it: the main thread in the data loader (the odd
    rank), or inside the collective's wait."""
    inner = (
        f'  File "{TRAIN}", line 61, in fetch\n  File "/usr/lib/python3.11/queue.py", line 180, in get\n'
        if stuck
        else f'  File "{TRAIN}", line 88, in forward\n'
        '  File "/env/lib/python3.11/site-packages/deepspeed/comm/torch.py", line 380, in all_gather_into_tensor\n'
    )
    return f'Thread MainThread:\n  File "{TRAIN}", line 140, in <module>\n  File "{TRAIN}", line 130, in train\n{inner}'


class Job:
    """The run directory's ranks: where each is, and what it answers with."""

    def __init__(
        self,
        out: Path,
        ranks: int,
        hosts: int,
        steps: int,
        odd: int,
        flight: tuple[int, int] = (2000, 30),
        tails: bool = True,
        sums: bool = False,
    ) -> None:
        self.out, self.ranks, self.odd, self.tails = out, ranks, odd, tails
        #: The pickled flight-recorder dump and its tail (None: not written), the odd rank's and the others'.
        self.flights: dict[bool, tuple[bytes, bytes | None]] = {}
        self.flight_entries, flight_frames = flight
        #: A flight-recorder entry's frames, innermost first: the job's line, then (a deeper
        #: stack, as DeepSpeed's calls have) library frames out to the script; each entry's
        #: list holds the same frame objects, as torch's dumps do (a frame is written once).
        self.frames = [{"name": "forward", "filename": TRAIN, "line": 88}] + [
            {
                "name": f"wrapper{i}",
                "filename": f"/env/lib/python3.11/site-packages/deepspeed/runtime/m{i}.py",
                "line": i,
            }
            for i in range(flight_frames - 1)
        ]
        self.per_host = max(1, ranks // hosts)
        self.last_seq = steps * len(STEP_CALLS)
        self.prefixes: dict[int, Path] = {}
        now = time.time()
        record_launch(out, "node000-4242", ["torchrun", TRAIN], start=now - 600, end=None, exit_status=None)
        for n in range(ranks):
            host = f"node{n // self.per_host:03d}"
            prefix = self.prefixes[n] = stream_prefix(out, n, host, 10_000 + n)
            stream = Stream(prefix)
            t = now - 300 + n * 1e-4

            def write(kind: str, stream: Stream = stream, **fields: Any) -> None:
                nonlocal t
                t += 0.01
                stream.write({"k": kind, "t": t, **fields})

            write(
                "start", rank=n, world_size=ranks, local_rank=n % self.per_host, pid=10_000 + n, host=host,
                argv=[TRAIN], versions={"torch": "2.13.0"}, device="cpu",
            )  # fmt: skip
            write("group", gid=0, name="default_pg", ranks=list(range(ranks)), backend="gloo")
            for _, _, site in STEP_CALLS:
                write("site", site=site, line="x = step(batch)", conditions=[])
            calls = Calls(stream, prefix, t)
            files = Steps(stream, prefix, t)
            seq = 0
            for step in range(1, steps + 1):
                t += 0.01
                files.reading({"t": t, "src": "forward.begin", "step": step, "rss": 3 << 30})
                for phase in PHASES:
                    files.phase(t, phase, "begin", step)
                    files.phase(t + 0.005, phase, "end", step)
                for op, nbytes, site in STEP_CALLS:
                    seq += 1
                    last = step == steps and op == STEP_CALLS[0][0]
                    if n == odd and last:
                        break  # the odd rank never gets to its last step's gather
                    t += 0.01
                    began = t
                    if not last:
                        t += 0.01
                    calls.call(
                        began, seq, step=step, nbytes=nbytes, end=None if last else t, op=op, dtype="float32", site=site
                    )
                else:
                    files.step(t, step, 0.5, 2.0, "deepspeed")
                    if sums:  # as the probes write each step once the call file's ring went round
                        write(
                            "calls_step",
                            step=step,
                            groups=[[0, op, 1, nbytes, 10.0, 10.0, 0] for op, nbytes, _ in STEP_CALLS],
                        )
                    continue
                break
            calls.close()
            files.file.close()
            files.mem.close()
            stream.close()
        self.pending_seq = self.last_seq - 1  # the last step's gather

    def answer(self, n: int, request: str) -> None:
        """What rank N's probe thread writes for a request: its dump, its flight-recorder dump."""
        prefix = self.prefixes[n]
        odd = n == self.odd
        pending = [] if odd else [
            {"group": "default_pg", "seq": self.pending_seq, "op": STEP_CALLS[0][0], "bytes": STEP_CALLS[0][1],
             "site": FORWARD, "since": 30.0}
        ]  # fmt: skip
        done = self.pending_seq - 1
        if odd not in self.flights:  # every rank's is the same but the odd one's: built and pickled once
            entries = [
                {"record_id": s, "pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": s,
                 "p2p_seq_id": 0, "profiling_name": f"gloo:{'all_gather' if s % 2 else 'reduce_scatter'}",
                 "input_sizes": [[8192]], "output_sizes": [[8192 * self.ranks]], "input_dtypes": ["Float"],
                 "output_dtypes": ["Float"], "state": "scheduled", "retired": s <= done, "is_p2p": False,
                 "frames": list(self.frames)}
                for s in range(max(1, self.pending_seq - self.flight_entries + 1), self.pending_seq + (0 if odd else 1))
            ]  # fmt: skip
            flight = {
                "version": "2.10",
                "pg_config": {"0": {"name": "default_pg", "desc": "default_pg", "ranks": f"[0..{self.ranks - 1}]"}},
                "pg_status": {"0": {"last_enqueued_collective": entries[-1]["collective_seq_id"],
                                    "last_started_collective": -1, "last_completed_collective": done}},
                "entries": entries,
            }  # fmt: skip
            whole = pickle.dumps(flight, protocol=2)
            self.flights[odd] = whole, pickle.dumps(flight_tail(flight), protocol=2) if self.tails else None
        whole, tail = self.flights[odd]
        reason = f"request-{int(time.time())}"
        path = prefix.with_name(f"{prefix.name}.flight.{reason}.pickle")
        path.write_bytes(whole)
        tail_path = path.with_name(f"{prefix.name}.flight.{reason}.tail.pickle")
        if tail is not None:
            tail_path.write_bytes(tail)
        t = time.time()
        dump = {
            "reason": "request", "request": request, "step": 40, "stacks": _stacks(odd), "pending": pending,
            "made": {"default_pg": done if odd else self.pending_seq}, "mem": None, "since_progress": 30.0,
            "k": "dump", "t": t,
        }  # fmt: skip
        flight_rec = {
            "file": path.name, "reason": reason, "bytes": len(whole), "k": "flight_dump", "t": t,
            **({"tail": tail_path.name} if tail is not None else {}),
        }  # fmt: skip
        with open(prefix.with_name(f"{prefix.name}.0000.jsonl"), "a") as f:
            f.write(json.dumps(dump) + "\n" + json.dumps(flight_rec) + "\n")


#: Threads writing the ranks' answers.
RESPONDERS = 8


def responder(job: Job, silent: set[int], stop: threading.Event, answered: list[tuple[float, float]]) -> None:
    """The ranks' probe threads: each answers a new request within its one-second look
    (``answered``: when the request was seen, when the last answer was written)."""
    path = job.out / DUMP_REQUEST
    seen = path.stat().st_ino if path.exists() else None
    while not stop.is_set():
        try:
            st = path.stat()
        except FileNotFoundError:
            time.sleep(0.01)
            continue
        if st.st_ino == seen:
            time.sleep(0.01)
            continue
        seen = st.st_ino
        request = json.loads(path.read_text())["id"]
        began = time.time()
        order = sorted((random.random(), n) for n in range(job.ranks) if n not in silent)
        job.answer(order[0][1], request)  # the flight-recorder dumps are built once, then shared
        # several threads, as the ranks answer each on its own (a file's creation here takes ~0.3 ms)
        threads = [
            threading.Thread(target=_answer, args=(job, request, began, order[1 + k :: RESPONDERS]))
            for k in range(RESPONDERS)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        answered.append((began, time.time()))


def _answer(job: Job, request: str, began: float, ranks: list[tuple[float, int]]) -> None:
    """Each of ``ranks`` (its moment after ``began``, its number) answers ``request`` then."""
    for delay, n in ranks:
        time.sleep(max(0.0, began + delay - time.time()))
        job.answer(n, request)


#: `lorascope hang`, saying at its exit how many bytes it read (``rchar`` of /proc/self/io,
#: Linux): the run directory's read traffic, which on a shared filesystem is the network's.
HANG = """
import atexit, sys
def said():
    try:
        with open("/proc/self/io") as f:
            sys.stderr.write("\\nhang_scale: rchar " + f.read().split("rchar:")[1].split()[0] + "\\n")
    except (OSError, IndexError):
        pass
atexit.register(said)
from lorascope.cli import main
main(sys.argv[1:])
"""


def run_hang(job: Job, silent: set[int], *extra: str) -> tuple[float, tuple[float, float] | None, str]:
    """`lorascope hang` with the responder standing in for the ranks: (its wall time, when
    the request was out and how long the answers took from there, its output). Its CPU time
    (with its reading workers') and the bytes it read are printed: on a shared machine the
    wall time is the load's."""
    stop, answered = threading.Event(), []
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    thread = threading.Thread(target=responder, args=(job, silent, stop, answered), daemon=True)
    thread.start()
    began = time.time()
    res = subprocess.run(
        [sys.executable, "-c", HANG, "hang", str(job.out), "--no-html", *extra],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    took = time.time() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    read = [int(line.split()[-1]) for line in res.stderr.splitlines() if line.startswith("hang_scale: rchar ")]
    per_rank = f", {read[0] / job.ranks / 1024:.0f} KiB read a rank" if read else ""
    print(f"  (lorascope hang {' '.join(extra)}: {cpu:.2f} CPU-s in its process and workers{per_rank})")
    stop.set()
    thread.join()
    if res.returncode != 0:
        raise SystemExit(f"lorascope hang failed: {res.stderr.strip()[-2000:]}")
    return took, ((answered[0][0] - began, answered[0][1] - answered[0][0]) if answered else None), res.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--hosts", type=int, default=128)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument(
        "--flight-entries",
        type=int,
        default=2000,
        help="entries of each flight-recorder dump (torch keeps the last TORCH_FR_BUFFER_SIZE: lorascope run sets 2000;"
        " the dump holds at most the job's 2 calls a step)",
    )
    parser.add_argument("--flight-frames", type=int, default=30, help="frames of each entry (a DeepSpeed call's: ~30)")
    parser.add_argument(
        "--no-tails", action="store_true", help="write no tail beside each flight-recorder dump (as lorascope <= 0.3.0)"
    )
    parser.add_argument(
        "--sums",
        action="store_true",
        help="write each step's calls_step record to the stream (what the probes write once the call file's ring went round)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the run directory (its path is printed)")
    parser.add_argument("--read-all", action="store_true", help="run `hang --read-all`: every rank read whole")
    args = parser.parse_args()
    random.seed(0)
    out = Path(tempfile.mkdtemp(prefix="lorascope-hang-scale-")) / "run"
    try:
        began = time.time()
        odd = args.ranks // 2 + 5
        job = Job(
            out,
            args.ranks,
            args.hosts,
            args.steps,
            odd,
            (args.flight_entries, args.flight_frames),
            not args.no_tails,
            args.sums,
        )
        print(
            f"wrote {args.ranks:,} ranks on {args.hosts} hosts ({args.steps} steps each) in {time.time() - began:.1f} s"
        )
        flags = ("--read-all",) if args.read_all else ()
        took, after, text = run_hang(job, set(), *flags)
        lines = text.rstrip("\n").splitlines()
        print(f"hang, every rank answering within 1 s: verdict in {took:.2f} s (goal < 2 s)")
        if after is None:
            print("  no answer")
        else:  # the responder writes 1,024 ranks' answers on these cores, and may take longer than the ranks' 1 s
            asked, answering = after
            print(
                f"  the request out at {asked:.2f} s; the answers took {answering:.2f} s from there; after the last "
                f"answer {took - asked - answering:.2f} s; hang's own (the verdict's time less the answering): "
                f"{took - answering:.2f} s"
            )
        fits = len(lines) <= SCREEN_LINES
        print(f"  output: {len(lines)} lines ({'fits' if fits else 'does NOT fit'} a {SCREEN_LINES}-line screen)")
        print("  " + "\n  ".join(lines))
        silent = {odd + 100, odd + 101}
        took2, _, text2 = run_hang(job, silent, "--wait", "1.2", *flags)
        lines2 = text2.rstrip("\n").splitlines()
        print(f"hang, 2 ranks never answering (--wait 1.2): verdict in {took2:.2f} s, {len(lines2)} lines")
        print("  " + "\n  ".join(lines2))
        _, _, as_json = run_hang(job, set(), "--json", *flags)
        kept = len(json.loads(as_json)["ranks"])
        print(f"hang --json: {kept:,} ranks kept (of {args.ranks:,})")
        began, cpu = time.time(), time.process_time()
        load_run(out)
        print(
            f"reading the whole run once (load_run, in this process; hang reads each rank as it answers): {time.time() - began:.2f} s wall, "
            f"{time.process_time() - cpu:.2f} s CPU; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
        )
        if not fits or len(lines2) > SCREEN_LINES or kept != args.ranks:
            raise SystemExit(1)
    finally:
        if args.keep:
            print(f"run directory kept: {out}")
        else:
            shutil.rmtree(out.parent, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
