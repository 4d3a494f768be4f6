"""The columnar reader (lorascope.rundir.loading.columnar) against the line-by-line one: every
stream it accepts must come out as the same RankData, field for field, with the same
warnings; the streams it declines are read line by line."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lorascope.errors import BadInputError
from lorascope.rundir.format import schema
from lorascope.rundir.loading import columnar, reader, reduce
from lorascope.rundir.loading.fastlines import FLAT_LAYOUTS
from lorascope.rundir.loading.reader import RankData

REPO = Path(__file__).resolve().parents[2]
STREAMS = sorted((REPO / "fixtures").glob("*/ranks/rank-*/*.jsonl"))
START = {
    "rank": 0, "world_size": 2, "local_rank": 0, "pid": 7, "ppid": 1, "host": "vm", "argv": ["train.py"],
    "versions": {}, "device": "cpu", "sample_interval": 0.5, "launch_id": "vm-1", "k": "start",
}  # fmt: skip
T0 = 1795945031.0


@contextmanager
def _mode(monkeypatch: pytest.MonkeyPatch, use: bool, block: int) -> Iterator[None]:
    with monkeypatch.context() as m:
        if use:
            m.setattr(columnar, "MIN_BYTES", 0)
            m.setattr(columnar, "BLOCK_BYTES", block)
        else:
            m.setattr(columnar, "available", lambda: False)
        yield


def _read(
    segs: list[tuple[int, Path]], windows: dict[str, list[tuple[int, int]]] | None = None, budget: int = 1 << 16
) -> Any:
    warnings: list[str] = []
    try:
        data = reader._load_process(0, segs, warnings, budget, windows)
    except BadInputError as exc:
        return ("error", str(exc))
    return _fields(data), warnings


def _fields(data: RankData) -> dict[str, Any]:
    """Every field, typed: ``1 == 1.0`` and dicts compare equal whatever their keys' order,
    but a record read as JSON has its keys in the line's order and its values' types."""
    out = {f.name: getattr(data, f.name) for f in dataclasses.fields(data)}
    out["collectives"] = [dataclasses.astuple(c) for c in data.collectives]
    # Sums per op or step, keyed in the order calls completed a block or a call at a time:
    # read by key, or sorted (lorascope.report.collectives, detect.straggler)
    for name in ("op_totals", "coll_wait", "coll_wait_outside_backward"):
        out[name] = sorted(getattr(data, name).items())
    return {name: _typed(value) for name, value in out.items()}


def _typed(value: Any) -> Any:
    if isinstance(value, dict):
        return [(key, _typed(item)) for key, item in value.items()]
    if isinstance(value, (list, tuple)):
        return [_typed(item) for item in value]
    return (type(value).__name__, value)


def _both(
    monkeypatch: pytest.MonkeyPatch,
    segs: list[tuple[int, Path]],
    block: int,
    windows: Any = None,
    budget: int = 1 << 16,
) -> tuple[Any, Any, str | None]:
    """Both readings, and why the columnar reader declined (None: it read the stream)."""
    with _mode(monkeypatch, False, block):
        lines = _read(segs, windows, budget)
    declined: list[str] = []
    real = columnar.read

    def spy(*args: Any) -> Any:
        try:
            return real(*args)
        except columnar.Unsuitable as exc:
            declined.append(str(exc))
            raise

    with _mode(monkeypatch, True, block):
        monkeypatch.setattr(columnar, "read", spy)
        columns = _read(segs, windows, budget)
        monkeypatch.setattr(columnar, "read", real)
    return lines, columns, declined[0] if declined else None


@pytest.mark.parametrize("block", [4 << 20, 24 << 10], ids=["one-block", "24KiB-blocks"])
@pytest.mark.parametrize("stream", STREAMS, ids=lambda p: f"{p.parts[-4]}-{p.parts[-2]}")
def test_probe_streams_read_the_same_both_ways(monkeypatch: pytest.MonkeyPatch, stream: Path, block: int) -> None:
    lines, columns, declined = _both(monkeypatch, [(0, stream)], block)
    assert declined is None
    assert columns == lines


@pytest.mark.parametrize("stream", STREAMS, ids=lambda p: f"{p.parts[-4]}-{p.parts[-2]}")
def test_column_wise_reading_needs_no_newer_polars_than_the_floor(
    monkeypatch: pytest.MonkeyPatch, stream: Path
) -> None:
    """polars 1.30 (pyproject's floor) to 1.33 refuse unsorted indices in ``Series.scatter``
    ("set indices must be sorted"), and the reader then fell back to line by line with a
    warning: with a scatter as strict, every stream still reads column-wise, the same."""
    import polars as pl

    scatter = pl.Series.scatter

    def strict(self: pl.Series, indices: Any, values: Any) -> pl.Series:
        given = pl.Series(indices)
        if not given.equals(given.sort()):
            raise pl.exceptions.ComputeError("set indices must be sorted")
        return scatter(self, indices, values)

    monkeypatch.setattr(pl.Series, "scatter", strict)
    lines, columns, declined = _both(monkeypatch, [(0, stream)], 4 << 20)
    assert declined is None
    assert columns == lines


@pytest.mark.parametrize("block", [4 << 20, 24 << 10], ids=["one-block", "24KiB-blocks"])
@pytest.mark.parametrize("stream", STREAMS, ids=lambda p: f"{p.parts[-4]}-{p.parts[-2]}")
def test_probe_streams_in_format_v2_read_as_in_v1(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, stream: Path, block: int
) -> None:
    """The recorded streams with their calls' shapes declared and named by id (v2) read,
    both ways, into what the original (v1) reads into line by line."""
    shaped = _shaped(stream, tmp_path / "rank")
    assert shaped.stat().st_size < stream.stat().st_size * 0.8
    with _mode(monkeypatch, False, block):
        original = _read([(0, stream)])
    lines, columns, declined = _both(monkeypatch, [(0, shaped)], block)
    assert declined is None
    assert columns == lines
    moved = json.loads(json.dumps(lines, default=repr).replace(str(shaped.parent), str(stream.parent)))
    assert moved == json.loads(json.dumps(original, default=repr))


def test_small_bounds_and_asked_windows_read_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tails that evict pending calls, digest windows closed across blocks, windows asked for."""
    stream = REPO / "fixtures" / "tiny-kernel-tail" / "ranks" / "rank-0"
    segs = [(0, next(stream.glob("*.jsonl")))]
    _small(monkeypatch)
    windows = {"default_pg": [(20, 40), (300, 310)], "1": [(5, 9)]}
    lines, columns, declined = _both(monkeypatch, segs, 16 << 10, windows)
    assert declined is None
    assert columns == lines
    tallies = [tally for _, (_, tally) in lines[0]["tallies"]]  # (group, (type name, GroupTally))
    assert len(lines[0]["collectives"]) < sum(t.calls for t in tallies)


def _small(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in (reduce, columnar):
        monkeypatch.setattr(module, "HEAD_CALLS", 3)
        monkeypatch.setattr(module, "TAIL_CALLS", 5)
        monkeypatch.setattr(module, "WINDOW", 4)


def _line(rec: dict[str, Any]) -> str:
    return json.dumps(rec, separators=(",", ":"))


def _call(kind: str, t: float, seq: int, gid: int, op: str, is_async: bool, step: int, **more: Any) -> str:
    """A call in the probes' own layout (lorascope.probes.collectives); with ``shapes``
    (format v2: a stream's shape ids so far), naming its shape, declared first if new."""
    shape = {
        "op": op,
        "bytes": more.get("bytes"),
        "dtype": more.get("dtype"),
        "async": is_async,
        "site": more.get("site"),
    }
    if not more.get("exact"):  # the probes write microseconds
        t, more["end"] = round(t, 6), round(more["end"], 6) if kind == "coll_done" else None
    rec: dict[str, Any] = {"k": kind, "t": t, "seq": seq, "gid": gid}
    declared = ""
    shapes: dict[str, int] | None = more.get("shapes")
    if shapes is None:
        rec.update(shape)
    else:
        key = _line(shape)
        if key not in shapes:
            shapes[key] = len(shapes)
            declared = _line({"k": "shape", "t": t, "id": shapes[key], **shape}) + "\n"
        rec["sh"] = shapes[key]
    rec["step"] = step
    if more.get("via"):
        rec["via"] = more["via"]
    if kind == "coll_done":
        rec.update(end=more["end"], err=more.get("err"))
    return declared + _line(rec)


def _shaped(stream: Path, into: Path) -> Path:
    """A copy of a stream (its side files beside it) in format v2: each call names its
    shape (the probes' layout), declared before the first call of it; every other line as
    it is."""
    shutil.copytree(stream.parent, into)
    out = into / stream.name
    shapes: dict[str, int] = {}
    lines = []
    for line in stream.read_text().splitlines():
        rec = json.loads(line) if line.strip() else {}
        if rec.get("k") in ("coll", "coll_done"):
            keys = ("bytes", "dtype", "site", "via", "end", "err")
            more = {k: rec[k] for k in keys if k in rec}
            line = _call(
                rec["k"], rec["t"], rec["seq"], rec["gid"], rec["op"], rec["async"], rec["step"], shapes=shapes, exact=True, **more
            )  # fmt: skip
        lines.append(line)
    out.write_text("\n".join(lines) + "\n")
    return out


@st.composite
def _streams(draw: st.DrawFn) -> list[str]:
    """A stream of two groups' calls: most written whole, some started and ended later (or
    never), ends out of order, device times of recent and long-gone calls, a few odd
    records (an error with escapes, so read as JSON; ops with quotes, a backslash, a
    non-ASCII letter; blank lines; a late or repeated sequence number; a torn end)."""
    out = [_line({**START, "t": T0})]
    out += [
        _line({"gid": g, "name": str(g), "ranks": [0, 1], "backend": "gloo", "k": "group", "t": T0}) for g in (0, 1)
    ]
    seqs = {0: 0, 1: 0}
    shapes: dict[str, int] | None = {} if draw(st.booleans()) else None  # format v2, or v1
    open_calls: list[tuple[int, int]] = []
    t, step = T0 + 1, 0
    for _ in range(draw(st.integers(5, 80))):
        t += draw(st.integers(1, 5000)) / 1e6
        what = draw(st.sampled_from(["done"] * 6 + ["start", "end", "device", "step", "blank", "odd"]))
        gid = draw(st.integers(0, 1))
        if what in ("done", "start"):
            odd = draw(st.sampled_from([None] * 60 + ["again", "jump", "late"]))
            seqs[gid] += {"again": 0, "jump": 2}.get(odd or "", 1)
            seq = max(seqs[gid] - 9, 1) if odd == "late" else max(seqs[gid], 1)
            op = draw(st.sampled_from(["all_reduce", "all_gather", "it's", "a \"b\" \\ 'c' é"]))
            more = dict(
                bytes=draw(st.sampled_from([None, 4096, 0])),
                dtype=draw(st.sampled_from([None, "float32", "bf'16"])),
                site=draw(st.sampled_from([None, "train.py:12 in main", "a, b.py:3 in f"])),
                via=draw(st.sampled_from([None, None, "train.py:40 in save"])),
                shapes=shapes,
            )
            if what == "done":
                more.update(end=t + draw(st.integers(0, 900)) / 1e6, err=draw(st.sampled_from([None, None, "Boom"])))
                out.append(_call("coll_done", t, seq, gid, op, draw(st.booleans()), step, **more))
            else:
                out.append(_call("coll", t, seq, gid, op, draw(st.booleans()), step, **more))
                open_calls.append((gid, seq))
        elif what == "end" and open_calls:
            gid, seq = open_calls.pop(draw(st.integers(0, len(open_calls) - 1)))
            err = draw(st.sampled_from([None, None, "RuntimeError('closed \\ud83c\\udfd6')"]))
            rec = {"k": "coll_end", "t": round(t, 6), "seq": seq, "gid": gid, "err": err}
            out.append(_line(rec).replace("\\\\", "\\") if err else _line(rec))
        elif what == "device":  # a synchronous CUDA call's device time, read at a step end
            seq = max(1, seqs[gid] - draw(st.sampled_from([0, 1, 6, 40])))
            out.append(_line({"k": "coll_dev", "t": round(t, 6), "seq": seq, "gid": gid, "ms": 0.25, "host_ms": 0.5}))
        elif what == "step":  # the lines of FLAT_LAYOUTS' kinds, in their layouts and not
            step += draw(st.sampled_from([1, 1, 0]))  # (0: a backward span can open and close)
            if draw(st.booleans()):  # a CUDA loss, read later, for the step about to end
                out.append(_line({"step": step, "loss": None, "text": "nan", "k": "loss", "t": t}))
            dur = draw(st.sampled_from([0.5, 0.0, 1, 1e-07, -0.25]))
            loss = draw(st.sampled_from([1.0, None, 2.5e-08, 7, 123456.789]))
            out.append(_line({"step": step, "dur": dur, "loss": loss, "src": "deepspeed", "k": "step", "t": t}))
            if draw(st.booleans()):
                out.append(_line({"step": step, "loss": 0.5, "k": "loss", "t": t}))
            edge = draw(st.sampled_from(["begin", "end", 'a "b"']))
            out.append(_line({"name": "backward", "edge": edge, "step": step, "k": "phase", "t": t}))
            mem: dict[str, Any] = {"src": draw(st.sampled_from(["step", "forward.begin"])), "step": step}
            mem["rss"] = draw(st.sampled_from([5 << 30, None, 0]))
            heap = draw(st.sampled_from(["heap", "none", "cuda", "after"]))
            mem.update({"heap": {"heap": 3, "after": 4}, "cuda": {"cuda": {"allocated": 1}}}.get(heap, {}))
            out.append(_line({**mem, "k": "mem", "t": t} if heap != "after" else {**mem, "k": "mem", "t": t, "x": 1}))
        elif what == "blank":
            out.append("")
        elif what == "odd":
            out.append(_line({"src": "sampler", "step": step, "rss": 5, "heap": 3, "k": "mem", "t": t, "x": "é"}))
    if draw(st.integers(0, 5)) == 0:
        out.append(out[-1][: len(out[-1]) // 2] + "\\")
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stream=_streams(), block=st.sampled_from([700, 2048, 1 << 20]))
def test_generated_streams_read_the_same_both_ways(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory, stream: list[str], block: int
) -> None:
    path = tmp_path_factory.mktemp("stream") / "vm-7.0000.jsonl"
    torn = not stream[-1].endswith("}")
    path.write_text("\n".join(stream) + ("" if torn else "\n"))
    with monkeypatch.context() as m:
        _small(m)
        lines, columns, declined = _both(m, [(0, path)], block)
    if declined is None:
        assert columns == lines
    else:  # declined streams are read line by line: the same as the line reader's
        assert columns == lines


@st.composite
def _long_streams(draw: st.DrawFn) -> list[str]:
    """Steps with their ``step``, ``phase`` and ``mem`` lines in the probes' layouts
    (values that tie, peak anywhere or are null; step numbers that repeat, skip and go
    back), now and then a ``mem`` record read as JSON (an extra field, a NaN, CUDA
    figures), a call."""
    out = [_line({**START, "t": T0})]
    out.append(_line({"gid": 0, "name": "0", "ranks": [0, 1], "backend": "gloo", "k": "group", "t": T0}))
    t, step, seq = T0 + 1, 0, 0
    for _ in range(draw(st.integers(10, 160))):
        t += draw(st.integers(1, 5000)) / 1e6
        step += draw(st.sampled_from([1] * 8 + [0, 2, -3]))
        out.append(_line({"step": step, "dur": 0.5, "loss": 1.0, "src": "deepspeed", "k": "step", "t": t}))
        for name in draw(st.sampled_from([["forward", "backward"], ["backward"], ["forward"]])):
            for edge in ("begin", "end"):
                out.append(_line({"name": name, "edge": edge, "step": step, "k": "phase", "t": t}))
        for _ in range(draw(st.integers(0, 3))):
            mem: dict[str, Any] = {"src": "step", "step": draw(st.sampled_from([step, step, step + 1, step - 2]))}
            mem["rss"] = draw(st.sampled_from([None, 0, 5, 7, 7, 1 << 40]))
            heap = draw(st.sampled_from([None, 3, 3, 9, 1 << 33, "nan", "extra", "cuda"]))
            if heap == "nan":
                mem["heap"] = math.nan
            elif heap == "cuda":  # a CUDA rank's (read as JSON)
                mem["cuda"] = {"alloc": draw(st.sampled_from([1, 9])), "max_alloc": draw(st.sampled_from([2, 9, 12]))}
            elif heap is not None:
                mem["heap"] = 4 if heap == "extra" else heap
            out.append(_line({**mem, "k": "mem", "t": t, **({"x": 1} if heap == "extra" else {})}))
        if draw(st.integers(0, 9)) == 0:
            seq += 1
            out.append(_call("coll_done", t, seq, 0, "all_reduce", False, step, bytes=8, end=t + 1e-4))
    return out


def _forget_sync_after(monkeypatch: pytest.MonkeyPatch, calls: int) -> None:
    """Both collective logs forget synchronous calls of dropped steps past ``calls``."""
    monkeypatch.setattr(reduce, "SYNC_PRUNE", calls)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    stream=_long_streams(),
    block=st.sampled_from([700, 4096, 1 << 20]),
    budget=st.integers(1, 24),
    forget=st.sampled_from([None, 1, 3]),
)
def test_long_streams_past_their_budget_read_the_same_both_ways(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path_factory: pytest.TempPathFactory,
    stream: list[str],
    block: int,
    budget: int,
    forget: int | None,
) -> None:
    """The records the columnar reader does not make (sure to be dropped) change nothing;
    nor do the synchronous calls of such steps that either reader forgets (``forget``:
    after so many, compared with a reading that keeps them all)."""
    path = tmp_path_factory.mktemp("stream") / "vm-7.0000.jsonl"
    path.write_text("\n".join(stream) + "\n")
    if forget is not None:
        _forget_sync_after(monkeypatch, forget)
    lines, columns, declined = _both(monkeypatch, [(0, path)], block, budget=budget)
    assert declined is None
    assert columns == lines
    if forget is not None:
        _forget_sync_after(monkeypatch, 1 << 62)
        assert _both(monkeypatch, [(0, path)], block, budget=budget)[0] == lines


def test_a_long_streams_synchronous_calls_of_dropped_steps_are_forgotten(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """3,000 steps of 8 synchronous calls at a budget of 16 steps: both readers hold a few
    hundred calls' times at most, not 24,000, and read what they read keeping them all."""
    path = tmp_path / "vm-7.0000.jsonl"
    out = [_line({**START, "t": T0})]
    out.append(_line({"gid": 0, "name": "0", "ranks": [0, 1], "backend": "gloo", "k": "group", "t": T0}))
    seq = 0
    for step in range(3000):
        t = T0 + step
        out.append(_line({"step": step, "dur": 0.5, "loss": 1.0, "src": "deepspeed", "k": "step", "t": t}))
        out += [_line({"name": "backward", "edge": e, "step": step, "k": "phase", "t": t + 0.1 * i}) for i, e in enumerate(("begin", "end"))]  # fmt: skip
        for i in range(8):
            seq += 1
            out.append(
                _call("coll_done", t + 0.05 * i, seq, 0, "all_reduce", False, step, bytes=8, end=t + 0.05 * i + 0.01)
            )
    path.write_text("\n".join(out) + "\n")
    held: list[int] = []
    real = reduce.SyncTimes.grew

    def spy(self: Any, n: int) -> None:
        real(self, n)
        held.append(self.held)

    monkeypatch.setattr(reduce.SyncTimes, "grew", spy)
    _forget_sync_after(monkeypatch, 64)
    lines, columns, declined = _both(monkeypatch, [(0, path)], 64 << 10, budget=16)
    assert declined is None and columns == lines
    assert held and max(held) < 600, max(held)
    _forget_sync_after(monkeypatch, 1 << 62)
    held.clear()
    assert _both(monkeypatch, [(0, path)], 64 << 10, budget=16)[:2] == (lines, lines)
    assert max(held) == 24_000  # kept them all


def test_a_long_streams_records_sure_to_be_dropped_are_not_made(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Read column-wise at a small budget, a 2,000-step stream's ``mem`` and ``phase``
    records are mostly never made, and it reads as line by line."""
    path = tmp_path / "vm-7.0000.jsonl"
    out = [_line({**START, "t": T0})]
    for step in range(2000):
        t = T0 + step
        out.append(_line({"step": step, "dur": 0.5, "loss": 1.0, "src": "deepspeed", "k": "step", "t": t}))
        out += [
            _line({"name": n, "edge": e, "step": step, "k": "phase", "t": t})
            for n in ("forward", "backward")
            for e in ("begin", "end")
        ]
        out += [
            _line({"src": "step", "step": step, "rss": (step * 7919) % 1009, "heap": step % 13, "k": "mem", "t": t})
        ] * 2
    path.write_text("\n".join(out) + "\n")
    made = dict.fromkeys(FLAT_LAYOUTS, 0)
    real = columnar._made

    def spy(kind: str, frames: Any) -> Any:
        positions, recs = real(kind, frames)
        made[kind] += len(recs)
        return positions, recs

    monkeypatch.setattr(columnar, "_made", spy)
    lines, columns, declined = _both(monkeypatch, [(0, path)], 64 << 10, budget=16)
    assert declined is None and columns == lines
    # made: every step record and backward edge; of the rest, the first block's (applied
    # at once: it holds the start record), the peaks, the steps kept, the newest
    assert made["step"] == 2000 and made["mem"] < 400 and 4000 <= made["phase"] < 4400, made
    assert dict(lines[0]["totals"])["mem"] == ("int", 4000)


def test_flat_records_before_the_start_record_are_bad_input_at_their_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    first = [
        _line({"src": "attach", "step": 0, "rss": 5, "heap": 3, "k": "mem", "t": T0}),
        _line({"name": "forward", "edge": "begin", "step": 0, "k": "phase", "t": T0}),
    ]
    for order in (first, first[::-1]):
        path = tmp_path / "vm-7.0000.jsonl"
        path.write_text("\n".join([*order, _line({**START, "t": T0})]) + "\n")
        lines, columns, _ = _both(monkeypatch, [(0, path)], 1 << 20)
        assert lines == columns == ("error", f"{path}:1: the stream does not begin with a 'start' record")


def test_the_probes_flat_records_take_the_columnar_path() -> None:
    """Every ``mem``, ``phase`` and ``step`` line of a recorded CPU stream is in one of
    FLAT_LAYOUTS' layouts (a field the probes add or reorder would send them all back to
    JSON, unnoticed but for this), and each layout is a record validate_record accepts."""
    import polars as pl

    stream = next((REPO / "fixtures" / "healthy" / "ranks" / "rank-0").glob("*.jsonl"))
    lines = stream.read_bytes().splitlines()
    kinds = [json.loads(line)["k"] for line in lines]
    applied: list[tuple[str, int, dict[str, Any]]] = []

    class Sink:
        def extend(self, path: Path, number: int, kind: str, recs: list[dict[str, Any]], last: float) -> None:
            applied.extend((kind, number, rec) for rec in recs)  # number: the first one's line

    flat = columnar._Flat(pl.Series(lines, dtype=pl.Binary), Sink(), stream, 0)  # type: ignore[arg-type]
    flat.make()
    flat.apply_before(len(lines))
    expected = [i for i, kind in enumerate(kinds) if kind in FLAT_LAYOUTS]
    assert len(expected) > 100 and sorted(flat.positions) == expected
    for kind in FLAT_LAYOUTS:
        assert [rec for k, _, rec in applied if k == kind] == [
            json.loads(lines[i]) for i in expected if kinds[i] == kind
        ]
    assert {n for _, n, _ in applied} <= {i + 1 for i in expected}
    assert {kind for kind, _, _ in applied} == set(FLAT_LAYOUTS)
    produced = {"int": {int}, "opt_int": {int, type(None)}, "float": {float}, "opt_float": {float, type(None)}}
    produced["str"] = {str}
    for kind, layouts in FLAT_LAYOUTS.items():
        required = schema.RECORD_FIELDS[kind]
        for layout in layouts:
            assert set(required) <= {key for key, _ in layout}, kind
            for key, value in layout:  # a field the schema lists takes what the layout gives
                assert produced[value] <= set(required.get(key, produced[value])), (kind, key)
            for value_of in (min, max):
                rec = {key: value_of(produced[value], key=str)() for key, value in layout}
                assert schema.validate_record({**rec, "k": kind, "t": T0})


def test_declines_what_it_cannot_reproduce(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Times in different binades (relative seconds), a call before its group's record and
    a repeated sequence number make the reader go line by line; the result is the line
    reader's."""
    base = [_line({**START, "t": 1.5})]
    group = _line({"gid": 0, "name": "g", "ranks": [0, 1], "backend": "gloo", "k": "group", "t": 1.5})
    cases = {
        "binade": [*base, group, _call("coll_done", 1.6, 1, 0, "all_reduce", False, 0, end=2.5)],
        "group-after-calls": [*base, _call("coll_done", 1.6, 1, 0, "all_reduce", False, 0, end=1.7), group],
        "repeated-seq": [
            *base,
            group,
            _call("coll_done", 1.6, 1, 0, "all_reduce", False, 0, end=1.7),
            _call("coll_done", 1.8, 1, 0, "all_reduce", False, 0, end=1.9),
        ],
    }
    for name, stream in cases.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text("\n".join(stream) + "\n")
        lines, columns, declined = _both(monkeypatch, [(0, path)], 1 << 20)
        assert declined is not None, name
        assert columns == lines, name


def test_a_shape_named_before_it_is_declared_or_declared_twice_is_bad_input(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A call naming a shape no record before it declares, and a shape declared again
    with other fields, are a corrupt stream: the same one-line error both ways."""
    shape = {"op": "all_reduce", "bytes": 8, "dtype": "float32", "async": False, "site": None}
    head = [
        _line({**START, "t": T0}),
        _line({"gid": 0, "name": "g", "ranks": [0, 1], "backend": "gloo", "k": "group", "t": T0}),
    ]
    call = _line({"k": "coll_done", "t": T0 + 1, "seq": 1, "gid": 0, "sh": 0, "step": 0, "end": T0 + 2, "err": None})
    declare = _line({"k": "shape", "t": T0 + 1, "id": 0, **shape})
    cases = {
        "undeclared": ([*head, call, declare], "names shape 0, which no 'shape' record before it declares"),
        "redeclared": ([*head, declare, call, declare.replace("float32", "bf16")], "shape 0 is declared again"),
    }
    for name, (stream, error) in cases.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text("\n".join(stream) + "\n")
        lines, columns, _ = _both(monkeypatch, [(0, path)], 1 << 20)
        assert lines == columns and lines[0] == "error" and error in lines[1], (name, lines)
        assert f"{path}:" in lines[1] and "\n" not in lines[1]


def test_a_fault_of_the_columnar_reader_falls_back_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    segs = [(0, STREAMS[0])]
    with _mode(monkeypatch, False, 1 << 20):
        lines = _read(segs)

    def broken(*args: Any) -> None:
        raise RuntimeError("a bug")

    with _mode(monkeypatch, True, 1 << 20):
        monkeypatch.setattr(columnar, "_block", broken)
        data, warnings = _read(segs)
    assert data == lines[0]
    assert warnings == ["rank 0: reading column-wise failed (RuntimeError: a bug); read line by line", *lines[1]]


def test_streams_from_one_mb_go_column_wise_once_polars_is_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    # Importing polars costs ~0.3 s: a process that has not paid it reads only large streams
    # column-wise; one that has (a worker of a parallel read) reads streams from 1 MB on.
    monkeypatch.setattr(columnar, "available", lambda: True)
    monkeypatch.setitem(sys.modules, "polars", sys.modules.get("polars") or object())
    assert columnar.suits(columnar.MIN_BYTES_LOADED) and not columnar.suits(columnar.MIN_BYTES_LOADED - 1)
    monkeypatch.delitem(sys.modules, "polars")
    assert not columnar.suits(columnar.MIN_BYTES_LOADED) and not columnar.suits(columnar.MIN_BYTES - 1)
    assert columnar.suits(columnar.MIN_BYTES)
    monkeypatch.setattr(columnar, "available", lambda: False)
    assert not columnar.suits(columnar.MIN_BYTES)


_NAMES = st.sampled_from(["all_reduce", "all_gather", "float32", "", "'", "é\\", "None"])


@settings(max_examples=60, deadline=None)
@given(
    calls=st.lists(
        st.tuples(
            st.integers(1, 2**62),
            _NAMES,
            st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
            st.one_of(st.none(), _NAMES),
        ),
        max_size=300,
    )
)
def test_a_blocks_window_sums_are_its_calls_hashes_summed_modulo_2_64(calls: list[Any]) -> None:
    """The digests summed as columns are the line reader's (which needs polars' integer
    arithmetic to wrap modulo 2^64, as it does)."""
    import polars as pl

    columnar.available()
    rows = pl.DataFrame(
        calls, schema={"seq": pl.Int64, "op": pl.String, "bytes": pl.Int64, "dtype": pl.String}, orient="row"
    )
    rows = rows.with_columns(((pl.col("seq") - 1) // 4).alias("w"))
    expected: dict[int, tuple[int, int]] = {}
    for seq, op, size, dtype in calls:
        hashes = reduce.call_hashes(seq, op, size, dtype)
        held = expected.get((seq - 1) // 4, (0, 0))
        expected[(seq - 1) // 4] = ((held[0] + hashes[0]) & reduce.MASK, (held[1] + hashes[1]) & reduce.MASK)
    sums = columnar._window_sums(rows)
    assert {w: (a, b) for w, a, b in sums.iter_rows()} == expected
    assert list(sums["w"]) == list(dict.fromkeys((seq - 1) // 4 for seq, *_ in calls))
