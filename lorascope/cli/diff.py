"""`lorascope diff A B [--json] [--html OUT]`: what changed between two runs (or two
artifacts of one kind)."""

from __future__ import annotations

from pathlib import Path

import click

from lorascope.analysis import analyze, strict_json
from lorascope.analysis.diff import build_diff
from lorascope.cli.options import cluster_option
from lorascope.report.write import write_diff_report
from lorascope.rundir.loading.cluster import connect
from lorascope.text import echo
from lorascope.text.diff import render_diff
from lorascope.text.progress import terminal_progress


@click.command("diff")
@click.argument("a", type=click.Path(path_type=Path))
@click.argument("b", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the differences as JSON.")
@click.option(
    "--html",
    "html_out",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Also write the differences as one HTML page (the report's design).",
)
@cluster_option
def command(a: Path, b: Path, as_json: bool, html_out: Path | None, cluster: str | None) -> int:
    """Compare run A (the one that worked) with run B: configuration first, then memory,
    step time, collectives and findings.

    A and B are run directories, or two artifacts of one kind (allocator snapshots,
    Kineto traces, flight-recorder dumps, job logs)."""
    with connect(cluster) as on, terminal_progress(not as_json) as progress:
        first = analyze(a, progress=progress, cluster=on)
        second = analyze(b, progress=progress, cluster=on)
    data = build_diff(first, second)
    if as_json:
        echo(strict_json.dumps(data, indent=2, sort_keys=True, default=str))
    else:
        echo(render_diff(data))
    if html_out is not None:
        size = write_diff_report(data, html_out)
        echo(f"lorascope: diff report written to {html_out} ({size / 1024:.0f} KiB)", err=True)
    return 0
