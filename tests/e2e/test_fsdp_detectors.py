"""The failure modes planted in the FSDP job (probes/train_fsdp.py, 2 ranks on CPU over
gloo) named by `lorascope analyze`, and the healthy FSDP job named nothing. One job run per
planting, shared by its assertions (each costs ~10-25 s here)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from lorascope.rundir.reader import load_run
from tests.helpers import LORASCOPE, TRAIN, Finished, free_port, probed, torchrun

pytestmark = pytest.mark.e2e

TRAIN_FSDP = str(Path(TRAIN).with_name("train_fsdp.py"))
FIVE = {"rank0-asymmetry", "logits-spike", "reentrant-dead-grads", "rank-conditional-hang", "tiny-kernel-tail"}

JOBS = {
    "healthy-fsdp2": ["--steps", "8"],
    "healthy-fsdp1": ["--fsdp", "1", "--steps", "8"],
    "reentrant-fsdp2": ["--steps", "3", "--plant", "reentrant-checkpoint"],
    "reentrant-fsdp1": ["--fsdp", "1", "--steps", "3", "--plant", "reentrant-checkpoint"],
    "logits-spike": ["--steps", "3", "--plant", "logits-spike"],
    "state-dict-gather": ["--steps", "8", "--plant", "rank0-state-dict-gather"],
    # train_lora's tiny-kernel-tail preset: many small layers, dropout (a kernel per adapter).
    "tiny-kernel-tail": [
        "--steps",
        "8",
        "--layers",
        "12",
        "--hidden",
        "32",
        "--intermediate",
        "64",
        "--lora-dropout",
        "0.1",
    ],
}


def fsdp_job(*args: str) -> list[str]:
    cmd = torchrun(free_port(), *args)
    cmd[cmd.index(TRAIN)] = TRAIN_FSDP
    return cmd


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Finished, dict]]:
    """Each job once, lazily (a test asks for its own by name)."""
    return {}


def job(
    runs: dict[str, tuple[Finished, dict]], tmp_path_factory: pytest.TempPathFactory, name: str
) -> tuple[Finished, dict]:
    if name not in runs:
        fin = probed(tmp_path_factory.mktemp(name) / "run", fsdp_job(*JOBS[name]))
        assert fin.proc.returncode == 0, fin.proc.stderr[-3000:]
        res = subprocess.run(
            [*LORASCOPE, "analyze", str(fin.out), "--json"], capture_output=True, text=True, timeout=120
        )
        assert res.returncode == 0, res.stderr
        runs[name] = fin, json.loads(res.stdout)
    return runs[name]


@pytest.mark.parametrize("name", ["healthy-fsdp2", "healthy-fsdp1"])
def test_healthy_fsdp_job_raises_nothing(runs: dict, tmp_path_factory: pytest.TempPathFactory, name: str) -> None:
    fin, data = job(runs, tmp_path_factory, name)
    assert not [f["title"] for f in data["findings"] if f["severity"] != "info"], data["findings"]
    assert not {f["id"] for f in data["findings"]} & FIVE
    # The grads probe saw every adapter's gradient on the shards: each lora_B has one on some rank.
    run = load_run(fin.out)
    statuses: dict[str, set[str]] = {}
    for rank in run.ranks.values():
        assert rank.grads is not None and rank.grads["scope"] == "local-partition"
        for n, s in zip(rank.grads["names"], rank.grads["status"], strict=True):
            statuses.setdefault(n, set()).add(s)
    lora_b = [n for n in statuses if ".lora_B." in n]
    assert len(lora_b) == 14 and all("o" in statuses[n] for n in lora_b)


@pytest.mark.parametrize("name", ["reentrant-fsdp2", "reentrant-fsdp1"])
def test_reentrant_checkpoint_wrapper(runs: dict, tmp_path_factory: pytest.TempPathFactory, name: str) -> None:
    """torch's checkpoint_wrapper (REENTRANT) on every layer but the last: layer 0's seven
    adapters get no gradient, silently."""
    _, data = job(runs, tmp_path_factory, name)
    top = data["findings"][0]
    assert top["id"] == "reentrant-dead-grads" and top["ranks"] == [0, 1]
    assert top["confidence"] == "high"
    assert "use_reentrant=True" in " ".join(f"{e['label']} {e['value']}" for e in top["evidence"])
    dead = top["details"]["dead_lora_B"]
    assert len(dead) == 7 and top["details"]["lora_B_checked"] == 14
    assert all(".layers.0." in n for n in dead)


def test_logits_spike(runs: dict, tmp_path_factory: pytest.TempPathFactory) -> None:
    _, data = job(runs, tmp_path_factory, "logits-spike")
    top = data["findings"][0]
    assert top["id"] == "logits-spike" and top["ranks"] == [0, 1]
    assert top["details"]["logits_shape"] == [4, 128, 32000]
    assert top["details"]["logits_bytes"] == 4 * 128 * 32000 * 4


def test_state_dict_gathered_on_rank0(runs: dict, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Full state dicts (cpu_offload: only rank 0 receives them) kept on rank 0."""
    _, data = job(runs, tmp_path_factory, "state-dict-gather")
    top = data["findings"][0]
    assert top["id"] == "rank0-asymmetry" and top["ranks"] == [0]
    peaks = {int(k): v for k, v in top["details"]["peaks"].items()}
    assert peaks[0] - peaks[1] >= 16 * 2**20


def test_tiny_kernel_tail(runs: dict, tmp_path_factory: pytest.TempPathFactory) -> None:
    _, data = job(runs, tmp_path_factory, "tiny-kernel-tail")
    top = data["findings"][0]
    assert top["id"] == "tiny-kernel-tail" and top["ranks"]
    stats = top["details"]["stats"]
    # The counts carry the rule (docs/detectors.md): thousands of LoRA ops per step, mostly tiny.
    for rank in ("0", "1"):
        assert stats[rank]["lora_per_step"] >= 2000 and stats[rank]["lora_tiny_share"] >= 0.5
