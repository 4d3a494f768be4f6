"""benchmarks/gpu_check.py's orchestration on CPU (the GPU check itself needs a GPU, and a
GPU session is scarce: a broken import or path there would waste it). Its single-rank run
goes through `lorascope run`, the analysis and the fixture copy here; the CUDA checks
fail, each saying what the CPU run showed instead."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_check

pytestmark = pytest.mark.e2e


def test_single_run_orchestration_on_cpu(tmp_path: Path) -> None:
    (tmp_path / "work").mkdir()
    check = gpu_check.GpuCheck(tmp_path / "work", tmp_path / "out", [tmp_path / "fixtures"], time.time())
    check.single()
    rows = {c.name: c for c in check.report.checks}
    assert rows["single: 1 rank, NCCL, probed"].ok is True
    assert "off: torch" in rows["allocator history on, OOM observer"].detail
    assert rows["CUDA counters in memory records"].ok is False
    assert "cpu trace" in rows["Kineto window: CUDA kernels in lora_A/lora_B"].detail
    kept = tmp_path / "fixtures" / "single"
    assert (kept / "manifest.json").is_file() and not (kept / "bootstrap").exists()
    assert list(kept.glob("ranks/rank-0/*.trace.json.gz")) and check.report.figures["fixtures"]["single"] > 0
