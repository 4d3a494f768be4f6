"""Errors that carry the exit code the CLI returns; caught in one place (lorascope.cli)."""

from __future__ import annotations


class LorascopeError(Exception):
    """A problem the user can act on: printed as one line, never as a traceback."""

    exit_code = 1


class UsageError(LorascopeError):
    """The command line asks for something impossible."""

    exit_code = 2


class BadInputError(LorascopeError):
    """An input file or directory is missing, unreadable or not in a known format."""

    exit_code = 3


class FormatVersionError(BadInputError):
    """A run directory written by a newer, incompatible lorascope."""


class NothingRecordedError(BadInputError):
    """A run directory in which no process attached the probes: nothing to analyse."""


class ClusterError(LorascopeError):
    """The Dask cluster asked for (``--cluster``) cannot be reached or cannot read the run."""

    exit_code = 5
