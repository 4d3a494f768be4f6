"""The `lorascope` command: a click group built from one list of subcommand modules."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import click

from lorascope import __version__
from lorascope.cli import analyze, hang, plan, report, run
from lorascope.errors import LorascopeError

#: Every subcommand, one module each; each module exposes ``command``.
COMMANDS = [run, analyze, hang, report, plan]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="lorascope")
def cli() -> None:
    """Diagnose distributed LoRA fine-tuning: probe a run, analyse what went wrong."""


for _module in COMMANDS:
    cli.add_command(_module.command)


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point: LorascopeError becomes one line on stderr and its exit code."""
    try:
        rc = cli.main(args=list(argv) if argv is not None else None, standalone_mode=False)
    except LorascopeError as exc:
        click.echo(f"lorascope: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("lorascope: aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    sys.exit(rc if isinstance(rc, int) else 0)
