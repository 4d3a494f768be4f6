"""Allocator snapshots: state, fragmentation, trace replay to the peak and the OOM, sites,
categories, logits-sized blocks, rank-only allocations; odd real-world layouts."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

from lorascope.errors import BadInputError
from lorascope.ingest.snapshot.compare import compare_ranks
from lorascope.ingest.snapshot.reader import analyse_snapshot, read_snapshot
from tests.helpers import fixture_script

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "snapshots"
MiB = 1 << 20


build = fixture_script("snapshots/build.py")


def _raw(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        return pickle.load(f)  # our own fixture: the reference reading


def test_lora_oom_rank0_state_peak_and_oom() -> None:
    path = FIXTURES / "lora-oom" / "rank-0.pickle"
    raw = _raw(path)
    snap = read_snapshot(path, 0)
    assert snap.warnings == [] and snap.settings.present and snap.settings.expandable_segments is False
    assert snap.other_keys == []
    dev = snap.main
    assert dev is not None
    blocks = [b for s in raw["segments"] for b in s["blocks"]]
    assert dev.state.reserved == sum(s["total_size"] for s in raw["segments"])
    assert dev.state.allocated == sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    assert dev.state.largest_free_block == max(b["size"] for b in blocks if b["state"] == "inactive")
    assert dev.trace_entries == len(raw["device_traces"][0]) == 60
    assert dev.trace_starts_mid_run and dev.allocated_before_trace > 0
    assert dev.trace_vs_segments == 0

    logits = build.LOGITS_ELEMENTS
    (oom,) = dev.ooms
    assert oom.requested == logits * 4 and oom.device_free == 64 * MiB
    assert oom.live.by_category["logits"] == logits * (2 + 4 + 4)
    assert oom.live.by_category["weights"] == 8 * 48 * MiB + 16 * 256 * 1024
    assert oom.live.by_category["optimizer"] == 16 * 512 * 1024
    assert "evaluate" in " ".join(s for g in oom.live.by_stack for s in g.stack)
    assert dev.peak is not None and dev.peak.allocated >= dev.state.allocated
    assert dev.peak.annotations == ["ProfilerStep#1", "loss"]
    sites = {g.site for g in dev.peak.by_site if g.category == "logits"}
    assert "transformers/loss/loss_utils.py:36 in fixed_cross_entropy" in sites
    notes = {b.bytes: b.note for b in dev.logits_blocks}
    assert notes[logits * 2] == "same size as the loss's logits"  # the bf16 lm_head output, by size
    assert notes[logits * 4] == ""


def test_rank0_only_allocations_across_ranks() -> None:
    snaps = {r: read_snapshot(FIXTURES / "lora-oom" / f"rank-{r}.pickle", r) for r in (0, 1)}
    cmp = compare_ranks(snaps)
    assert cmp is not None and cmp.points == {0: "peak", 1: "peak"}
    rank0 = [a for a in cmp.rank_only if a.rank == 0]
    assert len(rank0) == 1 and rank0[0].only_here and rank0[0].bytes == 40 * MiB
    assert any("in evaluate" in s for s in rank0[0].stack)
    assert compare_ranks({0: snaps[0]}) is None


def test_fragmented_cache() -> None:
    snap = read_snapshot(FIXTURES / "fragmented" / "rank-0.pickle", 0)
    dev = snap.main
    assert dev is not None and not dev.trace_starts_mid_run
    assert dev.state.fragmentation > 0.9 and dev.state.inactive == dev.state.reserved - dev.state.allocated
    assert dev.state.allocated == 45 * (2 * MiB - 512)
    (oom,) = dev.ooms
    assert (oom.live.reserved or 0) - oom.live.allocated >= oom.requested > dev.state.largest_free_block


def _alloc_snapshot() -> dict[str, Any]:
    a = build.Allocator()
    keep = [a.alloc(4 * MiB, "activations") for _ in range(3)]
    a.free(keep[0])
    return a.snapshot()


def test_trace_without_segments() -> None:
    data = _alloc_snapshot()
    data["segments"] = []
    dev = analyse_snapshot(data, Path("t.pickle")).main
    assert dev is not None and dev.peak is not None
    assert dev.peak.allocated == 12 * MiB and dev.trace_vs_segments is None and dev.peak.reserved is None


def test_legacy_list_of_segments_with_history() -> None:
    data = _alloc_snapshot()
    for seg in data["segments"]:
        for block in seg["blocks"]:
            block["history"] = [
                {"addr": block.pop("address"), "real_size": block["size"], "frames": block.pop("frames")}
            ]
            if block["state"] == "inactive" and block is seg["blocks"][-1]:
                block["state"] = "active_pending_free"
    snap = analyse_snapshot(data["segments"], Path("old.pickle"))
    dev = snap.main
    assert dev is not None and dev.trace_entries == 0 and dev.peak is None
    assert dev.state.allocated == 8 * MiB and dev.state.active > dev.state.allocated
    assert {g.category for g in dev.state.by_site} == {"activations"}
    assert snap.settings.present is False


def test_inconsistent_and_odd_files_are_analysed_with_warnings() -> None:
    data = _alloc_snapshot()
    data["segments"][0]["blocks"][0]["size"] += 512  # blocks no longer add up
    data["device_traces"][0][1:1] = ["junk", {"action": "alloc"}, {"action": "free_completed", "addr": 1, "size": 8}]
    data["compile_context"] = "whatever a newer torch adds"
    snap = analyse_snapshot(data, Path("odd.pickle"))
    assert snap.other_keys == ["compile_context"]
    text = " ".join(snap.warnings)
    assert "do not add up" in text and "2 trace entries" in text
    assert snap.main is not None and snap.main.trace_starts_mid_run  # the free of an unknown address


@pytest.mark.parametrize("data", [{"entries": []}, [1, 2, 3], "text", {"version": 1}])
def test_not_a_snapshot(data: Any) -> None:
    with pytest.raises(BadInputError, match="not an allocator snapshot"):
        analyse_snapshot(data, Path("x.pickle"))
