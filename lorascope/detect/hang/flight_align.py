"""Several ranks' flight-recorder dumps aligned: where the ranks stop agreeing.

Per process group, collectives are aligned by ``collective_seq_id`` (p2p ops by
``p2p_seq_id``). Each dump is a ring buffer, so only sequence numbers every rank still
holds are compared. A sequence number disagrees when a rank of the group never enqueued
it (missing), or when the ranks ran different ops, or the same op with different sizes or
dtypes. For the first disagreement the frames of each rank's entry are kept (for a rank
that never got there: its last entry, where it is waiting), and, when the later entries
line up again shifted by one, which ranks ran an extra collective.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from lorascope.detect.hang.conditions import chain_condition
from lorascope.detect.hang.divergence import Aspects, splits
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.ingest.flight.reader import FlightDump, FlightEntry, call_chain, call_site, is_job_code
from lorascope.units import rank_ranges

#: Disagreements kept per group (the first one matters most).
MAX_DISAGREEMENTS = 20


@dataclass
class RankProgress:
    """One rank's progress in a group: from ``pg_status`` where the dump has it, else
    from its entries."""

    rank: int
    last_enqueued: int | None
    last_started: int | None
    last_completed: int | None
    #: The entry the rank is on: its last enqueued one.
    last_entry: FlightEntry | None

    @property
    def pending(self) -> bool:
        """Enqueued something it has not completed."""
        return self.last_enqueued is not None and (self.last_completed or 0) < self.last_enqueued


@dataclass
class Disagreement:
    """One sequence number on which the ranks of a group disagree."""

    group: str
    seq: int
    #: "missing" (some rank never enqueued it), "op", or what differs between the same op:
    #: "size", "dtype" or "size+dtype".
    kind: str
    #: The entry of every rank that has one.
    entries: dict[int, FlightEntry]
    missing_ranks: list[int]
    #: For missing ranks: their last entry (where they wait instead).
    waiting_at: dict[int, FlightEntry]
    #: Ranks that ran one collective more than the others here (the others' later entries
    #: match theirs shifted by one), when the dumps show it.
    extra_on: list[int]
    p2p: bool = False

    def describe(self) -> str:
        parts = [f"rank {r}: {_short(e)}" for r, e in sorted(self.entries.items())]
        parts += [
            f"rank {r}: never enqueued #{self.seq}"
            + (
                f", {'last ran' if self.waiting_at[r].completed else 'waits in'} {_short(self.waiting_at[r])}"
                if r in self.waiting_at
                else ""
            )
            for r in self.missing_ranks
        ]
        return f"group {self.group} #{self.seq} ({self.kind}): " + "; ".join(parts)


@dataclass
class GroupAlignment:
    """One process group across the ranks that dumped it."""

    group: str
    desc: str
    #: Ranks of the group as ``pg_config`` lists them (None if no dump says).
    expected_ranks: list[int] | None
    ranks: list[int]
    #: Ranks of the group without a dump.
    missing_dumps: list[int]
    #: Sequence numbers every rank still holds: (first, last), None if none in common.
    window: tuple[int, int] | None
    progress: dict[int, RankProgress]
    disagreements: list[Disagreement]
    compared: int = 0

    @property
    def first_disagreement(self) -> Disagreement | None:
        return self.disagreements[0] if self.disagreements else None


@dataclass
class FlightAlignment:
    """All groups of all dumps."""

    ranks: list[int]
    groups: list[GroupAlignment] = field(default_factory=list)

    @property
    def first_disagreement(self) -> Disagreement | None:
        firsts = [g.first_disagreement for g in self.groups if g.first_disagreement is not None]
        return min(firsts, key=lambda d: (d.kind == "missing", d.seq)) if firsts else None


def _short(e: FlightEntry) -> str:
    sizes = list(e.input_sizes) if e.input_sizes else ""
    dtypes = "/".join(e.input_dtypes)
    chain = call_chain(e.frames)
    where = f" at {chain[0]}" if chain else ""
    if len(chain) > 1 and is_job_code(chain[-1]):  # a library made the call: the job's line that led there
        where += f", from {chain[-1]}"
    return f"{e.op} {sizes} {dtypes}".rstrip() + where


def flight_alignment(bundle: EvidenceBundle) -> FlightAlignment | None:
    """The bundle's flight-recorder dumps aligned, computed once and kept on the bundle."""
    if not bundle.flight_records:
        return None
    if "flight_alignment" not in bundle.derived:
        bundle.derived["flight_alignment"] = align(bundle.flight_records)
    found: FlightAlignment = bundle.derived["flight_alignment"]
    return found


