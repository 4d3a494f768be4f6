"""The per-rank reduction (lorascope/rundir/loading/reduce.py, align.py): with bounds far below a
recorded run's size, the analysis and the report say what they say when everything is
kept; a divergence in the middle of a run is found by the digests and read again; the
worker pool reads what the serial path reads."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lorascope.analysis import analyze
from lorascope.detect.common import peak_memory
from lorascope.detect.hang.divergence import first_divergence
from lorascope.report.data import build_report_data
from lorascope.rundir.format.layout import CALL, CALL_FIELDS, HEADER, STEP_END, STEP_KINDS, offset_of, slot_of
from lorascope.rundir.format.writer import Stream, stream_prefix
from lorascope.rundir.loading import align, callreduce, reader, reduce, workers
from lorascope.rundir.loading.calls import STEPS, read_calls
from lorascope.rundir.loading.reader import load_run
from lorascope.rundir.loading.reduce import StepKeeper
from lorascope.rundir.loading.steps import backward_spans_of
from tests.helpers import FIXTURES, Steps

RUNS = sorted(p.parent.name for p in FIXTURES.glob("*/manifest.json"))


def tight(monkeypatch: pytest.MonkeyPatch, steps: int = 10_000, least: int = 64) -> None:
    """Bounds a recorded fixture exceeds: 8 first calls, 64 newest, windows of 16."""
    for module in (reduce, callreduce):
        monkeypatch.setattr(module, "HEAD_CALLS", 8)
        monkeypatch.setattr(module, "TAIL_CALLS", 64)
        monkeypatch.setattr(module, "WINDOW", 16)
    monkeypatch.setattr(align, "WINDOW", 16)
    monkeypatch.setattr(reduce, "STEP_BUDGET", steps)
    monkeypatch.setattr(reduce, "MIN_STEPS_KEPT", least)


def outcome(path: Path) -> tuple[str, str]:
    """``analyze --json`` and the report's data, but the blame per collective: it counts
    the calls kept (docs/architecture.md, what changes past the bounds)."""
    analysis = analyze(path)
    report = build_report_data(analysis.bundle, analysis.findings, analysis.summary)
    data = analysis.to_data()
    for pace in (data["pace"], report["charts"].get("pace")):
        if pace is not None:
            pace.pop("blame")
    return (
        json.dumps(data, sort_keys=True, default=str),
        json.dumps(report, sort_keys=True, default=str),
    )


@pytest.mark.parametrize("name", RUNS)
def test_tight_bounds_change_no_output(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    whole = outcome(FIXTURES / name)
    tight(monkeypatch)
    run = load_run(FIXTURES / name)
    kept = {n: len(r.collectives) for n, r in run.ranks.items()}
    assert all(kept[n] < r.collectives_total for n, r in run.ranks.items()), kept  # it did reduce
    assert outcome(FIXTURES / name) == whole


def _plant_mismatch(dst: Path, seq: int) -> None:
    """Rank 1's call ``seq`` of the default group becomes a broadcast (its size kept): a
    new shape, its call record names it."""
    shutil.copytree(FIXTURES / "healthy", dst)
    [stream] = (dst / "ranks" / "rank-1").glob("*.jsonl")
    [path] = (dst / "ranks" / "rank-1").glob("*.calls")
    records = [json.loads(line) for line in stream.read_text().splitlines()]
    gid = next(r["gid"] for r in records if r["k"] == "group" and r["name"] == "default_pg")
    shapes = {r["id"]: r for r in records if r["k"] == "shape"}
    calls = read_calls(path, "rank 1", [])
    [at] = [
        i
        for i, (g, s) in enumerate(zip(calls.records["gid"], calls.records["seq"], strict=True))
        if (g, s) == (gid, seq)
    ]
    new = max(shapes) + 1
    shape = {**shapes[int(calls.records["shape"][at])], "id": new, "op": "broadcast"}
    with stream.open("a") as f:
        f.write(json.dumps(shape, separators=(",", ":")) + "\n")
    slot = slot_of(int(calls.index[at]), calls.head, calls.ring)
    with path.open("r+b") as f:
        f.seek(HEADER.size + slot * CALL.size + offset_of(CALL_FIELDS, "shape"))
        f.write(new.to_bytes(4, "little"))


def test_a_divergence_mid_run_is_found_by_its_window(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _plant_mismatch(tmp_path / "run", 200)
    whole = load_run(tmp_path / "run")
    found = first_divergence(whole)
    assert found is not None and (found.group, found.seq) == ("default_pg", 200)
    expected = outcome(tmp_path / "run")
    tight(monkeypatch)
    reduced = load_run(tmp_path / "run")
    assert all(not r.tallies["default_pg"].holds(190, 210) for r in reduced.ranks.values())  # dropped by the bounds
    again = first_divergence(reduced)
    assert again is not None and (again.group, again.seq) == ("default_pg", 200)
    assert outcome(tmp_path / "run") == expected


@pytest.fixture
def pools(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Every stream read in a pool however small the run; the sizes of the pools started.
    The configured number of workers is reset after."""
    sizes: list[int] = []

    class Recorded(ProcessPoolExecutor):
        def __init__(self, max_workers: int, **kwargs: Any) -> None:
            sizes.append(max_workers)
            super().__init__(max_workers, **kwargs)

    monkeypatch.setattr(reader, "POOL_MIN_BYTES", 0)
    monkeypatch.setattr(reader, "ProcessPoolExecutor", Recorded)
    yield sizes
    workers.configure(None)


