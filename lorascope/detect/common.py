"""Small helpers the detectors share: memory metrics, sizes, where evidence lives."""

from __future__ import annotations

import functools
import itertools
import operator
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from lorascope.detect.finding import Evidence
from lorascope.rundir.loading.ending import ending_of, launchers_ended
from lorascope.rundir.loading.reader import Collective, RankData, RunData
from lorascope.units import rank_ranges

#: The memory figures a rank can be measured by (``memory_kind``).
CUDA_ALLOCATED, HEAP_IN_USE, RSS = "CUDA allocated", "heap in use", "RSS"


#: The key of each figure in a ``mem`` record.
FIGURE_KEYS = {CUDA_ALLOCATED: "cuda", HEAP_IN_USE: "heap", RSS: "rss"}


def any_has_key(samples: Sequence[Mapping[str, Any]], key: str) -> bool:
    """Whether any sample has ``key`` at all, tested in C (~20 ns a sample): a figure a run
    never recorded is a key none of its samples has, and at 1,024 ranks asking for one
    in Python went through millions of samples."""
    return any(map(operator.contains, samples, itertools.repeat(key)))


def memory_kind(rank: RankData) -> str:
    """Which figure the memory detectors use for this rank: CUDA allocated bytes, else the
    C heap in use (CPU; memory freed is not counted, unlike RSS), else RSS."""
    if any_has_key(rank.mem, "cuda") and any(isinstance(m.get("cuda"), dict) for m in rank.mem):
        return CUDA_ALLOCATED
    if any_has_key(rank.mem, "heap") and any(m.get("heap") is not None for m in rank.mem):
        return HEAP_IN_USE
    return RSS


def has_figure(rank: RankData, kind: str) -> bool:
    """Whether any of the rank's samples has the figure (``mem_value`` not None)."""
    return any_has_key(rank.mem, FIGURE_KEYS[kind]) and any(mem_value(m, kind) is not None for m in rank.mem)


def mem_value(sample: Mapping[str, Any], kind: str | None = None) -> int | None:
    """A sample's figure of the given kind (see memory_kind); without one, CUDA allocated
    bytes where the sample has them, else RSS."""
    cuda = sample.get("cuda")
    if kind in (None, CUDA_ALLOCATED) and isinstance(cuda, dict) and cuda.get("alloc") is not None:
        return int(cuda["alloc"])
    if kind == CUDA_ALLOCATED:
        return None
    return sample.get("heap" if kind == HEAP_IN_USE else "rss")


def mem_reader(kind: str | None) -> Callable[[Mapping[str, Any]], int | None]:
    """``mem_value(sample, kind)`` as a function of the sample alone; for the CPU figures a
    C one (a 1,024-rank run's detectors read millions of samples)."""
    if kind in (None, CUDA_ALLOCATED):
        return functools.partial(mem_value, kind=kind)
    return operator.methodcaller("get", "heap" if kind == HEAP_IN_USE else "rss")


def peak_memory(rank: RankData) -> int | None:
    """CUDA max-allocated where recorded, else the largest heap-in-use or RSS sample."""
    kind = memory_kind(rank)
    if kind == CUDA_ALLOCATED:
        return max(int(m["cuda"].get("max_alloc", 0)) for m in rank.mem if isinstance(m.get("cuda"), dict))
    values = [v for v in map(mem_reader(kind), rank.mem) if v is not None]
    return max(values) if values else None


def stream_source(run: RunData, rank: RankData, what: str) -> str:
    """A pointer to a rank's stream, relative to the run directory."""
    files = [os.path.relpath(f, run.path) for f in rank.files]
    return f"{', '.join(files) or f'ranks/rank-{rank.rank}'} ({what})"


def calls_source(run: RunData, rank: RankData) -> str:
    """A pointer to a rank's call file (its collective calls), relative to the run directory."""
    where = os.path.relpath(rank.calls_file, run.path) if rank.calls_file else f"ranks/rank-{rank.rank}"
    return f"{where} (call records)"


def ended_with_oom(rank: RankData) -> bool:
    text = rank.exception["message"] if rank.exception is not None else ""
    return "out of memory" in text.lower()


def short_site(site: str | None) -> str:
    """A call site with the file's directory left out: ``train.py:42 in main``."""
    if not site:
        return "?"
    path, _, rest = site.partition(":")
    return f"{path.rsplit('/', 1)[-1]}:{rest}"


#: Device memory at or above this share is an error on its own: the next longer batch,
#: eval pass or fragmented allocation runs out.
FULL_DEVICE_SHARE = 0.90


def device_fill(rank: RankData) -> float | None:
    """The highest share of the rank's device memory in use (NVML's used over total, every
    process on the GPU counted); None without a device budget (CPU, or no NVML)."""
    shares = [
        nvml["used"] / nvml["total"]
        for m in rank.mem
        if isinstance(nvml := m.get("nvml"), dict) and nvml.get("total") and nvml.get("used") is not None
    ]
    return max(shares) if shares else None


def device_total(rank: RankData) -> int | None:
    """The rank's device memory, bytes, where NVML recorded it."""
    totals = [nvml["total"] for m in rank.mem if isinstance(nvml := m.get("nvml"), dict) and nvml.get("total")]
    return max(totals) if totals else None


