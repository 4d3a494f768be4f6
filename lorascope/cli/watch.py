"""`lorascope watch RUN_DIR`: a running job, live, on one terminal screen."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from lorascope.analysis import analyze
from lorascope.analysis.live import LiveRun
from lorascope.errors import BadInputError
from lorascope.rundir.format.schema import MANIFEST_FILE
from lorascope.rundir.loading.tail import Tail
from lorascope.text.findings import quiet
from lorascope.units import ranks_named

if TYPE_CHECKING:
    from rich.console import Console

#: The manifest is small; a larger one is not read for the launches' ends.
MANIFEST_BYTES = 4 << 20
#: Open files watch asks for at most (its soft limit raised up to its hard limit): it keeps
#: the slot files that grow open between refreshes, three a rank process.
OPEN_FILES = 1 << 16


def _more_open_files() -> None:
    """Raise the limit on open files toward the hard limit (the slot files watch keeps
    open: :attr:`Tail.max_open`); where it cannot, watch opens the rest at each refresh."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (OSError, ValueError):
            pass


def _launches_ended(run_dir: Path) -> bool:
    """Every `lorascope run` launch writing into the directory recorded its end."""
    try:
        path = run_dir / MANIFEST_FILE
        if path.stat().st_size > MANIFEST_BYTES:
            return False
        launches = json.loads(path.read_bytes()).get("launches")
    except (OSError, ValueError, AttributeError):
        return False
    return bool(launches) and all(isinstance(x, dict) and x.get("end") is not None for x in launches)


def _verdict(run_dir: Path) -> dict[str, str]:
    """The analysis of the whole run, as one line and its level."""
    analysis = analyze(run_dir)
    if analysis.findings:
        top = analysis.findings[0]
        ranks = f" ({ranks_named(top.ranks)})" if top.ranks else ""
        return {"level": top.severity, "text": f"{top.severity}: {top.title}{ranks}"}
    return {"level": "ok", "text": quiet(analysis.to_data())}


def _view(run_dir: Path, live: LiveRun, tail: Tail, verdict: dict[str, str] | None, interval: float) -> dict[str, Any]:
    now = time.time()
    rows, checks, median = live.view(now)
    return {
        "run_dir": run_dir,
        "now": now,
        "rows": rows,
        "checks": checks,
        "world_size": live.world_size(),
        "median_step": median,
        "bytes_read": tail.bytes_read,
        "interval": interval,
        "verdict": verdict,
    }


@click.command("watch")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1, max=1.0),
    default=1.0,
    show_default=True,
    help="Seconds between refreshes.",
)
@click.option("--once", is_flag=True, help="Print one screen of what the run directory holds now, and exit.")
def command(run_dir: Path, interval: float, once: bool) -> int:
    """Watch a running job: per rank its step, step time, memory, the collective it waits
    in and for how long; stalled and slower ranks; the findings so far; and when the run
    ends, the verdict. Reads only what the ranks appended since the last refresh.
    Ctrl-C quits (exit 130)."""
    from rich.console import Console

    if not (run_dir / MANIFEST_FILE).is_file():
        raise BadInputError(f"{run_dir}: not a lorascope run directory (no {MANIFEST_FILE})")
    console = Console(highlight=False)
    _more_open_files()
    tail, live = Tail(run_dir), LiveRun()
    try:
        _follow(run_dir, console, tail, live, interval, once)
    finally:
        tail.close()
    return 0


def _follow(run_dir: Path, console: Console, tail: Tail, live: LiveRun, interval: float, once: bool) -> None:
    """Refresh the screen until the run ends (or once), then print the verdict (the
    files kept open closed first: the verdict's analysis reads the whole run)."""
    from rich.live import Live

    from lorascope.text.watch import render_watch

    def frame(verdict: dict[str, str] | None) -> Any:
        return render_watch(_view(run_dir, live, tail, verdict, interval), console.width, console.height)

    def finished() -> bool:
        return live.ended() or _launches_ended(run_dir)

    live.update(tail)
    if once:
        tail.close()
        console.print(frame(_verdict(run_dir) if finished() else None))
        return
    if not console.is_terminal:
        while not finished():
            time.sleep(interval)
            live.update(tail)
        live.update(tail, whole=True)
        tail.close()
        console.print(frame(_verdict(run_dir)))
        return
    with Live(console=console, screen=True, auto_refresh=False, redirect_stdout=False, redirect_stderr=False) as screen:
        while not finished():
            began = time.monotonic()
            screen.update(frame(None), refresh=True)
            time.sleep(max(0.0, interval - (time.monotonic() - began)))
            live.update(tail)
        live.update(tail, whole=True)
        tail.close()
        screen.update(frame(None), refresh=True)
        verdict = _verdict(run_dir)
    console.print(frame(verdict))
    sys.stdout.flush()
