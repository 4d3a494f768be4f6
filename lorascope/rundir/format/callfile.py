"""Writing a rank's call file, steps file and memory file (probe side; standard library
only). Layout: ``layout.py``. One writer, :class:`SlotFile`, serves them all: a record
Struct, a header, and slots kept from the start and a ring after them (none for the steps
and memory files).

``begin`` writes a call's record into its slot with one ``struct.pack_into`` on the thread
that makes the call: no queue, no formatting, no system call. The file is mapped shared,
so what is written is in the page cache at once and outlives the process however it dies
(not a power cut). ``end`` writes the end time into the call's own record. Where a shared
mapping cannot be had (a filesystem that refuses it), the same bytes go to the same
offsets with ``os.pwrite``: a system call per record, as durable; :attr:`CallFile.how`
says which, and the probes record it in the run.

The file grows by :data:`CHUNK_SLOTS` slots at a time, up to its header plus ``head +
ring`` slots, each chunk's blocks reserved (``posix_fallocate``) before it is mapped: a
store into a mapped page the filesystem has no room for would kill the job with SIGBUS,
where a failed reservation only turns the probe off.

Thread-safe: indexes come from ``itertools.count`` (atomic under the GIL), each record is
written whole by the one thread that owns its index, and growing takes a lock.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lorascope.rundir.format import safe_open
from lorascope.rundir.format.layout import (
    CALL,
    CALLS_VERSION,
    COUNT_OFFSET,
    DEFAULT_HEAD,
    DEFAULT_RING,
    END_OFFSET,
    HEADER,
    MAGIC,
    MEM,
    MEM_MAGIC,
    MEM_VERSION,
    STAMP_MASK,
    STEP,
    STEPS_HEAD,
    STEPS_MAGIC,
    STEPS_RING,
    STEPS_VERSION,
    file_size,
    slot_runs,
)
from lorascope.rundir.format.schema import CALLS_SUFFIX, KEPT_CALLS_SUFFIX, MEM_SUFFIX, STEPS_SUFFIX

_END = struct.Struct("<d")
_COUNT = struct.Struct("<Q")
#: Slots the file grows by (192 KiB): a call in 4,096 pays for the growth (~0.1 ms).
CHUNK_SLOTS = 4096


def calls_path(prefix: Path) -> Path:
    """A rank process's call file, beside its segments: ``HOST-PID.calls``."""
    return prefix.with_name(prefix.name + CALLS_SUFFIX)


def steps_path(prefix: Path) -> Path:
    """A rank process's steps file, beside its segments: ``HOST-PID.steps``."""
    return prefix.with_name(prefix.name + STEPS_SUFFIX)


def mem_path(prefix: Path) -> Path:
    """A rank process's memory file, beside its segments: ``HOST-PID.mem``."""
    return prefix.with_name(prefix.name + MEM_SUFFIX)


def kept_calls_path(prefix: Path) -> Path:
    """Its calls kept whole past the ring (``probes/callsteps.py``): ``HOST-PID.kept-calls``."""
    return prefix.with_name(prefix.name + KEPT_CALLS_SUFFIX)


