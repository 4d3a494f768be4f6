"""The probes started in a process that was already running (``lorascope attach``).

`lorascope attach` writes a request file and a short script into the run directory, and
has the process run the script: through ``sys.remote_exec`` (PEP 768, Python 3.14+) or
through gdb (a pending call, or the GIL taken for a moment: :mod:`lorascope.inject`).
The script calls :func:`run_request` in the process. It must never raise into the job
(``PyRun_SimpleString`` would print it, and a ``SystemExit`` would end the job), so the
script catches everything and writes what happened to ``RESULT``; :func:`run_request`
writes the result itself and is idempotent (a request run twice, by a pending call that
runs after the direct path did it, does nothing the second time).

What the process is then given: the always-on probes of :func:`lorascope.probes.attach.attach`,
from that moment on (the ``start`` record's ``attached`` field says when and how), and
an ``attach`` dump at once: every thread's stack, the collective the main thread is in
if it began before (read from its stack), a memory reading, torch's flight-recorder
buffer when the job enabled one, and on a CUDA rank an allocator snapshot.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from lorascope.rundir.format.procfs import start_ticks

#: Under the run directory: the requests, scripts and results of ``lorascope attach``.
ATTACH_DIR = "attach"

SCRIPT = """\
# Written by `lorascope attach`: run once inside process {pid} (gdb or sys.remote_exec).
def _lorascope_attach():
    import sys, time
    began = time.perf_counter()
    try:
        try:
            from lorascope.probes.live import run_request
        except ImportError:
            sys.path.append({package_root!r})
            from lorascope.probes.live import run_request
        run_request({request!r}, began)
    except BaseException as exc:
        try:
            with open({failed!r}, "w") as f:
                f.write(repr(exc)[:2000])
        except BaseException:
            pass


_lorascope_attach()
del _lorascope_attach
"""

#: What gdb asks the process to run (``PyRun_SimpleString``, in ``__main__``'s namespace:
#: it binds no name there, and catches everything).
ONE_LINE = (
    "try:\n exec(compile(open({path!r}, 'rb').read(), {path!r}, 'exec'), {{'__name__': 'lorascope_attach'}})\n"
    "except BaseException:\n pass\n"
)


def script_source(request: dict[str, Any]) -> str:
    """The script a process runs for ``request`` (plain values: ``action`` "attach" or
    "detach", ``pid``, ``run_dir``, ``result`` (the path written), probe options)."""
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return SCRIPT.format(
        pid=request["pid"], package_root=package_root, request=request, failed=str(request["result"]) + ".failed"
    )


def one_line(script_path: str) -> str:
    return ONE_LINE.format(path=script_path)


def _write_result(path: str, result: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)


def run_request(request: dict[str, Any], began: float) -> None:
    """Carry out ``request`` in this process once; write its result. Never raises."""
    result_path = str(request["result"])
    if int(request["pid"]) != os.getpid() or os.path.exists(result_path):
        return  # a forked child that inherited a queued call; or done already
    result: dict[str, Any] = {
        "pid": os.getpid(),
        "action": request["action"],
        "how": request.get("how"),
        "main_thread": threading.current_thread() is threading.main_thread(),
    }
    try:
        if request["action"] == "detach":
            from lorascope.probes.attach import detach

            result["ok"] = detach()
            if not result["ok"]:
                result["error"] = "the probes were not on in this process"
        else:
            result.update(_attach(request))
    except Exception as exc:
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
    result["pause_ms"] = round((time.perf_counter() - began) * 1e3, 3)
    result["t"] = time.time()
    try:
        _write_result(result_path, result)
    except OSError:
        pass


def _attach(request: dict[str, Any]) -> dict[str, Any]:
    from lorascope.probes import attach as probes
    from lorascope.rundir.format.ranks import discover

    if probes._session is not None and probes._session.pid == os.getpid():
        if not probes._session.active:
            return {"ok": False, "error": "detached earlier: the probes cannot be attached again in this process"}
        where = probes.run_dir_of_session
        if where is not None and where != Path(request["run_dir"]).absolute():
            return {"ok": False, "error": f"already attached, recording into {where}"}
        return {"ok": True, "error": "already attached"}
    identity = discover()
    attached = {
        "t": time.time(),
        "how": request.get("how"),
        "proc_start_ticks": start_ticks(),
        "flight_recorder": os.environ.get("TORCH_FR_BUFFER_SIZE"),
        "torch_imported": "torch" in sys.modules,
        "dist_initialized": _dist_initialized(),
    }
    ok = probes.attach(
        request["run_dir"],
        sample_interval=request.get("sample_interval"),
        trace_window=request.get("trace_window"),
        launch_id=request.get("launch_id"),
        identity=identity,
        attached=attached,
    )
    if not ok:
        return {"ok": False, "error": "the probes did not start (see probe-errors.log in the run directory)"}
    session, dumper = probes._session, probes._dumper
    assert session is not None and dumper is not None
    # The evidence of what came before: in a thread of its own, so that the job is not
    # held while it is written (the flight recorder's dump and a CUDA snapshot take time).
    threading.Thread(target=dumper.dump, args=("attach",), name="lorascope-attach-dump", daemon=True).start()
    return {
        "ok": True,
        "rank": session.rank,
        "world_size": session.world_size,
        "dump_thread": dumper.thread_id,
        "on_demand_dumps": dumper.thread_id is not None,
    }


def _dist_initialized() -> bool:
    dist = sys.modules.get("torch.distributed")
    try:
        return bool(dist is not None and dist.is_available() and dist.is_initialized())
    except Exception:
        return False


def request_path(run_dir: Path, pid: int, action: str, stamp: str) -> Path:
    """Where a request's files go: ``ATTACH_DIR/PID-ACTION-STAMP`` (+ ``.py``, ``.json``)."""
    return run_dir / ATTACH_DIR / f"{pid}-{action}-{stamp}"
