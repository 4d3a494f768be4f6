"""The recorded run-directory fixtures (real 2-rank CPU runs, fixtures/record_runs.py):
each failure mode's run is named by its own detector first; the healthy run by none."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorascope.detect.registry import run_detectors
from lorascope.ingest.load import load_bundle

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
RUNS = sorted(p.parent.name for p in FIXTURES.glob("*/manifest.json"))
FIVE = {"rank0-asymmetry", "logits-spike", "reentrant-dead-grads", "rank-conditional-hang", "tiny-kernel-tail"}


@pytest.mark.parametrize("name", RUNS)
def test_fixture_run_is_named_by_its_detector(name: str) -> None:
    findings = run_detectors(load_bundle(FIXTURES / name))
    if name == "healthy":
        assert not {f.id for f in findings} & (FIVE | {"hung-ranks"})
    else:
        assert findings and findings[0].id == name
        assert findings[0].confidence == "high"


def test_every_failure_mode_has_a_fixture() -> None:
    assert FIVE | {"healthy", "hung-ranks"} <= set(RUNS)


def test_flight_recorder_dumps_alone_name_the_rank_conditional_collective() -> None:
    """Real gloo dumps of the planted hang (fixtures/flight-recorder/record.py), no run dir."""
    [finding] = [
        f
        for f in run_detectors(load_bundle(FIXTURES / "flight-recorder" / "rank0-extra-allreduce"))
        if f.id == "rank-conditional-hang"
    ]
    assert finding.details["seq"] == 4 and finding.details["source"] == "flight recorder"
    ops = " ".join(str(e.value) for e in finding.evidence)
    assert "all_reduce" in ops and "barrier" in ops
    recorded = FIXTURES / "flight-recorder" / "record.py"
    if any(str(recorded) in str(e.source) for e in finding.evidence):  # the dumps' paths exist here
        assert finding.ranks == [0] and finding.confidence == "high"


def test_snapshots_alone_feed_the_memory_detectors() -> None:
    """Two ranks' allocator snapshots at an OOM (fixtures/snapshots/build.py): the logits
    blocks in the loss frames, and what rank 0 alone holds."""
    findings = {f.id: f for f in run_detectors(load_bundle(FIXTURES / "snapshots" / "lora-oom"))}
    logits = findings["logits-spike"]
    assert logits.details["source"] == "snapshot"
    assert logits.details["logits_bytes"] == 2 * 262_144_000 + 131_072_000
    asym = findings["rank0-asymmetry"]
    assert asym.ranks == [0] and "activations" in asym.title
