"""Live allocations at one moment, grouped by where they come from and what they are."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from lorascope.ingest.frames import category_of, site_of, user_frames
from lorascope.ingest.snapshot.types import LiveBlock, MemoryPoint, SiteGroup

#: A live allocation: (size in bytes, its stack frames or None).
Live = tuple[int, Any]

#: Groups kept per point; the rest are summed into one "<N more sites>" group.
MAX_GROUPS = 40
#: Distinct stacks kept per point (what cross-rank comparisons use).
MAX_STACKS = 200
LARGEST_BLOCKS = 10
#: Blocks from the loss at least this large make other blocks of their size "logits-sized".
LOGITS_MIN_BYTES = 1 << 20
#: Block sizes are rounded up to 512 bytes: a same-shaped tensor lands within this.
SIZE_SLACK = 1024

_NO_STACK = ("<no stack recorded>", "unknown", ())


class StackInfo:
    """Site, category and user frames per distinct stack object, computed once.

    Snapshots share one frames object between all the entries with the same stack (the
    safe unpickler makes them one tuple), so the cache is keyed by object identity; the
    caller keeps the snapshot data alive while the cache is used.
    """

    def __init__(self) -> None:
        self._cache: dict[int, tuple[str, str, tuple[str, ...]]] = {}

    def __call__(self, frames: Sequence[Any] | None) -> tuple[str, str, tuple[str, ...]]:
        if not frames or not isinstance(frames, (list, tuple)):
            return _NO_STACK
        key = id(frames)
        info = self._cache.get(key)
        if info is None:
            info = (site_of(frames), category_of(frames), tuple(user_frames(frames, 6)))
            self._cache[key] = info
        return info


@dataclass
class Grouped:
    """A live set summed up: by site, by whole user stack, by category."""

    by_site: list[SiteGroup]
    by_stack: list[SiteGroup]
    by_category: dict[str, int]
    #: Bytes whose stack is unknown.
    unattributed: int


def _add(acc: dict[Any, list[Any]], key: Any, size: int, site: str, stack: tuple[str, ...]) -> None:
    group = acc.get(key)
    if group is None:
        acc[key] = [size, 1, size, site, stack]
    else:
        group[0] += size
        group[1] += 1
        if size > group[2]:
            group[2] = size


def _groups(acc: dict[Any, list[Any]], category_at: int, limit: int) -> list[SiteGroup]:
    ordered = sorted(acc.items(), key=lambda kv: -kv[1][0])
    groups = [
        SiteGroup(site=v[3], category=k[category_at], bytes=v[0], count=v[1], largest=v[2], stack=list(v[4]))
        for k, v in ordered[:limit]
    ]
    rest = ordered[limit:]
    if rest:
        groups.append(
            SiteGroup(
                site=f"<{len(rest)} more>",
                category="other",
                bytes=sum(v[0] for _, v in rest),
                count=sum(v[1] for _, v in rest),
                largest=max(v[2] for _, v in rest),
                stack=[],
            )
        )
    return groups


def is_remainder(group: SiteGroup) -> bool:
    """Whether the group is the sum of the groups left out, not one site."""
    return group.site.startswith("<") and group.site.endswith(" more>")


def group_by_site(
    items: Iterable[Live], info: StackInfo | None = None, relabel: dict[int, str] | None = None
) -> Grouped:
    """Groups by (site, category) and by (user stack, category), largest first."""
    info = info or StackInfo()
    sites: dict[tuple[str, str], list[Any]] = {}
    stacks: dict[tuple[tuple[str, ...], str, str], list[Any]] = {}
    categories: dict[str, int] = {}
    unattributed = 0
    for i, (size, frames) in enumerate(items):
        site, category, stack = info(frames)
        if relabel and i in relabel:
            category = relabel[i]
        if category == "unknown":
            unattributed += size
        categories[category] = categories.get(category, 0) + size
        _add(sites, (site, category), size, site, stack)
        _add(stacks, (stack, category, site), size, site, stack)
    return Grouped(
        by_site=_groups(sites, 1, MAX_GROUPS),
        by_stack=_groups(stacks, 1, MAX_STACKS),
        by_category=dict(sorted(categories.items(), key=lambda kv: -kv[1])),
        unattributed=unattributed,
    )


def _logits_relabel(blocks: list[tuple[int, int, Any]], info: StackInfo) -> dict[int, str]:
    """Indices of blocks the same size as a large loss-frame block (or half / twice it:
    the bf16 logits next to their fp32 copy), which the frames alone do not call logits."""
    targets = sorted({size for _, size, frames in blocks if size >= LOGITS_MIN_BYTES and info(frames)[1] == "logits"})[
        :16
    ]
    if not targets:
        return {}
    wanted = sorted({t for s in targets for t in (s, s // 2, s * 2)})
    out: dict[int, str] = {}
    for i, (_, size, frames) in enumerate(blocks):
        if (
            size >= LOGITS_MIN_BYTES // 2
            and any(abs(size - t) <= SIZE_SLACK for t in wanted)
            and info(frames)[1] != "logits"
        ):
            out[i] = "logits"
    return out


def build_point(
    label: str,
    index: int | None,
    time_us: int | None,
    live: dict[int, Live],
    reserved: int | None,
    annotations: list[str],
    info: StackInfo,
) -> tuple[MemoryPoint, list[LiveBlock]]:
    """The MemoryPoint for a live set, and its logits blocks (loss frames or logits-sized)."""
    blocks = [(addr, size, frames) for addr, (size, frames) in live.items()]
    relabel = _logits_relabel(blocks, info)
    grouped = group_by_site(((s, f) for _, s, f in blocks), info, relabel)
    largest_idx = heapq.nlargest(LARGEST_BLOCKS, range(len(blocks)), key=lambda i: blocks[i][1])

    def live_block(i: int) -> LiveBlock:
        addr, size, frames = blocks[i]
        site, category, _ = info(frames)
        if i in relabel:
            return LiveBlock(addr, size, site, relabel[i], note="same size as the loss's logits")
        return LiveBlock(addr, size, site, category)

    logits = sorted(
        (
            live_block(i)
            for i in range(len(blocks))
            if blocks[i][1] >= LOGITS_MIN_BYTES // 2 and (i in relabel or info(blocks[i][2])[1] == "logits")
        ),
        key=lambda b: -b.bytes,
    )[:LARGEST_BLOCKS]
    point = MemoryPoint(
        label=label,
        index=index,
        time_us=time_us,
        allocated=sum(b[1] for b in blocks),
        reserved=reserved,
        by_site=grouped.by_site,
        by_stack=grouped.by_stack,
        by_category=grouped.by_category,
        largest=[live_block(i) for i in largest_idx],
        unattributed=grouped.unattributed,
        annotations=annotations,
    )
    return point, logits
