"""Allocator snapshots: the pickle ``torch.cuda.memory._dump_snapshot`` writes, analysed.

Reads the documented keys (``segments`` with ``blocks``, ``device_traces``, frames) and
tolerates the ones real files add (``allocator_settings``, ``external_annotations``,
``time_us``, ``compile_context``, ``user_metadata``) and older layouts (a bare list of
segments; blocks with ``history`` instead of ``frames``; ``active_pending_free``).
Internally inconsistent files (blocks that do not add up to their segment, frees of
unknown addresses) are analysed anyway, with a warning saying what did not add up.

No torch needed: the file is read by :mod:`lorascope.rundir.format.safe_pickle`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lorascope.errors import BadInputError
from lorascope.ingest.snapshot.points import Live, StackInfo, group_by_site
from lorascope.ingest.snapshot.replay import replay
from lorascope.ingest.snapshot.types import (
    AllocatorSettings,
    AllocatorState,
    DeviceMemory,
    SnapshotAnalysis,
)
from lorascope.rundir.format.safe_pickle import load_pickle, no_gc

_KNOWN_KEYS = {"segments", "device_traces", "allocator_settings", "external_annotations"}
_ALLOCATED = "active_allocated"
_AWAITING_FREE = ("active_awaiting_free", "active_pending_free")


def read_snapshot(path: Path, rank: int | None = None, inside: Path | None = None) -> SnapshotAnalysis:
    """Load and analyse one snapshot file. BadInputError when it is not one. INSIDE: a
    folder it must not leave (``safe_open.open_regular``)."""
    with no_gc():
        return analyse_snapshot(load_pickle(path, inside=inside), path, rank)


def analyse_snapshot(data: Any, path: Path, rank: int | None = None) -> SnapshotAnalysis:
    """Analyse snapshot data already loaded (a dict, or the legacy list of segments)."""
    if isinstance(data, list) and all(isinstance(s, Mapping) and "total_size" in s for s in data[:100]):
        data = {"segments": data, "device_traces": []}
    if not isinstance(data, Mapping) or not ({"segments", "device_traces"} & set(data)):
        keys = sorted(map(str, data))[:6] if isinstance(data, Mapping) else type(data).__name__
        raise BadInputError(f"{path}: not an allocator snapshot (no 'segments' or 'device_traces'; found {keys})")
    warnings: list[str] = []
    segments = _list(data.get("segments"), "segments", warnings)
    traces = _list(data.get("device_traces"), "device_traces", warnings)
    annotations = _list(data.get("external_annotations"), "external_annotations", warnings)
    settings = _settings(data.get("allocator_settings"), segments)
    devices = sorted(
        {_int(s.get("device"), 0) for s in segments if isinstance(s, Mapping)}
        | {i for i, t in enumerate(traces) if isinstance(t, list) and t}
    )
    analysed = [
        _device(
            d, segments, traces[d] if d < len(traces) and isinstance(traces[d], list) else [], annotations, warnings
        )
        for d in devices
    ]
    return SnapshotAnalysis(
        path=path,
        rank=rank,
        devices=analysed,
        settings=settings,
        other_keys=sorted(str(k) for k in data if k not in _KNOWN_KEYS),
        warnings=warnings,
    )


def _list(value: Any, name: str, warnings: list[str]) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    warnings.append(f"'{name}' is a {type(value).__name__}, not a list: ignored")
    return []


def _int(value: Any, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _settings(raw: Any, segments: Sequence[Any]) -> AllocatorSettings:
    expandable_in_segments = any(isinstance(s, Mapping) and s.get("is_expandable") for s in segments)
    if not isinstance(raw, Mapping):
        return AllocatorSettings(
            present=False,
            expandable_segments=True if expandable_in_segments else None,
            max_split_size=None,
            garbage_collection_threshold=None,
            alloc_conf=None,
            raw={},
        )
    expandable = raw.get("expandable_segments")
    gc_threshold = raw.get("garbage_collection_threshold")
    conf = raw.get("PYTORCH_CUDA_ALLOC_CONF")
    return AllocatorSettings(
        present=True,
        expandable_segments=bool(expandable) if isinstance(expandable, (bool, int)) else expandable_in_segments,
        max_split_size=_int(raw.get("max_split_size"), 0) or None,
        garbage_collection_threshold=float(gc_threshold) if isinstance(gc_threshold, (int, float)) else None,
        alloc_conf=conf if isinstance(conf, str) else None,
        raw={str(k): v for k, v in raw.items() if isinstance(v, (str, int, float, bool, type(None)))},
    )


def _block_frames(block: Mapping[str, Any]) -> Sequence[Any] | None:
    frames = block.get("frames")
    if frames:
        return frames  # type: ignore[no-any-return]
    history = block.get("history")  # torch < 2.1
    if isinstance(history, list) and history and isinstance(history[0], Mapping):
        frames = history[0].get("frames")
        return frames if isinstance(frames, (list, tuple)) else None
    return None


def _device(
    device: int, segments: list[Any], trace: list[Any], annotations: list[Any], warnings: list[str]
) -> DeviceMemory:
    info = StackInfo()
    state, live_end = _state(device, segments, warnings, info)
    result = replay(trace, live_end, state.reserved if segments else None, annotations, device, info)
    if result.skipped:
        warnings.append(
            f"device {device}: {result.skipped} trace entries without a usable action, address or size were skipped"
        )
    if result.unmatched_frees:
        warnings.append(
            f"device {device}: {result.unmatched_frees} frees of addresses the trace had already freed (ignored)"
        )
    mismatch = result.trace_vs_segments if segments else None
    # The trace records each allocation's requested size, the segments the block's (rounded
    # up to 512 bytes): a shortfall within the rounding of the live blocks is no mismatch
    # (every snapshot of the GPU check read -2,240 to -3,196 bytes so).
    if mismatch and not -state.rounding <= mismatch < 0:
        warnings.append(
            f"device {device}: replaying the trace ends at {mismatch:+d} bytes from what the "
            "segments hold at the snapshot"
        )
    return DeviceMemory(
        device=device,
        state=state,
        trace_entries=len(trace),
        trace_starts_mid_run=result.allocated_before > 0,
        allocated_before_trace=result.allocated_before,
        peak=result.peak,
        ooms=result.ooms,
        actions=result.actions,
        logits_blocks=result.logits_blocks,
        trace_vs_segments=mismatch,
    )


def _state(
    device: int, segments: list[Any], warnings: list[str], info: StackInfo
) -> tuple[AllocatorState, dict[int, Live]]:
    """Totals over the device's segments, and its live blocks by address."""
    live: dict[int, Live] = {}
    reserved = allocated = active = inactive = rounding = largest_free = 0
    n_segments = n_blocks = expandable = large = small = inconsistent = 0
    for seg in segments:
        if not isinstance(seg, Mapping) or _int(seg.get("device"), 0) != device:
            continue
        n_segments += 1
        total = _int(seg.get("total_size"))
        reserved += total
        expandable += bool(seg.get("is_expandable"))
        large += seg.get("segment_type") == "large"
        small += seg.get("segment_type") == "small"
        address = _int(seg.get("address"))
        in_blocks = 0
        blocks = seg.get("blocks")
        for block in blocks if isinstance(blocks, list) else ():
            if not isinstance(block, Mapping):
                continue
            n_blocks += 1
            size = _int(block.get("size"))
            block_address = _int(block.get("address"), address + in_blocks)
            in_blocks += size
            state = block.get("state")
            if state == _ALLOCATED:
                allocated += size
                active += size
                rounding += max(0, size - _int(block.get("requested_size"), size))
                live[block_address] = (size, _block_frames(block))
            elif state in _AWAITING_FREE:
                active += size
            else:
                inactive += size
                largest_free = max(largest_free, size)
        if blocks is not None and in_blocks != total:
            inconsistent += 1
    if inconsistent:
        warnings.append(
            f"device {device}: {inconsistent} of {n_segments} segments have blocks that do not "
            "add up to the segment size (analysed as they are)"
        )
    grouped = group_by_site(list(live.values()), info)
    state = AllocatorState(
        segments=n_segments,
        blocks=n_blocks,
        reserved=reserved,
        allocated=allocated,
        active=active,
        inactive=inactive,
        rounding=rounding,
        largest_free_block=largest_free,
        fragmentation=round(1 - largest_free / inactive, 4) if inactive else 0.0,
        expandable_segments=expandable,
        large_segments=large,
        small_segments=small,
        inconsistent_segments=inconsistent,
        by_site=grouped.by_site,
        by_stack=grouped.by_stack,
        by_category=grouped.by_category,
    )
    return state, live
