"""How many worker processes read a run directory's rank streams at once: one per core,
unless the command line says fewer (``lorascope --workers N analyze RUN``, env
``LORASCOPE_WORKERS``).

Each worker holds ~100-180 MB while it reads a long stream (docs/architecture.md, "Reading
at scale"), so on a machine short of memory fewer workers trade time for memory; what is
read is the same whatever the number (each stream's reduction is a pure function of its
files). ``--workers 1`` reads every stream in the calling process.
"""

from __future__ import annotations

import os

_configured: int | None = None


def configure(workers: int | None) -> None:
    """Set the number of workers (None: one per core); the CLI calls this once."""
    global _configured
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be at least 1, not {workers}")
    _configured = workers


def available() -> int:
    """The workers a read may start: the configured number, else the machine's cores."""
    return _configured if _configured is not None else os.cpu_count() or 1


def for_jobs(jobs: int) -> int:
    """The workers a read of ``jobs`` streams starts."""
    return max(1, min(jobs, available()))
