"""Chart data for collectives: every rank's calls aligned by sequence number, and time per op.

The first sequence number where a group's members disagree (a different op, size or
dtype, or a member that never made the call while others did; found by
:mod:`lorascope.detect.hang.divergence`) is where a rank-conditional collective shows;
pending calls (a ``coll`` with no ``coll_end``) are where the ranks wait.
"""

from __future__ import annotations

import math
import operator
import statistics
from collections import Counter, defaultdict
from typing import Any

from lorascope.detect.finding import Finding
from lorascope.detect.hang.divergence import RUN_ALL, first_split
from lorascope.detect.hang.divergence import by_group as groups_of
from lorascope.rundir.reader import Collective, RunData
from lorascope.units import ranks_named

#: Sequence numbers shown in the alignment chart, and in the table under it.
CHART_WINDOW = 48
TABLE_WINDOW = 12
#: Ranks (rows) in the chart and the table, at most: those that differ from the others first.
MAX_ROWS = 64
#: Ops in the per-op time chart, at most (the most time-consuming first).
MAX_OPS = 24

#: What a cell's status code means (the page draws each differently).
STATUS = {"ok": 0, "pending": 1, "error": 2, "absent": 3}


def wait_per_step(run: RunData) -> dict[int, list[tuple[int, float]]]:
    """Per rank, the wall seconds its synchronous calls spent in collectives, per step in
    progress (the time includes waiting for the other ranks, which is what sets a
    straggler's peers apart; async calls overlap the rank's own work and are left out).
    Summed by the reader over every call, not only the calls it kept."""
    return {rank.rank: sorted(rank.coll_wait.items()) for rank in run.ranks.values()}


#: A call's end (None while pending), read in C over a rank's calls.
_END = operator.attrgetter("end")


def _signature(c: Collective) -> tuple[str, int | None, str | None]:
    return (c.op, c.bytes, c.dtype)


def _describe(c: Collective) -> str:
    size = "" if c.bytes is None else f" {c.bytes:,} B"
    return f"{c.op}{size}{' ' + c.dtype if c.dtype else ''}"


def _members(run: RunData, group: str, users: set[int]) -> list[int]:
    """Ranks expected in a group: the ``ranks`` its members recorded, else those that used it."""
    listed: set[int] = set()
    seen: set[int] = set()  # the reader shares equal member lists: each read once, not once a rank
    for rank in run.ranks.values():
        for g in rank.groups.values():
            ranks = g.get("ranks")
            if g.get("name") == group and isinstance(ranks, list) and id(ranks) not in seen:
                seen.add(id(ranks))
                listed.update(int(r) for r in ranks if isinstance(r, int))
    return sorted((listed & set(run.ranks)) | users)


def _at(calls: dict[int, dict[int, Collective]], members: list[int], seq: int) -> dict[str, Any] | None:
    """How the members disagree at ``seq``: ``mismatch`` (different op, size or dtype) or
    ``missing`` (some members made the call, others never did); None if they agree."""
    present = {r: calls.get(r, {}).get(seq) for r in members}
    made = {r: c for r, c in present.items() if c is not None}
    if not made:
        return None
    by_sig: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    for r, c in made.items():
        by_sig[_signature(c)].append(r)
    if len(by_sig) > 1:
        parts = [f"{ranks_named(rs)}: {_describe(made[rs[0]])}" for rs in sorted(by_sig.values())]
        return {"seq": seq, "kind": "mismatch", "ranks": sorted(made), "text": "; ".join(parts)}
    missing = sorted(r for r, c in present.items() if c is None)
    if not missing:
        return None
    return {
        "seq": seq,
        "kind": "missing",
        "ranks": missing,
        "text": f"{ranks_named(made)} called {_describe(next(iter(made.values())))}; {ranks_named(missing)} never did",
    }


def _finding_pointer(findings: list[Finding]) -> tuple[str, int] | None:
    """A detector's own first disagreement (``details`` with ``group`` and ``seq``) wins."""
    for f in findings:
        group, seq = f.details.get("group"), f.details.get("seq")
        if isinstance(group, str) and isinstance(seq, int) and not isinstance(seq, bool):
            return group, seq
    return None


def _cell(c: Collective | None) -> str:
    if c is None:
        return "absent"
    if c.err is not None:
        return "error"
    return "pending" if c.pending else "ok"


def _shown(calls: dict[int, dict[int, Collective]], members: list[int], lo: int, hi: int) -> list[int]:
    """The rows to draw: all members, or above :data:`MAX_ROWS` the ranks whose call (op,
    size, dtype, status) at some sequence number of the window differs from what most
    members have there, then the lowest others, up to :data:`MAX_ROWS`."""
    if len(members) <= MAX_ROWS:
        return members
    odd: set[int] = set()
    for seq in range(lo, hi + 1):
        keys = {}
        for r in members:
            c = calls.get(r, {}).get(seq)
            keys[r] = (_signature(c), _cell(c)) if c is not None else None
        common = Counter(keys.values()).most_common(1)[0][0]
        odd.update(r for r, k in keys.items() if k != common)
    picked = sorted(odd)[:MAX_ROWS]
    return sorted(picked + [r for r in members if r not in odd][: MAX_ROWS - len(picked)])


