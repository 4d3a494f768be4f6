"""`lorascope watch RUN_DIR`: a running job, live, on one terminal screen."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click

from lorascope.analysis import analyze
from lorascope.analysis.live import LiveRun
from lorascope.errors import BadInputError
from lorascope.rundir.format.schema import MANIFEST_FILE
from lorascope.rundir.loading.tail import Tail
from lorascope.text.findings import quiet
from lorascope.units import ranks_named

#: The manifest is small; a larger one is not read for the launches' ends.
MANIFEST_BYTES = 4 << 20


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
    from rich.live import Live

    from lorascope.text.watch import render_watch

    if not (run_dir / MANIFEST_FILE).is_file():
        raise BadInputError(f"{run_dir}: not a lorascope run directory (no {MANIFEST_FILE})")
    console = Console(highlight=False)
    tail, live = Tail(run_dir), LiveRun()

    def frame(verdict: dict[str, str] | None) -> Any:
        return render_watch(_view(run_dir, live, tail, verdict, interval), console.width, console.height)

    def finished() -> bool:
        return live.ended() or _launches_ended(run_dir)

    live.update(tail)
    if once:
        console.print(frame(_verdict(run_dir) if finished() else None))
        return 0
    if not console.is_terminal:
        while not finished():
            time.sleep(interval)
            live.update(tail)
        live.update(tail)
        console.print(frame(_verdict(run_dir)))
        return 0
    with Live(console=console, screen=True, auto_refresh=False, redirect_stdout=False, redirect_stderr=False) as screen:
        while not finished():
            began = time.monotonic()
            screen.update(frame(None), refresh=True)
            time.sleep(max(0.0, interval - (time.monotonic() - began)))
            live.update(tail)
        live.update(tail)
        screen.update(frame(None), refresh=True)
        verdict = _verdict(run_dir)
    console.print(frame(verdict))
    sys.stdout.flush()
    return 0
