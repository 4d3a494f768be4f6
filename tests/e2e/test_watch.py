"""`lorascope watch` on a real probed 2-rank job, in an 80x24 tmux pane read back with
``capture-pane``: a planted stall (rank 1 sleeps outside any collective, rank 0 waits in
the next one) shows within 2 s of being detectable, Ctrl-C exits 130 without a
traceback, and the verdict is printed when the run ends."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import statistics
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from lorascope.analysis.live import STALL_FACTOR, STALL_MIN_S
from lorascope.rundir.loading.reader import load_run
from tests.helpers import LORASCOPE, REPO, free_port, job_env, torchrun

FAULT_STEP = 7
STALL_S = 12
#: rank 0's row with a pending call: "0  6 ... reduce_scatter_tensor 1.4s · ..."
PENDING = re.compile(r"^0\s+\d+\s.*?([a-z_]+) (\d+\.\d)s")

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (apt-get install -y tmux)")


@contextmanager
def _pane(name: str, run_dir: Path) -> Iterator[str]:
    """`lorascope watch RUN_DIR` in a detached 80x24 tmux session; its exit status is
    printed after it as EXIT=N."""
    env = f"PYTHONPATH={shlex.quote(os.environ.get('PYTHONPATH', str(REPO)))}"
    watch = shlex.join([*LORASCOPE, "watch", str(run_dir)])
    shell = f"cd {shlex.quote(str(REPO))} && env {env} {watch}; echo EXIT=$?; sleep 600"
    subprocess.run(["tmux", "new-session", "-d", "-s", name, "-x", "80", "-y", "24", shell], check=True)
    try:
        yield name
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], check=False, capture_output=True)


def _screen(name: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", name], capture_output=True, text=True).stdout


def _wait_for(name: str, text: str, timeout: float) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        screen = _screen(name)
        if text in screen:
            return screen
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not on the screen after {timeout} s:\n{_screen(name)}")


def _steps(run_dir: Path, rank: int) -> list[dict]:
    return load_run(run_dir).ranks[rank].steps


def test_watch_shows_a_planted_stall_live_then_the_verdict(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = torchrun(free_port(), "--steps", "14", "--fault", "rank1-stall", "--fault-step", str(FAULT_STEP),
                   "--stall-seconds", str(STALL_S), "--pg-timeout", "60")  # fmt: skip
    job = subprocess.Popen(
        [*LORASCOPE, "run", "--out", str(out), "--", *cmd],
        env=job_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    tag = f"lorascope-watch-{os.getpid()}"
    try:
        deadline = time.time() + 60
        while not (out / "manifest.json").exists() and time.time() < deadline:
            time.sleep(0.1)
        with _pane(tag, out) as pane:
            stall_seen: float | None = None
            # rank 0's pending call, frame after frame: (op, age first shown, age last shown)
            streak: tuple[str, float, float] | None = None
            deadline = time.time() + 240
            while job.poll() is None and time.time() < deadline:
                lines = _screen(pane).splitlines()
                match = next((m for line in lines if (m := PENDING.match(line))), None)
                if match is None:
                    streak = None
                else:
                    op, age = match.group(1), float(match.group(2))
                    same = streak is not None and streak[0] == op and age >= streak[2]
                    streak = (op, streak[1] if same and streak else age, age)
                if any(re.match(r"^1\s+\d+\s.*no step", line) for line in lines):
                    stall_seen = time.time()
                    break
                time.sleep(0.1)
            pending_age = streak[1] if streak else None  # how long the call had been pending when first shown
            assert stall_seen is not None, _screen(pane)
            screen = _screen(pane)
            assert "not-stepping rank 1: no step for" in screen and "in no collective" in screen, screen
            assert re.search(r"waiting rank 0: in \S+ \d+\.\d s, no step", screen), screen

            with _pane(tag + "-quit", out) as quit_pane:  # a second watch, quit with Ctrl-C mid-stall
                _wait_for(quit_pane, "Ctrl-C quits", 30)
                subprocess.run(["tmux", "send-keys", "-t", quit_pane, "C-c"], check=True)
                quit_screen = _wait_for(quit_pane, "EXIT=", 10)
            assert "EXIT=130" in quit_screen and "Traceback" not in quit_screen, quit_screen
            assert "lorascope: aborted" in quit_screen

            assert job.wait(timeout=240) == 0, job.stderr.read() if job.stderr else ""
            final = _wait_for(pane, "EXIT=", 120)
        assert "EXIT=0" in final and "verdict:" in final, final
        assert all(len(line) <= 80 for line in final.splitlines())
    finally:
        if job.poll() is None:
            job.kill()
        job.wait()

    before = [s for s in _steps(out, 1) if s["step"] < FAULT_STEP]
    onset = before[-1]["t"]  # rank 1's last step before it slept
    median = statistics.median(s["dur"] for s in before)
    detectable = onset + max(STALL_MIN_S, STALL_FACTOR * median)
    latency = stall_seen - detectable
    print(f"stall on screen {stall_seen - onset:.2f} s after rank 1's last step, {latency:.2f} s after detectable")
    assert latency <= 2.0, (latency, median)
    assert pending_age is not None and pending_age <= 2.0, pending_age  # rank 0's call shown within 2 s
