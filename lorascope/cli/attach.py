"""`lorascope attach --out DIR (--pid PID ... | --launcher PID)`: the probes put into the
ranks of a job that is already running (started without lorascope), recording into DIR
from then on; ``--detach`` turns them off again."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from lorascope.errors import BadInputError, UsageError
from lorascope.inject.attach import Attempt, Options, manifest_entry, run_all
from lorascope.inject.procs import Process, describe, ranks_of
from lorascope.probes.kernels import parse_window
from lorascope.rundir.format.procfs import start_ticks
from lorascope.rundir.format.schema import MANIFEST_FILE
from lorascope.rundir.format.writer import record_attach


def _attached_before(run_dir: Path) -> list[Process]:
    """The processes an earlier ``lorascope attach`` into ``run_dir`` attached, not
    detached since, that still run (the same pid and start time)."""
    try:
        manifest = json.loads((run_dir / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        raise BadInputError(f"{run_dir}: no readable {MANIFEST_FILE}: give the processes with --pid") from None
    last: dict[tuple[int, object], str] = {}  # (pid, start ticks) -> its latest action that took
    for entry in manifest.get("attached") or []:
        if not isinstance(entry, dict) or entry.get("action") not in ("attach", "detach"):
            continue
        for p in entry.get("processes") or []:
            if isinstance(p, dict) and isinstance(p.get("pid"), int) and p.get("ok"):
                last[(p["pid"], p.get("start_ticks"))] = entry["action"]
    return [describe(pid) for (pid, ticks), action in last.items() if action == "attach" and ticks == start_ticks(pid)]


def _line(a: Attempt, action: str) -> str:
    who = a.process.label
    if not a.ok:
        return f"  {who}: NOT {action}ed: {a.why}; fix: {a.fix}"
    paths = " then ".join(h for h in a.how if not h.startswith("ran by"))
    pause = f", main thread held {a.pause_ms:.0f} ms" if isinstance(a.pause_ms, int | float) else ""
    stopped = f", stopped by gdb <= {a.stopped_ms:.0f} ms" if a.stopped_ms else ""
    text = f"  {who}: {action}ed ({paths}, {a.took_ms:.0f} ms{stopped}{pause})"
    return "\n".join([text, *(f"    note: {n}" for n in a.notes)])


@click.command("attach")
@click.option(
    "--out",
    "run_dir",
    type=click.Path(path_type=Path, file_okay=False),
    required=True,
    help="Run directory to record into (every other command reads it).",
)
@click.option("--pid", "pids", type=int, multiple=True, help="A rank's process id (once per rank).")
@click.option("--launcher", type=int, default=None, help="The launcher's pid (torchrun, deepspeed): its ranks.")
@click.option("--detach", is_flag=True, help="Turn the probes off again (the processes attached into --out).")
@click.option("--any-user", is_flag=True, help="As root: attach processes of other users too.")
@click.option(
    "--wait",
    "wait_s",
    type=float,
    default=3.0,
    show_default=True,
    help="Seconds a process is given to run the queued bootstrap before gdb runs it directly.",
)
@click.option("--sample-interval", type=float, default=None, help="Seconds between background memory samples.")
@click.option(
    "--trace-window",
    default="off",
    show_default=True,
    help="Kernel trace of steps START+1..START+STEPS after the attach ('START:STEPS'), as `lorascope run "
    "--trace-window`; off by default (starting the profiler holds a live job ~1 s).",
)
@click.option("--json", "as_json", is_flag=True, help="Print each process's outcome as JSON.")
@click.option("--verbose", is_flag=True, help="Add gdb's findings to each line.")
def command(
    run_dir: Path,
    pids: tuple[int, ...],
    launcher: int | None,
    detach: bool,
    any_user: bool,
    wait_s: float,
    sample_interval: float | None,
    trace_window: str,
    as_json: bool,
    verbose: bool,
) -> int:
    """Put the probes into a running job's ranks (started without lorascope): they record
    into --out from now on, and each rank's stacks, flight recorder (if the job enabled
    one) and, on CUDA, an allocator snapshot are taken at once. Below Python 3.14 this
    needs gdb and ptrace; from 3.14, sys.remote_exec (PEP 768)."""
    if pids and launcher is not None:
        raise UsageError("give --pid or --launcher, not both")
    if sample_interval is not None and sample_interval < 0:
        raise UsageError("--sample-interval must be >= 0")
    try:
        parse_window(trace_window)
    except ValueError as exc:
        raise UsageError(f"--trace-window: {exc}") from None
    if not pids and launcher is None and not detach:
        raise UsageError("give the ranks with --pid PID (once each) or their launcher with --launcher PID")
    if launcher is not None:
        processes = ranks_of(launcher)
        if not processes:
            raise BadInputError(
                f"no ranks under pid {launcher}: no descendant carries RANK/LOCAL_RANK/WORLD_SIZE "
                "(or SLURM/MPI rank variables); give them with --pid"
            )
    elif pids:
        processes = [describe(pid) for pid in dict.fromkeys(pids)]
    else:
        processes = _attached_before(run_dir)
        if not processes:
            raise BadInputError(f"{run_dir}: no attached process of it is running: nothing to detach")
    action = "detach" if detach else "attach"
    options = Options(
        run_dir=run_dir,
        action=action,
        any_user=any_user,
        wait_s=wait_s,
        sample_interval=sample_interval,
        trace_window=trace_window,
        verbose=verbose,
        launch_id=f"attach-{int(time.time())}",
    )
    began = time.time()
    attempts = run_all(processes, options)
    entry = manifest_entry(attempts, options, began)
    record_attach(run_dir, entry)
    done = sum(a.ok for a in attempts)
    if as_json:
        click.echo(json.dumps(entry, indent=2, sort_keys=True))
    else:
        pythons = sorted({".".join(map(str, a.process.python)) for a in attempts if a.process.python})
        click.echo(
            f"{action}ed {done} of {len(attempts)} process{'es' if len(attempts) != 1 else ''} "
            f"({'Python ' + ', '.join(pythons) if pythons else 'no Python found'}); run directory: {run_dir}"
        )
        for a in attempts:
            click.echo(_line(a, action))
        if done and not detach:
            click.echo(f"next: lorascope hang {run_dir} | lorascope analyze {run_dir}")
    return 0 if done == len(attempts) else 1
