"""`lorascope attach`: the probes put into processes that are running, one process at a
time per worker thread, each independently (one that cannot be attached is named with
the reason and the fix; the others are attached all the same).

Per process: the checks (:func:`refusal`), a request and its script written under the
run directory (:mod:`lorascope.probes.live`), the script run there by ``sys.remote_exec``
on Python 3.14+ or by a pending call through gdb before that; if the process does not
run it within ``wait_s`` (its main thread is blocked in native code: a hung collective),
by gdb's ``direct`` path; then the result the process wrote is read.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorascope.inject import gdb as gdb_inject
from lorascope.inject import remote
from lorascope.inject.procs import Process, method_for, ptrace_denied_fix
from lorascope.probes.live import ATTACH_DIR, one_line, request_path, script_source
from lorascope.rundir.format.writer import ensure_manifest

POLL_S = 0.05
#: gdb's direct path, at most this many times, this far apart, while the main thread is
#: at a place it must not be entered (taking the GIL, allocating: brief).
DIRECT_TRIES = 3
DIRECT_PAUSE_S = 0.5
RETRIED = frozenset({"main-thread-in-gil-or-allocator", "main-thread-holds-gil", "main-thread-in-unknown-code"})
#: Processes attached at once.
PARALLEL = 8


@dataclass
class Attempt:
    """How attaching (or detaching) one process went."""

    process: Process
    ok: bool = False
    #: The paths tried, in order ("remote_exec", "gdb-queue", "gdb-direct").
    how: list[str] = field(default_factory=list)
    why: str | None = None
    fix: str | None = None
    #: The process stopped by gdb, ms (each gdb run's attach to detach, summed; an upper bound).
    stopped_ms: float = 0.0
    #: The main thread's time in the injected script, ms (as the process measured it).
    pause_ms: float | None = None
    #: From the request to the result, ms.
    took_ms: float = 0.0
    result: dict[str, Any] = field(default_factory=dict)
    #: Said of a process that was attached all the same.
    notes: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "pid": self.process.pid,
            "rank": self.process.identity.rank,
            "start_ticks": self.process.start_ticks,
            "python": ".".join(map(str, self.process.python)) if self.process.python else None,
            "ok": self.ok,
            "how": self.how,
            "why": self.why,
            "fix": self.fix,
            "stopped_ms": round(self.stopped_ms, 3),
            "pause_ms": self.pause_ms,
            "took_ms": round(self.took_ms, 3),
            "dump_thread": self.result.get("dump_thread"),
            "notes": self.notes,
        }


#: What a run attached at ``t`` cannot know (the manifest says it with each attach).
UNKNOWN_BEFORE = (
    "nothing before t is recorded: steps (counted from the attach), memory peaks, collectives, "
    "warnings and errors; a collective in flight at t is known from its rank's stack only"
)

#: Reason codes of the injection paths -> (what happened, what to do).
EXPLAIN: dict[str, tuple[str, str]] = {
    "no-gdb": ("gdb is not installed (needed below Python 3.14)", "install gdb (apt-get install gdb; dnf install gdb)"),
    "gone": ("the process ended", "check the pid (`ps -ef`)"),
    "no-python-symbols": (
        "its interpreter exports no Py_AddPendingCall/PyRun_SimpleString symbols (a stripped or unusual build)",
        "start the job under `lorascope run` next time",
    ),
    "main-thread-in-gil-or-allocator": (
        "its main thread is inside the interpreter's GIL or the C allocator's code, where it must not be entered",
        "run `lorascope attach` again in a few seconds",
    ),
    "main-thread-in-unknown-code": (
        "its main thread is in native code gdb cannot name (outside libc and libpython), where it is not entered",
        "run `lorascope attach` again in a few seconds",
    ),
    "main-thread-holds-gil": (
        "its main thread holds the GIL in native code and did not run the queued call",
        "run `lorascope attach` again in a few seconds (the queued call runs when it returns to Python)",
    ),
    "remote-debug-off": (
        "remote debugging is off in that process (PYTHON_DISABLE_REMOTE_DEBUG, -X disable_remote_debug, or a build without it)",
        "start the job without it (or under `lorascope run`)",
    ),
    "gdb-timeout": ("gdb did not finish in time", "run `lorascope attach --verbose` to see gdb's output"),
    "gdb-failed": ("gdb could not attach or run its script", "run `lorascope attach --verbose` to see gdb's output"),
    "run-failed": ("the injected line failed to run", "see probe-errors.log in the run directory"),
    "mmap-failed": ("no page could be mapped in the process", "run `lorascope attach` again"),
    "pending-calls-full": (
        "the interpreter's pending-call queue is full",
        "run `lorascope attach` again in a few seconds",
    ),
    "remote-exec-failed": ("sys.remote_exec failed", "run `lorascope attach --verbose` to see why"),
}


def explain(code: str) -> tuple[str, str]:
    if code == "ptrace-denied":
        return ptrace_denied_fix()
    return EXPLAIN.get(code, (code, "run `lorascope attach --verbose`"))


def refusal(proc: Process, any_user: bool) -> tuple[str, str] | None:
    """Why ``proc`` is not to be attached by the calling user: another user's process,
    unless the caller is root and said so (``--any-user``)."""
    if proc.why is not None:
        return proc.why, proc.fix or ""
    me = os.getuid()
    if proc.uid is None:
        return "its owner cannot be read", "check the pid (`ps -ef`)"
    if proc.uid != me and not (me == 0 and any_user):
        who = _user(proc.uid)
        if me == 0:
            return (
                f"owned by {who}, not by the calling user (root)",
                "pass --any-user to attach another user's process as root",
            )
        return f"owned by {who}, not by you ({_user(me)})", f"run `lorascope attach` as {who}"
    return None


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


@dataclass
class Options:
    run_dir: Path
    action: str = "attach"
    any_user: bool = False
    #: Seconds a queued injection is waited for before the direct path, and the direct one.
    wait_s: float = 3.0
    sample_interval: float | None = None
    trace_window: str | None = None
    gdb: str | None = None
    verbose: bool = False
    launch_id: str = ""


def run_all(processes: list[Process], options: Options) -> list[Attempt]:
    """Attach (or detach) every process, PARALLEL at a time; never raises for one."""
    run_dir = options.run_dir
    ensure_manifest(run_dir)
    (run_dir / ATTACH_DIR).mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=max(1, min(PARALLEL, len(processes)))) as pool:
        return list(pool.map(lambda p: one(p, options), processes))


def one(proc: Process, options: Options) -> Attempt:
    attempt = Attempt(proc)
    began = time.perf_counter()
    try:
        _one(attempt, options)
    except Exception as exc:  # a bug here must not cost the other ranks
        attempt.ok, attempt.why, attempt.fix = False, f"{type(exc).__name__}: {exc}", "report it"
    attempt.took_ms = (time.perf_counter() - began) * 1e3
    return attempt


def _one(attempt: Attempt, options: Options) -> None:
    proc = attempt.process
    refused = refusal(proc, options.any_user)
    if refused is not None:
        attempt.why, attempt.fix = refused
        return
    assert proc.python is not None
    stamp = f"{time.time():.6f}".replace(".", "")
    base = request_path(options.run_dir.absolute(), proc.pid, options.action, stamp)
    result = base.with_suffix(".json")
    request = {
        "action": options.action,
        "pid": proc.pid,
        "run_dir": str(options.run_dir.absolute()),
        "result": str(result),
        "sample_interval": options.sample_interval,
        "trace_window": options.trace_window,
        "launch_id": options.launch_id,
    }

    def script(how: str) -> Path:
        """The request's script for one path (its result says which path ran it)."""
        path = base.with_name(f"{base.name}-{how}.py")
        path.write_text(script_source({**request, "how": how}))
        return path

    def gdb(mode: str) -> gdb_inject.GdbOutcome:
        """One injection through gdb (``queue`` or ``direct``), its pause and notes counted."""
        how = f"gdb-{mode}"
        attempt.how.append(how)
        got = gdb_inject.inject(
            proc.pid, one_line(str(script(how))), mode, base.with_name(f"{base.name}-{how}.gdb.py"), options.gdb
        )
        attempt.stopped_ms += got.stopped_ms or 0.0
        if options.verbose and got.detail:
            attempt.notes.append(f"gdb: {got.detail}")
        return got

    if proc.uid is not None and proc.uid != os.getuid():  # root attaching another user's job
        for path in (options.run_dir, options.run_dir / ATTACH_DIR):
            os.chown(path, proc.uid, -1)
    method = method_for(proc.python)
    if method == "remote_exec":
        attempt.how.append("remote_exec")
        out = remote.inject(proc.pid, script("remote_exec"))
        failed = out.why
    else:
        failed = gdb("queue").why
    if failed is None and _wait(result, options.wait_s):
        _take(attempt, result)
        return
    if _script_failed(attempt, result):
        return
    if failed is not None and (method == "gdb" or failed not in ("remote-debug-off", "remote-exec-failed")):
        attempt.why, attempt.fix = explain(failed)
        return
    # queued (or remote_exec refused) and not run: the main thread is in native code
    if shutil.which(options.gdb or "gdb") is None:
        attempt.why, attempt.fix = explain(failed or "no-gdb")
        if failed is None:
            attempt.why = "queued, but its main thread has not run Python since (blocked in native code?)"
            attempt.fix = "install gdb to attach such a process now; or wait: the queued call runs when it returns"
        return
    for _ in range(DIRECT_TRIES):
        got = gdb("direct")
        if got.why is None or _wait(result, 0.2):  # run; or the queued call ran meanwhile
            break
        if got.why not in RETRIED:
            break
        time.sleep(DIRECT_PAUSE_S)
    if got.why is not None and not result.exists():
        attempt.why, attempt.fix = explain(got.why)
        if failed is None:
            attempt.notes.append(
                "a call is still queued in the process: it runs when its main thread returns to Python"
            )
        return
    if _wait(result, options.wait_s):
        _take(attempt, result)
        return
    if not _script_failed(attempt, result):
        attempt.why, attempt.fix = (
            "the process ran the script but wrote no result",
            "see probe-errors.log in the run directory",
        )


