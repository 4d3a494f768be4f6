"""Chart data for many ranks: per step range, the spread over ranks (percentile bands), the
ranks that stand apart from it (outliers, named), and a rank-by-step heatmap.

Everything here is a pure function of per-rank, per-step series (:data:`Series`: per rank,
its ``(step, value)`` points in ascending step order), so the same charts come from the
records of a run directory (:func:`lorascope.report.steps.per_step`) or from any
compact per-rank summary that holds the same series.

Size does not grow with steps: the steps are cut into at most ``max_columns`` equal step
ranges (:class:`Columns`) and each rank is reduced, in one pass over its points, to per
column its point count, sum, lowest and highest value (:class:`RankColumns`). Everything the
page shows is computed from those reductions: O(ranks x columns), whatever the run's length.

What each figure means, per column (a step range; one step when the run is short):

- ``min`` / ``max``: the lowest / highest single value any rank had in the range (a
  one-step spike of one rank survives any amount of bucketing), with the rank that had it;
- ``p10`` / ``median`` / ``p90``: percentiles over ranks of each rank's value in the range
  (its mean for time-like series, ``how="mean"``; its highest for memory, ``how="max"``).
  With one step per column these are the exact percentiles over ranks at that step.

**Outlier rule** (:func:`outliers`): each rank gets one typical value, the median of its
column values (``how="mean"``: a rank that is slow for most of the run) or its highest
(``how="max"``: a rank whose peak stands out). Against the ranks' median *m* and median
absolute deviation *MAD*, a rank's robust z-score is ``0.6745 * (x - m) / MAD`` (Iglewicz
and Hoaglin); a rank is an outlier when ``|z| >= 3.5``. So that ranks that all read the
same (MAD 0) do not make a rank 0.1% away an outlier, the MAD is floored at 1% of ``|m|``.
At most :data:`MAX_OUTLIERS` are drawn, the furthest first; ranks a finding names are drawn
too (``also``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

#: Per rank, its (step, value) points in ascending step order.
Series = Mapping[int, Sequence[tuple[int, float]]]
How = Literal["mean", "max"]

#: Above this many ranks the charts draw bands and outliers; at or below it, one line per
#: rank (a handful of lines each stays readable, and a band over two ranks is just them).
LINES_UP_TO = 16
#: Columns of a band chart and of a heatmap; heatmap rows (ranks merged above that). A
#: heatmap cell costs the browser ~10-20 µs to draw: 128 x 64 cells keep one near 0.1 s.
MAX_COLUMNS = 400
HEAT_COLUMNS = 64
HEAT_ROWS = 128
#: A heatmap's colour is a cell's deviation from the median cell: within +-HEAT_NEUTRAL of it
#: a neutral grey (a healthy run's ~10% spread of memory or step time, which a min-to-max
#: scale painted alarming red), then blue below and red above, full at +-HEAT_FULL.
HEAT_NEUTRAL = 0.10
HEAT_FULL = 0.50
#: Outlier threshold (robust z-score), most outliers drawn, the MAD's floor relative to the median.
Z_OUTLIER = 3.5
MAX_OUTLIERS = 5
MAD_FLOOR = 0.01
#: Ranks drawn as their own line at most (outliers plus ranks the findings name).
MAX_DRAWN = 8


@dataclass
class PerStep:
    """The per-step series the charts are built from: step time (s), loss, the time spent
    in collectives (s) and memory (MiB, per figure, the one the verdict used first)."""

    step_time: Series
    loss: Series
    wait: Series
    memory: dict[str, Series]


@dataclass(frozen=True)
class Columns:
    """Steps ``first`` .. ``last`` cut into ``count`` ranges of ``width`` steps."""

    first: int
    last: int
    width: int

    @property
    def count(self) -> int:
        return (self.last - self.first) // self.width + 1

    def span(self, c: int) -> tuple[int, int]:
        lo = self.first + c * self.width
        return lo, min(self.last, lo + self.width - 1)

    def coarser(self, max_columns: int) -> Columns:
        """The same steps in at most ``max_columns`` ranges, each a whole number of these."""
        factor = -(-self.count // max_columns)
        return Columns(self.first, self.last, self.width * factor)


def columns(series: Series, max_columns: int = MAX_COLUMNS) -> Columns | None:
    """The step ranges for ``series`` (None when it holds no point)."""
    ends = [(s[0][0], s[-1][0]) for s in series.values() if s]
    if not ends:
        return None
    first, last = min(e[0] for e in ends), max(e[1] for e in ends)
    return Columns(first, last, max(1, -(-(last - first + 1) // max_columns)))


@dataclass
class RankColumns:
    """One rank's points reduced to the columns: per column how many, their sum, lowest
    and highest (``n == 0``: no point there; the others are then 0)."""

    n: list[int]
    total: list[float]
    low: list[float]
    high: list[float]

    def value(self, c: int, how: How) -> float | None:
        if not self.n[c]:
            return None
        return self.total[c] / self.n[c] if how == "mean" else self.high[c]

    def values(self, how: How) -> list[float | None]:
        return [self.value(c, how) for c in range(len(self.n))]

    def merged_values(self, factor: int, how: How) -> list[float | None]:
        """:meth:`values` in columns ``factor`` times wider (see :meth:`Columns.coarser`)."""
        out: list[float | None] = []
        for c in range(0, len(self.n), factor):
            counts = self.n[c : c + factor]
            count = sum(counts)
            if not count:
                out.append(None)
            elif how == "mean":
                out.append(sum(self.total[c : c + factor]) / count)
            else:
                out.append(max(h for h, m in zip(self.high[c : c + factor], counts, strict=True) if m))
        return out


def reduce_rank(points: Iterable[tuple[int, float]], cols: Columns) -> RankColumns:
    """One pass over one rank's points (non-finite values are skipped)."""
    k = cols.count
    n, total, low, high = [0] * k, [0.0] * k, [math.inf] * k, [-math.inf] * k
    first, width, isfinite = cols.first, cols.width, math.isfinite
    for step, value in points:
        c = (step - first) // width
        if 0 <= c < k and isfinite(value):
            n[c] += 1
            total[c] += value
            if value < low[c]:
                low[c] = value
            if value > high[c]:
                high[c] = value
    empty = [not m for m in n]
    if any(empty):
        low = [0.0 if e else v for v, e in zip(low, empty, strict=True)]
        high = [0.0 if e else v for v, e in zip(high, empty, strict=True)]
    return RankColumns(n, total, low, high)


