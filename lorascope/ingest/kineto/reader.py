"""Kineto (PyTorch profiler) Chrome-trace JSON, ``.json`` or ``.json.gz``, one rank per file.

What counts as a "kernel": GPU kernels (``cat == "kernel"``, CUDA or ROCm names alike);
on a CPU-only trace there are none, so the leaf CPU ops (ops with no op inside them on
their thread) stand in for them, so that nested ops are not counted twice (the same rule
as the report's kernel table).

Collectives: NCCL kernels, with the args recent PyTorch attaches (``Collective name``,
``In msg nelems``, ``Out msg nelems``, ``dtype``, ``Group size``, ``Process Group Name``,
``Process Group Ranks``) when present, else the op read from the kernel name
(``ncclKernel_AllReduce_...``, ``ncclDevKernel_SendRecv``); on CPU the ``gloo:*`` ranges
(they carry ``Input Dims`` and ``Input type``).

The reader needs no torch and no holistictraceanalysis (see ``kineto_hta`` for the HTA
figures added on top when it is installed and accepts the trace).
"""

from __future__ import annotations

import bisect
import json
import math
import re
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorascope.errors import BadInputError
from lorascope.ingest.kineto.hta import HtaFigures
from lorascope.ingest.kineto.salvage import salvage
from lorascope.rundir.format.safe_open import loads_json, read_capped_cut

#: Duration buckets' upper edges (microseconds) for the distribution.
BUCKETS_US = (1, 2, 5, 10, 20, 50, 100, 1000, 10_000)
#: Thresholds for which the count and time share under them are reported.
TINY_THRESHOLDS_US = (2.0, 5.0, 10.0)
TOP_KERNELS = 20
#: Times and durations past this (microseconds: ~31,700 years) are not a trace's.
MAX_TIME_US = 1e18

_NCCL_NAME = re.compile(r"^(?:nccl|rccl)(?:Dev)?Kernel_([A-Za-z]+)", re.I)
_GLOO = "gloo:"
_ROCM_NAME = re.compile(r"^(?:Cijk_|__amd|rocblas|miopen|hip)", re.I)


@dataclass
class DurationStats:
    """The distribution of kernel (or op) durations, in microseconds."""

    count: int
    total_us: float
    p10_us: float | None
    p50_us: float | None
    p90_us: float | None
    p99_us: float | None
    max_us: float | None
    #: (upper edge in us, count, time in us) per bucket of BUCKETS_US, plus one open bucket
    #: (upper edge None) for the rest.
    histogram: list[tuple[float | None, int, float]]
    #: threshold us -> (count under it, share of all kernels' time spent in them).
    under: dict[float, tuple[int, float]]


@dataclass
class KernelSummary:
    """One kernel (or op) name, over the trace."""

    name: str
    count: int
    total_us: float
    median_us: float
    max_us: float


@dataclass
class Collective:
    """One collective as the trace shows it (a GPU kernel, or a gloo range on CPU)."""

    op: str
    ts_us: float
    dur_us: float
    in_nelems: int | None = None
    out_nelems: int | None = None
    dtype: str | None = None
    group: str | None = None
    group_ranks: list[int] | None = None
    group_size: int | None = None
    #: "kernel args", "kernel name" or "gloo range".
    source: str = "kernel name"


