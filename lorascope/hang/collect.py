"""Taking evidence from live ranks: the dump signal, a bounded wait for the dumps, and
py-spy for ranks that do not answer (stuck in C code holding the GIL, dumps turned off,
or a job not started under `lorascope run`)."""

from __future__ import annotations

import ctypes
import errno
import glob
import json
import os
import platform
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorascope.detect.hang.diagnosis import pending_calls
from lorascope.errors import BadInputError
from lorascope.hang.targets import Target
from lorascope.rundir.cluster import Cluster
from lorascope.rundir.reader import RunData, load_run
from lorascope.rundir.safe_open import open_regular
from lorascope.rundir.schema import DUMP_SIGNAL, STREAM_SUFFIX
from lorascope.rundir.writer import stream_prefix

POLL_S = 0.2
PY_SPY_TIMEOUT_S = 20.0
#: What is read of a stream file's growth since the dump signal, at most (a dump record
#: holds every thread's stack: tens of KB; the sampler adds a record every 0.5 s).
MAX_TAIL_BYTES = 64 << 20
#: Seconds a dump's flight-recorder dump is waited for, at most, once the dump is in (a
#: process without torch.distributed writes none).
FLIGHT_GRACE_S = 2.0


#: A process of the run: (host, pid).
Process = tuple[str, int]


def request_dumps(targets: list[Target]) -> float:
    """Signal every verified process (once each); returns the time the request was made."""
    asked = time.time()
    signalled: set[Process] = set()
    for target in targets:
        if target.ours and (target.host, target.pid) not in signalled:
            signalled.add((target.host, target.pid))
            try:
                if target.thread is not None:
                    tgkill(target.pid, target.thread, DUMP_SIGNAL)
                elif not target.attached:
                    os.kill(target.pid, DUMP_SIGNAL)
            except ProcessLookupError:
                target.alive, target.why = False, "process gone"
    return asked


#: tgkill's system call number per machine (Linux).
_SYS_TGKILL = {"x86_64": 234, "aarch64": 131, "ppc64le": 250}


def tgkill(pid: int, thread: int, sig: int) -> None:
    """Send ``sig`` to one thread of another process (an attached rank's dump thread:
    no thread of the job is interrupted by it); raises ProcessLookupError when that
    thread is gone, OSError when it cannot be sent."""
    number = _SYS_TGKILL.get(platform.machine())
    if number is None:
        os.kill(pid, sig)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, pid, thread, int(sig)) != 0:
        err = ctypes.get_errno()
        if err == errno.ESRCH:
            raise ProcessLookupError(err, os.strerror(err))
        raise OSError(err, os.strerror(err))


@dataclass(frozen=True)
class Grown:
    """A process's stream files (``ends``: where each ended before the dump signal) and
    the prefix its segments share, for a segment begun since."""

    prefix: Path
    ends: dict[Path, int]

    def segments(self) -> list[Path]:
        return sorted(self.prefix.parent.glob(f"{glob.escape(self.prefix.name)}.*{STREAM_SUFFIX}"))


def stream_ends(run_dir: Path, targets: list[Target]) -> dict[Process, Grown]:
    """Where each process's stream files end now (taken before the dump signal): what it
    writes after it is read from there on."""
    ends: dict[Process, Grown] = {}
    for t in targets:
        files = Grown(stream_prefix(run_dir, t.rank, t.host, t.pid), {})
        files.ends.update((path, _size(path)) for path in files.segments())
        ends[(t.host, t.pid)] = files
    return ends


def wait_for_dumps(
    run_dir: Path, ends: dict[Process, Grown], since: float, wait_s: float, cluster: Cluster | None = None
) -> tuple[RunData, list[int]]:
    """Wait until every process of ``ends`` (:func:`stream_ends`) wrote a dump after
    ``since``, or ``wait_s`` passes, then read the run once (on ``cluster``, if given);
    returns it and the ranks whose process was asked and did not answer. The wait reads
    only what the processes wrote since the signal: reading a large run again on every
    poll took longer than the wait itself, and a rank read in the first instant, before
    its dump was flushed, was then reported silent."""
    deadline = time.time() + wait_s
    waiting = _until_written(dict(ends), since, "dump", deadline)
    # Each dump is followed by the rank's flight-recorder dump (the collectives the probes
    # cannot see): a moment more for those, as long as the wait lasts.
    dumped = {key: files for key, files in ends.items() if key not in waiting}
    _until_written(dumped, since, "flight_dump", min(deadline, time.time() + FLIGHT_GRACE_S))
    run = load_run(run_dir, cluster=cluster)
    silent = [
        n
        for n, rank in run.ranks.items()
        if (rank.host, rank.pid) in ends and not any(float(d["t"]) >= since for d in rank.dumps)
    ]
    return run, silent


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _until_written(files: dict[Process, Grown], since: float, kind: str, until: float) -> dict[Process, Grown]:
    """Poll until every process's files hold a record of ``kind`` after ``since``, or
    ``until``; returns the processes still without one."""
    waiting = files
    while waiting and time.time() < until:
        waiting = {key: grown for key, grown in waiting.items() if not _written_since(grown, since, kind)}
        if waiting:
            time.sleep(POLL_S)
    return waiting


