"""Which processes `lorascope hang` may signal: the run's own live ranks, proven so.

A pid written in the run directory may have been recycled by an unrelated process
since: it is signalled only if the process now under that pid carries this run's
``LORASCOPE_RUN_DIR`` in its environment and started no later than the rank's
``start`` record. Ranks on other hosts cannot be signalled from here.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

import psutil

from lorascope.rundir.reader import RankData

#: Clock slack between the process's start time (/proc, 10 ms ticks) and its first record.
START_SLACK_S = 1.0


@dataclass
class Target:
    rank: int
    pid: int
    alive: bool
    ours: bool
    why: str


def verify(rank: RankData, run_dir: Path) -> Target:
    """Whether ``rank``'s recorded pid is alive and still that rank's process."""
    pid = rank.pid
    if rank.host != socket.gethostname():
        return Target(rank.rank, pid, alive=True, ours=False, why=f"on host {rank.host}: run `lorascope hang` there")
    try:
        proc = psutil.Process(pid)
        created = proc.create_time()
        env_dir = proc.environ().get("LORASCOPE_RUN_DIR")
    except psutil.NoSuchProcess:
        return Target(rank.rank, pid, alive=False, ours=False, why="process gone")
    except (psutil.AccessDenied, psutil.ZombieProcess) as exc:
        return Target(rank.rank, pid, alive=True, ours=False, why=f"cannot check it: {exc.__class__.__name__}")
    if env_dir is None or os.path.realpath(env_dir) != os.path.realpath(run_dir):
        return Target(
            rank.rank,
            pid,
            alive=False,
            ours=False,
            why="pid now belongs to another process (not this run's): not signalled",
        )
    if created > float(rank.start["t"]) + START_SLACK_S:
        return Target(
            rank.rank, pid, alive=False, ours=False, why="pid was reused after the rank started: not signalled"
        )
    return Target(rank.rank, pid, alive=True, ours=True, why="verified")
