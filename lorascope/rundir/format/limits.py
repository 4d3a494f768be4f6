"""How much the analysis side reads from one input, at most: every input may be broken or
hostile (a decompression bomb, a stream that never ends, a 500 MB line), and none may
take the process past these bounds.

Each size limit has a default and a flag of the ``lorascope`` command that raises it
(``lorascope --max-json-size 4GiB analyze trace.json.gz``); docs/artifacts.md lists them.
The sanity maxima below them (world size, nesting depth) have no flag: a value past them
is not a real job's.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from lorascope.errors import BadInputError
from lorascope.units import fmt_bytes


@dataclass(frozen=True)
class Limits:
    """Size limits, in bytes (decompressed where the file is gzip) or lines."""

    #: A whole-file JSON input: a Kineto trace, a flight-recorder JSON dump. Parsed JSON
    #: takes ~4x its text in memory, so 1 GiB needs ~5 GiB of RAM.
    json_bytes: int = 1 << 30
    #: All the segments one rank process wrote (the writer keeps ~320 MiB by default), and
    #: its steps file (40 bytes a step or phase edge).
    stream_bytes: int = 512 << 20
    #: One record (line) of a rank stream; a longer one is skipped with a warning.
    record_bytes: int = 16 << 20
    #: A job log: read up to this much (decompressed), then the rest is skipped, warned.
    log_bytes: int = 2 << 30
    #: A job log: read up to this many lines (~2 us a line), then the rest is skipped, warned.
    log_lines: int = 10_000_000


#: The command-line flag that sets each limit.
FLAGS = {
    "json_bytes": "--max-json-size",
    "stream_bytes": "--max-stream-size",
    "record_bytes": "--max-record-size",
    "log_bytes": "--max-log-size",
    "log_lines": "--max-log-lines",
}

#: Nesting depth of a run-directory record, at most (no flag; the schema's own maxima,
#: world size and 64-bit integers, are in :mod:`lorascope.rundir.format.schema`).
MAX_RECORD_DEPTH = 64

_current = Limits()


def current() -> Limits:
    """The limits in force (the defaults unless the command line raised some)."""
    return _current


def configure(**values: int | None) -> None:
    """Set some limits (None keeps the current value); the CLI calls this once."""
    global _current
    known = {f.name for f in fields(Limits)}
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"unknown limits {sorted(unknown)}")
    _current = replace(_current, **{k: v for k, v in values.items() if v is not None})


def shown(name: str, value: int) -> str:
    """A limit's value in words: '1 GiB', '1.5 GiB', '10,000,000 lines'."""
    return f"{value:,} lines" if name == "log_lines" else fmt_bytes(value).replace(".0 ", " ")


def describe(name: str) -> str:
    """'the 1 GiB limit (raise it with `lorascope --max-json-size ...`)'."""
    return f"the {shown(name, getattr(_current, name))} limit (raise it with `lorascope {FLAGS[name]} ...`)"


class LimitError(BadInputError):
    """An input larger than a limit: the one line names the limit and its flag."""

    def __init__(self, subject: str, what: str, name: str) -> None:
        super().__init__(f"{subject}: {what} is over {describe(name)}")
