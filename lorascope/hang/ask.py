"""Asking every rank of a run for a dump: the processes to wait for (this host's live
ones; every other host's whose stream has not ended), where each one's stream ends before
the request (what it writes after is its answer), the request file in the run directory
(every host) and the dump signal (the ranks on this host, at once). Light: `lorascope
hang` asks before it imports the reader and the diagnosis, which load while the ranks
answer."""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorascope.errors import BadInputError
from lorascope.hang.request import write_request
from lorascope.hang.targets import Target, verify
from lorascope.rundir.format.safe_open import open_regular
from lorascope.rundir.format.schema import DUMP_SIGNAL, STREAM_SUFFIX
from lorascope.rundir.format.writer import stream_prefix
from lorascope.rundir.loading.attachments import attached_processes

#: What is read of the end of a process's last stream segment to see whether it ended.
END_TAIL_BYTES = 16 << 10


#: A process of the run: (host, pid).
Process = tuple[str, int]


@dataclass(frozen=True)
class Asked:
    """A dump request: when it was made (this host's clock), its id in the run directory
    (None when it could not be written) and the processes signalled on this host."""

    since: float
    request: str | None
    signalled: frozenset[Process]

    def answered_by(self, dump: Mapping[str, Any], process: Process) -> bool:
        """Whether a ``dump`` record of ``process`` answers this request: it carries its
        id, or (a process signalled here, on this clock) it was taken since."""
        if self.request is not None and dump.get("request") == self.request:
            return True
        try:
            return process in self.signalled and float(dump["t"]) >= self.since
        except (KeyError, TypeError, ValueError):
            return False


def request_dumps(run_dir: Path, targets: list[Target], waited: list[Target]) -> tuple[Asked, list[str]]:
    """Ask every rank for a dump: the request file in the run directory (every host; not
    written when no rank is waited for: a job over, a fixture read in place), then the
    dump signal to every verified process on this host (once each); returns the request
    and a note when the file could not be written."""
    since = time.time()
    request, why = write_request(run_dir) if waited else (None, None)
    signalled: set[Process] = set()
    for target in targets:
        if target.ours and (target.host, target.pid) not in signalled:
            try:
                if target.thread is not None:
                    tgkill(target.pid, target.thread, DUMP_SIGNAL)
                    signalled.add((target.host, target.pid))
                elif not target.attached:
                    os.kill(target.pid, DUMP_SIGNAL)
                    signalled.add((target.host, target.pid))
            except ProcessLookupError:
                target.alive, target.why = False, "process gone"
    return Asked(since, request, frozenset(signalled)), [why] if why else []


def expected(targets: list[Target], run_dir: Path) -> list[Target]:
    """The processes a dump is waited for: this host's verified live ones, and every
    other host's whose stream has not ended (those are reached through the request file
    only; whether they are alive cannot be told from here)."""
    out = []
    for t in targets:
        if t.ours and t.alive:
            out.append(t)
        elif (
            t.alive and t.rank >= 0 and not t.local and not _stream_ended(stream_prefix(run_dir, t.rank, t.host, t.pid))
        ):
            out.append(t)
    return out


def _stream_ended(prefix: Path) -> bool:
    """Whether the last segment of a process's stream holds its ``end`` record."""
    segments = Grown(prefix, {}).segments()
    if not segments:
        return False
    try:
        with open_regular(segments[-1]) as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - END_TAIL_BYTES))
            tail = f.read(END_TAIL_BYTES)
    except (OSError, BadInputError):
        return False
    return b'"k":"end"' in tail or b'"k": "end"' in tail


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


@dataclass
class Grown:
    """A process's stream files (``ends``: where each ended before the dump signal) and
    the prefix its segments share, for a segment begun since."""

    prefix: Path
    ends: dict[Path, int]
    #: Each segment's size when its growth was last read (unchanged: not read again), and
    #: what was found in what it gained (:func:`_answers`).
    looked: dict[Path, int] = field(default_factory=dict, compare=False)
    found: set[str] = field(default_factory=set, compare=False)
    #: The latest ``dump`` record that answers the request (:func:`_answers`).
    answer: dict[str, Any] | None = field(default=None, compare=False)

    def segments(self) -> list[Path]:
        """The process's segment files now (a listing of its rank's folder: a glob compiles
        its pattern at every call, ~1.6 ms, which 1,024 ranks polled 5 times a second
        could not afford)."""
        head, folder = f"{self.prefix.name}.", self.prefix.parent
        try:
            names = os.listdir(folder)
        except OSError:
            return []
        return sorted(folder / n for n in names if n.startswith(head) and n.endswith(STREAM_SUFFIX))


def stream_ends(run_dir: Path, targets: list[Target]) -> dict[Process, Grown]:
    """Where each process's stream files end now (taken before the dump signal): what it
    writes after it is read from there on."""
    ends: dict[Process, Grown] = {}
    for t in targets:
        files = Grown(stream_prefix(run_dir, t.rank, t.host, t.pid), {})
        files.ends.update((path, _size(path)) for path in files.segments())
        ends[(t.host, t.pid)] = files
    return ends


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


@dataclass(frozen=True)
class Request:
    """A dump request and whom it went to: every process of the run (its ``start`` record,
    and as a target), those a dump is waited for, where their streams ended before it, the
    request, and notes (the request file could not be written)."""

    starts: list[dict[str, Any]]
    targets: list[Target]
    waited: list[Target]
    ends: dict[Process, Grown]
    asked: Asked
    notes: list[str]


def ask(run_dir: Path) -> Request:
    """Ask every process of the run for a dump (:func:`request_dumps`), the processes found
    from each stream's first record."""
    starts = attached_processes(run_dir)
    targets = [verify(start, run_dir) for start in starts]
    waited = expected(targets, run_dir)
    ends = stream_ends(run_dir, waited)
    asked, notes = request_dumps(run_dir, targets, waited)
    return Request(starts, targets, waited, ends, asked, notes)
