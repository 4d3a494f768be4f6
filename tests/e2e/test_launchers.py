"""The launches users run, each under `lorascope run` with a real job: a lone
`python train.py`, the `torchrun` script with nothing but PYTHON* variables reaching it
(and a SIGUSR1 sent to `lorascope run` mid-job), the Hugging Face Trainer (ZeRO-3 through
TrainingArguments, plain DDP) with planted faults, and `accelerate launch` with one and
two processes. One job run per test, few steps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lorascope.rundir.loading.reader import load_run
from tests.helpers import LORASCOPE, REPO, TRAIN, Finished, free_port, probed, torchrun

pytestmark = pytest.mark.e2e

TRAINER = str(REPO / "probes" / "train_trainer.py")
BIN = Path(sys.executable).parent
#: Starts CMD with an environment that keeps only PYTHON* variables (as pdsh/ssh
#: runners do for remote ranks): the run directory must come from the bootstrap.
PYTHON_VARS_ONLY = [
    sys.executable,
    "-c",
    "import os, sys; os.execve(sys.argv[1], sys.argv[1:], "
    "{k: v for k, v in os.environ.items() if k.startswith('PYTHON')})",
]
FIVE = {"rank0-asymmetry", "logits-spike", "reentrant-dead-grads", "rank-conditional-hang", "tiny-kernel-tail"}


def analyze(fin: Finished) -> dict:
    res = subprocess.run([*LORASCOPE, "analyze", str(fin.out), "--json"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def failure(fin: Finished) -> str:
    """Why a job failed, for the assertion message: its status, the lines that say error, the tail."""
    err = fin.proc.stderr
    said = [line for line in err.splitlines() if "rror" in line or "Traceback" in line]
    return f"exit status {fin.proc.returncode}\n" + "\n".join(said[:20]) + "\n...\n" + err[-2000:]


def last_line(fin: Finished) -> str:
    return fin.proc.stderr.strip().splitlines()[-1]


def torchrun_trainer(*args: str) -> list[str]:
    return torchrun(free_port(), *args, script=TRAINER)


# -- a lone process ------------------------------------------------------------------
@pytest.mark.parametrize(
    "fault, steps, finding",
    [
        ("logits-spike", "3", "logits-spike"),
        pytest.param("reentrant-dead-grads", "2", "reentrant-dead-grads", marks=pytest.mark.slow),
    ],
)
def test_lone_python_process_is_probed(tmp_path: Path, fault: str, steps: str, finding: str) -> None:
    """`python train.py` (no launcher, no rank variables) is rank 0 of 1, and the
    single-process faults are named on it."""
    fin = probed(tmp_path / "run", [sys.executable, TRAIN, "--engine", "torch", "--fault", fault, "--steps", steps])
    assert last_line(fin) == "lorascope: 1 process attached the probes (rank 0)", fin.proc.stderr[-3000:]
    run = load_run(fin.out)
    rank = run.ranks[0]
    assert rank.start["rank_source"] == "lone" and run.world_size == 1
    assert rank.dist_init is not None and (rank.dist_init["rank"], rank.dist_init["world_size"]) == (0, 1)
    top = analyze(fin)["findings"][0]
    assert top["id"] == finding and top["ranks"] == [0]
    if fault == "logits-spike":
        assert fin.proc.returncode == 0
        assert [s["step"] for s in rank.steps] == [1, 2, 3]
        assert top["details"]["logits_shape"] == [4, 128, 32000]
    else:
        assert fin.proc.returncode == 1 and rank.exception is not None


# -- torchrun with PYTHON* only, and a signal mid-job -----------------------------------
def test_python_vars_only_launch_is_probed_and_sigusr1_ends_it_cleanly(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [*PYTHON_VARS_ONLY, str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port())]
    proc = subprocess.Popen(
        [*LORASCOPE, "run", "--out", str(out), "--", *cmd, TRAIN, "--engine", "torch", "--steps", "500"],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 240
    while True:
        assert time.time() < deadline and proc.poll() is None, "both ranks should be probed and stepping"
        try:
            run = load_run(out)
        except Exception:
            run = None
        if run is not None and len(run.ranks) == 2 and all(len(r.steps) >= 2 for r in run.ranks.values()):
            break
        time.sleep(0.5)
    proc.send_signal(signal.SIGUSR1)  # what SLURM and Kubernetes send before pre-emption
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGUSR1
    assert "passing SIGUSR1 on to the job" in err
    assert err.strip().splitlines()[-1] == "lorascope: 2 processes attached the probes (ranks 0, 1)"
    launch = json.loads((out / "manifest.json").read_text())["launches"][0]
    assert launch["exit_status"] == 128 + signal.SIGUSR1 and launch["signals"] == ["SIGUSR1"]
    run = load_run(out)
    for rank in run.ranks.values():
        assert rank.start["rank_source"] == "env"
        assert rank.signal is not None and rank.signal["name"] == "SIGUSR1"  # with its stacks
        assert not Path(f"/proc/{rank.pid}").exists() or "Z" in Path(f"/proc/{rank.pid}/stat").read_text().split()[2]
    log = out / "bootstrap" / launch["id"] / "processes.jsonl"
    roles = [json.loads(line)["role"] for line in log.read_text().splitlines()]
    assert sorted(roles) == ["launcher", "lone", "rank", "rank"]  # the env wrapper, torchrun, 2 ranks


# -- the Hugging Face Trainer ----------------------------------------------------------
@pytest.fixture(scope="module")
def trainer_zero3(tmp_path_factory: pytest.TempPathFactory) -> Finished:
    """Healthy, ZeRO-3 through TrainingArguments(deepspeed=dict), the adapter loaded with
    PeftModel.from_pretrained; evaluation and a checkpoint every 3 steps."""
    out = tmp_path_factory.mktemp("trainer") / "run"
    return probed(out, torchrun_trainer("--adapter", "from_pretrained", "--steps", "6"))


def test_trainer_steps_line_up_with_global_step(trainer_zero3: Finished) -> None:
    fin = trainer_zero3
    assert fin.proc.returncode == 0, failure(fin)
    assert "train_trainer: done global_step=6 evals=[3, 6] saves=[3, 6]" in fin.proc.stdout
    run = load_run(fin.out)
    assert sorted(run.ranks) == [0, 1]
    for rank in run.ranks.values():
        assert [s["step"] for s in rank.steps] == [1, 2, 3, 4, 5, 6]
        assert {s["src"] for s in rank.steps} == {"deepspeed"}
        for phase in ("eval", "save"):
            begins = [p["step"] for p in rank.phases if p["name"] == phase and p["edge"] == "begin"]
            assert begins == [3, 6], phase  # after the Trainer's global_step 3 and 6, once each
        assert rank.configs["deepspeed"]["zero_optimization"]["stage"] == 3
        assert rank.configs["lora"]["default"]["r"] == 8  # from PeftModel.from_pretrained
        assert rank.configs["trainer"]["max_steps"] == 6
    assert not {f["id"] for f in analyze(fin)["findings"]} & FIVE


def test_trainer_ddp_logits_spike_is_named(tmp_path: Path) -> None:
    fin = probed(tmp_path / "run", torchrun_trainer("--engine", "ddp", "--fault", "logits-spike", "--steps", "3"))
    assert fin.proc.returncode == 0, failure(fin)
    run = load_run(fin.out)
    assert all([s["src"] for s in r.steps] == ["torch"] * 3 for r in run.ranks.values())
    assert "lora" in run.ranks[0].configs and "deepspeed" not in run.ranks[0].configs
    top = analyze(fin)["findings"][0]
    assert top["id"] == "logits-spike" and top["ranks"] == [0, 1]
    assert top["details"]["logits_shape"] == [4, 128, 32000]


def test_trainer_rank0_only_save_under_zero3_is_named(tmp_path: Path) -> None:
    args = ["--fault", "rank0-save-gather", "--steps", "6", "--save-steps", "2", "--eval-steps", "100"]
    fin = probed(tmp_path / "run", torchrun_trainer(*args, "--pg-timeout", "15"))
    assert fin.proc.returncode != 0
    top = analyze(fin)["findings"][0]
    assert top["id"] == "rank-conditional-hang" and top["ranks"] == [0]
    assert "train_trainer.py" in top["title"] and "is_world_process_zero" in top["title"]


def test_trainer_add_adapter_config_is_recorded(tmp_path: Path) -> None:
    from importlib.metadata import version

    from packaging.version import Version
    from transformers.integrations.peft import MIN_PEFT_VERSION

    if Version(version("peft")) < Version(MIN_PEFT_VERSION):
        pytest.skip(f"transformers' add_adapter needs peft >= {MIN_PEFT_VERSION}; peft {version('peft')} is installed")
    cmd = [sys.executable, TRAINER, "--engine", "ddp", "--adapter", "add_adapter", "--steps", "2"]
    fin = probed(tmp_path / "run", cmd)
    assert fin.proc.returncode == 0, failure(fin)
    assert load_run(fin.out).ranks[0].configs["lora"]["default"]["r"] == 8


# -- accelerate launch -----------------------------------------------------------------
def documented_accelerate_launch() -> list[str]:
    """The `accelerate launch` line of probes/train_trainer.py's docstring, as a command."""
    import ast

    doc = ast.get_docstring(ast.parse(Path(TRAINER).read_text())) or ""
    [line] = [x.strip() for x in doc.splitlines() if x.strip().startswith("accelerate launch")]
    words = line.split("#", 1)[0].split()
    return [str(BIN / "accelerate"), *[TRAINER if w == "probes/train_trainer.py" else w for w in words[1:]]]


