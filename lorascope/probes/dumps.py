"""Evidence for a hung job, taken without stopping it: on demand (``lorascope hang``
sends DUMP_SIGNAL) and by a stall watchdog (no step finished for ``stall_seconds``).

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

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from lorascope.probes.exits import thread_stacks
from lorascope.probes.session import Session
from lorascope.rundir.schema import DUMP_SIGNAL

#: The stall watchdog fires after this share of the process-group timeout ...
STALL_SHARE_OF_PG_TIMEOUT = 1 / 3
#: ... within these bounds (seconds).
STALL_MIN, STALL_MAX = 5.0, 300.0
TORCH_DEFAULT_PG_TIMEOUT = 30 * 60.0
#: Stall dumps a process writes at most (the watchdog fires again after a step: a job
#: with evaluations longer than the limit would write one each). After the first, a stall
#: dump comes with the flight recorder's dump but no allocator snapshot (which can be
#: hundreds of MB on a large CUDA job).
MAX_STALL_DUMPS = 20


def stall_seconds(pg_timeout: float | None, override: float | None) -> float:
    if override is not None:
        return override
    timeout = pg_timeout or TORCH_DEFAULT_PG_TIMEOUT
    return min(max(timeout * STALL_SHARE_OF_PG_TIMEOUT, STALL_MIN), STALL_MAX)


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
    ) -> None:
        self.session = session
        self._pending = pending
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
        self.dump = session.guarded("dumps")(self._dump)

    def _dump(self, reason: str, beside: Callable[[str], None] | None = None) -> None:
        with self._lock:  # one dump at a time (a signal during the watchdog's)
            session = self.session
            session.record(
                "dump",
                reason=reason,
                step=session.step,
                stacks=thread_stacks()[-100_000:],
                pending=self._pending(),
                mem=self._reading(),
                since_progress=None if self.last_progress is None else round(time.time() - self.last_progress, 3),
            )
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
        self.last_progress = time.time()
        self._stall_fired = False  # a step after a stall: the next stall is dumped too

    def start_watchdog(self) -> None:
        threading.Thread(target=self._watch, name="lorascope-watchdog", daemon=True).start()

    def _watch(self) -> None:
        while self.session.active:
            limit = stall_seconds(self._pg_timeout(), self._stall_override)
            time.sleep(min(1.0, limit / 5))
            if self._stall_dumps >= MAX_STALL_DUMPS:
                return
            last = self.last_progress
            if not self._stall_fired and self.session.step > 0 and last is not None and time.time() - last > limit:
                self._stall_fired = True  # once a stall: the evidence is taken, the job is left alone
                self.session.record("stall", seconds=round(time.time() - last, 3), limit=limit, step=self.session.step)
                self.dump("stall", self._repeat_flight if self._stall_dumps else None)
                self._stall_dumps += 1


def _no_op(signum: int, frame: Any) -> None:
    """The Python-level handler of DUMP_SIGNAL in an attached process: the work is done by
    the dump thread that reads the wakeup pipe."""
