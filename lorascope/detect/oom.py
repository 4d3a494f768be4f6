"""oom: a rank ran out of device memory; what held the memory at that moment.

Evidence: the ``oom`` entry of an allocator snapshot's trace (the request, what the
driver still had free) with the live allocations replayed to that entry, grouped by
category and by the first user frame; else the CUDA OOM message of the job's log (its
numbers, other processes on the same GPU). The fix follows the category that held the
most. Thresholds and reasoning: docs/artifacts.md.
"""

from __future__ import annotations

import dataclasses

from lorascope.detect.common import stream_source
from lorascope.detect.finding import Evidence, Finding
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.ingest.logs.reader import OomReport, parse_oom
from lorascope.ingest.snapshot.points import SIZE_SLACK
from lorascope.ingest.snapshot.types import MemoryPoint, OomEvent, SiteGroup, SnapshotAnalysis
from lorascope.rundir.loading.reader import RankData, RunData
from lorascope.units import fmt_bytes

ID = "oom"

#: What to change, by the category that held the most memory at the OOM.
FIXES = {
    "logits": "the loss's logits dominate: use a chunked or fused cross-entropy (Liger, Cut Cross Entropy), "
    "a smaller micro-batch or sequence length, or logits_to_keep",
    "activations": "activations dominate: enable gradient checkpointing (use_reentrant=False), shorten "
    "sequences or pack them, or lower the micro-batch size",
    "optimizer": "optimizer state dominates: shard it (ZeRO stage 1/2/3), offload it, or use an 8-bit optimizer; "
    "with LoRA make sure the optimizer only holds the adapter parameters",
    "weights": "the weights dominate: shard them (ZeRO-3 / FSDP), load the base model quantized (QLoRA), "
    "or use a smaller model per GPU",
    "gradients": "gradients dominate: check that only the adapters require grad, and shard gradients (ZeRO-2/3)",
}
DEFAULT_FIX = (
    "see what held the memory below; lower the micro-batch size, or shard states with ZeRO; "
    "if much is reserved but unallocated, set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
)


def _room_left(oom: OomEvent) -> bool:
    """Whether the device still had room for the request: with a cap set, the process ran
    into its own cap, not the device's end (a planted OOM on the GPU check: 138.5 GiB free)."""
    return oom.device_free is not None and oom.device_free > oom.requested


def _logits_sized(live: MemoryPoint, logits_bytes: list[int]) -> tuple[dict[str, int], list[SiteGroup]]:
    """The live set's categories and sites with the blocks of the logits' size (the probes
    record it at the output projection) counted as logits: an OOM at the loss comes before
    the loss allocates anything its frames would name, and the output projection's frame
    is the model's forward (seen on the GPU check: 62.5 MiB of logits read "activations")."""
    by_category, by_site = dict(live.by_category), []
    for g in live.by_site:
        blocks = round(g.bytes / g.largest) if g.largest else 0
        if g.category != "logits" and any(abs(g.largest - b) <= SIZE_SLACK for b in logits_bytes) and blocks:
            moved = g.largest * min(g.count, blocks)
            by_category[g.category] -= moved
            by_category["logits"] = by_category.get("logits", 0) + moved
            g = dataclasses.replace(g, category="logits")
        by_site.append(g)
    return {c: b for c, b in sorted(by_category.items(), key=lambda kv: -kv[1]) if b > 0}, by_site


def _snapshot_finding(
    rank: int,
    snap: SnapshotAnalysis,
    oom: OomEvent,
    device: int,
    cap: tuple[str, int] | None,
    logits_bytes: list[int],
) -> Finding:
    live = oom.live
    src = f"{snap.path}: device_traces[{device}][{oom.index}]"
    by_category, by_site = _logits_sized(live, logits_bytes)
    top = max(by_category.items(), key=lambda kv: kv[1])[0] if by_category else None
    capped = cap if cap is not None and _room_left(oom) else None
    evidence = [
        Evidence("request that failed", f"{oom.requested:,} B ({fmt_bytes(oom.requested)})", src),
        Evidence("free on the device then", fmt_bytes(oom.device_free), src),
        Evidence(
            "allocated / reserved at the OOM",
            f"{fmt_bytes(live.allocated)} / {fmt_bytes(live.reserved)}",
            f"{snap.path} (trace replayed to entry {oom.index})",
        ),
        Evidence(
            "by category",
            ", ".join(f"{c} {fmt_bytes(b)}" for c, b in by_category.items()),
            f"{snap.path} (frames of the live allocations"
            + ("; blocks of the logits' size as logits)" if by_category != live.by_category else ")"),
        ),
    ]
    evidence += [
        Evidence(
            f"held by {g.site}",
            f"{fmt_bytes(g.bytes)} {g.category} in {g.count} blocks",
            f"{snap.path} (first user frame)",
        )
        for g in by_site[:3]
    ]
    if live.annotations:
        evidence.append(Evidence("inside", " > ".join(live.annotations), f"{snap.path}: external_annotations"))
    if capped is not None:
        evidence.insert(2, Evidence("the process's own cap", f"{fmt_bytes(capped[1])} allowed", capped[0]))
    share = by_category.get(top, 0) / live.allocated if top and live.allocated else 0.0
    fix = FIXES.get(top or "", DEFAULT_FIX)
    if capped is not None:
        fix = (
            f"the process hit its own cap of {fmt_bytes(capped[1])} (torch.cuda.set_per_process_memory_fraction) "
            f"with {fmt_bytes(oom.device_free)} still free on the device: raise or remove the cap; else {fix}"
        )
    return Finding(
        id=ID,
        title=f"rank {rank} ran out of memory asking for {fmt_bytes(oom.requested)}"
        + (f" at its own {fmt_bytes(capped[1])} cap" if capped is not None else "")
        + f"; {top or 'unattributed'} memory held {share:.0%} of it",
        severity="error",
        confidence="high",
        confidence_reason="the allocator's own OOM record, with every live allocation replayed to it",
        ranks=[rank],
        evidence=evidence,
        explanation="The caching allocator could not find or create a block for the request. The live "
        "allocations at that moment say what the memory was spent on; the largest category is "
        "where a change pays most.",
        fix=fix,
        details={
            "requested": oom.requested,
            "by_category": by_category,
            "sites": [g.site for g in by_site[:10]],
        },
    )


