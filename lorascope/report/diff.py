"""``diff_page_data(diff)``: the page of `lorascope diff --html` as plain data.

The data is :func:`lorascope.analysis.diff.build_diff`'s, with what the page adds: a
title, a headline of what changed most, rows made text where the terminal makes them
text (the same formatters), and the secrets scrubbed as in the report. Laid out by
``templates/diff.html.j2`` with the report's styles (:func:`lorascope.report.render.render_diff`).
"""

from __future__ import annotations

from typing import Any

from lorascope import __version__
from lorascope.detect.finding import SEVERITY_ORDER
from lorascope.report.scrub import scrub
from lorascope.units import fmt_bytes, rank_ranges


def _headline(diff: dict[str, Any]) -> dict[str, str]:
    """The one line at the top, and its level (the report's verdict colours)."""
    found = diff["findings"]
    worse = [f for f in found["new"]] + [c["b"] for c in found["changed"] if c["worse"]]
    parts = []
    if worse:
        top = max(worse, key=lambda f: SEVERITY_ORDER[f["severity"]])
        parts.append(f"B has {len(worse)} new or worse finding(s), the most severe: {top['title']}")
        level = top["severity"]
    else:
        level = "ok"
    if found["gone"]:
        parts.append(f"{len(found['gone'])} finding(s) of A gone")
    if diff["kind"] == "run":
        config = diff["config"]
        labels = [r["label"] for r in config["headline"] if r["name"] != "command"]
        if labels:
            parts.append("configuration: " + ", ".join(labels[:4]) + (" ..." if len(labels) > 4 else "") + " differ")
        step = diff["steps"]["step"]
        if step["ratio"] is not None:
            parts.append(f"median step x{step['ratio']:.2f}")
        if diff["memory"]["median_delta"] is not None:
            sign = "+" if diff["memory"]["median_delta"] >= 0 else "-"
            parts.append(f"peak memory {sign}{fmt_bytes(abs(diff['memory']['median_delta']))} (median rank)")
    return {"level": level, "text": "; ".join(parts) or "no difference found"}


def diff_page_data(diff: dict[str, Any]) -> dict[str, Any]:
    data = {
        "title": f"lorascope diff: {diff['a']['path']} -> {diff['b']['path']}",
        "lorascope_version": __version__,
        "headline": _headline(diff),
        "diff": diff,
        "shared_ranks": rank_ranges(diff["shared"]["ranks"]) if diff.get("shared") else None,
        "memory_rows": [
            {**r, "a_text": fmt_bytes(r["a"]), "b_text": fmt_bytes(r["b"]), "delta_text": fmt_bytes(r["delta"])}
            for r in (diff["memory"]["largest"] if diff["kind"] == "run" else [])
        ],
        "plan_rows": [
            {**t, "a_text": fmt_bytes(t["a"]), "b_text": fmt_bytes(t["b"])}
            for t in (diff["plan"]["terms"] if diff["kind"] == "run" else [])
        ],
        "collective_rows": [
            {**r, "a_bytes_text": fmt_bytes(r["a_bytes"]), "b_bytes_text": fmt_bytes(r["b_bytes"])}
            for r in (diff["collectives"]["per_rank_step"] if diff["kind"] == "run" else [])
        ],
    }
    scrubbed: dict[str, Any] = scrub(data)
    return scrubbed
