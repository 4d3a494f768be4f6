"""The GPU fixtures benchmarks/gpu_check.sh records (fixtures/gpu/: real runs of the
probes/ job on a GPU), read on CPU with the same checks the GPU check applied there."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lorascope.detect.registry import run_detectors
from lorascope.ingest.load import load_bundle

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_check  # noqa: E402

GPU = REPO / "fixtures" / "gpu"


def recorded(name: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        not (GPU / name / "manifest.json").is_file(),
        reason=f"fixtures/gpu/{name} not recorded yet: run `bash benchmarks/gpu_check.sh` on a GPU, commit fixtures/gpu/",
    )


@recorded("single")
def test_single_rank_nccl_run() -> None:
    bundle = load_bundle(GPU / "single")
    for check in (
        gpu_check.check_memory_history,
        gpu_check.check_cuda_counters,
        gpu_check.check_nvml,
        gpu_check.check_device_times,
    ):
        ok, detail = check(bundle.run)
        assert ok, f"{check.__name__}: {detail}"
    ok, detail = gpu_check.check_kernel_window(bundle)
    assert ok, detail


@recorded("shared")
def test_two_ranks_sharing_a_gpu() -> None:
    bundle = load_bundle(GPU / "shared")
    ok, detail = gpu_check.check_snapshots(bundle.run, bundle, ("stall", "signal"))
    assert ok, detail
    ok, detail = gpu_check.check_device_times(bundle.run)
    assert ok, detail
    ok, detail = gpu_check.check_finding(run_detectors(bundle), "rank0-asymmetry", "on rank 0 only", "gather_to_rank0")
    assert ok, detail


@recorded("oom")
def test_planted_oom() -> None:
    bundle = load_bundle(GPU / "oom")
    ok, detail = gpu_check.check_oom(bundle.run, bundle, run_detectors(bundle))
    assert ok, detail
