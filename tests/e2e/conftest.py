"""Helpers for the end-to-end tests: they run the real 2-rank LoRA job (probes/train_lora.py)
on CPU over gloo, under `lorascope run`."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "probes" / "train_lora.py")
LORASCOPE = [sys.executable, "-m", "lorascope"]
JOB_TIMEOUT = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def torchrun(port: int, *args: str, nproc: int = 2) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(port),
        TRAIN,
        *args,
    ]


@dataclass
class Finished:
    out: Path
    proc: subprocess.CompletedProcess[str]

    def summary(self) -> dict:
        res = subprocess.run(
            [*LORASCOPE, "analyze", str(self.out), "--json"], capture_output=True, text=True, timeout=60
        )
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout)


def probed(out: Path, cmd: list[str], *extra: str) -> Finished:
    proc = subprocess.run(
        [*LORASCOPE, "run", "--out", str(out), *extra, "--", *cmd],
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT,
        env=job_env(),
    )
    return Finished(out, proc)


def losses(stdout: str) -> list[str]:
    """The per-step losses rank 0 prints with --print-losses, as exact text."""
    return re.findall(r"^step \d+ loss (\S+)$", stdout, flags=re.M)


@pytest.fixture(scope="session")
def torchrun_run(tmp_path_factory: pytest.TempPathFactory) -> Finished:
    """The healthy job, 20 steps under torchrun, probed (shared by several tests)."""
    out = tmp_path_factory.mktemp("torchrun") / "run"
    return probed(out, torchrun(free_port(), "--steps", "20", "--print-losses"))


@pytest.fixture(scope="session")
def bare_losses() -> list[str]:
    """Rank 0's losses of the same 20-step job without lorascope."""
    bare = subprocess.run(
        torchrun(free_port(), "--steps", "20", "--print-losses"),
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT,
        env=job_env(),
    )
    assert bare.returncode == 0, bare.stderr[-3000:]
    return losses(bare.stdout)
