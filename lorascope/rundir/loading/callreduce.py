"""A rank's call records reduced as numpy columns (analysis side).

What :class:`~lorascope.rundir.loading.reduce.CollectiveLog` computes call by call, computed
over a call file's columns at once (:mod:`lorascope.rundir.loading.calls`): per group the
tally (count, sequence numbers, ops, window digests), the calls kept (the first
:data:`~lorascope.rundir.loading.reduce.HEAD_CALLS`, the newest
:data:`~lorascope.rundir.loading.reduce.TAIL_CALLS`, the pending ones and those of the windows
asked for), and over every completed call, in the order they started, each step's time in
synchronous calls and each op's time and count (``np.bincount`` adds in array order, as
the log adds one call after another: the sums are the same to the bit). A
:class:`~lorascope.rundir.loading.reader.Collective` is made only for the calls kept.

Calls a call file did not keep (its ring went round, a torn slot) are known by index; per
group they become the sequence ranges no rank is compared over
(:attr:`GroupTally.missing`), and the steps they may belong to have no time in
collectives (unknown, not zero).
"""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from lorascope.rundir.loading.calls import CallRecords, stable_order
from lorascope.rundir.loading.reduce import (
    HEAD_CALLS,
    MIX_A,
    MIX_B,
    NO_BYTES,
    TAIL_CALLS,
    WINDOW,
    GroupTally,
    digests_of,
    name_code,
)

if TYPE_CHECKING:
    from lorascope.rundir.loading.reader import Collective

#: A call shape's fields, as a ``shape`` record declares them: op, dtype, async, site, via.
Shape = tuple[str, str | None, bool, str | None, str | None]
#: What a call naming a shape no ``shape`` record declared reads as.
UNKNOWN_SHAPE: Shape = ("unknown", None, False, None, None)
#: Sequence numbers past every real one: the upper end of a group's missing range that no
#: kept call closes.
OPEN_END = (1 << 62) - 1

_A, _B = np.uint64(MIX_A), np.uint64(MIX_B)


def _mix(z: np.ndarray) -> np.ndarray:
    """:func:`~lorascope.rundir.loading.reduce.mix` of uint64 columns (they wrap modulo 2^64)."""
    z = (z ^ (z >> np.uint64(30))) * _A
    z = (z ^ (z >> np.uint64(27))) * _B
    out: np.ndarray = z ^ (z >> np.uint64(31))
    return out


@dataclass
class ReducedCalls:
    """One rank process's calls, reduced (see the module docstring)."""

    collectives: list[Collective] = field(default_factory=list)
    tallies: dict[str, GroupTally] = field(default_factory=dict)
    #: Per step + 1, the seconds in completed synchronous calls; per op, (seconds, calls).
    sync: dict[int, float] = field(default_factory=dict)
    op_totals: dict[str, tuple[float, int]] = field(default_factory=dict)
    #: The synchronous completed calls: step + 1, start, seconds (for :meth:`outside_backward`).
    sync_calls: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    #: Step + 1 keys whose calls are not all kept: no sum is said for them.
    unknown_steps: set[int] = field(default_factory=set)
    #: Step + 1 keys read from their ``calls_step`` sums: no time outside backward is said.
    summed_steps: set[int] = field(default_factory=set)
    last_time: float = 0.0
    #: Calls naming a shape no ``shape`` record declared.
    unshaped: int = 0

    def outside_backward(self, spans: dict[int, list[tuple[float, float]]]) -> dict[int, float]:
        """Per step (+1), the seconds of synchronous calls that started outside every backward
        phase of the step (:func:`~lorascope.rundir.loading.reduce.sync_outside_backward`)."""
        if self.sync_calls is None:
            return {}
        keys, starts, took = self.sync_calls
        inside = np.zeros(len(keys), dtype=bool)
        if spans:
            # exact as the per-call test: the j-th span of each step, for every j at once
            known = np.array(sorted(spans), dtype=np.int64)
            at = np.minimum(np.searchsorted(known, keys), len(known) - 1)
            of_step = known[at] == keys
            for j in range(max(map(len, spans.values()))):
                edges = [spans[k][j] if j < len(spans[k]) else (math.inf, -math.inf) for k in known.tolist()]
                begin, end = np.array(edges, dtype=np.float64).T
                inside |= of_step & (starts >= begin[at]) & (starts <= end[at])
        out: dict[int, float] = {}
        outside = ~inside
        if outside.any():
            k, w = keys[outside], took[outside]
            uniq, first, inverse = np.unique(k, return_index=True, return_inverse=True)
            sums = np.bincount(inverse, weights=w, minlength=len(uniq))
            for i in np.argsort(first, kind="stable").tolist():
                out[int(uniq[i])] = float(sums[i])
        for key in self.unknown_steps | self.summed_steps:
            out.pop(key, None)
        return out


