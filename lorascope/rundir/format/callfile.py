"""Writing a rank's call file (probe side; standard library only). Layout: ``layout.py``.

``begin`` writes a call's record into its slot with one ``struct.pack_into`` on the thread
that makes the call: no queue, no formatting, no system call. The file is mapped shared,
so what is written is in the page cache at once and outlives the process however it dies
(not a power cut). ``end`` writes the end time into the call's own record. Where a shared
mapping cannot be had (a filesystem that refuses it), the same bytes go to the same
offsets with ``os.pwrite``: a system call per record, as durable; :attr:`CallFile.how`
says which, and the probes record it in the run.

Thread-safe without a lock: indexes come from ``itertools.count`` (atomic under the GIL),
and each record is written whole by the one thread that owns its index.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

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
    STAMP_MASK,
    file_size,
)
from lorascope.rundir.format.schema import CALLS_SUFFIX

_END = struct.Struct("<d")


def calls_path(prefix: Path) -> Path:
    """A rank process's call file, beside its segments: ``HOST-PID.calls``."""
    return prefix.with_name(prefix.name + CALLS_SUFFIX)


class CallFile:
    """One rank process's call records. No method raises: a failed write calls
    ``on_error`` once and turns the file off (the job goes on); a forked child (a
    DataLoader worker) finds its copy off, so it never writes into its parent's file."""

    def __init__(
        self,
        path: Path,
        head: int = DEFAULT_HEAD,
        ring: int = DEFAULT_RING,
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.path = path
        self.head, self.ring = max(0, head), max(2, ring)
        self._on_error = on_error
        self._next = itertools.count()
        #: Records begun so far, as far as this process has written it into the header.
        self.count = 0
        self._map: mmap.mmap | None = None
        self._fd: int | None = None
        self._closed = False
        #: "mmap", or "pwrite (why)" where a shared mapping could not be had.
        self.how = "mmap"
        fd = safe_open.create(path, readable=True)
        try:
            size = file_size(self.head, self.ring)
            os.ftruncate(fd, size)  # sparse: the slots take disk as they are written
            header = HEADER.pack(MAGIC, CALLS_VERSION, CALL.size, self.head, self.ring, 0, time.time(), b"")
            os.pwrite(fd, header, 0)
            try:
                self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except (OSError, ValueError) as exc:
                self.how = f"pwrite ({getattr(exc, 'strerror', None) or exc})"
        except BaseException:
            os.close(fd)
            raise
        if self._map is not None:
            os.close(fd)
        else:
            self._fd = fd
        os.register_at_fork(after_in_child=self._forked)

    @property
    def alive(self) -> bool:
        return self._map is not None or self._fd is not None

    def _forked(self) -> None:
        self._map, self._fd = None, None

    def begin(self, t: float, seq: int, nbytes: int, step: int, gid: int, shape: int) -> int:
        """Write a call's record (its end 0.0: not yet); its index, or -1 when off."""
        index = next(self._next)
        head = self.head
        slot = index if index < head else head + (index - head) % self.ring
        try:
            buf = self._map
            at = HEADER.size + slot * CALL.size
            if buf is not None:
                CALL.pack_into(buf, at, t, 0.0, seq, nbytes, step, gid, shape, (index + 1) & STAMP_MASK)
                if index >= self.count:
                    self.count = index + 1
                    buf[COUNT_OFFSET : COUNT_OFFSET + 8] = self.count.to_bytes(8, "little")
                return index
            if self._fd is None:
                return -1
            os.pwrite(self._fd, CALL.pack(t, 0.0, seq, nbytes, step, gid, shape, (index + 1) & STAMP_MASK), at)
            if index >= self.count:
                self.count = index + 1
                os.pwrite(self._fd, self.count.to_bytes(8, "little"), COUNT_OFFSET)
            return index
        except Exception as exc:
            self._fail(exc)
            return -1

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
        """Later calls write nothing (what was written stays in the file). The mapping is
        dropped, not closed: a thread in ``end`` may still hold it, and the last
        reference unmaps it."""
        self._closed = True
        fd = self._fd
        self._map, self._fd = None, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