@dataclass
class KinetoTrace:
    """One rank's trace, summarised."""

    path: Path
    rank: int | None
    world_size: int | None
    backend: str | None
    #: "cuda", "rocm" or "cpu" (no GPU kernels in the trace).
    device: str
    #: "kernel" (GPU kernels) or "op" (leaf CPU ops, on a CPU-only trace).
    unit: str
    #: Wall time the trace covers (first event start to last event end).
    span_us: float
    #: Steps in the trace (``ProfilerStep#N`` or ``lorascope.step#N`` ranges): (name, dur_us).
    steps: list[tuple[str, float]]
    durations: DurationStats
    top: list[KernelSummary]
    #: Time at least one unit runs (union of intervals) and the gaps between them, per
    #: device/thread lane summed. On GPU: busy vs idle; with many tiny kernels the idle
    #: gaps are launch overhead.
    busy_us: float
    idle_gaps: int
    idle_us: float
    #: How many lanes (devices, or threads on a CPU trace) the three figures above sum:
    #: over several, idle time can be more than the trace's span.
    lanes: int
    #: Time in communication (union of the collectives' spans) and in the other units.
    comm_us: float
    compute_us: float
    collectives: list[Collective]
    #: op -> (count, total us).
    collective_ops: dict[str, tuple[int, float]]
    #: The parsed JSON, as the file holds it (``raw["traceEvents"]`` are the events).
    raw: dict[str, Any] = field(repr=False, default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    #: HolisticTraceAnalysis figures (GPU traces it accepts), or why there are none.
    hta: HtaFigures | None = None
    hta_note: str | None = None

    @property
    def events(self) -> list[Any]:
        return self.raw.get("traceEvents") or []


def load_trace_json(path: Path, inside: Path | None = None) -> tuple[Any, list[str]]:
    """The trace's JSON (gzipped or not), read up to the JSON size limit, and what was
    wrong with it; BadInputError when unreadable or over the limit. A trace cut short (a
    gzip stream or JSON text that breaks off) is read as far as it goes (``salvage``),
    with a warning."""
    data, gzip_cut = read_capped_cut(path, "json_bytes", "the trace (decompressed)", inside)
    try:
        return loads_json(data, path, "the trace"), _gzip_warning(gzip_cut)
    except BadInputError:
        kept = salvage(data)
        if kept is None:
            raise
    events = kept.data["traceEvents"]
    if not kept.events_cut:
        return kept.data, [*_gzip_warning(gzip_cut), "the trace's JSON breaks off after its events: all of them read"]
    return kept.data, [
        *_gzip_warning(gzip_cut),
        f"the trace's JSON breaks off inside its events, {len(data):,} bytes in: read the {len(events):,} "
        "whole events before that (the profiler's later events, and any step they hold, are not in it)",
    ]


def _gzip_warning(cut: bool) -> list[str]:
    return ["the gzip file ends inside its compressed stream (cut short): read what it holds"] if cut else []


def read_trace(path: Path, rank: int | None = None, inside: Path | None = None) -> KinetoTrace:
    """One trace file (INSIDE: a folder it must not leave, as ``safe_open.open_regular``)."""
    data, warnings = load_trace_json(path, inside)
    trace = analyse_trace(data, path, rank)
    trace.warnings[:0] = warnings
    return trace


def _num(value: Any) -> float | None:
    """A number within +-MAX_TIME_US, else None (NaN, Infinity, integers past a float's range)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) and abs(number) <= MAX_TIME_US else None


def _absurd(e: Any) -> bool:
    """A timed event whose time or duration is a number, but not a usable one."""
    return (
        isinstance(e, Mapping)
        and e.get("ph") == "X"
        and any(isinstance(v, (int, float)) and _num(v) is None for v in (e.get("ts"), e.get("dur")))
    )


def _spans(events: list[Any]) -> list[dict[str, Any]]:
    """Complete ("X") events with a numeric time and duration and a plain pid/tid."""
    out: list[dict[str, Any]] = []
    for e in events:
        if isinstance(e, dict) and e.get("ph") == "X":
            ts, dur = _num(e.get("ts")), _num(e.get("dur"))
            if ts is not None and dur is not None and dur >= 0 and _plain_id(e.get("pid")) and _plain_id(e.get("tid")):
                out.append(e)
    return out


def _mapping(value: Any) -> Mapping[str, Any]:
    """``value`` if it is a JSON object, else an empty one (traces from elsewhere carry
    any JSON value where a dict is expected)."""
    return value if isinstance(value, Mapping) else {}


def _plain_id(value: Any) -> bool:
    return value is None or isinstance(value, (int, str))


def analyse_trace(data: Any, path: Path, rank: int | None = None) -> KinetoTrace:
    if not isinstance(data, Mapping) or not isinstance(data.get("traceEvents"), list):
        found = sorted(map(str, data))[:6] if isinstance(data, Mapping) else type(data).__name__
        raise BadInputError(f"{path}: not a Kineto trace (no 'traceEvents' list; found {found})")
    warnings: list[str] = []
    info = _mapping(data.get("distributedInfo"))
    file_rank = info.get("rank") if isinstance(info.get("rank"), int) else None
    if file_rank is not None and rank is not None and file_rank != rank:
        warnings.append(f"the file name says rank {rank}, the trace says rank {file_rank}: using the trace's")
    absurd = sum(map(_absurd, data["traceEvents"]))
    if absurd:  # dropped from .raw too: its readers (the kernel table) take times as they are
        data = {**data, "traceEvents": [e for e in data["traceEvents"] if not _absurd(e)]}
        warnings.append(f"{absurd} timed events with NaN, infinite or absurd times were dropped")
    spans = _spans(data["traceEvents"])
    if not spans:
        raise BadInputError(f"{path}: a Kineto trace without any timed event")
    kernels = [e for e in spans if e.get("cat") == "kernel"]
    device = _device(data, kernels)
    units = kernels if kernels else _leaf_ops(spans)
    unit = "kernel" if kernels else "op"
    comm = (
        [e for e in kernels if _is_comm(e)]
        if kernels
        else [e for e in spans if str(e.get("name", "")).startswith(_GLOO)]
    )
    lanes = _lanes(units, by_device=bool(kernels))
    lane_count = len(lanes)
    busy, gaps, idle = _busy(lanes)
    compute = [e for e in units if not _is_comm(e)]
    compute_busy = _busy(_lanes(compute, by_device=bool(kernels)))[0] if compute else 0.0
    comm_busy = _busy(_lanes(comm, by_device=bool(kernels)))[0] if comm else 0.0
    collectives = _collectives(comm)
    ops: dict[str, tuple[int, float]] = {}
    for c in collectives:
        n, t = ops.get(c.op, (0, 0.0))
        ops[c.op] = (n + 1, t + c.dur_us)
    start = min(float(e["ts"]) for e in spans)
    end = max(float(e["ts"]) + float(e["dur"]) for e in spans)
    return KinetoTrace(
        path=path,
        rank=file_rank if file_rank is not None else rank,
        world_size=info.get("world_size") if isinstance(info.get("world_size"), int) else None,
        backend=str(info["backend"]) if info.get("backend") else None,
        device=device,
        unit=unit,
        span_us=end - start,
        steps=_steps(spans),
        durations=_durations([float(e["dur"]) for e in units]),
        top=_top(units),
        busy_us=busy,
        idle_gaps=gaps,
        idle_us=idle,
        lanes=lane_count,
        comm_us=comm_busy,
        compute_us=compute_busy,
        collectives=collectives,
        collective_ops=ops,
        raw=dict(data),
        warnings=warnings,
    )


def _device(data: Mapping[str, Any], kernels: list[dict[str, Any]]) -> str:
    if not kernels:
        return "cpu"
    props = data.get("deviceProperties")
    names = " ".join(str(p.get("name", "")) for p in props if isinstance(p, Mapping)) if isinstance(props, list) else ""
    if (
        "AMD" in names
        or "Radeon" in names
        or "Instinct" in names
        or any(_ROCM_NAME.match(str(k.get("name", ""))) for k in kernels[:200])
    ):
        return "rocm"
    return "cuda"


def _leaf_ops(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """CPU ops that contain no other CPU op on their thread."""
    ops = sorted(
        (e for e in spans if e.get("cat") == "cpu_op"),
        key=lambda e: (str(e.get("pid")), str(e.get("tid")), float(e["ts"]), -float(e["dur"])),
    )
    leaves = []
    for i, e in enumerate(ops):
        nxt = ops[i + 1] if i + 1 < len(ops) else None
        inside = (
            nxt is not None
            and nxt.get("pid") == e.get("pid")
            and nxt.get("tid") == e.get("tid")
            and float(nxt["ts"]) < float(e["ts"]) + float(e["dur"])
        )
        if not inside:
            leaves.append(e)
    return leaves


def _is_comm(e: Mapping[str, Any]) -> bool:
    name = str(e.get("name", ""))
    args = _mapping(e.get("args"))
    return (
        bool(_NCCL_NAME.match(name)) or "Collective name" in args or name.startswith(_GLOO) or name.startswith("c10d::")
    )


def _lanes(units: list[dict[str, Any]], by_device: bool) -> dict[Any, list[tuple[float, float]]]:
    lanes: dict[Any, list[tuple[float, float]]] = {}
    for e in units:
        args = _mapping(e.get("args"))
        device = args.get("device")
        key = (device if isinstance(device, int) else e.get("pid")) if by_device else (e.get("pid"), e.get("tid"))
        lanes.setdefault(key, []).append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    return lanes


def _busy(lanes: dict[Any, list[tuple[float, float]]]) -> tuple[float, int, float]:
    """Union of intervals per lane, summed: (busy us, idle gaps, idle us between first and last)."""
    busy = idle = 0.0
    gaps = 0
    for intervals in lanes.values():
        intervals.sort()
        cur_s, cur_e = intervals[0]
        for s, e in intervals[1:]:
            if s > cur_e:
                busy += cur_e - cur_s
                idle += s - cur_e
                gaps += 1
                cur_s, cur_e = s, e
            elif e > cur_e:
                cur_e = e
        busy += cur_e - cur_s
    return busy, gaps, idle


def _percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    i = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[i]


def _durations(values: list[float]) -> DurationStats:
    values.sort()
    total = math.fsum(values)  # (fsum: sum() rounds differently from Python 3.12 on)
    histogram: list[tuple[float | None, int, float]] = []
    lo = 0
    for edge in BUCKETS_US:
        hi = bisect.bisect_left(values, edge)
        histogram.append((float(edge), hi - lo, math.fsum(values[lo:hi])))
        lo = hi
    histogram.append((None, len(values) - lo, math.fsum(values[lo:])))
    under = {}
    for t in TINY_THRESHOLDS_US:
        k = bisect.bisect_left(values, t)
        under[t] = (k, math.fsum(values[:k]) / total if total else 0.0)
    return DurationStats(
        count=len(values),
        total_us=total,
        p10_us=_percentile(values, 0.1),
        p50_us=_percentile(values, 0.5),
        p90_us=_percentile(values, 0.9),
        p99_us=_percentile(values, 0.99),
        max_us=values[-1] if values else None,
        histogram=histogram,
        under=under,
    )


def _top(units: list[dict[str, Any]]) -> list[KernelSummary]:
    by_name: dict[str, list[float]] = {}
    for e in units:
        by_name.setdefault(str(e.get("name", "?")), []).append(float(e["dur"]))
    ordered = sorted(by_name.items(), key=lambda kv: -math.fsum(kv[1]))[:TOP_KERNELS]
    return [
        KernelSummary(name=n, count=len(d), total_us=math.fsum(d), median_us=statistics.median(d), max_us=max(d))
        for n, d in ordered
    ]


def _steps(spans: list[dict[str, Any]]) -> list[tuple[str, float]]:
    steps = [
        (str(e["name"]), float(e["dur"]))
        for e in spans
        if str(e.get("name", "")).startswith(("ProfilerStep#", "lorascope.step#"))
        and e.get("cat") in ("user_annotation", "cpu_op", None)
    ]
    return sorted(set(steps), key=lambda s: s[0])


def _opt_int(value: Any) -> int | None:
    if isinstance(value, str) and value.strip().isdigit() and len(value.strip()) <= 20:
        return int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _group_ranks(value: Any) -> list[int] | None:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return value
    return None


def _collectives(events: list[dict[str, Any]]) -> list[Collective]:
    out = []
    for e in events:
        name = str(e.get("name", ""))
        args = _mapping(e.get("args"))
        ts, dur = float(e["ts"]), float(e["dur"])
        if "Collective name" in args:
            out.append(
                Collective(
                    op=str(args["Collective name"]),
                    ts_us=ts,
                    dur_us=dur,
                    in_nelems=_opt_int(args.get("In msg nelems")),
                    out_nelems=_opt_int(args.get("Out msg nelems")),
                    dtype=str(args["dtype"]) if args.get("dtype") is not None else None,
                    group=str(args.get("Process Group Name")) if args.get("Process Group Name") is not None else None,
                    group_ranks=_group_ranks(args.get("Process Group Ranks")),
                    group_size=_opt_int(args.get("Group size")),
                    source="kernel args",
                )
            )
        elif m := _NCCL_NAME.match(name):
            out.append(Collective(op=m.group(1).lower(), ts_us=ts, dur_us=dur, source="kernel name"))
        elif name.startswith(_GLOO):
            dims = args.get("Input Dims")
            types = args.get("Input type")
            out.append(
                Collective(
                    op=name[len(_GLOO) :],
                    ts_us=ts,
                    dur_us=dur,
                    in_nelems=_nelems(dims[0]) if isinstance(dims, list) and dims else None,
                    dtype=str(types[0]) if isinstance(types, list) and types else None,
                    source="gloo range",
                )
            )
    out.sort(key=lambda c: c.ts_us)
    return out


def _nelems(dims: Any) -> int | None:
    if not isinstance(dims, list) or not all(isinstance(d, int) for d in dims):
        return None
    n = 1
    for d in dims:
        n *= d
    return n
