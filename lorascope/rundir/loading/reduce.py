"""A rank's stream reduced to a bounded summary while it is read (analysis side).

A long job makes ~100-150 collective calls and writes ~15 other records per rank and step:
1,024 ranks x 10,000 steps is ~10^9 calls, far more than one machine holds as objects. The
reader (:mod:`lorascope.rundir.loading.reader`) therefore keeps, per rank, only what the
detectors and the report use, and counts the rest as it reads (the calls as numpy columns:
:mod:`lorascope.rundir.loading.callreduce`):

* **collectives**, per process group: the first :data:`HEAD_CALLS` and the last
  :data:`TAIL_CALLS` calls, every call still pending, and a :class:`GroupTally` (count,
  last sequence number, last completed one, the ops seen, and one digest per
  :data:`WINDOW` sequence numbers). Ranks are then aligned by comparing digests
  (:mod:`lorascope.rundir.loading.align`): only the windows where they differ, and the one where the
  shortest rank stops, are read again in full;
* what is summed over every call: each step's time in synchronous collectives (the
  straggler's waiting; kept for the kept steps below), and each op's total time and calls
  (the report), summed in the order the calls started, as a sort of the whole list would;
* **step-keyed records** (memory samples, phase edges, steps, logits): every record of the
  first and the last steps, and of every ``stride``-th step between, within a budget of
  steps per rank (:func:`decimate`); the records that hold a peak are always kept, and
  those it is sure to drop are dropped while the stream is read (:class:`StepKeeper`);
* counts of every listed kind, the median step time and the last loss over all steps.

A stream within the bounds is kept whole: the reduction changes nothing for it.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import heapq
import statistics
import sys
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from sortedcontainers import SortedList

from lorascope.rundir.loading.records import PhaseEdge

if TYPE_CHECKING:
    from lorascope.rundir.loading.reader import Collective

#: Calls kept per process group: the first ones, and the newest ones.
HEAD_CALLS = 512
TAIL_CALLS = 1024
#: Sequence numbers per digest window (ranks are compared window by window).
WINDOW = 256
#: Calls read on either side of a window that has to be read again (>= the report's
#: alignment chart window, so a chart around a divergence has its neighbours).
WINDOW_PAD = 64
#: Completed calls waiting behind an older pending one before they are summed anyway.
MAX_REORDER = 1 << 18
#: Step-keyed records: rank-steps kept over the whole run, and at least per rank.
STEP_BUDGET = 1 << 17
MIN_STEPS_KEPT = 64
#: Warnings kept per rank (all are counted).
KEEP_WARNINGS = 200


def steps_per_rank(ranks: int) -> int:
    """The step budget of one rank in a run of ``ranks`` ranks."""
    return max(MIN_STEPS_KEPT, STEP_BUDGET // max(ranks, 1))


#: What :meth:`StepKeeper.bounds` says: (low, high, stride).
Rule = tuple[int | None, int, int]


def sure_dropped(rule: Rule, step: Any) -> bool:
    """Whether decimation is sure to drop what is keyed by step number ``step`` (a record's
    step; a per-step sum's key, the step record's number): a whole number with
    ``low < step < high`` (no lower bound if low is None), not a multiple of the stride."""
    low, high, stride = rule
    return isinstance(step, int) and (low is None or step > low) and step < high and step % stride != 0


#: Arithmetic modulo 2^64 (a call's hash, a window's digest).
MASK = (1 << 64) - 1
#: splitmix64's finaliser's constants; a missing size's code in a call's hash.
MIX_A, MIX_B = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
NO_BYTES = 0x9E3779B97F4A7C15


def mix(z: int) -> int:
    """splitmix64's finaliser: a 64-bit value's bits spread over all 64."""
    z = ((z ^ (z >> 30)) * MIX_A) & MASK
    z = ((z ^ (z >> 27)) * MIX_B) & MASK
    return z ^ (z >> 31)


@functools.lru_cache(maxsize=4096)
def name_code(name: str | None) -> int:
    """A 64-bit code of an op or dtype name (None too) in a call's hash."""
    return int.from_bytes(hashlib.blake2b(repr(name).encode(), digest_size=8).digest(), "little")