def test_the_worker_pool_reads_what_one_process_reads(pools: list[int]) -> None:
    workers.configure(1)
    serial = outcome(FIXTURES / "rank-conditional-hang")
    assert pools == []
    workers.configure(2)
    assert outcome(FIXTURES / "rank-conditional-hang") == serial
    assert pools == [2]


def test_the_configured_workers_are_the_pools_size(pools: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """`lorascope --workers N`: at most N workers, one per stream at most, none for 1."""
    monkeypatch.setattr(workers.os, "cpu_count", lambda: 1)
    load_run(FIXTURES / "healthy")
    assert pools == []  # one core: read in the calling process
    workers.configure(8)
    load_run(FIXTURES / "healthy")
    assert pools == [2]  # asked for: on one core too; two streams, two workers
    monkeypatch.setattr(workers.os, "cpu_count", lambda: 8)
    workers.configure(1)
    load_run(FIXTURES / "healthy")
    assert pools == [2]
    with pytest.raises(ValueError, match="at least 1"):
        workers.configure(0)


def test_the_workers_flag_and_its_variable() -> None:
    def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "lorascope", *args], capture_output=True, text=True, timeout=120, env=env
        )

    default = cli("analyze", "--json", str(FIXTURES / "rank-conditional-hang"))
    one = cli("--workers", "1", "analyze", "--json", str(FIXTURES / "rank-conditional-hang"))
    assert default.returncode == one.returncode == 0 and one.stdout == default.stdout
    bad = cli("analyze", str(FIXTURES / "healthy"), env={**os.environ, "LORASCOPE_WORKERS": "0"})
    assert bad.returncode == 2 and "Invalid value for '--workers'" in bad.stderr and "Traceback" not in bad.stderr


def test_the_ranks_share_each_groups_member_list(pools: list[int]) -> None:
    """Every rank records the member ranks of its groups: one list a group, read in
    the calling process or by workers."""
    for n in (1, 2):
        workers.configure(n)
        members: dict[str, list[Any]] = {}
        for rank in load_run(FIXTURES / "healthy").ranks.values():
            for group in rank.groups.values():
                members.setdefault(group["name"], []).append(group["ranks"])
        assert members and all(len(ls) == 2 and ls[0] == [0, 1] and ls[0] is ls[1] for ls in members.values())
    assert pools == [2]


def test_a_bad_stream_in_a_worker_is_one_line(tmp_path: Path, pools: list[int]) -> None:
    shutil.copytree(FIXTURES / "healthy", tmp_path / "run")
    [stream] = (tmp_path / "run" / "ranks" / "rank-1").glob("*.jsonl")
    stream.write_text("not json\n" + stream.read_text())
    workers.configure(2)
    with pytest.raises(reader.BadInputError, match=r"rank-1/.*:1: not a JSON record"):
        load_run(tmp_path / "run")


