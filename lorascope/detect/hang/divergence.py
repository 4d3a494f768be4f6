"""Where ranks' collectives diverge: the one finder, for run records and flight-recorder
dumps alike.

Ranks pair collectives by order within a process group: the n-th call of group G on one
rank pairs with the n-th call of G on every other member. At a sequence number the
members disagree when their calls differ in an *aspect* (the op; the size; the dtype),
or, where that counts, when some member never issued the call while others did
("missing": it is stuck elsewhere, dead, or simply not there yet).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Generic, TypeVar

from lorascope.detect.hang.conditions import call_condition, odd_by_condition
from lorascope.rundir.format.ops import P2P_OPS
from lorascope.rundir.loading.reader import Collective, RunData

T = TypeVar("T")


@dataclass(frozen=True)
class Aspects(Generic[T]):
    """What is compared of the members' calls: the calls disagree on an aspect when its
    values differ. ``key`` gives a call's values of every aspect at once, in the order of
    ``names`` (one C call for run records: a row of a 1,024-rank run is built per call)."""

    names: tuple[str, ...]
    key: Callable[[T], tuple[object, ...]]


#: Run records: what the hang detectors compare (a dtype alone does not hang a job).
RUN_OP_SIZE: Aspects[Collective] = Aspects(("op", "size"), attrgetter("op", "bytes"))
#: Run records, every aspect the records carry (the report's alignment chart).
RUN_ALL: Aspects[Collective] = Aspects(("op", "size", "dtype"), attrgetter("op", "bytes", "dtype"))


def classify(calls: Mapping[int, T | None], aspects: Aspects[T], missing: bool) -> str | None:
    """How the members' calls at one sequence number disagree: "op" when the ops differ,
    else the aspects that differ joined by "+" ("size", "size+dtype"), else "missing" when
    some member never issued it (if ``missing`` counts); None when they agree."""
    keys = [aspects.key(c) for c in calls.values() if c is not None]
    if not keys:
        return None
    differ = [name for i, name in enumerate(aspects.names) if len({k[i] for k in keys}) > 1]
    if differ:
        return differ[0] if differ[0] == "op" else "+".join(differ)
    return "missing" if missing and len(keys) < len(calls) else None


@dataclass
class Split(Generic[T]):
    """One sequence number at which the members of a group disagree."""

    seq: int
    kind: str
    #: Every member's call at ``seq`` (None: it never issued one).
    calls: dict[int, T | None]


def _first_difference(a: list[object], b: list[object], chunk: int = 512) -> int:
    """The first index where two lists differ (the shorter one's length if it is a prefix
    of the other). Compares chunk by chunk, so the work runs in C."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i : i + chunk] == b[i : i + chunk]:
        i += chunk
    while i < n and a[i] == b[i]:
        i += 1
    return min(i, n)


def _agreeing_prefix(
    tables: Mapping[int, Mapping[int, T]], users: list[int], seqs: list[int], aspects: Aspects[T]
) -> int:
    """How many of ``seqs`` (the numbers some member holds, in order) pass before some
    member's call (or its absence) differs from the first member's in any aspect: nothing
    before that can disagree."""

    key = aspects.key

    def row(r: int) -> list[object]:
        calls = tables[r]
        return [None if (c := calls.get(s)) is None else key(c) for s in seqs]

    ref = row(users[0])
    first = len(ref)
    for r in users[1:]:
        first = min(first, _first_difference(ref, row(r)))
    return first


def splits(
    tables: Mapping[int, Mapping[int, T]], aspects: Aspects[T], missing: bool, members: Sequence[int] | None = None
) -> Iterator[Split[T]]:
    """Every sequence number at which ``members`` (default: every rank in ``tables``)
    disagree, in order. ``tables``: rank -> seq -> call. Counting starts at the first
    sequence number every member that called into the group still holds (older ones may
    have been rotated out of a stream or a flight-recorder ring buffer)."""
    members = sorted(tables) if members is None else list(members)
    users = [r for r in members if tables.get(r)]
    if not users:
        return
    start = max(min(tables[r]) for r in users)
    # The numbers some member holds, never range(start, end): a corrupt stream's or a
    # forged dump's numbers may be 10^18 apart. Where no member holds one, none disagrees.
    seqs = sorted({s for r in users for s in tables[r] if s >= start})
    if len(users) == len(members):  # a member that never called in differs from the start
        seqs = seqs[_agreeing_prefix(tables, users, seqs, aspects) :]
    for seq in seqs:
        calls = {r: tables.get(r, {}).get(seq) for r in members}
        kind = classify(calls, aspects, missing)
        if kind is not None:
            yield Split(seq, kind, calls)


def first_split(
    tables: Mapping[int, Mapping[int, T]], aspects: Aspects[T], missing: bool, members: Sequence[int] | None = None
) -> Split[T] | None:
    return next(splits(tables, aspects, missing, members), None)