def _log_finding(path: str, report: OomReport) -> Finding:
    src = f"{path}:{report.line}"
    evidence = [Evidence("request that failed", fmt_bytes(report.requested), src)]
    for label, value in (
        ("free on the device", report.free),
        ("allocated by PyTorch", report.allocated_by_pytorch),
        ("reserved but unallocated", report.reserved_unallocated),
        ("total capacity", report.total_capacity),
        ("allowed to the process (its own cap)", report.allowed),
    ):
        if value is not None:
            evidence.append(Evidence(label, fmt_bytes(value), src))
    if report.other_processes:
        evidence.append(
            Evidence(
                "other processes on the GPU",
                ", ".join(f"pid {pid}: {fmt_bytes(b)}" for pid, b in report.other_processes.items()),
                src,
            )
        )
    ranks = [report.rank] if report.rank is not None else []
    who = f"rank {report.rank}" if report.rank is not None else "a rank"
    return Finding(
        id=ID,
        title=f"{who} ran out of CUDA memory asking for {fmt_bytes(report.requested)}",
        severity="error",
        confidence="medium",
        confidence_reason="the OOM message of the job's log; without an allocator snapshot it does not say "
        "what held the memory",
        ranks=ranks,
        evidence=evidence,
        explanation="The job's log carries torch's OOM message. Its numbers tell whether the memory was in use "
        "(allocated by PyTorch), cached (reserved but unallocated) or held by other processes.",
        fix=DEFAULT_FIX
        + (
            "; other processes hold memory on this GPU: give each rank its own device "
            "(torch.cuda.set_device(local_rank) before init_process_group)"
            if report.other_processes
            else ""
        ),
        details={"log": path, "line": report.line},
    )


def _log_reports(bundle: EvidenceBundle) -> dict[int, tuple[str, OomReport]]:
    out: dict[int, tuple[str, OomReport]] = {}
    for log in bundle.logs:
        for report in log.ooms:
            if report.rank is not None:
                out.setdefault(report.rank, (str(log.path), report))
    return out


def _logits_bytes(data: RankData | None) -> list[int]:
    """Sizes of the logits the probes saw at the rank's output projection."""
    logits = data.logits if data is not None else []
    return sorted({int(r["bytes"]) for r in logits if r.get("where") == "lm_head_output" and r.get("bytes")})


def _cap(run: RunData | None, data: RankData | None, logged: tuple[str, OomReport] | None) -> tuple[str, int] | None:
    """(where it is read, bytes) of the rank's own memory cap, from its OOM message: the
    exception the probes recorded, else the job's log."""
    report = parse_oom(data.exception["message"]) if data is not None and data.exception is not None else None
    if run is not None and data is not None and report is not None and report.allowed is not None:
        return stream_source(run, data, "exception record: torch's OOM message"), report.allowed
    if logged is not None:
        path, log_report = logged
        if log_report.allowed is not None:
            return f"{path}:{log_report.line}", log_report.allowed
    return None


def detect(bundle: EvidenceBundle) -> list[Finding]:
    findings = []
    with_snapshot: set[int] = set()
    logged = _log_reports(bundle)
    for rank, snap in sorted(bundle.snapshots.items()):
        for device in snap.devices:
            if device.ooms:
                data = bundle.run.ranks.get(rank) if bundle.run is not None else None
                cap = _cap(bundle.run, data, logged.get(rank))
                finding = _snapshot_finding(rank, snap, device.ooms[0], device.device, cap, _logits_bytes(data))
                if rank in logged:  # the log's message adds what the snapshot cannot see
                    path, report = logged[rank]
                    finding.evidence += [
                        e
                        for e in _log_finding(path, report).evidence
                        if e.label in ("reserved but unallocated", "other processes on the GPU")
                    ]
                findings.append(finding)
                with_snapshot.add(rank)
                break
    for log in bundle.logs:
        seen: set[int | None] = set()
        for report in log.ooms:
            if report.rank in seen or (report.rank is not None and report.rank in with_snapshot):
                continue
            seen.add(report.rank)
            findings.append(_log_finding(str(log.path), report))
    return findings
