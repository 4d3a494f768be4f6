"""Ranks' reduced collective records made comparable (analysis side).

Each rank kept the first and the newest calls of every group and one digest per window of
sequence numbers (:mod:`lorascope.rundir.loading.reduce`). Where ranks first differ is found by
comparing the digests of the windows every compared rank completed; that window, and the
one where the shortest rank stops (from there on some ranks never made the calls others
did), must be held in full by every rank: :func:`windows_needed` says which ranks must read
which windows again. :func:`trim` then drops the calls only some ranks hold (between the
first calls and the newest ones), so that a call one rank kept and another dropped never
reads as a call the other never made.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Mapping
from typing import Any

from lorascope.rundir.loading.reduce import WINDOW, WINDOW_PAD, GroupTally

#: group -> sequence ranges (inclusive).
Windows = dict[str, list[tuple[int, int]]]


def _first_differing(tallies: Mapping[int, GroupTally], aspect: int) -> int | None:
    """The first window index whose digests differ among the ranks that completed it.

    A rank completed window i when its last sequence number is at least (i + 1) x WINDOW;
    the rank with the highest one completed every window any rank did, so the windows
    differ among them exactly where some rank's differ from its: each rank is compared
    with it, up to the windows the rank completed, as arrays (:class:`Digests`)."""
    if not tallies:
        return None
    ref = max(tallies.values(), key=lambda t: t.last_seq)
    ref_index, *ref_digests = ref.digests.columns()
    first = None
    for tally in tallies.values():
        if tally is ref:
            continue
        index, *digests = tally.digests.columns()
        mine, theirs = (index, digests[aspect]), (ref_index, ref_digests[aspect])
        missing = [*tally.missing, *ref.missing]
        if missing:  # windows some calls of which a call file did not keep: compared by neither
            mine, theirs = _known(mine, missing), _known(theirs, missing)
        found = _first_mismatch(mine, theirs, tally.last_seq // WINDOW)
        if found is not None and (first is None or found < first):
            first = found
    return first


def _known(windows: tuple[array[int], array[int]], missing: list[tuple[int, int]]) -> tuple[array[int], array[int]]:
    """(index, digest) arrays without the windows that hold a sequence number of ``missing``."""
    keep = [
        i
        for i, w in enumerate(windows[0])
        if not any(lo <= (w + 1) * WINDOW and w * WINDOW + 1 <= hi for lo, hi in missing)
    ]
    return array("q", (windows[0][i] for i in keep)), array("Q", (windows[1][i] for i in keep))


def _first_mismatch(a: tuple[array[int], array[int]], b: tuple[array[int], array[int]], limit: int) -> int | None:
    """The first window index below ``limit`` that (index, digest) arrays ``a`` and ``b``
    do not hold alike (one holds it and the other not, or their digests differ)."""
    n_a, n_b = bisect.bisect_left(a[0], limit), bisect.bisect_left(b[0], limit)

    def alike(start: int, stop: int) -> bool:  # slices compared in C
        return a[0][start:stop] == b[0][start:stop] and a[1][start:stop] == b[1][start:stop]

    lo, hi = 0, min(n_a, n_b)
    if alike(lo, hi):
        return None if n_a == n_b else (a if n_a > n_b else b)[0][hi]
    while hi - lo > 1:  # alike up to lo, not up to hi
        mid = (lo + hi) // 2
        if alike(lo, mid):
            lo = mid
        else:
            hi = mid
    return min(a[0][lo], b[0][lo])


def group_windows(tallies: Mapping[int, GroupTally]) -> list[tuple[int, int]]:
    """The sequence ranges of one group that every rank must hold in full: the first
    window where the digests differ (of op and size; of every aspect), and where the
    shortest rank stops."""
    out = []
    for aspect in (0, 1):
        index = _first_differing(tallies, aspect)
        if index is not None:
            out.append((index * WINDOW + 1 - WINDOW_PAD, (index + 1) * WINDOW + WINDOW_PAD))
    shortest = min(t.last_seq for t in tallies.values())
    out.append((shortest - WINDOW - WINDOW_PAD, shortest + WINDOW + WINDOW_PAD))
    return sorted(set(out))


def windows_needed(ranks: Mapping[int, Any]) -> tuple[Windows, dict[int, Windows]]:
    """Per group the ranges every rank must hold, and per rank the ranges (by group) it
    must read again because it does not hold them. ``ranks``: rank -> RankData."""
    by_group: dict[str, dict[int, GroupTally]] = {}
    for n, data in ranks.items():
        for group, tally in data.tallies.items():
            by_group.setdefault(group, {})[n] = tally
    needed: Windows = {}
    reread: dict[int, Windows] = {}
    for group, tallies in sorted(by_group.items()):
        if all(t.tail_first is None for t in tallies.values()):
            continue  # every rank holds every call
        needed[group] = group_windows(tallies)
        for n, tally in tallies.items():
            dropped = [w for w in needed[group] if tally.dropped(*w)]
            if dropped:
                reread.setdefault(n, {})[group] = dropped
    return needed, reread


def trim(ranks: Mapping[int, Any], needed: Windows) -> None:
    """Drop, in every group some rank holds only in part, the calls between the first ones
    and the newest ones every rank holds, outside the needed windows, and every rank's calls
    whose sequence numbers some rank's call file did not keep (pending calls stay)."""
    by_group: dict[str, list[GroupTally]] = {}
    for data in ranks.values():
        for group, tally in data.tallies.items():
            by_group.setdefault(group, []).append(tally)
    cut: dict[str, tuple[int, int, list[tuple[int, int]]]] = {}
    for group, windows in needed.items():
        tallies = by_group[group]
        head = min(t.head_last for t in tallies)
        tail = max(t.tail_first if t.tail_first is not None else t.last_seq + 1 for t in tallies)
        cut[group] = (head, tail, windows)

    # per group, the ranges some rank's call file did not keep, merged: each rank of a
    # recent read (`lorascope hang`) misses every call below its newest
    unknown = {group: _merged([r for t in tallies for r in t.missing]) for group, tallies in by_group.items()}

    def kept(c: Any) -> bool:
        if c.pending:
            return True
        if _within(c.seq, unknown.get(c.group, ([], []))):
            return False
        if c.group not in cut:
            return True
        head, tail, windows = cut[c.group]
        return c.seq <= head or c.seq >= tail or any(lo <= c.seq <= hi for lo, hi in windows)

    for data in ranks.values():
        data.collectives = [c for c in data.collectives if kept(c)]


def _merged(ranges: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Inclusive ranges merged where they overlap or touch, as (their starts, their ends)."""
    los: list[int] = []
    his: list[int] = []
    for lo, hi in sorted(ranges):
        if his and lo <= his[-1] + 1:
            his[-1] = max(his[-1], hi)
        else:
            los.append(lo)
            his.append(hi)
    return los, his


def _within(seq: int, ranges: tuple[list[int], list[int]]) -> bool:
    """Whether ``seq`` is in one of the merged ``ranges`` (:func:`_merged`)."""
    at = bisect.bisect_right(ranges[0], seq) - 1
    return at >= 0 and seq <= ranges[1][at]