def _written_since(files: Grown, since: float, kind: str) -> bool:
    """Whether a record of ``kind`` after ``since`` is in what one process's files gained
    past their ends (at most MAX_TAIL_BYTES of each), a segment begun since included."""
    compact, spaced = f'"k":"{kind}"'.encode(), f'"k": "{kind}"'.encode()
    for path in files.segments():
        try:
            with open_regular(path, inside=path.parent) as f:
                f.seek(files.ends.get(path, 0))
                tail = f.read(MAX_TAIL_BYTES)
        except (OSError, BadInputError):
            continue
        for line in tail.split(b"\n"):
            if compact in line or spaced in line:
                try:
                    if float(json.loads(line)["t"]) >= since:
                        return True
                except (ValueError, KeyError, TypeError, RecursionError):
                    continue
    return False


def py_spy_dump(pid: int) -> str:
    """Every thread's stack of ``pid``, read from outside (ptrace) with ``py-spy dump
    --json``, native frames included where py-spy can unwind them (a rank blocked inside
    NCCL shows where), written as the probes write a thread dump; raises BadInputError when
    py-spy is missing or cannot read the process."""
    exe = shutil.which("py-spy")
    if exe is None:
        raise BadInputError("py-spy is not installed (pip install py-spy): cannot read a silent rank's stacks")
    res = _py_spy(exe, pid, "--native")
    if res.returncode != 0:  # no native unwinding for this process or platform
        res = _py_spy(exe, pid)
    if res.returncode != 0:
        line = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise BadInputError(f"py-spy dump --pid {pid} failed: {line}")
    try:
        threads = json.loads(res.stdout)
    except ValueError:
        raise BadInputError(f"py-spy dump --pid {pid} --json printed no JSON") from None
    if not isinstance(threads, list):
        raise BadInputError(f"py-spy dump --pid {pid} --json: not a list of threads")
    return stacks_text([t for t in threads if isinstance(t, dict)])


def _py_spy(exe: str, pid: int, *extra: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            [exe, "dump", "--pid", str(pid), "--json", *extra], capture_output=True, text=True, timeout=PY_SPY_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        raise BadInputError(f"py-spy dump --pid {pid} took over {PY_SPY_TIMEOUT_S:.0f} s") from None


def stacks_text(threads: list[dict[str, Any]]) -> str:
    """py-spy's JSON threads (frames innermost first) as the probes' thread dump: a
    ``Thread NAME:`` line, then each frame outermost first as a traceback line; native
    frames (a shared object's function) as ``[native] FUNC (LIB)`` lines."""
    parts = []
    for thread in threads:
        name = thread.get("thread_name")
        if not name and thread.get("os_thread_id") is not None and thread.get("os_thread_id") == thread.get("pid"):
            name = "MainThread"  # with --native py-spy may not name threads; the main one's id is the pid's
        lines = [f"Thread {name or thread.get('thread_id')}:"]
        for frame in reversed([f for f in thread.get("frames") or [] if isinstance(f, dict)]):
            if frame.get("module"):
                lines.append(f"  [native] {frame.get('name')} ({frame.get('short_filename')})")
            else:
                lines.append(f'  File "{frame.get("filename")}", line {frame.get("line")}, in {frame.get("name")}')
        parts.append("\n".join(lines))
    return "\n".join(parts) + "\n"


def read_silent_ranks(run: RunData, silent: list[int], wait_s: float) -> list[str]:
    """Stacks of the ranks that did not answer the dump signal, read from outside with
    py-spy and added to the run as ``dump`` records; returns a note per rank."""
    notes = []
    for n in silent:
        try:
            stacks = py_spy_dump(run.ranks[n].pid)
        except BadInputError as exc:
            notes.append(f"rank {n} did not answer the dump signal and {exc}")
            continue
        run.ranks[n].dumps.append(
            {
                "k": "dump",
                "t": time.time(),
                "reason": "py-spy",
                "step": 0,
                "stacks": stacks,
                "pending": pending_calls(run.ranks[n]),
            }
        )
        notes.append(f"rank {n} did not answer the dump signal in {wait_s:g} s: stacks read with py-spy")
    return notes
