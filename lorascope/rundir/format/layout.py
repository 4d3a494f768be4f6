"""The binary layout of a rank's call file and steps file: the one place it is spelled.

A rank process's collective calls are fixed-width records in ``HOST-PID.calls``, beside its
JSON Lines stream, written in place by the thread that made the call (a shared ``mmap``, or
``pwrite`` where one cannot be had): there the instant it is written, so it survives
SIGKILL, ``abort()``, a segfault and the OOM killer. A call's end is written into its own
record when it comes. What a call shares with the same call at every step (op, bytes,
dtype, async, site, via: its *shape*; not its size, which varies with a batch) is a ``shape`` record of the stream, named here by
its id; a call's error is a ``coll_err`` record naming the call's index.

The file is a header and then slots: the first ``head`` records stay where they were
written; every later one goes round a ring of ``ring`` slots, overwriting the oldest, so a
call file never grows past its header plus ``head + ring`` slots. A record carries a stamp
(its index plus one, modulo 2**32) that says which index a slot holds: a slot whose
stamp is not the one expected was never written, or is being overwritten.

A rank process's steps and phase edges are fixed-width records of ``HOST-PID.steps``
(:data:`STEP_FIELDS`), written in place the same way by the same writer: the same header,
no ring (``ring`` 0: every record stays where it was written; the file grows a chunk at a
time). A record's ``label`` names a phase (``forward``, ``eval`` ...) or a step's source
(``deepspeed``, ``torch``) by the id of the stream's ``label`` record that holds the text.

A rank process's memory readings are fixed-width records of ``HOST-PID.mem``
(:data:`MEM_FIELDS`), written the same way (no ring): RSS, the C heap in use and the CUDA
caching allocator's counters, -1 where a reading has no such figure; its ``src`` (the phase
edge, ``sampler``) is a ``label`` record's id as a steps-file record's label is. The rare
NVML part of a sampler's reading is an ``nvml`` record of the stream naming the reading's
index.

The writer (:mod:`lorascope.rundir.format.callfile`), the readers and docs/run-format.md
all read the tables below; the readers build their numpy dtypes from :data:`CALL_FIELDS`,
:data:`STEP_FIELDS` and :data:`MEM_FIELDS`.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

#: The first bytes of a call file.
MAGIC = b"LSCALLS\0"
#: The call file's own version (the run directory's is FORMAT_VERSION in schema.py).
CALLS_VERSION = 1

#: (field, struct code, meaning), little-endian, in order.
HEADER_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("magic", "8s", "MAGIC"),
    ("version", "I", "CALLS_VERSION"),
    ("record_size", "I", "bytes per call record (CALL.size)"),
    ("head", "Q", "slots kept from the start: records 0 .. head-1 are never overwritten"),
    ("ring", "Q", "slots after them, reused in turn by records head, head+1, ..."),
    ("count", "Q", "records begun so far (written after each record; a hint, stamps decide)"),
    ("created", "d", "epoch seconds the file was made"),
    ("reserved", "24s", "zero"),
)
#: One call, as its thread wrote it.
CALL_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("t", "d", "epoch seconds the call began"),
    ("end", "d", "epoch seconds it ended; 0.0 while it has not"),
    ("seq", "q", "the call's number in its group"),
    ("bytes", "q", "the rank's payload in bytes; -1 where unknown"),
    ("step", "i", "steps this rank had completed when the call began"),
    ("gid", "i", "its group, as the stream's group record with this gid"),
    ("shape", "i", "the id of the stream's shape record that describes it"),
    ("stamp", "I", "(index + 1) mod 2**32: which record the slot holds"),
)

#: One step's end or phase edge, as its thread wrote it.
STEP_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("t", "d", "epoch seconds of the phase edge, or when the step's record was made"),
    ("dur", "d", "a step: its wall seconds (6 decimals); a phase edge: 0.0"),
    ("loss", "d", "a step: its loss; NaN when none was read then (a stream 'loss' record may give it)"),
    (
        "waited",
        "d",
        "seconds the process's threads were blocked on async collectives' handles since the step began "
        "(Work.wait, wait_tensor; a step: all of it); 0.0: none, or not recorded",
    ),
    ("step", "i", "a step: its number, from 1; a phase edge: steps this rank had completed"),
    ("label", "i", "the id of the stream's label record: the phase's name, or the step's source"),
    ("kind", "I", "STEP_KINDS: 0 a phase begins, 1 a phase ends, 2 a step ends"),
    ("stamp", "I", "(index + 1) mod 2**32: which record the slot holds"),
)
#: A steps-file record's ``kind``: its index here (a phase edge's is its ``edge``).
STEP_KINDS = ("begin", "end", "step")
BEGIN, END, STEP_END = range(len(STEP_KINDS))

#: One memory reading, as its thread wrote it (-1: the reading has no such figure).
MEM_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("t", "d", "epoch seconds the reading was written"),
    ("rss", "q", "the process's resident set size in bytes; -1: not read"),
    ("heap", "q", "the C heap's bytes in use (glibc mallinfo2); -1: not read"),
    ("alloc", "q", "the CUDA caching allocator's allocated bytes on the rank's device; -1: no CUDA"),
    ("reserved", "q", "its reserved bytes; -1: no CUDA"),
    ("max_alloc", "q", "its peak allocated bytes; -1: no CUDA"),
    ("step", "i", "steps this rank had completed (a step's end: the step's number)"),
    ("device", "i", "the rank's CUDA device index; -1: no CUDA (then no CUDA field is read)"),
    ("src", "i", "the id of the stream's label record naming where it was read (forward.begin, sampler)"),
    ("stamp", "I", "(index + 1) mod 2**32: which record the slot holds"),
)


def _struct(fields: tuple[tuple[str, str, str], ...]) -> struct.Struct:
    return struct.Struct("<" + "".join(code for _, code, _ in fields))


HEADER = _struct(HEADER_FIELDS)
CALL = _struct(CALL_FIELDS)
STEP = _struct(STEP_FIELDS)
#: The first bytes of a steps file, and its own version.
STEPS_MAGIC = b"LSSTEPS\0"
STEPS_VERSION = 2
#: Version 1 of the steps file (lorascope 0.3.0): the same records without ``waited``;
#: still read (``waited`` 0.0: not recorded).
STEP_FIELDS_V1 = tuple(f for f in STEP_FIELDS if f[0] != "waited")
STEP_V1 = _struct(STEP_FIELDS_V1)
#: A steps file's slots: every record in the head (no ring; 2**39 records is no bound a
#: run reaches), so that the call file's slot arithmetic serves it unchanged.
STEPS_HEAD = 1 << 39
STEPS_RING = 0
MEM = _struct(MEM_FIELDS)
#: The first bytes of a memory file, and its own version; its slots are a steps file's.
MEM_MAGIC = b"LSMEMRY\0"
MEM_VERSION = 1


def offset_of(fields: tuple[tuple[str, str, str], ...], name: str) -> int:
    """Byte offset of a field in a record laid out by ``fields``."""
    at = 0
    for field, code, _ in fields:
        if field == name:
            return at
        at += struct.calcsize("<" + code)
    raise KeyError(name)


#: Where the header's ``count`` is, and a call's ``end``.
COUNT_OFFSET = offset_of(HEADER_FIELDS, "count")
END_OFFSET = offset_of(CALL_FIELDS, "end")
STAMP_MASK = 0xFFFFFFFF

#: Slots kept from the start, and in the ring, by default: ~20 steps of a ZeRO-3 job's
#: calls whole, and the newest 262,144 calls (13 MiB at 48 bytes a call; a 1,024-rank job
#: holds at most 13 GiB of call files however long it runs).
DEFAULT_HEAD = 1 << 14
DEFAULT_RING = 1 << 18


def slot_of(index: int, head: int, ring: int) -> int:
    """The slot record ``index`` is written to."""
    return index if index < head else head + (index - head) % ring


def slot_runs(first: int, stop: int, head: int, ring: int) -> Iterator[tuple[int, int, int]]:
    """Records ``first`` .. ``stop - 1`` as runs of adjacent slots: (first index, its
    slot, how many); a run ends where the head ends and where the ring wraps."""
    index = first
    while index < stop:
        slot = slot_of(index, head, ring)
        run = min(stop - index, (head if index < head else head + ring) - slot)
        yield index, slot, run
        index += run


def file_size(head: int, ring: int, record: struct.Struct = CALL) -> int:
    return HEADER.size + (head + ring) * record.size