def test_step_records_past_the_budget_keep_first_last_strided_and_peaks(monkeypatch: pytest.MonkeyPatch) -> None:
    whole = load_run(FIXTURES / "rank0-asymmetry")
    tight(monkeypatch, steps=8, least=4)  # 2 ranks: 4 steps each, of 8
    run = load_run(FIXTURES / "rank0-asymmetry")
    for n, rank in run.ranks.items():
        steps = [s["step"] for s in rank.steps]
        assert rank.stride == 4 and steps == [1, 4, 8], steps
        assert len(rank.mem) < len(whole.ranks[n].mem) and len(rank.phases) < len(whole.ranks[n].phases)
        assert peak_memory(rank) == peak_memory(whole.ranks[n])
        assert rank.totals == whole.ranks[n].totals  # counted over every record read
        for sums in ("coll_wait", "coll_wait_outside_backward"):  # per step: of the kept steps, as they were
            kept = {k: v for k, v in getattr(whole.ranks[n], sums).items() if k in steps or k > max(steps)}
            assert getattr(rank, sums) == kept and len(kept) < len(getattr(whole.ranks[n], sums)), sums


_VALUES = st.one_of(
    st.integers(-(2**40), 2**40), st.floats(allow_nan=False), st.booleans(), st.none(), st.text(max_size=3),
    st.lists(st.integers(), max_size=2),
)  # fmt: skip
_FIELDS = st.sampled_from(["t", "step", "rss", "heap", "bytes", "where", "cuda", "nvml"])
_RECORDS = st.lists(
    st.dictionaries(
        _FIELDS,
        st.one_of(_VALUES, st.dictionaries(st.sampled_from(["used", "total", "reserved", "t"]), _VALUES, max_size=3)),
        max_size=4,
    ),
    max_size=10,
)


# nested records can overrun Hypothesis's per-example data budget: not the code under test
@settings(suppress_health_check=[HealthCheck.data_too_large])
@given(records=_RECORDS, by=st.sampled_from([None, "where"]))
def test_peaks_are_the_records_holding_each_fields_highest_value(records: list[dict[str, Any]], by: Any) -> None:
    """``_peaks`` (a loop per field, for speed) against its definition: per (``by`` value,
    numeric field of the record or of a nested object, a nested object's used/total share)
    the first record holding the highest value; ``t``, ``step`` and bools are not values."""
    for rec in records:  # a logits record's "where" is a string (the schema's)
        if "where" in rec:
            rec["where"] = repr(rec["where"])[:2]
    best: dict[tuple[Any, str], tuple[float, int]] = {}
    for i, rec in enumerate(records):
        for name, value in reduce._numbers(rec):
            key = (rec.get(by) if by else None, name)
            if key not in best or value > best[key][0]:
                best[key] = (value, i)
    assert reduce._peaks(records, by) == {i for _, i in best.values()}


def test_kept_steps() -> None:
    assert reduce.kept_steps(range(1, 11), 16) == (1, set(range(1, 11)))
    stride, kept = reduce.kept_steps(range(1, 101), 16)
    assert stride == 16 and kept == {1, 2, 3, 4, 16, 32, 48, 64, 80, 96, 97, 98, 99, 100}
    assert reduce.kept_steps(range(1, 101), 16, stride=32)[1] == {1, 2, 3, 4, 32, 64, 96, 97, 98, 99, 100}


def test_a_collective_pickles_as_its_fields() -> None:
    """Workers send thousands a rank to the parent: as a tuple of its fields, loaded equal."""
    import dataclasses
    import pickle

    from lorascope.rundir.loading.reader import Collective

    calls = [
        Collective(7, "default_pg", "all_reduce", 64, "float32", True, "/j/t.py:3 in f", 2, 1.5, 2.5, "E", 0.3, "v"),
        Collective(8, "1", "barrier", None, None, False, None, 0, 3.0),
    ]
    for call in calls:
        assert call.__reduce__() == (Collective, tuple(getattr(call, f.name) for f in dataclasses.fields(call)))
    loaded = pickle.loads(pickle.dumps(calls, protocol=pickle.HIGHEST_PROTOCOL))
    assert loaded == calls and loaded[0].pending is False and loaded[1].pending is True


