"""Whom the ranks wait for when every rank waits in a collective: each collective waited
in (its process group and sequence number), the ranks in it, and the members of its group
that never issued it.

A collective completes once every member of its group has issued it. When every member
is in it, the collective itself is stuck (the transport). When members never issued it,
they wait in another collective: ranks that issue two groups' collectives in different
orders wait for one another that way, with no group's own sequence disagreeing
(:func:`lorascope.detect.hang.divergence.first_divergence` compares within a group).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lorascope.detect.hang.divergence import listed_members
from lorascope.rundir.loading.reader import RunData


@dataclass(frozen=True)
class Wait:
    """One collective waited in: the ranks in it (its group's members among them) and the
    members that never issued it."""

    group: str
    seq: int
    #: Where its first waiter is, as the rank's state says it ("all_reduce #4 on tp at
    #: train.py:88 in step, under `if ...`").
    where: str
    ranks: tuple[int, ...]
    absent: tuple[int, ...]


def waits(run: RunData, states: Sequence[Mapping[str, Any]]) -> list[Wait] | None:
    """The collectives the ranks wait in (each rank's first pending call), most ranks
    first; None when a wait has no sequence number (a call begun before `lorascope
    attach`, read from a stack) or no group, or its group's ranks were not recorded."""
    by: dict[tuple[str, int], list[Mapping[str, Any]]] = {}
    issued: dict[int, set[tuple[str, int]]] = {}
    for s in states:
        pending = [(p.get("group"), p.get("seq")) for p in s["pending"]]
        if not pending or not all(isinstance(g, str) and type(q) is int for g, q in pending):
            return None
        issued[s["rank"]] = set(pending)
        by.setdefault(pending[0], []).append(s)
    out = []
    groups = members(run)
    if any(group not in groups for group, _ in by):
        return None
    for (group, seq), alike in by.items():
        ranks = tuple(sorted(s["rank"] for s in alike))
        absent = tuple(
            m
            for m in sorted(groups[group] - set(ranks))
            if (group, seq) not in issued.get(m, ()) and not _passed(run, m, group, seq)
        )
        out.append(Wait(group, seq, str(alike[0]["where"]), ranks, absent))
    return sorted(out, key=lambda w: (-len(w.ranks), w.ranks))


def members(run: RunData) -> dict[str, set[int]]:
    """Each process group's ranks, as its ``group`` records list them
    (:func:`listed_members`), else the ranks that recorded it."""
    listed = listed_members(run)
    holders: dict[str, set[int]] = {}
    for n, rank in run.ranks.items():
        for record in rank.groups.values():
            holders.setdefault(str(record.get("name")), set()).add(n)
    return {name: listed.get(name) or held for name, held in holders.items()}


def _passed(run: RunData, rank: int, group: str, seq: int) -> bool:
    """Whether the rank's records show it issued the group's call ``seq`` (or a later one)."""
    data = run.ranks.get(rank)
    tally = data.tallies.get(group) if data is not None else None
    return tally is not None and tally.last_seq >= seq


def complete(found: Sequence[Wait]) -> list[Wait]:
    """The collectives every member of whose group is in: stuck themselves."""
    return [w for w in found if not w.absent]


def crossed(found: Sequence[Wait]) -> bool:
    """Whether every collective waited in misses members that wait in another one: the
    ranks wait for one another across groups (a deadlock)."""
    waiting = {r for w in found for r in w.ranks}
    return all(w.absent and set(w.absent) <= waiting for w in found)


def fewest(found: Sequence[Wait]) -> list[int]:
    """The ranks of the collectives with the fewest ranks in them (the odd ones out)."""
    least = min(len(w.ranks) for w in found)
    return sorted(r for w in found if len(w.ranks) == least for r in w.ranks)
