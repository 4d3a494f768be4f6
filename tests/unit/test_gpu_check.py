"""benchmarks/gpu_check.sh on a machine without CUDA (it skips, exit 0), and the checks it
applies to each GPU run, on CPU runs and real GPU traces: each must fail where the GPU
evidence is missing and say what it saw."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lorascope.detect.registry import run_detectors
from lorascope.ingest.load import load_bundle
from lorascope.rundir.reader import load_run
from tests.helpers import FIXTURES, OOM_SNAPSHOTS, RankSpec, add_snapshot, real_trace, write_run

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_check  # noqa: E402

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: run benchmarks/gpu_check.sh itself")


@NO_CUDA
def test_script_skips_without_cuda() -> None:
    res = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("gpu_check: skipped: no CUDA device (torch ")
    assert gpu_check.main([]) == 0


def test_checks_fail_on_a_cpu_run_saying_what_they_saw() -> None:
    run = load_run(FIXTURES / "healthy")
    ok, detail = gpu_check.check_ranks_on(run, 0)
    assert not ok and "{0: [], 1: []}" in detail and "'exit'" in detail
    ok, detail = gpu_check.check_memory_history(run)
    assert not ok and "rank 0: no memory_history record" in detail  # recorded before the probe existed
    ok, detail = gpu_check.check_cuda_counters(run)
    assert not ok and "rank 0: 0/" in detail
    ok, detail = gpu_check.check_nvml(run)
    assert not ok and "rank 1: 0 samples" in detail
    ok, detail = gpu_check.check_device_times(run)
    timed = [c for c in run.ranks[0].collectives if c.bytes and not c.is_async]
    assert not ok and f"rank 0 (gloo): 0/{len(timed)} timed" in detail


def test_kernel_window_check_on_a_real_gpu_trace() -> None:
    """A real CUDA trace (not a LoRA job): kernels counted, none attributed to adapters."""
    bundle = load_bundle(real_trace("128rank-job.rank-0.json.gz"))
    ok, detail = gpu_check.check_kernel_window(bundle)
    assert not ok and "cuda trace" in detail and "lora_A 0, lora_B 0" in detail
    kernels = int(detail.split(" kernels")[0].rsplit(" ", 1)[1])
    assert kernels > 0


def test_snapshot_and_oom_checks_on_a_run_with_the_probes_snapshots(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURES / "rank0-asymmetry", run_dir)
    for rank in (0, 1):
        add_snapshot(run_dir, rank, OOM_SNAPSHOTS / f"rank-{rank}.pickle", "oom")
    bundle = load_bundle(run_dir)
    findings = run_detectors(bundle)
    ok, detail = gpu_check.check_snapshots(bundle.run, bundle, ("oom",))
    assert ok and "rank 1: [oom " in detail
    ok, _ = gpu_check.check_snapshots(bundle.run, bundle, ("oom", "stall"))
    assert not ok
    ok, detail = gpu_check.check_oom(bundle.run, bundle, findings)
    assert not ok and "exception None" in detail and "top category" in detail  # the CPU run did not die of it
    ok, detail = gpu_check.check_finding(findings, "rank0-asymmetry", "on rank 0 only")
    assert ok, detail
    ok, detail = gpu_check.check_finding(findings, "rank0-asymmetry", "gather_to_rank0")
    assert not ok and "missing ['gather_to_rank0']" in detail


def test_oom_cap_sits_between_the_step_start_and_its_peak() -> None:
    mib = 2**20
    rank = SimpleNamespace(
        mem=[
            {"src": "attach", "rss": 1},
            {"src": "forward.begin", "cuda": {"alloc": 100 * mib, "max_alloc": 100 * mib}},
            {"src": "backward.end", "cuda": {"alloc": 150 * mib, "max_alloc": 600 * mib}},
        ]
    )
    assert gpu_check.oom_cap_mib(rank) == 400
    assert gpu_check.oom_cap_mib(SimpleNamespace(mem=[{"src": "step", "rss": 5}])) is None


def test_figures_and_table() -> None:
    out = "step 1\ntrain_lora: done steps=60 final_loss=6.2 mean_step_s=0.0123\n"
    assert gpu_check.mean_step_s(out) == 0.0123 and gpu_check.mean_step_s("crashed") is None
    figures = gpu_check.overhead({"bare": [0.010, 0.012], "probed": [0.0121, 0.0121], "probed_no_history": []})
    assert figures["vs_bare"] == {"probed": 0.1} and figures["runs"]["probed_no_history"] == 0
    report = gpu_check.Report()
    report.add("a", True, "fine")
    report.add("longer name", None, "DeepSpeed not importable")
    assert report.passed
    assert report.guarded("c", lambda: 1 / 0) is None and not report.passed
    lines = report.table().splitlines()
    assert lines[2].startswith("a            PASS") and "skip" in lines[3] and "ZeroDivisionError" in lines[4]


def _rank(pid: int, *pid_lists: list[int] | None) -> SimpleNamespace:
    return SimpleNamespace(pid=pid, mem=[{"src": "sampler", "nvml": {"used": 1, "pids": p}} for p in pid_lists])


def test_gpu0_guests_check() -> None:
    shared = SimpleNamespace(ranks={0: _rank(10, [10], [10, 11]), 1: _rank(11, [10, 11])})
    assert gpu_check.check_gpu0_guests(shared) == (True, "other ranks listed on rank 0's GPU: {1: True}")
    alone = SimpleNamespace(ranks={0: _rank(10, [10]), 1: _rank(11, None)})
    assert gpu_check.check_gpu0_guests(alone)[0] is False
    assert gpu_check.check_gpu0_guests(SimpleNamespace(ranks={0: _rank(10), 1: _rank(11)}))[0] is False
    container = SimpleNamespace(ranks={0: _rank(10, [4242, 4243]), 1: _rank(11, [4242, 4243])})
    ok, detail = gpu_check.check_gpu0_guests(container)
    assert ok is None and "another PID namespace" in detail


def test_loss_frames() -> None:
    assert gpu_check.LOSS_FRAMES.search("/repo/probes/train_lora.py:345 in compute_loss")
    assert gpu_check.LOSS_FRAMES.search("transformers/models/llama/modeling_llama.py:480 in forward")
    assert not gpu_check.LOSS_FRAMES.search("/repo/probes/train_lora.py:413 in gather_to_rank0")


def test_job_wrapper_splits_its_options_from_the_jobs() -> None:
    import gpu_job

    assert gpu_job._split(["--stall", "1:8:12", "--", "--steps", "3"]) == (["--stall", "1:8:12"], ["--steps", "3"])
    assert gpu_job._split(["--share-gpu", "--steps", "3"]) == (["--share-gpu", "--steps", "3"], [])


def test_in_job_cost_of_a_run(tmp_path: Path) -> None:
    """The share of a step the run says it spent in probe code; None from a run (the
    recorded fixtures) without cost records."""
    assert gpu_check.in_job_cost(FIXTURES / "healthy") is None
    costs = [
        {"k": "cost", "step": s, "job_ms": 10.0 * s, "calls_ms": 0.0, "calls": 0, "flush_ms": 0.0, "sites_ms": 0.0,
         "sites": 0, "heap_ms": 0.0, "heap_reads": 0, "trace_ms": 0.0, "threads_cpu_ms": {}}
        for s in (1, 4)
    ]  # fmt: skip
    run = write_run(tmp_path / "run", [RankSpec(steps=4, extra=costs)])
    assert gpu_check.in_job_cost(run) == 0.02  # 10 ms of 500 ms steps


def test_peak_rss_of_a_run() -> None:
    rank0 = load_run(FIXTURES / "healthy").ranks[0]
    assert gpu_check.peak_rss(FIXTURES / "healthy") == max(m["rss"] for m in rank0.mem) > 0


def test_check_quiet_lists_what_is_loud() -> None:
    """The healthy run must raise no warning; the shared run no collective-mismatch."""
    loud = SimpleNamespace(id="plan-deviation", severity="warning", title="max_memory_allocated is 66.8 MiB")
    info = SimpleNamespace(id="logits-spike", severity="info", title="the loss's logits")
    assert gpu_check.check_quiet([info], None) == (True, "none")
    ok, detail = gpu_check.check_quiet([info, loud], None)
    assert not ok and detail.startswith("plan-deviation warning: max_memory_allocated")
    assert gpu_check.check_quiet([loud], ("collective-mismatch",)) == (True, "none")
