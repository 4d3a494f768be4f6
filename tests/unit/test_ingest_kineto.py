"""Kineto traces: the real GPU traces in ../shared/real-traces (CUDA with and without
collective args, ROCm) and the CPU trace of the recorded healthy run. Expected numbers
are counted here from the raw JSON, not hard-coded."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from lorascope.analysis.artifacts import artifacts_data
from lorascope.errors import BadInputError
from lorascope.ingest.kineto import salvage
from lorascope.ingest.kineto.compare import STRAGGLER_RATIO, compare_traces
from lorascope.ingest.kineto.hta import hta_available, hta_figures
from lorascope.ingest.kineto.reader import analyse_trace, read_trace
from lorascope.ingest.load import load_bundle
from lorascope.text.artifacts import render_artifacts
from tests.helpers import REAL_TRACES

REAL = REAL_TRACES
CPU_TRACE = next(
    (Path(__file__).resolve().parents[2] / "fixtures" / "healthy" / "ranks" / "rank-0").glob("*.trace.json.gz")
)
needs_real = pytest.mark.skipif(
    not REAL.is_dir(), reason=f"{REAL_TRACES} is absent (the real GPU traces are kept beside the repository)"
)


def _raw(path: Path) -> dict[str, Any]:
    with gzip.open(path) as f:
        return json.load(f)


def _kernels(raw: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in raw["traceEvents"] if e.get("cat") == "kernel" and e.get("ph") == "X"]


@needs_real
@pytest.mark.parametrize(
    "name", ["128rank-job.rank-0.json.gz", "128rank-job.rank-1.json.gz", "a100-nccl-collective-args.rank-0.json.gz"]
)
def test_cuda_traces(name: str) -> None:
    raw = _raw(REAL / name)
    trace = read_trace(REAL / name)
    kernels = _kernels(raw)
    assert (trace.rank, trace.world_size, trace.backend) == (
        raw["distributedInfo"]["rank"],
        raw["distributedInfo"]["world_size"],
        "nccl",
    )
    assert trace.device == "cuda" and trace.unit == "kernel"
    assert trace.durations.count == len(kernels)
    assert trace.durations.total_us == pytest.approx(sum(e["dur"] for e in kernels))
    under5 = [e["dur"] for e in kernels if e["dur"] < 5]
    assert trace.durations.under[5.0][0] == len(under5)
    nccl = [e for e in kernels if e["name"].startswith("nccl")]
    assert len(trace.collectives) == len(nccl)
    with_args = [e for e in nccl if "Collective name" in e["args"]]
    assert sum(c.source == "kernel args" for c in trace.collectives) == len(with_args)
    if with_args:
        c = next(c for c in trace.collectives if c.source == "kernel args")
        e = next(e for e in with_args if e["ts"] == c.ts_us)
        assert (c.op, c.in_nelems, c.dtype, c.group_ranks) == (
            e["args"]["Collective name"],
            e["args"]["In msg nelems"],
            e["args"]["dtype"],
            [0, 1],
        )
    steps = {e["name"] for e in raw["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")}
    assert {name for name, _ in trace.steps} == steps
    assert 0 < trace.busy_us <= trace.span_us and trace.comm_us > 0


@needs_real
def test_rocm_trace_without_rank() -> None:
    raw = _raw(REAL / "mi250-rocm.json.gz")
    trace = read_trace(REAL / "mi250-rocm.json.gz")
    assert trace.device == "rocm" and trace.rank is None and trace.durations.count == len(_kernels(raw))
    assert trace.collectives == []


def test_cpu_trace_uses_leaf_ops_and_gloo_ranges() -> None:
    raw = _raw(CPU_TRACE)
    trace = read_trace(CPU_TRACE)
    assert trace.device == "cpu" and trace.unit == "op" and trace.backend == "gloo" and trace.rank == 0
    ops = [e for e in raw["traceEvents"] if e.get("cat") == "cpu_op"]
    assert 0 < trace.durations.count < len(ops)  # leaves only
    gloo = [e for e in raw["traceEvents"] if str(e.get("name", "")).startswith("gloo:")]
    assert len(trace.collectives) == len(gloo)
    assert sum(n for n, _ in trace.collective_ops.values()) == len(gloo)


def test_busy_and_idle_are_summed_over_threads_and_say_so(tmp_path: Path) -> None:
    """Two threads' CPU ops in a 30 us trace: 20 + 10 us busy, 10 + 20 us idle (more than
    the trace's span, as the recorded CPU traces' idle is): the trace counts its lanes and
    the text says what the figures are summed over."""
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": ts, "dur": dur, "pid": 1, "tid": tid}
        for tid, ts, dur in [(1, 0, 10), (1, 20, 10), (2, 0, 5), (2, 25, 5)]
    ]
    path = tmp_path / "two.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    trace = read_trace(path)
    assert (trace.lanes, trace.busy_us, trace.idle_us, trace.idle_gaps, trace.span_us) == (2, 30.0, 30.0, 2, 30.0)
    [line] = [x for x in render_artifacts(artifacts_data(load_bundle(path))).splitlines() if " gaps" in x]
    assert "in 2 gaps (summed over 2 threads)" in line
    one = tmp_path / "one.trace.json"
    one.write_text(json.dumps({"traceEvents": events[:2]}))
    assert read_trace(one).lanes == 1
    assert "summed over" not in render_artifacts(artifacts_data(load_bundle(one)))


@needs_real
def test_straggler_rule_on_two_real_ranks() -> None:
    traces = {r: read_trace(REAL / f"128rank-job.rank-{r}.json.gz") for r in (0, 1)}
    cmp = compare_traces(traces)
    assert cmp is not None and cmp.world_size == 128 and [t.rank for t in cmp.ranks] == [0, 1]
    per_step = {t.rank: t.compute_us / t.steps for t in cmp.ranks}
    slow = max(per_step, key=per_step.__getitem__)
    ratio = per_step[slow] / per_step[1 - slow]
    least_comm = min(cmp.ranks, key=lambda t: t.comm_us).rank
    expected = slow if ratio >= STRAGGLER_RATIO and least_comm == slow else None
    assert cmp.straggler == expected and "2 of 128 ranks" in cmp.reason
    print(f"\nstraggler verdict on the real 2-of-128 pair: {cmp.reason}")


@needs_real
@pytest.mark.skipif(not hta_available(), reason="holistictraceanalysis is not installed")
@pytest.mark.filterwarnings("ignore")  # pandas/plotly deprecations inside HTA
def test_hta_figures_on_gpu_traces_and_its_refusal_of_cpu_ones() -> None:
    figures, note = hta_figures({r: REAL / f"128rank-job.rank-{r}.json.gz" for r in (0, 1)})
    assert note is None and set(figures) == {0, 1}
    assert all(f.launches_matched > 0 and 0 <= f.short_kernels <= f.launches_matched for f in figures.values())
    figures, note = hta_figures({0: CPU_TRACE})
    assert figures == {} and note is not None and note.startswith("HTA rejected")


@pytest.mark.parametrize(
    "data, message",
    [
        ({"traceEvents": []}, "without any timed event"),
        ({"schemaVersion": 1}, "not a Kineto trace"),
        ([1, 2], "not a Kineto trace"),
    ],
)
def test_not_a_trace(data: Any, message: str) -> None:
    with pytest.raises(BadInputError, match=message):
        analyse_trace(data, Path("t.json"))


def _text(path: Path) -> bytes:
    with gzip.open(path) as f:
        return f.read()


@pytest.mark.parametrize("share", [0.2, 0.5, 0.93])
def test_a_trace_cut_inside_its_events_is_read_as_far_as_it_goes(tmp_path: Path, share: float) -> None:
    """A trace whose JSON breaks off (the job killed while the profiler wrote it) keeps its
    head and every whole event before the cut, in order, none invented; said in a warning."""
    text = _text(CPU_TRACE)
    whole = json.loads(text)["traceEvents"]
    path = tmp_path / "cut.json"
    path.write_bytes(text[: int(len(text) * share)])
    trace = read_trace(path)
    events = trace.events
    assert events == whole[: len(events)] and len(events) < len(whole)
    assert len(events) >= len(whole) * share * 0.8  # the events before the cut, not a few of them
    assert trace.rank == 0 and trace.world_size == 2  # the head (distributedInfo) is kept
    assert any("breaks off inside its events" in w and f"{len(events):,} whole events" in w for w in trace.warnings)


def test_a_trace_cut_after_its_events_or_in_its_gzip_stream(tmp_path: Path) -> None:
    text = _text(CPU_TRACE)
    whole = json.loads(text)["traceEvents"]
    after = text.rindex(b"]") + 1  # the event list closed; what follows it is cut
    path = tmp_path / "after.json"
    path.write_bytes(text[: after + 3])
    trace = read_trace(path)
    assert trace.events == whole and any("after its events: all of them read" in w for w in trace.warnings)
    packed = gzip.compress(text)
    path = tmp_path / "cut.json.gz"
    path.write_bytes(packed[: len(packed) // 2])
    trace = read_trace(path)
    assert 0 < len(trace.events) < len(whole) and trace.events == whole[: len(trace.events)]
    assert "ends inside its compressed stream" in trace.warnings[0] and "inside its events" in trace.warnings[1]


@pytest.mark.parametrize(
    "text",
    [b'{"schemaVersion": 1, "deviceProperties": [{"id": 0, "na', b'{"other": [{"ph": "X", "ts": 1, "du', b"[1, 2"],
)
def test_a_cut_that_leaves_no_trace_is_still_an_error(tmp_path: Path, text: bytes) -> None:
    path = tmp_path / "t.json"
    path.write_bytes(text)
    with pytest.raises(BadInputError, match="is not valid JSON"):
        read_trace(path)


def test_a_trace_broken_in_its_middle_is_not_taken_for_a_cut_one(tmp_path: Path) -> None:
    """Bytes that break the JSON with megabytes of events after them are a broken file,
    not one cut short: the error stands (nothing is read as if the trace ended there)."""
    text = _text(CPU_TRACE)
    at = text.rindex(b"{", 0, text.index(b'"ph": "X"', len(text) // 5))  # an event's start
    path = tmp_path / "broken.json"
    path.write_bytes(text[:at] + b'{"ph": "X", "ts": 1,, ' + text[at:])
    assert len(text) - at > salvage.MAX_AFTER_CUT
    with pytest.raises(BadInputError, match="is not valid JSON"):
        read_trace(path)


def test_hta_failure_without_a_message_says_where() -> None:
    """HTA's own asserts carry no message: the line says where it failed instead of
    "AssertionError: " (what the GPU check's real trace read)."""
    from lorascope.ingest.kineto.hta import why_failed

    def breakdown() -> None:
        raise AssertionError  # what a bare assert raises (pytest would add a message to one here)

    try:
        breakdown()
    except AssertionError as exc:
        text = why_failed(exc)
    assert text.startswith("AssertionError: at tests/unit/test_ingest_kineto.py:") and "raise AssertionError" in text
    assert why_failed(ValueError("no GPU events")) == "ValueError: no GPU events"


def test_duration_sums_are_correctly_rounded_on_every_python() -> None:
    """Sums of kernel durations are ``math.fsum``'s: the builtin ``sum`` of floats rounds
    differently from Python 3.12 on (compensated), and the same trace then gave other last
    digits in `analyze --json` and the report on 3.11 than on 3.12. Here the naive sum of
    3.11 (1e16, then + 1.0 twice, each rounded away) is not the correctly rounded one."""
    from lorascope.detect.tiny_kernel_tail import _rank_stats
    from lorascope.ingest.kineto.reader import _durations, _top

    values = [1e16, 1.0, 1.0]
    exact = 1e16 + 2.0
    stats = _durations(list(values))
    assert stats.total_us == exact
    assert _top([{"name": "k", "dur": v} for v in values])[0].total_us == exact
    rows = [{"module": None, "durations_us": [1.0, 1.0, 1e16]}]
    assert _rank_stats({"rows": rows, "steps": 1}, 2.0)["tiny_time_share"] == 2.0 / exact


def test_with_a_run_the_traces_name_no_straggler_the_detectors_did_not() -> None:
    """A healthy run's two traced steps can single a rank out (read: "no problem found",
    then "straggler: rank 1 computes 2.33x the others' median per step"); the straggler is
    the detector's, read from every step: the traces' figure is told, not named so."""
    import dataclasses

    from lorascope.analysis import of_bundle
    from lorascope.detect.finding import Finding

    bundle = load_bundle(Path(__file__).resolve().parents[2] / "fixtures" / "healthy")
    assert bundle.trace_comparison is not None
    bundle.trace_comparison = dataclasses.replace(
        bundle.trace_comparison,
        straggler=1,
        reason="rank 1 computes 2.33x the others' median per step and waits least in collectives (9.0 ms)",
    )
    analysis = of_bundle(bundle)
    assert not [f for f in analysis.findings if f.id == "straggler"]
    text = render_artifacts(analysis.to_data()["artifacts"])
    assert "straggler:" not in text
    assert "no straggler over the run's steps" in text and "2.33x" in text
    named = Finding("straggler", "rank 1 is a straggler", "warning", "medium", "", [1], [], "", "")
    cmp = artifacts_data(bundle, [named])["trace_comparison"]
    assert cmp["straggler"] == 1
    assert "straggler: rank 1 computes 2.33x" in render_artifacts({"trace_comparison": cmp})
