"""The whole job as one Chrome trace-event timeline, for Perfetto and chrome://tracing.

One process per rank (named ``rank N``), with threads for steps, phases and each process
group's collectives as slices; flow arrows join the same collective (group, sequence
number) across ranks; memory per rank as counter tracks (MiB: CUDA allocated and
reserved, heap in use, RSS); each finding as a global instant event; the kernel-trace
window a rank recorded merged into its process (Kineto traces are on the same epoch
clock, in microseconds). Timestamps are microseconds since the epoch.

Bounded: a step range (from the first rank's records) or a time range picks a window,
and ``max_events`` caps the output, with a note event saying what was left out.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from lorascope.analysis import Analysis
from lorascope.detect.common import CUDA_ALLOCATED, RSS, mem_value
from lorascope.detect.finding import Finding
from lorascope.ingest.kineto.reader import KinetoTrace
from lorascope.rundir.loading.reader import Collective, RankData, RunData
from lorascope.rundir.loading.span import SpanRecords

#: Events written at most, by default (a 1,000-step, 64-rank ZeRO-3 run holds ~3 M calls).
MAX_EVENTS = 2_000_000
#: Thread ids inside each rank's process.
TID_STEPS, TID_PHASES, TID_COLLECTIVES = 1, 2, 10
MIB = 1 << 20


@dataclass
class Window:
    """The part of the run to export: [start, end] in epoch seconds (None: open)."""

    start: float | None = None
    end: float | None = None

    def holds(self, begin: float, end: float) -> bool:
        return (self.start is None or end >= self.start) and (self.end is None or begin <= self.end)


def step_window(run: RunData, first: int, last: int, spans: dict[int, SpanRecords] | None = None) -> Window:
    """Steps ``first``..``last`` of the first rank that recorded steps, from its records read
    again in ``spans`` when given (a step record is written at its end, with its duration).
    Where the range's first or last step is not among the records held (a reduced run keeps
    every stride-th step of a long one), the window reaches to the nearest steps held
    outside the range: it holds the range and a little more."""
    rank = next((r for r in run.ranks.values() if r.steps), None)
    if rank is None:
        return Window()
    span = None if spans is None else spans.get(rank.rank)
    steps = rank.steps if span is None else span.steps
    chosen = [s for s in steps if first <= s["step"] <= last]
    before = [s for s in steps if s["step"] < first]
    after = [s for s in steps if s["step"] > last]
    if not chosen and not (before and after):
        return Window(0.0, 0.0)
    if chosen and chosen[0]["step"] == first:
        start: float | None = float(chosen[0]["t"]) - float(chosen[0]["dur"])
    else:
        start = float(before[-1]["t"]) if before else None
    if chosen and chosen[-1]["step"] == last:
        end: float | None = float(chosen[-1]["t"])
    else:
        end = float(after[0]["t"]) - float(after[0]["dur"]) if after else None
    return Window(start, end)


def _us(t: float) -> float:
    return round(t * 1e6, 3)


def _meta(pid: int, name: str, tid: int | None = None) -> dict[str, Any]:
    event: dict[str, Any] = {"ph": "M", "pid": pid, "name": "thread_name" if tid is not None else "process_name"}
    if tid is not None:
        event["tid"] = tid
    event["args"] = {"name": name}
    return event


def _rank_events(
    rank: RankData, window: Window, tids: dict[str, int], span: SpanRecords | None
) -> Iterator[dict[str, Any]]:
    """The rank's process: its steps, phases, calls and memory readings in the window (from
    ``span`` when the run's were reduced and the span was read again)."""
    pid = rank.rank
    held: RankData | SpanRecords = rank if span is None else span
    yield _meta(pid, f"rank {rank.rank} ({rank.host} pid {rank.pid})")
    yield {"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": rank.rank}}
    yield _meta(pid, "steps", TID_STEPS)
    yield _meta(pid, "phases", TID_PHASES)
    for group, tid in tids.items():
        yield _meta(pid, f"collectives {group}", tid)
    for s in held.steps:
        end, dur = float(s["t"]), float(s["dur"])
        if window.holds(end - dur, end):
            args = {"loss": s.get("loss"), "src": s.get("src")}
            yield {
                "ph": "X",
                "pid": pid,
                "tid": TID_STEPS,
                "name": f"step {s['step']}",
                "ts": _us(end - dur),
                "dur": _us(dur),
                "args": args,
            }
    for p in held.phases:
        t = float(p["t"])
        if window.holds(t, t) and p.get("edge") in ("begin", "end"):
            yield {
                "ph": "B" if p["edge"] == "begin" else "E",
                "pid": pid,
                "tid": TID_PHASES,
                "name": str(p.get("name", "phase")),
                "ts": _us(t),
            }
    for c in held.collectives:
        end = c.end if c.end is not None else rank.last_time
        if not window.holds(c.start, end):
            continue
        call: dict[str, Any] = {
            "seq": c.seq,
            "group": c.group,
            "bytes": c.bytes,
            "dtype": c.dtype,
            "site": c.site,
            "async": c.is_async,
        }
        if c.pending:
            call["pending"] = "no end record: the rank was still in it when its stream ended"
        if c.err:
            call["error"] = c.err[:300]
        if c.via:
            call["via"] = c.via
        yield {
            "ph": "X",
            "pid": pid,
            "tid": tids[c.group],
            "name": f"{c.op} #{c.seq} {c.group}",
            "cat": "collective",
            "ts": _us(c.start),
            "dur": _us(max(end - c.start, 1e-6)),
            "args": call,
        }
    for m in held.mem:
        t = float(m["t"])
        if not window.holds(t, t):
            continue
        values = {
            "RSS MiB": mem_value(m, RSS),
            "heap in use MiB": m.get("heap"),
            "CUDA allocated MiB": mem_value(m, CUDA_ALLOCATED),
            "CUDA reserved MiB": cuda.get("reserved") if isinstance(cuda := m.get("cuda"), dict) else None,
        }
        args = {k: round(v / MIB, 3) for k, v in values.items() if isinstance(v, (int, float))}
        if args:
            yield {"ph": "C", "pid": pid, "name": "memory", "ts": _us(t), "args": args}


