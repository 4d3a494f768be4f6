"""The job under `lorascope run`: its own process group, the signals a scheduler or a
user sends passed on to every process group of the job, and nothing left behind.

Launchers put their ranks in groups and sessions of their own (torchrun starts each
worker in a new session), and a launcher killed by a signal it does not handle (SIGUSR1,
which SLURM and Kubernetes send before pre-emption) leaves its ranks running. So a
forwarded signal goes to the process group of every process of the job, `lorascope run`
is the job's child subreaper (Linux: ranks whose launcher died are re-parented to it,
not to init), and whatever of the job outlives its main process is terminated, then
killed, and reaped. A second SIGINT or SIGTERM kills the whole job at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import click
import psutil

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
#: A second one of these escalates to SIGKILL.
STOPPING = (signal.SIGINT, signal.SIGTERM)
#: Seconds the job's leftover processes get between SIGTERM and SIGKILL.
LEFTOVER_GRACE_S = 10.0
_PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper() -> None:
    """Orphaned descendants are re-parented to this process (Linux only; best effort)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _held_terminal() -> int | None:
    """The controlling terminal's fd (stdin), when this process's group holds it."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        fd = sys.stdin.fileno()
        if os.isatty(fd) and os.tcgetpgrp(fd) == os.getpgrp():
            return fd
    return None


def _own_group(terminal: int | None) -> None:
    """In the job's process, before it runs (``preexec_fn``): a process group of its own,
    and the terminal for it. Done here and not only from this process after the start: a
    job that reads its terminal at once (``read x``, a debugger prompt) would otherwise read
    it from the background first and be stopped by SIGTTIN for good."""
    os.setpgrp()
    if terminal is not None:
        with contextlib.suppress(OSError):
            _set_foreground(terminal, os.getpgrp())


@contextlib.contextmanager
def _terminal_to(fd: int | None, pgid: int) -> Iterator[None]:
    """Hand the controlling terminal (Ctrl-C, a debugger's prompt) to the job's group
    while it runs, when this process held it; take it back afterwards."""
    if fd is not None:
        with contextlib.suppress(OSError):
            _set_foreground(fd, pgid)
    try:
        yield
    finally:
        if fd is not None:
            with contextlib.suppress(OSError):
                _set_foreground(fd, os.getpgrp())


def _set_foreground(fd: int, pgid: int) -> None:
    """tcsetpgrp with SIGTTOU blocked: a background group may not call it otherwise (a
    signal mask, not a handler: it also serves in the forked job before its exec)."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTTOU})
    try:
        os.tcsetpgrp(fd, pgid)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


class Job:
    """The launch command, started in a process group of its own."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None) -> None:
        _become_subreaper()
        self._terminal = _held_terminal()
        try:
            self.proc: subprocess.Popen[bytes] = subprocess.Popen(
                cmd, env=env, preexec_fn=functools.partial(_own_group, self._terminal)
            )
        except OSError:  # not started (no such command): the terminal back, if the child took it
            if self._terminal is not None:
                with contextlib.suppress(OSError):
                    _set_foreground(self._terminal, os.getpgrp())
            raise
        self.stops = 0
        #: The signals passed on, by name, in order (the manifest records them).
        self.forwarded: list[str] = []
        #: The processes of the job that outlived its main process and were sent SIGTERM
        #: (``{"t", "pids"}``; the manifest records it as the launch's ``leftovers``).
        self.terminated: dict[str, object] | None = None

    def _groups(self) -> set[int]:
        """The process group of every live process of the job."""
        groups = {self.proc.pid}
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process().children(recursive=True):
                with contextlib.suppress(OSError):
                    groups.add(os.getpgid(child.pid))
        groups.discard(os.getpgrp())  # never this process's own group
        return groups

    def send(self, signum: int) -> None:
        for pgid in self._groups():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signum)

    def _on_signal(self, signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        if signum in STOPPING:
            self.stops += 1
            if self.stops > 1:
                click.echo(f"lorascope: {name} again: killing the job (SIGKILL)", err=True)
                self.forwarded.append("SIGKILL")
                self.send(signal.SIGKILL)
                return
        click.echo(f"lorascope: passing {name} on to the job", err=True)
        self.forwarded.append(name)
        self.send(signum)

    def wait(self) -> int:
        """Wait for the job (signals passed on meanwhile), then clear what is left of it.
        Returns the exit status as a shell reports it (128 + N for signal N)."""
        previous = {s: signal.signal(s, self._on_signal) for s in FORWARDED}
        try:
            with _terminal_to(self._terminal, self.proc.pid):
                rc = self.proc.wait()
            self._clear_leftovers()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return rc if rc >= 0 else 128 - rc

    def _clear_leftovers(self) -> None:
        """Processes of the job still running after its main process ended (ranks whose
        launcher died, re-parented here): SIGTERM, then SIGKILL after a grace period.
        After a forwarded signal they first get the grace period to end of it (a rank
        writing its stacks and flight-recorder dump)."""
        try:
            left = psutil.Process().children(recursive=True)
        except psutil.Error:
            return
        if left and self.forwarded:
            _, left = psutil.wait_procs(left, timeout=LEFTOVER_GRACE_S)
        if not left:
            return
        live = [p for p in left if _running(p)]
        if live:
            pids = ", ".join(str(p.pid) for p in live)
            click.echo(f"lorascope: {len(live)} processes of the job outlived it (pids {pids}): terminating", err=True)
        if live:
            self.terminated = {"t": time.time(), "pids": [p.pid for p in live]}
        for p in live:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, alive = psutil.wait_procs(left, timeout=LEFTOVER_GRACE_S)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(alive, timeout=LEFTOVER_GRACE_S)


def _running(p: psutil.Process) -> bool:
    try:
        return bool(p.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False
