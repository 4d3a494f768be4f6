"""Writing the run directory (probe and launcher side; standard library only).

Streams are append-only JSON Lines on an ``O_APPEND`` descriptor (collective calls go to
the call file instead: ``callfile.py``). The probes' hot path only *appends* a record to a
bounded in-memory queue (a deque append: no formatting, no JSON, no system call on the
calling thread); a writer thread formats what is queued and writes it with one
``os.write`` every ``FLUSH_INTERVAL`` seconds, so a SIGKILL loses at most the records of
the last interval or so. ``flush()`` writes the queue at once (at an exception, a signal,
a dump and the end), and ``write()``
flushes the queue and then its record (rare records that must be on disk when the call
returns). A full queue drops new records and counts them; the count is written as a
``dropped`` record. A stream is bounded on disk too: past ``segment_bytes`` it moves to a
new segment file, and only the first segment and the newest ``keep_segments`` stay.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import functools
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar

from lorascope.errors import BadInputError
from lorascope.rundir.format import safe_open
from lorascope.rundir.format.schema import (
    FATAL_SUFFIX,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_FILE,
    RANKS_DIR,
    STREAM_SUFFIX,
)

K = TypeVar("K")

DEFAULT_SEGMENT_BYTES = 64 * 1024 * 1024
#: With the segments' 64 MiB, a stream holds at most 25 x 64 MiB (1.6 GiB): ~1.7 million
#: steps of the CPU test job's ~950 bytes a step (docs/run-format.md, "Bounded growth").
DEFAULT_KEEP_SEGMENTS = 24
#: Seconds between the writer thread's flushes: a SIGKILL loses the records of about this
#: long (plus the flush itself), well inside the 100 ms the format promises.
FLUSH_INTERVAL = 0.04
#: Records queued at most between two flushes (~3 MB of small objects at worst); beyond
#: it new records are dropped and counted (``dropped``). The probe job queues ~800 a second.
DEFAULT_QUEUE_RECORDS = 32768


#: One encoder for every record (json.dumps with arguments builds a new one at each call).
_ENCODER = json.JSONEncoder(separators=(",", ":"), default=repr)


def _encode(record: dict[str, Any]) -> str:
    return _ENCODER.encode(record) + "\n"


@functools.lru_cache(maxsize=8192)
def json_str(text: str) -> str:
    """``text`` as a JSON string, for a record's template (cached: the strings the probes
    write again and again are few: call sites, ops, phase names)."""
    return json.dumps(text)


class Line:
    """A record the writer formats from a %-template and its values: numbers (``%d``,
    ``%r`` for a float, as the JSON encoder writes it) and ``json_str`` strings. A phase
    edge's records are two of these: each a fourth of its dict's formatting through the
    JSON encoder, and no dict made on the job's thread."""

    __slots__ = ("template", "values")

    def __init__(self, template: str, values: tuple[Any, ...]) -> None:
        self.template, self.values = template, values

    def encode(self) -> str:
        return self.template % self.values


class Declared(Generic[K]):
    """The ids a stream gives values that records name (call shapes, labels): each declared
    once, by a record line written (on disk) before the first record that names it, and
    again at the head of every later segment (:meth:`Stream.declare`). Thread-safe; look
    in ``ids`` first (no lock), then :meth:`declare`."""

    __slots__ = ("ids", "_lock", "_stream", "_most")

    def __init__(self, stream: Stream, most: int) -> None:
        self.ids: dict[K, int] = {}
        self._lock = threading.Lock()
        self._stream = stream
        self._most = most

    def declare(self, key: K, line: Callable[[int], str], known: Callable[[int], None] | None = None) -> int:
        """The id of ``key``, its record (``line(id)``) written now if it is new, ``known(id)``
        called before any other thread can see the id; -1 past ``most`` ids."""
        with self._lock:
            n = self.ids.get(key)
            if n is not None:  # another thread declared it first
                return n
            n = len(self.ids)
            if n >= self._most:
                return -1
            self._stream.declare(line(n))
            if known is not None:
                known(n)
            self.ids[key] = n
            return n


