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
from lorascope.rundir.loading.reader import load_run
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
    assert not ok and "rank 0: off: torch" in detail and "built without CUDA" in detail
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
    """The share of a step the run says it spent in probe code (the recorded healthy run's:
    a few percent of its 6 short steps); None from a run without cost records."""
    assert 0 < gpu_check.in_job_cost(FIXTURES / "healthy") < 0.2
    assert gpu_check.in_job_cost(write_run(tmp_path / "bare", [RankSpec(steps=4)])) is None
    costs = [
        {"k": "cost", "step": s, "job_ms": 10.0 * s, "calls_ms": 0.0, "calls": 0, "sites_ms": 0.0,
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


# -- the real-size part (benchmarks/gpu_realsize.py): its pure figures on CPU inputs ------


@NO_CUDA
def test_quick_skips_without_cuda() -> None:
    assert gpu_check.main(["--quick"]) == 0


def test_realsize_overhead_compares_steady_steps_with_bare() -> None:
    def done(steady: float, mean: float) -> dict[str, float]:
        return {"steady_step_s": steady, "mean_step_s": mean, "steps": 30, "peak_alloc": 1, "peak_reserved": 1}

    figures = gpu_check.realsize_overhead(
        {"bare": [done(0.40, 0.50), done(0.42, 0.52)], "auto": [done(0.41, 0.53)], "always": [], "off": []}
    )
    assert figures["steady_step_s"] == {"bare": 0.41, "auto": 0.41}
    assert figures["steady_vs_bare"] == {"auto": 0.0} and figures["mean_vs_bare"] == {"auto": 0.0392}
    assert figures["runs"] == {"bare": 2, "auto": 1, "always": 0, "off": 0}


def test_kernel_figures_on_a_real_gpu_trace() -> None:
    import gzip
    import json

    raw = json.loads(gzip.decompress(real_trace("a100-nccl-collective-args.rank-0.json.gz").read_bytes()))
    figures = gpu_check.kernel_figures(raw, 10.0)
    kernels = [e for e in raw["traceEvents"] if e.get("cat") == "kernel" and e.get("ph") == "X"]
    assert figures["kernels"] == len(kernels) > 0
    assert figures["lora_launch_share"] == 0.0  # not a LoRA job: no kernel in a lora_A/lora_B module
    assert 0.0 <= figures["idle_share"] < 1.0 and 0.0 <= figures["tiny_launch_share"] <= 1.0
    assert figures["gpu_us"] > 0


def test_kernel_figures_on_a_cpu_trace_have_no_kernels() -> None:
    import gzip
    import json

    trace = next((FIXTURES / "tiny-kernel-tail" / "ranks" / "rank-0").glob("*.trace.json.gz"))
    figures = gpu_check.kernel_figures(json.loads(gzip.decompress(trace.read_bytes())), 10.0)
    assert figures["kernels"] == 0 and figures["lora_time_share"] is None and figures["idle_share"] is None


@pytest.mark.e2e
def test_realsize_job_and_plan_on_cpu(tmp_path: Path) -> None:
    """The real-size job's code at a tiny shape on CPU: its last line parses, its config.json
    feeds `lorascope plan`, and the plan's figures compare with the peaks."""
    import json

    import gpu_realsize

    config = tmp_path / "config.json"
    job = [sys.executable, str(REPO / "benchmarks" / "gpu_realsize.py"), "--shape", "tiny", "--device", "cpu"]
    res = subprocess.run(
        [*job, "--steps", "6", "--seq", "32", "--config-out", str(config)], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    done = gpu_realsize.parse_done(res.stdout)
    assert done is not None and done["steps"] == 6 and done["steady_step_s"] > 0 and done["peak_alloc"] == 0
    assert gpu_realsize.parse_done(res.stdout.replace("gpu_realsize: done", "")) is None
    plan = subprocess.run(gpu_check.plan_command(config, 80 * 2**30), capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    planned = json.loads(plan.stdout)
    assert planned["model"]["hidden"] == gpu_realsize.SHAPES["tiny"]["hidden_size"]
    assert planned["lora"]["targets"] == "all-linear" and planned["setup"]["checkpointing"] == "non-reentrant"
    measured = {**done, "peak_alloc": planned["allocated_bytes"] * 2, "peak_reserved": planned["total_bytes"]}
    error = gpu_check.plan_error(planned, measured)
    assert error["alloc_error"] == -0.5 and error["reserved_error"] == 0.0
    assert error["terms"]["base_weights"] > 0
