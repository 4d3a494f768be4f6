"""The ``sitecustomize.py`` that ``lorascope run`` puts first on PYTHONPATH.

Every Python process the launcher starts (torchrun's workers, the deepspeed launcher's,
its pdsh/ssh runners, which export ``PYTHON*``) imports it. It attaches the probes when
the process is a rank (``RANK`` and ``LOCAL_RANK`` set) and not merely a child of a
probed rank (a spawned DataLoader worker inherits both), then runs the
``sitecustomize`` that would have run without lorascope, if any. It must never fail the
process: without lorascope importable it only chains.
"""

from __future__ import annotations

import os

SITECUSTOMIZE = """\
# Written by `lorascope run`: attaches lorascope's probes to each rank of this run, then
# runs the sitecustomize that would have run without it. Safe to delete with the run.
def _lorascope_bootstrap():
    import importlib.machinery, importlib.util, os, sys
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        try:
            from lorascope.probes.bootstrap import attach_if_rank
        except ImportError:
            sys.path.append({package_root!r})
            from lorascope.probes.bootstrap import attach_if_rank
        attach_if_rank()
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


def sitecustomize_source() -> str:
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return SITECUSTOMIZE.format(package_root=package_root)


def attach_if_rank() -> bool:
    env = os.environ
    if "RANK" not in env or "LOCAL_RANK" not in env or "LORASCOPE_RUN_DIR" not in env:
        return False
    attached = env.get("LORASCOPE_ATTACHED_PID")
    if attached and attached != str(os.getpid()):
        return False  # a process started by a probed rank, not a rank itself
    from lorascope.probes.attach import attach

    return attach(env["LORASCOPE_RUN_DIR"])
