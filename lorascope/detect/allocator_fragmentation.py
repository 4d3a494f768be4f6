"""allocator-fragmentation: memory is reserved but cut into pieces too small to use.

The caching allocator keeps freed blocks for reuse; a request it cannot fit in any one
free block makes it ask the driver for a new segment, or fail, even when the cached
free bytes add up to more than the request. Evidence, surest first:

- an allocator snapshot with an OOM where the cache (reserved - allocated) held at least
  the request but its largest free block was smaller (high);
- the OOM message's "reserved by PyTorch but unallocated" at least as large as the
  request (medium: the message has no block sizes);
- a snapshot whose cache is at least :data:`MIN_CACHE_SHARE` of the reservation and
  scattered (fragmentation >= :data:`MIN_FRAGMENTATION`), without an OOM (medium);
- DeepSpeed's "pytorch allocator cache flushes since last step" (low on its own: memory
  pressure, of which fragmentation is the usual cause).

The fix depends on ``expandable_segments``, read from the snapshot's allocator settings.
"""

from __future__ import annotations

from lorascope.detect.finding import Evidence, Finding
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.ingest.logs.reader import CacheFlushes, OomReport
from lorascope.ingest.snapshot.types import SnapshotAnalysis
from lorascope.units import fmt_bytes

ID = "allocator-fragmentation"
MIN_CACHE_SHARE = 0.3
MIN_FRAGMENTATION = 0.5
MIN_CACHE_BYTES = 256 * 2**20

FIX = (
    "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (segments grow in place, so freed memory can be "
    "reused for larger requests); keep allocation sizes steady across steps (pad or bucket sequence lengths); "
    "call torch.cuda.empty_cache() at the same point on every rank only as a last resort"
)
FIX_EXPANDABLE_ON = (
    "expandable_segments is already on: make allocation sizes steadier across steps (pad or "
    "bucket sequence lengths), lower the micro-batch, or set max_split_size_mb to keep large "
    "blocks from being split"
)


def _fix(snap: SnapshotAnalysis | None) -> str:
    return FIX_EXPANDABLE_ON if snap is not None and snap.settings.expandable_segments else FIX


def _from_snapshot(rank: int, snap: SnapshotAnalysis) -> Finding | None:
    device = snap.main
    if device is None:
        return None
    st = device.state
    settings = Evidence(
        "expandable_segments",
        {True: "on", False: "off", None: "unknown"}[snap.settings.expandable_segments],
        f"{snap.path}: allocator_settings",
    )
    frag = [
        Evidence(
            "at the snapshot",
            f"reserved {fmt_bytes(st.reserved)}, allocated {fmt_bytes(st.allocated)}, "
            f"cached free {fmt_bytes(st.inactive)} in pieces of at most "
            f"{fmt_bytes(st.largest_free_block)} (fragmentation {st.fragmentation:.0%})",
            f"{snap.path}: segments",
        )
    ]
    for oom in device.ooms:
        cached = (oom.live.reserved or 0) - oom.live.allocated
        if cached >= oom.requested > st.largest_free_block:
            src = f"{snap.path}: device_traces[{device.device}][{oom.index}]"
            return Finding(
                id=ID,
                title=f"rank {rank}: the OOM for {fmt_bytes(oom.requested)} came with {fmt_bytes(cached)} "
                f"cached but no free block larger than {fmt_bytes(st.largest_free_block)}",
                severity="error",
                confidence="high",
                confidence_reason="the snapshot shows the cache held more than the request, in smaller pieces",
                ranks=[rank],
                evidence=[
                    Evidence("request that failed", fmt_bytes(oom.requested), src),
                    Evidence(
                        "reserved but unallocated at the OOM",
                        fmt_bytes(cached),
                        f"{snap.path} (trace replayed to entry {oom.index})",
                    ),
                ]
                + frag
                + [settings],
                explanation="The memory was there, but not in one piece: freed blocks of many sizes were cached "
                "and none fitted the request, and the device had no room for a new segment.",
                fix=_fix(snap),
                details={"fragmentation": st.fragmentation, "cached": cached},
            )
    if (
        st.reserved
        and st.inactive >= max(MIN_CACHE_BYTES, MIN_CACHE_SHARE * st.reserved)
        and st.fragmentation >= MIN_FRAGMENTATION
    ):
        return Finding(
            id=ID,
            title=f"rank {rank}: {st.inactive / st.reserved:.0%} of the reserved memory is cached in "
            f"scattered free blocks",
            severity="warning",
            confidence="medium",
            confidence_reason="a scattered cache at the snapshot; no OOM recorded to show it mattered",
            ranks=[rank],
            evidence=frag + [settings],
            explanation="Cached free memory that is scattered can only serve small requests; large ones then need "
            "new segments, and with little headroom they fail.",
            fix=_fix(snap),
            details={"fragmentation": st.fragmentation},
        )
    return None


