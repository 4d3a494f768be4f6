"""The `lorascope` command: a click group built from one list of subcommand modules.

Errors are caught here and only here: each becomes one line on stderr and an exit code
(README "Exit status"); ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import importlib
import io
import sys
import traceback
from collections.abc import Sequence

import click

from lorascope import __version__
from lorascope.errors import LorascopeError
from lorascope.rundir.format import limits
from lorascope.rundir.loading import workers
from lorascope.text import echo
from lorascope.units import parse_bytes

#: Every subcommand, one module each (``lorascope/cli/NAME.py``, exposing ``command``),
#: imported when it runs (or when the help lists them): `lorascope hang` on call starts
#: without the modules of the analysis, the report and the plan (~0.15 s of 0.45).
COMMANDS = ["run", "attach", "analyze", "hang", "report", "export", "plan", "diff", "watch"]


class _Commands(click.Group):
    """The subcommands of COMMANDS, each module imported when asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        command: click.Command = importlib.import_module(f"lorascope.cli.{cmd_name}").command
        return command


#: Exit codes of failures that are not the project's own errors (those carry theirs).
EXIT_INTERNAL = 1
EXIT_RESOURCES = 5
EXIT_INTERRUPTED = 130


#: Set from ``--debug`` (or LORASCOPE_DEBUG=1) once the command line is read.
_debug = False


def _size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    """A size flag's text (``4GiB``) as bytes."""
    if value is None:
        return None
    try:
        return parse_bytes(value)
    except LorascopeError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


def _limit(name: str, help_text: str) -> click.Option:
    default = getattr(limits.Limits(), name)
    lines = name == "log_lines"
    return click.Option(
        [limits.FLAGS[name]],
        type=click.IntRange(min=1) if lines else str,
        metavar="N" if lines else "SIZE",
        callback=None if lines else _size,
        default=None,
        help=f"{help_text} (default {limits.shown(name, default)}).",
    )


@click.group(
    cls=_Commands,
    context_settings={"help_option_names": ["-h", "--help"]},
    params=[
        _limit("json_bytes", "Largest JSON input read whole: a Kineto trace, a flight-recorder JSON dump"),
        _limit("stream_bytes", "Largest stream one rank process wrote, all segments"),
        _limit("record_bytes", "Largest record line of a rank stream (longer ones are skipped, warned)"),
        _limit("log_bytes", "How much of a job log is read (decompressed)"),
        _limit("log_lines", "How many lines of a job log are read"),
    ],
)
@click.version_option(__version__, prog_name="lorascope")
@click.option("--debug", is_flag=True, envvar="LORASCOPE_DEBUG", help="On an error, show the traceback too.")
@click.option(
    "--workers",
    "reading_workers",
    type=click.IntRange(min=1),
    metavar="N",
    envvar="LORASCOPE_WORKERS",
    default=None,
    help="Worker processes that read a run directory's rank streams at once (default: one per core; "
    "env LORASCOPE_WORKERS). Each holds ~100-180 MB on long streams: fewer use less memory, "
    "take longer, and read the same.",
)
def cli(debug: bool, reading_workers: int | None, **sizes: int | None) -> None:
    """Diagnose distributed LoRA fine-tuning: probe a run, analyse what went wrong."""
    global _debug
    _debug = debug
    workers.configure(reading_workers)
    limits.configure(**{name: sizes[flag.lstrip("-").replace("-", "_")] for name, flag in limits.FLAGS.items()})


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] + ("..." if len(text) > 300 else "")


def _failure(exc: BaseException) -> tuple[str, int]:
    """The line and exit code for an exception that is not the project's own."""
    if isinstance(exc, MemoryError):
        return "out of memory (the input is too large for this machine, or hostile)", EXIT_RESOURCES
    if isinstance(exc, RecursionError):
        return "the input is nested too deeply to read", EXIT_RESOURCES
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename else ""
        return f"{where}{exc.strerror or _one_line(exc)}", EXIT_RESOURCES
    return (
        f"internal error ({exc.__class__.__name__}: {_one_line(exc)}); "
        "please report it with the output of `lorascope --debug ...`",
        EXIT_INTERNAL,
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point: every failure becomes one line on stderr and an exit code."""
    args = list(argv) if argv is not None else sys.argv[1:]
    for stream in (sys.stdout, sys.stderr):  # a character the encoding lacks: written as an escape
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")
    try:
        rc = cli.main(args=args, prog_name="lorascope", standalone_mode=False)
    except LorascopeError as exc:
        _report(f"error: {exc}")
        sys.exit(exc.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt):
        _report("aborted")
        sys.exit(EXIT_INTERRUPTED)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except Exception as exc:  # the one place every failure becomes a line
        line, code = _failure(exc)
        _report(f"error: {line}")
        sys.exit(code)
    sys.exit(rc if isinstance(rc, int) else 0)


def _report(line: str) -> None:
    if _debug:
        traceback.print_exc()
    try:
        echo(f"lorascope: {line}", err=True)
    except Exception:  # stderr itself is gone: the exit code still says it
        pass
