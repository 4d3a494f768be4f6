"""Which rank this process is, from the variables its launcher set, and whether it is a
launcher rather than a rank. Standard library only: the bootstrap runs this in every
Python process of a job.

Sources, first match wins: ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` (torchrun, the
deepspeed and accelerate launchers); ``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NTASKS``
(``srun``); ``OMPI_COMM_WORLD_RANK``/``..._LOCAL_RANK``/``..._SIZE`` (Open MPI's
``mpirun``); ``PMI_RANK``/``MPI_LOCALRANKID``/``PMI_SIZE`` (MPICH, Intel MPI). A process
with none of them is a lone process: rank 0 of 1.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from typing import NamedTuple

#: (source name, rank variable, local-rank variable, world-size variable), in order.
SOURCES: tuple[tuple[str, str, str, str], ...] = (
    ("env", "RANK", "LOCAL_RANK", "WORLD_SIZE"),
    ("slurm", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"),
    ("ompi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("pmi", "PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE"),
)
LONE = "lone"

#: Programs (script names or ``-m`` modules) that start ranks and are not ranks
#: themselves, even when a rank variable reaches them (``srun torchrun ...``).
LAUNCHERS = frozenset(
    {
        "torchrun",
        "torch.distributed.run",
        "torch.distributed.launch",
        "deepspeed",
        "ds",
        "deepspeed.launcher.runner",
        "deepspeed.launcher.launch",
        "accelerate",
        "accelerate.commands.launch",
        "accelerate.commands.accelerate_cli",
    }
)

#: Frameworks' command-line tools that train in-process on one device and start torchrun
#: or accelerate themselves for several (LLaMA-Factory's ``FORCE_TORCHRUN=1``): not a
#: launcher by the rule, so such a tool attaches as a lone process when it imports torch,
#: and the reader leaves it out, without a warning, once ranks name it as their launcher.
LAUNCHING_CLIS = frozenset({"llamafactory-cli", "lmf", "axolotl", "trl", "tune", "swift"})

#: Interpreter options that take a value as the next argument.
_OPTS_WITH_VALUE = frozenset({"-W", "-X", "--check-hash-based-pycs"})


class Identity(NamedTuple):
    """A process's place in the job (a NamedTuple: dataclasses would import inspect
    into every Python process of the job)."""

    rank: int
    local_rank: int
    world_size: int
    #: Where the numbers came from: a SOURCES name, or "lone".
    source: str

    @property
    def key(self) -> str:
        """Equal in a process and in the children that inherit its environment."""
        return f"{self.source}:{self.rank}/{self.world_size}"


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def discover(env: Mapping[str, str] | None = None) -> Identity:
    """This process's rank from its environment; a lone process is rank 0 of 1."""
    env = os.environ if env is None else env
    for source, rank_var, local_var, world_var in SOURCES:
        rank = _int(env.get(rank_var))
        if rank is None or rank < 0:
            continue
        local = _int(env.get(local_var))
        world = _int(env.get(world_var))
        return Identity(
            rank=rank,
            local_rank=local if local is not None and local >= 0 else 0,
            world_size=world if world is not None and world > rank else rank + 1,
            source=source,
        )
    return Identity(rank=0, local_rank=0, world_size=1, source=LONE)


def program(argv: Sequence[str]) -> str | None:
    """What an interpreter command line runs: the ``-m`` module, the script's name
    (without ``.py``), ``-c`` for a command, None for an interactive interpreter."""
    args = iter(argv[1:])
    for arg in args:
        if arg in _OPTS_WITH_VALUE:
            next(args, None)
        elif arg == "-m":
            return next(args, None)
        elif arg.startswith("-m") and len(arg) > 2:
            return arg[2:]
        elif arg == "-c" or (arg.startswith("-c") and len(arg) > 2):
            return "-c"
        elif arg == "-" or not arg.startswith("-"):
            name = os.path.basename(arg)
            return name[:-3] if name.endswith(".py") else name
    return None


def is_launcher(argv: Sequence[str] | None = None) -> bool:
    """Whether this process runs a known launcher (it starts ranks, it is none)."""
    argv = getattr(sys, "orig_argv", sys.argv) if argv is None else argv
    return program(argv) in LAUNCHERS
