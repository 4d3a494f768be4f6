"""Ranks whose answers agree, read a few at a time.

Reading a rank's records takes a few milliseconds (its stream, its call, steps and memory
files, its flight recorder's tail): at 1,024 ranks, seconds, while nearly all of them wait
in the same place. A rank's answer to a dump request (its ``dump`` record) says where it
is: the calls in flight (process group, number, op, size, call site, peer), the calls made
so far on each process group (``made``), its main thread's stack and its step. Ranks whose
answers agree in all of these are alike: the first READ_ALIKE of them to answer are read
whole, and each of the others is told by a copy of the first one's records, under its own
rank, host, pid and start record and with its own answer, so that the diagnosis counts
and names every rank as its own. A dump without ``made`` (a probe before it) is read whole.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Mapping
from dataclasses import fields, replace
from typing import Any, cast

from lorascope.detect.hang.diagnosis import FlightTimeline, main_thread_frames
from lorascope.rundir.format.schema import SchemaError, validate_record
from lorascope.rundir.loading.reader import RankData, RunData
from lorascope.rundir.loading.records import DumpRecord, StartRecord

#: Ranks read whole of each kind of answer (the rest are told by the first's records).
READ_ALIKE = 4
#: The fields of a call in flight that alike answers share (not ``since``: how long).
CALL_FIELDS = ("group", "seq", "op", "bytes", "site", "peer")


def answer_key(dump: Mapping[str, Any]) -> Hashable | None:
    """What ranks with alike answers share, from a ``dump`` record: its reason and step, the
    calls made per group, the calls in flight and the main thread's frames; None when the
    dump cannot be told from others' (no ``made``: an older probe; a field of another type)."""
    made, pending, stacks = dump.get("made"), dump.get("pending"), dump.get("stacks")
    if not isinstance(made, dict) or not isinstance(pending, list) or not isinstance(stacks, str):
        return None
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in made.values()):
        return None
    if not all(isinstance(call, dict) for call in pending):
        return None
    calls = sorted(tuple(repr(call.get(f)) for f in CALL_FIELDS) for call in pending)
    frames = tuple(m.group(0) for m in main_thread_frames(stacks))
    return (repr(dump.get("reason")), repr(dump.get("step")), tuple(sorted(made.items())), tuple(calls), frames)


def answer_record(dump: Mapping[str, Any]) -> DumpRecord | None:
    """The ``dump`` record as the reader keeps it (validated), or None when it is not one."""
    try:
        return cast(DumpRecord, dump) if dump.get("k") == "dump" and validate_record(dict(dump)) else None
    except SchemaError:
        return None


def stand_in(read: RankData, rank: int, start: StartRecord, answer: DumpRecord) -> RankData:
    """Rank ``rank`` told by ``read``'s records (an alike rank read whole): its own start
    record and answer, ``read``'s calls, steps and memory (each list and table a copy, so
    that aligning one rank changes no other), nothing of ``read``'s own (dumps, files,
    endings, errors: it answered, so it is alive)."""
    own: dict[str, Any] = {
        f.name: copy.copy(v) for f in fields(read) if isinstance(v := getattr(read, f.name), (list, dict))
    }
    own.update(
        {
            "rank": rank,
            "start": start,
            "files": [],
            "dumps": [answer],
            "flight_dumps": [],
            "warnings": [],
            "probe_errors": [],
            "trace_files": [],
            "snapshots": [],
            "exception": None,
            "signal": None,
            "end": None,
            "stall": None,
            "fatal": None,
            "dist_init": None,
            "calls_file": None,
            "last_time": max(read.last_time, float(answer["t"])),
            "told_by": read.rank,
        }
    )
    return replace(read, **own)


def told_flights(run: RunData, flight: FlightTimeline) -> FlightTimeline:
    """``flight`` with each told rank given the flight-recorder dumps of the rank that
    tells it (under its own rank number): the diagnosis aligns and counts every rank."""
    out = dict(flight)
    for n, rank in run.ranks.items():
        if rank.told_by is not None and rank.told_by in flight:
            out[n] = [(t, replace(dump, rank=n)) for t, dump in flight[rank.told_by]]
    return out


def told_note(run: RunData) -> list[str]:
    """What was read of the ranks: a line when some were told by alike ranks' records."""
    told = sum(1 for r in run.ranks.values() if r.told_by is not None)
    if not told:
        return []
    return [
        f"{told:,} of {len(run.ranks):,} ranks told by the records of alike ranks (the same calls in flight and made, "
        f"stack and step in their answers; {len(run.ranks) - told:,} ranks read whole): `--read-all` reads each"
    ]
