"""Following a run directory while the job writes it: what each rank process appended
since the last look, as whole lines, and the calls its call file gained (`lorascope watch`).

Each stream file is read from the offset where the last look stopped, up to its last
complete line (a line the writer has half written waits for the next look). A look
stats the newest segment of every process it knows; the rank folders are listed again
every :data:`RESCAN_S` seconds for new ranks, processes and segments (a rotated segment's
file is finished first, from its offset): the top folder whole, a rank folder only when
its modification time changed (and at the rescan after: a file made in the same clock
tick), every one every :data:`FULL_RESCAN_S`. A stream's segment is kept open from its
first look (within :attr:`Tail.max_open`; past it, looked at by its path) and nothing but
the appended bytes is read, so a look costs one ``fstat`` a process whose stream did not
change (as a ``stat`` of the path, it asks a network filesystem's client for the size as
its attribute cache allows; a segment removed or made anew under its name is followed by
its name again). Works on a shared filesystem as on a local one: polling, no inotify
(which does not see another host's writes).

A stream already longer than :data:`START_TAIL_BYTES` when first seen (``watch`` started
late in a long run) is read from its last :data:`START_TAIL_BYTES` bytes, from the first
line boundary there, after the whole lines of its first :data:`HEAD_BYTES`:
``Followed.partial`` says so.

A process's call file (beside its stream) is followed by index: a look reads its header's
count, the records begun since the last look (the newest :data:`START_CALLS` at the first)
and the calls still pending at the last look again, whose ends may have been written
since (:func:`lorascope.rundir.loading.calls.read_runs`): one ``pread`` of the header and
one of the new records in the common look, however long the run. Its steps file and its
memory file are followed the same way: the records written since the last look (the
newest :data:`START_STEPS` at the first); the memory files at most every
:data:`MEM_LOOK_S`. A slot file that grew at a look is kept open for the next (at most
:attr:`Tail.max_open` of them: the open-file limit less :data:`SPARE_FDS`); one that did
not is closed and opened again at the next look: on a network filesystem opening a file is
what makes the client ask the server for its newest size and pages (close-to-open), so a
quiet file, or one made anew under its name, is seen as it is now at the next look (a
file held open may show the client's cached header for a look: then it did not grow, and
is opened again).

The calls are read after the streams and steps files (whose ``shape`` lines name what a
call was), and decoded many processes at a time (:class:`Batch`: one set of numpy columns
a batch of about :data:`BATCH_BYTES`), not one process at a time: a look brings each of
1,024 ranks a step's calls or so, and per-process array operations would cost more than
the reading.
"""

from __future__ import annotations

import os
import resource
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lorascope.errors import BadInputError
from lorascope.rundir.format.layout import COUNT_OFFSET, HEADER
from lorascope.rundir.format.safe_open import leaves
from lorascope.rundir.format.schema import CALLS_SUFFIX, MEM_SUFFIX, RANKS_DIR, STEPS_SUFFIX, STREAM_SUFFIX
from lorascope.rundir.loading.calls import CALLS, MEMORY, STEPS, FileKind, Run, decode, read_header, read_runs

#: Seconds between listings of the rank folders (new ranks, processes, segments).
RESCAN_S = 2.0
#: A rank folder is listed at a rescan only when its modification time changed since the
#: rescan before (or at the one before that: a file made in the same clock tick as the
#: change seen), and at least every FULL_RESCAN_S (a filesystem that keeps no folder times).
FULL_RESCAN_S = 30.0
#: A stream longer than this when first seen is followed from its last START_TAIL_BYTES
#: (~35 steps of the probes/ job), after the whole lines of its first HEAD_BYTES (its
#: start record, its first groups and call shapes).
START_TAIL_BYTES = 256 << 10
HEAD_BYTES = 64 << 10
#: At most this much of one file is read in one look; the rest at the next.
MAX_READ_BYTES = 4 << 20
#: Calls read of a call file at its first look (the newest), and pending calls read again
#: at each look, at most (the oldest: the one a hang sits in).
START_CALLS = 4096
MAX_PENDING_CALLS = 256
#: Steps-file (and memory-file) records read at its first look (the newest).
START_STEPS = 1024
#: The memory files are read at most every MEM_LOOK_S seconds (every other look at the
#: default second): memory now and peak are read the least often of a rank's figures, a
#: third of a look's reading; a look that must see everything (the last) reads them anyway.
MEM_LOOK_S = 1.5
#: Bytes of records decoded in one batch, of as many processes as they come from.
BATCH_BYTES = 3 << 20
#: File descriptors left to the rest of the process (the verdict's analysis, the terminal)
#: when slot files are kept open between looks.
SPARE_FDS = 256


_COUNT = struct.Struct("<Q")


