"""A running job as `lorascope watch` shows it: each rank's state, kept up to date from the
lines its stream appends and the records its call file, steps file and memory file gain
(:class:`lorascope.rundir.loading.tail.Tail`), and the checks that can run on a partial run.

Lines are taken in a block at a time (what one stream appended), without decoding
most of them: watch runs for hours beside the job. One regular expression, anchored where
a line begins (``{"``), picks out the first key of the rare kinds, which are decoded whole
(``start``, ``dist_init``, ``group``, ``shape``, ``label``, ``stall``, ``dump``,
``exception``, ``signal``, ``end``, ``probe_error``). Steps and phase edges come as the
steps file's columns (number, duration, time; the last phase edge's label), memory
readings as the memory file's (the latest, the highest). Calls come as columns, a
look's calls of many processes at once (each one's new calls, and those pending at the
last look read again): the pending ones are kept, and the seconds of the synchronous
ones that ended are summed per process and step, in one pass over the columns (a rank's
work in a step is its step time less them).
Memory is bounded: per rank the last :data:`KEEP_STEPS` steps, the pending calls (at most
:data:`MAX_PENDING`), the group and shape names.

The checks (:meth:`LiveRun.checks`), each from what was read so far:

* a rank ended badly (its ``exception`` or ``signal`` record, or an ``end`` record not exit 0;
  a rank killed without a word ends with its launch, for the verdict);
* the stall watchdog fired on a rank (its ``stall`` record: no step for its limit);
* a rank is not stepping: no step for :data:`STALL_FACTOR` times the run's median step
  and at least :data:`STALL_MIN_S` (the first step: since the rank started, at least
  :data:`FIRST_STEP_MIN_S`), said with what it is in: a collective pending since when,
  or outside any (the rank the others wait for, when they are in one);
* a rank is slower: its own work per step (step time minus its time in synchronous
  collectives and blocked on async collectives' handles, as the ``straggler`` detector
  measures it) over its last steps is
  ``pace.MIN_RATIO`` times the other ranks' median or more, over at least
  ``straggler.MIN_STEPS`` steps;
* fewer ranks seen than the world size their ``start`` records name.

The full detectors need the whole run: `watch` runs them once (``analyze``) when the run
has ended, for the verdict.
"""

from __future__ import annotations

import bisect
import json
import re
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lorascope.detect.pace import MIN_RATIO
from lorascope.detect.straggler import MIN_STEPS
from lorascope.rundir.format.layout import BEGIN, STEP_END
from lorascope.rundir.loading.tail import Batch, Followed, Looked, Tail
from lorascope.units import short_error

#: Steps kept per rank for its step time and work.
KEEP_STEPS = 16
#: Pending calls kept per rank (the oldest first: the one a hang sits in).
MAX_PENDING = 64
#: A rank is "not stepping" after this many median steps without one, and at least STALL_MIN_S.
STALL_FACTOR = 4.0
STALL_MIN_S = 2.0
#: Before a rank's first step: seconds since its start before it counts as not stepping
#: (model loading, DeepSpeed's start, a first compilation).
FIRST_STEP_MIN_S = 120.0
#: Ranks not seen for this long after the first rank started count as missing.
MISSING_AFTER_S = 30.0

#: The lines watch decodes, matched where they begin (``{"``) in the probes' layouts: the
#: first key of a rare kind (``start`` and ``dist_init`` begin with rank, ``group`` gid,
#: ``shape`` and ``label`` their kind, ``stall`` seconds, ``dump`` reason, ``exception``
#: type, ``signal`` signum, ``end`` status, ``fatal_handler`` file, ``probe_error`` probe).
#: Nested objects do not match (a match must begin a line).
_LINE = re.compile(rb'\{"(?:rank|gid|k":"shape|k":"label|seconds|reason|type|signum|status|file|probe)"')
#: Every ``mem`` reading's RSS in a block of lines, at once (seven a step).


