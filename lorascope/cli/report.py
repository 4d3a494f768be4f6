"""`lorascope report RUN_DIR -o OUT.html`: the findings and charts as one self-contained page."""

from __future__ import annotations

from pathlib import Path

import click

from lorascope.analysis import analyze
from lorascope.report.write import write_report


@click.command("report")
@click.argument("path", type=click.Path(path_type=Path))
@click.option(
    "-o",
    "--out",
    type=click.Path(path_type=Path, dir_okay=False),
    required=True,
    help="The HTML file to write (one file, no network needed to open it).",
)
def command(path: Path, out: Path) -> int:
    """Write an HTML report: the verdict, each finding with its chart, and the run facts."""
    size = write_report(analyze(path), out)
    click.echo(f"lorascope: report written to {out} ({size / 1024:.0f} KiB)", err=True)
    return 0
