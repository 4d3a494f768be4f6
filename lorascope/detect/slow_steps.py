"""slow-steps: a rank (or a group of ranks) set the pace for a stretch of the run: since
when, where in its step, who waited for it, and what evening it out would save.

``straggler`` names a rank slow for most of the run; a rank that becomes slow halfway,
or for a few dozen steps, or only in its data loading, is averaged away there. Per rank
and step, from the pace table (:mod:`lorascope.detect.pace`): the rank's **episodes**
(:mod:`lorascope.detect.episodes`): stretches of at least 5 steps in which it set the pace,
its work above the others' median by 3x the step-to-step noise of that excess, a change
against its own steps outside. On more than one host each host's ranks (up to half the
ranks) are a **group** too, tested as one unit (the slowest of them against the other
hosts' ranks' median); a rank's episode inside its host's is the host's. Ranks with at
least :data:`~lorascope.detect.episodes.MIN_HOT` hot steps but no episode of their own (2
to half the ranks: two slow GPUs of one node take turns) are tested as one group the same
way.

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
from typing import Any

from lorascope.detect.common import stream_source
from lorascope.detect.episodes import MIN_HOT, Episode, Unit, episodes, group_unit, rank_units, ratios
from lorascope.detect.finding import Evidence, Finding
from lorascope.detect.pace import (
    NOISE_FACTOR,
    PART_LABELS,
    PaceTable,
    blame,
    host_groups,
    offsets_text,
    saving_text,
    table,
    what_if_summary,
)
from lorascope.detect.straggler import from_run as straggler_of
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.rundir.loading.reader import RunData
from lorascope.units import rank_ranges

ID = "slow-steps"
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


def _finding(run: RunData, t: PaceTable, e: Episode) -> Finding:
    label = _label(t, e.ranks)
    when = _when(t, e)
    idx = range(e.first, e.last + 1)
    saving = what_if_summary(t, e.ranks, idx, e.outside(len(t.steps)) if e.baseline else ())
    parts = _parts(t, e)
    top = parts[0]
    ratio = statistics.median(ratios(t, e.ranks, idx))
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
        confidence="high" if hot_share >= 0.9 and excess >= 2 * NOISE_FACTOR * e.noise else "medium",
        confidence_reason=(
            f"hot (the most work, >= {NOISE_FACTOR:g}x the step-to-step noise of its excess over the others') in "
            f"{hot_share:.0%} of {e.last - e.first + 1} steps; median excess {excess * 1000:.1f} ms against noise "
            f"{e.noise * 1000:.1f} ms"
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


def _turn_takers(t: PaceTable, units: list[Unit], leave: set[int]) -> list[int]:
    """The ranks outside ``leave`` with at least :data:`MIN_HOT` hot steps (the pace set,
    well above the others), when they are 2 to half the ranks: tested together (two slow
    ranks take turns, and neither has an episode alone). Counting every step a rank set
    the pace took in the ranks that took turns before the slowness began."""
    group = sorted(u.ranks[0] for u in units if sum(u.hot) >= MIN_HOT and u.ranks[0] not in leave)
    return group if 2 <= len(group) <= len(t.ranks) // 2 else []


def from_run(run: RunData) -> list[Finding]:
    t = table(run)
    if t is None or len(t.steps) < MIN_HOT:
        return []
    named = straggler_of(run)
    skip = set(named.ranks) if named is not None else set()
    found = [
        e
        for ranks in host_groups(t).values()
        if 1 < len(ranks) <= len(t.ranks) // 2
        for e in episodes(t, group_unit(t, ranks))
    ]
    units = rank_units(t)
    for u in units:
        if u.ranks[0] in skip:
            continue
        for e in episodes(t, u):
            # a rank's episode inside its host's is the host's
            if not any(u.ranks[0] in g.ranks and _overlap(e, g) for g in found):
                found.append(e)
    group = _turn_takers(t, units, skip | {r for e in found for r in e.ranks})
    if group:
        found += episodes(t, group_unit(t, group))
    findings = [_finding(run, t, e) for e in sorted(found, key=lambda e: (e.first, e.ranks))]
    return [f for f in findings if f.details["what_if"]["share_of_run"] >= NOTE_SHARE]


def detect(bundle: EvidenceBundle) -> list[Finding]:
    return from_run(bundle.run) if bundle.run is not None else []
