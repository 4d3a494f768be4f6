"""One analysis, the path every command takes: load -> detect -> summarise.

:func:`analyze` (a path) and :func:`of_run` (a run already in memory, as `lorascope hang`
has it) return an :class:`Analysis`: the evidence, the findings and the per-rank summary,
each computed once. The CLI prints it (:mod:`lorascope.text`), the report renders it
(:mod:`lorascope.report`), the gallery and the tests use the same function.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorascope.analysis.artifacts import artifacts_data
from lorascope.analysis.summary import build_summary
from lorascope.detect import pace
from lorascope.detect.finding import Finding
from lorascope.detect.hang.diagnosis import FlightTimeline
from lorascope.detect.registry import run_detectors
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.ingest.load import bundle_of_run, load_bundle
from lorascope.rundir.loading.cluster import Cluster
from lorascope.rundir.loading.reader import Progress, RunData, no_cycle_collection


@dataclass
class Analysis:
    bundle: EvidenceBundle
    #: Most severe and surest first.
    findings: list[Finding]
    #: The per-rank summary (:func:`build_summary`) when the evidence holds a run directory.
    summary: dict[str, Any] | None

    def to_data(self) -> dict[str, Any]:
        """What `lorascope analyze --json` prints: the summary, the reading warnings, the
        loaded artifacts, the findings and the pace (who set each step's pace, the blame per
        collective: :func:`lorascope.detect.pace.summary`), as plain data."""
        data = dict(self.summary) if self.summary is not None else {"ranks": []}
        data["warnings"] = self.bundle.warnings
        data["artifacts"] = artifacts_data(self.bundle, self.findings)
        data["findings"] = [f.to_dict() for f in self.findings]
        data["pace"] = pace.summary(self.bundle.run) if self.bundle.run is not None else None
        return data


def of_bundle(bundle: EvidenceBundle, progress: Progress | None = None) -> Analysis:
    with no_cycle_collection():
        findings = run_detectors(bundle, progress=progress)
        summary = build_summary(bundle.run) if bundle.run is not None else None
    return Analysis(bundle=bundle, findings=findings, summary=summary)


def analyze(
    path: Path,
    kind: str | None = None,
    hta: bool | None = False,
    progress: Progress | None = None,
    cluster: Cluster | None = None,
) -> Analysis:
    """Analyse PATH: a run directory, one artifact, or a folder of one job's artifacts
    (see :func:`lorascope.ingest.load.load_bundle`; ``kind`` forces the reader, ``hta``
    adds HolisticTraceAnalysis figures to GPU traces, None: when installed; ``progress``
    is told how far reading and detecting have come; ``cluster`` reads a run directory's
    streams on a Dask cluster)."""
    return of_bundle(load_bundle(path, kind=kind, hta=hta, progress=progress, cluster=cluster), progress)


def of_run(run: RunData, path: Path, flight: FlightTimeline | None = None) -> Analysis:
    """An analysis of a run directory already loaded (`lorascope hang` reloads the live
    run while it waits for the ranks' dumps; ``flight``: the flight-recorder dumps its
    verdict went by, read already)."""
    return of_bundle(bundle_of_run(run, path, flight))