def _write_all(fd: int, data: bytes) -> None:
    """os.write may write less than asked (a full disk, a signal): finish the record."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def stream_prefix(run_dir: Path, rank: int, host: str, pid: int) -> Path:
    """Where a rank process's segments go: ``ranks/rank-R/HOST-PID.NNNN.jsonl``."""
    return run_dir / RANKS_DIR / f"rank-{rank}" / f"{host}-{pid}"


def fatal_path(prefix: Path) -> Path:
    """A rank process's faulthandler file, beside its segments: ``HOST-PID.fatal.txt``."""
    return prefix.with_name(prefix.name + FATAL_SUFFIX)


class Stream:
    """One process's append-only record stream. Thread-safe; no method raises.

    A failed write calls ``on_error`` once and turns the stream off: the job goes on.
    A forked child (a DataLoader worker) finds its copy of the stream off.
    """

    def __init__(
        self,
        prefix: Path,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        keep_segments: int = DEFAULT_KEEP_SEGMENTS,
        on_error: Callable[[BaseException], None] | None = None,
        queue_records: int = DEFAULT_QUEUE_RECORDS,
    ) -> None:
        self._prefix = prefix
        self._segment_bytes = segment_bytes
        self._keep = max(1, keep_segments)
        self._on_error = on_error
        self._lock = threading.RLock()  # re-entered by a signal handler mid-flush
        self._index = 0
        self._size = 0
        self._fd: int | None = None
        self._queue: collections.deque[dict[str, Any] | Line] = collections.deque()
        self._capacity = max(1, queue_records)
        #: Records dropped because the queue was full, in all; and how many of them the
        #: stream has said so in a ``dropped`` record.
        self.dropped = 0
        self._dropped_told = 0
        self._stop = threading.Event()
        self._writer: threading.Thread | None = None
        #: Called (on the flushing thread) at the start of every flush, the writer's ticks
        #: included, to queue what has happened since (the collective probe ends the async
        #: calls it sees completed); it must not raise.
        self.before_flush: Callable[[], None] | None = None
        #: Declarations (``declare``): written again at the head of every later segment,
        #: after its ``segment`` record (the segments before may be rotated away with them).
        self._declared: list[str] = []
        safe_open.make_dirs(prefix.parents[2], prefix.parent)  # RUN_DIR/ranks/rank-N: no symlink followed
        self._fd = self._open(0)
        os.register_at_fork(after_in_child=self._forked)

    @property
    def alive(self) -> bool:
        return self._fd is not None

    @property
    def prefix(self) -> Path:
        """Where its segments go (``HOST-PID``, without the segment and suffix): the
        process's other files go beside it."""
        return self._prefix

    @property
    def writer_thread(self) -> threading.Thread | None:
        """The thread that flushes every FLUSH_INTERVAL (``start_writer``), once started."""
        return self._writer

    def _path(self, index: int) -> Path:
        return self._prefix.with_name(f"{self._prefix.name}.{index:04d}{STREAM_SUFFIX}")

    def _open(self, index: int) -> int:
        return safe_open.create(self._path(index), append=True)

    def _forked(self) -> None:
        """In a forked child: the parent's records and descriptor are the parent's."""
        self._fd, self._writer = None, None
        self._queue.clear()

    # -- the hot path ---------------------------------------------------------------
    def append(self, entry: dict[str, Any] | Line) -> None:
        """Queue a record for the writer: a dict with ``k`` and ``t``, or a Line.
        Costs a length check and a deque append; a full queue drops it and counts."""
        if len(self._queue) < self._capacity:
            self._queue.append(entry)
        else:
            self.dropped += 1

    # -- writing --------------------------------------------------------------------
    def write(self, record: dict[str, Any]) -> None:
        """Write one record now, after everything queued (``k`` and ``t`` are the
        caller's; ``t`` is filled if absent): on disk when this returns."""
        if self._fd is None:
            return
        record.setdefault("t", time.time())
        self.append(record)
        self.flush()

    def write_line(self, line: str) -> None:
        """Write one preformatted record line (``\\n``-terminated) now, after everything
        queued: on disk when this returns."""
        if self._fd is None:
            return
        self.append(Line("%s", (line,)))
        self.flush()

    def declare(self, line: str) -> None:
        """Write a declaration (a call ``shape``, a ``label``: a preformatted record line
        that later records name by id) now, as :meth:`write_line`, and again at the head of
        every later segment."""
        with self._lock:
            self._declared.append(line)
        self.write_line(line)

    def flush(self) -> None:
        """Format and write what is queued, in order, with one ``os.write`` per segment
        touched."""
        try:
            if self.before_flush is not None:
                self.before_flush()
            with self._lock:
                if self._fd is None:
                    self._queue.clear()
                    return
                queue, lines = self._queue, []
                while queue:
                    entry = queue.popleft()
                    lines.append(_encode(entry) if isinstance(entry, dict) else entry.encode())
                if self.dropped != self._dropped_told:
                    self._dropped_told = self.dropped
                    lines.append(_encode({"k": "dropped", "t": time.time(), "records": self.dropped}))
                self._write_lines(lines)
        except Exception as exc:
            self._fail(exc)

    def _write_lines(self, lines: list[str]) -> None:
        """Append lines to the current segment, moving to a new one where it is full.
        Lines are ASCII (``json.dumps`` escapes the rest), so characters are bytes."""
        total = sum(map(len, lines))
        if self._size + total <= self._segment_bytes:  # (most flushes)
            if total:
                self._write_batch(lines)
            return
        batch: list[str] = []
        pending = 0
        for line in lines:
            if not line:
                continue
            used = self._size + pending
            if used and used + len(line) > self._segment_bytes:
                if batch:
                    self._write_batch(batch)
                    batch, pending = [], 0
                self._rotate()
            batch.append(line)
            pending += len(line)
        if batch:
            self._write_batch(batch)

    def _write_batch(self, batch: list[str]) -> None:
        assert self._fd is not None
        data = "".join(batch).encode()
        _write_all(self._fd, data)
        self._size += len(data)

    def _rotate(self) -> None:
        assert self._fd is not None
        os.close(self._fd)
        self._index += 1
        self._fd = self._open(self._index)
        head = _encode({"k": "segment", "t": time.time(), "index": self._index})
        head += "".join(self._declared)
        data = head.encode()
        _write_all(self._fd, data)
        self._size = len(data)
        dropped = self._index - self._keep
        if dropped >= 1:  # segment 0 (the rank's header and configs) is always kept
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(dropped))

    # -- the writer thread ----------------------------------------------------------
    def start_writer(self, interval: float = FLUSH_INTERVAL) -> None:
        """Flush every ``interval`` seconds from a daemon thread (started once, after the
        probes that block signals for their own threads are in place)."""
        if self._writer is not None or self._fd is None:
            return
        self._writer = threading.Thread(target=self._run, args=(interval,), name="lorascope-writer", daemon=True)
        self._writer.start()

    def _run(self, interval: float) -> None:
        """Flush every ``interval`` until the stream stops. ``time.sleep``, not a timed
        ``Event.wait``: the thread wakes 25 times a second for the whole job, and a timed
        wait costs a wake-up twice a sleep's CPU (~150 vs ~78 us on the test VM, where any
        wake-up is dear). A stop is seen at the next tick."""
        while True:
            time.sleep(interval)
            if self._stop.is_set() or self._fd is None:
                return
            if self._queue or self.dropped != self._dropped_told or self.before_flush is not None:
                self.flush()

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
            self._queue.clear()
        self._stop.set()
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
            if self._on_error is not None:
                with contextlib.suppress(Exception):
                    self._on_error(exc)

    def close(self) -> None:
        """Write what is queued, stop the writer and close."""
        self.flush()
        self._stop.set()
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


