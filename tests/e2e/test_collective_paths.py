"""Collective paths through libraries, on a real 2-rank gloo job (probes/collective_paths.py)
under `lorascope run`: an async collective is in flight until its work completes, a
library's collective made under the user's rank condition is named at the user's line,
and a rank killed at random points loses none of its calls and none of its steps."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from lorascope.rundir.format.layout import (
    CALL,
    CALL_FIELDS,
    HEADER,
    HEADER_FIELDS,
    MAGIC,
    STEP,
    STEP_END,
    STEP_FIELDS,
    STEPS_MAGIC,
)
from lorascope.rundir.format.schema import SHAPE_FIELDS
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


def _truth(path: Path) -> tuple[int, list[tuple[str, float]]]:
    events = [(w, float(t)) for w, *_, t in (line.split() for line in path.read_text().splitlines())]
    pid = int(path.read_text().split()[1])
    return pid, events[1:]


def _on_disk(run: Path, rank: int) -> tuple[list[dict], dict[int, dict]]:
    """The rank's stream records as the kill left them (a torn last line skipped), and its
    calls from the call file by sequence number, each with its shape's fields (the
    layout read straight from layout.py: what is on disk, not what a reader makes of it)."""
    [stream] = (run / "ranks" / f"rank-{rank}").glob("*.0000.jsonl")
    lines = stream.read_bytes().split(b"\n")
    records = []
    shapes: dict[int, dict] = {}
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            assert i >= len(lines) - 2, f"{stream}:{i + 1}: a corrupt line before the last"
            continue
        if rec["k"] == "shape":
            shapes[rec["id"]] = {k: rec[k] for k in SHAPE_FIELDS}
        records.append(rec)
    [calls_file] = (run / "ranks" / f"rank-{rank}").glob("*.calls")
    data = calls_file.read_bytes()
    head = dict(zip((f for f, _, _ in HEADER_FIELDS), HEADER.unpack_from(data), strict=True))
    assert head["magic"] == MAGIC and head["record_size"] == CALL.size
    calls: dict[int, dict] = {}
    for index in range(head["count"]):
        rec = dict(
            zip((f for f, _, _ in CALL_FIELDS), CALL.unpack_from(data, HEADER.size + index * CALL.size), strict=True)
        )
        assert rec["stamp"] == index + 1, f"{calls_file}: record {index} torn or unwritten"
        assert rec["shape"] in shapes, f"{calls_file}: record {index} names shape {rec['shape']}, not on disk"
        calls[rec["seq"]] = {**rec, **shapes[rec["shape"]]}
    return records, calls


def _steps_on_disk(run: Path, rank: int) -> set[int]:
    """The numbers of the steps in the rank's steps file as the kill left it (the layout
    read straight from layout.py)."""
    [steps_file] = (run / "ranks" / f"rank-{rank}").glob("*.steps")
    data = steps_file.read_bytes()
    head = dict(zip((f for f, _, _ in HEADER_FIELDS), HEADER.unpack_from(data), strict=True))
    assert head["magic"] == STEPS_MAGIC and head["record_size"] == STEP.size
    numbers = set()
    for index in range(head["count"]):
        rec = dict(
            zip((f for f, _, _ in STEP_FIELDS), STEP.unpack_from(data, HEADER.size + index * STEP.size), strict=True)
        )
        assert rec["stamp"] == index + 1, f"{steps_file}: record {index} torn or unwritten"
        if rec["kind"] == STEP_END:
            numbers.add(rec["step"])
    return numbers


def _kill_at(out: Path, truth: Path, after: float, signum: int, *job: str) -> float:
    """Run the job probed, send rank 1 ``signum`` ``after`` seconds into its steady state;
    the time it was sent."""
    cmd = torchrun(
        free_port(),
        "--steps",
        "1000000",
        "--step-seconds",
        "0.002",
        "--pg-timeout",
        "5",
        "--truth",
        str(truth),
        *job,
        script=JOB,
    )
    launch = subprocess.Popen(
        [*LORASCOPE, "run", "--out", str(out), "--", *cmd],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=job_env(),
    )
    try:
        rank1 = Path(f"{truth}.rank1")
        deadline = time.monotonic() + 120
        while not (rank1.exists() and rank1.read_text().count("step ") >= 50):
            assert launch.poll() is None and time.monotonic() < deadline, "the job did not reach its steps"
            time.sleep(0.05)
        time.sleep(after)
        pid, _ = _truth(rank1)
        killed_at = time.time()
        os.kill(pid, signum)
        launch.wait(timeout=120)
    finally:
        if launch.poll() is None:
            launch.kill()
    return killed_at


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGABRT], ids=["SIGKILL", "SIGABRT"])
def test_a_killed_rank_loses_no_call(tmp_path: Path, signum: int) -> None:
    """Calls are written in place before they start, their ends when they end: a rank
    killed (SIGKILL; SIGABRT, as ``abort()`` raises it) at random points, in a call or
    between, has on disk every call it made, with its site, and every end it saw. What the
    job itself saw (written unbuffered) says which: each call it made, each call's end
    once it had returned, each step once its optimizer step had returned (the steps file
    is written in place too)."""
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    for kill in range(2):
        out, truth = tmp_path / f"run{kill}", tmp_path / f"truth{kill}"
        after = rng.uniform(0.0, 1.5)
        # kill 0: every call async (in flight while the job computes); kill 1: the job as it is
        killed_at = _kill_at(out, truth, after, signum, *(["--async-reduce"] if kill == 0 else []))
        where = f"{signal.Signals(signum).name} {kill} ({after:.3f} s into the steps; seed {seed})"
        _, events = _truth(Path(f"{truth}.rank1"))
        records, calls = _on_disk(out, 1)
        steps = _steps_on_disk(out, 1)
        assert not any(r["k"] == "end" for r in records), f"{where}: the rank was not killed"
        seq, step = 0, 0
        last_call = max(i for i, (what, _) in enumerate(events) if what == "call")
        for i, (what, t) in enumerate(events):
            if what == "call":
                seq += 1
                if i == last_call and seq not in calls:
                    continue  # killed after the job said so, before the call began
                assert seq in calls, f"{where}: call {seq}, made {killed_at - t:.3f} s before the kill, is lost"
                assert calls[seq]["site"] and "collective_paths.py" in calls[seq]["site"], f"{where}: call {seq}"
            elif what in ("returned", "waited"):  # an async call ends inside the job's wait()
                assert calls[seq]["end"] > 0, f"{where}: the end of call {seq} ({killed_at - t:.3f} s before) is lost"
            elif what == "step":
                step += 1
                assert step in steps, f"{where}: step {step}, {killed_at - t:.3f} s before the kill, is lost"
        assert seq >= 100, f"{where}: only {seq} calls"
        ops = [calls[s]["op"] for s in sorted(calls)][:3]
        assert ops == ["all_gather_into_tensor", "all_reduce", "all_reduce"], f"{where}: calls not matched: {ops}"
        if kill == 0:
            assert all(c["async"] for c in calls.values()), f"{where}: the calls are async"
