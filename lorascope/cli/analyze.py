"""`lorascope analyze PATH [--json] [--fail-on LEVEL]`: what went wrong, and what each rank did."""

from __future__ import annotations

from pathlib import Path

import click

from lorascope.analysis import analyze, strict_json
from lorascope.cli.options import cluster_option
from lorascope.detect.finding import SEVERITY_ORDER
from lorascope.ingest.kinds import KINDS
from lorascope.report.write import write_report
from lorascope.rundir.loading.cluster import connect
from lorascope.text import echo
from lorascope.text.artifacts import render_artifacts
from lorascope.text.findings import render_findings
from lorascope.text.progress import terminal_progress
from lorascope.text.summary import render_text
from lorascope.units import MAX_TABLE_RANKS

#: Exit status when --fail-on matches a finding (distinct from input errors).
FINDINGS_EXIT = 4


@click.command("analyze")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print findings and summary as JSON.")
@click.option(
    "--fail-on",
    type=click.Choice(["warning", "error"]),
    default=None,
    help=f"Exit with status {FINDINGS_EXIT} when a finding of this severity or worse exists.",
)
@click.option(
    "--html",
    "html_out",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Also write the HTML report to this file (as `lorascope report`).",
)
@click.option(
    "--kind",
    type=click.Choice(KINDS),
    default=None,
    help="Read PATH (or every file in the folder PATH) as this kind instead of detecting it.",
)
@click.option(
    "--hta/--no-hta",
    default=None,
    help="Add HolisticTraceAnalysis figures to GPU traces (default: when it is installed).",
)
@click.option(
    "--all-ranks",
    is_flag=True,
    help=f"Print every rank's row of the summary table (past {MAX_TABLE_RANKS} ranks it shows those that stand out).",
)
@click.option(
    "-v",
    "--verbose",
    is_flag=True,
    help="Also print what the probes cost the job, and notes on what was not analysed (HTA on CPU traces).",
)
@cluster_option
def command(
    path: Path,
    as_json: bool,
    fail_on: str | None,
    html_out: Path | None,
    kind: str | None,
    hta: bool | None,
    all_ranks: bool,
    verbose: bool,
    cluster: str | None,
) -> int:
    """Name what went wrong, and summarise it per rank.

    PATH is a lorascope run directory, or artifacts a job left: an allocator snapshot
    pickle, a Kineto trace, a flight-recorder dump, a job log, or a folder of them."""
    with connect(cluster) as on, terminal_progress(not as_json) as progress:
        analysis = analyze(path, kind=kind, hta=hta, progress=progress, cluster=on)
    findings = analysis.findings
    data = analysis.to_data()
    if as_json:
        echo(strict_json.dumps(data, indent=2, sort_keys=True, default=str))
    else:
        echo(render_findings(findings, data))
        if analysis.summary is not None:
            echo(render_text(data, all_ranks=all_ranks, verbose=verbose))
        elif analysis.bundle.warnings:
            echo("\n".join(f"warning: {w}" for w in analysis.bundle.warnings))
        if data["artifacts"]:
            echo(render_artifacts(data["artifacts"], verbose=verbose))
    if html_out is not None:
        write_report(analysis, html_out)
        echo(f"lorascope: report written to {html_out}", err=True)
    if fail_on is not None and any(SEVERITY_ORDER[f.severity] >= SEVERITY_ORDER[fail_on] for f in findings):
        return FINDINGS_EXIT
    return 0
