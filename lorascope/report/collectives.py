"""Chart data for collectives: every rank's calls aligned by sequence number, and time per op.

The first sequence number where a group's members disagree (a different op, size or
dtype, or a member that never made the call while others did; found by
:mod:`lorascope.detect.hang.divergence`) is where a rank-conditional collective shows;
pending calls (a call whose record has no end) are where the ranks wait.
"""

from __future__ import annotations

import math
import operator
import statistics
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from lorascope.detect.common import MIN_ALIKE_RANKS
from lorascope.detect.finding import Finding
from lorascope.detect.hang.divergence import RUN_ALL, first_split, listed_members
from lorascope.detect.hang.divergence import by_group as groups_of
from lorascope.rundir.loading.reader import Collective, RunData
from lorascope.units import rank_ranges, ranks_named

#: Sequence numbers shown in the alignment chart, and in the table under it.
CHART_WINDOW = 48
TABLE_WINDOW = 12
#: Rows in the chart and the table, at most (a row is one rank, or ranks whose calls read alike).
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
    return sorted((listed_members(run).get(group, set()) & set(run.ranks)) | users)


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


def _alike(members: list[int], key: Any) -> list[list[int]]:
    """The members as rows, as ``analyze`` condenses its table: ranks whose ``key`` (what
    the row shows of them) is the same, :data:`MIN_ALIKE_RANKS` or more of them, share a
    row; the others have one each. In the order of each row's first rank."""
    same: dict[Any, list[int]] = {}
    for r in members:
        same.setdefault(key(r), []).append(r)
    rows = [[r] for group in same.values() if len(group) < MIN_ALIKE_RANKS for r in group]
    rows += [group for group in same.values() if len(group) >= MIN_ALIKE_RANKS]
    return sorted(rows)


def _row_name(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_ranges(ranks)} ({len(ranks):,})"


def _shown(rows: list[list[int]]) -> list[list[int]]:
    """At most :data:`MAX_ROWS` rows: the largest (what most ranks did), then the others,
    those that stand alone first (where ranks differ), by rank."""
    if len(rows) <= MAX_ROWS:
        return rows
    largest = max(rows, key=len)
    rest = sorted((r for r in rows if r is not largest), key=lambda r: (len(r), r[0]))
    return sorted([largest, *rest[: MAX_ROWS - 1]])


def _window(first: int, last: int, focus: int | None, size: int) -> tuple[int, int]:
    if focus is None:
        return max(first, last - size + 1), last
    lo = max(first, focus - size // 4)
    return lo, min(last, lo + size - 1)


def alignment(run: RunData, findings: list[Finding], sites_of: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
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
    t_lo, t_hi = _window(w_lo, w_hi, focus, TABLE_WINDOW)

    def chart_key(r: int) -> tuple[Any, ...]:
        per = calls.get(r, {})
        return tuple((_signature(c), _cell(c)) if (c := per.get(s)) else None for s in range(w_lo, w_hi + 1))

    def table_key(r: int) -> tuple[Any, ...]:
        per = calls.get(r, {})
        return tuple((_signature(c), _cell(c), c.site) if (c := per.get(s)) else None for s in range(t_lo, t_hi + 1))

    rows = _shown(_alike(members, chart_key))
    cells = []
    for row, ranks in enumerate(rows):
        per = calls.get(ranks[0], {})
        for seq in range(w_lo, w_hi + 1):
            call = per.get(seq)
            if call is None and seq > max(per, default=0) and not first:
                continue  # a rank simply not there yet, in a run that never disagreed
            dur = None if call is None or call.end is None else round((call.end - call.start) * 1000, 3)
            cells.append(
                [seq, row, op_index[call.op] if call else -1, STATUS[_cell(call)], dur, call.bytes if call else None]
            )
    table_rows = _shown(_alike(members, table_key))
    table = [
        {
            "rank": ranks[0],
            "ranks": rank_ranges(ranks),
            "count": len(ranks),
            "cells": [_table_cell(calls.get(ranks[0], {}).get(s), s == focus, sites_of) for s in range(t_lo, t_hi + 1)],
        }
        for ranks in table_rows
    ]
    return {
        "available": True,
        "group": group,
        "groups": sorted((s[3], s[2]) for s in summaries),
        "rows": [_row_name(ranks) for ranks in rows],
        "rows_ranks": sum(len(ranks) for ranks in rows),
        "members_total": len(members),
        "ops": ops,
        "window": [w_lo, w_hi],
        "cells": cells,
        "first": first,
        "pending": [[r, c.seq, c.op, c.site] for r in members for c in calls.get(r, {}).values() if c.end is None],
        "table_seqs": list(range(t_lo, t_hi + 1)),
        "table": table,
        "table_ranks": sum(len(ranks) for ranks in table_rows),
    }


def _table_cell(c: Collective | None, focus: bool, sites_of: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
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
