"""sharding-not-applied on recorded configs: the Trainer's request against the wrapper that
saw the model, and ZeRO-3's frozen weights left whole (the e2e run: tests/e2e/test_trl.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lorascope.detect import sharding_not_applied
from lorascope.detect.registry import run_detectors
from lorascope.ingest.load import load_bundle
from tests.helpers import RankSpec, write_run

FSDP2_ASKED = {"fsdp": ["full_shard", "auto_wrap"], "fsdp_config": {"fsdp_version": 2, "min_num_params": 0}}
ZERO3 = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 4}
DDP = {"find_unused_parameters": False, "static_graph": False, "gradient_as_bucket_view": False}


def _findings(tmp_path: Path, configs: dict[str, Any]) -> list[Any]:
    run = write_run(tmp_path / "run", [RankSpec(), RankSpec()], configs=configs)
    return sharding_not_applied.detect(load_bundle(run))


def test_fsdp2_asked_for_and_ddp_running_is_named(tmp_path: Path) -> None:
    """TRL's SFTConfig(fsdp=..., fsdp_config={"fsdp_version": 2}) with use_cpu=True: accelerate
    ran DDP, and lorascope recorded both and said nothing."""
    [finding] = _findings(tmp_path, {"trainer": {"deepspeed": None, **FSDP2_ASKED}, "ddp": DDP})
    assert finding.title == "FSDP2 was asked for, but the job ran DDP: every rank held the whole model"
    assert finding.severity == "warning" and finding.ranks == [0, 1]
    assert "fsdp='full_shard auto_wrap', fsdp_config fsdp_version 2" in finding.evidence[0].value
    assert "accelerate" in finding.fix and "GPU" in finding.fix
    assert [f.id for f in run_detectors(load_bundle(tmp_path / "run"))][:1] == ["rank0-asymmetry"]  # the helper's


@pytest.mark.parametrize(
    "configs",
    [
        {"trainer": {"deepspeed": None, **FSDP2_ASKED}, "fsdp": {"version": 2, "units": 3}},
        {"trainer": {"deepspeed": ZERO3, "fsdp": []}, "deepspeed": ZERO3},
        {"trainer": {"deepspeed": "ds_z3.json", "fsdp": ""}, "deepspeed": ZERO3},
        {"trainer": {"deepspeed": None, "fsdp": [], "fsdp_config": {"fsdp_version": 1}}, "ddp": DDP},
    ],
)
def test_what_was_asked_for_and_applied_is_quiet(tmp_path: Path, configs: dict[str, Any]) -> None:
    assert _findings(tmp_path, configs) == []


def test_another_zero_stage_than_asked_for_is_named(tmp_path: Path) -> None:
    asked = {"trainer": {"deepspeed": ZERO3, "fsdp": []}, "deepspeed": {"zero_optimization": {"stage": 2}}}
    [finding] = _findings(tmp_path, asked)
    assert finding.title == "ZeRO-3 was asked for, but the job ran ZeRO-2"
    [fsdp1] = _findings(tmp_path / "v1", {"trainer": FSDP2_ASKED, "fsdp": {"version": 1}})
    assert fsdp1.title == "FSDP2 was asked for, but the job ran FSDP1"


def test_frozen_weights_left_whole_under_zero3_are_named(tmp_path: Path) -> None:
    whole = {
        "frozen_bytes": 1200 * 2**20,
        "frozen_whole_bytes": 1000 * 2**20,
        "frozen_whole_count": 180,
        "trainable_bytes": 8 * 2**20,
        "trainable_whole_bytes": 8 * 2**20,
        "persistence_threshold": 100_000_000,
    }
    [finding] = _findings(tmp_path, {"deepspeed": ZERO3, "zero3_params": whole})
    assert finding.title.startswith("ZeRO-3 left 1000.0 MiB of frozen weights whole on every rank (83% of them)")
    assert "stage3_param_persistence_threshold" in finding.fix
    tiny = {**whole, "frozen_bytes": 2 * 2**20, "frozen_whole_bytes": 2 * 2**20}  # a test model: all persist
    assert _findings(tmp_path / "tiny", {"deepspeed": ZERO3, "zero3_params": tiny}) == []
