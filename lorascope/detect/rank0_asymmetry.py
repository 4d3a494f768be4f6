"""rank0-asymmetry: rank 0 holds more memory than the other ranks.

Evidence: each rank's peak against the median of the others; the point of the loop
(step and phase edge) where rank 0 began to pull away, aligning the ranks' memory
samples taken at the same phase edges; on CUDA, other ranks' PIDs that NVML lists on
rank 0's GPU (their CUDA contexts landed on GPU 0). Thresholds: docs/detectors.md.
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from lorascope.detect.common import (
    ended_with_oom,
    mem_reader,
    mem_value,
    memory_kind,
    peak_memory,
    run_failed_here,
    stream_source,
)
from lorascope.detect.finding import Confidence, Evidence, Finding
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.rundir.loading.reader import RankData
from lorascope.units import fmt_bytes, ranks_named

ID = "rank0-asymmetry"
#: Rank 0's excess over the others' median must pass a share of the others' peak ...
MIN_EXCESS_SHARE = 0.05
#: ... or a share of what the other ranks' memory grew by during training (the baseline,
#: weights and framework, can dwarf what a step adds: a small job on CPU) ...
MIN_SHARE_OF_GROWTH = 0.25
#: ... and always an absolute floor (allocator noise stays under it).
MIN_EXCESS_BYTES = 16 * 2**20
#: A finding needs this many times the threshold: at the threshold itself it is noise (a
#: healthy DDP Trainer job on CPU read rank 0 +16.2 MiB, 6%, "1.0x the threshold", on
#: three tries out of three).
MARGIN = 1.5


EXPLANATION = (
    "In data-parallel training every rank should hold about the same memory. Rank 0 "
    "often does extra work the others do not: it evaluates or logs alone and keeps the "
    "outputs, gathers tensors from every rank, or hosts other ranks' CUDA contexts when "
    "they did not select their own device before initialising. It then runs out of "
    "memory while the other ranks are comfortable."
)
FIX = (
    "Run evaluation on every rank and all_reduce the metrics; keep no outputs on rank 0 (move "
    "gathered tensors to CPU, reduce them to numbers, delete them); call "
    "torch.cuda.set_device(local_rank) before init_process_group and pass "
    "barrier(device_ids=[local_rank])."
)


def _edge_series(rank: RankData, kind: str) -> list[tuple[tuple[int, str, int], int]]:
    """Main-thread samples keyed by (step, phase edge, occurrence), in order."""
    seen: dict[tuple[int, str], int] = {}
    out = []
    value_of = mem_reader(kind)
    for sample in rank.mem:
        src = sample["src"]
        if src == "sampler":
            continue
        value = value_of(sample)
        if value is None:
            continue
        step = sample["step"]
        n = seen[step, src] = seen.get((step, src), 0) + 1
        out.append(((step, src, n), value))
    return out


def _growth(rank: RankData, kind: str, peak: int | None) -> int | None:
    """Peak (``peak_memory``) minus the memory held at the first forward (what training added)."""
    base = next((v for m in rank.mem if m["src"] == "forward.begin" and (v := mem_value(m, kind)) is not None), None)
    return None if base is None or peak is None else max(peak - base, 0)


#: Rank 0's gap to the others' median at each phase edge every rank sampled (``_gaps``).
Gaps = list[tuple[tuple[int, str, int], float]]


def _gaps(rank0: RankData, others: list[RankData], kind: str) -> Gaps:
    """Rank 0's reading minus the others' median at each phase edge all ranks sampled."""
    series = [dict(_edge_series(r, kind)) for r in others]
    out = []
    for key, value in _edge_series(rank0, kind):
        values = [s[key] for s in series if key in s]
        if len(values) == len(series):
            out.append((key, value - statistics.median(values)))
    return out


def held_gap(gaps: Gaps) -> float | None:
    """The most rank 0 held over the others for a whole step: the largest gap present at
    every one of as many consecutive phase edges as a step has (edges every rank sampled,
    at the same point of the loop; the ``end`` sample is left out, the ranks exit at
    different moments). A background-sampler reading that caught one rank mid-loss and
    not the other (a transient: the logits at the loss) is no excess. None without
    matched edges."""
    gaps = [(key, g) for key, g in gaps if key[1] != "end"]
    if not gaps:
        return None
    window = max(1, round(statistics.median(Counter(_iteration(key) for key, _ in gaps).values())))
    values = [g for _, g in gaps]
    if len(values) <= window:
        return min(values)
    return max(min(values[i : i + window]) for i in range(len(values) - window + 1))


def _iteration(key: tuple[int, str, int]) -> int:
    """The loop iteration a sample belongs to: a ``step`` sample's number is the step it
    ends plus one (``probes/steps.py``), every other edge's the steps done before it."""
    return key[0] - (key[1] == "step")


