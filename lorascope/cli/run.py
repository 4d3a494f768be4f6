"""`lorascope run [--out DIR] -- CMD...`: run a launch command with the probes injected
into every rank; the exit status is the job's."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import click

from lorascope.analysis.summary import build_summary
from lorascope.errors import LorascopeError, UsageError
from lorascope.probes.bootstrap import sitecustomize_source
from lorascope.probes.kernels import parse_window
from lorascope.rundir.reader import load_run
from lorascope.rundir.schema import BOOTSTRAP_DIR
from lorascope.rundir.writer import record_launch, record_ranks
from lorascope.text.summary import render_text


def _prepare(out: Path) -> Path | None:
    """Create the run directory and its bootstrap folder; returns the bootstrap path, or
    None (warned) when it cannot be written: the job then runs without probes."""
    try:
        bootstrap = out / BOOTSTRAP_DIR
        bootstrap.mkdir(parents=True, exist_ok=True)
        (bootstrap / "sitecustomize.py").write_text(sitecustomize_source())
    except OSError as exc:
        click.echo(
            f"lorascope: warning: cannot write the run directory {out} ({exc.strerror}); the job runs without probes",
            err=True,
        )
        return None
    return bootstrap


def _child_env(
    out: Path, bootstrap: Path, launch_id: str, sample_interval: float, trace_window: str, memory_history: bool
) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(bootstrap), env.get("PYTHONPATH", "")) if p)
    env["LORASCOPE_RUN_DIR"] = str(out)
    env["LORASCOPE_LAUNCH_ID"] = launch_id
    env["LORASCOPE_SAMPLE_INTERVAL"] = str(sample_interval)
    env["LORASCOPE_TRACE_WINDOW"] = trace_window
    if not memory_history:
        env["LORASCOPE_MEMORY_HISTORY"] = "off"
    env.pop("LORASCOPE_ATTACHED_PID", None)
    return env


def _wait(proc: subprocess.Popen[bytes]) -> int:
    """Wait for the job; SIGTERM/SIGHUP are passed on, Ctrl-C reaches it through the terminal."""

    def forward(signum: int, _frame: object) -> None:
        proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGHUP)}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        rc = proc.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return rc if rc >= 0 else 128 - rc


@click.command("run", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=None,
    help="Run directory (default: lorascope-runs/<date-time>). Several launchers of one multi-node job may share it.",
)
@click.option(
    "--sample-interval",
    type=float,
    default=0.5,
    show_default=True,
    help="Seconds between background memory samples (0: step and phase edges only).",
)
@click.option(
    "--trace-window",
    default="5:2",
    show_default=True,
    help="Kernel trace: START:STEPS traces steps START+1..START+STEPS; 'off' for none.",
)
@click.option(
    "--memory-history/--no-memory-history",
    default=True,
    show_default=True,
    help="On CUDA ranks, record the allocator's history (Python stacks) for the snapshots "
    "written at an OOM, a hang dump or a stall. LORASCOPE_MEMORY_HISTORY=N sets the entries kept.",
)
@click.option("--summary/--no-summary", default=True, help="Print the per-rank summary at the end.")
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
def command(
    out: Path | None,
    sample_interval: float,
    trace_window: str,
    memory_history: bool,
    summary: bool,
    cmd: tuple[str, ...],
) -> int:
    """Run CMD (torchrun, deepspeed, python ...) with the probes in every rank."""
    if sample_interval < 0:
        raise UsageError("--sample-interval must be >= 0")
    try:
        parse_window(trace_window)
    except ValueError as exc:
        raise UsageError(f"--trace-window: {exc}") from None
    out = (out or Path("lorascope-runs") / time.strftime("%Y%m%d-%H%M%S")).absolute()
    bootstrap = _prepare(out)
    launch_id = f"{socket.gethostname()}-{os.getpid()}"
    record_launch(out, launch_id, list(cmd))
    click.echo(f"lorascope: recording to {out}", err=True)
    try:
        env = (
            _child_env(out, bootstrap, launch_id, sample_interval, trace_window, memory_history) if bootstrap else None
        )
        proc = subprocess.Popen(list(cmd), env=env)
    except OSError as exc:
        record_launch(out, launch_id, list(cmd), end=time.time(), exit_status=127)
        raise UsageError(f"cannot start {cmd[0]!r}: {exc.strerror}") from None
    rc = _wait(proc)
    record_launch(out, launch_id, list(cmd), end=time.time(), exit_status=rc)
    try:
        run = load_run(out)
        data = build_summary(run)
        record_ranks(out, {str(r["rank"]): {k: r[k] for k in ("pid", "host", "ended")} for r in data["ranks"]})
        if summary:
            click.echo(render_text(data), err=True)
    except Exception as exc:  # whatever happened to the run directory, the status is the job's
        reason = str(exc) if isinstance(exc, LorascopeError) else f"{exc.__class__.__name__}: {exc}"
        click.echo(f"lorascope: the run directory could not be summarised: {reason[:300]}", err=True)
    sys.stderr.flush()
    return rc