def reduce_all(series: Series, cols: Columns) -> dict[int, RankColumns]:
    return {rank: reduce_rank(points, cols) for rank, points in sorted(series.items())}


def _quantile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default) on sorted values."""
    pos = q * (len(ordered) - 1)
    i = int(pos)
    if i + 1 >= len(ordered):
        return ordered[-1]
    return ordered[i] + (ordered[i + 1] - ordered[i]) * (pos - i)


def bands(reduced: Mapping[int, RankColumns], cols: Columns, how: How, digits: int) -> dict[str, Any]:
    """Per column (only those where some rank has a point): ``step`` (its first step),
    ``to`` (its last), ``ranks`` (how many ranks have a point), ``min`` / ``min_rank``,
    ``p10``, ``median``, ``p90``, ``max`` / ``max_rank`` (see the module docstring)."""
    out: dict[str, list[Any]] = {
        k: [] for k in ("step", "to", "ranks", "min", "min_rank", "p10", "median", "p90", "max", "max_rank")
    }
    for c in range(cols.count):
        vals: list[float] = []
        lo = hi = None
        lo_rank = hi_rank = -1
        for rank, rc in reduced.items():
            if not rc.n[c]:
                continue
            vals.append(rc.total[c] / rc.n[c] if how == "mean" else rc.high[c])
            if lo is None or rc.low[c] < lo:
                lo, lo_rank = rc.low[c], rank
            if hi is None or rc.high[c] > hi:
                hi, hi_rank = rc.high[c], rank
        if not vals or lo is None or hi is None:
            continue
        vals.sort()
        first, last = cols.span(c)
        for key, v in (
            ("step", first),
            ("to", last),
            ("ranks", len(vals)),
            ("min", round(lo, digits)),
            ("min_rank", lo_rank),
            ("p10", round(_quantile(vals, 0.1), digits)),
            ("median", round(_quantile(vals, 0.5), digits)),
            ("p90", round(_quantile(vals, 0.9), digits)),
            ("max", round(hi, digits)),
            ("max_rank", hi_rank),
        ):
            out[key].append(v)
    return out


def typical(rc: RankColumns, how: How) -> float | None:
    """A rank's one figure for the outlier rule: the median of its column means, or its highest."""
    values = [v for v in rc.values(how) if v is not None]
    if not values:
        return None
    return statistics.median(values) if how == "mean" else max(values)


