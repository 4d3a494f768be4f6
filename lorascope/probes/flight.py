"""The flight recorder and stacks, when a rank ends by an exception or a signal.

torch keeps the last ``TORCH_FR_BUFFER_SIZE`` collectives of each process group in its
flight recorder (gloo included); ``lorascope run`` sets that variable for the job when
it is unset. The dump is written as torch writes it (a pickle of plain data) next to
the rank's stream, and beside it its tail: the same dump with only each group's
collectives from a few before its last completed one on, which is what `lorascope hang`
aligns the ranks by (a dump of torch's size takes ~90 ms to read safely: at 1,024
ranks, a minute and a half before a verdict).
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lorascope.probes.session import Session
from lorascope.rundir.format.safe_pickle import loads_pickle

ENV_BUFFER = "TORCH_FR_BUFFER_SIZE"
DEFAULT_BUFFER = "2000"
#: The completed collectives of each process group a dump's tail keeps, from its last
#: completed one back. A collective completes on a rank once every rank of its group
#: enqueued it, so the tails of a hung job's ranks share a collective in every group.
TAIL_DONE = 8
#: The collectives kept of a group whose progress the dump does not state: its last ones.
TAIL_ENTRIES = 64


def dump_flight_recorder(session: Session, out_prefix: Path, reason: str) -> None:
    """Write torch's flight-recorder dump, if torch.distributed has one to give, and its tail."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    dump = getattr(sys.modules["torch"]._C._distributed_c10d, "_dump_fr_trace", None)
    if dump is None:
        return
    data = dump()
    path = out_prefix.with_name(f"{out_prefix.name}.flight.{reason}.pickle")
    _write(path, data)
    tail = out_prefix.with_name(f"{out_prefix.name}.flight.{reason}.tail.pickle")
    try:  # torch's bytes, decoded as any dump is read
        _write(tail, pickle.dumps(flight_tail(loads_pickle(data, path.name)), protocol=2))
    except Exception as exc:  # laid out otherwise by another torch: the whole dump is there
        session.record("flight_dump", file=path.name, reason=reason, bytes=len(data), tail=None, why=repr(exc)[:200])
        return
    session.record("flight_dump", file=path.name, reason=reason, bytes=len(data), tail=tail.name)


def flight_tail(dump: Mapping[str, Any], done: int = TAIL_DONE, keep: int = TAIL_ENTRIES) -> dict[str, Any]:
    """A flight-recorder dump (as torch's pickle holds it) with only each process group's
    collectives from ``done`` before its last completed one on (those in flight with
    them), or, where ``pg_status`` does not say, its last ``keep``; everything else as it
    is (``pg_status`` still says how far each group got)."""
    entries = dump.get("entries")
    if not isinstance(entries, (list, tuple)):
        raise ValueError("a flight-recorder dump without an 'entries' list")
    status = dump.get("pg_status")
    first: dict[str, int] = {}  # group -> the first sequence number kept
    for name, progress in status.items() if isinstance(status, Mapping) else ():
        last = progress.get("last_completed_collective") if isinstance(progress, Mapping) else None
        if isinstance(last, int) and not isinstance(last, bool):
            first[str(name)] = max(last, 0) - done
    left: dict[str, int] = {}
    kept = []
    for entry in reversed(entries):
        group, seq = _group(entry), entry.get("collective_seq_id") if isinstance(entry, Mapping) else None
        if group in first and isinstance(seq, int):
            if seq >= first[group]:
                kept.append(entry)
        elif left.setdefault(group, keep) > 0:
            left[group] -= 1
            kept.append(entry)
    return {**dump, "entries": kept[::-1]}


def _group(entry: Any) -> str:
    """An entry's process group, named as ``pg_status`` names it (its ``process_group``'s
    first item, else its ``pg_id``)."""
    if not isinstance(entry, Mapping):
        return ""
    pg = entry.get("process_group")
    return str(pg[0]) if isinstance(pg, (list, tuple)) and pg else str(entry.get("pg_id"))


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