def _codes(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(values, return_inverse=True)``, by counting where the values are small
    whole numbers (a call's shape id, its gid): no sort of every call."""
    if len(values) and int(values.min()) >= 0 and int(values.max()) < 1 << 20:
        present = np.bincount(values) > 0
        return np.flatnonzero(present).astype(values.dtype), (np.cumsum(present) - 1)[values]
    return np.unique(values, return_inverse=True)


@dataclass
class _Columns:
    """A call file's kept calls with their shapes and groups looked up, as columns."""

    calls: CallRecords
    seq: np.ndarray
    step: np.ndarray
    #: Per call, its shape's position in ``table``, and its group's in ``names``.
    shape_pos: np.ndarray
    group: np.ndarray
    table: list[Shape]
    names: list[Any]
    ops: list[str]
    unshaped: int

    @classmethod
    def of(cls, calls: CallRecords, shapes: Mapping[int, Shape], group_name: Callable[[int], Any]) -> _Columns:
        recs = calls.records
        shape_ids, shape_pos = _codes(recs["shape"])
        table: list[Shape] = []
        unshaped = 0
        intern = sys.intern
        for sid in shape_ids.tolist():
            known = shapes.get(sid)
            if known is None:
                unshaped += int(np.count_nonzero(recs["shape"] == sid))
            op, dtype, is_async, site, via = UNKNOWN_SHAPE if known is None else known
            table.append(
                (
                    intern(op),
                    None if dtype is None else intern(dtype),
                    bool(is_async),
                    None if site is None else intern(site),
                    None if via is None else intern(via),
                )
            )
        # groups by name, as the log keys them (two gids of one name are one group)
        gids, gid_pos = _codes(recs["gid"])
        names: list[Any] = []
        name_of_gid = np.zeros(len(gids), dtype=np.int64)
        for i, gid in enumerate(gids.tolist()):
            name = group_name(gid)
            if name not in names:
                names.append(name)
            name_of_gid[i] = names.index(name)
        return cls(
            calls,
            recs["seq"].astype(np.int64),
            recs["step"].astype(np.int64),
            shape_pos.astype(np.int64),
            name_of_gid[gid_pos],
            table,
            names,
            sorted({s[0] for s in table}),
            unshaped,
        )

    def made(self, make: type[Collective], kept: np.ndarray, errors: Mapping[int, str]) -> list[Collective]:
        """A Collective of each call at positions ``kept`` (positional, in its fields' order)."""
        recs, table, names = self.calls.records, self.table, self.names
        rows = zip(
            self.seq[kept].tolist(),
            recs["bytes"][kept].tolist(),
            self.group[kept].tolist(),
            self.shape_pos[kept].tolist(),
            recs["step"][kept].tolist(),
            recs["t"][kept].tolist(),
            recs["end"][kept].tolist(),
            self.calls.index[kept].tolist(),
            strict=True,
        )
        out = []
        for s, size, g, sh, st, start, stop, i in rows:
            op, dtype, is_async, site, via = table[sh]
            out.append(
                make(
                    s,
                    names[g],
                    op,
                    None if size < 0 else size,
                    dtype,
                    is_async,
                    site,
                    st,
                    start,
                    stop or None,
                    errors.get(i),
                    None,
                    via,
                )
            )
        return out


def calls_between(
    calls: CallRecords,
    shapes: Mapping[int, Shape],
    group_name: Callable[[int], Any],
    errors: Mapping[int, str],
    span: tuple[float, float],
    most: int,
    make: type[Collective],
) -> tuple[list[Collective], int]:
    """The calls that overlap ``span`` (a call in flight when the file was read overlaps
    everything after its start), in the order they started: the first ``most``, those in
    flight since before the span past the bound, and how many more were left out."""
    if not len(calls):
        return [], 0
    cols = _Columns.of(calls, shapes, group_name)
    t, end = calls.records["t"], calls.records["end"]
    pending = end == 0.0
    inside = (t <= span[1]) & (pending | (end >= span[0]))
    at = np.flatnonzero(inside)
    at = at[np.argsort(t[at], kind="stable")]
    through = pending[at] & (t[at] < span[0])
    bounded = at[~through]
    kept = np.sort(np.concatenate((bounded[:most], at[through])))
    kept = kept[np.argsort(t[kept], kind="stable")]
    return cols.made(make, kept, errors), max(0, len(bounded) - most)


#: A ``calls_step`` record's groups: [gid, op, calls, bytes, ms in calls, longest ms, not ended].
StepSums = dict[int, list[list[Any]]]


def with_kept(calls: CallRecords, kept: CallRecords) -> CallRecords:
    """The call file's calls and, after them, those of the kept-calls file it does not hold
    (by group and sequence number), with indexes -1, -2, ... (theirs in the call file are
    not known: no ``coll_err`` names them)."""
    if not len(kept):
        return calls
    held = calls.records["gid"].astype(np.int64) << 40 | calls.records["seq"].astype(np.int64)
    theirs = kept.records["gid"].astype(np.int64) << 40 | kept.records["seq"].astype(np.int64)
    new = kept.records[~np.isin(theirs, held)]
    records = np.concatenate((calls.records, new))
    index = np.concatenate((calls.index, -1 - np.arange(len(new), dtype=np.int64)))
    return CallRecords(records, index, calls.head, calls.ring, calls.last, calls.missing, calls.lost)


def reduce_calls(
    calls: CallRecords,
    shapes: Mapping[int, Shape],
    group_name: Callable[[int], Any],
    errors: Mapping[int, str],
    windows: Mapping[str, list[tuple[int, int]]] | None,
    make: type[Collective],
    sums: StepSums | None = None,
) -> ReducedCalls:
    """The reduction of one call file's kept calls (``shapes``: the stream's shape records by
    id; ``group_name``: a gid's name; ``errors``: the stream's ``coll_err`` records, index ->
    error; ``windows``: group -> sequence ranges to keep in full; ``sums``: the stream's
    ``calls_step`` records by step).

    A step with sums is counted from them and from its calls in the file's head (the sums
    hold every other call of the step: the probes fold a call into them before the ring
    overwrites it), its calls in the ring or the kept-calls file (indexes below 0, from
    :func:`with_kept`) kept as detail only; a synchronous call's time is taken from the sums
    for an op whose every shape is synchronous."""
    out = ReducedCalls()
    recs = calls.records
    n = len(recs)
    sums = sums or {}
    if n == 0:
        _add_step_sums(out, sums, group_name, [])
        return out
    cols = _Columns.of(calls, shapes, group_name)
    out.unshaped = cols.unshaped
    t, end, seq, step, group, shape_pos = recs["t"], recs["end"], cols.seq, cols.step, cols.group, cols.shape_pos
    table, names, ops = cols.table, cols.names, cols.ops
    index = calls.index
    out.last_time = float(max(t.max(), end.max())) if n else 0.0
    summed = np.isin(step, np.fromiter(sums, dtype=np.int64, count=len(sums)))
    counted = ~summed | ((index >= 0) & (index < calls.head))
    sum_ops = sorted({str(g[1]) for groups in sums.values() for g in groups} - set(ops))
    ops = cols.ops = ops + sum_ops
    op_of_shape = np.array([ops.index(s[0]) for s in table], dtype=np.int64)
    op_code = np.array([name_code(s[0]) for s in table], dtype=np.uint64)
    dtype_code = np.array([name_code(s[1]) for s in table], dtype=np.uint64)
    async_of_shape = np.array([s[2] for s in table], dtype=bool)
    size = recs["bytes"]
    size_code = np.where(size < 0, np.uint64(NO_BYTES), size.astype(np.uint64))
    # digests: per (group, window) the sums modulo 2^64 of the calls' two hashes
    op_size = _mix(_mix(seq.astype(np.uint64) ^ op_code[shape_pos]) ^ size_code)
    full = _mix(op_size ^ dtype_code[shape_pos])
    window = (seq - 1) // WINDOW
    by_window = np.lexsort((window, group))
    g_sorted, w_sorted = group[by_window], window[by_window]
    starts = np.flatnonzero(np.r_[True, (g_sorted[1:] != g_sorted[:-1]) | (w_sorted[1:] != w_sorted[:-1])])
    with np.errstate(over="ignore"):
        op_sums = np.add.reduceat(op_size[by_window], starts)
        full_sums = np.add.reduceat(full[by_window], starts)
    win_group = g_sorted[starts]
    ended = end != 0.0
    # per group, its calls in call order (the kept-calls file's among them by number)
    by_group = np.lexsort((seq, group))
    bounds = np.searchsorted(group[by_group], np.arange(len(names) + 1))
    win_bounds = np.searchsorted(win_group, np.arange(len(names) + 1))
    kept_parts: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
    for g, name in enumerate(names):
        mine = by_group[bounds[g] : bounds[g + 1]]
        s = seq[mine]
        done = s[ended[mine]]
        tally = GroupTally(
            calls=int(np.count_nonzero(counted[mine])),
            first_seq=int(s[0]),
            last_seq=max(0, int(s.max())),
            last_done=max(0, int(done.max())) if len(done) else 0,
            ops={ops[i] for i in np.unique(op_of_shape[shape_pos[mine]]).tolist()},
        )
        lo, hi = win_bounds[g], win_bounds[g + 1]
        tally.digests = digests_of(
            array("q", w_sorted[starts[lo:hi]].tobytes()),
            array("Q", op_sums[lo:hi].tobytes()),
            array("Q", full_sums[lo:hi].tobytes()),
        )
        head = mine[:HEAD_CALLS]
        tally.head_last = int(seq[head[-1]])
        kept_parts.append(head)
        if len(mine) > HEAD_CALLS:
            tail = mine[HEAD_CALLS:][-TAIL_CALLS:]
            tally.tail_first = int(seq[tail[0]])
            kept_parts.append(tail)
            middle = mine[HEAD_CALLS : max(HEAD_CALLS, len(mine) - TAIL_CALLS)]
            keep = ~ended[middle]
            for w_lo, w_hi in (windows or {}).get(name, ()):
                keep |= (seq[middle] >= w_lo) & (seq[middle] <= w_hi)
            kept_parts.append(middle[keep])
        tally.missing = _missing(calls, index[mine], s)
        out.tallies[name] = tally
    in_file = np.flatnonzero(index >= 0)
    for a, b in calls.missing:
        at, past = int(np.searchsorted(index[in_file], a)), int(np.searchsorted(index[in_file], b, side="right"))
        first = int(step[in_file[at - 1]]) if at > 0 else int(step.min())
        last = int(step[in_file[past]]) if past < len(in_file) else int(step.max())
        out.unknown_steps.update(range(first + 1, last + 2))
    out.unknown_steps -= {s + 1 for s in sums}
    out.summed_steps = {s + 1 for s in sums}
    keep = counted
    _sums(
        out,
        t[keep],
        end[keep],
        step[keep],
        ended[keep],
        async_of_shape[shape_pos][keep],
        op_of_shape[shape_pos][keep],
        ops,
    )
    _add_step_sums(out, sums, group_name, table)
    # the calls kept, made once each, in the order they started
    kept = np.unique(np.concatenate(kept_parts)).astype(np.int64)
    kept = kept[stable_order(t[kept])]
    out.collectives = cols.made(make, kept, errors)
    return out


def _missing(calls: CallRecords, index: np.ndarray, seq: np.ndarray) -> list[tuple[int, int]]:
    """A group's sequence ranges the file did not keep (its calls' indexes and numbers given):
    between the last call kept before each missing index range and the first after, but
    those the kept-calls file holds (index below 0)."""
    if not calls.missing:
        return []
    in_file = index >= 0
    order = np.argsort(index[in_file], kind="stable")
    at_index, at_seq = index[in_file][order], seq[in_file][order]
    extra = np.sort(seq[~in_file])
    out: list[tuple[int, int]] = []
    for a, _ in calls.missing:
        at = int(np.searchsorted(at_index, a))
        lo = int(at_seq[at - 1]) + 1 if at > 0 else 0
        hi = int(at_seq[at]) - 1 if at < len(at_seq) else OPEN_END
        for held in extra[(extra >= lo) & (extra <= hi)].tolist():
            if lo < held:
                out.append((lo, held - 1))
            lo = held + 1
        if lo <= hi:
            out.append((lo, hi))
    return out


def _add_step_sums(out: ReducedCalls, sums: StepSums, group_name: Callable[[int], Any], table: list[Shape]) -> None:
    """The ``calls_step`` sums into the tallies' counts, the op totals and each step's time in
    synchronous calls (an op's, where every shape of it is synchronous)."""
    sync_ops = {op for op, *_ in table} - {op for op, _, is_async, *_ in table if is_async}
    for step, groups in sums.items():
        key, waited = step + 1, 0.0
        for gid, op, n, _nbytes, ms, _longest, open_ in groups:
            name = group_name(gid)
            tally = out.tallies.get(name)
            if tally is None:  # a group whose calls are all summed: counted, never compared
                tally = out.tallies[name] = GroupTally()
            tally.calls += int(n)
            tally.ops.add(str(op))
            seconds, done = out.op_totals.get(str(op), (0.0, 0))
            out.op_totals[str(op)] = (seconds + ms / 1e3, done + int(n) - int(open_))
            if op in sync_ops:
                waited += ms / 1e3
        if waited or key in out.sync:
            out.sync[key] = out.sync.get(key, 0.0) + waited
    if sums:
        out.sync = dict(sorted(out.sync.items()))


def _sums(
    out: ReducedCalls,
    t: np.ndarray,
    end: np.ndarray,
    step: np.ndarray,
    ended: np.ndarray,
    is_async: np.ndarray,
    op: np.ndarray,
    ops: list[str],
) -> None:
    """Per step + 1 the synchronous calls' seconds, per op the calls' seconds and count,
    summed over the completed calls in the order they started."""
    order = stable_order(t)
    order = order[ended[order]]
    took = end[order] - t[order]
    op_order = op[order]
    if len(order):
        seconds = np.bincount(op_order, weights=took, minlength=len(ops))
        counts = np.bincount(op_order, minlength=len(ops))
        _, first = np.unique(op_order, return_index=True)
        for i in np.sort(first).tolist():
            o = int(op_order[i])
            out.op_totals[ops[o]] = (float(seconds[o]), int(counts[o]))
    sync = ~is_async[order]
    keys, starts, took = step[order][sync] + 1, t[order][sync], took[sync]
    if len(keys):
        uniq, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
        sums = np.bincount(inverse, weights=took, minlength=len(uniq))
        for i in np.argsort(first, kind="stable").tolist():
            key = int(uniq[i])
            if key not in out.unknown_steps:
                out.sync[key] = float(sums[i])
    out.sync_calls = (keys, starts, took)