def open_budget() -> int:
    """Slot files a :class:`Tail` may keep open: the process's limit on open files less
    :data:`SPARE_FDS`."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(0, (soft if soft != resource.RLIM_INFINITY else 1 << 20) - SPARE_FDS)


@dataclass
class FollowedSlots:
    """A rank process's slot file (its call file, steps file or memory file): the count
    read up to, the calls pending then (a call file's), and the file kept open while it
    grows."""

    path: Path
    #: Records read up to (-1: none yet; the first look reads the newest only).
    count: int = -1
    pending: list[int] = field(default_factory=list)
    #: The file, open since a look that found it grown (None: closed; opened at the next look).
    fd: int | None = field(default=None, repr=False)
    #: Its header's bytes before the count, as checked (magic, version, record size, head,
    #: ring), and its head and ring: a header that still reads the same is not checked again.
    layout: bytes = field(default=b"", repr=False)
    head: int = 0
    ring: int = 0


@dataclass
class Followed:
    """One rank process's stream: its newest segment and where the last look stopped."""

    rank: int
    process: str
    segment: int
    path: Path
    offset: int = 0
    #: Bytes after the last newline, kept for the next look.
    rest: bytes = b""
    #: Followed from the middle of a stream (its beginning was not read).
    partial: bool = False
    #: The segment's size at the last look (a look reads only a file that grew).
    size: int = field(default=-1, repr=False)
    #: The segment, kept open (None: its path is looked at each time).
    fd: int | None = field(default=None, repr=False)
    #: Its call file, beside the stream (read once it is there).
    calls: FollowedSlots | None = None
    #: Its steps file, beside the stream (read once it is there).
    steps: FollowedSlots | None = None
    #: Its memory file, beside the stream (read once it is there).
    mem: FollowedSlots | None = None


#: What a look yields of one process: its stream's new whole lines (without the last
#: newline).
Looked = tuple[Followed, bytes]


@dataclass
class Batch:
    """The records a look read of some processes' slot files of one kind (their call
    files, their steps files or their memory files), as one set of columns: ``records`` (the kind's dtype)
    and ``index``, each process's together and in index order (a call file's: its calls
    pending at the last look read again, then the new ones), ``owner`` the position of its
    process in ``processes``. Every process read is there, also one none of whose records
    were kept (those a ring went round over): the calls it had pending are not any more."""

    processes: list[Followed]
    records: np.ndarray
    index: np.ndarray
    owner: np.ndarray


def _batch(processes: list[Followed], runs: list[Run], owners: list[int], kind: FileKind) -> Batch:
    """The runs read of ``processes`` (``owners``: the position of each run's process),
    decoded at once."""
    records, index, run = decode(runs, kind)
    return Batch(processes, records, index, np.asarray(owners, dtype=np.int64)[run])


def _rank_of(name: str) -> int | None:
    prefix = "rank-"
    if not name.startswith(prefix) or not name[len(prefix) :].isdigit():
        return None
    return int(name[len(prefix) :])


def _stream_name(name: str) -> tuple[str, int] | None:
    """``HOST-PID.NNNN.jsonl`` -> (``HOST-PID``, NNNN); None for any other file."""
    if not name.endswith(STREAM_SUFFIX):
        return None
    proc, _, index = name[: -len(STREAM_SUFFIX)].rpartition(".")
    if not proc or not index.isdigit() or len(index) > 9:
        return None
    return proc, int(index)


class Tail:
    """The appended lines of every rank stream under ``run_dir``, look by look."""

    def __init__(self, run_dir: Path, clock: Callable[[], float] = time.monotonic, max_open: int | None = None) -> None:
        self.run_dir = run_dir
        self.clock = clock
        #: Slot files kept open between looks, at most (default: :func:`open_budget`).
        self.max_open = open_budget() if max_open is None else max_open
        self._open = 0
        #: (rank, process) -> the stream followed.
        self.streams: dict[tuple[int, str], Followed] = {}
        self._scanned = self._scanned_all = self._mem_looked = -float("inf")
        #: Rank folder name -> (its modification time at the last rescan, whether it had
        #: changed then: it is listed again at the next rescan either way).
        self._folders: dict[str, tuple[int, bool]] = {}
        #: Bytes read so far, all looks (for the benchmark and the footer).
        self.bytes_read = 0

    def _scan(self) -> list[Looked]:
        """Take in new streams and newer segments; returns the last lines of the segments
        a newer one replaced (finished from their offset)."""
        finished: list[Looked] = []
        try:
            rank_dirs = list(os.scandir(self.run_dir / RANKS_DIR))
        except OSError:
            return finished
        now = self.clock()
        every = now - self._scanned_all >= FULL_RESCAN_S
        if every:
            self._scanned_all = now
        for entry in rank_dirs:
            rank = _rank_of(entry.name)
            if rank is None or not entry.is_dir(follow_symlinks=False):
                continue
            try:
                mtime = entry.stat(follow_symlinks=False).st_mtime_ns
            except OSError:
                continue
            seen = self._folders.get(entry.name)
            self._folders[entry.name] = (mtime, seen is None or seen[0] != mtime)
            if seen is not None and seen[0] == mtime and not seen[1] and not every:
                continue  # nothing made or removed in it since it was listed
            newest: dict[str, tuple[int, str]] = {}
            try:
                files = list(os.scandir(entry.path))
            except OSError:
                continue
            for f in files:
                named = _stream_name(f.name)
                if named is not None and named[1] >= newest.get(named[0], (-1, ""))[0]:
                    newest[named[0]] = (named[1], f.path)
            for proc, (index, path) in newest.items():
                known = self.streams.get((rank, proc))
                if known is not None and index <= known.segment:
                    continue
                if leaves(self.run_dir, Path(path)):
                    continue
                if known is None:
                    calls = FollowedSlots(Path(entry.path) / (proc + CALLS_SUFFIX))
                    steps = FollowedSlots(Path(entry.path) / (proc + STEPS_SUFFIX))
                    mem = FollowedSlots(Path(entry.path) / (proc + MEM_SUFFIX))
                    self.streams[(rank, proc)] = Followed(
                        rank, proc, index, Path(path), calls=calls, steps=steps, mem=mem
                    )
                    continue
                lines = self._read(known)  # the rest of the segment it replaces
                if lines:
                    finished.append((known, lines))
                self._close_stream(known)
                known.segment, known.path, known.offset, known.size, known.rest = index, Path(path), 0, -1, b""
        return finished

    def _size(self, stream: Followed) -> int | None:
        """The stream's segment's size: of the segment kept open (from its first look, as
        long as :attr:`max_open` allows), or of its path; a segment removed or replaced
        under its name is followed by its name again."""
        fd = stream.fd
        try:
            if fd is None and self._open < self.max_open:
                fd = stream.fd = os.open(stream.path, os.O_RDONLY)
                self._open += 1
            if fd is None:
                return os.stat(stream.path).st_size
            st = os.fstat(fd)
            if st.st_nlink == 0:
                self._close_stream(stream)
                return os.stat(stream.path).st_size
            return st.st_size
        except OSError:
            return None

    def _close_stream(self, stream: Followed) -> None:
        if stream.fd is not None:
            os.close(stream.fd)
            stream.fd, self._open = None, self._open - 1

    def _read(self, stream: Followed) -> bytes:
        """The stream's whole lines after its offset, without the last newline (empty when
        its size did not change)."""
        size = self._size(stream)
        if size is None or size == stream.size:
            return b""
        first_look = stream.size == -1
        if first_look and stream.offset == 0 and size > START_TAIL_BYTES:
            stream.offset, stream.partial = size - START_TAIL_BYTES, True
        if size < stream.offset:  # truncated or replaced: start over
            stream.offset, stream.rest = 0, b""
        try:
            fd = stream.fd if stream.fd is not None else os.open(stream.path, os.O_RDONLY)
            try:
                chunk = os.pread(fd, min(size - stream.offset, MAX_READ_BYTES), stream.offset)
            finally:
                if fd != stream.fd:
                    os.close(fd)
        except OSError:
            return b""
        started_inside = first_look and stream.partial
        if started_inside:  # its head still names the rank, its groups and call shapes
            head = self._head(stream.path)
        stream.offset += len(chunk)
        stream.size = size if stream.offset >= size else -2  # -2: more to read at the next look
        self.bytes_read += len(chunk)
        data = stream.rest + chunk
        cut = data.rfind(b"\n")
        if cut < 0:
            stream.rest = data
            return b""
        stream.rest = data[cut + 1 :]
        if started_inside:  # the first line was cut by the start offset
            first = data.find(b"\n")
            return head + (data[first + 1 : cut] if first < cut else b"")
        return data[:cut]

    @staticmethod
    def _head(path: Path) -> bytes:
        """The whole lines of a stream's first HEAD_BYTES, with a newline after them."""
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                head = os.pread(fd, HEAD_BYTES, 0)
            finally:
                os.close(fd)
        except OSError:
            return b""
        return head[: head.rfind(b"\n") + 1]

    def _read_slots(self, followed: FollowedSlots | None, kind: FileKind, most: int) -> list[Run] | None:
        """The slot file's records written since the last look and its pending calls again,
        as read (None: none of either). The header's count is read with one ``pread``, and
        the new records with one more (the common look): a file that grew since the last
        look stays open for the next (up to :attr:`Tail.max_open` files); one that did not
        is closed, and opened again at the next look (on a network filesystem, opening it
        is what makes the client ask the server for its newest state)."""
        if followed is None:
            return None
        fd, grew = followed.fd, False
        if fd is None:
            try:
                fd = os.open(followed.path, os.O_RDONLY)
            except OSError:
                return None
        try:
            header = os.pread(fd, HEADER.size, 0)
            if followed.layout and len(header) == HEADER.size and header.startswith(followed.layout):
                (count,) = _COUNT.unpack_from(header, COUNT_OFFSET)
            else:  # its first read, or the file was made anew
                try:
                    followed.head, followed.ring, count = read_header(header, str(followed.path), kind)
                except BadInputError:
                    return None
                if followed.layout:
                    followed.count, followed.pending = -1, []
                followed.layout = header[:COUNT_OFFSET]
            if count < followed.count:  # the count went back: made anew, read it as new
                followed.count, followed.pending = -1, []
            if count == followed.count and not followed.pending:
                return None
            since = followed.count
            runs = read_runs(fd, followed.head, followed.ring, count, max(since, 0), followed.pending,
                             most if since < 0 else None, kind.record.size)  # fmt: skip
            grew, followed.count = count > max(since, 0), count
            return runs
        except OSError:
            return None
        finally:
            if grew and (followed.fd is not None or self._open < self.max_open):
                if followed.fd is None:
                    followed.fd, self._open = fd, self._open + 1
            else:
                if followed.fd is not None:
                    followed.fd, self._open = None, self._open - 1
                os.close(fd)

    def close(self) -> None:
        """Close the files kept open (a later look opens them again)."""
        for stream in self.streams.values():
            self._close_stream(stream)
            for followed in (stream.calls, stream.steps, stream.mem):
                if followed is not None and followed.fd is not None:
                    os.close(followed.fd)
                    followed.fd, self._open = None, self._open - 1

    def look(self) -> Iterator[Looked]:
        """Every stream's whole lines appended since the last look, oldest first per
        stream, as one ``bytes`` of lines without the last newline, one process at a time
        (those with none are left out): a caller that takes each in before the next holds
        one process's at most."""
        now = self.clock()
        if now - self._scanned >= RESCAN_S:
            self._scanned = now
            yield from self._scan()
        for stream in list(self.streams.values()):
            lines = self._read(stream)
            if lines:
                yield stream, lines

    def look_steps(self) -> Iterator[Batch]:
        """Every steps file's records written since the last look, in batches (the
        processes with none are left out). Called after :meth:`look`."""
        return self._batches(STEPS, "steps", START_STEPS)

    def look_mem(self, now: bool = False) -> Iterator[Batch]:
        """Every memory file's readings written since they were last read, in batches (the
        processes with none are left out): none when they were read less than
        :data:`MEM_LOOK_S` ago, unless ``now``."""
        at = self.clock()
        if not now and at - self._mem_looked < MEM_LOOK_S:
            return iter(())
        self._mem_looked = at
        return self._batches(MEMORY, "mem", START_STEPS)

    def look_calls(self) -> Iterator[Batch]:
        """Every call file's records begun since the last look, and its calls pending at
        the last look read again, in batches (the processes with neither are left out);
        each process's calls pending now, to read again at the next look, are those not
        ended. Called after :meth:`look`."""
        for batch in self._batches(CALLS, "calls", START_CALLS):
            pending: dict[int, list[int]] = {}
            at = np.flatnonzero(batch.records["end"] == 0.0)
            for owner, index in zip(batch.owner[at].tolist(), batch.index[at].tolist(), strict=True):
                of = pending.setdefault(owner, [])
                if len(of) < MAX_PENDING_CALLS:
                    of.append(index)
            for n, process in enumerate(batch.processes):
                if process.calls is not None and (process.calls.pending or n in pending):
                    process.calls.pending = pending.get(n, [])
            yield batch

    def _batches(self, kind: FileKind, attr: str, most: int) -> Iterator[Batch]:
        """What each process's slot file of a ``kind`` (its ``attr``: calls, steps, mem)
        gained since the last look (:meth:`_read_slots`; ``most``: the records read at its
        first look, at most), decoded :data:`BATCH_BYTES` or so at a time, many processes'
        in one pass."""
        processes: list[Followed] = []
        runs: list[Run] = []
        owners: list[int] = []
        size = 0
        read = self._read_slots
        for stream in list(self.streams.values()):
            got = read(getattr(stream, attr), kind, most)
            if got is None:
                continue
            at = len(processes)
            processes.append(stream)
            for run in got:
                runs.append(run)
                owners.append(at)
                size += len(run[1])
            if size >= BATCH_BYTES:
                self.bytes_read += size
                yield _batch(processes, runs, owners, kind)
                processes, runs, owners, size = [], [], [], 0
        self.bytes_read += size
        if processes:
            yield _batch(processes, runs, owners, kind)
