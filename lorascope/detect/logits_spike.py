"""logits-spike: the loss, not the layers, sets the peak: B·T·V logits in fp32, the
log-softmax the loss builds from them and their gradient.

Evidence: the logits the probes saw at the first steps (shape, dtype, bytes, B·T·V), the
memory reading right before and after the loss, and how that footprint compares with
the rank's peak. Thresholds: docs/detectors.md.
"""

from __future__ import annotations

import math
from typing import Any

from lorascope.detect.common import (
    device_total,
    mem_value,
    memory_kind,
    peak_memory,
    run_failed_here,
    stream_source,
)
from lorascope.detect.finding import Evidence, Finding, Severity
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.rundir.loading.reader import RankData, RunData
from lorascope.units import fmt_bytes

ID = "logits-spike"
#: fp32 logits, the log-softmax cross_entropy builds, and the logits' gradient: three
#: tensors of B·T·V·4 bytes are live together at the loss (more with a native-dtype copy).
LIVE_COPIES = 3
#: The spike must be this share of the memory the step itself uses (peak minus the
#: memory held before the first forward) ...
MIN_SHARE_OF_STEP = 0.25
#: ... and at least this much in absolute terms.
MIN_BYTES = 32 * 2**20
#: Severity follows consequence (docs/detectors.md): an error when the rank ran out of
#: memory or filled its device; a warning when the spike is a real cost in its own right,
#: this much or this share of the device; else a note (a large share of a small job's
#: budget) that projects the term to a training-sized batch.
WARNING_BYTES = 2**30
WARNING_DEVICE_SHARE = 0.10
#: The batch the note projects to: 4 sequences of 4,096 tokens.
PROJECTED_TOKENS = 4 * 4096


def _baseline(rank: RankData) -> int | None:
    """Memory held before the first forward (weights, optimizer, framework)."""
    for sample in rank.mem:
        if sample["src"] == "forward.begin":
            return mem_value(sample, memory_kind(rank))
    return None


def _rank_finding(run: RunData, rank: RankData) -> tuple[float, list[Evidence], dict[str, Any]] | None:
    loss_inputs = [r for r in rank.logits if r["where"] == "loss_input"]
    heads = [r for r in rank.logits if r["where"] == "lm_head_output"]
    if not loss_inputs and not heads:
        return None
    # B·T·V from the output projection when seen (the loss input may be shifted: T-1).
    rec = max(heads or loss_inputs, key=lambda r: r["bytes"])
    vocab = rec["shape"][-1]
    tokens = math.prod(rec["shape"][:-1])
    fp32_bytes = tokens * vocab * 4
    spike = LIVE_COPIES * fp32_bytes
    peak, base = peak_memory(rank), _baseline(rank)
    if peak is None:
        return None
    step_memory = peak - base if base is not None and peak > base else peak
    share = spike / step_memory if step_memory else 0.0
    if spike < MIN_BYTES or share < MIN_SHARE_OF_STEP:
        return None
    src = stream_source(run, rank, "logits records")
    evidence = [
        Evidence(
            "logits" if rec in heads else "loss input",
            f"shape {rec['shape']} {rec['dtype']} = {rec['bytes']:,} B ({fmt_bytes(rec['bytes'])})",
            src,
        ),
        Evidence(
            "B·T·V",
            f"{tokens:,} tokens x {vocab:,} vocab = {tokens * vocab:,} logits ({fmt_bytes(fp32_bytes)} in fp32)",
            src,
        ),
    ]
    loss_rec = max(loss_inputs, key=lambda r: r["bytes"]) if loss_inputs else None
    if loss_rec is not None and loss_rec is not rec:
        evidence.append(
            Evidence(
                "loss input", f"shape {loss_rec['shape']} {loss_rec['dtype']} = {fmt_bytes(loss_rec['bytes'])}", src
            )
        )
    before, after = (loss_rec.get("mem_before"), loss_rec.get("mem_after")) if loss_rec is not None else (None, None)
    if isinstance(before, dict) and isinstance(after, dict) and before.get("rss") and after.get("rss"):
        evidence.append(
            Evidence("RSS across the loss", f"{fmt_bytes(before['rss'])} -> {fmt_bytes(after['rss'])}", src)
        )
    evidence.append(
        Evidence(
            f"share of the step's memory ({memory_kind(rank)})",
            _share_text(spike, step_memory, share),
            f"{LIVE_COPIES} x fp32 logits vs peak minus memory before the first forward",
        )
    )
    return (
        share,
        evidence,
        {
            "tokens": tokens,
            "vocab": vocab,
            "fp32_bytes": fp32_bytes,
            "logits_shape": rec["shape"],
            "logits_bytes": rec["bytes"],
            "spike_bytes": spike,
            "step_memory_bytes": step_memory,
            "dtype": rec["dtype"],
            "failed": run_failed_here(rank),
            "device_total": device_total(rank),
        },
    )


def _share_text(spike: int, step_memory: int, share: float) -> str:
    """The estimate against what the readings measured. An estimate above the step's whole
    measured growth is said as such, not as a share over 100%: the copies it counts live
    inside the loss, between the phase edges where memory is read."""
    if share < 1:
        return f"~{fmt_bytes(spike)} of {fmt_bytes(step_memory)} = {share:.0%}"
    return (
        f"~{fmt_bytes(spike)} estimated, more than the {fmt_bytes(step_memory)} the step was measured to grow by "
        "(its readings are at phase edges; the loss's copies live between them)"
    )


