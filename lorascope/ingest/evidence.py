"""Everything loaded for one analysis, from a run directory or from loose artifacts.

Each field is filled by a reader in ``lorascope.ingest``; a detector uses whichever
kinds of evidence are present and says how sure it is accordingly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorascope.rundir.reader import RunData


@dataclass
class EvidenceBundle:
    path: Path
    #: A lorascope run directory, when PATH is one (or holds one).
    run: RunData | None = None
    #: Allocator snapshots (``torch.cuda.memory._dump_snapshot`` pickles), by rank.
    snapshots: dict[int, Any] = field(default_factory=dict)
    #: Kineto Chrome-trace JSON files, by rank.
    traces: dict[int, Any] = field(default_factory=dict)
    #: Flight-recorder dumps, by rank.
    flight_records: dict[int, Any] = field(default_factory=dict)
    #: Parsed job logs.
    logs: list[Any] = field(default_factory=list)
    #: What the readers could not read or had to skip (one line each).
    warnings: list[str] = field(default_factory=list)
