"""The tiny-kernel-tail detector on real GPU traces (../shared/real-traces, read-only; each
case skips, naming its file, where it is absent) and on a synthetic CUDA trace carrying
the probes' module ranges."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from lorascope.detect import kernel_attribution, tiny_kernel_tail
from lorascope.ingest.load import load_bundle
from tests.helpers import REAL_TRACE_NAMES, REAL_TRACES, real_trace

#: Every real trace: the named ones (each skips, saying so, when absent) and any newer file there.
TRACES = sorted({*REAL_TRACE_NAMES, *(p.name for p in REAL_TRACES.glob("*.json.gz"))})


def independent_counts(path: Path) -> tuple[int, int]:
    """GPU kernels and those under the GPU threshold, counted straight from the JSON."""
    events = json.load(gzip.open(path))["traceEvents"]
    kernels = [e for e in events if isinstance(e, dict) and e.get("cat") == "kernel" and e.get("ph") == "X"]
    return len(kernels), sum(1 for k in kernels if float(k["dur"]) < kernel_attribution.TINY_GPU_US)


@pytest.mark.parametrize("name", TRACES)
def test_real_gpu_traces(name: str) -> None:
    path = real_trace(name)
    bundle = load_bundle(path)
    findings = tiny_kernel_tail.detect(bundle)
    total, tiny = independent_counts(path)
    trace = next(iter(bundle.traces.values()))
    idle = trace.idle_us / (trace.busy_us + trace.idle_us)
    print(
        f"{path.name}: {total} kernels, {tiny} under {kernel_attribution.TINY_GPU_US:g} us, "
        f"idle {idle:.0%} -> {[f.title for f in findings] or 'no finding'}"
    )
    assert total > 0 and trace.unit == "kernel"
    share = tiny / total
    expected = share >= tiny_kernel_tail.MIN_TINY_COUNT_SHARE and idle >= tiny_kernel_tail.MIN_IDLE_SHARE
    assert bool(findings) == expected
    if findings:
        assert f"{share:.0%} of {total:,} kernels" in findings[0].evidence[0].value


def synthetic_cuda_trace(path: Path, lora_kernels: int, base_kernels: int, ranges: bool = True) -> Path:
    """A Kineto-shaped CUDA trace: module ranges (unless ``ranges`` is False), CPU launches,
    kernels linked by correlation."""
    events: list[dict] = [
        {"ph": "X", "cat": "user_annotation", "name": "lorascope.step#6", "ts": 0, "dur": 1_000_000, "pid": 1, "tid": 1}
    ]
    ts, corr = 10.0, 0
    for i in range(lora_kernels + base_kernels):
        module = "model.layers.0.q_proj.lora_A.default" if i < lora_kernels else "model.layers.0.q_proj.base_layer"
        corr += 1
        if ranges:
            events.append(
                {
                    "ph": "X",
                    "cat": "user_annotation",
                    "name": f"lorascope.module::{module}",
                    "ts": ts,
                    "dur": 8,
                    "pid": 1,
                    "tid": 1,
                }
            )
        events += [
            {
                "ph": "X",
                "cat": "cuda_runtime",
                "name": "cudaLaunchKernel",
                "ts": ts + 1,
                "dur": 5,
                "pid": 1,
                "tid": 1,
                "args": {"correlation": corr},
            },
            {
                "ph": "X",
                "cat": "kernel",
                "name": "ampere_sgemm_32x32" if i < lora_kernels else "sm90_gemm_big",
                "ts": ts + 6,
                "dur": 2.0 if i < lora_kernels else 40.0,
                "pid": 0,
                "tid": 7,
                "args": {"correlation": corr, "device": 0, "stream": 7},
            },
        ]
        ts += 50
    path.write_text(json.dumps({"traceEvents": events, "distributedInfo": {"rank": 0, "world_size": 1}}))
    return path


def test_synthetic_cuda_lora_tail_is_attributed(tmp_path: Path) -> None:
    bundle = load_bundle(synthetic_cuda_trace(tmp_path / "rank-0.json", lora_kernels=3000, base_kernels=100))
    [finding] = tiny_kernel_tail.detect(bundle)
    stats = finding.details["stats"]["0"]
    assert stats["lora_units"] == 3000 and stats["lora_per_step"] == 3000
    assert finding.details["threshold_us"] == kernel_attribution.TINY_GPU_US
    assert stats["lora_time_share"] == pytest.approx(6000 / (6000 + 4000))
    assert "LoRA adds 3,000 kernels" in finding.title and finding.confidence == "high"


def test_synthetic_cuda_trace_with_big_lora_kernels_is_quiet(tmp_path: Path) -> None:
    bundle = load_bundle(synthetic_cuda_trace(tmp_path / "rank-0.json", lora_kernels=0, base_kernels=500))
    assert tiny_kernel_tail.detect(bundle) == []


def test_an_event_category_of_any_json_type_is_read_past(tmp_path: Path) -> None:
    """An odd value (here a category that is an object) costs that event, not the detector."""
    path = synthetic_cuda_trace(tmp_path / "rank-0.json", lora_kernels=3000, base_kernels=100)
    trace = json.loads(path.read_text())
    trace["traceEvents"].append(
        {"ph": "X", "cat": {"not": "a category"}, "name": "x", "ts": 5, "dur": 1, "pid": 1, "tid": 1}
    )
    path.write_text(json.dumps(trace))
    bundle = load_bundle(path)
    [finding] = tiny_kernel_tail.detect(bundle)
    assert finding.details["stats"]["0"]["lora_units"] == 3000


def test_launch_bound_trace_without_module_ranges_blames_no_module(tmp_path: Path) -> None:
    """Issue 11: a GPU trace without module ranges (a non-LoRA model, a trace from elsewhere)
    is launch-bound, but nothing in it says LoRA launches the tiny kernels."""
    path = synthetic_cuda_trace(tmp_path / "rank-0.json", lora_kernels=3000, base_kernels=100, ranges=False)
    [finding] = tiny_kernel_tail.detect(load_bundle(path))
    assert "launch-bound" in finding.title and "unknown" in finding.title
    assert "LoRA" not in finding.title and "LoRA" not in finding.fix
    assert finding.explanation == tiny_kernel_tail.PLAIN_EXPLANATION and finding.confidence == "medium"