def align(dumps: dict[int, FlightDump]) -> FlightAlignment:
    """Align every group of the given per-rank dumps (keyed by rank)."""
    result = FlightAlignment(ranks=sorted(dumps))
    names = sorted(
        {e.group for d in dumps.values() for e in d.entries} | {g for d in dumps.values() for g in d.group_ranks if g}
    )
    for name in names:
        holders = {r: d for r, d in dumps.items() if any(e.group == name for e in d.entries) or name in d.group_ranks}
        if holders:
            result.groups.append(_align_group(name, holders))
    return result


def _expected(name: str, dumps: dict[int, FlightDump]) -> list[int] | None:
    for d in dumps.values():
        ranks = d.group_ranks.get(name)
        if ranks:
            return ranks
    return None


def _progress(rank: int, dump: FlightDump, entries: list[FlightEntry], name: str) -> RankProgress:
    status = dump.status.get(name)
    seqs = [e.seq for e in entries if e.seq is not None]
    done = [e.seq for e in entries if e.seq is not None and e.completed]
    started = [e.seq for e in entries if e.seq is not None and e.state in ("started", "completed")]
    enq = status.last_enqueued if status and status.last_enqueued is not None else max(seqs, default=None)
    return RankProgress(
        rank=rank,
        last_enqueued=enq,
        last_started=status.last_started if status and status.last_started is not None else max(started, default=None),
        last_completed=status.last_completed
        if status and status.last_completed is not None
        else max(done, default=None),
        last_entry=entries[-1] if entries else None,
    )


def _align_group(name: str, dumps: dict[int, FlightDump]) -> GroupAlignment:
    per_rank = {r: [e for e in d.entries if e.group == name] for r, d in dumps.items()}
    expected = _expected(name, dumps)
    progress = {r: _progress(r, dumps[r], per_rank[r], name) for r in sorted(dumps)}
    colls = {r: {e.seq: e for e in es if not e.is_p2p and e.seq is not None} for r, es in per_rank.items()}
    p2p = {r: {e.p2p_seq: e for e in es if e.is_p2p and e.p2p_seq is not None} for r, es in per_rank.items()}
    disagreements, window, compared = _compare(name, colls, progress, False)
    p2p_dis, _, p2p_compared = _compare(name, p2p, progress, True)
    desc = next((d.group_desc.get(name, "") for d in dumps.values() if d.group_desc.get(name)), "")
    missing = sorted(set(expected or []) - set(dumps))
    return GroupAlignment(
        group=name,
        desc=desc,
        expected_ranks=expected,
        ranks=sorted(dumps),
        missing_dumps=missing,
        window=window,
        progress=progress,
        disagreements=(disagreements + p2p_dis)[:MAX_DISAGREEMENTS],
        compared=compared + p2p_compared,
    )


#: What can differ between ranks' entries at one sequence number (``signature``: the
#: sides of a rooted call that only its root holds are left out).
FLIGHT_ASPECTS: Aspects[FlightEntry] = Aspects(("op", "size", "dtype"), FlightEntry.signature)


def _compare(
    name: str, by_seq: dict[int, dict[int, FlightEntry]], progress: dict[int, RankProgress], p2p: bool
) -> tuple[list[Disagreement], tuple[int, int] | None, int]:
    holding = {r: seqs for r, seqs in by_seq.items() if seqs}
    if len(holding) < 2:
        return [], None, 0
    start = max(min(seqs) for seqs in holding.values())
    end = max(max(seqs) for seqs in holding.values())
    window = (start, min(max(seqs) for seqs in holding.values()))
    compared = len({s for seqs in holding.values() for s in seqs if start <= s <= end})
    out: list[Disagreement] = []
    for split in islice(splits(holding, FLIGHT_ASPECTS, missing=True), MAX_DISAGREEMENTS):
        entries = {r: e for r, e in split.calls.items() if e is not None}
        missing = sorted(r for r, e in split.calls.items() if e is None)
        waiting = {r: e for r in missing if (e := progress[r].last_entry) is not None}
        out.append(
            Disagreement(
                group=name,
                seq=split.seq,
                kind=split.kind,
                entries=entries,
                missing_ranks=missing,
                waiting_at=waiting,
                extra_on=_extra_on(holding, split.seq),
                p2p=p2p,
            )
        )
    return out, window if window[0] <= window[1] else None, compared


def _extra_on(holding: dict[int, dict[int, FlightEntry]], seq: int) -> list[int]:
    """Ranks whose entries from ``seq + 1`` on match the other ranks' from ``seq`` on (as
    far as both hold them). The others' runs from ``seq`` are compared once per distinct
    run, not once per pair of ranks (1,024 ranks: a million pairs)."""

    def run(calls: dict[int, FlightEntry], start: int) -> tuple[tuple[Any, ...], ...]:
        out = []
        while start in calls:
            out.append(calls[start].signature())
            start += 1
        return tuple(out)

    theirs = {r: run(calls, seq) for r, calls in holding.items()}
    kinds = Counter(theirs.values())
    extra = []
    for r, mine in holding.items():
        ahead = run(mine, seq + 1)
        pairs = 0
        agree = True
        for other, count in kinds.items():
            count -= other == theirs[r]  # the other ranks only
            n = min(len(ahead), len(other))
            if count and ahead[:n] != other[:n]:
                agree = False
                break
            pairs += n * count
        if agree and pairs > 0:
            extra.append(r)
    return extra if len(extra) < len(holding) else []


