"""`lorascope run [--out DIR] -- CMD...`: run a launch command with the probes injected
into every rank; the exit status is the job's. It ends with where the verdict is (`lorascope
analyze`; the per-rank table with --summary) and one line saying how many processes
attached the probes (or, when none did, the likely reason)."""

from __future__ import annotations

import errno
import os
import secrets
import socket
import sys
import time
from pathlib import Path

import click

from lorascope.analysis.summary import build_summary
from lorascope.cli.supervise import Job
from lorascope.errors import LorascopeError, UsageError
from lorascope.probes.allocator import ENV_SWITCH as ENV_MEMORY_HISTORY
from lorascope.probes.bootstrap import sitecustomize_source
from lorascope.probes.history_policy import MODES
from lorascope.probes.kernels import parse_window
from lorascope.probes.memory import MAX_SAMPLE_INTERVAL
from lorascope.rundir.format import safe_open
from lorascope.rundir.format.schema import BOOTSTRAP_DIR
from lorascope.rundir.format.writer import record_launch, record_ranks
from lorascope.rundir.loading.attachments import attached_processes, remove_empty_fatal_files, why_none_attached
from lorascope.rundir.loading.reader import launching_cli, load_run
from lorascope.text import echo
from lorascope.text.summary import render_text
from lorascope.units import ranks_named


def _check_trusted(out: Path, trust: bool) -> None:
    """Refuse (one line) a run directory, or its bootstrap folder, that someone else owns
    or may write: what is planted there would run in every rank (docs/security.md)."""
    if os.pathsep in str(out):
        raise UsageError(
            f"--out {str(out)!r}: the path holds {os.pathsep!r}, which cannot be put on PYTHONPATH "
            "(the probes would not attach, and a part of it would be imported from): choose another"
        )
    if trust:
        return
    for folder in (out, out / BOOTSTRAP_DIR):
        why = safe_open.untrusted_dir(folder)
        if why is not None:
            raise UsageError(
                f"{folder}: {why}: refused, as code planted in it would run in every rank of the job; "
                "use a folder of your own, or `lorascope run --trust-run-dir` if you trust who can write it"
            )