def outliers(figures: Mapping[int, float], max_outliers: int = MAX_OUTLIERS) -> list[dict[str, Any]]:
    """The ranks whose figure stands apart (robust z-score, see the module docstring), the
    furthest first (ties: lowest rank): ``rank``, ``typical`` (its figure), ``z``, ``median``
    (of all ranks' figures)."""
    if len(figures) < 3:  # no "typical rank" among two
        return []
    median = statistics.median(figures.values())
    mad = statistics.median(abs(v - median) for v in figures.values())
    scale = max(mad, MAD_FLOOR * abs(median))
    if scale <= 0:
        return []
    scored = [(0.6745 * (v - median) / scale, rank, v) for rank, v in figures.items()]
    picked = sorted((s for s in scored if abs(s[0]) >= Z_OUTLIER), key=lambda s: (-abs(s[0]), s[1]))
    return [{"rank": r, "typical": v, "z": round(z, 1), "median": median} for z, r, v in picked[:max_outliers]]


def rank_line(rc: RankColumns, cols: Columns, how: How, digits: int) -> dict[str, list[Any]]:
    """One rank's column values as a line: ``step`` (each column's first step) and ``value``."""
    steps, values = [], []
    for c, v in enumerate(rc.values(how)):
        if v is not None:
            steps.append(cols.span(c)[0])
            values.append(round(v, digits))
    return {"step": steps, "value": values}


