"""Reading a rank's call file (analysis side): its records as numpy columns.

The layout is :mod:`lorascope.rundir.format.layout`'s tables; the numpy dtypes here are
built from them, never spelled again. A call file is read whole (~40 bytes a call): the
header is checked (magic, version, record size; a bad one is a one-line warning and the
rank's calls are not read), then the first ``head`` slots and the ring's slots are taken in
index order, each kept only if its stamp names the index the slot should hold by then. A
slot whose stamp does not was never written, or was being overwritten when the process
died (torn): it is dropped. A file cut short is read as far as it goes, with a warning.

What is not kept is known by index (:attr:`CallRecords.missing`): the calls a ring went
round over (``rank R: calls N..M not kept (the ring holds the newest K)``) and the slots
dropped. The reduction (:mod:`lorascope.rundir.loading.callreduce`) turns those into
sequence ranges per group that alignment compares no rank over.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path

import numpy as np

from lorascope.errors import BadInputError
from lorascope.rundir.format.layout import (
    CALL,
    CALL_FIELDS,
    CALLS_VERSION,
    HEADER,
    HEADER_FIELDS,
    MAGIC,
    MEM,
    MEM_FIELDS,
    MEM_MAGIC,
    MEM_VERSION,
    STAMP_MASK,
    STEP,
    STEP_FIELDS,
    STEP_FIELDS_V1,
    STEP_V1,
    STEPS_MAGIC,
    STEPS_VERSION,
    slot_runs,
)
from lorascope.rundir.format.safe_open import open_regular


def _numpy_code(code: str) -> str:
    """A struct code (little-endian) as numpy spells it: ``8s`` -> ``S8``, ``q`` -> ``<q``."""
    return "S" + code[:-1] if code.endswith("s") else "<" + code


def dtype_of(fields: tuple[tuple[str, str, str], ...]) -> np.dtype[np.void]:
    """The packed numpy dtype of a record laid out by ``fields`` (layout.py's tables)."""
    return np.dtype([(name, _numpy_code(code)) for name, code, _ in fields])


def stable_order(values: np.ndarray) -> np.ndarray:
    """``np.argsort(values, kind="stable")``, without the sort where the values are in order
    already (a rank's calls are, unless a ring went round or threads raced: ~10 ms a
    rank-thousand-steps saved)."""
    if len(values) < 2 or bool((values[1:] >= values[:-1]).all()):
        return np.arange(len(values))
    return np.argsort(values, kind="stable")


#: A call file's header and one call, and a steps file's record, as numpy reads them.
HEADER_DTYPE = dtype_of(HEADER_FIELDS)
CALL_DTYPE = dtype_of(CALL_FIELDS)
STEP_DTYPE = dtype_of(STEP_FIELDS)
MEM_DTYPE = dtype_of(MEM_FIELDS)
assert HEADER_DTYPE.itemsize == HEADER.size and CALL_DTYPE.itemsize == CALL.size and STEP_DTYPE.itemsize == STEP.size
assert MEM_DTYPE.itemsize == MEM.size


@dataclass(frozen=True)
class FileKind:
    """What tells one kind of slot file from another (layout.py): what its records are
    called in a warning, its magic, version and record."""

    noun: str
    magic: bytes
    version: int
    record: struct.Struct
    dtype: np.dtype[np.void]


CALLS = FileKind("call", MAGIC, CALLS_VERSION, CALL, CALL_DTYPE)
STEPS = FileKind("step", STEPS_MAGIC, STEPS_VERSION, STEP, STEP_DTYPE)
#: A steps file of lorascope 0.3.0 (no ``waited``).
STEPS_V1 = FileKind("step", STEPS_MAGIC, 1, STEP_V1, dtype_of(STEP_FIELDS_V1))
MEMORY = FileKind("memory", MEM_MAGIC, MEM_VERSION, MEM, MEM_DTYPE)


@dataclass
class CallRecords:
    """The calls kept of one call file, in index order: ``records`` (CALL_DTYPE) and their
    indexes; ``last``: the highest index begun (-1: none); ``missing``: inclusive index
    ranges below it not kept; ``lost``: the range the ring went round over (None: none)."""

    records: np.ndarray
    index: np.ndarray
    head: int
    ring: int
    last: int = -1
    missing: list[tuple[int, int]] = field(default_factory=list)
    lost: tuple[int, int] | None = None

    def __len__(self) -> int:
        return len(self.index)


def empty(head: int = 0, ring: int = 0, dtype: np.dtype[np.void] = CALL_DTYPE) -> CallRecords:
    return CallRecords(np.zeros(0, dtype), np.zeros(0, np.int64), head, ring)


def read_header(raw: bytes, where: str, kind: FileKind = CALLS) -> tuple[int, int, int]:
    """(head, ring, count) of a call file's (or another ``kind``'s) first bytes;
    BadInputError (one line) when they are not such a file this lorascope reads. A ring of
    0 is none: every record is in the head."""
    noun = kind.noun
    if len(raw) < HEADER.size:
        raise BadInputError(f"{where}: a {noun} file cut before the end of its header ({len(raw)} bytes)")
    magic, version, size, head, ring, count, *_ = HEADER.unpack_from(raw)
    if magic != kind.magic:
        raise BadInputError(f"{where}: not a {noun} file (its first bytes are {magic[:8]!r})")
    if version != kind.version:
        raise BadInputError(f"{where}: {noun} file version {version}; this lorascope reads version {kind.version}")
    if size != kind.record.size:
        raise BadInputError(f"{where}: {noun} records of {size} bytes; version {kind.version} has {kind.record.size}")
    if (ring < 1 and head < 1 << 30) or head + ring >= 1 << 40:
        raise BadInputError(f"{where}: a {noun} file header with head {head} and ring {ring}")
    return head, ring, count


def file_version(path: Path) -> int | None:
    """The version a slot file's header gives (None: no header could be read; reading
    the file then says why)."""
    try:
        with open_regular(path, inside=path.parent) as f:
            raw = f.read(HEADER.size)
    except (OSError, BadInputError):
        return None
    return int(HEADER.unpack_from(raw)[1]) if len(raw) == HEADER.size else None


#: Slots read past the header's count: records begun while the count was behind them.
#: A writing thread stores its record, then the count, so each thread writing when the
#: process stopped leaves at most one: 64 is more threads recording at once than a job
#: has. The rest of the file's grown chunk (up to CHUNK_SLOTS) is unwritten: not read.
COUNT_SLACK = 64


def read_calls(
    path: Path, who: str, warnings: list[str], summed: str = "", kind: FileKind = CALLS, newest: int | None = None
) -> CallRecords:
    """The kept calls of the call file at ``path`` (``who``: ``rank R``, for the warnings;
    ``kind``: another kind of slot file, its records in ``records``);
    a file that cannot be read, or whose header is bad, is warned and reads as no calls.
    Only the slots written so far are read (the header's count, and COUNT_SLACK more): a
    call file is made at its full size, sparse, and may be cut after its last slot written
    (a writer that closes it may give the rest back); shorter than its count says, it is
    read as far as it goes, with a warning. With ``newest``, only the newest that many
    records are read (:func:`_newest`): what `lorascope hang` needs of a long run."""
    try:
        with open_regular(path, inside=path.parent) as f:
            size = os.fstat(f.fileno()).st_size
            header = f.read(HEADER.size)
            try:
                head, ring, count = read_header(header, str(path), kind)
            except BadInputError as exc:
                warnings.append(f"{exc}; {who}'s {kind.noun}s are not read")
                return empty(dtype=kind.dtype)
            slots = (size - HEADER.size) // kind.record.size
            if slots < min(head + ring, count):  # a file may end after its last slot written, not before
                warnings.append(
                    f"{path}: the {kind.noun} file is cut short ({max(slots, 0):,} of the "
                    f"{min(head + ring, count):,} slots its header says were written); read as far as it goes"
                )
            if newest is not None and count > newest and (not ring or ring > newest):
                return _newest(f.fileno(), head, ring, count, newest, who, warnings, kind)
            want = min(head + ring, count + COUNT_SLACK)
            raw = f.read(want * kind.record.size)
    except (OSError, BadInputError) as exc:
        why = getattr(exc, "strerror", None) or exc
        warnings.append(f"{who}: its {kind.noun} file {path} is unreadable ({why}); its {kind.noun}s are not read")
        return empty(dtype=kind.dtype)
    table = np.frombuffer(raw, kind.dtype, count=len(raw) // kind.record.size)
    return kept(table, head, ring, count, who, warnings, summed, kind.noun)


def _newest(
    fd: int, head: int, ring: int, count: int, newest: int, who: str, warnings: list[str], kind: FileKind
) -> CallRecords:
    """The newest ``newest`` records of the open slot file ``fd`` (its header's ``head``,
    ``ring`` (0, or more than ``newest``) and ``count``), and those begun past its count
    (COUNT_SLACK, as many as the ring holds besides), each kept only if its stamp names its
    index; the indexes below them are ``lost`` (not warned: the reader chose not to read
    them), a hole among them is warned as :func:`kept` warns it. OSError when a read fails."""
    first = count - newest
    stop = count + min(COUNT_SLACK, ring - newest) if ring else min(head, count + COUNT_SLACK)
    records, index, _ = decode(read_runs(fd, head, ring, stop, first, [], stop - first, kind.record.size), kind)
    # the calls below the window were begun (the count says so), read or not: with every
    # slot of the window torn, the newest still is the count's
    last = max(int(index.max(initial=-1)), first - 1)
    if last < count - 1 <= last + (ring or head):  # begun (the count is written after a record), not whole
        last = count - 1
    if ring:  # a slot a newer record had begun to overwrite: torn
        whole = (index < head) | (index > last - ring)
        records, index = records[whole], index[whole]
    order = stable_order(index)
    out = CallRecords(records[order], index[order], head, ring, last, lost=(0, first - 1) if first else None)
    present = np.zeros(max(last + 1 - first, 0), dtype=bool)
    present[out.index - first] = True
    _note_missing(out, np.flatnonzero(~present) + first, who, warnings, kind.noun)
    return out


def _note_missing(out: CallRecords, at: np.ndarray, who: str, warnings: list[str], noun: str) -> None:
    """The indexes ``at`` (sorted), torn or never written, as ``out``'s missing ranges
    (warned), with the range it did not keep (``lost``)."""
    if len(at):
        runs = np.split(at, np.flatnonzero(np.diff(at) != 1) + 1)
        out.missing = [(int(r[0]), int(r[-1])) for r in runs]
        warnings.append(
            f"{who}: {len(at):,} {noun} record(s) torn or never written (the process stopped while writing "
            f"them?), the first at index {int(at[0]):,}: not read"
        )
    if out.lost is not None:
        out.missing = sorted([*out.missing, out.lost])


def kept(
    table: np.ndarray,
    head: int,
    ring: int,
    count: int,
    who: str,
    warnings: list[str],
    summed: str = "",
    noun: str = "call",
) -> CallRecords:
    """The records of a call file's slots ``table`` whose stamps say they hold the index
    expected, in index order, and what is missing (warned)."""
    stamps = table["stamp"].astype(np.int64)
    n_head = min(head, len(table))
    head_index = np.arange(n_head, dtype=np.int64)
    head_ok = stamps[:n_head] == (head_index + 1) & STAMP_MASK
    # The ring: each stamp read as the index nearest the header's count (a hint) whose low
    # 32 bits + 1 it holds; a slot holds that index only if the index falls in that slot.
    ring_slots = np.arange(n_head, len(table), dtype=np.int64) - head
    ring_stamps = stamps[n_head:]
    hint = max(count - 1, head)
    delta = ((ring_stamps - 1 - hint) & STAMP_MASK).astype(np.int64)
    delta[delta >= 1 << 31] -= 1 << 32
    ring_index = hint + delta
    ring_ok = (ring_stamps != 0) & (ring_index >= head) & ((ring_index - head) % max(ring, 1) == ring_slots)
    last = max(int(head_index[head_ok][-1]) if head_ok.any() else -1, int(ring_index[ring_ok].max(initial=-1)))
    if last < count - 1 <= last + (ring or head):  # begun (the count is written after a record), not whole
        last = count - 1
    # a ring slot whose index is a lap or more behind the newest was being overwritten:
    # the newer call took its index, and its record was not whole when the process stopped
    ring_ok &= ring_index > last - ring
    index = np.concatenate((head_index[head_ok], ring_index[ring_ok]))
    whole = table.view(np.dtype((np.void, table.dtype.itemsize)))  # records copied as bytes: ~8x a field-wise copy
    records = np.concatenate((whole[:n_head][head_ok], whole[n_head:][ring_ok]))
    order = stable_order(index)
    index, records = index[order], records[order]
    out = CallRecords(records.view(table.dtype), index, head, ring, last)
    if last < 0:
        return out
    if last - ring >= head:
        out.lost = (head, last - ring)
        warnings.append(
            f"{who}: {noun}s {head:,}..{last - ring:,} not kept (the ring holds the newest {ring:,}){summed}"
        )
    # the indexes up to the newest that should be here, and are not
    expected = np.zeros(min(head, last + 1), dtype=bool)
    expected[: min(n_head, len(expected))] = head_ok[: len(expected)]
    holes = [np.flatnonzero(~expected)]
    ring_lo = max(head, last - ring + 1)
    if last >= ring_lo:
        present = np.zeros(last + 1 - ring_lo, dtype=bool)
        present[index[index >= ring_lo] - ring_lo] = True
        holes.append(np.flatnonzero(~present) + ring_lo)
    _note_missing(out, np.concatenate(holes), who, warnings, noun)
    return out


#: Records read from a slot file: (the first one's index, the bytes of adjacent slots).
Run = tuple[int, bytes]


def read_since(
    path: Path, since: int, pending: list[int], most: int | None = None, kind: FileKind = CALLS
) -> tuple[int, list[Run]] | None:
    """For a follower (`lorascope watch`): the records of indexes ``since`` up to the
    header's count (the newest ``most`` of them at most), and those of the ``pending``
    indexes again (their ends may have been written since), as they are in the file: runs
    of adjacent slots, each read with one ``pread`` (the common look: one run); returns
    (the count, the runs), or None when the file is not (yet) a call file (``kind``:
    another kind of slot file, a steps file). Indexes a ring went round over are skipped;
    the stamps are checked by :func:`decode`, which takes the runs of many files at once."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            head, ring, count = read_header(os.pread(fd, HEADER.size, 0), str(path), kind)
        except BadInputError:
            return None
        return count, read_runs(fd, head, ring, count, since, pending, most, kind.record.size)
    except OSError:
        return None
    finally:
        os.close(fd)


def read_runs(
    fd: int, head: int, ring: int, count: int, since: int, pending: list[int], most: int | None, size: int
) -> list[Run]:
    """:func:`read_since`'s runs, of the open slot file ``fd`` whose header says ``head``,
    ``ring`` and ``count`` (records of ``size`` bytes). OSError when a read fails."""
    first = max(since, count - ring, 0) if count > head else since
    if most is not None:
        first = max(first, count - most)
    if not pending and first < count and (count <= head or not ring):  # the common look: one run
        raw = os.pread(fd, (count - first) * size, HEADER.size + first * size)
        whole = len(raw) - len(raw) % size
        return [(first, raw if whole == len(raw) else raw[:whole])] if whole else []
    spans: list[list[int]] = []  # [first, stop) index ranges: the earlier pending ones, then the new
    for index in sorted(i for i in pending if i < first):
        if spans and spans[-1][1] == index:
            spans[-1][1] += 1
        else:
            spans.append([index, index + 1])
    if spans and spans[-1][1] == first:
        spans[-1][1] = count
    else:
        spans.append([first, count])
    runs = []
    for lo, hi in spans:
        for index, slot, n in slot_runs(lo, hi, head, ring):
            raw = os.pread(fd, n * size, HEADER.size + slot * size)
            whole = len(raw) - len(raw) % size
            if whole:
                runs.append((index, raw if whole == len(raw) else raw[:whole]))
    return runs


def decode(runs: list[Run], kind: FileKind = CALLS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs of records (of one slot file or many of a ``kind``) decoded in one pass: (the
    records, their indexes, the position in ``runs`` each came from), in the order given;
    a record whose stamp does not name its index (never written, or overwritten since) is
    left out (the common look has none: then nothing is copied)."""
    size = kind.record.size
    firsts = np.fromiter(map(itemgetter(0), runs), np.int64, len(runs))
    raws = list(map(itemgetter(1), runs))
    lengths = np.fromiter(map(len, raws), np.int64, len(runs)) // size
    table = np.frombuffer(b"".join(raws), kind.dtype)
    starts = np.cumsum(lengths) - lengths
    index = np.arange(len(table), dtype=np.int64) + np.repeat(firsts - starts, lengths)
    of = np.repeat(np.arange(len(runs)), lengths)
    ok = table["stamp"] == (index + 1) & STAMP_MASK
    if ok.all():
        return table, index, of
    whole = table.view(np.dtype((np.void, size)))  # records copied as bytes: ~8x a field-wise copy
    return whole[ok].view(kind.dtype), index[ok], of[ok]
