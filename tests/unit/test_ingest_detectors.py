"""The artifact-only detectors (oom, allocator-fragmentation, collective-mismatch,
straggler) on the recorded artifacts, and their silence on healthy ones."""

from __future__ import annotations

from pathlib import Path

from lorascope.detect import allocator_fragmentation, collective_mismatch, oom, straggler
from lorascope.ingest.load import load_bundle

FIX = Path(__file__).resolve().parents[2] / "fixtures"


def test_oom_names_what_held_the_memory() -> None:
    bundle = load_bundle(FIX / "snapshots" / "lora-oom", hta=False)
    (finding,) = oom.detect(bundle)
    assert finding.ranks == [0] and finding.severity == "error" and finding.confidence == "high"
    assert "logits" in finding.title and "cross-entropy" in finding.fix
    labels = {e.label for e in finding.evidence}
    assert {"request that failed", "by category", "other processes on the GPU"} <= labels  # snapshot + log


def test_oom_from_the_log_alone() -> None:
    bundle = load_bundle(FIX / "snapshots" / "lora-oom" / "job.log")
    (finding,) = oom.detect(bundle)
    assert finding.confidence == "medium" and finding.ranks == [0] and "set_device" in finding.fix


def test_fragmentation_from_the_snapshot_and_from_the_log() -> None:
    (snap,) = allocator_fragmentation.detect(load_bundle(FIX / "snapshots" / "fragmented"))
    assert snap.confidence == "high" and "expandable_segments:True" in snap.fix
    (from_log,) = allocator_fragmentation.detect(load_bundle(FIX / "snapshots" / "lora-oom" / "job.log"))
    assert from_log.confidence == "medium" and from_log.ranks == [0]  # reserved-but-unallocated >= request
    assert any(e.label.startswith("allocator cache flushes") for e in from_log.evidence)


def test_collective_mismatch_but_not_for_the_rank_conditional_hang() -> None:
    (finding,) = collective_mismatch.detect(load_bundle(FIX / "flight-recorder" / "dtype-mismatch"))
    assert finding.ranks == [0, 1] and finding.details["seq"] == 4 and finding.details["kind"] == "size+dtype"
    assert collective_mismatch.detect(load_bundle(FIX / "flight-recorder" / "rank0-extra-allreduce")) == []
    assert collective_mismatch.detect(load_bundle(FIX / "flight-recorder" / "healthy")) == []


def test_collective_mismatch_names_the_call_site_past_the_wrappers() -> None:
    """The mismatched call's site is the flight reader's call site: past typing_extensions'
    ``@deprecated`` wrapper (ZeRO's all_gather_into_tensor / reduce_scatter_tensor in torch
    2.13) and torch's module-call machinery (FSDP), not the first frame outside
    torch.distributed, which named them."""
    bundle = load_bundle(FIX / "flight-recorder" / "dtype-mismatch")
    wrappers = ["typing_extensions.py:3140 in wrapper", "torch/nn/modules/module.py:1786 in _call_impl"]
    for dump in bundle.flight_records.values():
        for entry in dump.entries:
            entry.frames[2:2] = wrappers
    (finding,) = collective_mismatch.detect(bundle)
    text = " ".join(str(e.value) for e in finding.evidence)
    assert "record.py:65 in rank_main" in text and "typing_extensions" not in text and "_call_impl" not in text


def test_healthy_artifacts_raise_nothing() -> None:
    for path in (FIX / "healthy", FIX / "flight-recorder" / "healthy"):
        bundle = load_bundle(path, hta=False)
        for detector in (oom, allocator_fragmentation, collective_mismatch, straggler):
            assert detector.detect(bundle) == [], (path, detector.__name__)
