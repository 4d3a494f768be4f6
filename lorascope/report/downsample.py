"""Thinning long timelines for the page while keeping what an engineer looks for.

A 10,000-step run has far more points than a chart has pixels. Averaging would hide the
spike that explains an OOM, so each bucket keeps its minimum and its maximum (in time
order), and the first and last points of the series are always kept: the end of a rank
and its peak survive any amount of thinning.
"""
from __future__ import annotations

from collections.abc import Sequence

Point = tuple[float, float]


def minmax_downsample(points: Sequence[Point], max_points: int) -> list[Point]:
    """At most ``max_points`` points (x ascending; y None-free): per equal-width x bucket,
    the min and the max point, plus the first and the last point."""
    n = len(points)
    if n <= max_points or n <= 2:
        return list(points)
    buckets = max(1, (max_points - 2) // 2)
    x0, x1 = points[0][0], points[-1][0]
    width = (x1 - x0) / buckets or 1.0
    keep: set[int] = {0, n - 1}
    lo_i: list[int | None] = [None] * buckets
    hi_i: list[int | None] = [None] * buckets
    for i in range(1, n - 1):
        b = min(buckets - 1, int((points[i][0] - x0) / width))
        y = points[i][1]
        lo, hi = lo_i[b], hi_i[b]
        if lo is None or y < points[lo][1]:
            lo_i[b] = i
        if hi is None or y > points[hi][1]:
            hi_i[b] = i
    keep.update(i for i in lo_i if i is not None)
    keep.update(i for i in hi_i if i is not None)
    return [points[i] for i in sorted(keep)]