@dataclass
class LiveRank:
    """What one rank process did, so far."""

    rank: int
    process: str
    partial: bool = False
    host: str | None = None
    pid: int | None = None
    started: float | None = None
    world_size: int | None = None
    step: int = 0
    last_step_t: float | None = None
    durs: deque[float] = field(default_factory=lambda: deque(maxlen=KEEP_STEPS))
    #: The last steps past the first: (number, duration less the time blocked on handles).
    timed: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=KEEP_STEPS))
    #: Seconds in synchronous collectives per step (the steps completed when they began),
    #: of the steps from the oldest one in ``timed`` on.
    waited: dict[int, float] = field(default_factory=dict)
    mem_now: int | None = None
    mem_peak: int | None = None
    #: "cuda" once a reading carries the CUDA allocator's figures, else "rss".
    mem_metric: str = "rss"
    #: (gid, seq) -> (start time, op).
    pending: dict[tuple[int, int], tuple[float, str]] = field(default_factory=dict)
    phase: str | None = None
    last_t: float = 0.0
    groups: dict[int, str] = field(default_factory=dict)
    #: Shape id -> (op, async).
    shapes: dict[int, tuple[str, bool]] = field(default_factory=dict)
    #: The ids of its async shapes (as a call record holds them: 32-bit).
    async_shapes: list[int] = field(default_factory=list)
    #: Label id -> its text (a phase's name).
    labels: dict[int, str] = field(default_factory=dict)
    #: How it ended: (status, detail) from its exception / signal / end / fatal record.
    ended: tuple[str, str] | None = None
    stall: dict[str, Any] | None = None
    dumps: int = 0
    probe_errors: int = 0

    @property
    def work(self) -> list[float]:
        """Its own work in each of its last steps (past the first): the step's time less its
        time in synchronous collectives and blocked on handles (as the ``straggler``
        detector measures it)."""
        get = self.waited.get  # a view computes this for every rank: no call but the dict's
        return [w if (w := dur - get(step - 1, 0.0)) > 0.0 else 0.0 for step, dur in self.timed]

    def take(self, data: bytes) -> None:
        """Lines the stream appended (without the last newline)."""
        pos, search = 0, _LINE.search
        while (m := search(data, pos)) is not None:
            start, pos = m.start(), m.end()
            if start and data[start - 1] != 10:  # inside a line: a nested object
                continue
            end = data.find(b"\n", pos)
            end = len(data) if end < 0 else end
            self._rare(data[start:end])
            pos = end

    def _readings(self, metric: str, now: int, peak: int) -> None:
        """Memory readings of one ``metric`` (``cuda``: the allocator's, allocated now and
        its peak; ``rss``): the latest one's figure is the rank's memory now, ``peak`` the
        highest of theirs. A CUDA rank's are the allocator's (once it has one, its RSS
        readings are left out), else RSS."""
        if metric == "cuda":
            if self.mem_metric != "cuda":
                self.mem_metric, self.mem_peak = "cuda", None
        elif self.mem_metric == "cuda":
            return
        self.mem_now = now
        self.mem_peak = peak if self.mem_peak is None else max(self.mem_peak, peak)

    def _step(self, step: int, dur: float, t: float, blocked: float = 0.0) -> None:
        """A step's end (``blocked``: its time blocked on async collectives' handles)."""
        self.last_t = max(self.last_t, t)
        self.step = step
        self.last_step_t = t
        self.durs.append(dur)
        if step > 1:
            self.timed.append((step, dur - blocked))
            oldest = self.timed[0][0] - 1
            if len(self.waited) > 2 * KEEP_STEPS:
                self.waited = {s: w for s, w in self.waited.items() if s >= oldest}

    def _rare(self, line: bytes) -> None:
        try:
            rec = json.loads(line)
        except ValueError:
            return
        if isinstance(rec, dict) and isinstance(rec.get("k"), str):
            if isinstance(rec.get("t"), (int, float)):
                self.last_t = max(self.last_t, float(rec["t"]))
            self._decoded(rec["k"], rec)

    def _decoded(self, kind: str, rec: dict[str, Any]) -> None:
        if kind == "start":
            self.host, self.pid, self.started = rec.get("host"), rec.get("pid"), rec.get("t")
            self.world_size = rec.get("world_size")
        elif kind == "dist_init" and isinstance(rec.get("world_size"), int):
            self.world_size = rec["world_size"]
        elif kind == "group" and isinstance(rec.get("gid"), int):
            self.groups[rec["gid"]] = str(rec.get("name"))
        elif kind == "shape" and isinstance(rec.get("id"), int):
            self.shapes[rec["id"]] = (str(rec.get("op")), rec.get("async") is True)
            if rec.get("async") is True and -(1 << 31) <= rec["id"] < 1 << 31:
                self.async_shapes.append(rec["id"])
        elif kind == "label" and isinstance(rec.get("id"), int):
            self.labels[rec["id"]] = str(rec.get("text"))
        elif kind == "stall":
            self.stall = rec
        elif kind == "dump":
            self.dumps += 1
        elif kind == "probe_error":
            self.probe_errors += 1
        elif kind == "exception":
            self.ended = ("exception", short_error(f"{rec.get('type')}: {rec.get('message', '')}", 200))
        elif kind == "signal":
            self.ended = ("signal", str(rec.get("name")))
        elif kind == "end" and self.ended is None:
            code = rec.get("code")
            self.ended = ("exit", f"exit {code}") if rec.get("status") == "exit" else (str(rec.get("status")), "")
        elif kind == "fatal_handler":
            pass  # the file is written only if the rank dies of a fatal signal: read at the end

    def oldest_pending(self) -> tuple[float, str, str] | None:
        """(since, op, group name) of the call pending longest."""
        if not self.pending:
            return None
        (gid, _), (t, op) = min(self.pending.items(), key=lambda kv: kv[1][0])
        return t, op, self.groups.get(gid, str(gid))

    @property
    def bad_end(self) -> bool:
        return self.ended is not None and self.ended[1] != "exit 0"


