"""`lorascope hang --pid`: stacks read with `py-spy dump --json` from real processes (py-spy
needs ptrace: root, or kernel.yama.ptrace_scope 0), written as the probes' thread dumps and
diagnosed with the same parser."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lorascope.detect.hang.diagnosis import main_thread_frame
from lorascope.hang.collect import py_spy_dump, stacks_text
from tests.helpers import HANG_JSON_KEYS

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