def _window(first: int, last: int, focus: int | None, size: int) -> tuple[int, int]:
    if focus is None:
        return max(first, last - size + 1), last
    lo = max(first, focus - size // 4)
    return lo, min(last, lo + size - 1)


def alignment(run: RunData, findings: list[Finding], sites_of: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The focus group's aligned calls: the group where ranks disagree, else one with pending
    calls, else the busiest."""
    by_group = groups_of(run)
    if not by_group:
        return {"available": False}
    pointer = _finding_pointer(findings)
    summaries = []
    first: dict[str, Any] | None
    for group, calls in by_group.items():
        members = _members(run, group, set(calls))
        if pointer is not None and pointer[0] == group:
            first = _at(calls, members, pointer[1]) or {
                "seq": pointer[1],
                "kind": "finding",
                "ranks": [],
                "text": "named by the detector",
            }
        else:
            split = first_split(calls, RUN_ALL, missing=True, members=members)
            first = None if split is None else _at(calls, members, split.seq)
        pending = any(None in map(_END, per.values()) for per in calls.values())
        made = sum(t.calls for r in run.ranks.values() if (t := r.tallies.get(group)) is not None)
        summaries.append((first is not None, pending, made, group, members, first, calls))
    summaries.sort(key=lambda s: (not s[0], not s[1], -s[2], s[3]))
    _, _, _, group, members, first, calls = summaries[0]
    lo_seq = min(min(per) for per in calls.values() if per)
    hi_seq = max(max(per) for per in calls.values() if per)
    focus = first["seq"] if first else None
    ops: list[str] = sorted({op for r in run.ranks.values() if (t := r.tallies.get(group)) for op in t.ops})
    op_index = {op: i for i, op in enumerate(ops)}
    w_lo, w_hi = _window(lo_seq, hi_seq, focus, CHART_WINDOW)
    everyone, members = members, _shown(calls, members, w_lo, w_hi)
    cells = []
    for row, r in enumerate(members):
        per = calls.get(r, {})
        for seq in range(w_lo, w_hi + 1):
            call = per.get(seq)
            if call is None and seq > max(per, default=0) and not first:
                continue  # a rank simply not there yet, in a run that never disagreed
            dur = None if call is None or call.end is None else round((call.end - call.start) * 1000, 3)
            cells.append(
                [seq, row, op_index[call.op] if call else -1, STATUS[_cell(call)], dur, call.bytes if call else None]
            )
    t_lo, t_hi = _window(w_lo, w_hi, focus, TABLE_WINDOW)
    table = [
        {
            "rank": r,
            "cells": [_table_cell(calls.get(r, {}).get(s), s == focus, sites_of) for s in range(t_lo, t_hi + 1)],
        }
        for r in members
    ]
    return {
        "available": True,
        "group": group,
        "groups": sorted((s[3], s[2]) for s in summaries),
        "members": members,
        "members_total": len(everyone),
        "ops": ops,
        "window": [w_lo, w_hi],
        "cells": cells,
        "first": first,
        "pending": [[r, c.seq, c.op, c.site] for r in everyone for c in calls.get(r, {}).values() if c.end is None],
        "table_seqs": list(range(t_lo, t_hi + 1)),
        "table": table,
    }


def _table_cell(c: Collective | None, focus: bool, sites_of: dict[str, dict[str, Any]]) -> dict[str, Any]:
    status = _cell(c)
    site = c.site if c else None
    context = sites_of.get(site or "", {})
    return {
        "text": _describe(c) if c else "—",
        "status": status,
        "focus": focus,
        "site": site,
        "line": context.get("line"),
        "conditions": context.get("conditions") or [],
        "err": c.err if c else None,
    }


def op_times(run: RunData) -> dict[str, Any]:
    """Wall time per op: per rank the total over its completed calls, then across ranks the
    fastest, the median and the slowest rank (a straggler or a waiting rank stands out)."""
    totals: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    counts: dict[str, int] = defaultdict(int)
    for rank in run.ranks.values():
        for op, (total, calls) in rank.op_totals.items():
            totals[op][rank.rank] += total
            counts[op] += calls
    ops = sorted(totals, key=lambda op: (-math.fsum(totals[op].values()), op))[:MAX_OPS]
    rows = []
    for op in ops:
        per = totals[op]
        ranks_sorted = sorted(per, key=lambda r: (per[r], r))
        rows.append(
            {
                "op": op,
                "calls": counts[op],
                "min": round(per[ranks_sorted[0]], 6),
                "min_rank": ranks_sorted[0],
                "median": round(statistics.median(per.values()), 6),
                "max": round(per[ranks_sorted[-1]], 6),
                "max_rank": ranks_sorted[-1],
            }
        )
    return {"rows": rows}
