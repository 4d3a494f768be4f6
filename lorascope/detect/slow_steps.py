"""slow-steps: a rank (or a group of ranks) set the pace for a stretch of the run: since
when, where in its step, who waited for it, and what evening it out would save.

``straggler`` names a rank slow for most of the run; a rank that becomes slow halfway,
or for a few dozen steps, or only in its data loading, is averaged away there. Per rank
and step, from the pace table (:mod:`lorascope.detect.pace`): the rank's work against the
median of the other ranks' work. A step is **hot** for a rank when its work is at least
:data:`MIN_RATIO` times the others' median and the excess is at least
:data:`NOISE_FACTOR` times the others' step-to-step noise (the median of their MADs): the
straggler's thresholds, step by step, and the rank set that step's pace (the most work:
two ranks that take turns are noise, as the straggler's persistence says). An
**episode** is a run of at least :data:`MIN_HOT` hot steps, at most :data:`MAX_GAP` cold
steps apart, hot in at least :data:`MIN_HOT_SHARE` of it
(:func:`lorascope.detect.shifts.episodes`). On more than one host each host's ranks
(up to half the ranks) are a **group** too: hot when the slowest of them is against the
other hosts' ranks' median and one of them set the pace; a rank's episode inside its
host's is the host's.

The finding says since when ("from step 20 on" when the episode reaches the last step,
else "in steps 12-18"), where (the part of the step whose excess over the others' is
largest: data loading, host-side work, a phase), who waited (blame per collective), and
the what-if: seconds a step and the share of the run that the unit doing the median
rank's work would have saved. **Severity** warning when that saving is at least
:data:`WARN_SHARE` of the run's time, else info; under :data:`NOTE_SHARE`, nothing. A
rank ``straggler`` already names is left to it (its finding carries the what-if too).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from lorascope.detect import shifts
from lorascope.detect.common import stream_source
from lorascope.detect.finding import Evidence, Finding
from lorascope.detect.pace import (
    PART_LABELS,
    PaceTable,
    blame,
    host_groups,
    offsets_text,
    saving_text,
    table,
    what_if_summary,
)
from lorascope.detect.straggler import MIN_RATIO, NOISE_FACTOR, _others_medians
from lorascope.detect.straggler import from_run as straggler_of
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.rundir.loading.reader import RunData
from lorascope.units import rank_ranges

ID = "slow-steps"
MIN_HOT = 5
MAX_GAP = 2
MIN_HOT_SHARE = 0.75
#: A saving of at least this share of the run's time is a warning; below, a note.
WARN_SHARE = 0.10
#: Below this share, nothing: the healthy sweep's 3-rank DDP runs on the loaded 2-core
#: machine showed episodes worth 3-4% of the run (a rank's forward +20-25 ms for a few
#: steps), noise worth no note.
NOTE_SHARE = 0.05
#: A rank's episode overlapping its host's by this share of the shorter is the host's.
GROUP_OVERLAP = 0.5

EXPLANATION = (
    "In synchronous training every step runs at the pace of the slowest rank: the others wait for it at the "
    "next collective. A rank that is slow only for a stretch of the run, or only in one part of its step, "
    "costs the whole job that stretch."
)
FIX = (
    "look at what the named part does on these ranks from the first step named: a data shard with longer "
    "samples or a slower disk (data loading), another process on their cores or a throttled device (every "
    "part), logging or checkpointing on one rank (host-side work); even it out or move it off the step's path"
)


@dataclass
class Episode:
    ranks: list[int]
    first: int  # step indexes, inclusive
    last: int
    hot: int


def _hot(t: PaceTable) -> tuple[dict[int, list[bool]], float]:
    """Per rank, which steps are hot (see the module docstring); the median noise."""
    others = _others_medians({r: dict(enumerate(t.work[r])) for r in t.ranks}, t.ranks, list(range(len(t.steps))))
    mads = {r: shifts.mad(t.work[r]) for r in t.ranks}
    noise_of = _others_medians({r: {0: mads[r]} for r in t.ranks}, t.ranks, [0])
    setters = [t.setter(i) for i in range(len(t.steps))]
    hot = {}
    for r in t.ranks:
        floor = NOISE_FACTOR * noise_of[r][0]
        hot[r] = [
            w >= MIN_RATIO * o and w - o >= floor and who == r
            for w, o, who in zip(t.work[r], others[r], setters, strict=True)
        ]
    return hot, statistics.median(mads.values())


def _host_hot(t: PaceTable, ranks: list[int]) -> list[bool]:
    """Which steps are hot for a host's ranks together: the slowest of them against the
    median of the other hosts' ranks, the pace set by one of them."""
    out, members = [], set(ranks)
    rest = [r for r in t.ranks if r not in members]
    floor = NOISE_FACTOR * statistics.median(shifts.mad(t.work[r]) for r in rest)
    for i in range(len(t.steps)):
        theirs = max(t.work[r][i] for r in ranks)
        o = statistics.median(t.work[r][i] for r in rest)
        out.append(theirs >= MIN_RATIO * o and theirs - o >= floor and t.setter(i) in members)
    return out


