"""The GPU fixtures benchmarks/gpu_check.sh records (fixtures/gpu/: real runs of the
probes/ job on a GPU), read on CPU with the same checks the GPU check applied there."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lorascope.detect.plan_deviation import CUDA_TOLERANCE, check_rank
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


# -- what the first GPU check found wrong, held on its recordings -------------------------


@recorded("healthy")
def test_healthy_gpu_run_raises_no_warning() -> None:
    """A healthy 1-rank job on the H200: plan-deviation called its two 32 MiB cuBLAS
    workspaces a deviation (66.8 MiB measured, 2.5 MiB planned, 64 MiB allowed over)."""
    bundle = load_bundle(GPU / "healthy")
    findings = run_detectors(bundle)
    assert [f.id for f in findings if f.severity in ("warning", "error")] == []
    assert bundle.run is not None
    check = check_rank(bundle.run.ranks[0], bundle.run)
    assert check is not None and check.memory == "CUDA allocated"
    # clear of the edge, not just under it: a second healthy run read 64 KiB less and passed
    cuda = [c for c in check.comparisons if c.tolerance == CUDA_TOLERANCE]
    assert len(cuda) >= 3 and all(c.excess < -32 * 2**20 for c in cuda), [(c.key, c.excess) for c in cuda]


@recorded("shared")
def test_shared_gpu_stall_named_and_gathers_not_a_mismatch() -> None:
    """The flight recorder lists a gather's outputs on the root only: every gather read as
    a size mismatch (an error). And under a virtual environment in /opt/torch/.venv every
    frame read as torch's, so the stalled rank's own code was never found."""
    bundle = load_bundle(GPU / "shared")
    findings = {f.id: f for f in run_detectors(bundle)}
    assert "collective-mismatch" not in findings
    hung = findings["hung-ranks"]
    assert hung.severity == "warning" and hung.ranks == [1]
    assert "rank 1 is stuck outside any collective" in hung.title and "gpu_job.py:66 in after_step" in hung.title
    assert not [w for w in bundle.warnings if "replaying the trace" in w]


@recorded("oom")
def test_planted_oom_reads_the_cap_and_the_logits() -> None:
    """The OOM under set_per_process_memory_fraction: the cap is named (the device had
    138.5 GiB free), the logits-sized block is logits, and no probe frame is a site."""
    bundle = load_bundle(GPU / "oom")
    oom = next(f for f in run_detectors(bundle) if f.id == "oom")
    assert "at its own 170.0 MiB cap" in oom.title and "logits memory held" in oom.title
    assert oom.fix.startswith("the process hit its own cap of 170.0 MiB")
    assert max(oom.details["by_category"], key=oom.details["by_category"].get) == "logits"
    assert not [s for s in oom.details["sites"] if "lorascope/probes" in s]
    assert oom.details["sites"][0].endswith("modeling_llama.py:480 in forward")
