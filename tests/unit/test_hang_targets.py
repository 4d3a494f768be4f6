"""`lorascope hang` signals only processes proven to be the run's ranks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from lorascope.rundir.format.writer import Stream, record_launch, stream_prefix

LISTENER = """
import pathlib, signal, sys, time
def got(*_):
    pathlib.Path(sys.argv[1]).write_text("signalled")
signal.signal(signal.SIGURG, got)
print("ready", flush=True)
time.sleep(60)
"""


def fake_run(tmp_path: Path, pid: int, started: float) -> Path:
    run = tmp_path / "run"
    record_launch(run, "h-1", ["job"])
    for rank, rank_pid in ((0, pid), (1, pid)):
        stream = Stream(stream_prefix(run, rank, socket.gethostname(), rank_pid + rank))
        stream.write(
            {
                "k": "start",
                "t": started,
                "rank": rank,
                "world_size": 2,
                "local_rank": rank,
                "pid": rank_pid,
                "host": socket.gethostname(),
                "argv": [],
                "versions": {},
                "device": "cpu",
            }
        )
        stream.close()
    return run


def listener(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.Popen[str], Path]:
    marker = tmp_path / "marker"
    proc = subprocess.Popen(
        [sys.executable, "-c", LISTENER, str(marker)], stdout=subprocess.PIPE, text=True, env={**os.environ, **env}
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc, marker


def hang(run: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lorascope", "hang", str(run), "--wait", "0.5", "--no-html"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PATH": ""},
    )  # no py-spy on PATH: nothing else reads it


def test_a_pid_now_owned_by_another_process_is_not_signalled(tmp_path: Path) -> None:
    proc, marker = listener(tmp_path, {})
    try:
        res = hang(fake_run(tmp_path, proc.pid, started=time.time()))
        time.sleep(0.5)
        assert not marker.exists(), "an unrelated process was signalled"
        assert "not this run's" in res.stdout and "not signalled" in res.stdout
    finally:
        proc.kill()
        proc.wait()


def test_a_recycled_pid_with_the_runs_environment_is_not_signalled(tmp_path: Path) -> None:
    """Same run directory in its environment, but it started after the rank's record."""
    run_dir = tmp_path / "run"
    proc, marker = listener(tmp_path, {"LORASCOPE_RUN_DIR": str(run_dir)})
    try:
        res = hang(fake_run(tmp_path, proc.pid, started=time.time() - 3600))
        time.sleep(0.5)
        assert not marker.exists()
        assert "reused" in res.stdout
    finally:
        proc.kill()
        proc.wait()


def test_the_runs_own_rank_is_signalled(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc, marker = listener(tmp_path, {"LORASCOPE_RUN_DIR": str(run_dir)})
    try:
        hang(fake_run(tmp_path, proc.pid, started=time.time() + 5))
        time.sleep(0.5)
        assert marker.read_text() == "signalled"
    finally:
        proc.kill()
        proc.wait()


def test_a_rank_reached_only_through_pythonpath_is_the_runs(tmp_path: Path) -> None:
    """A remote rank started over pdsh/ssh sees only PYTHON* variables: its PYTHONPATH entry
    in this run's bootstrap folder proves it is the run's, and it is signalled; a bootstrap
    folder of another run does not."""
    started = time.time() + 1  # the fake rank started after the listener
    run = tmp_path / "run"
    proc, marker = listener(tmp_path, {"PYTHONPATH": str(run / "bootstrap" / "h-1")})
    try:
        hang(fake_run(tmp_path, proc.pid, started=started))
        deadline = time.time() + 10
        while not marker.exists() and time.time() < deadline:
            time.sleep(0.1)
        assert marker.exists(), "the run's own rank was not signalled"
    finally:
        proc.kill()
        proc.wait()
    other = tmp_path / "other"
    other.mkdir()
    proc, marker = listener(other, {"PYTHONPATH": str(tmp_path / "elsewhere" / "bootstrap" / "h-1")})
    try:
        res = hang(fake_run(other, proc.pid, started=started))
        time.sleep(0.5)
        assert not marker.exists() and "not this run's" in res.stdout
    finally:
        proc.kill()
        proc.wait()
