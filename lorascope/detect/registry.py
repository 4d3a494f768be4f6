"""The one list of detectors, and running them."""

from __future__ import annotations

from collections.abc import Callable

from lorascope.detect import (
    allocator_fragmentation,
    collective_mismatch,
    failed_after_exit,
    hung_ranks,
    job_slowdown,
    logits_spike,
    oom,
    plan_deviation,
    probes_off,
    rank0_asymmetry,
    rank_conditional_hang,
    reentrant_dead_grads,
    sharding_not_applied,
    slow_steps,
    straggler,
    tiny_kernel_tail,
    unobserved_ranks,
)
from lorascope.detect.finding import CONFIDENCE_ORDER, SEVERITY_ORDER, Finding
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.rundir.loading.reader import Progress

Detector = Callable[[EvidenceBundle], list[Finding]]

#: Every detector module, in the order of precedence of their findings: at equal
#: severity, the earlier one's finding comes first. The order follows what explains how
#: a run ended: a hang (the cause, then who waits where), a crash (collectives that
#: disagree, a backward that fails), out of memory (its specific causes before the plain
#: OOM record, which says what held the memory), then what costs time or memory without
#: failing the run (a rank that keeps memory the others free, the logits, plan deviations,
#: a sharding asked for and not applied, a straggler, a rank or group that set the pace for a
#: stretch, the whole job slowing, a launch-bound step). docs/detectors.md, "Severity and order".
MODULES = [
    rank_conditional_hang,
    hung_ranks,
    collective_mismatch,
    reentrant_dead_grads,
    rank0_asymmetry,
    allocator_fragmentation,
    logits_spike,
    plan_deviation,
    oom,
    failed_after_exit,
    sharding_not_applied,
    straggler,
    slow_steps,
    job_slowdown,
    tiny_kernel_tail,
    unobserved_ranks,
    probes_off,
]
#: Every detector, in the order they run. Each is a pure function of the bundle.
DETECTORS: list[Detector] = [m.detect for m in MODULES]
PRECEDENCE: dict[str, int] = {m.ID: i for i, m in enumerate(MODULES)}


def verdict_order(finding: Finding) -> tuple[int, int, int]:
    """The sort key of findings: most severe first (severity says consequence: an error
    explains how the run failed), then by detector precedence, then surest first. The
    first finding is the top verdict."""
    return (
        -SEVERITY_ORDER[finding.severity],
        PRECEDENCE.get(finding.id, len(PRECEDENCE)),
        -CONFIDENCE_ORDER[finding.confidence],
    )


def run_detectors(
    bundle: EvidenceBundle, detectors: list[Detector] | None = None, progress: Progress | None = None
) -> list[Finding]:
    """All findings, in verdict order (:func:`verdict_order`). A detector that crashes
    on odd data becomes a warning on the bundle, never a failed analysis."""
    findings: list[Finding] = []
    chosen = DETECTORS if detectors is None else detectors
    for done, detector in enumerate(chosen, 1):
        if progress is not None:
            progress("running detectors", done, len(chosen))
        try:
            findings.extend(detector(bundle))
        except Exception as exc:
            bundle.warnings.append(
                f"detector {detector.__module__}.{detector.__name__} failed: {exc.__class__.__name__}: {exc}"
            )
    return sorted(findings, key=verdict_order)