def _flows(
    run: RunData, window: Window, tids: dict[str, int], spans: dict[int, SpanRecords] | None
) -> Iterator[dict[str, Any]]:
    """An arrow through the same collective on every rank that ran it, in rank order."""
    by_call: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for rank in run.ranks.values():
        for c in _calls(rank, spans):
            end = c.end if c.end is not None else rank.last_time
            if window.holds(c.start, end):
                by_call.setdefault((c.group, c.seq), []).append((rank.rank, c.start))
    for (group, seq), hops in by_call.items():
        if len(hops) < 2:
            continue
        flow = zlib.crc32(f"{group}#{seq}".encode())
        hops.sort()
        for i, (n, start) in enumerate(hops):
            ph = "s" if i == 0 else "f" if i == len(hops) - 1 else "t"
            event = {
                "ph": ph,
                "pid": n,
                "tid": tids[group],
                "name": f"{group} #{seq}",
                "cat": "collective",
                "id": flow,
                "ts": _us(start),
            }
            if ph != "s":
                event["bp"] = "e"
            yield event


def _moment(finding: Finding, run: RunData | None) -> float | None:
    """When a finding happened: the divergence it names (group, seq), else the run's end."""
    if run is None:
        return None
    group, seq = finding.details.get("group"), finding.details.get("seq")
    starts = [c.start for r in run.ranks.values() for c in r.collectives if c.group == group and c.seq == seq]
    if starts:
        return min(starts)
    return max((r.last_time for r in run.ranks.values()), default=None)


def _finding_events(analysis: Analysis) -> Iterator[dict[str, Any]]:
    for f in analysis.findings:
        t = _moment(f, analysis.bundle.run)
        if t is not None:
            yield {
                "ph": "i",
                "s": "g",
                "pid": 0,
                "tid": 0,
                "name": f"{f.id}: {f.title[:120]}",
                "ts": _us(t),
                "args": {"severity": f.severity, "ranks": f.ranks, "fix": f.fix},
            }


def _kernel_events(rank: int, trace: KinetoTrace, window: Window) -> Iterator[dict[str, Any]]:
    """The rank's Kineto window in its own process (device streams keep their tids)."""
    for e in (trace.raw or {}).get("traceEvents", []):
        if not isinstance(e, dict) or e.get("ph") not in ("X", "i", "C"):
            continue
        ts = e.get("ts")
        if not isinstance(ts, (int, float)) or isinstance(ts, bool):
            continue
        dur = e["dur"] if isinstance(e.get("dur"), (int, float)) else 0
        if window.holds(ts / 1e6, (ts + dur) / 1e6):
            tid = e.get("tid")
            yield {**e, "pid": rank, "tid": f"kineto {tid}" if not isinstance(tid, int) else 1000 + tid}


def _calls(rank: RankData, spans: dict[int, SpanRecords] | None) -> list[Collective]:
    span = None if spans is None else spans.get(rank.rank)
    return rank.collectives if span is None else span.collectives


def timeline(
    analysis: Analysis,
    window: Window | None = None,
    max_events: int = MAX_EVENTS,
    spans: dict[int, SpanRecords] | None = None,
) -> dict[str, Any]:
    """The trace-event document (see the module docstring). ``spans``: each rank's records
    in the window read again (:func:`lorascope.rundir.loading.reader.records_between`), for a run
    whose loaded records were reduced."""
    window = window or Window()
    run = analysis.bundle.run
    events: list[dict[str, Any]] = []
    left_out = sum(span.left_out for span in spans.values()) if spans is not None else 0

    def add(source: Iterator[dict[str, Any]]) -> None:
        nonlocal left_out
        for event in source:
            if len(events) < max_events:
                events.append(event)
            else:
                left_out += 1

    if run is not None:
        groups = sorted({c.group for r in run.ranks.values() for c in _calls(r, spans)})
        tids = {g: TID_COLLECTIVES + i for i, g in enumerate(groups)}
        for rank in run.ranks.values():
            add(_rank_events(rank, window, tids, None if spans is None else spans.get(rank.rank)))
        add(_flows(run, window, tids, spans))
    add(_finding_events(analysis))
    for n, trace in sorted(analysis.bundle.traces.items()):
        add(_kernel_events(n, trace, window))
    metadata: dict[str, Any] = {"source": str(analysis.bundle.path), "exporter": "lorascope"}
    if left_out:
        note = (
            f"{left_out:,} events left out past the cap of {max_events:,}: export a step or time range "
            "(--steps A:B, --from/--to) or raise --max-events"
        )
        metadata["truncated"] = note
        events.append(
            {"ph": "i", "s": "g", "pid": 0, "tid": 0, "name": note, "ts": events[-1].get("ts", 0) if events else 0}
        )
    return {"traceEvents": events, "displayTimeUnit": "ms", "metadata": metadata}
