"""Injection by ``sys.remote_exec`` (PEP 768), for processes running Python 3.14+.

It is run by the target's own interpreter (``/proc/PID/exe``: the version that must
match is the target's, not the one lorascope runs under), isolated (``-I``: nothing of
the job's environment or of this directory is imported). ``sys.remote_exec`` queues the
script and returns; the process runs it in its main thread at its next check between
bytecodes, as it runs signal handlers: a main thread blocked in native code runs it
only once it comes back (:mod:`lorascope.inject.gdb`'s ``direct`` path is then tried).
The process is never stopped.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

REMOTE_EXEC_TIMEOUT_S = 30.0
CALL = "import sys; sys.remote_exec(int(sys.argv[1]), sys.argv[2])"


@dataclass
class RemoteOutcome:
    ok: bool
    why: str | None
    detail: str
    wall_ms: float


def command(pid: int, script_path: Path, exe: str | None = None) -> list[str]:
    return [exe or f"/proc/{pid}/exe", "-I", "-c", CALL, str(pid), str(script_path)]


def classify(returncode: int, stderr: str) -> tuple[str | None, str]:
    """A failed ``sys.remote_exec`` as a reason code (see :func:`lorascope.inject.attach.explain`)."""
    if returncode == 0:
        return None, ""
    last = (stderr.strip().splitlines() or [""])[-1]
    lowered = stderr.lower()
    if "permission" in lowered or "operation not permitted" in lowered:
        return "ptrace-denied", last
    if "remote debugging" in lowered and ("disabled" in lowered or "not enabled" in lowered):
        return "remote-debug-off", last
    if "no such process" in lowered or "processlookuperror" in lowered:
        return "gone", last
    return "remote-exec-failed", last


def inject(pid: int, script_path: Path, exe: str | None = None) -> RemoteOutcome:
    began = time.perf_counter()
    try:
        res = subprocess.run(
            command(pid, script_path, exe),
            capture_output=True,
            text=True,
            timeout=REMOTE_EXEC_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return RemoteOutcome(False, "remote-exec-failed", str(exc), (time.perf_counter() - began) * 1e3)
    why, detail = classify(res.returncode, res.stderr)
    return RemoteOutcome(why is None, why, detail, (time.perf_counter() - began) * 1e3)
