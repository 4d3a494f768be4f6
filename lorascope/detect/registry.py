"""The one list of detectors, and running them."""

from __future__ import annotations

from collections.abc import Callable

from lorascope.detect import (
    allocator_fragmentation,
    collective_mismatch,
    hung_ranks,
    logits_spike,
    oom,
    plan_deviation,
    rank0_asymmetry,
    rank_conditional_hang,
    reentrant_dead_grads,
    straggler,
    tiny_kernel_tail,
)
from lorascope.detect.finding import Finding
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.rundir.reader import Progress

Detector = Callable[[EvidenceBundle], list[Finding]]

#: Every detector, in the order they run. Each is a pure function of the bundle.
DETECTORS: list[Detector] = [
    rank_conditional_hang.detect,
    hung_ranks.detect,
    reentrant_dead_grads.detect,
    logits_spike.detect,
    rank0_asymmetry.detect,
    tiny_kernel_tail.detect,
    plan_deviation.detect,
    oom.detect,
    allocator_fragmentation.detect,
    collective_mismatch.detect,
    straggler.detect,
]


def run_detectors(
    bundle: EvidenceBundle, detectors: list[Detector] | None = None, progress: Progress | None = None
) -> list[Finding]:
    """All findings, most severe and surest first. A detector that crashes on odd data
    becomes a warning on the bundle, never a failed analysis."""
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
    return sorted(findings, key=Finding.sort_key)
