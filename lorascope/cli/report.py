"""`lorascope report RUN_DIR -o OUT.html`: the findings and charts as one self-contained page."""

from __future__ import annotations

from pathlib import Path

import click

from lorascope.analysis import analyze
from lorascope.cli.options import cluster_option
from lorascope.report.write import write_report
from lorascope.rundir.loading.cluster import connect
from lorascope.text import echo
from lorascope.text.progress import terminal_progress


@click.command("report")
@click.argument("path", type=click.Path(path_type=Path))
@click.option(
    "-o",
    "--out",
    type=click.Path(path_type=Path, dir_okay=False),
    required=True,
    help="The HTML file to write (one file, no network needed to open it).",
)
@cluster_option
def command(path: Path, out: Path, cluster: str | None) -> int:
    """Write an HTML report: the verdict, each finding with its chart, and the run facts."""
    with connect(cluster) as on, terminal_progress(True) as progress:
        analysis = analyze(path, progress=progress, cluster=on)
    size = write_report(analysis, out)
    echo(f"lorascope: report written to {out} ({size / 1024:.0f} KiB)", err=True)
    return 0