def divergence_point(gaps: Gaps, excess: float) -> dict[str, Any] | None:
    """Where rank 0 pulls away: the ranks' samples are aligned by phase edge, the gap to
    the others' median is followed edge to edge, and the interval (from one edge to the
    next) whose gap increases add up to the most names the phase — robust to an allocator
    that wobbles at any single edge. ``step`` is where the gap first reached half the
    final excess; ``since`` (only when the steps before it were not read: a CPU rank's
    heap after ``HEAP_DENSE_STEPS`` in ``probes/memory.py``, or steps the reader left out
    of a long run) the first step it may have reached it at.

    An interval across steps not read holds every phase of those steps: its growth names
    none. When one such stretch grew more than the named interval did over the whole run
    (a one-off allocation in a step not read), the point names that stretch instead
    (``unread``: its first and last step; ``phase`` None); a steady growth in one phase
    adds up over the steps read, more than any one stretch between them holds. Where
    steps were not read, ``steps_read`` says in how many steps the named interval was read."""
    previous, last_gap, last_iteration = "start", 0.0, None
    growth: dict[tuple[str, str], float] = {}
    unread: tuple[float, int, int] | None = None
    first_step: int | None = None
    since: int | None = None
    times: Counter[tuple[str, str]] = Counter()
    for key, gap in gaps:
        step, edge, _ = key
        iteration = _iteration(key)
        skipped = last_iteration is not None and iteration > last_iteration + 1
        if not skipped:
            growth[(previous, edge)] = growth.get((previous, edge), 0.0) + (gap - last_gap)
            times[(previous, edge)] += 1
        elif last_iteration is not None and (unread is None or gap - last_gap > unread[0]):
            unread = (gap - last_gap, last_iteration + 1, iteration - 1)
        if first_step is None and gap >= excess / 2:
            first_step = step
            since = last_iteration + 1 if skipped and last_iteration is not None else None
        previous, last_gap, last_iteration = edge, gap, iteration
    if first_step is None:
        return None
    (after, edge), added = max(growth.items(), key=lambda kv: kv[1]) if growth else (("", ""), 0.0)
    point: dict[str, Any]
    if unread is not None and unread[0] > max(added, 0.0):
        point = {"step": first_step, "after": None, "edge": None, "phase": None, "gap": unread[0]}
        point["unread"] = [unread[1], unread[2]]
    elif added > 0:
        point = {"step": first_step, "after": after, "edge": edge, "phase": _phase_between(after, edge), "gap": added}
    else:
        return None
    if since is not None:
        point["since"] = since
    if unread is not None and point["phase"] is not None:
        point["steps_read"] = times[(after, edge)]
    return point


def _phase_between(previous: str, edge: str) -> str:
    """Name what ran between two samples: a phase that ended at ``edge``, or, when
    ``edge`` opens a phase, the training script's own code between the engine's phases
    (where evaluation, logging and gathers on rank 0 usually live). A gap that opens
    right after an eval or save phase is that phase's output kept by rank 0 alone (the
    other ranks free theirs once it is done). An interval that opens at one phase's begin
    and closes at another's edge holds the rest of the first (a CPU rank's heap is not
    read at every edge: ``RSS_ONLY_EDGES`` in ``probes/memory.py``): both are named."""
    name, _, side = edge.partition(".")
    before, _, before_side = previous.partition(".")
    if side and before_side == "begin" and before != name:
        then = f"the {name} phase" if side == "end" else "the training loop's own code after it"
        return f"the {before} phase or {then}"
    if side == "end":
        return name
    if before in ("eval", "save") and before_side == "end":
        return before  # what that phase produced and rank 0 alone kept
    return "the training loop's own code between steps" if side == "begin" else edge


