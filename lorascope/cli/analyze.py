"""`lorascope analyze RUN_DIR [--json]`: what each rank did and how it ended."""
from __future__ import annotations

import json
from pathlib import Path

import click

from lorascope.analyze.summary import build_summary, render_text
from lorascope.rundir.reader import load_run


@click.command("analyze")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def command(path: Path, as_json: bool) -> int:
    """Summarise a run directory per rank."""
    data = build_summary(load_run(path))
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True))
    else:
        click.echo(render_text(data))
    return 0