_COUNT = st.integers(0, 2**40)


@st.composite
def _step_keyed(draw: st.DrawFn) -> list[dict[str, Any]]:
    """A rank's step-keyed records: steps mostly in order, now and then one repeated,
    skipped or going back; readings with and without the heap or CUDA figures, phase edges
    of backward and other phases, logits of two places, and a loss read after its step."""
    out: list[dict[str, Any]] = []
    step, t = 0, 1.0
    for _ in range(draw(st.integers(0, 160))):
        t += 0.5
        step = max(0, step + draw(st.sampled_from([1] * 8 + [0, 3, -5])))
        what = draw(st.sampled_from(["step", "step", "mem", "mem", "mem", "phase", "phase", "logits", "loss"]))
        on = step + draw(st.sampled_from([0, 0, 0, 1, -1]))  # a record of the step in progress, or off by one
        if what == "step":
            loss = draw(st.one_of(st.none(), st.floats(0, 10)))
            out.append({"step": step, "dur": draw(st.sampled_from([0.5, 0.0, 1, 0.25])), "loss": loss, "src": "x"})
        elif what == "mem":
            rec: dict[str, Any] = {"src": "step", "step": on, "rss": draw(st.one_of(st.none(), _COUNT))}
            more = draw(st.sampled_from(["heap", "cuda", "none"]))
            if more == "heap":
                rec["heap"] = draw(_COUNT)
            elif more == "cuda":
                rec["cuda"] = {"device": 0, "alloc": draw(_COUNT), "reserved": draw(_COUNT), "max_alloc": draw(_COUNT)}
            out.append(rec)
        elif what == "phase":
            name = draw(st.sampled_from(["backward", "backward", "forward"]))
            out.append({"name": name, "edge": draw(st.sampled_from(["begin", "end"])), "step": on})
        elif what == "logits":
            where = draw(st.sampled_from(["lm_head_output", "loss_input"]))
            out.append({"where": where, "step": on, "shape": [2, 3], "dtype": "f", "bytes": draw(st.integers(0, 99))})
        else:
            out.append({"step": on, "loss": draw(st.floats(0, 10))})
        out[-1].update(k=what, t=t)
    return out


@settings(max_examples=100, deadline=None)
@given(records=_step_keyed(), budget=st.integers(1, 24))
def test_reading_within_a_budget_keeps_what_decimation_keeps(records: list[dict[str, Any]], budget: int) -> None:
    """A rank's steps, phase edges and readings (in its steps and memory files) and logits
    (in its stream), read within a step budget (dropping on the way, StepKeeper.prune after
    every record it holds): the kept records, peaks, stride, totals and time outside
    backward are those of the whole rank read, then decimated."""
    with tempfile.TemporaryDirectory() as tmp:
        prefix = stream_prefix(Path(tmp), 0, "vm", 7)
        stream = Stream(prefix)
        stream.write({"k": "start", "rank": 0, "world_size": 1, "local_rank": 0, "pid": 7, "host": "vm",
                      "argv": ["train.py"], "versions": {}, "device": "cpu", "t": 0.5})  # fmt: skip
        files = Steps(stream, prefix, 0.5)
        for rec in records:
            if rec["k"] in ("step", "phase", "mem"):
                files.record(rec)
            else:
                stream.write(rec)
        stream.close()
        [path] = prefix.parent.glob("*.jsonl")
        whole = reader._Stream(0, [], 1 << 62)
        whole.read([(0, path)])
        a = whole.finish(path, 1 << 62, None)
        with mock.patch.object(reduce, "PRUNE_RECORDS", 0):
            within = reader._Stream(0, [], budget)
            within.read([(0, path)])
            b = within.finish(path, budget, None)
    assert a.totals["mem"] == sum(rec["k"] == "mem" for rec in records)  # every reading counted, made or not
    a.stride = reduce.decimate(a, budget)
    for name in ("mem", "phases", "steps", "logits", "stride", "totals", "coll_wait_outside_backward"):
        assert json.dumps(getattr(a, name), default=str) == json.dumps(getattr(b, name), default=str), name