def _rss_note(rank: RankData, kind: str, heap_peak: int) -> str:
    """Beside a heap figure, the rank's peak RSS, and why the heap reads more when it does."""
    if kind != "heap in use":
        return ""
    rss = max((r for m in rank.mem if (r := m.get("rss"))), default=None)
    if not rss:
        return ""
    if heap_peak <= rss:
        return f" (peak RSS {fmt_bytes(rss)})"
    return (
        f" (peak RSS {fmt_bytes(rss)}: the heap also counts allocations never touched, such as "
        "DeepSpeed's reduce bucket, which a GPU would hold in full)"
    )


def _gpu0_guests(rank0: RankData, others: list[RankData]) -> list[int]:
    """Ranks whose PIDs NVML lists on rank 0's GPU."""
    pids: set[int] = set()
    for sample in rank0.mem:
        nvml = sample.get("nvml")
        if isinstance(nvml, dict):
            pids.update(nvml.get("pids") or [])
    return sorted(r.rank for r in others if r.pid in pids)


def _rank0_only_blocks(bundle: EvidenceBundle) -> list[Evidence]:
    """With the ranks' allocator snapshots (the probes write them on CUDA): what rank 0
    holds that the others do not, by category and user frame."""
    comparison = bundle.snapshot_comparison
    if comparison is None or 0 not in bundle.snapshots:
        return []
    src = f"{bundle.snapshots[0].path} ({comparison.points[0]})"
    return [
        Evidence(
            f"on rank 0 {'only' if a.only_here else 'mostly'}: {a.category}",
            f"{fmt_bytes(a.bytes)} at {a.site} (others at most {fmt_bytes(a.others_max)})",
            src,
        )
        for a in comparison.rank_only
        if a.rank == 0
    ][:5]


def from_snapshots(bundle: EvidenceBundle) -> list[Finding]:
    """Several ranks' allocator snapshots: rank 0's allocated bytes at its peak against the
    others', and the allocations present on rank 0 only (by first user frame)."""
    comparison = bundle.snapshot_comparison
    if comparison is None or 0 not in comparison.allocated or len(comparison.allocated) < 2:
        return []
    others = [v for r, v in comparison.allocated.items() if r != 0]
    median = statistics.median(others)
    excess = comparison.allocated[0] - median
    only = [a for a in comparison.rank_only if a.rank == 0]
    # Allocations no other rank has are evidence enough on their own: the floor suffices.
    alone = sum(a.bytes for a in only if a.only_here) >= MIN_EXCESS_BYTES
    threshold = MIN_EXCESS_BYTES if alone else max(MIN_EXCESS_BYTES, MIN_EXCESS_SHARE * median)
    if excess < threshold:
        return []
    src = f"{bundle.snapshots[0].path} ({comparison.points[0]})"
    evidence = [
        Evidence("rank 0 allocated", fmt_bytes(comparison.allocated[0]), src),
        Evidence("median of the other ranks", fmt_bytes(median), "their snapshots"),
        Evidence("rank 0 excess", f"{fmt_bytes(excess)} ({excess / median:.0%})", "allocated minus the median"),
    ]
    evidence += _rank0_only_blocks(bundle)
    return [
        Finding(
            id=ID,
            title=f"rank 0 holds {fmt_bytes(excess)} more than the other ranks"
            + (f"; the largest part only it holds: {only[0].category} at {only[0].site}" if only else ""),
            severity="error" if any(d.ooms for d in bundle.snapshots[0].devices) else "warning",
            confidence="high" if only else "medium",
            confidence_reason=(
                "allocations present on rank 0 only, found by comparing the ranks' snapshots"
                if only
                else "rank 0's peak is above the others', no allocation is rank 0's alone"
            ),
            ranks=[0],
            evidence=evidence,
            explanation=EXPLANATION,
            fix=FIX,
            details={"peaks": {str(r): v for r, v in comparison.allocated.items()}, "source": "snapshots"},
        )
    ]


