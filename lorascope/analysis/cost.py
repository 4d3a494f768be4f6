"""What the probes cost the job, as the job itself measured it (its ``cost`` records).

The probes add up the time the job's own threads spend in probe code (the collective
wrappers, phase edges, step ends; the C heap readings among it) and write the running
totals with the CPU time of their own threads (writer, sampler, watchdog) at the first
step's end, at the end of the probes' warm-up (``WARM_UP_STEPS``, through which a CPU
rank's C heap is read at every phase edge), every ``COST_EVERY`` steps and at the end.
The difference between the first record the reader keeps (the one at the warm-up's end,
or the first when the run ended before a record past it) and the latest, over the steps
between them, is what a step cost it once warmed up; one-offs are said apart: the kernel
trace window (a few steps traced, its trace exported on the job's thread) and the first call at a new site (its source read
for rank conditions: ~50 ms for a barrier at the end of a short DDP run, which would
otherwise read as 5 ms a step). Wall time: a wait for the GIL or a preemption that lands
in probe code counts; the hooks' dispatch, and what the probes' threads take from the
job outside probe code (the GIL, a core of a full machine), do not.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from typing import Any, cast

from lorascope.rundir.loading.reader import RankData


def _number(value: Any) -> bool:
    """A thread's CPU ms as the probes write it (the record's schema checks only that
    the field is an object)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def rank_cost(rank: RankData) -> dict[str, Any] | None:
    """Per step between the rank's first ``cost`` record and its latest; None without two
    records a step or more apart."""
    if len(rank.costs) < 2:
        return None
    first, last = cast("list[Mapping[str, Any]]", rank.costs)
    steps = int(last["step"] - first["step"])
    if steps < 1:
        return None

    def per_step(key: str) -> float:
        return float(last[key] - first[key]) / steps

    before = {name: ms for name, ms in first["threads_cpu_ms"].items() if _number(ms)}
    own = math.fsum(ms - before.get(name, 0.0) for name, ms in last["threads_cpu_ms"].items() if _number(ms))
    trace_ms = last["trace_ms"] - first["trace_ms"]
    sites_ms = last["sites_ms"] - first["sites_ms"]
    job_ms = per_step("job_ms") - (trace_ms + sites_ms) / steps
    calls_ms = per_step("calls_ms") - sites_ms / steps
    if job_ms < 0 or calls_ms < 0:
        # Recorded by a lorascope of before 2026-12-03, which left a call that raised (a
        # hang's timeout) out of the calls' time but counted its new site's reading among
        # the one-offs taken from it: not a cost to show.
        return None
    step_s = rank.totals.get("step_time_median_s")
    return {
        "steps": steps,
        "job_ms_per_step": round(job_ms, 3),
        "calls_ms_per_step": round(calls_ms, 3),
        "calls_per_step": round(per_step("calls"), 2),
        "heap_ms_per_step": round(per_step("heap_ms"), 3),
        "heap_reads_per_step": round(per_step("heap_reads"), 2),
        "trace_window_ms": round(trace_ms, 1),
        "new_sites": last["sites"] - first["sites"],
        "new_sites_ms": round(sites_ms, 1),
        "threads_cpu_ms_per_step": round(own / steps, 3),
        "share_of_step": round(job_ms / (step_s * 1000), 5) if step_s else None,
    }


#: What :func:`run_cost` takes the median of over the ranks.
_MEDIANS = (
    "job_ms_per_step",
    "calls_ms_per_step",
    "calls_per_step",
    "heap_ms_per_step",
    "heap_reads_per_step",
    "trace_window_ms",
    "new_sites",
    "new_sites_ms",
    "threads_cpu_ms_per_step",
)


def run_cost(ranks: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The median over the ranks that measured it (rank summaries' ``probe_cost``), and
    the rank it cost most."""
    measured = [(r["rank"], r["probe_cost"]) for r in ranks if r.get("probe_cost")]
    if not measured:
        return None
    shared = [(rank, c["share_of_step"]) for rank, c in measured if c["share_of_step"] is not None]
    most = max(shared, key=lambda rs: rs[1]) if shared else None
    return {
        "ranks": len(measured),
        **{key: round(float(statistics.median(c[key] for _, c in measured)), 3) for key in _MEDIANS},
        "share_of_step": round(statistics.median(s for _, s in shared), 5) if shared else None,
        "most": None if most is None else {"rank": most[0], "share_of_step": most[1]},
    }


def _count(per_step: float) -> str:
    """A count a step to a tenth: ``50``, ``53.2`` (not ``53.165``)."""
    return f"{per_step:.1f}".removesuffix(".0")


def cost_text(cost: dict[str, Any]) -> str:
    """One line: what the probes cost a step, as the job measured it, and its parts."""
    share = cost["share_of_step"]
    of_step = f" ({share:.1%} of the median step)" if share is not None else ""
    rest = cost["job_ms_per_step"] - cost["calls_ms_per_step"] - cost["heap_ms_per_step"]
    most = cost["most"]
    spread = (
        f"; median of {cost['ranks']} ranks, most on rank {most['rank']} ({most['share_of_step']:.1%})"
        if most is not None and cost["ranks"] > 1
        else ""
    )
    once = [f"the kernel trace window {cost['trace_window_ms']:.0f} ms"] if cost["trace_window_ms"] else []
    if cost["new_sites"]:
        sites = cost["new_sites"]
        once.append(
            f"reading the source of {sites:g} new call site{'' if sites == 1 else 's'} {cost['new_sites_ms']:.0f} ms"
        )
    trace = f"; once: {', '.join(once)}" if once else ""
    return (
        f"{cost['job_ms_per_step']:.2f} ms a step in probe code on the job's threads{of_step}: "
        f"collective calls {cost['calls_ms_per_step']:.2f} ms ({_count(cost['calls_per_step'])} a step), "
        f"C heap readings {cost['heap_ms_per_step']:.2f} ms ({_count(cost['heap_reads_per_step'])} a step), "
        f"phase edges and step ends {max(rest, 0.0):.2f} ms{trace}; "
        f"{cost['threads_cpu_ms_per_step']:.2f} ms CPU a step on the probes' own threads{spread}"
    )
