"""What `lorascope analyze PATH` loads: PATH becomes an EvidenceBundle."""
from __future__ import annotations

from pathlib import Path

from lorascope.errors import BadInputError
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.rundir.reader import load_run
from lorascope.rundir.schema import MANIFEST_FILE


def load_bundle(path: Path) -> EvidenceBundle:
    """Load PATH (a run directory) with everything the detectors can use."""
    if not path.exists():
        raise BadInputError(f"{path}: no such file or directory")
    if path.is_dir() and not (path / MANIFEST_FILE).exists():
        raise BadInputError(f"{path} is not a lorascope run directory (no {MANIFEST_FILE})")
    run = load_run(path)
    return EvidenceBundle(path=path, run=run, warnings=list(run.warnings))
