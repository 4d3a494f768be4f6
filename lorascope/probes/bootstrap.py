"""The ``sitecustomize.py`` that ``lorascope run`` puts first on PYTHONPATH, and the rule
by which a process that imports it attaches the probes.

Every Python process of the job imports it: launchers (torchrun, the deepspeed and
accelerate launchers, deepspeed's pdsh/ssh runners, which forward only ``PYTHON*``
variables), ranks, and whatever those start. The run's settings (run directory, probe
options) are written into the generated file itself, so a rank that receives only
``PYTHONPATH`` is probed all the same. The rule, in order:

1. a known launcher (:data:`lorascope.rundir.format.ranks.LAUNCHERS`) is no rank, whatever
   its environment says (``srun torchrun ...`` hands SLURM_PROCID to torchrun);
2. a process that inherited the identity of a probed process (``LORASCOPE_ATTACHED_*``
   equal to its own: a DataLoader worker, a compile worker) is no rank;
3. a process with rank variables (:mod:`lorascope.rundir.format.ranks`) attaches now;
4. any other process is a lone process, rank 0 of 1: it attaches when it first looks
   for ``torch``, before torch runs. A Python helper that never imports torch (a shell
   wrapper, a data-prep step without torch) stays unprobed, and a job started as
   ``python train.py`` is probed like one rank. Should an unknown launcher that imports
   torch attach this way, its ranks name it as the probed process they came from and
   the reader drops its stream.

Each decision is one line in ``processes.jsonl`` next to the generated file
(``lorascope run`` uses it to say why nothing attached). It must never fail the process: without lorascope
importable it only chains to the ``sitecustomize`` that would have run without it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from lorascope.rundir.format import ranks
from lorascope.rundir.format.schema import PROCESSES_LOG

ENV_ATTACHED_PID = "LORASCOPE_ATTACHED_PID"
ENV_ATTACHED_AS = "LORASCOPE_ATTACHED_AS"

SITECUSTOMIZE = """\
# Written by `lorascope run`: attaches lorascope's probes to each rank of this run, then
# runs the sitecustomize that would have run without it. Safe to delete with the run.
CONFIG = {config!r}


def _lorascope_bootstrap():
    import importlib.machinery, importlib.util, os, sys
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        try:
            from lorascope.probes.bootstrap import start
        except ImportError:
            sys.path.append({package_root!r})
            from lorascope.probes.bootstrap import start
        start(CONFIG)
    except Exception as exc:
        print("lorascope: probes not attached:", exc, file=sys.stderr)
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_lorascope_bootstrap()
del _lorascope_bootstrap
"""


def sitecustomize_source(config: dict[str, Any]) -> str:
    """The bootstrap file; ``config`` (plain values) holds ``run_dir``, ``bootstrap_dir``
    (where the file goes) and the options :func:`lorascope.probes.attach.attach` takes
    (``sample_interval``, ``trace_window``, ``launch_id``)."""
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return SITECUSTOMIZE.format(config=config, package_root=package_root)


def role(identity: ranks.Identity, env: Any = None, argv: Any = None) -> str:
    """ "launcher", "child" (of a probed process), "rank" or "lone" (see the module doc)."""
    env = os.environ if env is None else env
    if ranks.is_launcher(argv):
        return "launcher"
    parent = env.get(ENV_ATTACHED_PID)
    if parent and parent != str(os.getpid()) and env.get(ENV_ATTACHED_AS) == identity.key:
        return "child"
    return "lone" if identity.source == ranks.LONE else "rank"


def start(config: dict[str, Any]) -> str:
    """Apply the rule to this process (called by the generated sitecustomize)."""
    identity = ranks.discover()
    decided = role(identity)
    _note(config, decided, identity)
    if decided == "rank":
        _attach(config, identity)
    elif decided == "lone":
        from lorascope.probes import importhook

        importhook.before_import("torch", lambda: _attach(config, identity))
    return decided


def _attach(config: dict[str, Any], identity: ranks.Identity) -> None:
    from lorascope.probes.allocator import ENV_SWITCH as ENV_MEMORY_HISTORY
    from lorascope.probes.attach import attach

    mode = config.get("memory_history")  # `lorascope run --memory-history`, for a reduced environment
    if isinstance(mode, str):
        os.environ.setdefault(ENV_MEMORY_HISTORY, mode)

    attach(
        config["run_dir"],
        sample_interval=config.get("sample_interval"),
        trace_window=config.get("trace_window"),
        launch_id=config.get("launch_id"),
        identity=identity,
    )


def _note(config: dict[str, Any], decided: str, identity: ranks.Identity) -> None:
    """One line per process in processes.jsonl; best effort, one write."""
    if not config.get("bootstrap_dir"):
        return
    try:
        line = json.dumps(
            {
                "t": time.time(),
                "host": os.uname().nodename,
                "pid": os.getpid(),
                "ppid": os.getppid(),
                "role": decided,
                "rank_source": identity.source,
                "rank": identity.rank,
                "program": ranks.program(getattr(sys, "orig_argv", sys.argv)),
            }
        )
        path = os.path.join(config["bootstrap_dir"], PROCESSES_LOG)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)
    except Exception:
        pass
