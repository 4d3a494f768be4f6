"""Collective paths through libraries, on a real 2-rank gloo job (probes/collective_paths.py)
under `lorascope run`: an async collective is in flight until its work completes, and a
library's collective made under the user's rank condition is named at the user's line."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.helpers import LORASCOPE, free_port, job_env, torchrun

pytestmark = pytest.mark.e2e

JOB = str(Path(__file__).resolve().parents[2] / "probes" / "collective_paths.py")


def run_job(out: Path, *args: str) -> dict:
    cmd = torchrun(free_port(), "--pg-timeout", "8", *args, script=JOB)
    env = {**job_env(), "LORASCOPE_STALL_SECONDS": "3"}
    subprocess.run(
        [*LORASCOPE, "run", "--out", str(out), "--", *cmd], capture_output=True, text=True, timeout=180, env=env
    )
    res = subprocess.run([*LORASCOPE, "analyze", str(out), "--json"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_async_collective_is_in_flight_until_its_work_completes(tmp_path: Path) -> None:
    """Rank 0 issued the step's async all_gather and blocks in work.wait(); rank 1 stalls
    in its own code. Before: rank 0 looked 'in its own code (no collective in flight)'."""
    data = run_job(tmp_path / "run", "--fault", "async-stall")
    top = data["findings"][0]
    assert top["id"] == "hung-ranks" and top["ranks"] == [1]
    states = {s["rank"]: s for s in top["details"]["hang"]["ranks"]}
    assert states[0]["state"] == "in-collective"
    assert states[0]["pending"][0]["op"] == "all_gather_into_tensor"
    assert states[1]["state"] == "outside-collectives"


def test_library_collective_under_the_users_rank_condition(tmp_path: Path) -> None:
    """Rank 0 calls a library's save helper (an all_gather in site-packages/lorasave.py)
    under `if rank == 0:`; the call site is the library's frame, the condition the user's."""
    data = run_job(tmp_path / "run", "--fault", "save-rank0")
    top = data["findings"][0]
    assert top["id"] == "rank-conditional-hang" and top["ranks"] == [0] and top["confidence"] == "high"
    assert "all_gather at lorasave.py" in top["title"]
    assert "called from collective_paths.py" in top["title"] and "`if rank == 0:`" in top["title"]
    called = [e for e in top["evidence"] if e["label"] == "rank 0 called it from"]
    assert called and "lorasave.save_full" in called[0]["value"]


def test_healthy_async_steps_end_every_call(tmp_path: Path) -> None:
    data = run_job(tmp_path / "run", "--steps", "5")
    assert data["findings"] == []
    assert not list((tmp_path / "run").rglob("*.fatal.txt")), "an exit leaves no empty faulthandler file"
    for rank in data["ranks"]:
        assert rank["ended"]["status"] == "exit" and rank["collectives"]["pending"] == []
        assert rank["collectives"]["count"] == 15  # per step: the async all_gather, two all_reduces


def test_cpp_abort_is_how_the_rank_ended_and_a_mismatch_is_not_a_hang(tmp_path: Path) -> None:
    """gloo aborts a rank (SIGABRT from C++, no Python exception) on a size mismatch: the
    rank's ending is the fatal signal faulthandler wrote down, and the verdict is the
    mismatch that crashed the job, not a hang."""
    data = run_job(tmp_path / "run", "--fault", "size-mismatch")
    top = data["findings"][0]
    assert top["id"] == "collective-mismatch" and top["ranks"] == [0, 1]
    assert "with different sizes (32 B on rank 0, 16 B on rank 1)" in top["title"]
    aborted = [r for r in data["ranks"] if r["ended"]["status"] == "signal" and r["ended"]["code"] == -6]
    assert aborted and "Fatal Python error: Aborted" in aborted[0]["ended"]["detail"]
    assert f"rank {aborted[0]['rank']}: Fatal Python error: Aborted" in top["title"]
    assert all(f["id"] != "rank-conditional-hang" for f in data["findings"])