@dataclass
class Ahead:
    """The last collective a rank enqueued in a group, which other ranks of it never did."""

    group: str
    entry: FlightEntry
    #: The ranks of the group (with a dump) that never enqueued it.
    never: list[int]
    #: The ranks that made another op at its sequence number: rank -> that op.
    instead: dict[int, str] = field(default_factory=dict)

    def peers(self) -> str:
        """What the others did instead: ``rank 1 never enqueued it``, ``rank 1 made barrier there``."""
        parts = []
        if self.never:
            parts.append(f"rank{'s' if len(self.never) > 1 else ''} {rank_ranges(self.never)} never enqueued it")
        by_op: dict[str, list[int]] = {}
        for r, op in sorted(self.instead.items()):
            by_op.setdefault(op, []).append(r)
        parts += [f"rank{'s' if len(rs) > 1 else ''} {rank_ranges(rs)} made {op} there" for op, rs in by_op.items()]
        return "; ".join(parts)


def ahead_of_peers(alignment: FlightAlignment) -> dict[int, Ahead]:
    """Per rank, in a group whose ranks first disagree by a collective some never enqueued
    or by the op: the rank's last collective there, if other ranks never enqueued it (of
    the groups it is in, the first by name); where the ops differ and its last call is
    the one they differ on, the ranks with another op there never enqueued it. The calls
    the probes cannot see (DDP's C++ Reducer) are in the flight recorder only: this is how
    a rank waiting in one is told from a rank in its own code. Whether the rank is still
    in it is for the caller to judge: gloo marks a call completed once it fails, and a
    rank may complete a call its peers never join (a broadcast's receivers once the root
    sent to them)."""
    out: dict[int, Ahead] = {}
    for group in alignment.groups:
        first = group.first_disagreement
        if first is None or first.p2p or first.kind not in ("missing", "op"):
            continue
        short_of: dict[int, list[int]] = {}  # seq -> the ranks that never enqueued it (most ranks share one)
        for r, at in first.entries.items():
            entry = group.progress[r].last_entry
            if r in out or entry is None or entry.seq is None or entry.is_p2p or entry.seq < first.seq:
                continue
            instead: dict[int, str] = {}
            if first.kind == "op" and entry is at:
                never = sorted(first.missing_ranks)
                instead = {o: e.op for o, e in first.entries.items() if e.op != at.op}
            else:
                if entry.seq not in short_of:
                    short_of[entry.seq] = [o for o, p in group.progress.items() if (p.last_enqueued or 0) < entry.seq]
                never = short_of[entry.seq]
            if never or instead:
                out[r] = Ahead(group.desc or group.group, entry, never, instead)
    return out


def waiting_in(alignment: FlightAlignment) -> dict[int, dict[str, int]]:
    """Per rank, per group (by the name the probes give it), the sequence number of the
    call it waits in as its flight recorder counts: its last enqueued one, not completed.
    Where the probes do not see every call (DDP's C++ Reducer), their count is lower."""
    out: dict[int, dict[str, int]] = {}
    for group in alignment.groups:
        for r, progress in group.progress.items():
            entry = progress.last_entry
            if (
                progress.pending
                and entry is not None
                and entry.seq is not None
                and not (entry.completed or entry.is_p2p)
            ):
                out.setdefault(r, {})[group.desc or group.group] = entry.seq
    return out


def flight_conditions(bundle: EvidenceBundle, first: Disagreement) -> dict[int, tuple[str, str] | None]:
    """Per rank of the disagreement: the rank condition along its call chain, and the frame
    it encloses (None for ranks that never enqueued the call, or with no condition)."""
    out: dict[int, tuple[str, str] | None] = {r: None for r in first.missing_ranks}
    for r, entry in first.entries.items():
        out[r] = chain_condition(call_chain(entry.frames), bundle.sources)
    return out


def last_activity(entry: FlightEntry | None) -> str:
    """What a rank that never enqueued a call was doing instead, from its last entry."""
    if entry is None:
        return "its dump holds no earlier collective of the group"
    where = call_site(entry.frames) or "?"
    if entry.completed:
        return f"its last, {entry.op} #{entry.seq} at {where}, completed: it is outside any collective"
    return f"it waits in {entry.op} #{entry.seq} at {where}"