#: The manifest, read at most (the launches of a run, a few KiB each).
MAX_MANIFEST_BYTES = 16 << 20


@contextlib.contextmanager
def _locked_manifest(run_dir: Path) -> Iterator[dict[str, Any]]:
    """Read-modify-write manifest.json under an flock (several launchers share a run dir
    in a multi-node launch); written to a fresh temporary file and renamed, so it is never
    torn. Nothing is followed through a symlink or read past MAX_MANIFEST_BYTES; a FIFO or
    a device in its place is an OSError, not a wait."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / MANIFEST_FILE
    lock = safe_open.create(run_dir / (MANIFEST_FILE + ".lock"), append=True)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        manifest = _read_manifest(path)
        manifest.setdefault("format", FORMAT_NAME)
        version = manifest.setdefault("version", FORMAT_VERSION)
        if type(version) is int and version < FORMAT_VERSION:
            manifest["version"] = FORMAT_VERSION  # this launch's ranks write the newer format
        if not isinstance(manifest.get("launches"), list):
            manifest["launches"] = []
        yield manifest
        safe_open.replace_file(path, (json.dumps(manifest, indent=2, sort_keys=True, default=repr) + "\n").encode())
    finally:
        os.close(lock)


def _read_manifest(path: Path) -> dict[str, Any]:
    """The manifest so far ({} when there is none or it is unreadable: it is rewritten)."""
    try:
        with safe_open.open_regular(path, inside=path.parent) as f:
            manifest = json.loads(f.read(MAX_MANIFEST_BYTES + 1))
    except (OSError, ValueError, RecursionError, BadInputError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def ensure_manifest(run_dir: Path) -> None:
    """Create manifest.json if no launcher did (``lorascope.attach()`` without ``lorascope run``)."""
    if not (run_dir / MANIFEST_FILE).exists():
        with _locked_manifest(run_dir):
            pass


def _warn_unwritten(run_dir: Path, what: str, exc: BaseException) -> None:
    """One line on stderr: the manifest could not be written; the launch goes on."""
    reason = getattr(exc, "strerror", None) or f"{exc.__class__.__name__}: {exc}"
    with contextlib.suppress(Exception):
        sys.stderr.write(
            f"lorascope: warning: cannot {what} in {run_dir / MANIFEST_FILE} ({reason}); the job is not affected\n"
        )
        sys.stderr.flush()


def record_launch(run_dir: Path, launch_id: str, command: list[str], **fields: Any) -> bool:
    """Add or update this launcher's entry in manifest.json. Never raises (a full disk, a
    read-only or vanished run directory): warns in one line and returns False."""
    try:
        _record_launch(run_dir, launch_id, command, **fields)
    except Exception as exc:
        _warn_unwritten(run_dir, "record the launch", exc)
        return False
    return True


def _record_launch(run_dir: Path, launch_id: str, command: list[str], **fields: Any) -> None:
    with _locked_manifest(run_dir) as manifest:
        entry = next((e for e in manifest["launches"] if isinstance(e, dict) and e.get("id") == launch_id), None)
        if entry is None:
            entry = {
                "id": launch_id,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "command": command,
                "cwd": os.getcwd(),
                "start": time.time(),
                "end": None,
                "exit_status": None,
            }
            manifest["launches"].append(entry)
        entry.update(fields)


def record_attach(run_dir: Path, entry: dict[str, Any]) -> None:
    """Add one ``lorascope attach`` (when, which processes, how each went) to the
    manifest's ``attached`` list (created with the manifest when no launch made one)."""
    with _locked_manifest(run_dir) as manifest:
        manifest.setdefault("attached", []).append(entry)


def record_ranks(run_dir: Path, ranks: dict[str, Any]) -> bool:
    """Fold the per-rank table (pid, host, how it ended) into manifest.json at the end.
    Never raises: warns in one line and returns False."""
    try:
        with _locked_manifest(run_dir) as manifest:
            if not isinstance(manifest.get("ranks"), dict):
                manifest["ranks"] = {}
            manifest["ranks"].update(ranks)
    except Exception as exc:
        _warn_unwritten(run_dir, "record the ranks", exc)
        return False
    return True