def test_a_long_run_is_read_into_about_its_budget_of_records(tmp_path: Path) -> None:
    """3,000 steps (a step, three readings and two phase edges each, in the steps and
    memory files) read with a budget of 16 steps: only the records decimation keeps are
    made (the peaks among them), every reading is counted and every backward edge seen."""
    prefix = stream_prefix(tmp_path, 0, "vm", 7)
    stream = Stream(prefix)
    stream.write({"k": "start", "rank": 0, "world_size": 1, "local_rank": 0, "pid": 7, "host": "vm",
                  "argv": ["train.py"], "versions": {}, "device": "cpu", "t": 0.5})  # fmt: skip
    files = Steps(stream, prefix, 0.5)
    t = 1.0
    for step in range(1, 3001):
        files.phase(t, "backward", "begin", step)
        files.reading({"t": t, "src": "backward.begin", "step": step, "rss": 100 + step % 7, "heap": 9})
        files.phase(t + 0.1, "backward", "end", step)
        files.reading({"t": t + 0.1, "src": "sampler", "step": step, "rss": 100, "heap": 9})
        files.step(t + 0.2, step + 1, 0.5, 1.0, "x")
        files.reading({"t": t + 0.2, "src": "step", "step": step + 1, "rss": 100, "heap": 9})
        t += 1.0
    stream.close()
    [path] = prefix.parent.glob("*.jsonl")
    read = reader._Stream(0, [], 16)
    read.read([(0, path)])
    data = read.finish(path, 16, None)
    stride, kept = reduce.kept_steps(range(2, 3002), 16)
    assert data.totals["mem"] == 9000 and data.stride == stride == 512
    assert [s["step"] for s in data.steps] == sorted(kept)
    assert {m["step"] for m in data.mem} == set(kept) | {1, 6}  # the peaks: the first heap of 9, RSS of 106
    assert len(data.mem) < 100 and len(data.phases) < 100
    assert len(read.spans) == 3000


def test_a_windows_digest_is_its_calls_in_any_order() -> None:
    """The digest of a window is its calls' (seq, op, bytes[, dtype]), however they were
    read (a call two windows late counts too); a change of op or size changes both
    aspects, of the dtype only the second; nothing else of a call counts."""
    from lorascope.rundir.loading.reader import Collective

    def digests(calls: list[tuple[int, str, int | None, str | None]], start: float = 1.0) -> dict[int, Any]:
        log = reduce.CollectiveLog()
        for seq, op, size, dtype in calls:
            log.add(Collective(seq, "g", op, size, dtype, False, "a.py:1", 0, start + seq, start + seq + 1))
        log.finish()
        return log.tallies["g"].digests

    w = reduce.WINDOW
    calls = [
        (s, "all_reduce" if s % 3 else "broadcast", None if s % 7 == 0 else 8 * s, "float32") for s in range(1, 4 * w)
    ]
    whole = digests(calls)
    assert sorted(whole) == [0, 1, 2, 3]
    late = calls[1 : 3 * w] + [calls[0]] + calls[3 * w :]  # seq 1 read after window 2 began
    assert digests(late) == digests(calls[::-1]) == digests(calls, start=50.0) == whole
    for i, change, aspects in [(5, (6, "all_gather", 48, "float32"), {0, 1}), (5, (6, "all_reduce", 49, "float32"), {0, 1}),
                               (301, (302, "all_reduce", 2416, "bfloat16"), {1}), (6, (7, "all_reduce", 0, "float32"), {0, 1})]:  # fmt: skip
        changed = digests(calls[:i] + [change] + calls[i + 1 :])
        index = (change[0] - 1) // w
        assert {a for a in (0, 1) if changed[index][a] != whole[index][a]} == aspects, change
        assert {k: v for k, v in changed.items() if k != index} == {k: v for k, v in whole.items() if k != index}


def _first_differing_by_definition(tallies: dict[int, reduce.GroupTally], aspect: int) -> int | None:
    """align._first_differing as it was written first: window by window, every rank."""
    for index in sorted({i for t in tallies.values() for i in t.digests}):
        done = [t for t in tallies.values() if t.last_seq >= (index + 1) * reduce.WINDOW]
        if len({(d[aspect] if (d := t.digests.get(index)) else None) for t in done}) > 1:
            return index
    return None


