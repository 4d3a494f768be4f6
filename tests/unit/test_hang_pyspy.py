"""`lorascope hang --pid`: stacks read with `py-spy dump --json` from real processes (py-spy
needs ptrace: root, or kernel.yama.ptrace_scope 0), written as the probes' thread dumps and
diagnosed with the same parser."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lorascope.detect.hang.diagnosis import main_thread_frame
from lorascope.hang.collect import py_spy_dump, py_spy_message, stacks_text
from lorascope.rundir.format.writer import Stream, record_launch, stream_prefix
from tests.helpers import HANG_JSON_KEYS, Steps

#: A process whose main thread waits inside a function named like a collective.
IN_COLLECTIVE = "import time\ndef all_reduce():\n    time.sleep(60)\nall_reduce()\n"
OUTSIDE = "import time\ndef load_batch():\n    time.sleep(60)\nload_batch()\n"


def _can_trace() -> str | None:
    if shutil.which("py-spy") is None:
        return "py-spy is not installed"
    scope = Path("/proc/sys/kernel/yama/ptrace_scope")
    if scope.exists() and scope.read_text().strip() not in ("0",) and not hasattr(sys, "getwindowsversion"):
        import os

        if os.geteuid() != 0:
            return "ptrace is restricted (yama ptrace_scope) and this is not root"
    return None


pytestmark = pytest.mark.skipif(_can_trace() is not None, reason=str(_can_trace()))


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    for name, code in (("busy.py", IN_COLLECTIVE), ("stuck.py", OUTSIDE)):
        script = tmp_path / name
        script.write_text(code)
        started.append(subprocess.Popen([sys.executable, str(script)]))
    time.sleep(1.5)  # into the sleep
    yield started
    for p in started:
        p.kill()
        p.wait()


def test_py_spy_json_reads_as_a_thread_dump(procs: list[subprocess.Popen[bytes]]) -> None:
    stacks = py_spy_dump(procs[0].pid)
    assert stacks.startswith("Thread MainThread:")
    assert main_thread_frame(stacks) == f"{Path(procs[0].args[1])}:3 in all_reduce"  # type: ignore[index]


def test_hang_pid_mode_names_who_is_outside_collectives(procs: list[subprocess.Popen[bytes]]) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "lorascope", "hang", "--json", "--pid", str(procs[0].pid), "--pid", str(procs[1].pid)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert set(data) == HANG_JSON_KEYS  # the keys of `hang RUN_DIR --json` (tests/e2e/test_hang.py)
    assert data["kind"] == "stuck-outside" and data["id"] == "hung-ranks"
    assert data["odd_ranks"] == [f"pid {procs[1].pid}"]
    assert "load_batch" in data["ranks"][1]["where"] and data["ranks"][0]["collective"] == "all_reduce"
    assert data["verdict"].startswith(f"pid {procs[1].pid} is stuck outside any collective (")


def test_native_frames_are_kept_but_not_taken_for_the_jobs_code() -> None:
    threads = [
        {
            "thread_name": "MainThread",
            "frames": [
                {
                    "name": "ncclGroupEnd",
                    "filename": "/usr/lib/libnccl.so.2",
                    "module": "/usr/lib/libnccl.so.2",
                    "short_filename": "libnccl.so.2",
                    "line": 0,
                },
                {"name": "step", "filename": "/job/train.py", "module": None, "short_filename": "train.py", "line": 42},
            ],
        }
    ]
    text = stacks_text(threads)
    assert "[native] ncclGroupEnd (libnccl.so.2)" in text
    assert main_thread_frame(text) == "/job/train.py:42 in step"


RANKED = (
    "import os, time\n"
    "rank = int(os.environ['RANK'])\n"
    "def all_reduce():\n"
    "    time.sleep(60)\n"
    "def barrier():\n"
    "    time.sleep(60)\n"
    "if rank == 0:\n"
    "    all_reduce()\n"
    "barrier()\n"
)


def test_hang_pid_mode_names_the_rank_condition_a_call_sits_in(tmp_path: Path) -> None:
    """From outside, rank 0 in a collective under `if rank == 0:` and rank 1 in another: the
    verdict names rank 0 and the condition (read from the job's source on this host), as
    `hang RUN_DIR` does; it said "the processes wait in different collectives"."""
    script = tmp_path / "ranked.py"
    script.write_text(RANKED)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    started = [
        subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r), "WORLD_SIZE": "2"}) for r in (0, 1)
    ]
    try:
        time.sleep(1.5)
        res = subprocess.run(
            [sys.executable, "-m", "lorascope", "hang", "--json", *sum((["--pid", str(p.pid)] for p in started), [])],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        for p in started:
            p.kill()
            p.wait()
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["kind"] == "rank-conditional-hang" and data["odd_ranks"] == ["rank 0"]
    assert data["verdict"].startswith(
        f"rank 0 is in all_reduce at {script}:4 in all_reduce, inside `if rank == 0:` at "
    )
    assert data["ranks"][0]["condition"] == ["if rank == 0:", f"{script}:8 in <module>"]
    assert data["ranks"][1]["condition"] is None


#: What py-spy printed for a stopped rank (RUST_BACKTRACE set): its message first, the
#: Rust backtrace after it; the last line is not the message.
PY_SPY_STDERR = """Error: Failed to get stack traces

Stack backtrace:
   0: anyhow::error::<impl anyhow::Error>::msg
   8: std::rt::lang_start::{{closure}}
   9: main
"""


def test_py_spys_failure_is_its_own_message() -> None:
    assert py_spy_message(PY_SPY_STDERR) == "Failed to get stack traces"
    assert py_spy_message("") == "no message"


def test_hang_pid_mode_reports_the_live_rank_and_says_the_other_is_stopped(tmp_path: Path) -> None:
    """`hang --pid R0 --pid R1` with R1 stopped (SIGSTOP): it gave up on py-spy's failure
    ("py-spy dump --pid N failed:    9: main"); now rank 0 is diagnosed and rank 1 named
    stopped, from /proc."""
    script = tmp_path / "ranked.py"
    script.write_text(RANKED)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    started = [
        subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r), "WORLD_SIZE": "2"}) for r in (0, 1)
    ]
    try:
        time.sleep(1.5)
        os.kill(started[1].pid, signal.SIGSTOP)
        res = subprocess.run(
            [sys.executable, "-m", "lorascope", "hang", *sum((["--pid", str(p.pid)] for p in started), [])],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        for p in started:
            p.kill()
            p.wait()
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert any(line.startswith("rank 0") and f"in all_reduce at {script}:4" in line for line in lines), res.stdout
    assert any(line.startswith("rank 1") and "stopped (state T" in line for line in lines), res.stdout
    verdict = next(line for line in lines if line.startswith("verdict: "))
    assert verdict.startswith("verdict: rank 1 is stopped (state T") and "the others wait for it" in verdict


def test_a_stopped_local_rank_of_a_run_is_named_with_its_state(tmp_path: Path) -> None:
    """`hang RUN_DIR` with one rank's process stopped: it cannot answer the dump request or
    the signal; it is named with its host, its last record's age and its state (T), and
    py-spy is not tried on it (py-spy fails on a stopped process)."""
    run = tmp_path / "run"
    env = {**os.environ, "LORASCOPE_RUN_DIR": str(run)}
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env)
    try:
        time.sleep(0.5)
        now = time.time()
        record_launch(run, "h-1", ["torchrun", "train.py"], start=now - 10, end=None, exit_status=None)
        prefix = stream_prefix(run, 0, socket.gethostname(), proc.pid)
        stream = Stream(prefix)
        stream.write({"k": "start", "t": now + 1, "rank": 0, "world_size": 1, "local_rank": 0, "pid": proc.pid,
                      "host": socket.gethostname(), "argv": ["train.py"], "versions": {}, "device": "cpu"})  # fmt: skip
        Steps(stream, prefix, now + 1).step(now + 1, 1, 0.5, 1.0)
        stream.close()
        os.kill(proc.pid, signal.SIGSTOP)
        res = subprocess.run(
            [sys.executable, "-m", "lorascope", "hang", str(run), "--wait", "1", "--json", "--no-html"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        proc.kill()
        proc.wait()
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    [silent] = data["silent"]
    assert silent["rank"] == 0 and silent["host"] == socket.gethostname() and silent["local_rank"] == 0
    assert silent["process"].startswith("stopped (state T") and silent["py_spy"] is None
    assert data["kind"] == "stopped-process" and data["odd_ranks"] == [0]
    assert any(n.startswith("rank 0 (host ") and "stopped (state T" in n for n in data["notes"])
