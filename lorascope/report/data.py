"""``build_report_data(bundle, findings)``: everything the page shows, as plain data.

The result has two parts: what the template renders as HTML (verdict, findings, facts,
tables) and ``charts``, which is embedded in the page as JSON for the chart code. It is
deterministic (no clock, no random, sorted where order is not meaningful) and scrubbed
of secrets. Tests check the data; :func:`lorascope.report.render.render` only lays it out.
"""

from __future__ import annotations

import statistics
from typing import Any

from lorascope import __version__
from lorascope.analysis.summary import build_summary
from lorascope.detect import kernel_attribution
from lorascope.detect.finding import Finding
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.report import collectives, kernels, memory, pace, spread, steps
from lorascope.report.facts import run_facts, utc
from lorascope.report.findings import finding_data
from lorascope.report.memory import end_mark
from lorascope.report.scrub import scrub
from lorascope.report.spread import PerStep
from lorascope.report.timebase import run_origin
from lorascope.rundir.loading.ending import (
    RUNNING,
    ended_badly_headline,
    ending_of,
    no_steps_headline,
    stopped_while_moving,
    unrecorded_ending,
)
from lorascope.rundir.loading.reader import RunData, no_cycle_collection


def _missing(bundle: EvidenceBundle) -> list[str]:
    """What the report could not see: reading warnings, ranks that left no end record,
    probes that switched themselves off."""
    lines = list(bundle.warnings)
    run = bundle.run
    if run is not None:
        for rank in run.ranks.values():
            if not ending_of(rank).known:
                why = unrecorded_ending(run).removeprefix("no end record: ")
                lines.append(
                    f"rank {rank.rank}: the stream ends without an end record ({why}); its last record is shown"
                )
            lines.extend(f"rank {rank.rank}: probe {e['probe']} switched off: {e['error']}" for e in rank.probe_errors)
    return lines


def _kernel_section(bundle: EvidenceBundle, findings: list[Finding]) -> dict[str, Any]:
    table = kernels.find_table(findings)
    if table is None and bundle.traces:
        table = kernel_attribution.table_from_traces(bundle.traces, kernel_attribution.tiny_threshold_us(bundle.traces))
    if table is not None:
        return kernels.section(table, "")
    files = [f for r in (bundle.run.ranks.values() if bundle.run else []) for f in r.trace_files]
    if files:
        return kernels.section(
            None, f"the run holds {len(files)} kernel trace file(s), but none was loaded for this report"
        )
    return kernels.section(None, "no kernel trace in this run")


def _verdict(findings: list[dict[str, Any]], facts: dict[str, Any] | None) -> dict[str, Any]:
    if findings:
        top = findings[0]
        others = [f["id"] for f in findings[1:]]
        return {
            "level": top["severity"],
            "headline": top["title"],
            "id": top["id"],
            "ranks": top["ranks"],
            "confidence": top["confidence"],
            "also": others,
        }
    if facts is None:
        return {
            "level": "unknown",
            "headline": "no run directory: only the loaded artifacts are shown",
            "ranks": [],
            "also": [],
        }
    if facts.get("running"):
        return {"level": "ok", "ranks": [], "also": [], "headline": RUNNING}
    bad = [r for r in facts["ranks"] if r["bad"]]
    if bad:
        hows = [
            (
                r["rank"],
                r["ended"].get("t"),
                str(r["ended"]["detail"] or r["end_label"] or "?").splitlines()[0][:200],
                r["ended"].get("stopped"),
            )
            for r in bad
        ]
        return {
            "level": "ok" if stopped_while_moving(hows) else "warning",
            "ranks": [r["rank"] for r in bad],
            "also": [],
            "headline": ended_badly_headline(hows),
        }
    if not any(r["steps"] for r in facts["ranks"]):
        return {"level": "unknown", "ranks": [], "also": [], "headline": no_steps_headline(len(facts["ranks"]))}
    return {
        "level": "ok",
        "ranks": [],
        "also": [],
        "headline": f"no problem found: all {len(facts['ranks'])} ranks exited 0",
    }


