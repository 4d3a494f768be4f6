"""`lorascope attach` on the real 2-rank DeepSpeed job started WITHOUT lorascope (gdb,
Python 3.11 here): attached mid-run, then a rank-0-only collective planted after the
attach (``--fault rank-conditional-on-trigger``): `hang` and `analyze` on the run
directory name it at the job's line; and a job already hung when attached gets its
verdict from the dumps taken at the attach."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from lorascope.rundir.loading.reader import load_run
from tests.e2e.test_hang import end_job, hang, pending_in_job, wait_until
from tests.helpers import LORASCOPE, REPO, default_signals, free_port, job_env, torchrun, why_no_ptrace

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(why_no_ptrace() is not None, reason=str(why_no_ptrace())),
]

ATTACH_JOB = str(REPO / "probes" / "train_lora_attach.py")
TRAIN_LORA = REPO / "probes" / "train_lora.py"


def line_of(func: str, text: str) -> int:
    """The line of ``text`` inside ``func`` of probes/train_lora.py."""
    lines = TRAIN_LORA.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"def {func}("))
    return next(i for i in range(start, len(lines)) if text in lines[i]) + 1


@contextmanager
def bare_job(tmp_path: Path, *args: str, script: str = ATTACH_JOB) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """The 2-rank job without lorascope, rank 0's stdout in a file; ended on exit."""
    log = tmp_path / "job.out"
    env = {**job_env(), "TRAIN_LORA_TRIGGER": str(tmp_path / "trigger")}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            torchrun(free_port(), *args, script=script, launcher=["--monitor-interval", "600"]),
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=default_signals,
        )
    try:
        yield proc, log
    finally:
        end_job(proc)


def last_step(log: Path) -> int:
    found = re.findall(r"^step (\d+) loss", log.read_text(), flags=re.M)
    return int(found[-1]) if found else 0


def wait_for(check, timeout: float = 240.0, what: str = "") -> None:  # type: ignore[no-untyped-def]
    deadline = time.time() + timeout
    while time.time() < deadline:
        if check():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def attach(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LORASCOPE, "attach", "--out", str(out), *args], capture_output=True, text=True, timeout=240)


def analyze(out: Path) -> dict:
    res = subprocess.run([*LORASCOPE, "analyze", str(out), "--json"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_attach_mid_run_then_a_planted_rank0_collective(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ("--steps", "100000", "--print-losses", "--fault", "rank-conditional-on-trigger", "--pg-timeout", "900")
    with bare_job(tmp_path, *args) as (proc, log):
        wait_for(lambda: last_step(log) >= 3, what="the job's third step")
        res = attach(out, "--launcher", str(proc.pid), "--json")
        assert res.returncode == 0, res.stdout + res.stderr
        entry = json.loads(res.stdout)
        assert [p["rank"] for p in entry["processes"]] == [0, 1]
        assert all(p["ok"] and p["how"][0] == "gdb-queue" for p in entry["processes"]), entry
        # attached from now on: each rank's stream begins with the attach, its dump taken at once
        run = wait_until(out, lambda r: all(r.ranks[n].dumps and r.ranks[n].steps for n in (0, 1)))
        for rank in run.ranks.values():
            assert rank.start["attached"]["how"] == "gdb-queue"
            assert rank.dumps[0]["reason"] == "attach" and "Thread MainThread" in rank.dumps[0]["stacks"]
        # the fault, planted after the attach: rank 0 alone all_reduces a few steps on
        (tmp_path / "trigger").write_text(str(last_step(log) + 6))
        wait_until(out, lambda r: pending_in_job(r.ranks[0], "rank_conditional_on_trigger"))
        data = hang(out, "--no-html", "--wait", "20")  # dumps, not py-spy, even on a loaded machine
        summary = analyze(out)
    line = f"train_lora.py:{line_of('rank_conditional_on_trigger', 'dist.all_reduce(flag)')}"
    assert data["kind"] == "rank-conditional-hang" and data["odd_ranks"] == [0], data["verdict"]
    assert line in data["first_diverged"]["where"] and "if d.rank == 0:" in data["first_diverged"]["where"]
    assert data["ranks"][0]["dumped"] == "signal" and data["ranks"][1]["dumped"] == "signal"  # the wakeup path
    top = summary["findings"][0]
    assert top["id"] == "rank-conditional-hang" and top["ranks"] == [0], top["title"]
    assert line in json.dumps(top)
    assert any("attached to a running job" in w for w in summary["warnings"])


@pytest.mark.slow
def test_attach_to_a_job_already_hung(tmp_path: Path) -> None:
    """Both ranks are blocked in native code (gloo) when attached: the queued call is never
    run, gdb's direct path is; the attach dump's stacks give the verdict."""
    out = tmp_path / "run"
    args = ("--steps", "100000", "--print-losses", "--fault", "rank-conditional-hang", "--fault-step", "3")
    with bare_job(tmp_path, *args, "--pg-timeout", "900", script=str(REPO / "probes" / "train_lora.py")) as (proc, log):
        wait_for(lambda: last_step(log) >= 2, what="the job's second step")
        time.sleep(3)  # into the hang
        res = attach(out, "--launcher", str(proc.pid), "--json", "--wait", "2")
        assert res.returncode == 0, res.stdout + res.stderr
        entry = json.loads(res.stdout)
        assert all(p["ok"] and p["how"][:2] == ["gdb-queue", "gdb-direct"] for p in entry["processes"]), entry
        wait_until(out, lambda r: all(r.ranks[n].dumps for n in (0, 1)))
        data = hang(out, "--no-html")
    line = f"train_lora.py:{line_of('rank_conditional_collective', 'dist.all_reduce(flag)')}"
    assert data["kind"] == "rank-conditional-hang" and data["odd_ranks"] == [0], data["verdict"]
    assert line in data["first_diverged"]["where"] and "if d.rank == 0:" in data["first_diverged"]["where"]
    assert "begun before lorascope attached" in json.dumps(data["ranks"])
    run = load_run(out)
    assert {d["reason"] for r in run.ranks.values() for d in r.dumps} >= {"attach"}
