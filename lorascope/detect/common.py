"""Small helpers the detectors share: memory metrics, sizes, where evidence lives."""

from __future__ import annotations

import os
from typing import Any

from lorascope.rundir.reader import RankData, RunData

#: The memory figures a rank can be measured by (``memory_kind``).
CUDA_ALLOCATED, HEAP_IN_USE, RSS = "CUDA allocated", "heap in use", "RSS"


def memory_kind(rank: RankData) -> str:
    """Which figure the memory detectors use for this rank: CUDA allocated bytes, else the
    C heap in use (CPU; memory freed is not counted, unlike RSS), else RSS."""
    if any(isinstance(m.get("cuda"), dict) for m in rank.mem):
        return CUDA_ALLOCATED
    if any(m.get("heap") is not None for m in rank.mem):
        return HEAP_IN_USE
    return RSS


def mem_value(sample: dict[str, Any], kind: str | None = None) -> int | None:
    """A sample's figure of the given kind (see memory_kind); without one, CUDA allocated
    bytes where the sample has them, else RSS."""
    cuda = sample.get("cuda")
    if kind in (None, CUDA_ALLOCATED) and isinstance(cuda, dict) and cuda.get("alloc") is not None:
        return int(cuda["alloc"])
    if kind == CUDA_ALLOCATED:
        return None
    return sample.get("heap" if kind == HEAP_IN_USE else "rss")


def peak_memory(rank: RankData) -> int | None:
    """CUDA max-allocated where recorded, else the largest heap-in-use or RSS sample."""
    kind = memory_kind(rank)
    if kind == CUDA_ALLOCATED:
        return max(int(m["cuda"].get("max_alloc", 0)) for m in rank.mem if isinstance(m.get("cuda"), dict))
    values = [v for m in rank.mem if (v := mem_value(m, kind)) is not None]
    return max(values) if values else None


def stream_source(run: RunData, rank: RankData, what: str) -> str:
    """A pointer to a rank's stream, relative to the run directory."""
    files = [os.path.relpath(f, run.path) for f in rank.files]
    return f"{', '.join(files) or f'ranks/rank-{rank.rank}'} ({what})"


def ended_with_oom(rank: RankData) -> bool:
    text = (rank.exception or {}).get("message", "")
    return "out of memory" in text.lower()


def short_site(site: str | None) -> str:
    """A call site with the file's directory left out: ``train.py:42 in main``."""
    if not site:
        return "?"
    path, _, rest = site.partition(":")
    return f"{path.rsplit('/', 1)[-1]}:{rest}"