def by_group(run: RunData) -> dict[str, dict[int, dict[int, Collective]]]:
    """Run records as group -> rank -> seq -> call, of the group's collectives: its
    point-to-point calls pair one rank with another, not across the group (a send with its
    peer's receive, ranks 0 and 1 only), and the probes number them apart."""
    out: dict[str, dict[int, dict[int, Collective]]] = {}
    for rank in run.ranks.values():
        mine: dict[str, dict[int, Collective]] = {}  # a rank's calls are of a few groups
        for coll in rank.collectives:
            if coll.op in P2P_OPS:
                continue
            table = mine.get(coll.group)
            if table is None:
                table = mine[coll.group] = {}
            table[coll.seq] = coll
        for group, table in mine.items():
            out.setdefault(group, {})[rank.rank] = table
    return out


def listed_members(run: RunData) -> dict[str, set[int]]:
    """Each process group's ranks, as its ``group`` records list them (a group none of
    whose records lists its ranks is left out); computed once a run."""
    if "listed_members" not in run.derived:
        listed: dict[str, set[int]] = {}
        # the reader shares equal member lists, across ranks and groups: each read once a group
        seen: set[tuple[str, int]] = set()
        for rank in run.ranks.values():
            for g in rank.groups.values():
                ranks, name = g.get("ranks"), str(g.get("name"))
                if isinstance(ranks, list) and (name, id(ranks)) not in seen:
                    seen.add((name, id(ranks)))
                    listed.setdefault(name, set()).update(int(r) for r in ranks if isinstance(r, int))
        run.derived["listed_members"] = listed
    found: dict[str, set[int]] = run.derived["listed_members"]
    return found


@dataclass
class Divergence:
    """Where the ranks of a run went different ways: a group and a sequence number."""

    group: str
    seq: int
    calls: dict[int, Collective | None]  # rank -> its call at seq (None: never issued)


def first_divergence(run: RunData) -> Divergence | None:
    """The earliest (by time) sequence number, over all groups, at which the ranks that
    issued it disagree on the op or the size. A rank that never issued the call while
    others wait in it is not a disagreement: it is stuck elsewhere or dead (the hang
    diagnosis tells which). Computed once a run (three detectors ask; ~0.4 s each at
    1,024 ranks)."""
    if "first_divergence" not in run.derived:
        run.derived["first_divergence"] = _first_divergence(run)
    found: Divergence | None = run.derived["first_divergence"]
    return found


def _first_divergence(run: RunData) -> Divergence | None:
    found: list[tuple[float, Divergence]] = []
    for group, tables in sorted(by_group(run).items()):
        if len(tables) < 2:
            continue
        split = first_split(tables, RUN_OP_SIZE, missing=False)
        if split is not None:
            when = min(c.start for c in split.calls.values() if c is not None)
            found.append((when, Divergence(group, split.seq, split.calls)))
    return min(found, key=lambda f: f[0])[1] if found else None


def found_at(run: RunData, div: Divergence) -> dict[int, tuple[str, str] | None]:
    """Each rank's rank condition around its call at the divergence, and the frame it
    encloses (the call site, or the caller that led a library to the call)."""
    return {n: call_condition(run.ranks[n], c) for n, c in div.calls.items()}


def conditions_at(run: RunData, div: Divergence) -> dict[int, str | None]:
    """Each rank's rank condition around its call at the divergence."""
    return {n: f[0] if f else None for n, f in found_at(run, div).items()}


def odd_ranks(run: RunData, div: Divergence) -> list[int]:
    """The ranks that went their own way at the divergence: inside a rank condition (see
    :func:`odd_by_condition`), else the minority (op, bytes); none when it cannot be told."""
    odd = odd_by_condition(conditions_at(run, div), include_else=True)
    return sorted(odd) or minority({n: (c.op, c.bytes) if c else None for n, c in div.calls.items()})


def minority(keys: Mapping[int, Hashable]) -> list[int]:
    """The ranks whose key (their call's op and size, say) is the rarest, when it is rarer
    than the commonest; none on a tie or when all agree."""
    ranked = Counter(keys.values()).most_common()
    if len(ranked) < 2 or ranked[-1][1] == ranked[0][1]:
        return []
    return sorted(n for n, key in keys.items() if key == ranked[-1][0])


def size_mismatch(run: RunData, div: Divergence) -> bool:
    """Every rank made the same call from the same line with different sizes, and no rank
    condition encloses it: a collective-mismatch, not a collective only some ranks run
    (an extra collective on one rank comes from another line)."""
    calls = list(div.calls.values())
    if any(c is None for c in calls) or any(found_at(run, div).values()):
        return False
    present = [c for c in calls if c is not None]
    return len({(c.op, c.site) for c in present}) == 1 and len({c.bytes for c in present}) > 1
