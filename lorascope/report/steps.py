"""Chart data for steps: step time and loss per rank, and each rank's typical step time.

A straggler shows as one rank whose median step time stands above the others'; the
per-step lines show when it started.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Literal

from lorascope.report import collectives, memory
from lorascope.report.downsample import thin
from lorascope.report.memory import per_rank_points
from lorascope.report.spread import PerStep
from lorascope.rundir.loading.reader import RankData, RunData

STEP_BUDGET = 16_000
MAX_LISTED_LOSSES = 50
_NUMBERS = (int, float)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _finite(rank: RankData, key: Literal["loss", "dur"]) -> list[tuple[int, float]]:
    """(step, value) of the rank's steps whose ``key`` is a finite number (not a bool)."""
    out: list[tuple[int, float]] = []
    for s in rank.steps:
        value = s[key]
        if type(value) in _NUMBERS and value is not None and math.isfinite(value):
            out.append((s["step"], value))
    return out


def per_step(run: RunData) -> PerStep:
    """The run's per-step series for :func:`lorascope.report.spread.charts`."""
    return PerStep(
        step_time={r.rank: sorted((s, float(v)) for s, v in _finite(r, "dur")) for r in run.ranks.values()},
        loss={r.rank: sorted((s, float(v)) for s, v in _finite(r, "loss")) for r in run.ranks.values()},
        wait=collectives.wait_per_step(run),
        memory={kind: memory.per_step(run, kind) for kind in memory.recorded_metrics(run)},
    )


def step_series(run: RunData, lines: bool = True) -> dict[str, Any]:
    """Per rank, columns ``step`` / ``s`` (seconds) and ``step`` / ``loss``, thinned (only
    with ``lines``: above :data:`~lorascope.report.spread.LINES_UP_TO` ranks the page draws
    bands instead); the median and 95th percentile step time; the steps whose loss was NaN
    or infinite."""
    keep = per_rank_points(len(run.ranks), STEP_BUDGET)
    times, losses, stats, bad_losses = [], [], [], []
    for rank in run.ranks.values():
        steps = _finite(rank, "dur")
        if lines:
            xs, ys = thin([s for s, _ in steps], [v for _, v in steps], keep)
            times.append({"rank": rank.rank, "step": xs, "s": [round(y, 4) for y in ys]})
            with_loss = _finite(rank, "loss")
            xs, ys = thin([s for s, _ in with_loss], [v for _, v in with_loss], keep)
            losses.append({"rank": rank.rank, "step": xs, "loss": [round(y, 5) for y in ys]})
        bad_losses += [
            [rank.rank, s["step"], str(s.get("loss_text") or s["loss"])]
            for s in rank.steps
            if s.get("loss_text") or (isinstance(loss := s["loss"], _NUMBERS) and not math.isfinite(loss))
        ]
        values = [v for _, v in steps if v > 0]
        stats.append(
            {
                "rank": rank.rank,
                "steps": len(rank.steps),
                "median": round(statistics.median(values), 4) if values else None,
                "p95": round(_percentile(values, 0.95), 4) if values else None,
            }
        )
    return {
        "time": times if lines else None,
        "loss": losses if any(s["step"] for s in losses) else None,
        "stats": stats,
        "non_finite_losses": bad_losses[:MAX_LISTED_LOSSES],
    }
