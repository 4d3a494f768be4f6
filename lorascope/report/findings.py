"""Findings as report data: each with the chart that shows its evidence.

``details`` is free-form; the page renders it generically (tables for lists of records,
key/value lists for mappings), so this module only makes it plain, bounded data.
"""

from __future__ import annotations

import math
from typing import Any

from lorascope.detect.finding import Finding

#: The chart that shows each failure mode's evidence (anchors in the page). A detector
#: may name another with ``details["chart"]``.
CHART_FOR: dict[str, str] = {
    "rank0-asymmetry": "chart-memory",
    "logits-spike": "chart-peak",
    "reentrant-dead-grads": "chart-loss",
    "rank-conditional-hang": "chart-collectives",
    "tiny-kernel-tail": "chart-kernels",
    "hung-ranks": "chart-collectives",
    "plan-deviation": "chart-memory",
    "straggler": "chart-step-time",
    "slow-steps": "chart-pace",
    "job-slowdown": "chart-step-time",
}
CHART_TITLES: dict[str, str] = {
    "chart-memory": "memory over time",
    "chart-peak": "peak memory per rank",
    "chart-collectives": "collectives across ranks",
    "chart-collective-ops": "time per collective op",
    "chart-kernels": "kernel durations",
    "chart-step-time": "step time per rank",
    "chart-loss": "loss per step",
    "chart-memory-heatmap": "memory by rank and step",
    "chart-step-heatmap": "step time by rank and step",
    "chart-collective-wait": "time in collectives per step",
    "chart-pace": "who set each step's pace",
}
#: Keys of ``details`` the charts consume (rendered there, not repeated as text).
CHART_KEYS = frozenset({"kernels", "memory_breakdown", "chart"})
MAX_ITEMS = 50
MAX_TEXT = 4000
MAX_DEPTH = 6


def plain(value: Any, depth: int = 0) -> Any:
    """JSON-friendly, bounded, deterministic: long lists and texts are cut (and say so)."""
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, str):
        return value if len(value) <= MAX_TEXT else value[:MAX_TEXT] + f"… ({len(value) - MAX_TEXT} more characters)"
    if depth >= MAX_DEPTH:
        return "…"
    if isinstance(value, dict):
        items = list(value.items())
        out = {str(k): plain(v, depth + 1) for k, v in items[:MAX_ITEMS]}
        if len(items) > MAX_ITEMS:
            out["…"] = f"{len(items) - MAX_ITEMS} more"
        return out
    if isinstance(value, (list, tuple, set, frozenset)):
        seq = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else list(value)
        out_list = [plain(v, depth + 1) for v in seq[:MAX_ITEMS]]
        if len(seq) > MAX_ITEMS:
            out_list.append(f"… {len(seq) - MAX_ITEMS} more")
        return out_list
    return str(value)


def finding_data(finding: Finding) -> dict[str, Any]:
    chart = finding.details.get("chart") if isinstance(finding.details.get("chart"), str) else None
    chart = chart if chart in CHART_TITLES else CHART_FOR.get(finding.id)
    return {
        "id": finding.id,
        "title": finding.title,
        "severity": finding.severity,
        "confidence": finding.confidence,
        "confidence_reason": finding.confidence_reason,
        "ranks": list(finding.ranks),
        "evidence": [{"label": e.label, "value": plain(e.value), "source": e.source} for e in finding.evidence],
        "explanation": finding.explanation,
        "fix": finding.fix,
        "chart": chart,
        "chart_title": CHART_TITLES.get(chart or ""),
        "details": plain({k: v for k, v in finding.details.items() if k not in CHART_KEYS}),
    }
