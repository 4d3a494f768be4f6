"""Quantities as text, one formatter each for every command (findings, artifact summaries,
plan tables, the report): byte sizes (also parsed from what users type: ``80GiB``), counts,
lists of ranks."""

from __future__ import annotations

import re
from collections.abc import Iterable

from lorascope.errors import UsageError

GIB = 1 << 30

#: Binary prefixes for K/M/G/T, with or without "iB" (as nvidia-smi and torch mean them);
#: decimal only when spelled "KB"/"MB"/"GB"/"TB".
_MULTIPLIERS = {
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}
_QUANTITY = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]+)\s*")


def parse_bytes(text: str) -> int:
    """``"80GiB"`` -> 85899345920. A unit is required: a bare number is ambiguous."""
    match = _QUANTITY.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _MULTIPLIERS:
        raise UsageError(f"cannot read {text!r} as a memory size; write it like 80GiB, 40GB or 24576MiB")
    value = int(float(match.group(1)) * _MULTIPLIERS[unit])
    if value <= 0:
        raise UsageError(f"memory size {text!r} must be positive")
    return value


def gib(n_bytes: float) -> str:
    """Bytes as GiB with two decimals, the unit of every plan table."""
    return f"{n_bytes / GIB:.2f}"


def fmt_bytes(n_bytes: float | None, digits: int = 1) -> str:
    """Bytes in the largest binary unit that keeps the figure at 1 or more: 20.6 GiB,
    512.0 MiB (``digits`` after the point: plan tables use 2); "-" for None."""
    if n_bytes is None:
        return "-"
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n_bytes) >= size:
            return f"{n_bytes / size:.{digits}f} {unit}"
    return f"{n_bytes:.0f} B"


def count(n: int) -> str:
    """A parameter count with thousands separators: 41,943,040."""
    return f"{n:,}"


#: Ranks a per-rank table gives a row each, at most, before it is condensed (the terminal:
#: the ranks that stand out, the others as ranges) or folded (the report: behind a click).
MAX_TABLE_RANKS = 32


def rank_ranges(ranks: Iterable[int]) -> str:
    """Rank numbers as text, in order, three or more consecutive ones as a range:
    ``0, 1, 4-1023`` (a 1,024-rank job's list stays one line)."""
    numbers = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(numbers):
        j = i
        while j + 1 < len(numbers) and numbers[j + 1] == numbers[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{numbers[i]}-{numbers[j]}")
            i = j + 1
        else:
            parts.append(str(numbers[i]))
            i += 1
    return ", ".join(parts)


def group_named(name: object) -> str:
    """A process group as a verdict names it: ``group 2`` for one torch numbered (a bare
    number read "all_reduce #1 on 2"), else its name (``default_pg``)."""
    text = str(name)
    return f"group {text}" if text.isdigit() else text


def ranks_named(ranks: Iterable[int]) -> str:
    """``rank 3`` for one rank, ``ranks 0, 2, 4-7`` (:func:`rank_ranges`) for more."""
    numbers = sorted(set(ranks))
    return f"rank {numbers[0]}" if len(numbers) == 1 else f"ranks {rank_ranges(numbers)}"


#: The C++ source locations torch and gloo put in front of their messages
#: (``[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] ``).
_SOURCE_LOCATION = re.compile(r"\[[^\]\s]*\.(?:c|cc|cpp|cxx|cu|h|hpp):\d+\]\s*")


def strip_source_locations(text: str) -> str:
    return _SOURCE_LOCATION.sub("", text)


def short_error(text: str, limit: int) -> str:
    """An error message as one line of at most about ``limit`` characters, without the C++
    source locations in it (they pushed "Connection reset by peer" past the cut), cut
    at a word with "..."."""
    line = " ".join(strip_source_locations(text).split())
    if len(line) <= limit:
        return line
    cut = line.rfind(" ", 0, limit)
    return line[: cut if cut > limit // 2 else limit] + " ..."
