"""unobserved-ranks: ranks of the job's world that wrote no stream. Every verdict is read
from the ranks that did; of the others the run directory knows nothing, so "no problem
found" would be a clean bill for ranks nobody watched. The world size is what the
observed ranks recorded (their ``start`` records).
"""

from __future__ import annotations

from lorascope.detect.common import stream_source
from lorascope.detect.finding import Evidence, Finding
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.units import rank_ranges, ranks_named

ID = "unobserved-ranks"

EXPLANATION = (
    "lorascope sees a rank only through the probes its process loads. A rank with no stream "
    "was never probed: its launcher did not pass the bootstrap on (a container or scheduler that "
    "resets the environment, python -I, -E or -S), its node wrote another run directory (every "
    "node's launcher must write the same shared directory, or their ranks/ be copied together), "
    "or it died before importing torch. What the findings say, they say of the observed ranks."
)
FIX = (
    "run every node's launcher under `lorascope run --out` one shared directory (or copy each "
    "node's ranks/ into one) and read the line `lorascope run` ends with: it says which processes "
    "attached, and why none did on a launcher where none did"
)


def detect(bundle: EvidenceBundle) -> list[Finding]:
    run = bundle.run
    size = None if run is None else run.world_size
    if run is None or size is None:
        return []
    absent = sorted(set(range(size)) - set(run.ranks))
    if not absent:
        return []
    first = next(iter(run.ranks.values()))
    who = ranks_named(absent)
    return [
        Finding(
            id=ID,
            title=f"{who} of {size} {'was' if len(absent) == 1 else 'were'} not observed (no stream): "
            f"no verdict covers {'it' if len(absent) == 1 else 'them'}",
            severity="warning",
            confidence="high",
            confidence_reason="the observed ranks recorded the world size; the run directory holds no stream "
            "of the others",
            ranks=absent,
            evidence=[
                Evidence("world size", size, stream_source(run, first, "start record")),
                Evidence("ranks with a stream", rank_ranges(sorted(run.ranks)), "ranks/"),
            ],
            explanation=EXPLANATION,
            fix=FIX,
        )
    ]