_DIGEST = st.tuples(st.integers(0, 2), st.sampled_from([0, 1, 2**64 - 1]))


@settings(max_examples=400, deadline=None)
@given(
    base=st.dictionaries(st.integers(-2, 14), _DIGEST, max_size=14),
    ranks=st.lists(
        st.tuples(
            st.integers(0, 16 * reduce.WINDOW),  # last sequence number
            st.sets(st.integers(-2, 14), max_size=3),  # windows it does not hold
            st.dictionaries(st.integers(-2, 16), _DIGEST, max_size=3),  # and holds otherwise
        ),
        min_size=1,
        max_size=5,
    ),
)
def test_the_first_differing_window_is_the_one_defined(
    base: dict[int, tuple[int, int]], ranks: list[tuple[int, set[int], dict[int, tuple[int, int]]]]
) -> None:
    """Each rank's digests compared as arrays with the furthest rank's find the window
    comparing every rank's, window by window, finds; so does a pickled copy."""
    tallies = {}
    for n, (last, missing, changed) in enumerate(ranks):
        tally = tallies[n] = reduce.GroupTally(last_seq=last)
        for window, (op_size, full) in ({**base, **changed}).items():
            if window not in missing:
                tally.add_to_digest(window, op_size, full)
    copies = {n: pickle.loads(pickle.dumps(t)) for n, t in tallies.items()}
    for aspect in (0, 1):
        expected = _first_differing_by_definition(tallies, aspect)
        assert align._first_differing(tallies, aspect) == align._first_differing(copies, aspect) == expected


def test_digests_are_held_as_arrays_and_added_to_again() -> None:
    tally = reduce.GroupTally()
    for window in range(1000, 0, -1):
        tally.add_to_digest(window, window, 2**64 - window)
    index, op_size, full = tally.digests.columns()
    assert list(index) == list(range(1, 1001)) and op_size[0] == 1 and full[-1] == 2**64 - 1000
    held = sum(sys.getsizeof(a) for a in (index, op_size, full))
    assert held < 25 * 1000 + 300, held  # a dict of tuples held ~230 bytes a window
    copy = pickle.loads(pickle.dumps(tally))
    assert copy == tally and len(pickle.dumps(tally.digests)) < 25 * 1000 + 300
    copy.add_to_digest(1, 2**64 - 1, 1)  # read on after it was held: open again
    assert copy.digests[1] == (0, 0) and copy.digests[2] == tally.digests[2] and copy != tally
    assert dict(copy.digests) == {**dict(tally.digests), 1: (0, 0)}


def test_the_cycle_collector_is_off_while_ranks_are_taken_in_detected_and_reported_and_back_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gc

    import lorascope.analysis
    import lorascope.report.data

    seen: list[tuple[str, bool]] = []
    for owner, name in (
        (reader, "_align"),
        (lorascope.analysis, "run_detectors"),
        (lorascope.report.data, "_report_data"),
    ):
        real = getattr(owner, name)

        def spy(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            seen.append((_name, gc.isenabled()))
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, spy)
    assert gc.isenabled()
    analysis = analyze(FIXTURES / "healthy")
    build_report_data(analysis.bundle, analysis.findings, analysis.summary)
    assert seen == [("_align", False), ("run_detectors", False), ("_report_data", False)] and gc.isenabled()
    gc.disable()
    try:
        analyze(FIXTURES / "healthy")
        assert not gc.isenabled()  # someone else's setting is left as it was
    finally:
        gc.enable()


