"""probes-off: a probe that switched itself off in a rank is named with what is missing
from then on and which detectors read it (lorascope/detect/probes_off.py). The real
case, a job whose memory probe fails: tests/unit/test_probes.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lorascope.detect import probes_off
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.rundir.loading.reader import RankData, RunData


def rank(n: int, *errors: tuple[str, str, float]) -> RankData:
    steps: list[dict[str, Any]] = [{"k": "step", "step": i + 1, "dur": 0.1, "t": 100.0 + i} for i in range(5)]
    return RankData(
        rank=n,
        start={"rank": n, "pid": n, "host": "h", "world_size": 8},
        files=[],
        steps=steps,
        probe_errors=[{"k": "probe_error", "probe": p, "error": e, "t": t} for p, e, t in errors],
    )


def findings(*ranks: RankData) -> list:
    run = RunData(path=Path("/run"), manifest={}, ranks={r.rank: r for r in ranks}, warnings=[])
    return probes_off.detect(EvidenceBundle(path=run.path, run=run))


def test_a_probe_that_feeds_detectors_is_a_warning_saying_when_it_stopped() -> None:
    (found,) = findings(rank(0, ("memory", "OSError: [Errno 5] /proc unreadable", 102.5)), rank(1))
    assert found.ranks == [0] and found.severity == "warning" and found.confidence == "high"
    assert found.title.startswith("the memory probe switched off on rank 0 (OSError: [Errno 5] /proc unreadable)")
    assert "rank0-asymmetry" in found.title and "saw only part of the run" in found.title
    assert found.evidence[0].value.startswith("switched off after 3 step(s): OSError")


def test_many_ranks_alike_one_row_and_install_failures_count_as_their_probe() -> None:
    ranks = [
        rank(n, ("steps-deepspeed-install", f"AttributeError: no attribute 'step' (pid {n})", 99.0)) for n in range(8)
    ]
    (found,) = findings(*ranks)
    assert found.ranks == list(range(8)) and found.title.startswith(
        "the steps-deepspeed-install probe switched off on ranks 0-7"
    )
    assert "step times and losses missing" in found.title and "straggler" in found.title
    assert len(found.evidence) == 1  # the eight alike but for their numbers


def test_a_probe_no_detector_reads_is_a_note_and_no_failure_nothing() -> None:
    (found,) = findings(rank(0, ("dumps", "attached after threads started: no on-demand dumps", 99.0)))
    assert found.severity == "info" and "saw only part" not in found.title
    assert findings(rank(0), rank(1)) == []
