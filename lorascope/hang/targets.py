"""Which processes `lorascope hang` may signal: the run's own live ranks, proven so.

A pid written in the run directory may have been recycled by an unrelated process
since: it is signalled only if the process now under that pid carries this run's
``LORASCOPE_RUN_DIR`` in its environment and started no later than the rank's
``start`` record. Ranks on other hosts cannot be signalled from here: they are reached
through the dump request in the run directory (``lorascope.hang.request``).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from lorascope.rundir.schema import BOOTSTRAP_DIR

#: Clock slack between the process's start time (/proc, 10 ms ticks) and its first record.
START_SLACK_S = 1.0


@dataclass
class Target:
    """A process of the run (its stream's ``start`` record) and whether it may be signalled."""

    rank: int
    pid: int
    host: str
    alive: bool
    ours: bool
    why: str

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


def verify(start: dict[str, Any], run_dir: Path) -> Target:
    """Whether the process a stream's ``start`` record names (rank, pid, host, t) is alive
    and still that process."""
    rank, pid, host, started = start.get("rank"), start.get("pid"), start.get("host"), start.get("t")
    if not (_whole(rank) and _whole(pid) and pid and isinstance(host, str) and isinstance(started, int | float)):
        return Target(-1, -1, str(host), alive=False, ours=False, why="an unreadable start record: not signalled")
    assert isinstance(rank, int) and isinstance(pid, int)
    if host != socket.gethostname():
        return Target(rank, pid, host, alive=True, ours=False, why=f"on host {host}: asked through the run directory")
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
