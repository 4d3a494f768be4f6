"""How a rank ends, written before the process is gone: Python warnings, the exception
that ended it (full text, e.g. a CUDA OOM message), a terminating signal with every
thread's stack, and an ``end`` record at exit. A rank killed by SIGKILL writes no ``end``;
the reader says so."""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import IO, Any

from lorascope.probes.session import Session
from lorascope.rundir.format import safe_open
from lorascope.rundir.format.writer import fatal_path

MAX_WARNINGS = 200
_TERMINATING = ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
#: Held off while the probes write how the process ends (``_signals_held``).
_HELD = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Ctrl-C and the terminating signals dropped (a handler that does nothing) while the
    probes write how the process ends, then set back. A second SIGINT (a launcher passing on the
    one the rank got already: `lorascope run` and torchrun both do, ms apart) raised a
    KeyboardInterrupt inside the exception hook while it read source lines for the stacks
    (~20 ms): the record was lost, and the rank read "exit 0" at its exit. The process is
    ending already when they come. Only on the main thread (where handlers are set)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: dict[int, Any] = {}
    for name in _HELD:
        signum = getattr(signal, name, None)
        try:
            previous = signal.getsignal(signum) if signum is not None else None
            if signum is not None and previous not in (None, signal.SIG_IGN):
                signal.signal(signum, _dropped)
                held[signum] = previous
        except (ValueError, OSError):
            pass
    try:
        yield
    finally:
        for signum, previous in held.items():
            with contextlib.suppress(ValueError, OSError):
                signal.signal(signum, previous)


def _dropped(signum: int, frame: FrameType | None) -> None:
    """A signal that came while the probes wrote how the process ends."""


