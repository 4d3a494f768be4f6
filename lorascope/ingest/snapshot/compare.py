"""Several ranks' snapshots side by side: what one rank holds that the others do not.

Ranks of a data-parallel job allocate the same things at the same stacks; memory that
only one rank holds (eval outputs kept on rank 0, a gather to rank 0, logging tensors)
is the signature of rank-0 asymmetry. Each rank's live set at its peak (the snapshot
state when there is no trace) is grouped by whole user stack and compared.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lorascope.ingest.snapshot.points import is_remainder
from lorascope.ingest.snapshot.types import SiteGroup, SnapshotAnalysis

#: Differences smaller than this are noise (allocator rounding, a few small tensors).
MIN_BYTES = 1 << 20


@dataclass
class RankOnlyAllocation:
    """Memory one rank holds at a stack where the other ranks hold less (or nothing)."""

    rank: int
    category: str
    site: str
    stack: list[str]
    bytes: int
    #: The most any other rank holds at the same stack and category.
    others_max: int

    @property
    def only_here(self) -> bool:
        return self.others_max == 0


@dataclass
class SnapshotComparison:
    """The ranks' snapshots compared at each rank's peak (or snapshot state)."""

    #: "peak" per rank, or "snapshot" for a rank whose file has no trace.
    points: dict[int, str]
    allocated: dict[int, int]
    reserved: dict[int, int | None]
    #: Largest first, every rank (detectors pick the rank they care about).
    rank_only: list[RankOnlyAllocation] = field(default_factory=list)


def _live_groups(s: SnapshotAnalysis) -> tuple[str, int, int | None, list[SiteGroup]]:
    device = s.main
    if device is None:
        return "snapshot", 0, None, []
    if device.peak is not None:
        return "peak", device.peak.allocated, device.peak.reserved, device.peak.by_stack
    return "snapshot", device.state.allocated, device.state.reserved, device.state.by_stack


def compare_ranks(snapshots: dict[int, SnapshotAnalysis], min_bytes: int = MIN_BYTES) -> SnapshotComparison | None:
    """None with fewer than two ranks."""
    if len(snapshots) < 2:
        return None
    points: dict[int, str] = {}
    allocated: dict[int, int] = {}
    reserved: dict[int, int | None] = {}
    held: dict[int, dict[tuple[str, tuple[str, ...], str], SiteGroup]] = {}
    for rank, snap in sorted(snapshots.items()):
        points[rank], allocated[rank], reserved[rank], groups = _live_groups(snap)
        held[rank] = {(g.category, tuple(g.stack), g.site): g for g in groups if not is_remainder(g)}
    out: list[RankOnlyAllocation] = []
    for rank, by_key in held.items():
        for key, group in by_key.items():
            others = max((held[r][key].bytes if key in held[r] else 0) for r in held if r != rank)
            if group.bytes - others >= min_bytes:
                out.append(
                    RankOnlyAllocation(
                        rank=rank,
                        category=group.category,
                        site=group.site,
                        stack=group.stack,
                        bytes=group.bytes,
                        others_max=others,
                    )
                )
    out.sort(key=lambda a: -(a.bytes - a.others_max))
    return SnapshotComparison(points=points, allocated=allocated, reserved=reserved, rank_only=out)
