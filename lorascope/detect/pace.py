"""Who set each step's pace, where in the step its time went, and what evening it out
would save: the per-step table that ``slow-steps``, ``job-slowdown``, ``straggler`` and
the report share (computed once a run: ``run.derived["pace"]``).

Per rank and step (the steps every rank completed, the first left out as warm-up):

* **cycle**: the step record's ``dur``, from the previous step's end to this one's: every
  rank's is about the same in synchronous training (the fast ones wait);
* **work**: the cycle less the time in synchronous collectives and the time blocked on
  async collectives' handles (``Work.wait``, ``wait_tensor``: the steps file's ``waited``,
  where the probes recorded it) (``straggler``'s measure, :func:`step_work`): what the rank
  did itself;
* **parts** of the work: ``data`` (from the step's begin, the previous step's end, to its
  first phase: fetching the batch, host-side work before the forward), each phase
  (``forward``, ``backward``, ``optimizer``, ``eval`` ...: its spans' time) and ``host``
  (the rest: host-side work outside the phases). The synchronous collectives are taken
  out of the part they ran in where the step's calls are all held (every call of short
  runs; :mod:`lorascope.rundir.loading.reduce` keeps the first and the newest of long ones), else
  the backward's from the backward (the reader's sums over every call) and the rest from
  ``host``; the time blocked on handles is taken out of the phase it was in, the rest of
  it from ``host``.

The **pace-setter** of a step is the rank with the most work in it (the one the others
waited for); the **what-if** (:func:`what_if`) replays each step with a set of ranks
doing the median of the other ranks' work: the step shortens by what the slowest of
them did beyond the slowest other rank. When the replayed steps have a baseline (steps
where the set was not slow), each other rank's work is first moved back to its own there
(its rise is the time it waited for them outside the synchronous collectives and the
recorded waits on handles, or ran slower beside them on shared cores). **Blame per collective** (:func:`blame`): of each
synchronous call every rank of its group holds, the late arriver (the latest start, the
clocks of other hosts shifted by their offset) and how long the others waited for it;
the offset of each host is the median difference of the calls' ends (a collective ends on
all its ranks at about the same moment), stated with the finding.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lorascope.detect.hang.divergence import listed_members
from lorascope.rundir.loading.reader import Collective, RankData, RunData
from lorascope.rundir.loading.reduce import backward_spans

#: The part before the first phase of a step, and the rest outside the phases.
DATA, HOST = "data", "host"
PART_LABELS = {
    DATA: "data loading (from the previous step's end to the forward: fetching the batch, host-side work before it)",
    HOST: "host-side work outside the phases",
}
#: The straggler's thresholds, shared by every pace rule. Healthy runs on the loaded 2-core test machine show one rank persistently up to 1.34x
#: the other (a core shared with other work): a straggler worth a warning is well beyond.
MIN_RATIO = 1.5
NOISE_FACTOR = 3.0
#: Ranks at most whose parts make the others' baseline (:meth:`PaceTable.sample`).
PART_SAMPLE = 64
#: Strip columns at most in the report and ``--json`` (the steps merged above that).
STRIP_COLUMNS = 1024
#: A call's waits are counted only up to this many seconds (a hang is hung-ranks' business).
_ABSURD_S = 3600.0


@dataclass
class StepWork:
    """Per rank, its own work per completed step (seconds), steps 2.. in order."""

    work: dict[int, dict[int, float]]
    #: How the waiting was taken out: "collectives" or "backward phase (DDP)".
    wait_from: dict[int, str]


def _work(rank: RankData) -> tuple[dict[int, float], str]:
    """Step number -> the rank's own work in that step: its wall time minus the time in
    recorded synchronous collectives and blocked on async collectives' handles (where the
    probes recorded it: ZeRO-3's prefetched all-gathers are waited on inside the forward).
    Outside DeepSpeed (or in a step without recorded collectives) the backward phase is
    taken out too: DDP's gradient all_reduce runs inside it, in C++, unrecorded; the
    recorded collectives and waits inside it (FSDP's reduce-scatters and backward
    all-gathers) are then not taken out a second time. The collectives' sums are the
    reader's, over every call (:mod:`lorascope.rundir.loading.reduce`)."""
    backward = {step: math.fsum(e - b for b, e in spans) for step, spans in backward_spans(rank.phases).items()}
    waited, outside_backward = rank.coll_wait, rank.coll_wait_outside_backward
    handles, handles_in = rank.handle_wait, rank.handle_wait_phases
    work, by_backward = {}, 0
    for s in rank.steps:
        step = s["step"]
        if step <= 1:
            continue
        held = handles.get(step, 0.0)
        if s.get("src") == "deepspeed" and step in waited:
            wait = waited[step] + held
        else:
            in_backward = handles_in.get(step, {}).get("backward", 0.0)
            wait = outside_backward.get(step, 0.0) + backward.get(step, 0.0) + max(0.0, held - in_backward)
            by_backward += 1
        work[step] = max(0.0, s["dur"] - wait)
    how = "recorded collectives" + (" and waits on their handles" if handles else "")
    return work, how + (" and the backward phase (DDP)" if by_backward > len(work) / 2 else "")


