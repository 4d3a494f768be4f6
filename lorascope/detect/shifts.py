"""Since when: episodes of hot steps and change points in a per-step series.

Pure functions of lists (linear, or linear times a bounded grid), shared by
``slow-steps`` (a rank's episodes) and ``job-slowdown`` (the whole job's change point).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

#: Candidate split points of :func:`change_point` at most (a grid over the series).
GRID = 64


def episodes(hot: list[bool], min_hot: int, max_gap: int, min_share: float) -> list[tuple[int, int]]:
    """Index ranges ``(first, last)`` (inclusive) of runs of hot steps: hot steps at most
    ``max_gap`` cold ones apart are one run; a run is kept with at least ``min_hot`` hot
    steps making at least ``min_share`` of it. A kept run starts on a hot step followed
    by a hot one and ends on one preceded by a hot one (while it keeps ``min_hot`` hot
    steps): a lone step slow by chance just before (after) a stretch of slow steps, a
    cold gap between them, is not its start (end)."""
    runs: list[tuple[int, int, int]] = []  # first, last, hot count
    for i, h in enumerate(hot):
        if not h:
            continue
        if runs and i - runs[-1][1] - 1 <= max_gap:
            first, _, n = runs[-1]
            runs[-1] = (first, i, n + 1)
        else:
            runs.append((i, i, 1))
    kept = []
    for a, b, n in runs:
        if n < min_hot or n / (b - a + 1) < min_share:
            continue
        first, last, m = a, b, n
        while first < last and not hot[first + 1]:
            first = next(i for i in range(first + 1, last + 1) if hot[i])
            m -= 1
        while first < last and not hot[last - 1]:
            last = next(i for i in range(last - 1, first - 1, -1) if hot[i])
            m -= 1
        kept.append((first, last) if m >= min_hot else (a, b))
    return kept


def mad(values: list[float]) -> float:
    """The median absolute deviation."""
    m = statistics.median(values)
    return statistics.median(abs(v - m) for v in values)


def step_noise(values: list[float]) -> float:
    """The step-to-step noise of a series: the MAD of its successive differences over
    sqrt(2) (the MAD itself for a series without a trend). A change of level moves one
    difference, not half the series, so a rank slow from step 20 of 40 on keeps the
    noise of its steady stretches (the series' own MAD would be half the change); 0.0
    under 3 values."""
    if len(values) < 3:
        return 0.0
    return mad([b - a for a, b in zip(values, values[1:], strict=False)]) / math.sqrt(2)


@dataclass(frozen=True)
class Change:
    """A step index from which the series' median moved: before and after it."""

    at: int
    before: float
    after: float
    #: The median absolute deviation of the part before, the noise the move stands above.
    noise: float

    @property
    def ratio(self) -> float:
        return self.after / self.before if self.before > 0 else float("inf")


def change_point(values: list[float], min_len: int) -> Change | None:
    """The split (on a grid of at most :data:`GRID` candidates, each side at least
    ``min_len`` long) where the median after rises most over the median before; None
    when the series is too short or nothing rises."""
    n = len(values)
    if n < 2 * min_len:
        return None
    span = n - 2 * min_len
    step = max(1, -(-span // GRID))
    best: Change | None = None
    for k in range(min_len, n - min_len + 1, step):
        before, after = statistics.median(values[:k]), statistics.median(values[k:])
        if after > before and (best is None or after - before > best.after - best.before):
            best = Change(k, before, after, 0.0)
    if best is None:
        return None
    # the grid's best, refined to the exact index within a grid step either side
    for k in range(max(min_len, best.at - step + 1), min(n - min_len, best.at + step - 1) + 1):
        before, after = statistics.median(values[:k]), statistics.median(values[k:])
        if after - before > best.after - best.before:
            best = Change(k, before, after, 0.0)
    return Change(best.at, best.before, best.after, mad(values[: best.at]))
