"""Several ranks' traces side by side: per-rank timing and the straggler, if one stands out.

In a synchronous data-parallel job every rank waits at each collective for the slowest
one: the straggler computes longest and, arriving last, waits least in communication,
while the others' collective time grows by what they wait for it. A rank is named the
straggler when its compute time per step is at least :data:`STRAGGLER_RATIO` times the
median of the others' and its communication time is the lowest of all ranks. The traces
must cover the same steps (a profiler window) for this to mean anything; the step counts
are kept so a reader can check.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from lorascope.ingest.kineto.reader import KinetoTrace

STRAGGLER_RATIO = 1.10


@dataclass
class RankTiming:
    rank: int
    steps: int
    #: Median step duration (None when the trace marks no steps).
    step_us: float | None
    compute_us: float
    comm_us: float
    idle_us: float
    units: int


@dataclass
class TraceComparison:
    ranks: list[RankTiming]
    #: World size the traces report (the comparison covers only the ranks given).
    world_size: int | None
    straggler: int | None
    #: Why (or why not) a straggler is named, in words with the numbers.
    reason: str


def compare_traces(traces: dict[int, KinetoTrace]) -> TraceComparison | None:
    """None with fewer than two ranks."""
    if len(traces) < 2:
        return None
    timings = [
        RankTiming(
            rank=r,
            steps=len(t.steps),
            step_us=statistics.median(d for _, d in t.steps) if t.steps else None,
            compute_us=t.compute_us,
            comm_us=t.comm_us,
            idle_us=t.idle_us,
            units=t.durations.count,
        )
        for r, t in sorted(traces.items())
    ]

    def per_step(x: RankTiming) -> float:
        return x.compute_us / max(1, x.steps)

    slowest = max(timings, key=per_step)
    others = [per_step(x) for x in timings if x is not slowest]
    median = statistics.median(others)
    ratio = per_step(slowest) / median if median else float("inf")
    least_comm = min(timings, key=lambda x: x.comm_us)
    world = max((t.world_size for t in traces.values() if t.world_size), default=None)
    of = f" ({len(timings)} of {world} ranks compared)" if world and world > len(timings) else ""
    if ratio >= STRAGGLER_RATIO and least_comm is slowest and slowest.comm_us < max(x.comm_us for x in timings):
        return TraceComparison(
            timings,
            world,
            slowest.rank,
            f"rank {slowest.rank} computes {ratio:.2f}x the others' median per step and "
            f"waits least in collectives ({slowest.comm_us / 1000:.1f} ms){of}",
        )
    return TraceComparison(
        timings,
        world,
        None,
        f"no rank stands out: the slowest (rank {slowest.rank}) computes {ratio:.2f}x the others' median per step{of}",
    )
