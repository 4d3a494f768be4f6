"""Shared conventions of the chart data: one time origin, rounding, units."""

from __future__ import annotations

from lorascope.rundir.loading.reader import RunData

MIB = 2**20


def run_origin(run: RunData) -> float:
    """Epoch seconds every timeline counts from: the earliest launch or rank start."""
    starts = [float(launch["start"]) for launch in run.manifest.get("launches", [])]
    starts += [float(r.start["t"]) for r in run.ranks.values()]
    return min(starts) if starts else 0.0


def secs(t: float, origin: float) -> float:
    """Seconds since the origin, to the millisecond (keeps the page small and stable)."""
    return round(t - origin, 3)


def mib(n: float | None) -> float | None:
    return None if n is None else round(n / MIB, 2)
