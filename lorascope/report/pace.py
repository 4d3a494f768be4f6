"""Chart data for who set each step's pace: the pace-setter strip over the step axis
(:func:`lorascope.detect.pace.strip`), what evening out the named rank or group would
save (the what-if of the ``slow-steps`` and ``straggler`` findings), and where each
change begins, marked on the step-time heatmap (rank, first step)."""

from __future__ import annotations

from typing import Any

from lorascope.detect import pace
from lorascope.detect.finding import Finding
from lorascope.rundir.loading.reader import RunData

#: The findings whose what-if and first step the page shows.
SHOWN = ("slow-steps", "straggler")


def chart(run: RunData, findings: list[Finding]) -> dict[str, Any] | None:
    """None without a pace table (one rank, no step every rank completed)."""
    data = pace.summary(run)
    if data is None:
        return None
    marks = []
    for f in findings:
        w = f.details.get("what_if")
        if f.id not in SHOWN or not isinstance(w, dict):
            continue
        first = f.details.get("first_step", data["steps"][0])
        marks.append(
            {
                "id": f.id,
                "ranks": list(f.ranks),
                "label": f.details.get("label") or ", ".join(f"rank {r}" for r in f.ranks),
                "first_step": first,
                "last_step": f.details.get("last_step", data["steps"][1]),
                "part": f.details.get("part"),
                "saving": pace.saving_text(w),
            }
        )
    data["marks"] = marks
    return data