class SlotFile:
    """One rank process's fixed-width records of one kind (``record``: a layout.py
    Struct whose last field is the stamp, which :meth:`put` adds), in a file of ``head``
    slots kept and a ring of ``ring`` after them (``ring`` 0: no ring, every record kept).
    No method raises: a failed write calls ``on_error`` once and turns the file off (the
    job goes on); a forked child (a DataLoader worker) finds its copy off, so it never
    writes into its parent's file."""

    def __init__(
        self,
        path: Path,
        head: int = DEFAULT_HEAD,
        ring: int = DEFAULT_RING,
        on_error: Callable[[BaseException], None] | None = None,
        record: struct.Struct = CALL,
        magic: bytes = MAGIC,
        version: int = CALLS_VERSION,
    ) -> None:
        self.path = path
        self.head, self.ring = max(0, head), (max(2, ring) if ring else 0)
        self.record = record
        #: The record's size and packer, looked up once: ``put`` runs on every collective.
        self._record_size, self._pack_into = record.size, record.pack_into
        self._on_error = on_error
        self._next = itertools.count()
        #: Records begun so far, as far as this process has written it into the header.
        self.count = 0
        self._map: mmap.mmap | None = None
        self._fd: int | None = None
        self._closed = False
        self._grow_lock = threading.Lock()
        #: The file's size (bytes reserved and mapped); slots past it are not yet there.
        self._size = 0
        #: "mmap", or "pwrite (why)" where a shared mapping could not be had.
        self.how = "mmap"
        fd = safe_open.create(path, readable=True)
        try:
            self._size = min(self._full(), file_size(CHUNK_SLOTS, 0, record))
            _reserve(fd, 0, self._size)
            os.pwrite(fd, HEADER.pack(magic, version, record.size, self.head, self.ring, 0, time.time(), b""), 0)
            try:
                self._map = mmap.mmap(fd, self._size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except (OSError, ValueError) as exc:
                self.how = f"pwrite ({getattr(exc, 'strerror', None) or exc})"
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        os.register_at_fork(after_in_child=self._forked)

    @property
    def alive(self) -> bool:
        return self._fd is not None

    def _forked(self) -> None:
        self._map, self._fd = None, None

    def _full(self) -> int:
        """The file's size once every slot is there."""
        return file_size(self.head, self.ring, self.record)

    def put(self, *fields: Any) -> int:
        """Write a record (its fields but the stamp, in the layout's order) into the slot
        of the next index; its index, or -1 when off."""
        index = next(self._next)
        head, size = self.head, self._record_size
        # slot_of(index, head, ring), inlined: a call's worth on every collective
        at = HEADER.size + (index if index < head else head + (index - head) % self.ring) * size
        try:
            if at + size > self._size:
                self._grow(at + size)
            buf = self._map
            if buf is not None:
                self._pack_into(buf, at, *fields, (index + 1) & STAMP_MASK)
                if index >= self.count:
                    self.count = index + 1
                    _COUNT.pack_into(buf, COUNT_OFFSET, index + 1)
                return index
            if self._fd is None:
                return -1
            os.pwrite(self._fd, self.record.pack(*fields, (index + 1) & STAMP_MASK), at)
            if index >= self.count:
                self.count = index + 1
                os.pwrite(self._fd, _COUNT.pack(index + 1), COUNT_OFFSET)
            return index
        except Exception as exc:
            self._fail(exc)
            return -1

    def _grow(self, needed: int) -> None:
        """Reserve and map the next chunk (or chunks) so that ``needed`` bytes are there."""
        with self._grow_lock:
            if needed <= self._size or self._fd is None:
                return
            size = min(self._full(), self._size + max(CHUNK_SLOTS * self.record.size, needed - self._size))
            _reserve(self._fd, self._size, size - self._size)
            if self._map is not None:
                self._map.resize(size)
            self._size = size

    def read(self, first: int, last: int) -> Iterator[tuple[int, tuple[Any, ...]]]:
        """The records of indexes ``first`` .. ``last - 1`` still in the file (index,
        fields in the layout's order), read back from the mapping; a slot that holds
        another record by now is skipped. For the probes' own thread (``probes/callsteps.py``)."""
        buf, head, ring, record = self._map, self.head, self.ring, self.record
        if buf is None:
            return
        for index, slot, run in slot_runs(first, last, head, ring):
            at = HEADER.size + slot * record.size
            if at + run * record.size > self._size:
                return
            for offset, rec in enumerate(record.iter_unpack(buf[at : at + run * record.size])):
                if rec[-1] == (index + offset + 1) & STAMP_MASK:
                    yield index + offset, rec

    def _fail(self, exc: BaseException) -> None:
        fd = self._fd
        self._map, self._fd = None, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        if self._on_error is not None and not self._closed:
            with contextlib.suppress(Exception):
                self._on_error(exc)

    def close(self) -> None:
        """Later records write nothing (what was written stays in the file). The mapping
        is dropped, not closed: a thread writing may still hold it, and the last
        reference unmaps it."""
        self._closed = True
        fd = self._fd
        self._map, self._fd = None, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


class CallFile(SlotFile):
    """One rank process's call records (layout.CALL_FIELDS)."""

    def begin(self, t: float, seq: int, nbytes: int, step: int, gid: int, shape: int) -> int:
        """Write a call's record (its end 0.0: not yet); its index, or -1 when off. (The
        collective wrappers call ``put(t, 0.0, ...)`` themselves: a call layer less.)"""
        return self.put(t, 0.0, seq, nbytes, step, gid, shape)

    def end(self, index: int, t: float) -> None:
        """Write the end of call ``index`` into its record, unless the ring has gone round
        since and its slot holds a newer call (then the end is lost with the call)."""
        if index < 0:
            return
        head, ring = self.head, self.ring
        if index >= head and self.count - index >= ring:
            return
        at = HEADER.size + (index if index < head else head + (index - head) % ring) * CALL.size + END_OFFSET
        try:
            buf = self._map
            if buf is not None:
                _END.pack_into(buf, at, t)
            elif self._fd is not None:
                os.pwrite(self._fd, _END.pack(t), at)
        except Exception as exc:
            self._fail(exc)


def step_file(path: Path, on_error: Callable[[BaseException], None] | None = None) -> SlotFile:
    """A rank process's steps file (layout.STEP_FIELDS: its steps' ends and phase edges,
    every one kept); write a record with ``put(t, dur, loss, step, label, kind)``."""
    return SlotFile(path, STEPS_HEAD, STEPS_RING, on_error, STEP, STEPS_MAGIC, STEPS_VERSION)


def mem_file(path: Path, on_error: Callable[[BaseException], None] | None = None) -> SlotFile:
    """A rank process's memory file (layout.MEM_FIELDS: its memory readings, every one
    kept); write a record with ``put(t, rss, heap, alloc, reserved, max_alloc, step,
    device, src)``."""
    return SlotFile(path, STEPS_HEAD, STEPS_RING, on_error, MEM, MEM_MAGIC, MEM_VERSION)


def _reserve(fd: int, offset: int, length: int) -> None:
    """Give ``length`` bytes from ``offset`` their blocks now (and the file that size):
    ENOSPC here, not SIGBUS at a store into the mapping. Where the filesystem cannot
    reserve (EOPNOTSUPP, EINVAL), the file is only extended."""
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, offset + length)
