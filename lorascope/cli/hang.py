"""`lorascope hang RUN_DIR` (or `--pid PID...`): while a job hangs, where each rank is
and why, in seconds. The ranks are asked first (light imports); the reader and the
diagnosis (:mod:`lorascope.cli.hang_verdict`) load while they answer."""

from __future__ import annotations

import time
from pathlib import Path

import click

from lorascope.cli.options import cluster_option
from lorascope.errors import UsageError
from lorascope.hang.ask import ask


@click.command("hang")
@click.argument("run_dir", type=click.Path(path_type=Path), required=False)
@click.option(
    "--pid",
    "pids",
    type=int,
    multiple=True,
    help="Diagnose these processes (a job not started under `lorascope run`), with py-spy.",
)
@click.option(
    "--wait",
    "wait_s",
    type=float,
    default=3.0,
    show_default=True,
    help="Seconds to wait for the ranks' dumps (every host's, through the run directory) before falling back to py-spy.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the diagnosis as JSON.")
@click.option(
    "--html",
    "html",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Where to write the HTML report (default: RUN_DIR/hang-<time>.html).",
)
@click.option("--no-html", is_flag=True, help="Write no HTML report.")
@click.option(
    "--read-all",
    is_flag=True,
    help="Read every rank's records (by default, of ranks whose answers agree, a few are read and their records"
    " tell the others).",
)
@cluster_option
def command(
    run_dir: Path | None,
    pids: tuple[int, ...],
    wait_s: float,
    as_json: bool,
    html: Path | None,
    no_html: bool,
    read_all: bool,
    cluster: str | None,
) -> int:
    """Diagnose a hung job now: dump every rank's stacks and pending collectives (the job
    keeps running), then say which rank diverged where, and the fix."""
    if run_dir is None and not pids:
        raise UsageError("give a run directory, or the job's processes with --pid (once each: --pid 101 --pid 102)")
    if run_dir is not None and pids:
        if str(run_dir).isdigit() and not run_dir.exists():  # `--pid 101 102`: 102 read as the run directory
            more = " ".join(f"--pid {p}" for p in (*pids, int(str(run_dir))))
            raise UsageError(f"{run_dir} is not a run directory: --pid takes one process each ({more})")
        raise UsageError("give a run directory or --pid, not both")
    if pids:
        from lorascope.cli.hang_verdict import of_pids

        of_pids(list(pids), as_json)
        return 0
    assert run_dir is not None
    request = ask(run_dir)
    from lorascope.cli.hang_verdict import tell  # loads while the ranks answer

    tell(
        run_dir,
        request,
        wait_s,
        as_json,
        None if no_html else html or run_dir / time.strftime("hang-%Y%m%d-%H%M%S.html"),
        cluster,
        read_all,
    )
    return 0
