"""The LoRA job sharded by PyTorch FSDP (probes/train_fsdp.py), 2 ranks over gloo under
`lorascope run`: FSDP2 (fully_shard) and FSDP1 (FullyShardedDataParallel) healthy runs
record their collectives on both ranks with call sites in the job and their settings,
and `analyze` finds nothing; rank 0 alone taking a full state dict is named as a
rank-conditional hang at the job's `if rank == 0:` line. One job run per fixture."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from lorascope.rundir.loading.reader import RankData, RunData, load_run
from tests.helpers import LORASCOPE, REPO, Finished, free_port, probed, torchrun

pytestmark = pytest.mark.e2e

FSDP = str(REPO / "probes" / "train_fsdp.py")
STEPS = 4


def analyze(fin: Finished) -> dict:
    res = subprocess.run([*LORASCOPE, "analyze", str(fin.out), "--json"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def job(tmp_path_factory: pytest.TempPathFactory, name: str, *args: str) -> Finished:
    return probed(tmp_path_factory.mktemp(name) / "run", torchrun(free_port(), *args, script=FSDP))


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory: pytest.TempPathFactory) -> Finished:
    fin = job(tmp_path_factory, "fsdp2", "--steps", str(STEPS), "--mixed-precision", "bf16")
    assert fin.proc.returncode == 0, fin.proc.stderr[-3000:]
    return fin


@pytest.fixture(scope="module")
def fsdp1(tmp_path_factory: pytest.TempPathFactory) -> Finished:
    fin = job(tmp_path_factory, "fsdp1", "--steps", str(STEPS), "--fsdp", "1", "--sharding", "SHARD_GRAD_OP")
    assert fin.proc.returncode == 0, fin.proc.stderr[-3000:]
    return fin


def per_step(rank: RankData) -> Counter[int]:
    return Counter(c.step for c in rank.collectives)


def check_collectives(run: RunData, ops: set[str], per_training_step: int) -> None:
    """Both ranks: the same calls in the same order, all ended without error, at sites
    in the job (or transformers' layer, where FSDP's pre-forward hook runs)."""
    assert sorted(run.ranks) == [0, 1]
    sequences = []
    for rank in run.ranks.values():
        assert {c.op for c in rank.collectives} == ops | {"barrier"}
        counts = per_step(rank)
        assert [counts[s] for s in range(STEPS)] == [per_training_step] * STEPS, counts
        for call in rank.collectives:
            assert call.end is not None and call.err is None, call
            assert call.site is not None
            assert "train_fsdp.py:" in call.site or "train_lora.py:" in call.site or "modeling_llama.py" in call.site
        sequences.append([(c.op, c.bytes, c.seq) for c in rank.collectives])
    assert sequences[0] == sequences[1]


def test_fsdp2_collectives_are_recorded_on_both_ranks(fsdp2: Finished) -> None:
    # per step: forward all-gathers of root + 2 layers, backward all-gathers of the 2
    # layers, reduce-scatters of the 2 layers' adapter gradients (the root's are frozen)
    check_collectives(load_run(fsdp2.out), {"all_gather_single", "reduce_scatter_single"}, 8)


def test_fsdp2_settings_are_recorded_and_analyze_finds_nothing(fsdp2: Finished) -> None:
    fsdp = load_run(fsdp2.out).ranks[0].configs["fsdp"]
    assert fsdp["version"] == 2 and fsdp["units"] == 3
    assert fsdp["mesh"] == [{"shape": [2], "dim_names": None, "device": "cpu"}]
    assert fsdp["reshard_after_forward"] == [True] and fsdp["offload"] == [None]
    [mp] = fsdp["mixed_precision"]
    assert (mp["param_dtype"], mp["reduce_dtype"]) == ("bfloat16", "float32")
    data = analyze(fsdp2)
    assert data["findings"] == [] and data["warnings"] == []
    assert data["manifest"]["sharding"]["engine"] == "FSDP2"


def test_fsdp1_collectives_and_settings(fsdp1: Finished) -> None:
    run = load_run(fsdp1.out)
    # FSDP1 on gloo: all_gather into a list (no all_gather_single there); SHARD_GRAD_OP
    # keeps the layers unsharded between forward and backward: 3 all-gathers, 2 reduce-scatters
    check_collectives(run, {"all_gather", "reduce_scatter_single"}, 5)
    fsdp = run.ranks[1].configs["fsdp"]
    assert (fsdp["version"], fsdp["sharding_strategy"], fsdp["units"]) == (1, "SHARD_GRAD_OP", 3)
    assert fsdp["shard_world"] == 2 and fsdp["use_orig_params"] is True and fsdp["cpu_offload"] is False
    data = analyze(fsdp1)
    assert data["findings"] == [] and data["warnings"] == []


def test_rank0_full_state_dict_save_is_a_rank_conditional_hang(tmp_path: Path) -> None:
    args = ["--steps", "6", "--plant", "rank0-full-state-dict-save", "--plant-step", "3", "--pg-timeout", "20"]
    fin = probed(tmp_path / "run", torchrun(free_port(), *args, script=FSDP))
    assert fin.proc.returncode != 0  # gloo: rank 0 aborts or times out, rank 1 loses its peer
    lines = Path(FSDP).read_text().splitlines()
    [save] = [n for n, line in enumerate(lines, 1) if "state = get_model_state_dict(" in line]
    assert lines[save - 2].strip().startswith("if rank == 0:")
    top = analyze(fin)["findings"][0]
    assert top["id"] == "rank-conditional-hang" and top["ranks"] == [0], top["title"]
    assert f"train_fsdp.py:{save} in after_step" in top["title"] and "if rank == 0:" in top["title"]
    assert top["confidence"] == "high"
    assert "funcol.all_gather_single" in top["title"]