def run_failed_here(rank: RankData) -> bool:
    """The memory findings' test for an error: the rank ran out of memory, or its device
    was at least FULL_DEVICE_SHARE full (docs/detectors.md, severity)."""
    fill = device_fill(rank)
    return ended_with_oom(rank) or (fill is not None and fill >= FULL_DEVICE_SHARE)


#: Ranks whose evidence reads alike are shown as one group from this many on; fewer keep a
#: row each (a 2-rank run's evidence reads as it always has).
MIN_ALIKE_RANKS = 3
_NUMBER = re.compile(r"[0-9]+")
#: A figure in a value: its digits and decimals (texts alike but for their numbers have
#: their figures at the same places).
_FIGURE = re.compile(r"[0-9]+(?:\.[0-9]+)?")


def but_for_numbers(text: str) -> str:
    """The text with every number left out: what ranks' texts share when they differ only
    in ports, pids, addresses, thread ids, times."""
    return _NUMBER.sub("#", text)


def figure_ranges(values: list[str]) -> str:
    """Texts alike but for their numbers as one: each figure that differs between them as
    its range over them ("median 118.2-125.9 ms over 96 steps")."""
    figures = [_FIGURE.findall(v) for v in values]
    parts = iter(_FIGURE.split(values[0]))
    out = [next(parts)]
    for i, rest in enumerate(parts):
        column = [f[i] for f in figures]
        low, high = min(column, key=float), max(column, key=float)
        out += [low if low == high else f"{low}-{high}", rest]
    return "".join(out)


def per_rank_evidence(
    rows: dict[int, list[tuple[str, Any, str]]],
    apart: frozenset[int] = frozenset(),
    show: Literal["first", "ranges", "exact"] = "first",
) -> list[Evidence]:
    """Each rank's evidence rows, (label after "rank N", value, source), in rank order; the
    ranks (MIN_ALIKE_RANKS or more, none of ``apart``) whose rows read the same but for their
    numbers (ports, pids, addresses, times) as one group at its first rank's place: labelled
    with the ranks as ranges, the first rank's value (saying for how many ranks it stands)
    and source. ``show="ranges"`` (values that are measurements, not ports or addresses):
    each figure's range over the group (:func:`figure_ranges`); ``show="exact"`` (values
    whose numbers are the evidence: a collective's sizes): only ranks whose values read the
    same to the letter are grouped (their sources still but for numbers). A 1,024-rank
    hang's evidence is then a few rows, not 2,048."""
    alike: dict[object, list[int]] = {}
    for n, own in sorted(rows.items()):
        key = (
            n
            if n in apart
            else tuple(
                (suffix, str(value) if show == "exact" else but_for_numbers(str(value)), but_for_numbers(source))
                for suffix, value, source in own
            )
        )
        alike.setdefault(key, []).append(n)
    shown: list[tuple[int, list[Evidence]]] = []  # (the rank whose place it takes, its rows)
    for members in alike.values():
        first = members[0]
        if len(members) < MIN_ALIKE_RANKS:
            shown += [
                (n, [Evidence(f"rank {n}{suffix}", value, source) for suffix, value, source in rows[n]])
                for n in members
            ]
            continue
        group = f"ranks {rank_ranges(members)}"
        if show == "exact":
            note = f" ({len(members):,} ranks alike)"
            values = [value for _, value, _ in rows[first]]
        elif show == "ranges":
            note = f" ({len(members):,} ranks alike but for their numbers; each figure's range over them)"
            values = [figure_ranges([str(rows[n][i][1]) for n in members]) for i in range(len(rows[first]))]
        else:
            note = f" ({len(members):,} ranks alike but for their numbers; rank {first}'s shown)"
            values = [value for _, value, _ in rows[first]]
        shown.append(
            (
                first,
                [
                    Evidence(f"{group}{suffix}", f"{value}{note}", source)
                    for (suffix, _, source), value in zip(rows[first], values, strict=True)
                ],
            )
        )
    return [ev for _, evidence in sorted(shown, key=lambda s: s[0]) for ev in evidence]


def pending_state(call: Collective, rank: RankData, run: RunData) -> str:
    """What a call with no recorded end means: the rank is still waiting in it, unless its
    stream says how it ended (a signal, an abort, an exit), or the job's launchers have
    all ended: then it ended inside it."""
    ending = ending_of(rank)
    if not ending.known:
        if launchers_ended(run):
            return "never returned: the rank's process ended inside it without a word (SIGKILL)"
        return "still waiting in it"
    how = (ending.detail or f"{ending.status} {ending.code}").splitlines()[0][:80]
    return f"never returned: the rank ended inside it ({how})"


def reentrancy(values: list[Any]) -> str:
    """The activation checkpointing's kind as recorded in ``grad_setup`` (its
    ``use_reentrant`` values: True, False, or "unknown" where the probe could not read it
    through the framework's wrappers): "reentrant", "non-reentrant", both, or
    "(use_reentrant unknown)" whenever some module's setting was not read (never a known
    value in its place)."""
    known = {v for v in values if isinstance(v, bool)}
    if not values or any(not isinstance(v, bool) for v in values):
        return "reentrant (some modules' use_reentrant unknown)" if True in known else "(use_reentrant unknown)"
    if known == {True, False}:
        return "reentrant and non-reentrant"
    return "reentrant" if True in known else "non-reentrant"
