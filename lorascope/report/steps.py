"""Chart data for steps: step time and loss per rank, and each rank's typical step time.

A straggler shows as one rank whose median step time stands above the others'; the
per-step lines show when it started.
"""
from __future__ import annotations

import statistics
from typing import Any

from lorascope.report.downsample import minmax_downsample
from lorascope.report.memory import per_rank_points
from lorascope.report.timebase import finite
from lorascope.rundir.reader import RunData

STEP_BUDGET = 40_000


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def step_series(run: RunData) -> dict[str, Any]:
    keep = per_rank_points(len(run.ranks), STEP_BUDGET)
    times, losses, stats, bad_losses = [], [], [], []
    for rank in run.ranks.values():
        durs = [(float(s["step"]), float(s["dur"])) for s in rank.steps if finite(s["dur"]) is not None]
        times.append({"rank": rank.rank, "points": [[int(x), round(y, 4)]
                                                     for x, y in minmax_downsample(durs, keep)]})
        loss_pts = []
        for s in rank.steps:
            value = finite(s.get("loss"))
            if value is not None:
                loss_pts.append((float(s["step"]), value))
            elif s.get("loss") is not None or s.get("loss_text"):
                bad_losses.append([rank.rank, s["step"], str(s.get("loss_text") or s.get("loss"))])
        losses.append({"rank": rank.rank, "points": [[int(x), round(y, 5)]
                                                      for x, y in minmax_downsample(loss_pts, keep)]})
        values = [d for _, d in durs if d > 0]
        stats.append({"rank": rank.rank, "steps": len(rank.steps),
                      "median": round(statistics.median(values), 4) if values else None,
                      "p95": round(_percentile(values, 0.95), 4) if values else None})
    return {"time": times, "loss": losses if any(s["points"] for s in losses) else None,
            "stats": stats, "non_finite_losses": bad_losses[:50]}
