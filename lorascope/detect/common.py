"""Small helpers the detectors share: memory metrics, sizes, where evidence lives."""
from __future__ import annotations

import os
from typing import Any

from lorascope.rundir.reader import RankData, RunData


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def mem_value(sample: dict[str, Any]) -> int | None:
    """The figure that matters for a sample: CUDA allocated bytes where there are some,
    else the process RSS (CPU runs)."""
    cuda = sample.get("cuda")
    if isinstance(cuda, dict) and cuda.get("alloc") is not None:
        return int(cuda["alloc"])
    return sample.get("rss")


def peak_memory(rank: RankData) -> int | None:
    """CUDA max-allocated where recorded, else the largest RSS sample."""
    cuda = [m["cuda"].get("max_alloc", 0) for m in rank.mem if isinstance(m.get("cuda"), dict)]
    if cuda:
        return max(cuda)
    rss = [m["rss"] for m in rank.mem if m.get("rss") is not None]
    return max(rss) if rss else None


def memory_kind(rank: RankData) -> str:
    return "CUDA allocated" if any(isinstance(m.get("cuda"), dict) for m in rank.mem) else "RSS"


def stream_source(run: RunData, rank: RankData, what: str) -> str:
    """A pointer to a rank's stream, relative to the run directory."""
    files = [os.path.relpath(f, run.path) for f in rank.files]
    return f"{', '.join(files) or f'ranks/rank-{rank.rank}'} ({what})"


def ended_with_oom(rank: RankData) -> bool:
    text = (rank.exception or {}).get("message", "")
    return "out of memory" in text.lower()