def others_medians(work: dict[int, dict[int, float]], ranks: list[int], steps: list[int]) -> dict[int, list[float]]:
    """Per rank, per step of ``steps`` (in order): the median of the other ranks' work,
    as ``statistics.median`` of them gives it. Each step's values are sorted once and a
    rank's own value is left out by position: O(ranks log ranks) a step, not ranks^2."""
    out: dict[int, list[float]] = {r: [] for r in ranks}
    others = len(ranks) - 1
    half = others // 2  # the median's index among the others (odd), else the upper one of two
    for s in steps:
        values = sorted(work[r][s] for r in ranks)
        for r in ranks:
            gone = bisect.bisect_left(values, work[r][s])  # the others: values without index ``gone``
            upper = values[half if half < gone else half + 1]
            if others % 2:
                out[r].append(upper)
            else:
                out[r].append((values[half - 1 if half - 1 < gone else half] + upper) / 2)
    return out


def step_work(run: RunData) -> StepWork:
    """Every rank's :func:`_work`, computed once a run (``run.derived["step_work"]``)."""
    if "step_work" not in run.derived:
        run.derived["step_work"] = _step_work(run)
    found: StepWork = run.derived["step_work"]
    return found


def _step_work(run: RunData) -> StepWork:
    work, how = {}, {}
    for n, rank in run.ranks.items():
        work[n], how[n] = _work(rank)
    return StepWork(work, how)