def call_hashes(seq: int, op: str, size: int | None, dtype: str | None) -> tuple[int, int]:
    """A call's two hashes: of (seq, op, bytes), and of that with the dtype. A window's
    digest is their sum modulo 2^64 over its calls: the same whatever order they were read
    in, so it can be summed over columns at once (:mod:`lorascope.rundir.loading.callreduce`
    computes the same over uint64 columns, which wrap modulo 2^64 too)."""
    op_size = mix(mix((seq & MASK) ^ name_code(op)) ^ (NO_BYTES if size is None else size & MASK))
    return op_size, mix(op_size ^ name_code(dtype))


class Digests(Mapping[int, tuple[int, int]]):
    """A group's window digests (window index -> the two sums modulo 2^64 of its calls'
    :func:`call_hashes`): a dict while a stream is read, then three arrays sorted by window
    (24 bytes a window, pickled and held; the calling process holds every rank's, and a
    dict of tuples took ~230: 1,024 ranks x 10,000 steps of the probes/ job, ~430 MB).
    Equal when they hold the same digests (the arrays are kept in one canonical order)."""

    __slots__ = ("_open", "_index", "_op_size", "_full")

    def __init__(self) -> None:
        self._open: dict[int, tuple[int, int]] = {}
        self._index: array[int] = array("q")
        self._op_size: array[int] = array("Q")
        self._full: array[int] = array("Q")

    def add(self, window: int, op_size: int, full: int) -> None:
        """Hashes (or their sums) added to a window's digest."""
        if self._index:  # added to after it was read: open again
            self._open = dict(self._pairs())
            self._index, self._op_size, self._full = array("q"), array("Q"), array("Q")
        held = self._open.get(window)
        if held is not None:
            op_size, full = (held[0] + op_size) & MASK, (held[1] + full) & MASK
        self._open[window] = (op_size, full)

    def columns(self) -> tuple[array[int], array[int], array[int]]:
        """The window indexes, sorted, and their two digests (do not change them)."""
        if self._open:
            order = sorted(self._open)
            self._index = array("q", order)
            self._op_size = array("Q", (self._open[w][0] for w in order))
            self._full = array("Q", (self._open[w][1] for w in order))
            self._open = {}
        return self._index, self._op_size, self._full

    def _pairs(self) -> Iterator[tuple[int, tuple[int, int]]]:
        index, op_size, full = self.columns()
        return zip(index, zip(op_size, full, strict=True), strict=True)

    def __getitem__(self, window: int) -> tuple[int, int]:
        index, op_size, full = self.columns()
        i = bisect.bisect_left(index, window)
        if i == len(index) or index[i] != window:
            raise KeyError(window)
        return op_size[i], full[i]

    def __iter__(self) -> Iterator[int]:
        return iter(self.columns()[0])

    def __len__(self) -> int:
        return len(self.columns()[0])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Digests):
            return self.columns() == other.columns()
        return super().__eq__(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Digests({dict(self._pairs())!r})"

    def __reduce__(self) -> tuple[Callable[..., Digests], tuple[array[int], array[int], array[int]]]:
        return digests_of, self.columns()


def digests_of(index: array[int], op_size: array[int], full: array[int]) -> Digests:
    """Digests of window indexes (sorted, distinct) and their two sums (a pickled
    :class:`Digests` made again; the numpy reduction's columns)."""
    out = Digests()
    out._index, out._op_size, out._full = index, op_size, full
    return out


@dataclass
class GroupTally:
    """Everything one rank called in one process group, counted (the calls themselves are
    bounded)."""

    calls: int = 0
    first_seq: int | None = None
    last_seq: int = 0
    #: The highest sequence number of a completed call (0: none completed).
    last_done: int = 0
    ops: set[str] = field(default_factory=set)
    #: Window index -> (digest of seq, op and size; digest with the dtype too): the sums
    #: modulo 2^64 of its calls' :func:`call_hashes`.
    digests: Digests = field(default_factory=Digests)
    #: The last call kept from the start; the first of the newest calls kept (None: all kept).
    head_last: int = 0
    tail_first: int | None = None
    #: Sequence ranges (inclusive) whose calls the rank's call file did not keep (its ring
    #: went round over them, or a slot was torn): known to no one, compared with nothing.
    missing: list[tuple[int, int]] = field(default_factory=list)

    def add_to_digest(self, window: int, op_size: int, full: int) -> None:
        """Calls' :func:`call_hashes` (or their sums) added to a window's digest."""
        self.digests.add(window, op_size, full)

    def holds(self, lo: int, hi: int) -> bool:
        """Whether every call of this rank with a sequence number in lo..hi is kept."""
        return not any(a <= hi and lo <= b for a, b in self.missing) and not self.dropped(lo, hi)

    def dropped(self, lo: int, hi: int) -> bool:
        """Whether the reduction dropped calls numbered lo..hi, between the first calls kept
        and the newest (a read again that keeps lo..hi in full holds them; what the call
        file did not keep, ``missing``, no read holds)."""
        if self.first_seq is None or self.tail_first is None:
            return False
        return max(lo, self.head_last + 1) <= min(hi, self.tail_first - 1)


class SyncTimes:
    """A rank's completed synchronous calls, (start, seconds) by step (+1), held for the
    time outside backward (:func:`sync_outside_backward`), and each step's sum of them
    (``sums``: the rank's ``coll_wait``)."""

    def __init__(self) -> None:
        self.sums: dict[int, float] = {}
        self.calls: dict[int, list[tuple[float, float]]] = {}

    def add(self, step: int, start: float, took: float) -> None:
        self.sums[step] = self.sums.get(step, 0.0) + took
        self.calls.setdefault(step, []).append((start, took))


class CollectiveLog:
    """The bounded collective records of one rank, fed call by call: the reduction of a
    RankData built in memory (:func:`lorascope.rundir.loading.reader.recount`; a test's, a
    synthetic run's). The reader computes the same over a call file's columns
    (:mod:`lorascope.rundir.loading.callreduce`)."""

    def __init__(self, windows: dict[str, list[tuple[int, int]]] | None = None) -> None:
        self.tallies: dict[str, GroupTally] = {}
        self.head: dict[str, list[Collective]] = {}
        self.tail: dict[str, deque[Collective]] = {}
        #: Calls asked for by sequence number (a window read again), per group.
        self.windows = windows or {}
        self.extra: list[Collective] = []
        self.sync = SyncTimes()
        self.op_totals: dict[str, tuple[float, int]] = {}
        self._order: list[tuple[float, int, Collective]] = []
        self._n = 0

    def add(self, coll: Collective) -> None:
        """A call read: its start, or (``end`` set) the whole call."""
        group, seq = coll.group, coll.seq
        tally = self.tallies.get(group)
        if tally is None:
            tally = self.tallies[group] = GroupTally(first_seq=seq)
            self.head[group] = []
        tally.calls += 1
        if seq > tally.last_seq:
            tally.last_seq = seq
        if coll.end is not None and seq > tally.last_done:
            tally.last_done = seq
        tally.ops.add(coll.op)
        self._hash(coll)
        head = self.head[group]
        if len(head) < HEAD_CALLS:
            head.append(coll)
            tally.head_last = seq
        else:
            tail = self.tail.get(group)
            if tail is None:
                tail = self.tail[group] = deque(maxlen=TAIL_CALLS)
            if len(tail) == TAIL_CALLS:
                old = tail[0]
                if old.end is None or (self.windows and self._asked(old)):
                    self.extra.append(old)
            tail.append(coll)
            tally.tail_first = tail[0].seq
        order = self._order
        if not order and coll.end is not None:
            self._sum(coll)  # nothing older pending: summed in order as it is
            return
        heapq.heappush(order, (coll.start, self._n, coll))
        self._n += 1
        if order[0][2].end is not None or len(order) > MAX_REORDER:
            self._release(False)

    def _asked(self, coll: Collective) -> bool:
        return any(lo <= coll.seq <= hi for lo, hi in self.windows.get(coll.group, ()))

    def _hash(self, coll: Collective) -> None:
        op_size, full = call_hashes(coll.seq, coll.op, coll.bytes, coll.dtype)
        self.tallies[coll.group].add_to_digest((coll.seq - 1) // WINDOW, op_size, full)

    def _release(self, everything: bool) -> None:
        """Sum completed calls in the order they started: a call waits while an older one
        is pending (or, past MAX_REORDER, is summed anyway)."""
        order = self._order
        while order and (everything or order[0][2].end is not None or len(order) > MAX_REORDER):
            _, _, coll = heapq.heappop(order)
            if coll.end is not None:
                self._sum(coll)

    def _sum(self, coll: Collective) -> None:
        assert coll.end is not None
        took = coll.end - coll.start
        if not coll.is_async:
            self.sync.add(coll.step + 1, coll.start, took)
        total, n = self.op_totals.get(coll.op, (0.0, 0))
        self.op_totals[coll.op] = (total + took, n + 1)

    def finish(self) -> list[Collective]:
        """Close the sums; the kept calls, in the order they started."""
        self._release(True)
        kept: dict[int, Collective] = {}
        for pool in (*self.head.values(), *self.tail.values(), self.extra):
            for coll in pool:
                kept[id(coll)] = coll
        for group, tail in self.tail.items():
            if tail and self.tallies[group].tail_first is not None:
                self.tallies[group].tail_first = tail[0].seq
        calls = list(kept.values())
        calls.sort(key=lambda c: c.start)
        return calls

    def outside_backward(self, spans: dict[int, list[tuple[float, float]]]) -> dict[int, float]:
        """Per step (+1), the time in synchronous calls that started outside every backward
        phase of the step (FSDP's backward collectives run inside it); call after
        :meth:`finish`, with the backward spans of every phase record (:func:`backward_spans`)."""
        out = sync_outside_backward(self.sync.calls, spans)
        self.sync.calls = {}
        return out


def sync_outside_backward(
    sync: dict[int, list[tuple[float, float]]], spans: dict[int, list[tuple[float, float]]]
) -> dict[int, float]:
    """Per step (+1), the seconds of the synchronous calls ``sync`` holds ((start,
    seconds) per step + 1) that started outside every backward span of the step."""
    out: dict[int, float] = {}
    for step, calls in sync.items():
        for start, took in calls:
            if not any(b <= start <= e for b, e in spans.get(step, [])):
                out[step] = out.get(step, 0.0) + took
    return out


def _numbers(rec: dict[str, Any], prefix: str = "") -> Iterable[tuple[str, float]]:
    """Every numeric field of a record, one level of nesting (``cuda.reserved``)."""
    for key, value in rec.items():
        if isinstance(value, dict) and not prefix:
            yield from _numbers(value, key + ".")
            if isinstance(value.get("used"), int | float) and isinstance(value.get("total"), int | float):
                if value["total"]:
                    yield key + ".share", value["used"] / value["total"]
        elif isinstance(value, int | float) and not isinstance(value, bool) and key not in ("t", "step"):
            yield prefix + key, value


def _peaks(records: list[dict[str, Any]], by: str | None = None) -> set[int]:
    """Indexes of the records that hold the highest value of each numeric field (per
    ``by`` value, when given): of each, the first."""
    return _fold_peaks(records, by)[0]


def _fold_peaks(records: list[dict[str, Any]], by: str | None = None) -> tuple[set[int], bool]:
    """:func:`_peaks`, and whether any value was a NaN."""
    nan = False
    best: dict[tuple[Any, str], tuple[float, int]] = {}
    for i, rec in enumerate(records):
        tag = rec.get(by) if by else None
        for label, item in rec.items():
            kind = type(item)
            if kind is int or kind is float:  # most fields (~10^5 records a rank): no generator
                if label == "t" or label == "step":
                    continue
                numbers: Iterable[tuple[str, float]] = ((label, item),)
            elif kind is str or kind is list or item is None:  # never numeric (_numbers)
                continue
            else:
                numbers = _numbers({label: item})
            for name, value in numbers:
                key = (tag, name)
                held = best.get(key)
                if held is None or value > held[0]:
                    best[key] = (value, i)
                elif value != value:
                    nan = True
    return {i for _, i in best.values()}, nan or any(value != value for value, _ in best.values())


def kept_steps(steps: Iterable[int], budget: int, stride: int | None = None) -> tuple[int, set[int]]:
    """The step numbers kept of ``steps`` within ``budget``: the first and the last quarter
    of the budget, and every ``stride``-th between (the smallest power of two that fits,
    unless given). Returns (stride, kept); stride 1 keeps every step."""
    ordered = np.unique(np.fromiter(steps, dtype=np.int64))
    if stride is None and len(ordered) <= budget:
        return 1, set(ordered.tolist())
    edge = budget // 4
    head, tail = set(ordered[:edge].tolist()), set(ordered[-edge:].tolist()) if edge else set()
    middle = ordered[edge : len(ordered) - edge]
    if stride is None:
        stride = 1
        while np.count_nonzero(middle % stride == 0) > budget - 2 * edge:
            stride *= 2
    if stride == 1:
        return 1, set(ordered.tolist())
    return stride, head | tail | set(middle[middle % stride == 0].tolist())


def decimate(data: Any, budget: int, stride: int | None = None) -> int:
    """Keep the step-keyed records of ``data`` (a RankData) and its per-step sums of the
    collectives for the kept steps, and the records holding a peak; returns the stride."""
    stride, kept = kept_steps((s["step"] for s in data.steps), budget, stride)
    if stride == 1:
        return 1
    last = max((s["step"] for s in data.steps), default=0)

    def keep(rec: dict[str, Any]) -> bool:
        step = rec.get("step")
        return not isinstance(step, int) or step in kept or step > last

    peaks = _peaks(data.mem)
    data.mem = [m for i, m in enumerate(data.mem) if i in peaks or keep(m)]
    logit_peaks = _peaks(data.logits, by="where")
    data.logits = [r for i, r in enumerate(data.logits) if i in logit_peaks or keep(r)]
    data.phases = [p for p in data.phases if keep(p)]
    data.steps = [s for s in data.steps if keep(s)]
    # the per-step sums of the collectives, keyed by the step record's number (the step in
    # progress): every step's (~0.24 KB a rank-step, both) would grow with the run
    data.coll_wait = {k: v for k, v in data.coll_wait.items() if k in kept or k > last}
    data.coll_wait_outside_backward = {
        k: v for k, v in data.coll_wait_outside_backward.items() if k in kept or k > last
    }
    data.handle_wait = {k: v for k, v in data.handle_wait.items() if k in kept or k > last}
    data.handle_wait_phases = {k: v for k, v in data.handle_wait_phases.items() if k in kept or k > last}
    return stride


def share_values(data: Any) -> None:
    """One object for each distinct string or integer value of the kept step-keyed records
    of ``data`` (a RankData) and of its kept calls' sizes and steps: each line's were its
    own (a step's number in each of its ~17 records, the same size in call after call), so
    a rank's summary pickled them, and the calling process held them, once a record. A
    rank of 1,024 x 300 steps (128 kept): 1.86 -> 1.64 MB held by the calling process when
    strings were shared; integers and the calls' too, 1.80 -> 1.67 MB by a deep count,
    285 -> 275 KB pickled. The steps file's steps and phase edges share theirs as they are
    made (:func:`lorascope.rundir.loading.steps.as_records`: one object per step number,
    their strings the interpreter's interned ones): only the other records are gone through,
    their strings interned too, their integers joined to the steps' numbers."""
    seen: dict[Any, Any] = {}
    for rec in data.steps:
        seen.setdefault(rec["step"], rec["step"])
    intern = sys.intern
    for records in (data.mem, data.logits):
        for rec in records:
            for key, value in rec.items():
                if type(value) is str:
                    rec[key] = intern(value)
                elif type(value) is int:
                    rec[key] = seen.setdefault(value, value)
    for call in data.collectives:
        call.bytes = seen.setdefault(call.bytes, call.bytes)
        call.step = seen.setdefault(call.step, call.step)


def totals(data: Any, mem: int) -> dict[str, Any]:
    """What is computed over every step-keyed record before any is dropped (``data.steps``:
    every step record; ``mem``: how many mem records were read): counts, the median step
    time, the last loss."""
    durations = [s["dur"] for s in data.steps if s["dur"] > 0]
    losses = [s["loss"] for s in data.steps if s.get("loss") is not None]
    return {
        "steps": len(data.steps),
        "mem": mem,
        "warnings": len(data.warnings),
        "step_time_median_s": statistics.median(durations) if durations else None,
        "last_loss": losses[-1] if losses else None,
    }


#: Step-keyed records a reader holds before it first drops those that decimation would
#: drop (:class:`StepKeeper`); after each time, twice what it kept and this many more.
PRUNE_RECORDS = 1 << 15


class StepKeeper:
    """A rank's step-keyed records as they are read: it takes what is computed over all of
    them (the count of ``mem`` records) and, every so often, drops
    the ``mem``, ``phase`` and ``logits`` records that :func:`decimate` is sure to drop at the
    end, so that a reader holds about its budget's records, not every step's (the step
    records themselves, ~0.4 KB a step, are kept whole: a later ``loss`` record may change
    one). The result of :func:`decimate` does not change:

    * a record is dropped only if its step is a whole number with at least a quarter of the
      budget of step numbers below and above it (it will be in neither the first nor the
      last steps kept: they only get further away) and is not a multiple of the stride
      the step numbers so far already need (the final stride is a multiple of it: the
      numbers between the first and last steps only grow in number);
    * a record holding a peak (:func:`_peaks` of the records held, which are the peaks of
      every record so far) is never dropped, so the peaks at the end are the same; a NaN
      could make the order matter, so a kind in which one is seen is dropped from no more.
    """

    def __init__(self, budget: int) -> None:
        self.edge = budget // 4
        self.room = budget - 2 * self.edge
        #: How many mem records were read (:func:`totals`), made or not.
        self.mem = 0
        #: The distinct step numbers of the step records so far, sorted (a SortedList: a
        #: list's insert moved every later number, so a stream whose step numbers go down
        #: took quadratic time: 400,000 such steps 12 s, now 0.7 s; 1.8 us a step as a
        #: run goes); how many step records they come from; per k, how many of those
        #: between the first and the last ``edge`` are multiples of 2^k.
        self.numbers = SortedList()
        self._taken = 0
        self._multiples = [0] * 64
        self._nan = {"mem": False, "logits": False}
        self._next = PRUNE_RECORDS

    def note_steps(self, numbers: list[int]) -> None:
        """Step numbers known before their records are (a steps file read first). A
        number is counted once, when it is among the middle's (it stays there as numbers
        come), so what the keeper holds after does not depend on their order: into an
        empty keeper, they are counted at once."""
        if self.numbers:
            for step in numbers:
                self._number(step)
            return
        self.numbers = SortedList(set(numbers))
        middle = np.array(self.numbers[self.edge : len(self.numbers) - self.edge], dtype=np.int64)
        for k in range(64):
            self._multiples[k] = int(np.count_nonzero(middle & ((1 << k) - 1) == 0))
            if not self._multiples[k]:
                break

    def held(self, data: Any) -> None:
        """``data``'s lists grew: drop what is sure to be dropped, every so often."""
        if len(data.mem) + len(data.phases) + len(data.logits) >= self._next:
            self.prune(data)
            self._next = 2 * (len(data.mem) + len(data.phases) + len(data.logits)) + PRUNE_RECORDS

    def bounds(self, data: Any) -> Rule | None:
        """(low, high, stride): the records whose step is a whole number s with ``low < s <
        high`` (no lower bound if low is None) and ``s % stride != 0`` are sure to be
        dropped by :func:`decimate` (:func:`sure_dropped`) unless they hold a peak, from
        the step records so far (None: no step is yet sure to be dropped)."""
        for rec in data.steps[self._taken :]:
            self._number(rec["step"])
        self._taken = len(data.steps)
        stride = next((1 << k for k, n in enumerate(self._multiples) if n <= self.room), 1)
        numbers, edge = self.numbers, self.edge
        if stride == 1 or len(numbers) <= 2 * edge:
            return None
        return (numbers[edge - 1] if edge else None), (numbers[-edge] if edge else numbers[-1] + 1), stride

    def prune(self, data: Any) -> None:
        """Drop the records of ``data`` that :func:`decimate` is sure to drop."""
        rule = self.bounds(data)
        if rule is None:
            return
        data.phases = [p for p in data.phases if not sure_dropped(rule, p["step"])]
        for name, by in (("mem", None), ("logits", "where")):
            if self._nan[name]:
                continue
            records = getattr(data, name)
            peaks, nan = _fold_peaks(records, by)
            if nan:
                self._nan[name] = True
                continue
            setattr(
                data, name, [r for i, r in enumerate(records) if i in peaks or not sure_dropped(rule, r.get("step"))]
            )

    def _number(self, step: int) -> None:
        """A step record's number into the sorted numbers, and the multiples counted of
        those that came between the first and the last ``edge`` with it."""
        numbers = self.numbers
        i = numbers.bisect_left(step)
        if i < len(numbers) and numbers[i] == step:
            return
        numbers.add(step)
        low, high = self.edge, len(numbers) - self.edge  # the middle's indexes: [low, high)
        if low <= i < high:
            self._count(step)
        if i < low < high:  # the head's last one was pushed into the middle
            self._count(numbers[low])
        if i >= high > low:  # so was the tail's first one
            self._count(numbers[high - 1])

    def _count(self, step: int) -> None:
        k = 0
        while k < 64 and step % (1 << k) == 0:
            self._multiples[k] += 1
            k += 1


def backward_spans(phases: Iterable[PhaseEdge]) -> dict[int, list[tuple[float, float]]]:
    """Per step (+1, the step record's number), the (begin, end) times of its backward
    phases that ended."""
    spans: dict[int, list[tuple[float, float]]] = {}
    begin: dict[int, float] = {}
    for p in phases:
        if p["name"] != "backward":
            continue
        step = p["step"] + 1
        if p["edge"] == "begin":
            begin[step] = p["t"]
        elif step in begin:
            spans.setdefault(step, []).append((begin.pop(step), p["t"]))
    return spans
