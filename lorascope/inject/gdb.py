"""Injection through gdb, for interpreters older than 3.14 (no ``sys.remote_exec``).

gdb attaches (the process stops), loads only libc's and libpython's symbols, maps a page
in the process (``mmap``: no lock of the process's allocator is taken, so a thread
stopped inside ``malloc`` cannot deadlock us) and writes the line to run there, then
either:

- ``queue``: ``Py_AddPendingCall(PyRun_SimpleString, line)`` and detaches. The main
  thread runs it at its next check between bytecodes, with the GIL, as it runs a signal
  handler: the safe way, and the usual one (memray's attach does the same first). A main
  thread blocked in native code (a collective that never returns) never gets there.
- ``direct`` (when the queued call was not run): if the main thread is not holding the
  GIL and is not inside the interpreter's GIL or allocator code (its innermost frames,
  by name, up to the first frame outside libc and libpython: those two libraries'
  symbols are loaded, so GIL and allocator code is always named, and an innermost frame
  that is not named is refused), ``PyGILState_Ensure``, ``PyRun_SimpleString``,
  ``PyGILState_Release`` on it, as a native callback into Python would; otherwise
  nothing is done and the reason is printed. A thread blocked in a collective waits in a
  libc call (``recv``, ``poll``, a futex): it qualifies. The symbols are read whole
  (DWARF included: ``--readnever`` leaves libpython's static functions, ``take_gil``
  among them, unnamed, which this check cannot afford): on a Python built with debug
  information that is most of the stop (~1 s here). ``queue`` reads the ELF symbols only.

The process is stopped from gdb's attach to its detach: ``stopped_ms`` is the time from
just before the attach to the script's end (an upper bound: it includes gdb's reading of
the symbols, with the process stopped), ``script_ms`` the script's own share. Everything the gdb side prints for us is one ``LORASCOPE {json}`` line.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

#: gdb's whole run, at most: attach, a few symbol tables, one or two calls.
GDB_TIMEOUT_S = 60.0

#: Innermost frames (by name) in which the main thread must not be made to take the GIL:
#: the interpreter's GIL and pending-call code, and the C allocator's.
UNSAFE_FRAMES = (
    "take_gil",
    "drop_gil",
    "PyEval_RestoreThread",
    "PyEval_SaveThread",
    "PyEval_AcquireThread",
    "PyEval_ReleaseThread",
    "PyEval_AcquireLock",
    "PyGILState_Ensure",
    "PyGILState_Release",
    "Py_AddPendingCall",
    "_PyEval_AddPendingCall",
    "make_pending_calls",
    "malloc",
    "calloc",
    "realloc",
    "free",
    "_int_malloc",
    "_int_free",
    "_int_realloc",
    "malloc_consolidate",
    "__libc_malloc",
    "__libc_free",
    "__libc_calloc",
    "__libc_realloc",
    "_dl_",
    "fork",
)

GDB_SCRIPT = r"""
import json, time
import gdb

began = time.monotonic()


def say(**fields):
    now = time.monotonic()
    fields["stopped_ms"] = round((now - LORASCOPE_T0) * 1e3, 3)
    fields["script_ms"] = round((now - began) * 1e3, 3)
    print("LORASCOPE " + json.dumps(fields), flush=True)


def call(expr):
    return int(gdb.parse_and_eval(expr))


def main(args):
    try:
        for name in ("Py_AddPendingCall", "PyRun_SimpleString", "PyGILState_Ensure", "PyGILState_Check"):
            gdb.parse_and_eval("(long)&" + name)
    except gdb.error as exc:
        return say(ok=False, why="no-python-symbols", detail=str(exc))
    main_thread = [t for t in gdb.selected_inferior().threads() if t.ptid[1] == t.ptid[0]]
    if main_thread:
        main_thread[0].switch()
    code = args["code"].encode() + b"\0"
    addr = call("((void*(*)(void*, unsigned long, int, int, int, long))mmap)(0, %d, 3, 34, -1, 0)" % (len(code) + 4096))
    if addr in (0, -1, (1 << 64) - 1):
        return say(ok=False, why="mmap-failed", detail=hex(addr))
    gdb.selected_inferior().write_memory(addr, code)
    if args["mode"] == "queue":
        rc = call("((int(*)(void*, void*))Py_AddPendingCall)((void*)PyRun_SimpleString, (void*)%d)" % addr)
        return say(ok=rc == 0, mode="queue", rc=rc, why=None if rc == 0 else "pending-calls-full")
    names = []
    frame = gdb.newest_frame()
    while frame is not None and len(names) < 16:
        name = frame.name()
        if name is None:
            break
        names.append(name)
        try:
            frame = frame.older()
        except gdb.error:
            break
    if not names:  # innermost code gdb cannot name (symbols of libc and libpython only): unknown
        return say(ok=False, mode="direct", why="main-thread-in-unknown-code", detail=names)
    unsafe = [n for n in names if any(n == u or (u.endswith("_") and n.startswith(u)) for u in args["unsafe"])]
    if unsafe:
        return say(ok=False, mode="direct", why="main-thread-in-gil-or-allocator", detail=names[:8])
    if call("((int(*)(void))PyGILState_Check)()"):
        return say(ok=False, mode="direct", why="main-thread-holds-gil", detail=names[:8])
    state = call("((int(*)(void))PyGILState_Ensure)()")
    rc = call("((int(*)(void*))PyRun_SimpleString)((void*)%d)" % addr)
    gdb.parse_and_eval("((void(*)(int))PyGILState_Release)(%d)" % state)
    return say(ok=rc == 0, mode="direct", rc=rc, why=None if rc == 0 else "run-failed", detail=names[:8])


