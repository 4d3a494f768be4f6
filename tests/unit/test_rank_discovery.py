"""Rank discovery from launcher variables, the launcher rule, and what a run directory
without any rank stream tells (pure functions and small files; no torch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lorascope.cli.run import _attached_line
from lorascope.errors import NothingRecordedError
from lorascope.probes.bootstrap import role
from lorascope.rundir.format.ranks import Identity, discover, is_launcher, program
from lorascope.rundir.format.writer import Stream, record_launch, stream_prefix
from lorascope.rundir.loading.attachments import attached_processes, why_none_attached
from lorascope.rundir.loading.reader import load_run
from tests.helpers import LORASCOPE


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8"}, (3, 1, 8, "env")),
        ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "SLURM_PROCID": "0"}, (3, 1, 8, "env")),
        ({"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "6"}, (5, 1, 6, "slurm")),
        (
            {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4"},
            (2, 0, 4, "ompi"),
        ),
        ({"PMI_RANK": "1", "PMI_SIZE": "2"}, (1, 0, 2, "pmi")),
        ({"RANK": "x", "PMI_RANK": "1", "PMI_SIZE": "2"}, (1, 0, 2, "pmi")),  # unparsable: next source
        ({"RANK": "4"}, (4, 0, 5, "env")),  # no world size: at least rank + 1
        ({}, (0, 0, 1, "lone")),
    ],
)
def test_discover(env: dict[str, str], expected: tuple[int, int, int, str]) -> None:
    got = discover(env)
    assert (got.rank, got.local_rank, got.world_size, got.source) == expected


@pytest.mark.parametrize(
    "argv, name",
    [
        (["python", "-m", "torch.distributed.run", "--nproc_per_node", "2", "t.py"], "torch.distributed.run"),
        (["python", "-u", "-X", "dev", "-mdeepspeed.launcher.launch", "x"], "deepspeed.launcher.launch"),
        (["/venv/bin/python", "/venv/bin/torchrun", "t.py"], "torchrun"),
        (["python", "-W", "ignore", "train.py", "-m", "x"], "train"),
        (["python", "-c", "print(1)"], "-c"),
        (["python"], None),
    ],
)
def test_program(argv: list[str], name: str | None) -> None:
    assert program(argv) == name


def test_roles() -> None:
    rank1 = Identity(1, 1, 2, "env")
    assert role(rank1, {}, ["python", "train.py"]) == "rank"
    assert role(rank1, {}, ["python", "/bin/torchrun", "train.py"]) == "launcher"
    assert is_launcher(["python", "-m", "accelerate.commands.launch", "t.py"])
    child = {"LORASCOPE_ATTACHED_PID": "1", "LORASCOPE_ATTACHED_AS": rank1.key}
    assert role(rank1, child, ["python", "-c", "x"]) == "child"  # e.g. a DataLoader worker
    # a rank started by a process probed as something else (an unknown launcher) is a rank
    assert role(rank1, {**child, "LORASCOPE_ATTACHED_AS": "lone:0/1"}, ["python", "t.py"]) == "rank"
    assert role(Identity(0, 0, 1, "lone"), {}, ["python", "train.py"]) == "lone"


def _stream(run: Path, rank: int, pid: int, **start: object) -> None:
    s = Stream(stream_prefix(run, rank, "h", pid))
    s.write(
        {
            "k": "start",
            "rank": rank,
            "world_size": 2,
            "local_rank": rank,
            "pid": pid,
            "host": "h",
            "argv": [],
            "versions": {},
            "device": "cpu",
            **start,
        }
    )
    s.write({"k": "end", "status": "exit", "code": 0})
    s.close()


def test_a_lone_process_that_started_probed_ranks_is_left_out(tmp_path: Path) -> None:
    record_launch(tmp_path, "h-1", ["mylauncher"])
    _stream(tmp_path, 0, 10, world_size=1, rank_source="lone")
    _stream(tmp_path, 0, 11, rank_source="env", probed_parent=10)
    _stream(tmp_path, 1, 12, rank_source="env", probed_parent=10)
    run = load_run(tmp_path)
    assert {r: d.pid for r, d in run.ranks.items()} == {0: 11, 1: 12}
    assert any("pid 10 on h attached as a lone process but started probed ranks" in w for w in run.warnings)
    assert not any("processes wrote this rank" in w for w in run.warnings)


def test_a_frameworks_cli_that_started_the_ranks_is_left_out_quietly(tmp_path: Path) -> None:
    """`FORCE_TORCHRUN=1 llamafactory-cli train` imports torch (a lone process), then starts
    torchrun: every run ended "3 processes attached the probes (ranks 0, 1)" and warned that
    the llamafactory-cli parent was left out."""
    record_launch(tmp_path, "h-1", ["llamafactory-cli", "train", "lora.yaml"])
    _stream(tmp_path, 0, 10, world_size=1, rank_source="lone", argv=["/venv/bin/llamafactory-cli", "train", "x.yaml"])
    _stream(tmp_path, 0, 11, rank_source="env", probed_parent=10)
    _stream(tmp_path, 1, 12, rank_source="env", probed_parent=10)
    run = load_run(tmp_path)
    assert {r: d.pid for r, d in run.ranks.items()} == {0: 11, 1: 12}
    assert run.warnings == []
    attached = attached_processes(tmp_path)
    assert len(attached) == 3
    line = _attached_line(attached, tmp_path, ["llamafactory-cli"], "h-1", True, 0)
    assert line == "lorascope: 2 processes attached the probes (ranks 0, 1)"


def test_a_launcher_that_failed_before_any_rank_is_named_with_its_status(tmp_path: Path) -> None:
    """`accelerate launch --cpu --multi_gpu ...` refuses its options and exits 1: lorascope
    said only that no process attached (the launcher had loaded the bootstrap)."""
    record_launch(tmp_path, "h-1", ["accelerate", "launch", "t.py"], end=1.0, exit_status=1)
    (tmp_path / "bootstrap" / "h-1").mkdir(parents=True)
    line = json.dumps({"role": "launcher", "program": "accelerate"}) + "\n"
    (tmp_path / "bootstrap" / "h-1" / "processes.jsonl").write_text(line)
    why = why_none_attached(tmp_path, [["accelerate", "launch", "t.py"]], "h-1", 1)
    assert why.startswith("the launcher (accelerate) exited with status 1 before it started any process of the job")
    with pytest.raises(NothingRecordedError, match=r"the launcher \(accelerate\) exited with status 1"):
        load_run(tmp_path)


def test_no_rank_stream_is_an_error_with_the_likely_reason(tmp_path: Path) -> None:
    record_launch(tmp_path, "h-1", ["python", "-E", "train.py"])
    with pytest.raises(NothingRecordedError, match=r"no process attached the probes.*python -E"):
        load_run(tmp_path)
    other = tmp_path / "other"
    record_launch(other, "h-1", ["torchrun", "train.py"])
    (other / "bootstrap" / "h-1").mkdir(parents=True)
    lines = [{"role": "launcher", "program": "torchrun"}, {"role": "lone", "program": "prep"}]
    (other / "bootstrap" / "h-1" / "processes.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    res = subprocess.run([*LORASCOPE, "analyze", str(other), "--fail-on", "warning"], capture_output=True, text=True)
    assert res.returncode == 3 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    assert "2 Python processes loaded the bootstrap (1 launcher, 1 lone) and none attached" in res.stderr
    assert "(prep) attaches when it imports torch" in res.stderr
    empty = tmp_path / "empty"
    record_launch(empty, "h-1", ["bash", "job.sh"])
    with pytest.raises(NothingRecordedError, match="no Python process loaded the bootstrap"):
        load_run(empty)


def test_run_says_how_many_processes_attached(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    none = subprocess.run(
        [*LORASCOPE, "run", "--out", str(tmp_path / "none"), "--", sys.executable, "-c", "print('job ran')"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert none.returncode == 0 and none.stdout == "job ran\n"  # the job's own exit status
    last = none.stderr.strip().splitlines()[-1]
    assert last.startswith("lorascope: no process attached the probes: 1 Python process loaded the bootstrap (1 lone)")