@dataclass
class PaceTable:
    """Per rank, per common step (index into ``steps``)."""

    ranks: list[int]
    steps: list[int]
    cycle: dict[int, list[float]]
    work: dict[int, list[float]]
    hosts: dict[int, str]
    #: The run the parts are read from, each rank's when first asked (:meth:`parts_of`).
    run: RunData | None = field(default=None, repr=False)
    #: Per step index, the median over ranks of the work and of the cycle.
    median_work: list[float] = field(default_factory=list)
    median_cycle: list[float] = field(default_factory=list)

    _parts: dict[int, dict[str, list[float]]] = field(default_factory=dict, repr=False)
    #: Per step index, the rank that set the pace (:meth:`setter`), once first asked.
    _setters: list[int] | None = field(default=None, repr=False)

    def parts_of(self, rank: int) -> dict[str, list[float]]:
        """The rank's parts per step (the module docstring), computed when first asked."""
        if rank not in self._parts:
            self._parts[rank] = _parts(self.run.ranks[rank], self.steps) if self.run is not None else {}
        return self._parts[rank]

    def sample(self, unit: Iterable[int] = ()) -> list[int]:
        """The ranks outside ``unit`` whose parts stand for the others': all of them up to
        :data:`PART_SAMPLE`, else that many evenly spaced (the parts of 1,024 ranks took
        seconds; a median over 64 of them is as good a baseline)."""
        out = set(unit)
        rest = [r for r in self.ranks if r not in out]
        if len(rest) <= PART_SAMPLE:
            return rest
        return [rest[i * len(rest) // PART_SAMPLE] for i in range(PART_SAMPLE)]

    def part_names(self, ranks: Iterable[int]) -> list[str]:
        """The parts every one of ``ranks`` has, data loading first, host-side work last."""
        names: set[str] | None = None
        for r in ranks:
            have = set(self.parts_of(r))
            names = have if names is None else names & have
        return sorted(names or (), key=lambda n: (n != DATA, n == HOST, n))

    def others_median(self, unit: Iterable[int], values: dict[int, list[float]], i: int) -> float:
        """The median over the ranks outside ``unit`` of ``values`` at step index ``i``."""
        out = set(unit)
        return statistics.median(values[r][i] for r in self.ranks if r not in out)

    def setter(self, i: int) -> int:
        """The rank of the most work at step index ``i`` (the first such in ``ranks``);
        every step's found once (each rank's episodes ask of every step)."""
        if self._setters is None:
            among, columns = range(len(self.ranks)), [self.work[r] for r in self.ranks]
            self._setters = [self.ranks[max(among, key=values.__getitem__)] for values in zip(*columns, strict=False)]
        return self._setters[i]


def _spans(rank: RankData) -> dict[int, dict[str, list[tuple[float, float]]]]:
    """Per step (+1, the step record's number), per phase name, its (begin, end) spans."""
    spans: dict[int, dict[str, list[tuple[float, float]]]] = {}
    open_: dict[tuple[int, str], float] = {}
    for p in rank.phases:
        key = (p["step"] + 1, p["name"])
        if p["edge"] == "begin":
            open_[key] = p["t"]
        elif key in open_:
            spans.setdefault(key[0], {}).setdefault(key[1], []).append((open_.pop(key), p["t"]))
    return spans


def _sync_calls(rank: RankData) -> dict[int, list[Collective]]:
    """The rank's completed synchronous calls held, by step (+1)."""
    out: dict[int, list[Collective]] = {}
    for c in rank.collectives:
        if not c.is_async and c.end is not None and c.err is None:
            out.setdefault(c.step + 1, []).append(c)
    return out


def _parts(rank: RankData, steps: list[int]) -> dict[str, list[float]]:
    """:class:`PaceTable`'s parts for one rank (see the module docstring)."""
    spans, calls = _spans(rank), _sync_calls(rank)
    by_step = {s["step"]: s for s in rank.steps}
    names = sorted({name for step in steps for name in spans.get(step, {})})
    parts: dict[str, list[float]] = {name: [] for name in [DATA, *names, HOST]}
    for step in steps:
        rec, phases = by_step[step], spans.get(step, {})
        begin, dur = rec["t"] - rec["dur"], float(rec["dur"])
        firsts = [b for ss in phases.values() for b, _ in ss]
        data = max(0.0, min(firsts) - begin) if firsts else 0.0
        times = {name: math.fsum(e - b for b, e in phases.get(name, [])) for name in names}
        held = calls.get(step, [])
        waited = rank.coll_wait.get(step, 0.0)
        if held and abs(math.fsum(c.end - c.start for c in held if c.end is not None) - waited) < 1e-3:
            wait_in = dict.fromkeys([*names, HOST], 0.0)
            for c in held:
                within = [n for n in names if any(b <= c.start <= e for b, e in phases.get(n, []))]
                wait_in[within[0] if within else HOST] += (c.end or c.start) - c.start
        else:
            in_backward = (
                waited - rank.coll_wait_outside_backward.get(step, 0.0) if rec.get("src") == "deepspeed" else 0.0
            )
            wait_in = dict.fromkeys(names, 0.0)
            if "backward" in wait_in:
                wait_in["backward"] = in_backward
            wait_in[HOST] = waited - in_backward
        blocked, blocked_in = rank.handle_wait.get(step, 0.0), rank.handle_wait_phases.get(step, {})
        if blocked:  # on handles: out of the phase it was in, the rest out of the host-side work
            placed = {n: w for n, w in blocked_in.items() if n in times}
            for n, w in placed.items():
                wait_in[n] = wait_in.get(n, 0.0) + w
            wait_in[HOST] += max(0.0, blocked - math.fsum(placed.values()))
        host = dur - data - math.fsum(times.values())
        parts[DATA].append(data)
        for name in names:
            parts[name].append(max(0.0, times[name] - wait_in[name]))
        parts[HOST].append(max(0.0, host - wait_in[HOST]))
    return parts


def table(run: RunData) -> PaceTable | None:
    """The run's :class:`PaceTable`, computed once; None under two ranks or a common step."""
    if "pace" not in run.derived:
        run.derived["pace"] = _table(run)
    found: PaceTable | None = run.derived["pace"]
    return found


def _table(run: RunData) -> PaceTable | None:
    if len(run.ranks) < 2:
        return None
    sw = step_work(run)
    common = sorted(set.intersection(*(set(w) for w in sw.work.values())))
    if not common:
        return None
    ranks = sorted(run.ranks)
    cycle = {}
    for r in ranks:
        durs = {s["step"]: float(s["dur"]) for s in run.ranks[r].steps}
        cycle[r] = [durs[s] for s in common]
    t = PaceTable(
        ranks=ranks,
        steps=common,
        cycle=cycle,
        work={r: [sw.work[r][s] for s in common] for r in ranks},
        hosts={r: run.ranks[r].host for r in ranks},
        run=run,
    )
    t.median_work = [statistics.median(t.work[r][i] for r in ranks) for i in range(len(common))]
    t.median_cycle = [statistics.median(t.cycle[r][i] for r in ranks) for i in range(len(common))]
    return t


def what_if(t: PaceTable, unit: Iterable[int], indexes: Iterable[int], baseline: Iterable[int] = ()) -> list[float]:
    """Per step index of ``indexes``, the seconds the step would have been shorter had the
    ranks of ``unit`` done the median rank's work (the median of the other ranks' work: of
    two ranks, the other one's; never below 0).

    With ``baseline`` (step indexes where the unit was not slow), each other rank's work
    is first moved by its median there less its median over ``indexes``: back to its own
    work when the unit was not slow. Its rise is what it spent waiting for the unit
    outside the recorded synchronous collectives, which evening the unit out removes too
    (ZeRO-3's prefetching all-gathers are waited on through a handle, inside the forward
    and backward: the replay that kept it as work under-predicted the saving); ranks that
    share cores with the unit also run faster or slower beside it than beside each other."""
    members = set(unit)
    idx = list(indexes)
    rise = others_rise(t, members, idx, list(baseline))
    out = []
    for i in idx:
        theirs = max(t.work[r][i] for r in members)
        rest = [t.work[r][i] - rise.get(r, 0.0) for r in t.ranks if r not in members]
        out.append(max(0.0, theirs - max(rest, default=0.0)))
    return out


def others_rise(t: PaceTable, unit: set[int], indexes: list[int], baseline: list[int]) -> dict[int, float]:
    """Per rank outside ``unit``: its median work over ``indexes`` less its median over
    ``baseline`` (negative when it fell); {} without a baseline."""
    if not baseline or not indexes:
        return {}
    return {
        r: statistics.median(t.work[r][i] for i in indexes) - statistics.median(t.work[r][i] for i in baseline)
        for r in t.ranks
        if r not in unit
    }


def host_groups(t: PaceTable) -> dict[str, list[int]]:
    """Host -> its ranks, when the ranks are on more than one host."""
    groups: dict[str, list[int]] = {}
    for r in t.ranks:
        groups.setdefault(t.hosts[r], []).append(r)
    return groups if len(groups) > 1 else {}


@dataclass
class Blame:
    """Of the synchronous calls every rank of their group holds: per rank, how often it
    arrived last and how long the others waited for it; the clock offsets used."""

    calls: int
    late: dict[int, int]
    caused_s: dict[int, float]
    #: Per step (the step record's number), per rank, the others' wait it caused.
    by_step: dict[int, dict[int, float]]
    #: Host -> seconds its clock is ahead of the reference host's (the first rank's).
    offsets: dict[str, float]
    reference: str | None
    #: Host -> calls its offset was taken from.
    offset_calls: dict[str, int]


def blame(run: RunData) -> Blame:
    """Blame per collective (the module docstring), computed once a run."""
    if "pace_blame" not in run.derived:
        run.derived["pace_blame"] = _blame(run)
    found: Blame = run.derived["pace_blame"]
    return found


def _blame(run: RunData) -> Blame:
    members = listed_members(run)
    held: dict[tuple[str, int], dict[int, Collective]] = {}
    for r, rank in run.ranks.items():
        for c in rank.collectives:
            if not c.is_async and c.end is not None and c.err is None:
                held.setdefault((c.group, c.seq), {})[r] = c
    complete = [
        calls for (group, _), calls in held.items() if len(calls) >= 2 and set(calls) >= members.get(group, set(calls))
    ]
    hosts = {r: rank.host for r, rank in run.ranks.items()}
    reference = hosts[min(hosts)] if hosts else None
    diffs: dict[str, list[float]] = {}
    for calls in complete:
        ends: dict[str, list[float]] = {}
        for r, c in calls.items():
            ends.setdefault(hosts[r], []).append(c.end or c.start)
        if reference in ends:
            ref = statistics.median(ends[reference])
            for h, e in ends.items():
                if h != reference:
                    diffs.setdefault(h, []).append(statistics.median(e) - ref)
    offsets = {h: statistics.median(d) for h, d in diffs.items()}
    late: dict[int, int] = {}
    caused: dict[int, float] = {}
    by_step: dict[int, dict[int, float]] = {}
    for calls in complete:
        arrive = {r: c.start - offsets.get(hosts[r], 0.0) for r, c in calls.items()}
        last = max(arrive, key=lambda r: (arrive[r], r))
        waited = math.fsum(
            min(arrive[last] - arrive[r], (c.end or c.start) - c.start, _ABSURD_S)
            for r, c in calls.items()
            if r != last
        )
        late[last] = late.get(last, 0) + 1
        caused[last] = caused.get(last, 0.0) + waited
        step = calls[last].step + 1
        by_step.setdefault(step, {})[last] = by_step.get(step, {}).get(last, 0.0) + waited
    return Blame(
        calls=len(complete),
        late=late,
        caused_s=caused,
        by_step=by_step,
        offsets=offsets,
        reference=reference,
        offset_calls={h: len(d) for h, d in diffs.items()},
    )


def offsets_text(b: Blame) -> str:
    """The clock offsets, stated: "one host: no offset" or each host's against the reference."""
    if not b.offsets:
        return "one host: no clock offset to take out"
    shown = ", ".join(f"{h} {v * 1000:+.2f} ms ({b.offset_calls[h]} calls)" for h, v in sorted(b.offsets.items()))
    return f"clock offsets against {b.reference}, from the calls' common ends: {shown}"


def strip(t: PaceTable) -> dict[str, Any]:
    """The pace-setter per step for the report and ``--json``: at most
    :data:`STRIP_COLUMNS` columns (merged steps: the rank that set the pace most often,
    the mean excess), each with the setter and its work beyond the median rank's (s)."""
    n = len(t.steps)
    width = max(1, -(-n // STRIP_COLUMNS))
    first, last, setter, excess = [], [], [], []
    for lo in range(0, n, width):
        idx = range(lo, min(n, lo + width))
        who = [t.setter(i) for i in idx]
        top = max(set(who), key=lambda r: (who.count(r), -r))
        first.append(t.steps[idx[0]])
        last.append(t.steps[idx[-1]])
        setter.append(top)
        excess.append(
            round(statistics.fmean(t.work[w][i] - t.median_work[i] for w, i in zip(who, idx, strict=True)), 4)
        )
    return {"first": first, "last": last, "setter": setter, "excess_s": excess, "width": width}


def what_if_summary(
    t: PaceTable, unit: Iterable[int], indexes: Iterable[int], baseline: Iterable[int] = ()
) -> dict[str, float]:
    """:func:`what_if` over ``indexes``: seconds saved a step (mean over those steps), in
    all, and as a share of the run (the common steps' median cycle, summed); with
    ``baseline``, the others' median rise taken out (``others_rise_s``)."""
    idx, members, base = list(indexes), set(unit), list(baseline)
    saved = what_if(t, members, idx, base)
    rise = others_rise(t, members, idx, base)
    run_s = math.fsum(t.median_cycle)
    their_s = math.fsum(t.median_cycle[i] for i in idx)
    total = math.fsum(saved)
    return {
        "steps": len(idx),
        "saved_per_step_s": total / len(idx) if idx else 0.0,
        "step_s": their_s / len(idx) if idx else 0.0,
        "predicted_step_s": (their_s - total) / len(idx) if idx else 0.0,
        "saved_s": total,
        "run_s": run_s,
        "share_of_run": total / run_s if run_s else 0.0,
        "others_rise_s": statistics.median(rise.values()) if rise else 0.0,
        "baseline_steps": len(base),
    }


def saving_text(w: dict[str, float]) -> str:
    """ "0.231 s a step over 20 steps (0.446 -> 0.215 s), 31% of the run's time" and, with a
    baseline, the others' rise taken out."""
    text = (
        f"{w['saved_per_step_s']:.3f} s a step over {int(w['steps'])} steps "
        f"({w['step_s']:.3f} -> {w['predicted_step_s']:.3f} s), {w['share_of_run']:.0%} of the run's time"
    )
    if w.get("baseline_steps"):
        text += (
            f"; the other ranks' work replayed at their own in the {int(w['baseline_steps'])} other steps "
            f"({w['others_rise_s'] * 1000:+.1f} ms a step here, median: waiting for it outside the synchronous "
            "collectives, or cores shared with it)"
        )
    return text


#: Ranks listed at most in :func:`summary`'s blame (those who made the others wait longest).
BLAME_LISTED = 16


def summary(run: RunData) -> dict[str, Any] | None:
    """The pace data ``analyze --json`` and the report carry: the pace-setter strip, the
    blame per collective (the ranks the others waited for longest, the clock offsets)."""
    t = table(run)
    if t is None:
        return None
    b = blame(run)
    top = sorted(b.caused_s, key=lambda r: (-b.caused_s[r], r))[:BLAME_LISTED]
    return {
        "steps": [t.steps[0], t.steps[-1]],
        "strip": strip(t),
        "blame": {
            "calls": b.calls,
            "ranks": [{"rank": r, "late": b.late[r], "others_waited_s": round(b.caused_s[r], 4)} for r in top],
            "offsets_s": {h: round(v, 6) for h, v in sorted(b.offsets.items())},
            "reference_host": b.reference,
            "offsets": offsets_text(b),
        },
    }
