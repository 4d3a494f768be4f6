"""Everything loaded for one analysis, from a run directory or from loose artifacts.

Each field is filled by a reader in ``lorascope.ingest``; a detector uses whichever
kinds of evidence are present and says how sure it is accordingly. The comparisons of
ranks' snapshots and traces are computed once by ``load_bundle`` when two or more ranks'
artifacts of a kind are loaded, so that detectors and renderers share them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorascope.ingest.flight.reader import FlightDump
from lorascope.ingest.kineto.compare import TraceComparison
from lorascope.ingest.kineto.reader import KinetoTrace
from lorascope.ingest.logs.reader import LogAnalysis
from lorascope.ingest.snapshot.compare import SnapshotComparison
from lorascope.ingest.snapshot.types import SnapshotAnalysis
from lorascope.rundir.loading.reader import RunData


@dataclass
class EvidenceBundle:
    path: Path
    #: A lorascope run directory, when PATH is one (or holds one).
    run: RunData | None = None
    #: Allocator snapshots (``torch.cuda.memory._dump_snapshot`` pickles), analysed, by rank.
    snapshots: dict[int, SnapshotAnalysis] = field(default_factory=dict)
    #: Kineto Chrome traces, summarised (``.raw`` keeps the JSON), by rank.
    traces: dict[int, KinetoTrace] = field(default_factory=dict)
    #: Flight-recorder dumps, by rank (of a run directory's rank, the first it wrote).
    flight_records: dict[int, FlightDump] = field(default_factory=dict)
    #: Every flight-recorder dump a run directory's rank wrote that reads, with the time of
    #: its record, oldest first (the hang diagnosis reads the one written with the dump it
    #: reads: :func:`lorascope.detect.hang.diagnosis.flight_at`).
    flight_timeline: dict[int, list[tuple[float, FlightDump]]] = field(default_factory=dict)
    #: Parsed job logs.
    logs: list[LogAnalysis] = field(default_factory=list)
    #: Ranks' snapshots compared (what one rank holds that the others do not).
    snapshot_comparison: SnapshotComparison | None = None
    #: Ranks' traces compared (timing per rank, the straggler).
    trace_comparison: TraceComparison | None = None
    #: Source context of call sites the detectors need ("file:line in func" -> {"line":
    #: text, "conditions": enclosing if/while lines}), read by ingest when the file exists.
    sources: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Views derived from the evidence by the analysis side, computed once on first use and
    #: kept here so that detectors and renderers share them (e.g. the flight-recorder
    #: alignment: :func:`lorascope.detect.hang.flight_align.flight_alignment`).
    derived: dict[str, Any] = field(default_factory=dict)
    #: What the readers could not read or had to skip (one line each).
    warnings: list[str] = field(default_factory=list)