def _overlap(a: Episode, b: Episode) -> bool:
    """Whether two episodes share at least :data:`GROUP_OVERLAP` of the shorter one's steps."""
    shared = min(a.last, b.last) - max(a.first, b.first) + 1
    return shared >= GROUP_OVERLAP * (min(a.last - a.first, b.last - b.first) + 1)


def _label(t: PaceTable, ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    hosts = {t.hosts[r] for r in ranks}
    if len(hosts) == 1:
        host = hosts.pop()
        if sorted(r for r in t.ranks if t.hosts[r] == host) == ranks:
            return f"host {host}'s ranks ({rank_ranges(ranks)})"
    return f"ranks {rank_ranges(ranks)}"


def _when(t: PaceTable, e: Episode) -> str:
    if e.last == len(t.steps) - 1:
        return f"from step {t.steps[e.first]} on"
    return f"in steps {t.steps[e.first]}-{t.steps[e.last]}"


def _parts(t: PaceTable, e: Episode) -> list[dict[str, Any]]:
    """Per part, the unit's median in the episode, the others' median there (a sample of
    them past :data:`~lorascope.detect.pace.PART_SAMPLE`), and its own median outside the
    episode (None when too few steps lie outside): largest excess first."""
    inside = range(e.first, e.last + 1)
    outside = [i for i in range(len(t.steps)) if i < e.first or i > e.last]
    rows = []
    others = t.sample(e.ranks)
    for name in t.part_names([*e.ranks, *others]):
        mine = [statistics.fmean(t.parts_of(r)[name][i] for r in e.ranks) for i in inside]
        theirs = [statistics.median(t.parts_of(r)[name][i] for r in others) for i in inside]
        before = (
            statistics.median(statistics.fmean(t.parts_of(r)[name][i] for r in e.ranks) for i in outside)
            if len(outside) >= MIN_HOT
            else None
        )
        rows.append(
            {
                "part": name,
                "median_s": statistics.median(mine),
                "others_s": statistics.median(theirs),
                "excess_s": statistics.median(m - o for m, o in zip(mine, theirs, strict=True)),
                "own_outside_s": before,
            }
        )
    return sorted(rows, key=lambda p: -p["excess_s"])


def _part_text(p: dict[str, Any]) -> str:
    text = f"{p['median_s'] * 1000:.1f} ms a step vs the others' {p['others_s'] * 1000:.1f} ms"
    if p["own_outside_s"] is not None:
        base = p["own_outside_s"]
        change = f"{(p['median_s'] - base) * 1000:+.1f} ms"
        if base >= 0.005:
            change += f", {(p['median_s'] - base) / base:+.0%}"
        text += f"; its own outside these steps {base * 1000:.1f} ms ({change})"
    return text


def _finding(run: RunData, t: PaceTable, e: Episode, noise: float) -> Finding:
    label = _label(t, e.ranks)
    when = _when(t, e)
    idx = range(e.first, e.last + 1)
    saving = what_if_summary(t, e.ranks, idx)
    parts = _parts(t, e)
    top = parts[0]
    ratio = statistics.median(
        max(t.work[r][i] for r in e.ranks) / max(t.others_median(e.ranks, t.work, i), 1e-9) for i in idx
    )
    excess = statistics.median(max(t.work[r][i] for r in e.ranks) - t.others_median(e.ranks, t.work, i) for i in idx)
    b = blame(run)
    steps_in = {t.steps[i] for i in idx}
    caused = sum(w for s, by in b.by_step.items() if s in steps_in for r, w in by.items() if r in e.ranks)
    late = sum(1 for s, by in b.by_step.items() if s in steps_in for r in by if r in e.ranks)
    calls_in = sum(1 for s, by in b.by_step.items() if s in steps_in for _ in by)
    set_pace = sum(1 for i in idx if t.setter(i) in e.ranks)
    where = PART_LABELS.get(top["part"], f"the {top['part']} phase")
    title = (
        f"{label} set the pace {when}: {where.split(' (')[0]} +{top['excess_s'] * 1000:.0f} ms a step over the "
        f"others'; evening it out would save {saving['saved_per_step_s']:.3f} s a step, "
        f"{saving['share_of_run']:.0%} of the run's time"
    )
    source = stream_source(run, run.ranks[e.ranks[0]], "step and phase records")
    evidence = [
        Evidence(
            "since when",
            f"{when}: work {ratio:.2f}x the others' median, hot in {e.hot} of {e.last - e.first + 1} steps "
            f"(steps {t.steps[e.first]}-{t.steps[e.last]} of {t.steps[0]}-{t.steps[-1]})",
            source,
        ),
        *[
            Evidence(f"{label}: {PART_LABELS.get(p['part'], p['part'])}", _part_text(p), source)
            for p in parts
            if p["excess_s"] > 0
        ][:4],
        Evidence("what if", saving_text(saving), "per-step work replayed (lorascope/detect/pace.py)"),
        Evidence(
            "pace",
            f"{label} did the most work in {set_pace} of {len(idx)} of these steps",
            "per-step work compared across ranks",
        ),
        Evidence(
            "blame per collective",
            (
                f"arrived last at {late} of {calls_in} synchronous collectives of these steps held by every rank; "
                f"the others waited {caused:.3f} s for it in all; {offsets_text(b)}"
            )
            if calls_in
            else f"no synchronous collective of these steps is held by every rank; {offsets_text(b)}",
            "call records",
        ),
    ]
    hot_share = e.hot / (e.last - e.first + 1)
    return Finding(
        id=ID,
        title=title,
        severity="warning" if saving["share_of_run"] >= WARN_SHARE else "info",
        confidence="high" if hot_share >= 0.9 and excess >= 2 * NOISE_FACTOR * noise else "medium",
        confidence_reason=(
            f"hot (work >= {MIN_RATIO:g}x the others' median and >= {NOISE_FACTOR:g}x their noise) in {hot_share:.0%} "
            f"of {e.last - e.first + 1} steps; median excess {excess * 1000:.1f} ms against noise "
            f"{noise * 1000:.1f} ms (MAD)"
        ),
        ranks=list(e.ranks),
        evidence=evidence,
        explanation=EXPLANATION,
        fix=FIX,
        details={
            "label": label,
            "first_step": t.steps[e.first],
            "last_step": t.steps[e.last],
            "to_end": e.last == len(t.steps) - 1,
            "ratio": ratio,
            "excess_s": excess,
            "part": top["part"],
            "parts": parts,
            "what_if": saving,
            "blame": {"late": late, "calls": calls_in, "caused_s": caused, "offsets": b.offsets},
        },
    )


def from_run(run: RunData) -> list[Finding]:
    t = table(run)
    if t is None or len(t.steps) < MIN_HOT:
        return []
    hot, noise = _hot(t)
    named = straggler_of(run)
    skip = set(named.ranks) if named is not None else set()
    hosts = [ranks for ranks in host_groups(t).values() if len(ranks) > 1]
    found = [
        Episode(ranks, a, b, sum(h[a : b + 1]))
        for ranks in hosts
        if len(ranks) <= len(t.ranks) // 2
        for h in [_host_hot(t, ranks)]
        for a, b in shifts.episodes(h, MIN_HOT, MAX_GAP, MIN_HOT_SHARE)
    ]
    for r in t.ranks:
        if r in skip:
            continue
        for a, b in shifts.episodes(hot[r], MIN_HOT, MAX_GAP, MIN_HOT_SHARE):
            e = Episode([r], a, b, sum(hot[r][a : b + 1]))
            # a rank's episode inside its host's is the host's
            if not any(r in g.ranks and _overlap(e, g) for g in found):
                found.append(e)
    findings = [_finding(run, t, e, noise) for e in sorted(found, key=lambda e: (e.first, e.ranks))]
    return [f for f in findings if f.details["what_if"]["share_of_run"] >= NOTE_SHARE]


def detect(bundle: EvidenceBundle) -> list[Finding]:
    return from_run(bundle.run) if bundle.run is not None else []
