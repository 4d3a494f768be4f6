"""Writing the run directory (probe and launcher side; standard library only).

Streams are append-only JSON Lines written with one ``os.write`` per record on an
``O_APPEND`` descriptor: nothing is buffered in the process, so a SIGKILL at any moment
leaves every record up to the last one in the file (at worst the last line is torn,
which readers skip with a warning). A stream is bounded: past ``segment_bytes`` it moves
to a new segment file, and only the first segment and the newest ``keep_segments`` stay.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lorascope.rundir.schema import FORMAT_NAME, FORMAT_VERSION, MANIFEST_FILE, RANKS_DIR, STREAM_SUFFIX

DEFAULT_SEGMENT_BYTES = 64 * 1024 * 1024
DEFAULT_KEEP_SEGMENTS = 4


def _encode(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, separators=(",", ":"), default=repr) + "\n").encode()


def _write_all(fd: int, data: bytes) -> None:
    """os.write may write less than asked (a full disk, a signal): finish the record."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def stream_prefix(run_dir: Path, rank: int, host: str, pid: int) -> Path:
    """Where a rank process's segments go: ``ranks/rank-R/HOST-PID.NNNN.jsonl``."""
    return run_dir / RANKS_DIR / f"rank-{rank}" / f"{host}-{pid}"


class Stream:
    """One process's append-only record stream. Thread-safe; write() never raises.

    A failed write calls ``on_error`` once and turns the stream off: the job goes on.
    """

    def __init__(
        self,
        prefix: Path,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        keep_segments: int = DEFAULT_KEEP_SEGMENTS,
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        self._prefix = prefix
        self._segment_bytes = segment_bytes
        self._keep = max(1, keep_segments)
        self._on_error = on_error
        self._lock = threading.RLock()  # re-entered by a signal handler mid-write
        self._index = 0
        self._size = 0
        self._fd: int | None = None
        prefix.parent.mkdir(parents=True, exist_ok=True)
        self._fd = self._open(0)

    @property
    def alive(self) -> bool:
        return self._fd is not None

    def _path(self, index: int) -> Path:
        return self._prefix.with_name(f"{self._prefix.name}.{index:04d}{STREAM_SUFFIX}")

    def _open(self, index: int) -> int:
        return os.open(self._path(index), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (``k`` and ``t`` are the caller's; ``t`` is filled if absent)."""
        if self._fd is None:
            return
        record.setdefault("t", time.time())
        try:
            self.write_line(_encode(record))
        except Exception as exc:
            self._fail(exc)

    def write_line(self, data: bytes) -> None:
        """Append one record already encoded as a JSON line (the collectives' hot path
        formats its own); never raises."""
        try:
            with self._lock:
                if self._fd is None:
                    return
                if self._size and self._size + len(data) > self._segment_bytes:
                    self._rotate()
                _write_all(self._fd, data)
                self._size += len(data)
        except Exception as exc:
            self._fail(exc)

    def _rotate(self) -> None:
        assert self._fd is not None
        os.close(self._fd)
        self._index += 1
        self._fd = self._open(self._index)
        head = _encode({"k": "segment", "t": time.time(), "index": self._index})
        _write_all(self._fd, head)
        self._size = len(head)
        dropped = self._index - self._keep
        if dropped >= 1:  # segment 0 (the rank's header and configs) is always kept
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(dropped))

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
            if self._on_error is not None:
                with contextlib.suppress(Exception):
                    self._on_error(exc)

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


@contextlib.contextmanager
def _locked_manifest(run_dir: Path) -> Iterator[dict[str, Any]]:
    """Read-modify-write manifest.json under an flock (several launchers share a run dir
    in a multi-node launch); written to a temporary file and renamed, so it is never torn."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / MANIFEST_FILE
    with open(run_dir / (MANIFEST_FILE + ".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            manifest = json.loads(path.read_text()) if path.exists() else {}
        except (OSError, ValueError):
            manifest = {}
        manifest.setdefault("format", FORMAT_NAME)
        manifest.setdefault("version", FORMAT_VERSION)
        manifest.setdefault("launches", [])
        yield manifest
        tmp = path.with_name(f".{MANIFEST_FILE}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True, default=repr) + "\n")
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):  # a full disk: leave no partial file behind
                tmp.unlink()
            raise


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
        entry = next((e for e in manifest["launches"] if e.get("id") == launch_id), None)
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


def record_ranks(run_dir: Path, ranks: dict[str, Any]) -> bool:
    """Fold the per-rank table (pid, host, how it ended) into manifest.json at the end.
    Never raises: warns in one line and returns False."""
    try:
        with _locked_manifest(run_dir) as manifest:
            manifest.setdefault("ranks", {}).update(ranks)
    except Exception as exc:
        _warn_unwritten(run_dir, "record the ranks", exc)
        return False
    return True