def _from_log_oom(path: str, report: OomReport, snap: SnapshotAnalysis | None) -> Finding:
    who = f"rank {report.rank}" if report.rank is not None else "a rank"
    src = f"{path}:{report.line}"
    return Finding(
        id=ID,
        title=f"{who}: OOM for {fmt_bytes(report.requested)} with {fmt_bytes(report.reserved_unallocated)} "
        "reserved but unallocated",
        severity="error",
        confidence="medium",
        confidence_reason="torch's OOM message: the cache held more than the request; the message has no block "
        "sizes to show the pieces",
        ranks=[report.rank] if report.rank is not None else [],
        evidence=[
            Evidence("request that failed", fmt_bytes(report.requested), src),
            Evidence("reserved but unallocated", fmt_bytes(report.reserved_unallocated), src),
        ],
        explanation="PyTorch had reserved more than the request but could not use it: the cached memory was in "
        "blocks too small for it.",
        fix=_fix(snap),
    )


def _flush_evidence(path: str, flushes: list[CacheFlushes]) -> list[Evidence]:
    return [
        Evidence(
            "allocator cache flushes since last step" + (f" (rank {c.rank})" if c.rank is not None else ""),
            c.flushes,
            f"{path}:{c.line}",
        )
        for c in flushes[:5]
    ]


def detect(bundle: EvidenceBundle) -> list[Finding]:
    by_rank: dict[int, Finding] = {}
    findings: list[Finding] = []
    for rank, snap in sorted(bundle.snapshots.items()):
        finding = _from_snapshot(rank, snap)
        if finding is not None:
            findings.append(finding)
            by_rank[rank] = finding
    any_snapshot = next(iter(bundle.snapshots.values()), None)
    for log in bundle.logs:
        for report in log.ooms:
            if (
                report.rank in by_rank
                or report.requested is None
                or report.reserved_unallocated is None
                or report.reserved_unallocated < report.requested
            ):
                continue
            finding = _from_log_oom(str(log.path), report, any_snapshot)
            findings.append(finding)
            if report.rank is not None:
                by_rank[report.rank] = finding
        loose = []
        for c in log.cache_flushes:  # evidence for a finding on the same rank, else one of their own
            if c.rank in by_rank:
                by_rank[c.rank].evidence.extend(_flush_evidence(str(log.path), [c]))
            else:
                loose.append(c)
        if loose:
            findings.append(
                Finding(
                    id=ID,
                    title=f"DeepSpeed flushed the allocator cache {sum(c.flushes for c in loose)} times "
                    f"(in {len(loose)} steps)",
                    severity="warning",
                    confidence="low",
                    confidence_reason="cache flushes show memory pressure; fragmentation is the usual cause, but the "
                    "log alone cannot show the pieces",
                    ranks=sorted({c.rank for c in loose if c.rank is not None}),
                    evidence=_flush_evidence(str(log.path), loose),
                    explanation="When an allocation fails, the allocator frees its cache and retries; DeepSpeed counts "
                    "these flushes. Each one costs a device synchronisation and means the cache was too "
                    "scattered (or memory too tight) for the request.",
                    fix=_fix(any_snapshot),
                )
            )
    return findings
