"""Terminal output: findings, the per-rank summary and artifact summaries as text.

Everything printed goes through :func:`echo`: strings from a run directory (a group name,
a host, a log line) may hold escape sequences that would clear the screen or rewrite the
lines above them, and text that is not valid Unicode; both are shown escaped."""

from __future__ import annotations

import re

import click

#: C0 controls but tab and newline, DEL and C1 controls, line and paragraph separators,
#: bidirectional overrides and isolates ("Trojan Source"), and lone surrogates (bytes
#: that were not UTF-8).
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def terminal_safe(text: str) -> str:
    """TEXT with every character that could drive a terminal, or that cannot be encoded,
    written as an escape (``\\x1b``, ``\\udcff``); tabs and newlines kept."""
    return _UNSAFE.sub(_escaped, text)


def echo(text: str, err: bool = False) -> None:
    """Print one block of terminal output (stdout, or stderr with ``err``), escaped."""
    click.echo(terminal_safe(text), err=err)
