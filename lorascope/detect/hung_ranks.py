"""hung-ranks: the job stopped making progress, and why (other than a rank-conditional
collective, which rank-conditional-hang names): a rank that died while the others wait,
a rank stuck in its own code outside any collective, a straggler, or a collective that
is itself stuck. The diagnosis is lorascope.detect.hang.diagnosis's, the same `lorascope hang`
prints live; here it runs on the dumps the stall watchdog left in the run directory.
"""

from __future__ import annotations

from typing import Any

from lorascope.detect.common import stream_source
from lorascope.detect.finding import Evidence, Finding
from lorascope.detect.hang.diagnosis import diagnose
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.rundir.ending import ending_of
from lorascope.rundir.reader import RunData

ID = "hung-ranks"


def liveness(run: RunData) -> dict[int, bool]:
    """Once every launcher has ended, a rank without an end record died without a word."""
    launches = run.manifest["launches"]
    if launches and all(launch["end"] is not None for launch in launches):
        return {n: False for n, r in run.ranks.items() if not ending_of(r).known}
    return {}


def hang_finding(run: RunData, diagnosis: dict[str, Any]) -> Finding:
    """The diagnosis as a Finding (also what `lorascope hang` adds to its report)."""
    evidence = [
        Evidence(
            f"rank {s['rank']} ({s['state']})",
            s["where"] or s["state"],
            stream_source(run, run.ranks[s["rank"]], f"dump: {s['dumped']}" if s["dumped"] else "coll records"),
        )
        for s in diagnosis["ranks"]
    ]
    stalls = [r for r in run.ranks.values() if r.stall]
    if stalls:
        s = stalls[0].stall
        assert s is not None
        evidence.append(
            Evidence(
                "stall watchdog",
                f"no step for {s['seconds']:.0f} s (limit {s['limit']:.0f} s) after step {s['step']}",
                stream_source(run, stalls[0], "stall record"),
            )
        )
    dumped = any(s["dumped"] for s in diagnosis["ranks"])
    return Finding(
        id=ID,
        title=diagnosis["verdict"],
        severity="error",
        confidence="high" if dumped and diagnosis["kind"] != "unknown" else "medium",
        confidence_reason=(
            "every rank's stack and pending collectives were dumped while it hung"
            if dumped
            else "from the ranks' streams only (no dump taken while it hung)"
        ),
        ranks=diagnosis["odd_ranks"] or [s["rank"] for s in diagnosis["ranks"]],
        evidence=evidence,
        explanation=(
            "A distributed job hangs when one rank stops taking part in the collectives the others "
            "wait in. Nothing is logged until the process-group watchdog (30 minutes by default) "
            "kills it with a message naming a sequence number and no rank or line."
        ),
        fix=diagnosis["fix"],
        details={"hang": diagnosis},
    )


def detect(bundle: EvidenceBundle) -> list[Finding]:
    run = bundle.run
    if run is None or len(run.ranks) < 2:
        return []
    stalled = any(r.dumps or r.stall for r in run.ranks.values())
    waiting = any(c.pending for r in run.ranks.values() for c in r.collectives)
    if not (stalled or waiting):
        return []
    diagnosis = diagnose(run, liveness(run))
    if diagnosis["kind"] in ("rank-conditional", "unknown"):
        return []  # rank-conditional-hang names the first; the second has nothing to say
    return [hang_finding(run, diagnosis)]
