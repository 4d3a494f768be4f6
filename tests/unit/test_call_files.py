"""The reader of format v3's call files: stamps, the ring, torn and cut files, bad headers,
calls naming undeclared shapes, v2 refused; and the numpy reduction, which must compute what
the call-by-call CollectiveLog computes."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lorascope.analysis import of_run
from lorascope.cli import main
from lorascope.errors import FormatVersionError
from lorascope.rundir.format.callfile import CallFile
from lorascope.rundir.format.layout import CALL, CALL_FIELDS, HEADER, STEPS_HEAD, offset_of
from lorascope.rundir.format.schema import MANIFEST_FILE
from lorascope.rundir.loading import callreduce, reduce
from lorascope.rundir.loading import calls as calls_module
from lorascope.rundir.loading.callreduce import reduce_calls
from lorascope.rundir.loading.calls import CALL_DTYPE, decode, read_calls, read_since
from lorascope.rundir.loading.reader import Collective, load_run
from lorascope.rundir.loading.reduce import CollectiveLog
from tests.helpers import T0, Call, RankSpec, write_run


def _file(tmp_path: Path, calls: int, head: int = 4, ring: int = 8, ended: bool = True) -> Path:
    f = CallFile(tmp_path / "h-1.calls", head=head, ring=ring)
    for i in range(calls):
        index = f.begin(T0 + i, i + 1, 4, i // 5, 0, 0)
        if ended:
            f.end(index, T0 + i + 0.5)
    f.close()
    return f.path


def _stamp_at(path: Path, slot: int, stamp: int) -> None:
    with path.open("r+b") as f:
        f.seek(HEADER.size + slot * CALL.size + offset_of(CALL_FIELDS, "stamp"))
        f.write(stamp.to_bytes(4, "little"))


def test_the_dtype_is_the_layout_table() -> None:
    assert CALL_DTYPE.names == tuple(name for name, _, _ in CALL_FIELDS)
    assert CALL_DTYPE.itemsize == CALL.size


def test_a_ring_that_went_round_keeps_the_head_and_the_newest_and_says_what_is_not(tmp_path: Path) -> None:
    warnings: list[str] = []
    calls = read_calls(_file(tmp_path, 20), "rank 0", warnings)
    assert calls.index.tolist() == [0, 1, 2, 3, *range(12, 20)]
    assert calls.records["seq"].tolist() == [i + 1 for i in calls.index.tolist()]
    assert (calls.lost, calls.missing, calls.last) == ((4, 11), [(4, 11)], 19)
    assert warnings == ["rank 0: calls 4..11 not kept (the ring holds the newest 8)"]


def test_torn_and_never_written_slots_are_dropped(tmp_path: Path) -> None:
    path = _file(tmp_path, 14)  # head 0..3, ring slots hold 6..13
    _stamp_at(path, 2, 0)  # index 2: never written (its thread died before it wrote)
    _stamp_at(path, 4 + (13 - 4) % 8, 13 - 8 + 1)  # index 13's slot still says 5: torn mid-overwrite
    warnings: list[str] = []
    calls = read_calls(path, "rank 0", warnings)
    assert calls.index.tolist() == [0, 1, 3, *range(6, 13)]
    assert calls.missing == [(2, 2), (4, 5), (13, 13)] or calls.missing == [(2, 2), (4, 4), (5, 5), (13, 13)]
    assert any("torn or never written" in w for w in warnings)


def test_a_cut_file_is_read_as_far_as_it_goes(tmp_path: Path) -> None:
    path = _file(tmp_path, 10, head=16, ring=8)
    data = path.read_bytes()
    path.write_bytes(data[: HEADER.size + 6 * CALL.size + 7])  # cut inside record 6
    warnings: list[str] = []
    calls = read_calls(path, "rank 0", warnings)
    assert calls.index.tolist() == list(range(6))
    assert any("cut short" in w for w in warnings)


@pytest.mark.parametrize(
    ("at", "value", "says"),
    [
        (0, b"NOTCALLS", "not a call file"),
        (8, (9).to_bytes(4, "little"), "call file version 9"),
        (12, (41).to_bytes(4, "little"), "call records of 41 bytes"),
    ],
)
def test_a_bad_header_is_one_warning_and_no_calls(tmp_path: Path, at: int, value: bytes, says: str) -> None:
    path = _file(tmp_path, 3)
    data = bytearray(path.read_bytes())
    data[at : at + len(value)] = value
    path.write_bytes(bytes(data))
    warnings: list[str] = []
    assert len(read_calls(path, "rank 0", warnings)) == 0
    assert len(warnings) == 1 and says in warnings[0] and "rank 0's calls are not read" in warnings[0]


def test_a_run_with_a_bad_call_file_is_read_without_its_calls(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", [RankSpec(), RankSpec()])
    path = next((run_dir / "ranks" / "rank-1").glob("*.calls"))
    path.write_bytes(b"garbage" * 20)
    run = load_run(run_dir)
    assert len(run.ranks[0].collectives) == 3 and run.ranks[1].collectives == []
    assert any("not a call file" in w for w in run.warnings)


def test_a_call_naming_an_undeclared_shape_reads_as_unknown(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", [RankSpec()])
    path = next((run_dir / "ranks" / "rank-0").glob("*.calls"))
    with path.open("r+b") as f:
        f.seek(HEADER.size + 1 * CALL.size + offset_of(CALL_FIELDS, "shape"))
        f.write((7).to_bytes(4, "little"))
    run = load_run(run_dir)
    assert [c.op for c in run.ranks[0].collectives] == ["all_reduce", "unknown", "all_reduce"]
    assert any("1 call(s) name a shape no 'shape' record declares" in w for w in run.warnings)


def test_v2_run_directories_are_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = write_run(tmp_path / "run", [RankSpec()])
    manifest = json.loads((run_dir / MANIFEST_FILE).read_text())
    manifest["version"] = 2
    (run_dir / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(
        FormatVersionError, match=r"a run directory of format v2; this lorascope reads v3 \(re-record it"
    ):
        load_run(run_dir)
    with pytest.raises(SystemExit) as exc:
        main(["analyze", str(run_dir)])
    assert exc.value.code == 3
    err = capsys.readouterr().err
    assert "format v2; this lorascope reads v3" in err and len(err.strip().splitlines()) == 1


def test_a_follower_reads_the_new_calls_and_the_pending_ones_again(tmp_path: Path) -> None:
    f = CallFile(tmp_path / "h-1.calls", head=4, ring=8)
    first = f.begin(T0, 1, 4, 0, 0, 0)
    count, runs = read_since(f.path, 0, []) or (0, [])
    records, _, _ = decode(runs)
    assert count == 1 and records["end"].tolist() == [0.0]
    f.end(first, T0 + 1)
    for i in range(1, 22):
        f.begin(T0 + i, i + 1, 4, 0, 0, 0)
    count, runs = read_since(f.path, 1, [first]) or (0, [])
    assert count == 22
    assert [(index, len(raw) // CALL.size) for index, raw in runs] == [(0, 1), (14, 6), (20, 2)]  # the ring wraps
    records, index, _ = decode(runs)
    assert index.tolist() == [0, *range(14, 22)]  # 1..13 gone round the ring
    assert records["end"][0] == T0 + 1
    g = CallFile(tmp_path / "h-2.calls", head=4, ring=8)
    g.begin(T0, 1, 4, 0, 0, 0)
    records, index, run = decode([*runs, *(read_since(g.path, 0, []) or (0, []))[1]])  # two files at once
    assert index.tolist() == [0, *range(14, 22), 0] and run.tolist() == [0, 1, 1, 1, 1, 1, 1, 2, 2, 3]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    head=st.integers(1, 12),
    ring=st.sampled_from([0, 6, 16]),
    calls=st.integers(1, 60),
    newest=st.integers(1, 20),
    torn=st.lists(st.integers(0, 80), max_size=3),
)
def test_the_newest_calls_are_the_whole_reads_newest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, head: int, ring: int, calls: int, newest: int, torn: list[int]
) -> None:
    """What ``lorascope hang`` reads of a long run: the newest calls of the file, the same
    records, numbers and holes as the whole read's, and every call below them lost."""
    monkeypatch.setattr(calls_module, "COUNT_SLACK", 2)
    path = tmp_path / f"{head}-{ring}-{calls}-{newest}.calls"
    f = CallFile(path, head=head if ring else STEPS_HEAD, ring=ring)  # no ring: a steps file's head
    for i in range(calls):
        f.end(f.begin(T0 + i, i + 1, 4, i // 5, 0, 0), T0 + i + 0.5)
    f.close()
    for slot in torn:
        if slot < min(calls, f.head + f.ring):
            _stamp_at(path, slot, 0)
    whole = read_calls(path, "rank 0", [])
    warned: list[str] = []
    recent = read_calls(path, "rank 0", warned, newest=newest)
    if calls <= newest or (ring and ring <= newest):
        assert recent.index.tolist() == whole.index.tolist() and recent.missing == whole.missing
        return
    first = calls - newest
    mine = whole.index >= first
    assert recent.index.tolist() == whole.index[mine].tolist()
    assert recent.records.tobytes() == whole.records[mine].tobytes()
    assert (recent.lost, recent.last) == ((0, first - 1), whole.last)
    clipped = [(max(a, first), b) for a, b in whole.missing if b >= first]
    assert _merged(recent.missing) == _merged([(0, first - 1), *clipped])
    assert not any("not kept" in w for w in warned)  # the calls below are not read by choice, not lost


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _reference(colls: list[Collective]) -> CollectiveLog:
    log = CollectiveLog({"g1": [(30, 40)]})
    for coll in colls:  # in the order they were begun, as a stream was read in the order written
        log.add(coll)
    log.kept = log.finish()  # type: ignore[attr-defined]
    return log


@pytest.mark.parametrize("seed", range(6))
def test_the_numpy_reduction_is_the_call_by_call_one(
    tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random calls of two groups, some async, some pending, sizes unknown or not, written
    in index order with start times that go back now and then: every tally, digest, kept
    call and sum as CollectiveLog's, to the bit."""
    for module in (reduce, callreduce):
        monkeypatch.setattr(module, "HEAD_CALLS", 8)
        monkeypatch.setattr(module, "TAIL_CALLS", 16)
    rng = random.Random(seed)
    f = CallFile(tmp_path / "h-1.calls", head=1 << 10, ring=1 << 10)
    shapes = {
        0: ("all_reduce", "float32", False, "a.py:1 in f", None),
        1: ("all_gather", None, True, None, "b.py:2 in g"),
        2: ("barrier", "bfloat16", False, None, None),
    }
    names = {0: "g0", 1: "g1"}
    seqs = {0: 0, 1: 0}
    colls = []
    t = T0
    for i in range(rng.randint(1, 200)):
        gid = rng.randint(0, 1)
        seqs[gid] += 1
        sh = rng.randint(0, 2)
        t += rng.random() * 0.01 - (0.002 if rng.random() < 0.1 else 0.0)
        size = rng.choice([-1, 4, 1 << 40])
        end = None if rng.random() < 0.1 else t + rng.random() * 0.1
        step = i // 20
        f.begin(t, seqs[gid], size, step, gid, sh)
        if end is not None:
            f.end(i, end)
        op, dtype, is_async, site, via = shapes[sh]
        colls.append(
            Collective(
                seqs[gid],
                names[gid],
                op,
                None if size < 0 else size,
                dtype,
                is_async,
                site,
                step,
                t,
                end,
                None,
                None,
                via,
            )
        )
    f.close()
    ref = _reference(colls)
    got = reduce_calls(read_calls(f.path, "rank 0", []), shapes, names.__getitem__, {}, {"g1": [(30, 40)]}, Collective)
    assert got.tallies == ref.tallies
    assert got.collectives == ref.kept  # type: ignore[attr-defined]
    assert got.sync == ref.sync.sums
    assert got.op_totals == ref.op_totals
    spans = {1: [(T0, T0 + 0.05)], 3: [(T0 + 0.2, T0 + 0.3), (T0 + 0.35, T0 + 0.5)]}
    assert got.outside_backward(spans) == ref.outside_backward(spans)


def test_a_gap_in_one_ranks_ring_is_no_divergence(tmp_path: Path) -> None:
    """Rank 0's ring went round over calls rank 1 kept: nothing is said of them, and the
    calls of that stretch are dropped from both ranks; a real difference after the gap is
    still found."""

    def run(last_op: str, name: str, slots: tuple[int, int] = (4, 8)) -> list[str]:
        same = [Call("all_reduce")] * 40
        ranks = [RankSpec(calls=same, call_slots=slots), RankSpec(calls=[*same[:-1], Call(last_op)])]
        run_dir = write_run(tmp_path / name, ranks)
        loaded = load_run(run_dir)
        if slots == (4, 8):
            assert "rank 0: calls 4..31 not kept (the ring holds the newest 8)" in loaded.warnings
            assert sorted(c.seq for c in loaded.ranks[1].collectives) == [1, 2, 3, 4, *range(33, 41)]
        return sorted(f.id for f in of_run(loaded, run_dir).findings)

    whole = run("all_reduce", "whole", (64, 64))
    assert run("all_reduce", "same") == whole
    assert set(run("barrier", "differ")) > set(whole)


@pytest.mark.parametrize("table", ["HEADER_FIELDS", "CALL_FIELDS", "STEP_FIELDS", "MEM_FIELDS"])
def test_the_docs_tables_are_the_layout_tables(table: str) -> None:
    """docs/run-format.md spells the call, steps and memory files' layout as layout.py does, row for row."""
    from lorascope.rundir.format import layout

    text = (Path(__file__).resolve().parents[2] / "docs" / "run-format.md").read_text()
    block = text.split(f"<!-- layout: {table} -->\n", 1)[1].split("<!-- end layout -->", 1)[0]
    rows = [line.strip("| ").split(" | ") for line in block.strip().splitlines()[2:]]
    assert [(f.strip("`"), c.strip("`"), m) for f, c, m in rows] == list(getattr(layout, table))


def test_steps_past_the_ring_are_counted_from_their_sums_and_kept_calls_join_the_detail(tmp_path: Path) -> None:
    """20 calls of step 4 on rank 0, a head of 4 and a ring of 8: calls 4..11 are gone from
    the call file, but the step's ``calls_step`` sums hold its calls past the head (16 of
    them, 1.6 s), and the kept-calls file holds calls 6 and 7 (seq 7, 8): every call is
    counted once, the step's waiting is the head's and the sums', and only the sequence
    numbers no file holds are unknown."""
    from lorascope.rundir.format.callfile import kept_calls_path
    from lorascope.rundir.format.writer import stream_prefix

    bad = [0, "all_reduce", "16", 64, 1600.0, 100.0, 0]  # a count that is not an int: left out
    sums = {"k": "calls_step", "step": 4, "groups": [[0, "all_reduce", 16, 64, 1600.0, 100.0, 0], bad]}
    named = {"k": "calls_file", "file": "h-100.kept-calls", "how": "mmap", "head": 0, "ring": 64}  # the later one
    # call 7 (seq 8) failed: its record in the call file is overwritten, its copy kept
    failed = {"k": "coll_err", "t": T0 + 8.1, "index": 7, "gid": 0, "seq": 8, "err": "RuntimeError('gloo')"}
    spec = RankSpec(calls=[Call("all_reduce")] * 20, call_slots=(4, 8), extra=[sums, named, failed])
    run_dir = write_run(tmp_path / "run", [spec, RankSpec(calls=[Call("all_reduce")] * 20)])
    kept = CallFile(kept_calls_path(stream_prefix(run_dir, 0, "h", 100)), head=0, ring=64)
    for seq in (7, 8):
        kept.end(kept.begin(T0 + seq, seq, 4, 4, 0, 0), T0 + seq + 0.1)
    kept.close()
    run = load_run(run_dir)
    rank = run.ranks[0]
    assert rank.collectives_total == 20 == run.ranks[1].collectives_total
    assert rank.tallies["default_pg"].missing == [(5, 6), (9, 12)]
    assert rank.coll_wait[5] == pytest.approx(4 * 0.1 + 1.6, abs=1e-3)
    assert rank.op_totals["all_reduce"][1] == 20
    assert (
        "rank 0: calls 4..11 not kept (the ring holds the newest 8); steps 4..4 are counted from their per-step sums ('calls_step')"
        in run.warnings
    )
    held = {c.seq: c for c in rank.collectives}
    assert {7, 8} <= set(held) and not set(held) & {5, 6, 9, 10, 11, 12}
    assert held[8].err == "RuntimeError('gloo')" and held[7].err is None
    assert not {c.seq for c in run.ranks[1].collectives} & {5, 6, 9, 10, 11, 12}  # compared by no one
