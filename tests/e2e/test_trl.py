"""TRL's SFTTrainer as a launch: probes/train_trl.py (a tiny random Llama, a word-level
tokenizer and a dataset built in memory, PEFT LoraConfig as peft_config) under
`lorascope run -- torchrun --nproc_per_node 2`, on CPU over gloo. ZeRO-3: every rank
attached, its steps are the Trainer's global_step, and the healthy run raises nothing.
FSDP2 asked for: accelerate runs DDP on CPU, and sharding-not-applied says so, while the
DDP run itself is healthy (no rank0-asymmetry at its threshold: it fired on every try)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lorascope.rundir.loading.reader import load_run
from tests.helpers import REPO, Finished, free_port, probed, torchrun

pytest.importorskip("trl", reason="TRL is in the test extra (pip install -e '.[test]')")

pytestmark = pytest.mark.e2e

TRL = str(REPO / "probes" / "train_trl.py")


def _run(tmp_path: Path, engine: str) -> tuple[Finished, dict]:
    fin = probed(tmp_path / "run", torchrun(free_port(), "--engine", engine, "--steps", "5", script=TRL))
    assert fin.proc.returncode == 0, fin.proc.stderr[-3000:]
    assert fin.proc.stderr.strip().splitlines()[-1] == "lorascope: 2 processes attached the probes (ranks 0, 1)"
    [global_step] = re.findall(r"^train_trl: done global_step=(\d+)$", fin.proc.stdout, flags=re.M)
    run = load_run(fin.out)
    assert sorted(run.ranks) == [0, 1] and run.warnings == []
    for rank in run.ranks.values():
        assert [s["step"] for s in rank.steps] == list(range(1, int(global_step) + 1))
        assert rank.configs["trainer"]["max_steps"] == 5
    return fin, fin.summary()


@pytest.mark.slow  # ~50-80 s here (DeepSpeed's start); the Trainer under ZeRO-3 is in the default run (test_launchers)
def test_sft_trainer_with_zero3_is_probed_and_healthy(tmp_path: Path) -> None:
    fin, data = _run(tmp_path, "deepspeed")
    assert data["manifest"]["sharding"]["engine"] == "DeepSpeed"
    assert not [f["title"] for f in data["findings"] if f["severity"] != "info"], data["findings"]
    params = load_run(fin.out).ranks[0].configs["zero3_params"]
    assert 0 < params["frozen_whole_bytes"] <= params["frozen_bytes"] < 2**20 * 8  # a tiny model: all persist


def test_sft_trainer_asking_fsdp2_on_cpu_runs_ddp_and_is_told(tmp_path: Path) -> None:
    _, data = _run(tmp_path, "fsdp2")
    assert data["manifest"]["sharding"]["engine"] == "DDP"
    found = [f for f in data["findings"] if f["severity"] != "info"]
    assert [f["id"] for f in found] == ["sharding-not-applied"], found
    assert found[0]["title"] == "FSDP2 was asked for, but the job ran DDP: every rank held the whole model"
