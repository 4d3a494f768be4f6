"""A local process's state, from /proc (psutil): what a rank that does not answer is
doing from the kernel's point of view."""

from __future__ import annotations

import psutil

#: psutil's status -> the words `lorascope hang` says (None: nothing to say).
_SAID = {
    psutil.STATUS_STOPPED: "stopped (state T: SIGSTOP, Ctrl-Z or a debugger; resume it with kill -CONT)",
    psutil.STATUS_TRACING_STOP: "stopped by a tracer (state t: a debugger or py-spy holds it)",
    psutil.STATUS_ZOMBIE: "a zombie (state Z: it exited and its parent has not reaped it)",
    psutil.STATUS_DISK_SLEEP: "in D state (uninterruptible sleep: blocked in the kernel, on a filesystem or a device)",
    psutil.STATUS_DEAD: "dead (state X)",
}
#: The states in which a process cannot answer anything until someone else acts.
STOPPED = frozenset({psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP})


def process_state(pid: int) -> str:
    """psutil's status of ``pid`` ("running", "sleeping", "stopped", "zombie",
    "disk-sleep", ...), or "gone"."""
    try:
        return str(psutil.Process(pid).status())
    except (psutil.NoSuchProcess, ValueError, OverflowError):
        return "gone"
    except psutil.AccessDenied:
        return "unknown"


def describe_state(state: str) -> str | None:
    """The state in words where it says why a process does not answer; None for a running
    or sleeping one (it may be holding the GIL in C code: nothing the kernel shows)."""
    if state == "gone":
        return "gone (its process no longer exists)"
    return _SAID.get(state)