@dataclass
class Check:
    """A finding so far: what it is, how bad, which ranks, one line of evidence."""

    id: str
    severity: str
    ranks: list[int]
    text: str


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _add_waits(ranks: list[LiveRank], records: np.ndarray, owner: np.ndarray, is_async: np.ndarray) -> None:
    """Add the seconds of the synchronous calls that ended (``is_async``: which records
    name an async shape) to their rank's step (those of steps before the oldest a rank
    keeps left out), a run of records of one process and step at a time."""
    done = np.flatnonzero((records["end"] != 0.0) & ~is_async)
    if not len(done):
        return
    keys = owner[done] << 32 | (records["step"][done].astype(np.int64) + (1 << 31))
    firsts = np.flatnonzero(np.diff(keys, prepend=-1))
    seconds = np.add.reduceat((records["end"] - records["t"])[done], firsts)
    for key, secs in zip(keys[firsts].tolist(), seconds.tolist(), strict=True):
        rank, step = ranks[key >> 32], (key & 0xFFFFFFFF) - (1 << 31)
        if len(rank.timed) < KEEP_STEPS or step >= rank.timed[0][0] - 1:
            rank.waited[step] = rank.waited.get(step, 0.0) + secs


class LiveRun:
    """Every rank's :class:`LiveRank`, fed by the tail's looks."""

    def __init__(self) -> None:
        self.processes: dict[tuple[int, str], LiveRank] = {}
        #: Every process's async shapes as sorted keys (its number << 32 | the shape id),
        #: its number (position in ``processes``) by ``id()``; None: to be made again (a
        #: process or a line was taken since: a ``shape`` line is one).
        self._async: tuple[np.ndarray, dict[int, int]] | None = None

    def update(self, tail: Tail, whole: bool = False) -> None:
        """Take in what a look of ``tail`` finds: the streams' lines, the steps and memory
        files' records, then the calls (the lines declare the shapes the calls name);
        ``whole``: the memory files too, however recently they were read (the last look)."""
        self.take(tail.look())
        for batch in tail.look_steps():
            self.take_steps(batch)
        for batch in tail.look_mem(now=whole):
            self.take_mem(batch)
        for batch in tail.look_calls():
            self.take_calls(batch)

    def _process(self, stream: Followed) -> LiveRank:
        key = (stream.rank, stream.process)
        rank = self.processes.get(key)
        if rank is None:
            rank = self.processes[key] = LiveRank(stream.rank, stream.process, partial=stream.partial)
            self._async = None
        return rank

    def take(self, looked: Iterable[Looked]) -> None:
        for stream, lines in looked:
            self._process(stream).take(lines)
            self._async = None

    def _of_async_shapes(self, ranks: list[LiveRank], owner: np.ndarray, shape: np.ndarray) -> np.ndarray:
        """Which records (of ``ranks[owner]``) name an async shape of their process: (the
        process's number, the shape) as one key, looked up in the sorted keys of the async
        shapes, made again only when a line or a process was taken since."""
        if self._async is None:
            procs = list(self.processes.values())
            keys = [at << 32 | (s & 0xFFFFFFFF) for at, rank in enumerate(procs) for s in rank.async_shapes]
            self._async = np.sort(np.asarray(keys, dtype=np.int64)), {id(r): at for at, r in enumerate(procs)}
        known, number = self._async
        if not len(known):
            return np.zeros(len(shape), dtype=bool)
        numbers = np.fromiter((number[id(r)] for r in ranks), np.int64, len(ranks))
        keys = numbers[owner] << 32 | (shape.astype(np.int64) & 0xFFFFFFFF)
        found: np.ndarray = known[np.minimum(np.searchsorted(known, keys), len(known) - 1)] == keys
        return found

    def take_steps(self, batch: Batch) -> None:
        """Steps-file records of a look, many processes' at once: each one's steps' ends,
        and its phase edges (the last one says which phase it is in)."""
        ranks = [self._process(stream) for stream in batch.processes]
        records, owner = batch.records, batch.owner
        kinds = records["kind"]
        ended = np.flatnonzero(kinds == STEP_END)
        done = (owner[ended].tolist(), records["step"][ended].tolist(), records["dur"][ended].tolist(),
                records["t"][ended].tolist(), records["waited"][ended].tolist())  # fmt: skip
        for at, step, dur, t, blocked in zip(*done, strict=True):
            ranks[at]._step(step, dur, t, blocked)
        edges = np.flatnonzero(kinds < STEP_END)
        if not len(edges):
            return
        of = owner[edges]  # each process's records are together: so are its edges
        firsts = np.flatnonzero(np.diff(of, prepend=-1))
        lasts = edges[np.append(firsts[1:] - 1, len(edges) - 1)]
        latest = np.maximum.reduceat(records["t"][edges], firsts)
        cols = (of[firsts].tolist(), records["label"][lasts].tolist(), kinds[lasts].tolist(), latest.tolist())
        for at, label, kind, t in zip(*cols, strict=True):
            rank = ranks[at]
            rank.phase = rank.labels.get(label, "?") if kind == BEGIN else None
            rank.last_t = max(rank.last_t, t)

    def take_mem(self, batch: Batch) -> None:
        """Memory-file readings of a look, many processes' at once, as each process's
        readings in order would leave it (:meth:`LiveRank._readings`): of those with the CUDA
        allocator's figures (a device), the last one's and the highest peak; of a process
        with none, its last RSS reading and the highest."""
        ranks = [self._process(stream) for stream in batch.processes]
        records, owner = batch.records, batch.owner
        cuda = records["device"] >= 0
        for of, now, peak in (("cuda", "alloc", "max_alloc"), ("rss", "rss", "rss")):
            at = np.flatnonzero(cuda if of == "cuda" else ~cuda & (records["rss"] >= 0))
            if not len(at):
                continue
            who = owner[at]
            firsts = np.flatnonzero(np.diff(who, prepend=-1))  # each process's records are together
            lasts = at[np.append(firsts[1:] - 1, len(at) - 1)]
            highest = np.maximum.reduceat(records[peak][at], firsts)
            cols = (who[firsts].tolist(), records[now][lasts].tolist(), highest.tolist())
            for process, last, high in zip(*cols, strict=True):
                ranks[process]._readings(of, last, high)

    def take_calls(self, batch: Batch) -> None:
        """Call records of a look, many processes' at once (the calls each had pending at
        the last look read again, then its new ones), taken in as columns: per process,
        the latest time it wrote, the calls pending now (every call it had pending was
        read again: those not ended) and the seconds of its synchronous calls that ended,
        added to the step they began in."""
        ranks = [self._process(stream) for stream in batch.processes]
        for rank in ranks:
            if rank.pending:
                rank.pending = {}
        records, owner = batch.records, batch.owner
        if not len(records):
            return
        t, end = records["t"], records["end"]
        counts = np.bincount(owner, minlength=len(ranks))
        has = np.flatnonzero(counts)  # each process's records are together
        latest = np.maximum.reduceat(np.maximum(t, end), (np.cumsum(counts) - counts)[has])
        for at, last_t in zip(has.tolist(), latest.tolist(), strict=True):
            ranks[at].last_t = max(ranks[at].last_t, last_t)
        _add_waits(ranks, records, owner, self._of_async_shapes(ranks, owner, records["shape"]))
        for at in np.flatnonzero(end == 0.0).tolist():
            rank = ranks[owner[at]]
            if len(rank.pending) < MAX_PENDING:
                gid, seq, shape = int(records["gid"][at]), int(records["seq"][at]), int(records["shape"][at])
                rank.pending[(gid, seq)] = (float(t[at]), rank.shapes.get(shape, ("?", False))[0])

    @property
    def ranks(self) -> dict[int, LiveRank]:
        """Per rank, its latest process (a restarted rank's new one)."""
        out: dict[int, LiveRank] = {}
        for proc in self.processes.values():
            known = out.get(proc.rank)
            if known is None or (proc.started or 0) >= (known.started or 0):
                out[proc.rank] = proc
        return dict(sorted(out.items()))

    def world_size(self) -> int | None:
        sizes = [r.world_size for r in self.processes.values() if r.world_size is not None]
        return max(sizes) if sizes else None

    def median_step(self, steps: dict[int, float] | None = None) -> float | None:
        """The median of the ranks' median step times (``steps``: :meth:`step_times`, when
        the caller has them)."""
        return _median(list((self.step_times() if steps is None else steps).values()))

    def step_times(self, ranks: dict[int, LiveRank] | None = None) -> dict[int, float]:
        """Per rank with steps: its median step time (of ``ranks``: :attr:`ranks`, when
        the caller has them)."""
        return {n: statistics.median(r.durs) for n, r in (self.ranks if ranks is None else ranks).items() if r.durs}

    def ended(self) -> bool:
        ranks = self.ranks
        size = self.world_size()
        return bool(ranks) and all(r.ended is not None for r in ranks.values()) and (size is None or len(ranks) >= size)

    def not_stepping(self, rank: LiveRank, now: float, median: float | None) -> float | None:
        """Seconds without a step, when that is long enough to say (else None)."""
        if rank.ended is not None:
            return None
        if rank.last_step_t is None:
            since = rank.started if rank.started is not None else rank.last_t
            return now - since if since and now - since >= FIRST_STEP_MIN_S else None
        limit = max(STALL_MIN_S, STALL_FACTOR * median) if median else STALL_MIN_S
        quiet = now - rank.last_step_t
        return quiet if quiet >= limit else None

    def work_ratio(self, ranks: dict[int, LiveRank] | None = None) -> dict[int, float]:
        """Per rank with enough steps: its median work over the median of the other ranks'
        (as the straggler detector compares: with two ranks, the other one)."""
        of = self.ranks if ranks is None else ranks
        medians = {n: statistics.median(r.work) for n, r in of.items() if len(r.timed) >= MIN_STEPS}
        if len(medians) < 2:
            return {}
        ordered = sorted(medians.values())
        out = {}
        for n, m in medians.items():
            i = bisect.bisect_left(ordered, m)
            others = len(ordered) - 1

            def other(j: int, i: int = i) -> float:  # the j-th smallest of the others
                return ordered[j if j < i else j + 1]

            typical = other(others // 2) if others % 2 else (other(others // 2 - 1) + other(others // 2)) / 2
            if typical > 0:
                out[n] = m / typical
        return out

    def checks(
        self,
        now: float,
        median: float | None = None,
        ratios: dict[int, float] | None = None,
        ranks: dict[int, LiveRank] | None = None,
    ) -> list[Check]:
        """The findings so far, most severe first (see the module docstring); ``median``,
        ``ratios`` and ``ranks``: :meth:`median_step`, :meth:`work_ratio` and
        :attr:`ranks`, when the caller has them."""
        ranks = self.ranks if ranks is None else ranks
        found: list[Check] = []
        bad = [r for r in ranks.values() if r.bad_end]
        for r in bad[:3]:
            assert r.ended is not None
            found.append(Check("ended-badly", "error", [r.rank], f"ended: {r.ended[1] or r.ended[0]}"))
        if len(bad) > 3:
            found.append(Check("ended-badly", "error", [r.rank for r in bad[3:]], f"and {len(bad) - 3} more ranks"))
        median = self.median_step() if median is None else median
        quiet = {n: q for n, r in ranks.items() if (q := self.not_stepping(r, now, median)) is not None}
        if quiet:
            outside = sorted(n for n in quiet if not ranks[n].pending)
            waiting = sorted(n for n in quiet if ranks[n].pending)
            if outside:
                longest = max(quiet[n] for n in outside)
                times = f" ({longest / median:.0f}x median)" if median else ""
                found.append(
                    Check("not-stepping", "warning", outside, f"no step for {longest:.0f} s{times}, in no collective")
                )
            if waiting:
                calls = [ranks[n].oldest_pending() for n in waiting]
                op = max((c for c in calls if c is not None), key=lambda c: now - c[0])
                found.append(
                    Check(
                        "waiting",
                        "warning",
                        waiting,
                        f"in {op[1]} {now - op[0]:.1f} s, no step",
                    )
                )
        stalled = [r for r in ranks.values() if r.stall is not None and r.ended is None]
        if stalled:
            limit = stalled[0].stall.get("limit") if stalled[0].stall else None
            found.append(
                Check(
                    "stall-watchdog",
                    "warning",
                    [r.rank for r in stalled],
                    f"the stall watchdog fired: no step for its limit ({limit} s); dumps written",
                )
            )
        slow = {n: x for n, x in (self.work_ratio(ranks) if ratios is None else ratios).items() if x >= MIN_RATIO}
        if slow:
            worst = max(slow, key=lambda n: slow[n])
            found.append(
                Check(
                    "slower",
                    "warning",
                    sorted(slow),
                    f"works up to {slow[worst]:.1f}x the others' median per step (last {KEEP_STEPS} steps)",
                )
            )
        size = self.world_size()
        first = min((r.started for r in ranks.values() if r.started), default=None)
        if size is not None and len(ranks) < size and first is not None and now - first >= MISSING_AFTER_S:
            missing = sorted(set(range(size)) - set(ranks))
            found.append(
                Check("ranks-missing", "warning", missing, f"{len(missing)} of {size} ranks never wrote a stream")
            )
        return found

    def view(self, now: float) -> tuple[list[dict[str, Any]], list[Check], float | None]:
        """The rows, the checks and the median step, at ``now``, each computed once."""
        ranks = self.ranks
        steps = self.step_times(ranks)
        median, ratios = self.median_step(steps), self.work_ratio(ranks)
        return self.rows(now, median, ratios, ranks, steps), self.checks(now, median, ratios, ranks), median

    def rows(
        self,
        now: float,
        median: float | None,
        ratios: dict[int, float],
        ranks: dict[int, LiveRank] | None = None,
        steps: dict[int, float] | None = None,
    ) -> list[dict[str, Any]]:
        """One plain row per rank: what the view shows (``level``: ok, warning, error);
        ``ranks`` and ``steps``: :attr:`ranks` and :meth:`step_times`, when the caller has
        them."""
        ranks = self.ranks if ranks is None else ranks
        steps = self.step_times(ranks) if steps is None else steps
        out = []
        for n, r in ranks.items():
            oldest = r.oldest_pending()
            quiet = self.not_stepping(r, now, median)
            if r.ended is not None:
                state, level = r.ended[1] or r.ended[0], "error" if r.bad_end else "ok"
            elif r.stall is not None and quiet is not None:
                state, level = f"stalled {quiet:.0f}s (watchdog)", "warning"
            elif quiet is not None:
                state, level = f"no step {quiet:.0f}s", "warning"
            elif ratios.get(n, 0) >= MIN_RATIO:
                state, level = "slower", "warning"
            else:
                state, level = (r.phase or "running"), "ok"
            out.append(
                {
                    "rank": n,
                    "host": r.host,
                    "step": r.step,
                    "step_s": steps.get(n),
                    "work_x": ratios.get(n),
                    "mem_now": r.mem_now,
                    "mem_peak": r.mem_peak,
                    "metric": r.mem_metric,
                    "pending": None
                    if oldest is None
                    else {"op": oldest[1], "group": oldest[2], "for_s": now - oldest[0]},
                    "state": state,
                    "level": level,
                    "partial": r.partial,
                }
            )
        return out
