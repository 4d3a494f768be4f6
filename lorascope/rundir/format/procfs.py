"""What /proc says of a process that names it for the life of the machine: its start
time (a pid alone may be reused). Standard library only (the probes use it)."""

from __future__ import annotations


def start_ticks(pid: int | str = "self") -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22),
    None when unreadable (gone, or not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
        return int(text.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None