def thread_stacks() -> str:
    """Every thread's Python stack, as text."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"Thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


def install_fatal_handler(session: Session, prefix: Path) -> IO[str] | None:
    """Python's faulthandler writes every thread's stack to ``PREFIX.fatal.txt`` when the
    rank dies of SIGSEGV, SIGFPE, SIGABRT, SIGBUS or SIGILL: a C++ abort (gloo's "Received
    data size doesn't match", ``std::terminate``) leaves no exception, no signal record and
    no end record, only this file (announced by a ``fatal_handler`` record). Left alone when
    the job enabled faulthandler itself (PYTHONFAULTHANDLER, ``-X faulthandler``). Returns
    the open file (it must stay open while the process lives).

    It stays enabled through the interpreter's teardown, after the end record: a process
    group destroyed there can abort a rank whose job has finished (gloo's threads,
    "terminate called without an active exception"), which only this file then tells. So
    the file exists while the process lives; `lorascope run` removes the empty ones of its
    processes once they are gone (the reader ignores an empty one)."""
    if faulthandler.is_enabled():
        return None
    path = fatal_path(prefix)
    file = os.fdopen(safe_open.create(path), "w")  # kept open for the life of the process
    faulthandler.enable(file=file, all_threads=True)
    session.record("fatal_handler", file=path.name)
    return file


class ExitProbe:
    def __init__(
        self,
        session: Session,
        on_end: Callable[[], None],
        on_crash: Callable[[str], None],
        on_exception: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.session = session
        self._on_end = on_end
        self._on_crash = session.guarded("flight")(on_crash)
        #: Sees the uncaught exception itself (an OOM in its chain dumps an allocator snapshot).
        self._on_exception = on_exception
        self._seen_warnings = 0
        self._exit_code: int | None = None
        self._exception_recorded = False

    def install(self) -> None:
        self._install_warnings()
        self._install_excepthook()
        self._install_exit()
        self._install_signals()
        atexit.register(self._at_exit)

    def _install_warnings(self) -> None:
        previous = warnings.showwarning
        probe = self

        def showwarning(
            message: Any, category: type, filename: str, lineno: int, file: Any = None, line: str | None = None
        ) -> None:
            probe._warning(message, category, filename, lineno)
            previous(message, category, filename, lineno, file, line)

        warnings.showwarning = showwarning

    def _warning(self, message: Any, category: type, filename: str, lineno: int) -> None:
        if self._seen_warnings >= MAX_WARNINGS:
            return
        self._seen_warnings += 1
        try:
            self.session.record(
                "warning",
                category=category.__name__,
                message=str(message)[:4000],
                filename=str(filename),
                lineno=int(lineno),
            )
        except Exception as exc:
            self.session.fail("warnings", exc)

    def _install_excepthook(self) -> None:
        previous = sys.excepthook

        def excepthook(exc_type: type, exc: BaseException, tb: Any) -> None:
            with _signals_held():
                self._record_exception(exc_type, exc, tb, thread_stacks)
                previous(exc_type, exc, tb)

        sys.excepthook = excepthook

    def _record_exception(self, exc_type: type, exc: BaseException, tb: Any, stacks: Callable[[], str]) -> None:
        """The exception record, the crash dumps and the end record of an uncaught exception."""
        try:
            if not self._exception_recorded:
                self.session.record(
                    "exception",
                    type=exc_type.__name__,
                    message=str(exc)[:20000],
                    traceback="".join(traceback.format_exception(exc_type, exc, tb))[-50000:],
                    stacks=stacks()[-50000:],
                )
                self._exception_recorded = True
                self.session.flush()
                if self._on_exception is not None:
                    self._on_exception(exc)
                self._on_crash("exception")
            self._write_end("exception", 1)
        except Exception:
            pass

    def _uncaught(self) -> BaseException | None:
        """The exception the interpreter printed as uncaught, if the job dies of one: it sets
        ``sys.last_value`` before it calls the exception hook, so this holds even when the
        hook never wrote it. A second Ctrl-C pending when the first KeyboardInterrupt reached
        the hook fires at the hook's first line, before it can hold signals off: the rank
        then read "exit 0" (an e2e test saw it under load, one run in four beside a CPU hog)."""
        exc = getattr(sys, "last_value", None)
        return exc if isinstance(exc, BaseException) and not isinstance(exc, SystemExit) else None

    def _install_exit(self) -> None:
        """Remember the code given to sys.exit (atexit cannot see it)."""
        previous = sys.exit
        probe = self

        def exit(code: Any = None) -> None:
            probe._exit_code = code if isinstance(code, int) else (0 if code is None else 1)
            previous(code)

        sys.exit = exit  # type: ignore[assignment]

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for name in _TERMINATING:
            signum = getattr(signal, name, None)
            if signum is not None and signal.getsignal(signum) is signal.SIG_DFL:
                signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        try:
            with _signals_held():
                name = signal.Signals(signum).name
                self.session.record("signal", signum=signum, name=name, stacks=thread_stacks()[-50000:])
                self.session.flush()
                self._on_crash("signal")
                self._write_end("signal", -signum)
        finally:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

    def _write_end(self, status: str, code: int | None, why: str | None = None) -> None:
        if self.session.ended:
            return
        self.session.ended = True
        self._on_end()
        self.session.record("end", status=status, code=code, **({} if why is None else {"why": why}))
        self.session.flush()

    def _at_exit(self) -> None:
        try:
            if self._exit_code is not None:
                self._write_end("exit", self._exit_code)
                return
            uncaught = None if self.session.ended else self._uncaught()
            if uncaught is not None:
                with _signals_held():  # the process is ending of it: its stacks say nothing now
                    self._record_exception(type(uncaught), uncaught, uncaught.__traceback__, lambda: "")
                return
            missing = unopened_script()
            if missing is not None:  # python exits 2 without a SystemExit the probes see
                self._write_end("exit", 2, f"python could not open the script {missing!r}: it never ran")
            else:
                self._write_end("exit", 0)
        except Exception:
            pass


def unopened_script() -> str | None:
    """The script python was given and could not open (``python /no/such.py``: it prints
    "can't open file" and exits 2 with no exception, after the exit handlers ran), else
    None. Its ``__main__`` never ran, so has no ``__file__``; ``-c``, ``-m`` and stdin
    name no script."""
    main = sys.modules.get("__main__")
    if main is None or hasattr(main, "__file__") or not sys.argv or sys.argv[0] in ("", "-", "-c", "-m"):
        return None
    path = sys.argv[0]
    return None if os.access(path, os.R_OK) else path  # a folder without __main__.py exits 1: not this
