"""straggler: one rank computes longer than the others, who wait for it at every collective.

Evidence: the ranks' kernel traces compared (``kineto_ranks``): compute time per step
at least 1.1x the other ranks' median, and the least time in communication (it arrives
last, so it waits least). Confidence is medium when every rank's trace is there, low
when only some are (a straggler among the ranks not traced would go unseen).
"""

from __future__ import annotations

from lorascope.detect.finding import Evidence, Finding
from lorascope.ingest.evidence import EvidenceBundle

ID = "straggler"


def detect(bundle: EvidenceBundle) -> list[Finding]:
    cmp = bundle.trace_comparison
    if cmp is None or cmp.straggler is None:
        return []
    partial = cmp.world_size is not None and cmp.world_size > len(cmp.ranks)
    evidence = [
        Evidence(
            f"rank {t.rank}",
            f"compute {t.compute_us / 1000:.1f} ms, communication "
            f"{t.comm_us / 1000:.1f} ms over {t.steps or '?'} steps",
            str(bundle.traces[t.rank].path),
        )
        for t in cmp.ranks
    ]
    return [
        Finding(
            id=ID,
            title=f"rank {cmp.straggler} is the straggler: the other ranks wait for it at the collectives",
            severity="warning",
            confidence="low" if partial else "medium",
            confidence_reason=cmp.reason + ("; only some ranks' traces were given" if partial else ""),
            ranks=[cmp.straggler],
            evidence=evidence,
            explanation="In synchronous data parallelism every step runs at the pace of the slowest rank. Its extra "
            "compute shows as extra communication time on all the others.",
            fix="look for what this rank does more (rank-0 logging, eval, checkpoint writing, a slower GPU or a "
            "throttled one, a different data shard with longer sequences) and even it out",
            details={"ranks": [t.rank for t in cmp.ranks]},
        )
    ]
