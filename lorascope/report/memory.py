"""Chart data for memory: each rank's memory over time, and each rank's peak.

The figure per sample is CUDA allocated bytes when the job used CUDA, else the process
RSS (what the probes can read on a CPU run); the chart says which.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from lorascope.detect.common import CUDA_ALLOCATED, HEAP_IN_USE, RSS, has_figure, mem_reader, mem_value, memory_kind
from lorascope.detect.finding import Finding
from lorascope.ingest.frames import CATEGORIES
from lorascope.report.downsample import thin
from lorascope.report.timebase import MIB, mib, secs
from lorascope.rundir.loading.ending import ending_of
from lorascope.rundir.loading.reader import RankData, RunData
from lorascope.rundir.loading.records import StepRecord

#: Points kept per chart over all ranks (per rank: this / ranks, within the bounds below).
TIMELINE_BUDGET = 32_000
PER_RANK_MIN, PER_RANK_MAX = 200, 2_000
#: Step boundaries drawn as vertical markers, at most.
MAX_STEP_MARKERS = 40
#: Phases of every step are not drawn (too dense); other phases (eval, save) are.
STEP_PHASES = frozenset({"forward", "backward", "optimizer"})
MAX_PHASE_MARKERS = 200
#: Above the lines cutoff: pins for ranks that ended badly, one per way of ending; ranks named on each.
MAX_END_PINS, MAX_PIN_RANKS = 8, 12


#: The figures the memory chart can draw, in the order of its switch.
METRICS = (CUDA_ALLOCATED, HEAP_IN_USE, RSS)


def default_metric(run: RunData) -> str:
    """The figure the memory detectors use (see ``memory_kind``): the chart opens on it, so
    that it draws what the verdict was read from."""
    kinds = {memory_kind(r) for r in run.ranks.values()}
    return next((k for k in METRICS if k in kinds), RSS)


def _samples(rank: RankData, kind: str) -> tuple[list[float], list[float]]:
    """(times, bytes) of the rank's samples of one figure, in time order (the sampler
    thread and the training thread stamp records before they take the stream's lock)."""
    pairs = [(m["t"], v) for m in rank.mem if (v := mem_value(m, kind)) is not None]
    pairs.sort()
    return [p[0] for p in pairs], [p[1] for p in pairs]


def per_step(run: RunData, kind: str) -> dict[int, list[tuple[int, float]]]:
    """Per rank, its highest sample of one figure (MiB) in each step, by the step in progress
    when it was taken (a sample's ``step`` is the steps completed, so step n's carry n - 1).

    A CPU rank's heap is read at the phase edges of some steps only (``HEAP_EVERY`` in
    ``probes/memory.py``); a step whose edges were not read has at most a background
    sample and the previous step's end, not its peak: such steps are left out of the heap's
    figure, so that its line does not saw between peaks and troughs.

    A rank that exited 0 takes its last samples after its last step (the teardown): they are
    no step, and are left out (20 steps drew 21 columns). A rank that ended otherwise keeps
    the step it was in when it stopped (where an OOM or a hang shows)."""
    out: dict[int, list[tuple[int, float]]] = {}
    value_of = mem_reader(kind)
    heap = kind == HEAP_IN_USE
    for rank in run.ranks.values():
        high: dict[int, int] = {}
        edges: set[int] = set()
        for m, v in zip(rank.mem, map(value_of, rank.mem), strict=True):
            if v is not None and type(step := m.get("step")) is int:
                step += 1
                if v > high.get(step, -1):
                    high[step] = v
                if heap and m.get("src") not in _NOT_EDGES:
                    edges.add(step)
        if edges:
            high = {s: v for s, v in high.items() if s in edges}
        ended = ending_of(rank)
        if rank.steps and ended.status == "exit" and ended.code == 0:
            last = max(s["step"] for s in rank.steps)
            high = {s: v for s, v in high.items() if s <= last}
        out[rank.rank] = [(s, v / MIB) for s, v in sorted(high.items())]
    return out


#: Samples that do not say a step was read (``per_step``): the background sampler's, a
#: step's end (counted in the step after it), and the optimizer's end, which is read alone
#: at the end of the step before a read one.
_NOT_EDGES = frozenset({"sampler", "step", "optimizer.end"})