def test_the_first_divergence_is_found_once_a_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three detectors ask for it; it is computed once, and a run loaded again is new."""
    from lorascope.detect.hang import divergence

    _plant_mismatch(tmp_path / "run", 200)
    found: list[Any] = []
    real = divergence._first_divergence
    monkeypatch.setattr(divergence, "_first_divergence", lambda run: found.append(real(run)) or found[-1])
    analysis = analyze(tmp_path / "run")
    assert len(found) == 1 and found[0] is not None and (found[0].group, found[0].seq) == ("default_pg", 200)
    assert {f.id for f in analysis.findings} & {"collective-mismatch", "rank-conditional-hang"}
    assert first_divergence(analysis.bundle.run) is found[0]  # type: ignore[arg-type]
    first_divergence(load_run(tmp_path / "run"))
    assert len(found) == 2


def test_a_ranks_kept_records_and_calls_share_their_values() -> None:
    """One object a distinct string or integer of the kept records, and of the kept calls'
    sizes and steps (a rank's summary pickles each once); the same records."""
    run = load_run(FIXTURES / "healthy")
    shared = {str: 0, int: 0}
    for rank in run.ranks.values():
        seen: dict[Any, Any] = {}
        values = [v for rec in [*rank.mem, *rank.phases, *rank.steps, *rank.logits] for v in rec.values()]
        values += [v for c in rank.collectives for v in (c.bytes, c.step)]
        for value in values:
            if type(value) in shared and (type(value) is str or value > 256):  # smaller ints are one object anyway
                shared[type(value)] += value in seen
                assert seen.setdefault(value, value) is value
    assert shared[str] > 100 and shared[int] > 500, shared


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(min_value=-50, max_value=5000), max_size=300),
    st.lists(st.integers(min_value=-50, max_value=5000), max_size=30),
    st.integers(min_value=4, max_value=120),
)
def test_step_numbers_noted_at_once_are_kept_as_noted_one_by_one(
    first: list[int], later: list[int], budget: int
) -> None:
    """A steps file's numbers go into an empty keeper at once; what it holds after (and
    after more numbers come) is what noting them one by one, in any order, holds."""
    at_once, one_by_one = StepKeeper(budget), StepKeeper(budget)
    at_once.note_steps(first)
    for step in reversed(first):
        one_by_one._number(step)
    at_once.note_steps(later)
    one_by_one.note_steps(later)
    assert list(at_once.numbers) == list(one_by_one.numbers)
    assert at_once._multiples == one_by_one._multiples


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.integers(-1, 6), st.sampled_from([0, 1])),  # kind, step, label
        max_size=80,
    )
)
def test_backward_spans_of_a_steps_table_are_those_of_its_edges_one_by_one(
    rows: list[tuple[int, int, int]],
) -> None:
    """The steps file's backward spans, paired with numpy, are what pairing its phase
    edges one at a time gives (begins replaced, ends without a begin, other phases, step
    records among them), in the same order."""
    labels = {0: "backward", 1: "forward"}
    table = np.zeros(len(rows), dtype=STEPS.dtype)
    for i, (kind, step, label) in enumerate(rows):
        table[i] = (100.0 + i, 0.0, np.nan, 0.0, step, label, kind, 0)
    edges: list[Any] = [
        {"name": labels[label], "edge": STEP_KINDS[kind], "step": step, "k": "phase", "t": 100.0 + i}
        for i, (kind, step, label) in enumerate(rows)
        if kind < STEP_END
    ]
    got = backward_spans_of(table, labels)
    assert list(got.items()) == list(reduce.backward_spans(edges).items())


def _kept_one_by_one(steps: list[int], budget: int, stride: int | None) -> tuple[int, set[int]]:
    """kept_steps as its docstring says it, a step at a time (the oracle)."""
    ordered = sorted(set(steps))
    if stride is None and len(ordered) <= budget:
        return 1, set(ordered)
    edge = budget // 4
    head, tail = set(ordered[:edge]), set(ordered[-edge:]) if edge else set()
    middle = ordered[edge : len(ordered) - edge]
    if stride is None:
        stride = 1
        while sum(1 for s in middle if s % stride == 0) > budget - 2 * edge:
            stride *= 2
    if stride == 1:
        return 1, set(ordered)
    return stride, head | tail | {s for s in middle if s % stride == 0}


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(min_value=-20, max_value=3000), max_size=400),
    st.integers(min_value=1, max_value=80),
    st.sampled_from([None, 1, 2, 8, 64]),
)
def test_kept_steps_are_those_counted_one_by_one(steps: list[int], budget: int, stride: int | None) -> None:
    assert reduce.kept_steps(steps, budget, stride) == _kept_one_by_one(steps, budget, stride)
