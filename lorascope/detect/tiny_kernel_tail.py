"""tiny-kernel-tail: LoRA's many thin GEMMs (and its dropout, scaling and add) make the
step launch-bound: a large share of the step's kernel time sits in kernels too short to
cover their own launch, and the device idles between them.

Evidence, per rank, from the bounded Kineto window the probes record (or traces given
to `lorascope analyze`): kernels (on a CPU-only run, the leaf CPU ops, with the same
rule) under the tiny threshold, by count and by time; the share of kernel time
attributed to LoRA modules (the probes' module ranges; backward kernels through their
autograd sequence numbers); LoRA kernels per step; idle gaps between kernels on the GPU.
Thresholds and their reasoning: docs/detectors.md.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from lorascope.detect.finding import Confidence, Evidence, Finding
from lorascope.detect.kernel_attribution import table_from_traces, tiny_threshold_us
from lorascope.ingest.evidence import EvidenceBundle

ID = "tiny-kernel-tail"
#: "Thousands of thin GEMMs per step": LoRA kernels per traced step must reach this
#: (counts, unlike time shares, do not move with a loaded machine) ...
MIN_LORA_PER_STEP = 2000
#: ... most of them must be tiny (the LoRA cost is launch overhead, not math) ...
MIN_LORA_TINY_SHARE = 0.5
#: ... and they must weigh in the step's kernel time.
MIN_LORA_TIME_SHARE = 0.10
#: Without module ranges (a trace from elsewhere): tiny kernels' share of the count and
#: the device's idle share of the window that make a launch-bound step.
MIN_TINY_COUNT_SHARE = 0.5
MIN_IDLE_SHARE = 0.3
LORA = frozenset({"lora_A", "lora_B", "lora"})

LORA_EXPLANATION = (
    "Each LoRA-adapted layer adds two thin GEMMs (rank r), a dropout, a scaling and an "
    "add, forward and backward. With small r, hidden sizes or micro-batches these kernels "
    "finish faster than the CPU can launch the next one, so the device waits on Python and "
    "the launch path instead of computing: thousands of tiny kernels per step set the step "
    "time, not FLOPs."
)
LORA_FIX = (
    "Pack sequences or raise the micro-batch so each kernel does more work; set lora_dropout=0 "
    "(drops a kernel per adapter); torch.compile the model (fuses the LoRA epilogue); use fused "
    "LoRA kernels (e.g. Unsloth, Liger); target fewer modules or merge adapters for evaluation."
)
#: Without module ranges nothing in the trace says which code launches the tiny kernels:
#: the finding names the symptom only (LoRA is one cause among many).
PLAIN_EXPLANATION = (
    "Most kernels finish faster than the CPU can launch the next one, so the device waits on "
    "Python and the launch path between them instead of computing. The trace has no module "
    "ranges, so which part of the model launches them is not known from it: LoRA adapters "
    "are one usual cause, small element-wise ops, optimizer loops over many tensors and "
    "small batches are others."
)
PLAIN_FIX = (
    "Record the run with `lorascope run` (its module ranges attribute kernels to modules) or "
    "look at the trace's top kernels; then fuse or batch the small work: torch.compile or CUDA "
    "graphs, a larger micro-batch or packed sequences, foreach/fused optimizers."
)


def _rank_stats(entry: dict[str, Any], threshold: float) -> dict[str, Any]:
    durations = [(d, row["module"]) for row in entry["rows"] for d in row["durations_us"]]
    total = math.fsum(d for d, _ in durations) or 1.0  # (fsum: the same on every Python)
    lora = [d for d, m in durations if m in LORA]
    tiny = [d for d, _ in durations if d < threshold]
    steps = entry.get("steps") or None
    return {
        "units": len(durations),
        "steps": steps,
        "tiny_count_share": len(tiny) / len(durations) if durations else 0.0,
        "tiny_time_share": math.fsum(tiny) / total,
        "annotated": any(m is not None for _, m in durations),
        "lora_units": len(lora),
        "lora_per_step": len(lora) / steps if steps else None,
        "lora_time_share": math.fsum(lora) / total,
        "lora_tiny_share": sum(1 for d in lora if d < threshold) / len(lora) if lora else 0.0,
        "lora_median_us": statistics.median(lora) if lora else None,
    }


def detect(bundle: EvidenceBundle) -> list[Finding]:
    if not bundle.traces:
        return []
    threshold = tiny_threshold_us(bundle.traces)
    table = table_from_traces(bundle.traces, threshold)
    if table is None:
        return []
    unit = table["unit"]
    stats = {int(r): _rank_stats(e, threshold) for r, e in table["ranks"].items()}
    idle = {
        r: t.idle_us / (t.busy_us + t.idle_us)
        for r, t in bundle.traces.items()
        if hasattr(t, "idle_us") and t.busy_us + t.idle_us > 0 and unit == "kernel"
    }
    lora_hits = [
        r
        for r, s in stats.items()
        if (s["lora_per_step"] or s["lora_units"]) >= MIN_LORA_PER_STEP
        and s["lora_tiny_share"] >= MIN_LORA_TINY_SHARE
        and s["lora_time_share"] >= MIN_LORA_TIME_SHARE
    ]
    plain_hits = [
        r
        for r, s in stats.items()
        if not s["annotated"] and s["tiny_count_share"] >= MIN_TINY_COUNT_SHARE and idle.get(r, 0.0) >= MIN_IDLE_SHARE
    ]
    hits = lora_hits or plain_hits
    if not hits:
        return []
    rank = hits[0]
    s = stats[rank]
    source = table["ranks"][str(rank)].get("source") or f"trace of rank {rank}"
    evidence = [
        Evidence(
            f"{unit}s under {threshold:g} us",
            f"{s['tiny_count_share']:.0%} of {s['units']:,} {unit}s, {s['tiny_time_share']:.0%} of {unit} time",
            source,
        ),
    ]
    if lora_hits:
        per_step = f", {s['lora_per_step']:,.0f} per step" if s["lora_per_step"] else ""
        evidence += [
            Evidence(
                f"LoRA {unit}s (lora_A / lora_B / dropout, scaling, add)",
                f"{s['lora_units']:,}{per_step}; {s['lora_tiny_share']:.0%} of them under {threshold:g} us "
                f"(median {s['lora_median_us']:.1f} us)",
                source,
            ),
            Evidence(f"LoRA share of {unit} time", f"{s['lora_time_share']:.0%}", source),
        ]
    if rank in idle:
        evidence.append(Evidence("device idle between kernels", f"{idle[rank]:.0%} of the busy window", source))
    confidence: Confidence = "high" if lora_hits and len(lora_hits) == len(stats) else "medium"
    reason = (
        f"{s['lora_per_step'] or s['lora_units']:,.0f} LoRA {unit}s per step, mostly tiny, "
        f"{s['lora_time_share']:.0%} of {unit} time, on {len(lora_hits)} of {len(stats)} traced rank(s)"
        if lora_hits
        else "tiny kernels dominate and the device idles, but the trace has no module ranges to name LoRA"
    )
    return [
        Finding(
            id=ID,
            title=(
                f"LoRA adds {s['lora_units']:,} {unit}s to the traced steps, {s['lora_tiny_share']:.0%} of them "
                f"under {threshold:g} us ({s['lora_time_share']:.0%} of {unit} time): the step is launch-bound"
                if lora_hits
                else f"the step is launch-bound: {s['tiny_count_share']:.0%} of {unit}s are under {threshold:g} us and "
                f"the device idles {idle.get(rank, 0.0):.0%}; which modules launch them is unknown (no module ranges)"
            ),
            severity="warning",
            confidence=confidence,
            confidence_reason=reason,
            ranks=sorted(hits),
            evidence=evidence,
            explanation=LORA_EXPLANATION if lora_hits else PLAIN_EXPLANATION,
            fix=LORA_FIX if lora_hits else PLAIN_FIX,
            details={"kernels": table, "stats": {str(r): v for r, v in stats.items()}, "threshold_us": threshold},
        )
    ]