def per_rank_points(n_ranks: int, budget: int = TIMELINE_BUDGET) -> int:
    return max(PER_RANK_MIN, min(PER_RANK_MAX, budget // max(1, n_ranks)))


def end_mark(ended: dict[str, Any], rank: RankData) -> dict[str, Any]:
    """How the rank ended, as a short label for the end of its line."""
    status = ended["status"]
    if status == "exception":
        exc = rank.exception
        text = exc["message"] if exc is not None else ""
        label = "OOM" if "out of memory" in text.lower() else (exc["type"] if exc is not None else "exception")
    elif status == "signal":  # a fatal signal's detail goes on with faulthandler's whole dump
        label = str(ended["detail"] or "signal").splitlines()[0][:80]
    elif status == "exit":
        label = f"exit {ended['code']}"
    else:
        label = "no end record"
    return {"label": label, "bad": not (status == "exit" and ended["code"] == 0)}


def _step_markers(run: RunData, origin: float) -> list[list[float]]:
    rank = next((r for r in run.ranks.values() if r.steps), None)
    if rank is None:
        return []
    steps = rank.steps
    stride = max(1, -(-len(steps) // MAX_STEP_MARKERS))
    picked = steps[stride - 1 :: stride]
    if picked[-1] is not steps[-1]:
        picked.append(steps[-1])
    return [[secs(float(s["t"]), origin), s["step"]] for s in picked]


#: The memory chart opens zoomed to the steps, with this share of their span shown before the first.
VIEW_MARGIN = 0.05


def _duration(step: StepRecord) -> float:
    dur = step.get("dur")
    if not isinstance(dur, (int, float)) or isinstance(dur, bool) or not math.isfinite(dur):
        return 0.0
    return max(0.0, float(dur))


def steps_view(run: RunData, origin: float) -> list[float] | None:
    """Where the memory chart opens: from just before the first step began to the last
    sample (seconds since the start), so that the steps fill the width rather than the
    startup (75 s of loading left 20 steps the last 5 s); None when no step completed.
    The slider widens it to the whole run."""
    begins = [float(r.steps[0]["t"]) - _duration(r.steps[0]) for r in run.ranks.values() if r.steps]
    ends = [max(float(m["t"]) for m in r.mem) for r in run.ranks.values() if r.mem]
    if not begins or not ends or max(ends) <= min(begins):
        return None
    begin, end = min(begins), max(ends)
    return [max(0.0, secs(begin - VIEW_MARGIN * (end - begin), origin)), secs(end, origin)]


def _phase_spans(run: RunData, origin: float) -> list[dict[str, Any]]:
    """Non-step phases (eval, save, ...), merged across ranks by (name, step). A phase a
    rank entered and never left (it died or hangs there) is marked ``open``."""
    spans: dict[tuple[str, int, bool], dict[str, Any]] = {}

    def add(name: str, step: int, begin: float, end: float, rank: int, is_open: bool) -> None:
        span = spans.setdefault(
            (name, step, is_open), {"name": name, "step": step, "from": begin, "to": end, "ranks": [], "open": is_open}
        )
        span["from"], span["to"] = min(span["from"], begin), max(span["to"], end)
        span["ranks"].append(rank)

    for rank in run.ranks.values():
        open_at: dict[str, tuple[float, int]] = {}
        for rec in rank.phases:
            if rec["name"] in STEP_PHASES:
                continue
            if rec["edge"] == "begin":
                open_at[rec["name"]] = (float(rec["t"]), rec["step"])
            else:
                begin, _ = open_at.pop(rec["name"], (float(rec["t"]), rec["step"]))
                add(rec["name"], rec["step"], begin, float(rec["t"]), rank.rank, False)
        for name, (begin, step) in open_at.items():
            add(name, step, begin, rank.last_time, rank.rank, True)
    ordered = sorted(spans.values(), key=lambda s: (s["from"], s["name"]))
    stride = max(1, -(-len(ordered) // MAX_PHASE_MARKERS))
    return [
        {**s, "from": secs(s["from"], origin), "to": secs(s["to"], origin), "ranks": sorted(s["ranks"])}
        for s in ordered[::stride]
    ]


def _ends_by_step(run: RunData, kind: str, ends: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Where the ranks that ended badly stopped, by step (the band chart's x), one pin per
    way of ending (at most :data:`MAX_END_PINS`): at the first of them to stop, its last sample
    of the figure; ``ranks`` (the first :data:`MAX_PIN_RANKS`) and ``count``."""
    pins: dict[str, dict[str, Any]] = {}
    for rank in run.ranks.values():
        last = next((m for m in reversed(rank.mem) if mem_value(m, kind) is not None), None)
        if not ends[rank.rank]["bad"] or last is None or type(last.get("step")) is not int:
            continue
        label, step = ends[rank.rank]["label"], last["step"] + 1
        pin = pins.setdefault(
            label, {"label": label, "step": step, "mib": mib(mem_value(last, kind)), "ranks": [], "count": 0}
        )
        if step < pin["step"]:
            pin["step"], pin["mib"] = step, mib(mem_value(last, kind))
        pin["count"] += 1
        if len(pin["ranks"]) < MAX_PIN_RANKS:
            pin["ranks"].append(rank.rank)
    return sorted(pins.values(), key=lambda p: (p["step"], p["label"]))[:MAX_END_PINS]


def recorded_metrics(run: RunData) -> list[str]:
    """The figures the run recorded, the one the detectors use first."""
    metric = default_metric(run)
    recorded = [k for k in METRICS if any(has_figure(r, k) for r in run.ranks.values())]
    return [metric] + [k for k in recorded if k != metric]


def timeline(run: RunData, origin: float, ends: dict[int, dict[str, Any]], lines: bool = True) -> dict[str, Any]:
    """Per figure the run recorded (CUDA allocated, heap in use, RSS), per rank its samples
    (thinned, as columns ``t`` / ``mib``; only with ``lines``, see
    :data:`~lorascope.report.spread.LINES_UP_TO`) and where and how it ended (``ends``:
    :func:`end_mark` by rank). ``metric`` is the one the detectors use, drawn first."""
    metrics = recorded_metrics(run)
    metric = metrics[0]
    keep = per_rank_points(len(run.ranks) * len(metrics))
    by_metric: dict[str, list[dict[str, Any]]] = {}
    total = shown = 0
    for kind in metrics if lines else []:
        series = by_metric[kind] = []
        for rank in run.ranks.values():
            ts, vs = _samples(rank, kind)
            if kind == metric:
                total += len(ts)
            ts, vs = thin(ts, vs, keep)
            if kind == metric:
                shown += len(ts)
            series.append(
                {
                    "rank": rank.rank,
                    "t": [secs(t, origin) for t in ts],
                    "mib": [mib(v) for v in vs],
                    "end": {"t": secs(ts[-1], origin), "mib": mib(vs[-1]), **ends[rank.rank]} if ts else None,
                }
            )
    return {
        "metric": metric,
        "metrics": metrics,
        "series": by_metric[metric] if lines else None,
        "others": {k: v for k, v in by_metric.items() if k != metric},
        "ends": None if lines else _ends_by_step(run, metric, ends),
        "steps": _step_markers(run, origin),
        "view": steps_view(run, origin) if lines else None,
        "phases": _phase_spans(run, origin),
        "samples": total,
        "shown": shown,
    }


def _breakdown(findings: list[Finding], ranks: list[int]) -> dict[str, list[float | None]] | None:
    """Per-category MiB per rank, from the first finding that carries ``memory_breakdown``."""
    for finding in findings:
        raw = finding.details.get("memory_breakdown")
        if isinstance(raw, dict) and raw:
            by_rank = {str(k): v for k, v in raw.items() if isinstance(v, dict)}
            cats = [c for c in CATEGORIES if any(c in v for v in by_rank.values())]
            return {c: [mib(by_rank.get(str(r), {}).get(c)) for r in ranks] for c in cats}
    return None


#: What each memory figure's peak is called wherever the report shows one.
METRIC_LABELS = {
    CUDA_ALLOCATED: "CUDA max allocated",
    HEAP_IN_USE: "peak C heap in use: bytes malloc handed out, not RSS",
    RSS: "peak RSS, resident memory",
}


def peaks(run: RunData, summaries: list[dict[str, Any]], findings: list[Finding]) -> dict[str, Any]:
    """Each rank's peak, from the analyze summary's ``peak_memory`` (``summaries``)."""
    metric = default_metric(run)
    cuda = metric == CUDA_ALLOCATED
    ranks = [s["rank"] for s in summaries]
    peak_key = {CUDA_ALLOCATED: "cuda_max_allocated_bytes", HEAP_IN_USE: "heap_bytes"}.get(metric, "rss_bytes")
    peak = [mib(s["peak_memory"][peak_key]) for s in summaries]
    logits = [mib(max((r["bytes"] for r in run.ranks[n].logits), default=None)) for n in ranks]
    others = [p for r, p in zip(ranks, peak, strict=True) if r != 0 and p is not None]
    return {
        "metric": METRIC_LABELS.get(metric, METRIC_LABELS[RSS]),
        "ranks": ranks,
        "peak": peak,
        "reserved": [mib(s["peak_memory"]["cuda_reserved_bytes"]) for s in summaries] if cuda else None,
        # the resident memory too, where the metric is another (the terminal's table shows it)
        "rss": [mib(s["peak_memory"]["rss_bytes"]) for s in summaries] if metric != RSS else None,
        "largest_logits": logits if any(v is not None for v in logits) else None,
        "median_others": statistics.median(others) if others else None,
        "breakdown": _breakdown(findings, ranks),
    }