def detect(bundle: EvidenceBundle) -> list[Finding]:
    run = bundle.run
    if run is None or 0 not in run.ranks or len(run.ranks) < 2:
        return from_snapshots(bundle)
    rank0 = run.ranks[0]
    others = [r for n, r in run.ranks.items() if n != 0]
    peak_of = {r.rank: peak_memory(r) for r in run.ranks.values()}
    peak0 = peak_of[0]
    peaks = [p for r in others if (p := peak_of[r.rank]) is not None]
    if peak0 is None or not peaks:
        return []
    median = statistics.median(peaks)
    excess = peak0 - median
    kind = memory_kind(rank0)
    gaps = _gaps(rank0, others, kind) if kind != "CUDA allocated" else None
    kept = held_gap(gaps) if gaps is not None else None
    if kept is not None and kept < excess:
        excess = kept
    growths = [g for r in others if (g := _growth(r, kind, peak_of[r.rank])) is not None]
    growth = statistics.median(growths) if growths else None
    threshold = max(
        MIN_EXCESS_BYTES, min(MIN_EXCESS_SHARE * median, MIN_SHARE_OF_GROWTH * growth if growth else float("inf"))
    )
    if excess < MARGIN * threshold:
        return []
    point = divergence_point(gaps if gaps is not None else _gaps(rank0, others, kind), excess)
    guests = _gpu0_guests(rank0, others)
    evidence = [
        Evidence(
            f"rank 0 peak ({kind})",
            fmt_bytes(peak0) + _rss_note(rank0, kind, peak0),
            stream_source(run, rank0, "mem records"),
        ),
        Evidence(
            f"median peak of {ranks_named(r.rank for r in others)}",
            fmt_bytes(median),
            "mem records of those ranks",
        ),
        Evidence(
            "rank 0 excess",
            f"{fmt_bytes(excess)} ({excess / median:.0%} over the others)",
            "peak minus the median"
            if kept is None or kept >= 0.95 * (peak0 - median)
            else f"held at every phase edge of a whole step (peaks differ by {fmt_bytes(peak0 - median)})",
        ),
    ]
    if point is not None:
        reached = (
            f"half the excess reached at step {point['step']}"
            if "since" not in point
            else f"half the excess reached between steps {point['since']} and {point['step']}"
        )
        if point["phase"] is None:
            first, last = point["unread"]
            where = f"in steps {first} to {last}, whose memory was not read (+{fmt_bytes(point['gap'])} there; "
            where += "no phase can be named"
        else:
            over = f"the {point['steps_read']} steps it was read in" if "steps_read" in point else "the run"
            where = f"between {point['after']} and {point['edge']}: {point['phase']} (+{fmt_bytes(point['gap'])} over {over}"
        evidence.append(Evidence("rank 0 pulled away", f"{where}; {reached})", "mem records aligned by phase edge"))
    if guests:
        evidence.append(
            Evidence(
                "other ranks' processes on rank 0's GPU",
                f"{ranks_named(guests)} (NVML process list)",
                stream_source(run, rank0, "mem.nvml"),
            )
        )
    evidence += _rank0_only_blocks(bundle)
    oom = ended_with_oom(rank0)
    if oom:
        evidence.append(
            Evidence(
                "rank 0 ended with",
                (rank0.exception or {"message": ""})["message"].splitlines()[0][:300],
                stream_source(run, rank0, "exception record"),
            )
        )
    reasons = [f"excess {excess / threshold:.1f}x the threshold"]
    phase = point["phase"] if point else None
    if point is not None:
        reasons.append(
            f"divergence located at {point['edge']}" if phase else "divergence in steps whose memory was not read"
        )
    if guests:
        reasons.append("other ranks' contexts seen on GPU 0")
    confidence: Confidence = "high" if excess >= 2 * threshold and (phase is not None or guests) else "medium"
    return [
        Finding(
            id=ID,
            title=f"rank 0 holds {fmt_bytes(excess)} more memory than the other ranks"
            + (f"; it pulled away in {phase if ' ' in phase else 'the ' + phase + ' phase'}" if phase else ""),
            severity="error" if run_failed_here(rank0) else "warning",
            confidence=confidence,
            confidence_reason="; ".join(reasons),
            ranks=[0],
            evidence=evidence,
            explanation=EXPLANATION,
            fix=FIX,
            details={
                "peaks": {str(n): peak for n, peak in peak_of.items()},
                "divergence": point,
                "gpu0_guest_ranks": guests,
            },
        )
    ]
