"""What a file is, by its content (its name only breaks ties): the artifact kinds.

- ``rundir``: a lorascope run directory (a folder with ``manifest.json``);
- ``snapshot``: an allocator snapshot pickle (``segments`` / ``device_traces``);
- ``flight``: a flight-recorder dump, pickle or JSON (``pg_config`` / ``entries`` with
  ``collective_seq_id``);
- ``kineto``: a Kineto Chrome trace, JSON or gzipped JSON (``traceEvents``);
- ``log``: text (a job's log; the log reader then checks it looks like one).

Only the first :data:`HEAD` bytes are read (decompressed for gzip), so sniffing a folder
of large files is cheap.
"""

from __future__ import annotations

import zlib
from pathlib import Path

from lorascope.rundir.format.safe_open import open_regular
from lorascope.rundir.format.schema import MANIFEST_FILE

KINDS = ("rundir", "snapshot", "kineto", "flight", "log")
HEAD = 256 * 1024

_SNAPSHOT_KEYS = (b"device_traces", b"segments", b"total_size", b"allocator_settings")
_FLIGHT_KEYS = (b"pg_config", b"collective_seq_id", b"pg_status", b"profiling_name")


def head_bytes(path: Path) -> bytes:
    """The first HEAD bytes of the file's content (gunzipped when it is gzip). Only
    regular files are opened (a FIFO or a device is a one-line BadInputError)."""
    with open_regular(path) as f:
        raw = f.read(HEAD)
    if raw[:2] == b"\x1f\x8b":
        try:
            return zlib.decompressobj(zlib.MAX_WBITS | 16).decompress(raw, HEAD)
        except zlib.error:
            return b""
    return raw


def _is_text(head: bytes) -> bool:
    if not head or b"\x00" in head:
        return False
    text = head.decode("utf-8", "replace")
    bad = text.count("\ufffd") + sum(1 for c in text if ord(c) < 32 and c not in "\t\n\r\f\x1b")
    return bad <= len(text) // 100


def _looks_like_json(head: bytes) -> bool:
    """An object, or an array of objects/arrays/strings (a log line may start with "[")."""
    stripped = head.lstrip()
    return stripped[:1] == b"{" or (stripped[:1] == b"[" and stripped[1:].lstrip()[:1] in (b"{", b"[", b'"'))


def detect_kind(path: Path) -> str | None:
    """The kind of PATH, or None when it is none of them."""
    if path.is_dir():
        return "rundir" if (path / MANIFEST_FILE).is_file() else None
    head = head_bytes(path)
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        if any(k in head for k in _FLIGHT_KEYS):
            return "flight"
        if any(k in head for k in _SNAPSHOT_KEYS):
            return "snapshot"
        return None
    if _looks_like_json(head):
        if b'"traceEvents"' in head or (b'"schemaVersion"' in head and b'"ph"' in head):
            return "kineto"
        if any(b'"' + k + b'"' in head for k in _FLIGHT_KEYS):
            return "flight"
        return None
    if _is_text(head):
        return "log"
    return None


def describe_unknown(path: Path) -> str:
    """Why PATH is none of the kinds, in words."""
    if path.is_dir():
        return "a folder with nothing lorascope knows in it"
    try:
        size = path.stat().st_size
    except OSError:
        size = -1
    if size == 0:
        return "an empty file"
    head = head_bytes(path)
    if not head and size > 0:
        return "a gzip file that does not decompress (truncated or corrupt)"
    if head[:1] == b"\x80":
        return "a pickle, but neither an allocator snapshot nor a flight-recorder dump"
    if _looks_like_json(head):
        return "JSON, but neither a Kineto trace nor a flight-recorder dump"
    return "binary data of no known kind"