@pytest.mark.parametrize("processes", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_accelerate_launch(tmp_path: Path, processes: int) -> None:
    """Two processes: the launch probes/train_trainer.py documents (with accelerate 1.16,
    `--cpu --multi_gpu` together is refused; the Trainer's use_cpu keeps it on CPU)."""
    if processes == 2:
        launch = documented_accelerate_launch()
        cmd = [*launch[:2], "--main_process_port", str(free_port()), *launch[2:], "--steps", "3", "--eval-steps", "3"]
    else:
        cmd = [
            str(BIN / "accelerate"),
            "launch",
            "--cpu",
            "--num_processes",
            "1",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            TRAINER,
            "--engine",
            "ddp",
            "--steps",
            "3",
            "--eval-steps",
            "3",
        ]
    fin = probed(tmp_path / "run", cmd)
    assert fin.proc.returncode == 0, failure(fin)
    plural, ranks = ("1 process", "rank 0") if processes == 1 else (f"{processes} processes", "ranks 0, 1")
    assert processes <= 2 and last_line(fin) == f"lorascope: {plural} attached the probes ({ranks})"
    run = load_run(fin.out)
    assert run.world_size == processes and run.warnings == []
    for rank in run.ranks.values():
        assert rank.start["rank_source"] == ("lone" if processes == 1 else "env")
        assert [s["step"] for s in rank.steps] == [1, 2, 3]
        assert [p["step"] for p in rank.phases if p["name"] == "eval" and p["edge"] == "begin"] == [3]


def test_a_launcher_that_refuses_its_options_is_named(tmp_path: Path) -> None:
    """accelerate 1.16 refuses `--cpu --multi_gpu` (the launch probes/train_trainer.py
    documented before) and exits 1 before it starts any process: lorascope said only
    "no process attached the probes"."""
    cmd = [str(BIN / "accelerate"), "launch", "--cpu", "--multi_gpu", "--num_processes", "2", TRAINER]
    fin = probed(tmp_path / "run", cmd, rerun_teardown_abort=False)
    assert fin.proc.returncode == 1
    assert last_line(fin).startswith(
        "lorascope: no process attached the probes: the launcher (accelerate) exited with status 1 before it "
        "started any process of the job"
    ), fin.proc.stderr[-2000:]