def _figures(
    run: RunData, peak: dict[str, Any], step_stats: list[dict[str, Any]], facts: dict[str, Any]
) -> list[dict[str, str]]:
    figures = [
        {"label": "world size", "value": str(facts["world_size"])},
        {"label": "steps", "value": str(max((s["steps"] for s in step_stats), default=0))},
    ]
    if facts["duration_s"] is not None:
        figures.append({"label": "duration", "value": f"{facts['duration_s']:.1f} s"})
    medians = [s["median"] for s in step_stats if s["median"] is not None]
    if medians:
        figures.append({"label": "median step", "value": f"{statistics.median(medians) * 1000:.0f} ms"})
    by_rank = dict(zip(peak["ranks"], peak["peak"], strict=True))
    if by_rank.get(0) is not None:
        text = f"{by_rank[0]:,.0f} MiB"
        if peak["median_others"]:
            text += f" vs {peak['median_others']:,.0f} MiB (median of others)"
        rss = dict(zip(peak["ranks"], peak["rss"] or [], strict=False)).get(0)
        if rss is not None:
            text += f"; peak RSS {rss:,.0f} MiB"
        figures.append({"label": f"rank 0 {peak['metric']}", "value": text})
    return figures


def _named(found: list[dict[str, Any]]) -> dict[str, list[int]]:
    """By chart id, the ranks the findings that link there name (drawn as their own lines)."""
    named: dict[str, list[int]] = {}
    for f in found:
        if f["chart"]:
            named.setdefault(f["chart"], []).extend(r for r in f["ranks"] if isinstance(r, int))
    return named


def build_report_data(
    bundle: EvidenceBundle,
    findings: list[Finding],
    summary: dict[str, Any] | None = None,
    per_step: PerStep | None = None,
) -> dict[str, Any]:
    """The report as plain data (see the module docstring). ``summary``: the run's
    :func:`build_summary`, when the caller has it already; ``per_step``: the per-step series
    the step, loss, collective-wait and memory charts draw, when the caller has them
    already (e.g. from compact per-rank summaries), else read from the run. Built with the
    cyclic garbage collector off (:func:`~lorascope.rundir.loading.reader.no_cycle_collection`:
    1,024 ranks x 300 steps, 5.0 -> 2.9 s)."""
    with no_cycle_collection():
        return _report_data(bundle, findings, summary, per_step)


def _report_data(
    bundle: EvidenceBundle, findings: list[Finding], summary: dict[str, Any] | None, per_step: PerStep | None
) -> dict[str, Any]:
    run = bundle.run
    found = [finding_data(f) for f in findings]
    data: dict[str, Any] = {
        "title": f"lorascope report: {bundle.path}",
        "path": str(bundle.path),
        "lorascope_version": __version__,
        "findings": found,
        "missing": _missing(bundle),
        "facts": None,
        "figures": [],
        "collective_table": None,
        "charts": {"origin_utc": None, "kernels": _kernel_section(bundle, findings)},
    }
    if run is not None:
        summary = summary if summary is not None else build_summary(run)
        ends = {r["rank"]: end_mark(r["ended"], run.ranks[r["rank"]]) for r in summary["ranks"]}
        origin = run_origin(run)
        facts = run_facts(run, summary, ends)
        peak = memory.peaks(run, summary["ranks"], findings)
        per_rank = spread.charts(per_step if per_step is not None else steps.per_step(run), _named(found))
        step_data = steps.step_series(run, per_rank["lines"])
        sites = {site: ctx for rank in run.ranks.values() for site, ctx in rank.sites.items()}
        align = collectives.alignment(run, findings, sites)
        data["facts"] = facts
        data["figures"] = _figures(run, peak, step_data["stats"], facts)
        data["collective_table"] = {k: align.pop(k) for k in ("table", "table_seqs")} if align["available"] else None
        data["charts"].update(
            {
                "origin_utc": utc(origin),
                "memory": memory.timeline(run, origin, ends, per_rank["lines"]),
                "spread": per_rank,
                "peak": peak,
                "collectives": align,
                "op_times": collectives.op_times(run),
                "steps": step_data,
                "pace": pace.chart(run, findings),
            }
        )
    data["verdict"] = _verdict(found, data["facts"])
    scrubbed: dict[str, Any] = scrub(data)
    return scrubbed