try:
    main(ARGS)
except Exception as exc:
    say(ok=False, why="gdb-error", detail=str(exc)[:500])
"""


@dataclass
class GdbOutcome:
    ok: bool
    #: A short reason code when not ok (see :func:`explain`).
    why: str | None
    detail: str
    #: How long the process was stopped (gdb's attach to its detach, at most), ms.
    stopped_ms: float | None
    #: gdb's own wall time, ms.
    wall_ms: float


def script(code: str, mode: str) -> str:
    """The gdb Python script that injects ``code`` (one Python statement block) by ``mode``."""
    args = {"code": code, "mode": mode, "unsafe": list(UNSAFE_FRAMES)}
    return f"ARGS = {json.dumps(args)}\n" + GDB_SCRIPT


def command(gdb: str, pid: int, script_path: Path, mode: str = "direct") -> list[str]:
    """gdb in batch mode, attached to ``pid``, with only libc's and libpython's symbols
    loaded (libtorch's would take seconds, with the process stopped); for ``queue``, their
    ELF symbols only (``--readnever``: the exported functions it calls are all it needs,
    and their DWARF is most of the stop on a Python built with it)."""
    return [
        gdb,
        "-nx",
        "-nw",
        "-batch",
        *(["--readnever"] if mode == "queue" else []),
        "-iex",
        "set auto-solib-add off",
        "-iex",
        "python import time; LORASCOPE_T0 = time.monotonic()",  # just before the attach
        "-p",
        str(pid),
        "-ex",
        "sharedlibrary libc.so",
        "-ex",
        "sharedlibrary libpython",
        "-ex",
        "set unwindonsignal on",
        "-x",
        str(script_path),
    ]


def parse(output: str) -> dict[str, object] | None:
    for line in output.splitlines():
        if line.startswith("LORASCOPE "):
            try:
                found = json.loads(line[len("LORASCOPE ") :])
            except ValueError:
                return None
            return found if isinstance(found, dict) else None
    return None


def inject(pid: int, code: str, mode: str, script_path: Path, gdb: str | None = None) -> GdbOutcome:
    """Run ``code`` in ``pid`` through gdb by ``mode`` ("queue" or "direct")."""
    exe = shutil.which(gdb or "gdb")
    if exe is None:
        return GdbOutcome(False, "no-gdb", "", None, 0.0)
    script_path.write_text(script(code, mode))
    began = time.perf_counter()
    try:
        res = subprocess.run(
            command(exe, pid, script_path, mode),
            capture_output=True,
            text=True,
            timeout=GDB_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return GdbOutcome(False, "gdb-timeout", "", None, GDB_TIMEOUT_S * 1e3)
    wall = (time.perf_counter() - began) * 1e3
    said = parse(res.stdout)
    text = (res.stdout + res.stderr)[-2000:]
    if said is None:
        why = "ptrace-denied" if "ptrace: Operation not permitted" in text else "gdb-failed"
        if "ptrace: No such process" in text:
            why = "gone"
        return GdbOutcome(False, why, text.strip().splitlines()[-1] if text.strip() else "", None, wall)
    stopped = said.get("stopped_ms")
    return GdbOutcome(
        bool(said.get("ok")),
        str(said["why"]) if said.get("why") else None,
        json.dumps(said.get("detail")) if said.get("detail") is not None else "",
        float(stopped) if isinstance(stopped, int | float) else None,
        wall,
    )
