"""Which processes `lorascope hang` may signal: the run's own live ranks, proven so.

A pid written in the run directory may have been recycled by an unrelated process
since: it is signalled only if the process now under that pid carries this run's
``LORASCOPE_RUN_DIR`` in its environment and started no later than the rank's
``start`` record, or, for a process `lorascope attach` attached (whose environment
predates the attach), if it started at the very clock tick its ``start`` record gives
(/proc/PID/stat) and is the calling user's. Such a process takes the dump signal in its
dump thread alone (``thread``: the manifest's record of the attach). Ranks on other
hosts cannot be signalled from here: they are reached through the dump request in the
run directory (``lorascope.hang.request``).
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from lorascope.errors import BadInputError
from lorascope.rundir.format.procfs import start_ticks
from lorascope.rundir.format.safe_open import open_regular
from lorascope.rundir.format.schema import BOOTSTRAP_DIR, MANIFEST_FILE

#: Clock slack between the process's start time (/proc, 10 ms ticks) and its first record.
START_SLACK_S = 1.0
#: The manifest, read at most (it lists every attach of the run).
MAX_MANIFEST_BYTES = 16 << 20


@dataclass
class Target:
    """A process of the run (its stream's ``start`` record) and whether it may be signalled."""

    rank: int
    pid: int
    host: str
    alive: bool
    ours: bool
    why: str
    #: The thread to send the dump signal to (an attached process), else the process.
    thread: int | None = None
    #: Attached by `lorascope attach`: signalled only through ``thread`` (without one it
    #: has no dump thread, and the job's own handler may take the signal: read with py-spy).
    attached: bool = False

    @property
    def local(self) -> bool:
        """The process runs on this host (it can be signalled and its state read)."""
        return self.host == socket.gethostname()


def _of_run(env: dict[str, str], run_dir: Path) -> bool:
    """The process was started for this run: ``LORASCOPE_RUN_DIR`` names it, or, for ranks
    reached only through ``PYTHONPATH`` (a pdsh/ssh remote launch forwards ``PYTHON*``
    variables only), a ``PYTHONPATH`` entry is this run's bootstrap folder."""
    root = os.path.realpath(run_dir)
    named = env.get("LORASCOPE_RUN_DIR")
    if named is not None and os.path.realpath(named) == root:
        return True
    bootstrap = os.path.join(root, BOOTSTRAP_DIR) + os.sep
    return any(
        os.path.realpath(entry).startswith(bootstrap) for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry
    )


def _attached(start: dict[str, Any], pid: int, rank: int, host: str, run_dir: Path) -> Target:
    """A process `lorascope attach` attached: the same start tick, the same owner."""
    ticks = start["attached"].get("proc_start_ticks")
    now = start_ticks(pid)
    if now is None:
        return Target(rank, pid, host, alive=False, ours=False, why="process gone")
    if not isinstance(ticks, int) or ticks != now:
        return Target(rank, pid, host, alive=False, ours=False, why="pid now belongs to another process: not signalled")
    try:
        if psutil.Process(pid).uids().real != os.getuid() and os.getuid() != 0:
            return Target(rank, pid, host, alive=True, ours=False, why="another user's process: not signalled")
    except psutil.Error:
        return Target(rank, pid, host, alive=False, ours=False, why="process gone")
    thread = dump_thread(run_dir, pid, ticks)
    return Target(rank, pid, host, alive=True, ours=True, why="verified", thread=thread, attached=True)


def dump_thread(run_dir: Path, pid: int, ticks: int) -> int | None:
    """The dump thread of an attached process, from the manifest's ``attached`` entries."""
    try:
        with open_regular(run_dir / MANIFEST_FILE) as f:
            manifest = json.loads(f.read(MAX_MANIFEST_BYTES))
    except (OSError, ValueError, RecursionError, BadInputError):
        return None
    found = None
    for entry in manifest.get("attached") or [] if isinstance(manifest, dict) else []:
        for p in entry.get("processes") or [] if isinstance(entry, dict) else []:
            if isinstance(p, dict) and p.get("pid") == pid and p.get("start_ticks") == ticks and p.get("ok"):
                thread = p.get("dump_thread")
                found = thread if isinstance(thread, int) and thread > 0 else found
    return found


def verify(start: dict[str, Any], run_dir: Path) -> Target:
    """Whether the process a stream's ``start`` record names (rank, pid, host, t) is alive
    and still that process."""
    rank, pid, host, started = start.get("rank"), start.get("pid"), start.get("host"), start.get("t")
    if not (_whole(rank) and _whole(pid) and pid and isinstance(host, str) and isinstance(started, int | float)):
        return Target(-1, -1, str(host), alive=False, ours=False, why="an unreadable start record: not signalled")
    assert isinstance(rank, int) and isinstance(pid, int)
    if host != socket.gethostname():
        return Target(rank, pid, host, alive=True, ours=False, why=f"on host {host}: asked through the run directory")
    if isinstance(start.get("attached"), dict):
        return _attached(start, pid, rank, host, run_dir)
    try:
        proc = psutil.Process(pid)
        created = proc.create_time()
        env = proc.environ()
    except psutil.NoSuchProcess:
        return Target(rank, pid, host, alive=False, ours=False, why="process gone")
    except (psutil.AccessDenied, psutil.ZombieProcess) as exc:
        return Target(rank, pid, host, alive=True, ours=False, why=f"cannot check it: {exc.__class__.__name__}")
    except (ValueError, OverflowError):  # a pid no process can have
        return Target(rank, pid, host, alive=False, ours=False, why="process gone")
    if not _of_run(env, run_dir):
        return Target(
            rank,
            pid,
            host,
            alive=False,
            ours=False,
            why="pid now belongs to another process (not this run's): not signalled",
        )
    if created > float(started) + START_SLACK_S:
        return Target(
            rank, pid, host, alive=False, ours=False, why="pid was reused after the rank started: not signalled"
        )
    return Target(rank, pid, host, alive=True, ours=True, why="verified")


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
