"""The processes `lorascope attach` may put the probes into, read from /proc: the ranks
under a launcher, who owns each, which Python each runs, and why one cannot be attached
(with what to do about it). Linux only."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from lorascope.rundir.format.procfs import start_ticks
from lorascope.rundir.format.ranks import LAUNCHERS, SOURCES, Identity, discover, program

PROC = Path("/proc")
#: The oldest Python the probes run on (pyproject's requires-python).
MIN_PYTHON = (3, 10)
#: From this Python on, ``sys.remote_exec`` (PEP 768) injects without a debugger.
REMOTE_EXEC_PYTHON = (3, 14)
#: CAP_SYS_PTRACE's bit in /proc/PID/status CapEff.
CAP_SYS_PTRACE = 19
_LIBPYTHON = re.compile(rb"libpython(\d+)\.(\d+)")
_EXE = re.compile(r"python(\d+)\.(\d+)")


@dataclass
class Process:
    """One process to attach: its rank as its environment says, and, when it cannot be
    attached, why and the fix."""

    pid: int
    identity: Identity
    uid: int | None = None
    python: tuple[int, int] | None = None
    start_ticks: int | None = None
    why: str | None = None
    fix: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        if self.identity.source == "lone":
            return f"pid {self.pid}"
        return f"rank {self.identity.rank} (pid {self.pid})"


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def environ(pid: int) -> dict[str, str] | None:
    """The environment the process started with (/proc/PID/environ), None if unreadable."""
    data = _read(PROC / str(pid) / "environ")
    if data is None:
        return None
    out = {}
    for item in data.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def argv(pid: int) -> list[str]:
    data = _read(PROC / str(pid) / "cmdline") or b""
    return [a.decode(errors="replace") for a in data.split(b"\0") if a]


def owner(pid: int) -> int | None:
    """The process's real uid (/proc/PID/status)."""
    data = _read(PROC / str(pid) / "status")
    for line in (data or b"").decode(errors="replace").splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    return None


def children(pid: int) -> list[int]:
    """Direct children, from every thread's children list."""
    out: list[int] = []
    for task in sorted((PROC / str(pid) / "task").glob("*")):
        data = _read(task / "children") or b""
        out += [int(c) for c in data.split()]
    return out


def descendants(pid: int) -> list[int]:
    seen: list[int] = []
    todo = children(pid)
    while todo:
        child = todo.pop(0)
        if child not in seen:
            seen.append(child)
            todo += children(child)
    return seen


def python_version(maps: bytes | None, exe: str | None) -> tuple[int, int] | None:
    """The CPython a process runs: its loaded libpython, else its executable's name
    (``python3.11``); None when neither says (not a Python process, or one whose
    interpreter is named otherwise)."""
    found = _LIBPYTHON.search(maps or b"")
    if found:
        return int(found[1]), int(found[2])
    named = _EXE.search(os.path.basename(exe or ""))
    return (int(named[1]), int(named[2])) if named else None


def target_python(pid: int) -> tuple[int, int] | None:
    try:
        exe = os.readlink(PROC / str(pid) / "exe")
    except OSError:
        exe = None
    return python_version(_read(PROC / str(pid) / "maps"), exe)


def method_for(python: tuple[int, int]) -> str:
    """How to inject into a process running ``python`` (its version, not ours)."""
    return "remote_exec" if python >= REMOTE_EXEC_PYTHON else "gdb"


def describe(pid: int) -> Process:
    """A process as `lorascope attach` sees it (no check of who may attach it yet)."""
    env = environ(pid)
    proc = Process(pid, discover(env or {}), owner(pid), target_python(pid), start_ticks(pid))
    if not (PROC / str(pid)).exists():
        proc.why, proc.fix = "no such process", "check the pid (`ps -ef`)"
    elif proc.python is None and _read(PROC / str(pid) / "maps") is None:
        why, fix = ptrace_denied_fix()
        proc.why = f"its memory map cannot be read (not dumpable, or {why[0].lower() + why[1:]})"
        proc.fix = fix
    elif proc.python is None:
        proc.why = "not a Python process (no libpython mapped, and its executable is not named pythonX.Y)"
        proc.fix = "give the ranks' pids (the Python processes the launcher started), or the launcher's with --launcher"
    elif proc.python < MIN_PYTHON:
        proc.why = f"runs Python {proc.python[0]}.{proc.python[1]}; the probes need {MIN_PYTHON[0]}.{MIN_PYTHON[1]}+"
        proc.fix = "attach is not possible for this job: start it under `lorascope run` with a newer Python"
    elif env is None:
        proc.why = "its environment cannot be read (another user's process?)"
        proc.fix = "run `lorascope attach` as the job's user"
    return proc


def ranks_of(launcher: int) -> list[Process]:
    """The ranks a launcher started: its descendants that carry rank variables
    (``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` or another :data:`SOURCES` set) and are not
    launchers themselves (torchrun's workers, the deepspeed launcher's ``launch.py``'s
    children), ordered by rank."""
    found = []
    for pid in descendants(launcher):
        env = environ(pid)
        if env is None or not any(rank_var in env for _, rank_var, _, _ in SOURCES):
            continue
        if program(argv(pid)) in LAUNCHERS:
            continue
        found.append(describe(pid))
    return sorted(found, key=lambda p: (p.identity.rank, p.pid))


def ptrace_scope() -> int | None:
    """Yama's ptrace_scope (0: any process of the same user; 1: descendants only; 2: admin
    only; 3: none), None without Yama."""
    data = _read(PROC / "sys/kernel/yama/ptrace_scope")
    try:
        return int(data) if data is not None else None
    except ValueError:
        return None


def has_cap_ptrace(pid: int | str = "self") -> bool:
    data = _read(PROC / str(pid) / "status") or b""
    for line in data.decode(errors="replace").splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_SYS_PTRACE & 1)
    return False


def ptrace_denied_fix() -> tuple[str, str]:
    """Why ptrace was refused on this machine, as far as /proc tells, and the fix."""
    scope = ptrace_scope()
    cap = has_cap_ptrace()
    if scope is not None and scope >= 3:
        return (
            "ptrace is disabled on this machine (kernel.yama.ptrace_scope=3)",
            "only a reboot lowers it: start the job under `lorascope run` next time",
        )
    if scope in (1, 2) and not cap:
        return (
            f"kernel.yama.ptrace_scope={scope} allows tracing only {'descendants' if scope == 1 else 'by an admin'}",
            "sudo sysctl kernel.yama.ptrace_scope=0 (or run `lorascope attach` with CAP_SYS_PTRACE, e.g. as root)",
        )
    if not cap and os.getuid() == 0:
        return (
            "ptrace is not permitted here (root without CAP_SYS_PTRACE: a container?)",
            "run the container with --cap-add=SYS_PTRACE (Kubernetes: securityContext.capabilities.add: [SYS_PTRACE])",
        )
    return (
        "ptrace is not permitted",
        "run `lorascope attach` as the job's user, with ptrace allowed (kernel.yama.ptrace_scope=0)",
    )
