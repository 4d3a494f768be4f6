"""Each failure mode, planted in the real 2-rank LoRA job (two plantings each), is named
by `lorascope analyze` as its top finding, with the right ranks and evidence numbers;
the healthy job is named nothing."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from lorascope.rundir.loading.reader import load_run
from tests.helpers import LORASCOPE, TRAIN, Finished, free_port, probed, torchrun

pytestmark = pytest.mark.e2e

FIVE = {"rank0-asymmetry", "logits-spike", "reentrant-dead-grads", "rank-conditional-hang", "tiny-kernel-tail"}


def analyze(fin: Finished) -> dict:
    res = subprocess.run([*LORASCOPE, "analyze", str(fin.out), "--json"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def run_fault(tmp_path: Path, *args: str) -> tuple[Finished, dict]:
    fin = probed(tmp_path / "run", torchrun(free_port(), *args))
    return fin, analyze(fin)


@pytest.mark.parametrize(
    "planting",
    [
        ["--fault", "rank-conditional-hang", "--fault-step", "3"],
        # The library's collective under the job's rank condition is in test_collective_paths too.
        pytest.param(["--fault", "rank-conditional-gather", "--fault-step", "3"], marks=pytest.mark.slow),
    ],
)
def test_rank_conditional_hang(tmp_path: Path, planting: list[str]) -> None:
    fin, data = run_fault(tmp_path, "--steps", "6", "--pg-timeout", "15", *planting)
    assert fin.proc.returncode != 0
    top = data["findings"][0]
    assert top["id"] == "rank-conditional-hang" and top["ranks"] == [0]
    assert top["confidence"] == "high"
    # The sequence number, counted independently: rank 1's calls on that group before it
    # went somewhere rank 0 did not follow.
    run = load_run(fin.out)
    group = top["details"]["group"]
    rank0 = [c for c in run.ranks[0].collectives if c.group == group]
    odd = next(
        c
        for c in rank0
        if c.site and "train_lora.py" in c.site and "rank == 0" in " ".join(run.ranks[0].sites[c.site]["conditions"])
    )
    assert top["details"]["seq"] == odd.seq
    assert "rank == 0" in top["title"]


@pytest.mark.parametrize(
    "planting",
    [
        pytest.param(["--fault", "reentrant-dead-grads"], marks=pytest.mark.slow),  # the job fails: loud already
        ["--fault", "reentrant-partial"],
    ],
)
def test_reentrant_dead_grads(tmp_path: Path, planting: list[str]) -> None:
    fin, data = run_fault(tmp_path, "--steps", "3", *planting)
    top = data["findings"][0]
    assert top["id"] == "reentrant-dead-grads" and top["ranks"] == [0, 1]
    assert top["confidence"] == "high"
    labels = " ".join(e["label"] + " " + str(e["value"]) for e in top["evidence"])
    assert "use_reentrant=True" in labels
    if planting[1] == "reentrant-partial":  # silent: the job trains, some adapters get nothing
        assert fin.proc.returncode == 0
        layers = 2
        dead = top["details"]["dead_lora_B"]
        # all 7 adapted linears of every layer but the last (not checkpointed)
        assert len(dead) == 7 * (layers - 1) and top["details"]["lora_B_checked"] == 7 * layers
        assert all(".layers.0." in name for name in dead)
    else:
        assert fin.proc.returncode != 0
        assert "None of the inputs have requires_grad=True" in labels


@pytest.mark.parametrize(
    "planting, shape",
    [
        (["--fault", "logits-spike"], [4, 128, 32000]),
        pytest.param(
            ["--fault", "logits-spike-internal", "--micro-batch", "2", "--seq", "192"],
            [2, 192, 32000],
            marks=pytest.mark.slow,
        ),
    ],
)
def test_logits_spike(tmp_path: Path, planting: list[str], shape: list[int]) -> None:
    fin, data = run_fault(tmp_path, "--steps", "3", *planting)
    assert fin.proc.returncode == 0, fin.proc.stderr[-2000:]
    top = data["findings"][0]
    assert top["id"] == "logits-spike" and top["ranks"] == [0, 1]
    b, t, v = shape
    assert top["details"]["logits_shape"] == shape
    assert top["details"]["logits_bytes"] == b * t * v * 4  # fp32 model: element size 4


@pytest.mark.parametrize(
    "planting",
    [
        ["--fault", "rank0-asymmetry-eval", "--eval-batch", "256"],
        # 4 MiB kept per step (1 MiB, the default, put the held gap at 16.1 MiB against the
        # 16 MiB floor: a coin toss on a loaded machine, which failed once in CI; a finding
        # now needs 1.5x its threshold, rank0_asymmetry.MARGIN)
        pytest.param(["--fault", "rank0-asymmetry-gather", "--gather-numel", str(1 << 20)], marks=pytest.mark.slow),
    ],
)
def test_rank0_asymmetry(tmp_path: Path, planting: list[str]) -> None:
    fin, data = run_fault(tmp_path, "--steps", "10", *planting)
    assert fin.proc.returncode == 0, fin.proc.stderr[-2000:]
    top = data["findings"][0]
    assert top["id"] == "rank0-asymmetry" and top["ranks"] == [0]
    peaks = {int(k): v for k, v in top["details"]["peaks"].items()}
    assert peaks[0] - peaks[1] >= 16 * 2**20
    expected = "eval" if "eval" in planting[1] else "the training loop's own code between steps"
    assert top["details"]["divergence"]["phase"] == expected


@pytest.mark.parametrize(
    "config",
    [
        # The default shape's healthy run: test_run_job's shared 20-step run asserts it too.
        pytest.param(["--steps", "8"], marks=pytest.mark.slow),
        ["--steps", "30", "--hidden", "128", "--intermediate", "256", "--layers", "4", "--vocab", "2048"],
    ],
)
def test_healthy_job_reports_none_of_the_five(tmp_path: Path, config: list[str]) -> None:
    fin, data = run_fault(tmp_path, *config)
    assert fin.proc.returncode == 0, fin.proc.stderr[-2000:]
    assert not {f["id"] for f in data["findings"]} & FIVE, data["findings"]
    # Issue 11: no false alarm of any detector on a healthy run (notes are allowed).
    assert not [f["title"] for f in data["findings"] if f["severity"] != "info"]


def test_straggler_planted_in_other_code(tmp_path: Path) -> None:
    """probes/variants.py: rank 1 does 400 ms of extra CPU work before every step (about 3x
    a step of the job: a loaded CI machine's noise does not bring it near the 1.5x rule);
    the straggler finding names it and states its persistence (issue 11)."""
    cmd = torchrun(free_port(), "--variant", "straggler", "--straggle-ms", "400", "--steps", "10")
    cmd[cmd.index(TRAIN)] = str(Path(TRAIN).with_name("variants.py"))
    fin = probed(tmp_path / "run", cmd)
    assert fin.proc.returncode == 0, fin.proc.stderr[-2000:]
    findings = analyze(fin)["findings"]
    assert findings and findings[0]["id"] == "straggler", findings
    top = findings[0]
    assert top["ranks"] == [1] and top["severity"] == "warning"
    assert top["details"]["persistence"] >= 0.75 and top["details"]["ratio"] >= 1.5
    assert f"of {top['details']['steps']} steps" in top["title"]


@pytest.mark.parametrize(
    "planting",
    [
        ["--fault", "tiny-kernel-tail"],
        pytest.param(["--fault", "tiny-kernel-tail", "--engine", "torch"], marks=pytest.mark.slow),
    ],
)
def test_tiny_kernel_tail(tmp_path: Path, planting: list[str]) -> None:
    fin, data = run_fault(tmp_path, "--steps", "8", *planting)
    assert fin.proc.returncode == 0, fin.proc.stderr[-2000:]
    top = data["findings"][0]
    assert top["id"] == "tiny-kernel-tail" and top["ranks"] == [0, 1]
    # The LoRA op count, counted here from the rank's own trace table.
    table = top["details"]["kernels"]["ranks"]["0"]
    lora_ops = sum(len(r["durations_us"]) for r in table["rows"] if r["module"] in ("lora_A", "lora_B", "lora"))
    assert f"{lora_ops:,}" in top["title"]
    assert table["steps"] == 2  # the default window: steps 6-7
