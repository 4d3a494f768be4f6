"""Thinning long timelines for the page while keeping what an engineer looks for.

A 10,000-step run has far more points than a chart has pixels. Averaging would hide the
spike that explains an OOM, so each bucket keeps its minimum and its maximum (in x order),
and the first and last points of the series are always kept: the end of a rank and its
peak survive any amount of thinning.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence


def thin(xs: Sequence[float], ys: Sequence[float], max_points: int) -> tuple[list[float], list[float]]:
    """At most ``max_points`` of the points (``xs`` ascending, no None in ``ys``): per
    equal-width x bucket the min and the max point, plus the first and the last point."""
    n = len(xs)
    if n <= max_points or n <= 2:
        return list(xs), list(ys)
    buckets = max(1, (max_points - 2) // 2)
    width = (xs[-1] - xs[0]) / buckets
    keep = {0, n - 1}
    start = 1
    for b in range(1, buckets + 1):
        if b == buckets:
            end = n - 1
        elif width > 0:
            end = bisect_left(xs, xs[0] + b * width, start, n - 1)
        else:  # every x equal: buckets of equal count instead
            end = 1 + (n - 2) * b // buckets
        if end > start:
            seg = ys[start:end]
            keep.add(start + seg.index(min(seg)))
            keep.add(start + seg.index(max(seg)))
        start = end
    picked = sorted(keep)
    return [xs[i] for i in picked], [ys[i] for i in picked]
