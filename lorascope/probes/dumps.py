"""Evidence for a hung job, taken without stopping it: on demand (``lorascope hang``
writes a request file into the run directory and sends DUMP_SIGNAL to the ranks on its
own host) and by a stall watchdog (no step finished for ``stall_seconds``).

The request file (``DUMP_REQUEST``) reaches every rank that shares the run directory,
on any host and in any PID namespace: the watchdog thread opens it once a second (an
open, not only a stat: on NFS an open revalidates the file's attributes, which a stat may
serve from a cache for seconds) and answers a new request with a dump that carries its
id. Nothing of it runs on the job's threads.

A rank stuck in a collective sits in C code with the GIL released, where a Python
signal handler would never run. So the signal is blocked in the main thread at attach
(threads started later inherit the mask) and taken by a dedicated thread with
``sigwait``; that thread reads every thread's stack, the pending collectives, a
memory reading and torch's flight recorder, and writes them as a ``dump`` record; on a
CUDA rank it also writes an allocator snapshot (probes/allocator.py). ``kill -URG PID``
asks one rank for the same.

DUMP_SIGNAL is SIGURG: its default action is to ignore it, so a process without
lorascope's thread (or not lorascope's at all) is never harmed by one; training stacks
do not use it (it is raised only for sockets that asked for out-of-band data).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lorascope.probes.exits import thread_stacks
from lorascope.probes.session import Session
from lorascope.rundir.format.schema import DUMP_SIGNAL

#: The stall watchdog fires after this share of the process-group timeout ...
STALL_SHARE_OF_PG_TIMEOUT = 1 / 3
#: ... within these bounds (seconds) ...
STALL_MIN, STALL_MAX = 5.0, 300.0
#: ... or sooner: after STALL_STEPS times the median step, and no sooner than STALL_FLOOR.
STALL_STEPS, STALL_FLOOR = 10.0, 60.0
#: The step times the median is taken over (the latest).
STEP_TIMES_KEPT = 64
#: How often the watchdog thread looks for a dump request (seconds).
REQUEST_EVERY_S = 1.0
#: What is read of a request file, at most.
MAX_REQUEST_BYTES = 4096
#: A DUMP_SIGNAL this soon after a request was answered is that request's (`lorascope
#: hang` writes the file, then signals the ranks on its host): no second dump.
SIGNAL_AFTER_REQUEST_S = 2.0
TORCH_DEFAULT_PG_TIMEOUT = 30 * 60.0
#: Stall dumps a process writes at most (the watchdog fires again after a step: a job
#: with evaluations longer than the limit would write one each). After the first, a stall
#: dump comes with the flight recorder's dump but no allocator snapshot (which can be
#: hundreds of MB on a large CUDA job).
MAX_STALL_DUMPS = 20


def stall_seconds(pg_timeout: float | None, override: float | None, median_step: float | None = None) -> float:
    """How long without a step before the watchdog dumps: ``override`` if set, else
    max(STALL_FLOOR, STALL_STEPS x the median step), but never later than a third of the
    process-group timeout (5 s to 5 minutes): the dump must come before the timeout ends
    the job."""
    if override is not None:
        return override
    timeout = pg_timeout or TORCH_DEFAULT_PG_TIMEOUT
    by_timeout = min(max(timeout * STALL_SHARE_OF_PG_TIMEOUT, STALL_MIN), STALL_MAX)
    by_steps = max(STALL_FLOOR, STALL_STEPS * median_step) if median_step else STALL_MAX
    return min(by_timeout, by_steps)


def read_request(path: Path) -> tuple[tuple[int, int, int], str] | None:
    """The dump request in ``path``: (what identifies this version of the file: inode,
    mtime, size; the request's id), or None when there is none. One open and one fstat
    (and a read of MAX_REQUEST_BYTES when it changed: the caller compares the key)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        data = os.read(fd, MAX_REQUEST_BYTES)
    finally:
        os.close(fd)
    try:
        found = json.loads(data)
        request = str(found["id"])[:200]
    except (ValueError, KeyError, TypeError, RecursionError):
        request = f"{st.st_ino}-{st.st_mtime_ns}"
    return (st.st_ino, st.st_mtime_ns, st.st_size), request


class Dumper:
    def __init__(
        self,
        session: Session,
        pending: Callable[[], list[dict[str, Any]]],
        reading: Callable[[], dict[str, Any] | None],
        flight: Callable[[str], None],
        pg_timeout: Callable[[], float | None],
        stall_override: float | None,
        repeat_flight: Callable[[str], None] | None = None,
        progress_known: bool = True,
        request_path: Path | None = None,
        made: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        self.session = session
        self._pending = pending
        #: The calls made so far per process group (a dump's ``made``: `lorascope hang`
        #: tells ranks whose answers agree from a few of them).
        self._made = made
        self._reading = reading
        self._flight = flight
        #: What a stall dump after the first writes beside it (default: as ``flight``).
        self._repeat_flight = repeat_flight or flight
        self._pg_timeout = pg_timeout
        self._stall_override = stall_override
        self._lock = threading.Lock()
        #: When the rank last finished a step; None in a process attached while it ran,
        #: until its first step since (the attach is no progress: a hung rank dumped right
        #: after it must not read as moving).
        self.last_progress: float | None = time.time() if progress_known else None
        self._stall_fired = False
        self._stall_dumps = 0
        #: The wakeup pipe of a process attached while it ran (read end, write end).
        self._wakeup: tuple[int, int] | None = None
        #: The native id of the thread that takes DUMP_SIGNAL (``lorascope hang`` signals it).
        self.thread_id: int | None = None
        #: The latest step times (appended on the job's thread at a step's end; read here).
        self._step_times: deque[float] = deque(maxlen=STEP_TIMES_KEPT)
        self._request_path = request_path
        #: The request file as it was when last looked at (one there before attach is old).
        self._request_seen = self._look(request_path)
        self._answered_at = 0.0
        self.dump = session.guarded("dumps")(self._dump)
        self.answer_request = session.guarded("dumps")(self._answer_request)

    @staticmethod
    def _look(path: Path | None) -> tuple[int, int, int] | None:
        found = read_request(path) if path is not None else None
        return found[0] if found else None

    def _fresh_request(self) -> str | None:
        """The id of a request made since the last one looked at, if any (marked seen)."""
        if self._request_path is None:
            return None
        found = read_request(self._request_path)
        if found is None or found[0] == self._request_seen:
            return None
        self._request_seen = found[0]
        return found[1]

    def _answer_request(self) -> None:
        """A dump for a new request in the run directory (the watchdog thread, once a second)."""
        with self._lock:
            request = self._fresh_request()
        if request is not None:
            self.dump("request", request=request)

    def _dump(self, reason: str, beside: Callable[[str], None] | None = None, request: str | None = None) -> None:
        with self._lock:  # one dump at a time (a signal during the watchdog's)
            session = self.session
            if reason == "signal":  # `lorascope hang` wrote a request before signalling
                request = self._fresh_request()
                if request is None and time.time() - self._answered_at < SIGNAL_AFTER_REQUEST_S:
                    return  # the request this signal came with is answered already
            fields: dict[str, Any] = {"request": request} if request is not None else {}
            if self._made is not None:
                fields["made"] = self._made()
            session.record(
                "dump",
                reason=reason,
                step=session.step,
                stacks=thread_stacks()[-100_000:],
                pending=self._pending(),
                mem=self._reading(),
                since_progress=None if self.last_progress is None else round(time.time() - self.last_progress, 3),
                **fields,
            )
            if request is not None:
                self._answered_at = time.time()
            session.flush()
            (beside or self._flight)(f"{reason}-{int(time.time())}")
            session.flush()  # its record too: `lorascope hang` reads the run right after

    # -- on demand ----------------------------------------------------------------
    def install_signal(self) -> bool:
        """Block DUMP_SIGNAL here (the main thread, before the job starts threads) and
        take it in a waiter thread. False when attached too late to do it safely."""
        if threading.current_thread() is not threading.main_thread() or threading.active_count() > 1:
            return False
        signal.pthread_sigmask(signal.SIG_BLOCK, {DUMP_SIGNAL})
        threading.Thread(target=self._wait_for_signals, name="lorascope-dump", daemon=True).start()
        return True

    def install_wakeup(self) -> str | None:
        """On-demand dumps for a process attached while it runs (``lorascope attach``),
        whose threads started without DUMP_SIGNAL blocked. A no-op Python handler makes
        CPython's C handler write the signal's number to a wakeup pipe, from whichever
        thread takes it, even while the main thread waits in native code; a dump thread
        reads the pipe, and ``lorascope hang`` sends the signal to that thread alone
        (``thread_id``), so no thread of the job is interrupted by it. Main thread only,
        and never over the job's own use of DUMP_SIGNAL or of a wakeup fd (asyncio's).
        Returns why it was not installed, or None."""
        if threading.current_thread() is not threading.main_thread():
            return "not started in the main thread"
        if signal.getsignal(DUMP_SIGNAL) not in (signal.SIG_DFL, signal.SIG_IGN):
            return f"the job handles {DUMP_SIGNAL.name} itself"
        read, write = os.pipe()
        os.set_blocking(write, False)
        previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        if previous != -1:
            signal.set_wakeup_fd(previous)
            os.close(read)
            os.close(write)
            return "the job has a signal wakeup fd of its own"
        signal.signal(DUMP_SIGNAL, _no_op)
        self._wakeup = (read, write)
        started = threading.Event()
        threading.Thread(target=self._read_wakeups, args=(read, started), name="lorascope-dump", daemon=True).start()
        started.wait(5.0)
        return None

    def _read_wakeups(self, read: int, started: threading.Event) -> None:
        self.thread_id = threading.get_native_id()
        started.set()
        while self.session.active:
            try:
                data = os.read(read, 64)
            except OSError:
                return
            if not data:
                return  # the write end closed: detached
            if DUMP_SIGNAL in data:
                self.dump("signal")

    def remove_wakeup(self) -> None:
        """Undo :meth:`install_wakeup` (main thread): the job's signal state as it was."""
        if self._wakeup is None or threading.current_thread() is not threading.main_thread():
            return
        read, write = self._wakeup
        self._wakeup = None
        previous = signal.set_wakeup_fd(-1)
        if previous != write:  # someone else's since: theirs stays
            signal.set_wakeup_fd(previous)
        if signal.getsignal(DUMP_SIGNAL) is _no_op:
            signal.signal(DUMP_SIGNAL, signal.SIG_DFL)
        os.close(write)  # the dump thread reads the end of the pipe and returns

    def _wait_for_signals(self) -> None:
        while self.session.active:
            signal.sigwait({DUMP_SIGNAL})
            self.dump("signal")

    # -- stall watchdog -----------------------------------------------------------
    def progress(self) -> None:
        now = time.time()
        if self.last_progress is not None:  # an attached process's first step has no length known
            self._step_times.append(now - self.last_progress)
        self.last_progress = now
        self._stall_fired = False  # a step after a stall: the next stall is dumped too

    def median_step(self) -> float | None:
        """The median of the latest step times (the first step's, with the job's start-up, left out)."""
        times = list(self._step_times)[1:] if len(self._step_times) < STEP_TIMES_KEPT else list(self._step_times)
        return statistics.median(times) if times else None

    def start_watchdog(self) -> None:
        threading.Thread(target=self._watch, name="lorascope-watchdog", daemon=True).start()

    def _watch(self) -> None:
        while self.session.active:
            limit = stall_seconds(self._pg_timeout(), self._stall_override, self.median_step())
            time.sleep(min(REQUEST_EVERY_S, limit / 5))
            self.answer_request()
            if self._stall_dumps >= MAX_STALL_DUMPS:
                continue  # requests are still answered
            last = self.last_progress
            if not self._stall_fired and self.session.step > 0 and last is not None and time.time() - last > limit:
                self._stall_fired = True  # once a stall: the evidence is taken, the job is left alone
                self.session.record("stall", seconds=round(time.time() - last, 3), limit=limit, step=self.session.step)
                self.session.keep_steps.add(self.session.step)
                self.dump("stall", self._repeat_flight if self._stall_dumps else None)
                self._stall_dumps += 1


def _no_op(signum: int, frame: Any) -> None:
    """The Python-level handler of DUMP_SIGNAL in an attached process: the work is done by
    the dump thread that reads the wakeup pipe."""
