"""What the allocator-snapshot analysis returns: plain dataclasses for the detectors.

All sizes are bytes. "Allocated" counts blocks handed to tensors (``active_allocated``);
"reserved" counts the segments the caching allocator holds from the driver; what is
reserved but not allocated is the allocator's cache (free for reuse, but only for
requests that fit in a free block).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class SiteGroup:
    """Live allocations that share their first user frame (see ``stack_frames.site_of``)."""

    site: str
    #: weights / optimizer / gradients / activations / logits / other / unknown.
    category: str
    bytes: int
    count: int
    largest: int
    #: User frames of one representative stack, innermost first (callers show the context,
    #: e.g. an ``evaluate`` or a ``save`` frame above the allocation).
    stack: list[str]


@dataclass
class LiveBlock:
    """One live allocation (the largest ones at a point are kept)."""

    address: int
    bytes: int
    site: str
    category: str
    #: Why it is in the logits category when the frames alone do not say so.
    note: str = ""


@dataclass
class MemoryPoint:
    """The allocator's state at one moment: the trace's peak, an OOM, or the snapshot itself."""

    #: "peak", "oom" or "snapshot".
    label: str
    #: Index of the trace entry (None for the snapshot state).
    index: int | None
    time_us: int | None
    allocated: int
    #: Reserved bytes at that moment, when the trace tells (segment events) or the snapshot does.
    reserved: int | None
    by_site: list[SiteGroup]
    #: The same live set grouped by whole user stack (finer: one site reached from two
    #: callers, e.g. training and an ``evaluate`` on rank 0, is two groups here).
    by_stack: list[SiteGroup]
    by_category: dict[str, int]
    largest: list[LiveBlock]
    #: Bytes of live allocations whose stack is unknown (allocated before recording started).
    unattributed: int
    #: Annotations open at that moment (``record_function`` / external annotation names).
    annotations: list[str] = field(default_factory=list)


@dataclass
class OomEvent:
    """An ``oom`` trace entry: the allocator could not satisfy a request."""

    index: int
    time_us: int | None
    #: The request that failed.
    requested: int
    #: What the driver still reported free on the device at that moment.
    device_free: int | None
    live: MemoryPoint


@dataclass
class AllocatorState:
    """Segments and blocks at the moment the snapshot was taken."""

    segments: int
    blocks: int
    reserved: int
    allocated: int
    #: Allocated plus blocks freed but still in use by another stream.
    active: int
    #: Cached free blocks (reserved - active): reusable only by requests that fit.
    inactive: int
    #: Bytes the allocator rounded up inside allocated blocks (size - requested size).
    rounding: int
    largest_free_block: int
    #: 1 - largest free block / all free bytes: 0 when the cache is one block, near 1 when
    #: it is scattered in many small pieces (a large request cannot use it).
    fragmentation: float
    expandable_segments: int
    large_segments: int
    small_segments: int
    #: Segments whose blocks do not add up to the segment size (real files do this).
    inconsistent_segments: int
    by_site: list[SiteGroup]
    by_stack: list[SiteGroup]
    by_category: dict[str, int]


@dataclass
class AllocatorSettings:
    """``allocator_settings`` of the snapshot (absent from older torch versions)."""

    present: bool
    expandable_segments: bool | None
    max_split_size: int | None
    garbage_collection_threshold: float | None
    #: PYTORCH_CUDA_ALLOC_CONF as the allocator last parsed it.
    alloc_conf: str | None
    raw: dict[str, Any]


@dataclass
class DeviceMemory:
    """One device's part of a snapshot."""

    device: int
    state: AllocatorState
    trace_entries: int
    #: True when the trace does not cover the whole run (the ring buffer wrapped, or history
    #: recording started late): some live memory was allocated before the first entry.
    trace_starts_mid_run: bool
    #: Bytes already allocated when the trace starts.
    allocated_before_trace: int
    peak: MemoryPoint | None
    ooms: list[OomEvent]
    #: Counts per trace action (alloc, free_requested, ..., oom).
    actions: dict[str, int]
    #: Large blocks in loss frames and blocks of the same size elsewhere, at the peak.
    logits_blocks: list[LiveBlock]
    #: allocated(last trace entry) minus allocated(snapshot): 0 when trace and segments agree.
    trace_vs_segments: int | None


@dataclass
class SnapshotAnalysis:
    """An allocator snapshot (``torch.cuda.memory._dump_snapshot``), analysed."""

    path: Path
    rank: int | None
    devices: list[DeviceMemory]
    settings: AllocatorSettings
    #: Top-level keys the file has that this reader does not use (kept for the record).
    other_keys: list[str]
    warnings: list[str] = field(default_factory=list)

    @property
    def main(self) -> DeviceMemory | None:
        """The device with the most memory (snapshots usually hold one)."""
        if not self.devices:
            return None
        return max(self.devices, key=lambda d: (d.state.reserved, d.peak.allocated if d.peak else 0))
