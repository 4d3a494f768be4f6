"""A rank from a file's path, for artifacts that do not say which rank wrote them.

Recognised: ``rank-3``, ``rank_3``, ``rank3``, ``_rank3.``, ``nccl_trace_rank_3`` (torch's
flight-recorder prefix), a directory named ``rank-3`` / ``3`` above the file, and a
trailing ``.3`` / ``-3`` / ``_3`` before the extension when nothing better is there.
"""

from __future__ import annotations

import re
from pathlib import Path

_NAMED = re.compile(r"(?:^|[^a-z])rank[-_.]?(\d+)(?!\d)", re.I)
_TRAILING = re.compile(r"[-_.](\d{1,5})$")
_SUFFIXES = (".json.gz", ".pickle", ".pkl", ".json", ".gz", ".log", ".txt", ".pt")


def _stem(name: str) -> str:
    lower = name.lower()
    for suffix in _SUFFIXES:
        if lower.endswith(suffix):
            return name[: -len(suffix)]
    return name


def rank_from_path(path: Path) -> int | None:
    m = _NAMED.search(path.name)
    if m:
        return int(m.group(1))
    parent = path.parent.name
    m = _NAMED.search(parent)
    if m:
        return int(m.group(1))
    m = _TRAILING.search(_stem(path.name))
    if m:
        return int(m.group(1))
    if parent.isdigit() and len(parent) <= 5:
        return int(parent)
    return None