def _script_failed(attempt: Attempt, result: Path) -> bool:
    """Whether the script said it failed (``RESULT.failed``); the attempt says why."""
    failed_file = Path(str(result) + ".failed")
    if not failed_file.exists():
        return False
    attempt.why = f"the injected script failed: {failed_file.read_text()[:300]}"
    attempt.fix = "see probe-errors.log in the run directory"
    return True


def _wait(path: Path, wait_s: float) -> bool:
    failed = Path(str(path) + ".failed")
    deadline = time.time() + wait_s
    while time.time() < deadline:
        if path.exists() or failed.exists():
            return path.exists()
        time.sleep(POLL_S)
    return path.exists()


def _take(attempt: Attempt, path: Path) -> None:
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        attempt.why, attempt.fix = f"its result is unreadable: {exc}", "run `lorascope attach` again"
        return
    attempt.result = result if isinstance(result, dict) else {}
    attempt.ok = bool(attempt.result.get("ok"))
    attempt.pause_ms = attempt.result.get("pause_ms")
    if attempt.result.get("how"):
        attempt.how.append(f"ran by {attempt.result['how']}")
    if not attempt.ok:
        attempt.why = str(attempt.result.get("error") or "the probes did not start")
        attempt.fix = "see probe-errors.log in the run directory"
    elif attempt.result.get("on_demand_dumps") is False:
        attempt.notes.append(
            "no on-demand dumps (`lorascope hang` reads its stacks with py-spy; the stall watchdog runs)"
        )


def manifest_entry(attempts: list[Attempt], options: Options, began: float) -> dict[str, Any]:
    """What the manifest keeps of one ``lorascope attach``."""
    return {
        "t": began,
        "action": options.action,
        "host": socket.gethostname(),
        "by_pid": os.getpid(),
        "processes": [a.as_json() for a in attempts],
        "unknown_before": UNKNOWN_BEFORE if options.action == "attach" else None,
    }
