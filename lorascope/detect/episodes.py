"""Since when a rank (or a group of ranks) set the job's pace: its episodes, shared by
``slow-steps`` (which names them) and ``straggler`` (which leaves a rank that became slow
to it).

A **unit** is a rank or a group of ranks tested as one. Its **excess** per step is the
most work of its ranks less the median of the other ranks' work (what the whole job
shares, a machine's load rising, cancels out). A step is **hot** for it when one of its
ranks set that step's pace (the most work: ranks that take turns are noise) and the
excess is at least :data:`~lorascope.detect.pace.NOISE_FACTOR` times the excess's
step-to-step noise (:func:`lorascope.detect.shifts.step_noise`: a change of level does not
inflate it). An **episode** is a run of at least :data:`MIN_HOT` hot steps, at most
:data:`MAX_GAP` cold steps apart, hot in at least :data:`MIN_HOT_SHARE` of it, that is a
**change** against the unit's own steps outside it: its median excess there rose by
``NOISE_FACTOR`` times the noise. An episode with fewer than ``MIN_HOT`` steps outside
(about the whole run) needs the straggler's :data:`~lorascope.detect.pace.MIN_RATIO`
instead. An episode with a baseline has no ratio to meet: the others' work holds their
waiting outside the synchronous collectives (ZeRO-3's prefetching all-gathers, cores
shared with the slow rank), so a rank +300 ms in its forward read 1.4x the others.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from lorascope.detect import shifts
from lorascope.detect.pace import MIN_RATIO, NOISE_FACTOR, PaceTable, others_medians

MIN_HOT = 5
MAX_GAP = 2
MIN_HOT_SHARE = 0.75


@dataclass
class Episode:
    ranks: list[int]
    first: int  # step indexes, inclusive
    last: int
    hot: int
    #: The step-to-step noise of the unit's excess over the others (seconds).
    noise: float
    #: Whether it is a change against the unit's own steps outside it (else about the
    #: whole run, held to :data:`MIN_RATIO`).
    baseline: bool

    def outside(self, steps: int) -> list[int]:
        """The step indexes outside the episode, of ``steps``."""
        return [i for i in range(steps) if i < self.first or i > self.last]


@dataclass
class Unit:
    """A rank or a host's ranks, tested as one: per step its excess (the most work of its
    ranks less the median of the others' work), the step-to-step noise of that series,
    and which steps are hot."""

    ranks: list[int]
    excess: list[float]
    noise: float
    hot: list[bool]


def unit_of(t: PaceTable, ranks: list[int], others: list[float]) -> Unit:
    """``others``: per step, the median of the work of the ranks outside ``ranks``."""
    members = set(ranks)
    excess = [max(t.work[r][i] for r in ranks) - o for i, o in enumerate(others)]
    noise = shifts.step_noise(excess)
    hot = [e >= NOISE_FACTOR * noise and t.setter(i) in members for i, e in enumerate(excess)]
    return Unit(ranks, excess, noise, hot)


def rank_units(t: PaceTable) -> list[Unit]:
    steps = list(range(len(t.steps)))
    others = others_medians({r: dict(enumerate(t.work[r])) for r in t.ranks}, t.ranks, steps)
    return [unit_of(t, [r], others[r]) for r in t.ranks]


def group_unit(t: PaceTable, ranks: list[int]) -> Unit:
    members = set(ranks)
    rest = [r for r in t.ranks if r not in members]
    return unit_of(t, ranks, [statistics.median(t.work[r][i] for r in rest) for i in range(len(t.steps))])


def episodes(t: PaceTable, u: Unit) -> list[Episode]:
    """The unit's episodes of hot steps that are a change: against its own excess outside
    the episode (at least :data:`MIN_HOT` steps there) by :data:`NOISE_FACTOR` times its
    noise; an episode with no such baseline (about the whole run) needs the straggler's
    :data:`MIN_RATIO` (its persistence is that rule's business)."""
    found = []
    for a, b in shifts.episodes(u.hot, MIN_HOT, MAX_GAP, MIN_HOT_SHARE):
        inside = u.excess[a : b + 1]
        outside = u.excess[:a] + u.excess[b + 1 :]
        if len(outside) >= MIN_HOT:
            change = statistics.median(inside) - statistics.median(outside)
            if change < NOISE_FACTOR * u.noise:
                continue
        elif statistics.median(ratios(t, u.ranks, range(a, b + 1))) < MIN_RATIO:
            continue
        found.append(Episode(u.ranks, a, b, sum(u.hot[a : b + 1]), u.noise, len(outside) >= MIN_HOT))
    return found


def ratios(t: PaceTable, ranks: list[int], idx: range) -> list[float]:
    return [max(t.work[r][i] for r in ranks) / max(t.others_median(ranks, t.work, i), 1e-9) for i in idx]
