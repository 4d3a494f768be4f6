"""Replaying an allocator trace (``device_traces``) to find its peak and its OOMs.

The trace is a ring buffer: it may start mid-run, so memory allocated before its first
entry is unknown from the trace alone. It is recovered from two facts: a free of an
address the trace never allocated was live at the start; a block live at the snapshot
that the trace never touched was live throughout. With that baseline the allocated
bytes are known at every entry.

Pass 1 finds the peak (the largest allocated total) and the baseline; pass 2 replays
again up to the last point of interest (the peak, every ``oom`` entry) and groups the
live allocations there. A free is counted at the first of ``free_requested`` /
``free_completed`` for an address, so traces that record only one kind still work.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lorascope.ingest.snapshot.points import Live, StackInfo, build_point
from lorascope.ingest.snapshot.types import LiveBlock, MemoryPoint, OomEvent

_FREES = frozenset(("free_requested", "free_completed", "free"))
_SEGMENT_GROW = frozenset(("segment_alloc", "segment_map"))
_SEGMENT_SHRINK = frozenset(("segment_free", "segment_unmap"))
#: OOM entries whose live set is grouped (the first ones; later ones are counted only).
MAX_OOMS = 5


@dataclass
class ReplayResult:
    peak: MemoryPoint | None
    ooms: list[OomEvent]
    logits_blocks: list[LiveBlock]
    allocated_before: int
    actions: dict[str, int]
    trace_vs_segments: int
    skipped: int = 0
    unmatched_frees: int = 0
    warnings: list[str] = field(default_factory=list)


def replay(
    trace: list[Any],
    live_end: dict[int, Live],
    reserved_end: int | None,
    annotations: list[Any],
    device: int,
    info: StackInfo | None = None,
) -> ReplayResult:
    info = info or StackInfo()
    actions: dict[str, int] = {}
    live: dict[int, int] = {}
    pending: set[int] = set()
    ever: set[int] = set()
    before: dict[int, Live] = {}
    delta = best = 0
    best_i: int | None = None
    res_delta = 0
    skipped = unmatched = 0
    ooms: list[int] = []
    for i, raw in enumerate(trace):
        # a well-formed entry: a dict with a str action and an int size (checked inline: millions)
        if type(raw) is not dict:
            skipped += 1
            continue
        action = raw.get("action")
        size = raw.get("size")
        if type(action) is not str or type(size) is not int:
            skipped += 1
            continue
        addr = raw.get("addr", 0)
        if type(addr) is not int:
            addr = 0
        actions[action] = actions.get(action, 0) + 1
        if action == "alloc":
            live[addr] = size
            ever.add(addr)
            pending.discard(addr)
            delta += size
            if delta > best:
                best, best_i = delta, i
        elif action in _FREES:
            known = live.pop(addr, None)
            if known is not None:
                delta -= known
                pending.add(addr)
            elif addr in pending:
                pending.discard(addr)
            elif addr in ever:
                unmatched += 1
            else:  # allocated before the trace started
                before[addr] = (size, raw.get("frames"))
                ever.add(addr)
                pending.add(addr)
                delta -= size
        elif action in _SEGMENT_GROW:
            res_delta += size
        elif action in _SEGMENT_SHRINK:
            res_delta -= size
        elif action == "oom":
            ooms.append(i)
    untouched = {a: v for a, v in live_end.items() if a not in ever}
    baseline = sum(s for s, _ in before.values()) + sum(s for s, _ in untouched.values())
    at_end = baseline + delta
    allocated_end = sum(s for s, _ in live_end.values())
    if best_i is None and not trace:
        return ReplayResult(None, [], [], baseline, actions, 0, skipped, unmatched)
    points = sorted(({best_i} if best_i is not None else set()) | set(ooms[:MAX_OOMS]))
    start_live: dict[int, Live] = {**untouched, **before}
    snapshots, res_at = _replay_to(trace, points, start_live) if points else ({}, {})
    opened = _Annotations(annotations, device)

    def reserved(i: int) -> int | None:
        return None if reserved_end is None else reserved_end - (res_delta - res_at.get(i, 0))

    logits: list[LiveBlock] = []
    peak: MemoryPoint | None
    if best_i is None:  # nothing in the trace rises above its start
        peak, logits = build_point(
            "peak",
            None,
            _time(trace[0]) if trace else None,
            start_live,
            reserved(-1) if reserved_end is not None else None,
            [],
            info,
        )
    else:
        t = _time(trace[best_i])
        peak, logits = build_point("peak", best_i, t, snapshots[best_i], reserved(best_i), opened.at(t), info)
    events = []
    for i in ooms[:MAX_OOMS]:
        raw = trace[i]
        t = _time(raw)
        point, _ = build_point("oom", i, t, snapshots[i], reserved(i), opened.at(t), info)
        free = raw.get("device_free")
        events.append(
            OomEvent(
                index=i,
                time_us=t,
                requested=raw.get("size", 0),
                device_free=free if isinstance(free, int) else None,
                live=point,
            )
        )
    return ReplayResult(peak, events, logits, baseline, actions, at_end - allocated_end, skipped, unmatched)


def _time(entry: Any) -> int | None:
    t = entry.get("time_us") if isinstance(entry, Mapping) else None
    return t if isinstance(t, int) else None


def _replay_to(
    trace: list[Any], points: list[int], start: dict[int, Live]
) -> tuple[dict[int, dict[int, Live]], dict[int, int]]:
    """Live sets (copies) and reserved deltas right after each entry index in ``points``."""
    live = dict(start)
    wanted = set(points)
    last = points[-1]
    out: dict[int, dict[int, Live]] = {}
    res_at: dict[int, int] = {}
    res_delta = 0
    for i in range(last + 1):
        raw = trace[i]  # the same reading as replay()'s first pass, inlined for speed
        if type(raw) is dict:
            action = raw.get("action")
            size = raw.get("size")
            if type(action) is str and type(size) is int:
                addr = raw.get("addr", 0)
                if type(addr) is not int:
                    addr = 0
                if action == "alloc":
                    live[addr] = (size, raw.get("frames"))
                elif action in _FREES:
                    live.pop(addr, None)
                elif action in _SEGMENT_GROW:
                    res_delta += size
                elif action in _SEGMENT_SHRINK:
                    res_delta -= size
        if i in wanted:
            out[i] = dict(live)
            res_at[i] = res_delta
    return out, res_at


class _Annotations:
    """``external_annotations`` (record_function ranges): which are open at a time."""

    def __init__(self, annotations: list[Any], device: int) -> None:
        events = [
            (a["time_us"], a.get("stage"), str(a.get("name", "?")))
            for a in annotations
            if isinstance(a, Mapping) and isinstance(a.get("time_us"), int) and a.get("device", device) == device
        ]
        events.sort(key=lambda x: x[0])
        self.times = [t for t, _, _ in events]
        self.events = events

    def at(self, t: int | None) -> list[str]:
        if t is None or not self.events:
            return []
        open_: list[str] = []
        for _, stage, name in self.events[: bisect.bisect_right(self.times, t)]:
            if stage == "START":
                open_.append(name)
            elif stage == "END" and name in open_:
                open_.reverse()
                open_.remove(name)
                open_.reverse()
        return open_