def heatmap(
    reduced: Mapping[int, RankColumns],
    cols: Columns,
    how: How,
    digits: int,
    max_columns: int = HEAT_COLUMNS,
    max_rows: int = HEAT_ROWS,
) -> dict[str, Any]:
    """Ranks (rows) by step ranges (columns): at most ``max_rows`` x ``max_columns`` cells.
    A cell is the rank's value in the range (``how``); when there are more ranks than rows,
    consecutive ranks share a row and the cell is the highest of theirs (the worst rank shows:
    ``who`` names it). ``values`` is row-major, None where no rank of the row has a point.

    The colour scale: ``median`` (of the cells), ``neutral`` and ``full`` (shares of it:
    :data:`HEAT_NEUTRAL`, :data:`HEAT_FULL`), ``min`` / ``max`` where the colours are full
    (median x (1 -+ full))."""
    coarse = cols.coarser(max_columns)
    factor = coarse.width // cols.width
    ranks = sorted(reduced)
    per_row = max(1, -(-len(ranks) // max_rows))
    rows: list[list[int]] = []
    values: list[float | None] = []
    who: list[int | None] = []
    for start in range(0, len(ranks), per_row):
        group = ranks[start : start + per_row]
        rows.append([group[0], group[-1]])
        lines = [(r, reduced[r].merged_values(factor, how)) for r in group]
        for c in range(coarse.count):
            best: tuple[float, int] | None = None
            for r, vals in lines:
                v = vals[c]
                if v is not None and (best is None or v > best[0]):
                    best = (v, r)
            values.append(None if best is None else round(best[0], digits))
            who.append(None if best is None else best[1])
    finite = [v for v in values if v is not None]
    median = statistics.median(finite) if finite else None
    return {
        "rows": rows,
        "columns": [list(coarse.span(c)) for c in range(coarse.count)],
        "values": values,
        "who": who if per_row > 1 else None,
        "median": None if median is None else round(median, digits),
        "neutral": HEAT_NEUTRAL,
        "full": HEAT_FULL,
        "min": None if median is None else round(median * (1 - HEAT_FULL), digits),
        "max": None if median is None else round(median * (1 + HEAT_FULL), digits),
    }


def spread(
    series: Series, how: How, digits: int, also: Sequence[int] = (), rank_lines: bool = False
) -> dict[str, Any] | None:
    """Everything one per-step chart draws from ``series`` (None when it has no point):

    - ``lines``: true at or below :data:`LINES_UP_TO` ranks, where the page draws one line
      per rank instead of the bands (``ranks``: every rank's line, with ``rank_lines``);
    - ``bands`` (:func:`bands`), ``outliers`` (:func:`outliers`, each with its line) and
      ``named``: ranks in ``also`` (a finding names them) drawn as lines too, at most
      :data:`MAX_DRAWN` lines in all;
    - ``heatmap`` (:func:`heatmap`) and ``ranks_total``.
    """
    cols = columns(series)
    if cols is None:
        return None
    reduced = reduce_all(series, cols)
    lines = len(reduced) <= LINES_UP_TO
    figures = {r: v for r, rc in reduced.items() if (v := typical(rc, how)) is not None}
    found = outliers(figures)
    drawn = [o["rank"] for o in found]
    named = [r for r in dict.fromkeys(also) if r in reduced and r not in drawn][: max(0, MAX_DRAWN - len(drawn))]
    for o in found:
        o.update(rank_line(reduced[o["rank"]], cols, how, digits))
        o["typical"], o["median"] = round(o["typical"], digits), round(o["median"], digits)
    return {
        "how": how,
        "lines": lines,
        "ranks_total": len(reduced),
        "columns": cols.count,
        "width": cols.width,
        "bands": bands(reduced, cols, how, digits),
        "outliers": found,
        "named": [{"rank": r, **rank_line(reduced[r], cols, how, digits)} for r in named],
        "ranks": [{"rank": r, **rank_line(rc, cols, how, digits)} for r, rc in reduced.items()]
        if lines and rank_lines
        else None,
        "heatmap": heatmap(reduced, cols, how, digits),
    }


def _without_heatmap(chart: dict[str, Any] | None) -> dict[str, Any] | None:
    if chart is not None:
        chart["heatmap"] = None
    return chart


def charts(per: PerStep, named: Mapping[str, Sequence[int]]) -> dict[str, Any]:
    """The per-step charts of a run: step time, loss, collective wait and memory (per
    figure, the first of ``per.memory`` with its heatmap); ``named``: by chart id, the ranks
    the findings that link there name (drawn as lines beside the outliers)."""
    step_time = spread(per.step_time, "mean", 4, named.get("chart-step-time", ()))
    ranks = step_time["ranks_total"] if step_time else max((len(s) for s in per.memory.values()), default=0)
    lines = ranks <= LINES_UP_TO
    memory: dict[str, Any] = {}
    for n, (metric, series) in enumerate(per.memory.items()):
        if n == 0 or not lines:  # the other figures only feed the band chart's switch
            chart = spread(series, "max", 1, named.get("chart-memory", ()))
            memory[metric] = chart if n == 0 else _without_heatmap(chart)
    return {
        "lines": lines,
        "lines_up_to": LINES_UP_TO,
        "step_time": step_time,
        "loss": None if lines else _without_heatmap(spread(per.loss, "mean", 5, named.get("chart-loss", ()))),
        "wait": _without_heatmap(spread(per.wait, "mean", 4, named.get("chart-collective-wait", ()), rank_lines=True)),
        "memory": memory,
    }