def _snapshot_finding(bundle: EvidenceBundle, rank: int) -> tuple[float, list[Evidence], dict[str, Any]] | None:
    """From an allocator snapshot: the large blocks live at the peak in lm_head / loss
    frames (and blocks of the same size elsewhere), against the peak."""
    snapshot = bundle.snapshots[rank]
    device = snapshot.main
    if device is None or device.peak is None or not device.logits_blocks:
        return None
    logits = sum(b.bytes for b in device.logits_blocks)
    share = logits / device.peak.allocated if device.peak.allocated else 0.0
    if logits < MIN_BYTES or share < MIN_SHARE_OF_STEP:
        return None
    src = f"{snapshot.path} (blocks live at the trace's peak)"
    evidence = [
        Evidence(
            f"logits-sized block at {b.site}",
            f"{b.bytes:,} B ({fmt_bytes(b.bytes)})" + (f"; {b.note}" if b.note else ""),
            src,
        )
        for b in device.logits_blocks[:6]
    ]
    evidence.append(
        Evidence(
            "share of the peak",
            f"{fmt_bytes(logits)} of {fmt_bytes(device.peak.allocated)} allocated = {share:.0%}",
            src,
        )
    )
    details = {
        "logits_bytes": logits,
        "spike_bytes": logits,
        "peak_allocated": device.peak.allocated,
        "source": "snapshot",
        "failed": bool(device.ooms),
        "device_total": None,
    }
    return share, evidence, details


def _severity(details: dict[str, Any]) -> Severity:
    if details["failed"]:
        return "error"
    total = details["device_total"]
    spike = details["spike_bytes"]
    if spike >= WARNING_BYTES or (total and spike >= WARNING_DEVICE_SHARE * total):
        return "warning"
    return "info"


def _projection(details: dict[str, Any]) -> str:
    """The same term at a training-sized batch, for a small job's note."""
    vocab = details.get("vocab")
    if not vocab:
        return ""
    per_token = LIVE_COPIES * 4 * vocab
    return (
        f" At {PROJECTED_TOKENS:,} tokens per micro-batch (e.g. 4 x 4,096) the same vocabulary's logits "
        f"take ~{fmt_bytes(per_token * PROJECTED_TOKENS)} ({LIVE_COPIES} x 4 B x {vocab:,} per token): "
        "`lorascope plan --model CONFIG --seq T --micro-batch B` gives the budget at the real size."
    )


def detect(bundle: EvidenceBundle) -> list[Finding]:
    run = bundle.run
    hits = {n: f for n, r in run.ranks.items() if (f := _rank_finding(run, r)) is not None} if run else {}
    if not hits:
        hits = {n: f for n in bundle.snapshots if (f := _snapshot_finding(bundle, n)) is not None}
    if not hits:
        return []
    rank = min(hits, key=lambda n: -hits[n][0])
    share, evidence, details = hits[rank]
    details = {
        **details,
        "failed": any(h[2]["failed"] for h in hits.values()),
        "device_total": min((t for h in hits.values() if (t := h[2]["device_total"])), default=None),
    }
    shape = (
        f" ({details['tokens']:,} tokens x {details['vocab']:,} vocab)"
        if "tokens" in details
        else " at the allocator's peak"
    )
    whole = share >= 1 and "step_memory_bytes" in details
    if whole:
        title = (
            f"the loss's logits (~{fmt_bytes(details['spike_bytes'])} estimated, with the log-softmax and their "
            f"gradient) are more than the step's whole measured growth ({fmt_bytes(details['step_memory_bytes'])})"
            f"{shape}"
        )
    else:
        title = f"the loss's logits take ~{share:.0%} of each step's memory{shape}"
    severity = _severity(details)
    if severity == "info":
        amount = "" if whole else f"~{fmt_bytes(details['spike_bytes'])}, "
        title += f": {amount}no memory pressure in this run"
    return [
        Finding(
            id=ID,
            title=title,
            severity=severity,
            confidence="high" if share >= 2 * MIN_SHARE_OF_STEP else "medium",
            confidence_reason=(
                f"logits measured at the loss on {len(hits)} rank(s); their footprint is "
                + ("more than all" if share >= 1 else f"{share:.0%}")
                + f" of the step's memory (threshold {MIN_SHARE_OF_STEP:.0%})"
            ),
            ranks=sorted(hits),
            evidence=evidence,
            explanation=(
                "A causal-LM loss materialises one score per token per vocabulary entry. With a large "
                "vocabulary the logits (B·T·V), their fp32 upcast for the loss, the log-softmax and "
                "their gradient are live together at the loss, and they, not the adapters or the "
                "frozen layers, set the peak. LoRA makes the rest of the step small, so this "
                "dominates."
                + (
                    " Here the run did not run out of memory and the amount is small: a note, not a fault, "
                    "unless the real job uses longer sequences or a larger micro-batch." + _projection(details)
                    if severity == "info"
                    else ""
                )
            ),
            fix=(
                "Use a chunked or fused cross-entropy that never materialises full logits (Liger Kernel's "
                "fused linear cross-entropy, Apple's Cut Cross Entropy); lower the micro-batch or sequence "
                "length; compute logits only where labels are (logits_to_keep / num_logits_to_keep)."
            ),
            details=details,
        )
    ]