def _prepare(out: Path, launch_id: str, config: dict[str, object]) -> tuple[Path | None, str]:
    """Create the run directory and a fresh private (0700) bootstrap folder in it (the
    settings written into it, so that they reach ranks whose launcher passes on nothing
    but PYTHON* variables); returns the bootstrap path, or None (warned) when it cannot be
    written: the job then runs without probes; and the launch id (the folder's name: a
    launch id already there gets a suffix)."""
    try:
        out.mkdir(mode=0o755, parents=True, exist_ok=True)
        safe_open.make_dirs(out, out / BOOTSTRAP_DIR)
        bootstrap, launch_id = _fresh_folder(out / BOOTSTRAP_DIR, launch_id)
        config.update(bootstrap_dir=str(bootstrap), launch_id=launch_id)
        fd = safe_open.create(bootstrap / "sitecustomize.py", exclusive=True, mode=0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(sitecustomize_source(config))
    except OSError as exc:
        echo(
            f"lorascope: warning: cannot write the run directory {out} ({exc.strerror}); the job runs without probes",
            err=True,
        )
        return None, launch_id
    return bootstrap, launch_id


def _fresh_folder(parent: Path, name: str) -> tuple[Path, str]:
    """A folder made now, mode 0700, named NAME (or NAME.<random> if NAME is taken)."""
    for attempt in range(16):
        chosen = name if attempt == 0 else f"{name}.{secrets.token_hex(3)}"
        try:
            os.mkdir(parent / chosen, 0o700)
        except FileExistsError:
            continue
        os.chmod(parent / chosen, 0o700)
        return parent / chosen, chosen
    raise FileExistsError(errno.EEXIST, "no fresh bootstrap folder could be made", str(parent))


def _child_env(
    out: Path, bootstrap: Path, launch_id: str, sample_interval: float, trace_window: str, memory_history: str
) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(bootstrap), env.get("PYTHONPATH", "")) if p)
    env["LORASCOPE_RUN_DIR"] = str(out)
    env["LORASCOPE_LAUNCH_ID"] = launch_id
    env["LORASCOPE_SAMPLE_INTERVAL"] = str(sample_interval)
    env["LORASCOPE_TRACE_WINDOW"] = trace_window
    # the mode from the flag; the entries kept, from LORASCOPE_MEMORY_HISTORY if it names them
    entries = env.get(ENV_MEMORY_HISTORY, "").rpartition(":")[2].strip()
    env[ENV_MEMORY_HISTORY] = f"{memory_history}:{entries}" if entries.isdigit() else memory_history
    env.pop("LORASCOPE_ATTACHED_PID", None)
    return env


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
    "--memory-history",
    type=click.Choice(MODES),
    default="auto",
    show_default=True,
    help="On CUDA ranks, when to record the allocator's history (Python stacks of allocations) for the "
    "snapshots written at an OOM, a hang dump or a stall: auto (the first steps, evaluation and save, and "
    "while reserved memory is at 85% of the device or more), always, off. "
    "LORASCOPE_MEMORY_HISTORY=MODE:N sets the entries kept.",
)
@click.option("--no-memory-history", is_flag=True, hidden=True, help="The same as --memory-history off.")
@click.option(
    "--summary/--no-summary",
    default=False,
    help="Print the per-rank summary table at the end (`lorascope analyze` prints it with the verdict).",
)
@click.option(
    "--trust-run-dir",
    is_flag=True,
    help="Use a run directory (or its bootstrap folder) that another user owns or others may write: "
    "whoever can write it can run code in the job. Refused without this flag (docs/security.md).",
)
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
def command(
    out: Path | None,
    sample_interval: float,
    trace_window: str,
    memory_history: str,
    no_memory_history: bool,
    summary: bool,
    trust_run_dir: bool,
    cmd: tuple[str, ...],
) -> int:
    """Run CMD (torchrun, deepspeed, python ...) with the probes in every rank."""
    if not 0 <= sample_interval <= MAX_SAMPLE_INTERVAL:  # False for a NaN too
        raise UsageError(f"--sample-interval must be between 0 and {MAX_SAMPLE_INTERVAL:g} seconds")
    try:
        parse_window(trace_window)
    except ValueError as exc:
        raise UsageError(f"--trace-window: {exc}") from None
    if no_memory_history:
        memory_history = "off"
    out = (out or Path("lorascope-runs") / time.strftime("%Y%m%d-%H%M%S")).absolute()
    _check_trusted(out, trust_run_dir)
    # One bootstrap folder per launch: the launchers of a multi-node job share the run dir.
    config: dict[str, object] = {
        "run_dir": str(out),
        "sample_interval": sample_interval,
        "trace_window": trace_window,
        "memory_history": memory_history,
    }
    bootstrap, launch_id = _prepare(out, f"{socket.gethostname()}-{os.getpid()}", config)
    record_launch(out, launch_id, list(cmd))
    echo(f"lorascope: recording to {out}", err=True)
    try:
        env = (
            _child_env(out, bootstrap, launch_id, sample_interval, trace_window, memory_history) if bootstrap else None
        )
        job = Job(list(cmd), env)
    except OSError as exc:
        record_launch(out, launch_id, list(cmd), end=time.time(), exit_status=127)
        raise UsageError(f"cannot start {cmd[0]!r}: {exc.strerror}") from None
    rc = job.wait()
    ended = {"end": time.time(), "exit_status": rc, "signals": job.forwarded}
    record_launch(out, launch_id, list(cmd), **ended, **({"leftovers": job.terminated} if job.terminated else {}))
    attached = attached_processes(out, launch_id)
    remove_empty_fatal_files(out, attached, socket.gethostname())
    if attached:
        try:
            data = build_summary(load_run(out))
            record_ranks(out, {str(r["rank"]): {k: r[k] for k in ("pid", "host", "ended")} for r in data["ranks"]})
            if summary:
                echo(render_text(data), err=True)
        except Exception as exc:  # whatever happened to the run directory, the status is the job's
            reason = str(exc) if isinstance(exc, LorascopeError) else f"{exc.__class__.__name__}: {exc}"
            echo(f"lorascope: the run directory could not be summarised: {reason[:300]}", err=True)
    if attached and not summary:
        echo(f"lorascope: the verdict and each rank's summary: lorascope analyze {out}", err=True)
    echo(_attached_line(attached, out, list(cmd), launch_id, bootstrap is not None, rc), err=True)
    sys.stderr.flush()
    return rc


def _attached_line(
    attached: list[dict[str, object]], out: Path, cmd: list[str], launch_id: str, injected: bool, rc: int
) -> str:
    if not attached:
        why = why_none_attached(out, [cmd], launch_id, rc) if injected else "the run directory could not be written"
        return f"lorascope: no process attached the probes: {why}"
    # A framework's tool that started the ranks itself (llamafactory-cli) attached as a
    # lone process first: not counted, as the reader leaves it out (rundir.reader).
    parents = {(a.get("host"), a.get("probed_parent")) for a in attached if a.get("probed_parent")}
    attached = [
        a
        for a in attached
        if not (a.get("rank_source") == "lone" and (a.get("host"), a.get("pid")) in parents and launching_cli(a))
    ]
    ranks = sorted({int(str(a["rank"])) for a in attached})
    hosts = sorted({str(a["host"]) for a in attached})
    where = f" on {len(hosts)} hosts" if len(hosts) > 1 else ""
    processes = "1 process" if len(attached) == 1 else f"{len(attached)} processes"
    return f"lorascope: {processes} attached the probes ({ranks_named(ranks)}){where}"
