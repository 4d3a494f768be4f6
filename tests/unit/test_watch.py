"""`lorascope watch`'s parts on recorded runs and generated ones: the tail reads only what
was appended, whole lines, across segments and late ranks; the live state matches what
`analyze` reads from the same streams; the checks name stalled, waiting and slower ranks;
1,024 ranks fit an 80x24 screen."""

from __future__ import annotations

import io
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from rich.console import Console

from lorascope.analysis import analyze
from lorascope.analysis.live import LiveRank, LiveRun
from lorascope.cli import cli, main
from lorascope.rundir.format.callfile import CallFile, mem_file, step_file
from lorascope.rundir.format.layout import BEGIN, CALL, COUNT_OFFSET, HEADER, STEP, STEP_END
from lorascope.rundir.loading import tail as tail_module
from lorascope.rundir.loading.calls import CALL_DTYPE, MEM_DTYPE, STEP_DTYPE, read_calls
from lorascope.rundir.loading.mem import read_mem
from lorascope.rundir.loading.steps import read_steps
from lorascope.rundir.loading.tail import Tail
from lorascope.text.watch import render_watch
from tests.helpers import FIXTURES


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _stream(run: Path, rank: int, name: str = "h-1.0000.jsonl") -> Path:
    folder = run / "ranks" / f"rank-{rank}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


def _lines(tail: Tail) -> dict[tuple[int, str], list[bytes]]:
    out: dict[tuple[int, str], list[bytes]] = {}
    for stream, data in tail.look():
        if data:
            out.setdefault((stream.rank, stream.process), []).extend(data.split(b"\n"))
    return out


def test_tail_reads_only_appended_whole_lines_and_follows_segments_and_new_ranks(tmp_path: Path) -> None:
    clock = Clock()
    tail = Tail(tmp_path, clock=clock)
    assert _lines(tail) == {}
    first = _stream(tmp_path, 0)
    first.write_bytes(b'{"a":1}\n{"b":2}\n{"c":')
    clock.now += tail_module.RESCAN_S  # a new stream is found at the next listing
    assert _lines(tail) == {(0, "h-1"): [b'{"a":1}', b'{"b":2}']}
    assert _lines(tail) == {}  # nothing appended: nothing read
    with open(first, "ab") as f:
        f.write(b'3}\n{"d":4}\n')
    assert _lines(tail) == {(0, "h-1"): [b'{"c":3}', b'{"d":4}']}
    assert tail.bytes_read == first.stat().st_size  # every byte read once
    with open(first, "ab") as f:
        f.write(b'{"e":5}\n')
    _stream(tmp_path, 0, "h-1.0001.jsonl").write_bytes(b'{"f":6}\n')
    _stream(tmp_path, 3).write_bytes(b'{"g":7}\n')
    assert _lines(tail) == {(0, "h-1"): [b'{"e":5}']}  # the folders are listed again only every RESCAN_S
    clock.now += tail_module.RESCAN_S
    with open(first, "ab") as f:
        f.write(b'{"e2":5}\n')
    got = _lines(tail)
    assert got[(0, "h-1")] == [b'{"e2":5}', b'{"f":6}']  # the old segment finished, then the new one
    assert got[(3, "h-1")] == [b'{"g":7}']


def test_tail_follows_a_stream_kept_open_when_it_is_cut_or_made_anew(tmp_path: Path) -> None:
    """A stream is kept open between looks; cut shorter than read it is read from its start,
    and removed and made again under its name the new file is followed."""
    path = _stream(tmp_path, 0)
    path.write_bytes(b'{"a":1}\n{"b":2}\n')
    tail = Tail(tmp_path)
    assert _lines(tail) == {(0, "h-1"): [b'{"a":1}', b'{"b":2}']}
    stream = tail.streams[(0, "h-1")]
    assert stream.fd is not None
    path.write_bytes(b'{"c":3}\n')  # cut in place
    assert _lines(tail) == {(0, "h-1"): [b'{"c":3}']}
    path.unlink()
    path.write_bytes(b'{"d":4}\n{"e":5}\n')
    assert _lines(tail)[(0, "h-1")][-1] == b'{"e":5}'  # the new file's, by its name
    assert _lines(tail) == {}  # and kept open from the next look
    assert stream.fd is not None and os.fstat(stream.fd).st_ino == path.stat().st_ino
    tail.close()
    assert stream.fd is None


def test_tail_reads_a_call_file_by_index_only_what_is_new_and_what_was_pending(tmp_path: Path) -> None:
    _stream(tmp_path, 0).write_bytes(b'{"a":1}\n')
    calls = CallFile(tmp_path / "ranks" / "rank-0" / "h-1.calls", head=4, ring=8)
    for seq in (1, 2, 3):
        index = calls.begin(10.0 + seq, seq, 4, 0, 0, 0)
        if seq != 2:
            calls.end(index, 10.5 + seq)
    tail = Tail(tmp_path)

    def looked() -> list[int]:
        list(tail.look())
        return [i for got in tail.look_calls() for i in got.index.tolist()]

    assert looked() == [0, 1, 2]
    assert looked() == [1]  # nothing new: the pending call read again, nothing else
    read = tail.bytes_read
    calls.end(1, 12.9)
    for seq in range(4, 30):
        calls.begin(10.0 + seq, seq, 4, 0, 0, 0)
    list(tail.look())
    (got,) = tail.look_calls()
    assert got.index.tolist() == [1, *range(21, 29)]  # 3..20 went round the ring before this look
    assert got.records["end"][0] == 12.9
    assert tail.bytes_read - read == 9 * CALL.size


def test_tail_follows_a_long_stream_from_its_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tail_module, "START_TAIL_BYTES", 100)
    monkeypatch.setattr(tail_module, "HEAD_BYTES", 20)
    path = _stream(tmp_path, 0)
    path.write_bytes(b"".join(b'{"n":%d}\n' % i for i in range(100)))
    tail = Tail(tmp_path)
    (stream, data), *_ = list(tail.look())
    lines = data.split(b"\n")
    assert stream.partial and tail.bytes_read == 100
    assert lines[:2] == [b'{"n":0}', b'{"n":1}']  # the head's whole lines (its start record)
    assert lines[-1] == b'{"n":99}' and all(json.loads(line) for line in lines)  # the cut line left out
    assert json.loads(lines[2])["n"] > 80


def _steps_looked(tail: Tail) -> list[int]:
    list(tail.look())
    return [step for got in tail.look_steps() for step in got.records["step"].tolist()]


def test_tail_keeps_a_growing_slot_file_open_and_opens_a_quiet_one_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A steps file that grew stays open for the next look (one ``pread`` of its header's
    count, one of the new records: no open); one that did not grow is not read again but
    closed, and opened again at the next look, which sees a record written late."""
    _stream(tmp_path, 0).write_bytes(b'{"a":1}\n')
    written = step_file(tmp_path / "ranks" / "rank-0" / "h-1.steps")
    opened: list[str] = []
    real_open = tail_module.os.open

    def counted(path: str | Path, *args: int) -> int:
        opened.append(Path(path).name)
        return real_open(path, *args)

    monkeypatch.setattr(tail_module.os, "open", counted)
    tail = Tail(tmp_path)
    assert _steps_looked(tail) == []  # no record yet
    followed = tail.streams[(0, "h-1")].steps
    assert followed is not None and followed.fd is None
    for step in (1, 2):
        written.put(10.0 + step, 1.0, 0.5, 0.0, step, 0, STEP_END)
    opened.clear()
    assert _steps_looked(tail) == [1, 2] and opened.count("h-1.steps") == 1 and followed.fd is not None
    written.put(13.0, 1.0, 0.5, 0.0, 3, 0, STEP_END)
    read = tail.bytes_read
    opened.clear()
    assert _steps_looked(tail) == [3] and opened.count("h-1.steps") == 0  # read through the open file
    assert tail.bytes_read - read == STEP.size  # the new record only
    read = tail.bytes_read
    assert _steps_looked(tail) == [] and tail.bytes_read == read and followed.fd is None  # quiet: closed
    written.put(14.0, 1.0, 0.5, 0.0, 4, 0, STEP_END)  # late
    opened.clear()
    assert _steps_looked(tail) == [4] and opened.count("h-1.steps") == 1  # opened again, and seen
    tail.close()
    assert followed.fd is None and tail._open == 0
    written.close()


def test_tail_keeps_no_more_files_open_than_its_budget_and_reads_them_all(tmp_path: Path) -> None:
    files = []
    for rank in range(4):
        _stream(tmp_path, rank).write_bytes(b'{"a":1}\n')
        files.append(step_file(tmp_path / "ranks" / f"rank-{rank}" / "h-1.steps"))
    tail = Tail(tmp_path, max_open=2)
    for step in (1, 2, 3):
        for rank, f in enumerate(files):
            f.put(10.0 + step, 1.0, 0.5, 0.0, 10 * rank + step, 0, STEP_END)
        assert sorted(_steps_looked(tail)) == [10 * rank + step for rank in range(4)]
        held = [f.fd for s in tail.streams.values() for f in (s, s.steps) if f is not None and f.fd is not None]
        assert tail._open == len(held) == 2  # streams and slot files together
    tail.close()
    assert tail._open == 0 and all(s.fd is None and s.steps and s.steps.fd is None for s in tail.streams.values())


def test_memory_files_are_read_every_other_look_and_at_the_last(tmp_path: Path) -> None:
    """A memory reading written after a look is shown at the first look MEM_LOOK_S after
    the memory files were last read (not at the one a second later), and at a whole look
    (the last one, when the run ended) at once."""
    clock = Clock()
    _stream(tmp_path, 0).write_bytes(b'{"a":1}\n')
    readings = mem_file(tmp_path / "ranks" / "rank-0" / "h-1.mem")
    tail, live = Tail(tmp_path, clock=clock), LiveRun()

    def shown(rss: int, whole: bool = False) -> int | None:
        readings.put(clock.now, rss, -1, -1, -1, -1, 0, -1, 0)
        live.update(tail, whole)
        clock.now += 1.0
        return live.ranks[0].mem_now

    assert shown(100) == 100
    assert shown(200) == 100 and tail_module.MEM_LOOK_S > 1.0  # read a second ago: not yet
    assert shown(300) == 300  # both readings read now
    assert live.ranks[0].mem_peak == 300
    assert shown(400) == 300
    assert shown(500, whole=True) == 500
    tail.close()
    readings.close()


def test_tail_reads_a_slot_file_made_anew_or_cut_as_far_as_it_goes(tmp_path: Path) -> None:
    """A steps file replaced by a new one (its count lower than read) is read from its
    start, whether the old one was held open or not; a header cut short reads as nothing
    yet, then as the file once it is whole."""
    _stream(tmp_path, 0).write_bytes(b'{"a":1}\n')
    path = tmp_path / "ranks" / "rank-0" / "h-1.steps"
    old = step_file(path)
    for step in range(1, 6):
        old.put(10.0 + step, 1.0, 0.5, 0.0, step, 0, STEP_END)
    tail = Tail(tmp_path)
    assert _steps_looked(tail) == [1, 2, 3, 4, 5]
    old.put(16.0, 1.0, 0.5, 0.0, 6, 0, STEP_END)
    assert _steps_looked(tail) == [6]  # held open now
    old.close()
    path.unlink()
    new = step_file(path)
    for step in (1, 2):
        new.put(20.0 + step, 1.0, 0.5, 0.0, 100 + step, 0, STEP_END)
    assert _steps_looked(tail) == []  # the open file is the old one: it did not grow, closed
    assert _steps_looked(tail) == [101, 102]  # opened again: the new file, from its start
    new.close()
    data = path.read_bytes()
    path.write_bytes(data[:20])  # cut inside its header
    assert _steps_looked(tail) == []
    path.write_bytes(data)
    assert _steps_looked(tail) == []  # whole again, its count as read: nothing new
    with open(path, "r+b") as f:  # a third record, written as the writer would
        rec = np.frombuffer(data, STEP_DTYPE, count=1, offset=HEADER.size + STEP.size).copy()
        rec["step"], rec["stamp"] = 103, 3
        f.seek(HEADER.size + 2 * STEP.size)
        f.write(rec.tobytes())
        f.seek(COUNT_OFFSET)
        f.write((3).to_bytes(8, "little"))
    assert _steps_looked(tail) == [103]
    tail.close()


def test_a_rank_folder_is_listed_again_only_when_it_changed(tmp_path: Path) -> None:
    """At a rescan a rank folder whose modification time did not change is not listed
    (a segment made there without changing it waits for the full listing every
    FULL_RESCAN_S); one that changed is, and once more at the rescan after."""
    clock = Clock()
    first = _stream(tmp_path, 0)
    first.write_bytes(b'{"a":1}\n')
    folder = first.parent
    tail = Tail(tmp_path, clock=clock)
    assert _lines(tail) == {(0, "h-1"): [b'{"a":1}']}
    clock.now += tail_module.RESCAN_S
    assert _lines(tail) == {}  # listed again: it was new at the rescan before
    stamp = folder.stat().st_mtime_ns
    _stream(tmp_path, 0, "h-1.0001.jsonl").write_bytes(b'{"b":2}\n')
    os.utime(folder, ns=(stamp, stamp))  # as if nothing was made in it
    clock.now += tail_module.RESCAN_S
    assert _lines(tail) == {}  # not listed
    clock.now += tail_module.FULL_RESCAN_S
    assert _lines(tail) == {(0, "h-1"): [b'{"b":2}']}  # the full listing finds it
    _stream(tmp_path, 0, "h-2.0000.jsonl").write_bytes(b'{"c":3}\n')
    clock.now += tail_module.RESCAN_S
    assert _lines(tail) == {(0, "h-2"): [b'{"c":3}']}  # the folder changed: listed


def _feed(run_dir: Path, pieces: int, seed: int = 0) -> LiveRun:
    """A recorded run's streams, call files, steps files and memory files taken in as a
    tail would see them: each stream cut at random places, and with each piece the steps-
    and memory-file records written and the calls begun up to its last record (and, as a
    tail reads them again, the calls pending at the last piece)."""
    live = LiveRun()
    rng = random.Random(seed)
    for folder in sorted((run_dir / "ranks").iterdir()):
        for path in sorted(folder.glob("*.jsonl")):
            data = path.read_bytes()
            cuts = sorted(rng.sample(range(1, len(data)), pieces - 1)) if pieces > 1 else []
            process = path.name.split(".")[0]
            stream = tail_module.Followed(int(folder.name.split("-")[1]), process, 0, path)
            calls = read_calls(folder / (process + ".calls"), "rank", [])
            begun = np.maximum.accumulate(calls.records["t"]) if len(calls) else np.zeros(0)
            steps = read_steps(folder / (process + ".steps"), "rank", []).records
            written = np.maximum.accumulate(steps["t"]) if len(steps) else np.zeros(0)
            mem = read_mem(folder / (process + ".mem"), "rank", []).records
            read = np.maximum.accumulate(mem["t"]) if len(mem) else np.zeros(0)
            rest, given, given_steps, given_mem, pending = b"", 0, 0, 0, np.zeros(0, dtype=np.int64)
            for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True):
                chunk = rest + data[a:b]
                cut = chunk.rfind(b"\n")
                lines, rest = (chunk[:cut], chunk[cut + 1 :]) if cut >= 0 else (b"", chunk)
                last = json.loads(lines.rsplit(b"\n", 1)[-1])["t"] if lines else -1.0
                done = len(steps) if b == len(data) else int(np.searchsorted(written, last, side="right"))
                live.take([(stream, lines)])
                part = np.arange(given_steps, max(given_steps, done))
                live.take_steps(tail_module.Batch([stream], steps[part], part, np.zeros(len(part), dtype=np.int64)))
                given_steps = max(given_steps, done)
                upto_mem = len(mem) if b == len(data) else int(np.searchsorted(read, last, side="right"))
                part = np.arange(given_mem, max(given_mem, upto_mem))
                live.take_mem(tail_module.Batch([stream], mem[part], part, np.zeros(len(part), dtype=np.int64)))
                given_mem = max(given_mem, upto_mem)
                upto = len(calls) if b == len(data) else int(np.searchsorted(begun, last, side="right"))
                at = np.concatenate((pending, np.arange(given, max(given, upto))))
                owner = np.zeros(len(at), dtype=np.int64)
                live.take_calls(tail_module.Batch([stream], calls.records[at], calls.index[at], owner))
                pending = at[calls.records["end"][at] == 0.0]
                given = max(given, upto)
    return live


def test_live_state_matches_the_analysis_whatever_the_pieces() -> None:
    run_dir = FIXTURES / "diff" / "straggler"
    summary = analyze(run_dir).summary
    assert summary is not None
    whole, pieces = _feed(run_dir, 1), _feed(run_dir, 40, seed=3)
    for live in (whole, pieces):
        ranks = live.ranks
        assert sorted(ranks) == [0, 1] and live.ended() and live.world_size() == 2
        for r in summary["ranks"]:
            rank = ranks[r["rank"]]
            assert rank.step == r["steps"] == 7
            assert rank.mem_peak == r["peak_memory"]["rss_bytes"]
            assert rank.ended == ("exit", "exit 0") and not rank.pending
    assert [list(r.durs) for r in whole.ranks.values()] == [list(r.durs) for r in pieces.ranks.values()]
    checks = whole.checks(now=max(r.last_t for r in whole.ranks.values()))
    assert [(c.id, c.ranks) for c in checks] == [("slower", [1])]
    assert not _feed(FIXTURES / "diff" / "r8", 7).checks(now=0.0)  # healthy: quiet


def test_a_stall_reads_as_one_rank_outside_any_collective_and_the_other_waiting(tmp_path: Path) -> None:
    """fixtures/hung-ranks: rank 1 sleeps in its data loading at step 3; rank 0 waits in the
    next collective. Cut the streams 6 s after rank 1's last step, as a watch would see them."""
    source = FIXTURES / "hung-ranks"
    last_step = max(read_steps(next((source / "ranks" / "rank-1").glob("*.steps")), "rank", []).records["t"].tolist())
    now = last_step + 6.0
    for folder in (source / "ranks").iterdir():
        for path in folder.glob("*.jsonl"):
            kept = []
            for line in path.read_bytes().splitlines(keepends=True):
                t = json.loads(line).get("t")
                if isinstance(t, (int, float)) and t > now:
                    break
                kept.append(line)
            target = tmp_path / "ranks" / folder.name / path.name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(b"".join(kept))
            process = path.name.split(".")[0]
            calls = read_calls(folder / (process + ".calls"), "rank", [])
            cut = CallFile(target.parent / (process + ".calls"), calls.head, calls.ring)
            rows = calls.records
            columns = (rows[name].tolist() for name in ("t", "end", "seq", "bytes", "step", "gid", "shape"))
            for t, end, seq, nbytes, step, gid, shape in zip(*columns, strict=True):
                if t <= now:  # as the call file was at ``now``: a call that ended later, pending
                    index = cut.begin(t, seq, nbytes, step, gid, shape)
                    if end <= now:
                        cut.end(index, end)
            cut.close()
            written = step_file(target.parent / (process + ".steps"))
            for rec in read_steps(folder / (process + ".steps"), "rank", []).records.tolist():
                if rec[0] <= now:
                    written.put(*rec[:-1])
            written.close()
    live = _feed(tmp_path, 5)
    checks = {c.id: c for c in live.checks(now)}
    assert checks["not-stepping"].ranks == [1] and "in no collective" in checks["not-stepping"].text
    assert checks["waiting"].ranks == [0]
    rows, _, _ = live.view(now)
    assert rows[0]["pending"] is not None and rows[0]["pending"]["for_s"] > 1
    assert rows[1]["pending"] is None and rows[1]["state"] == "stalled 6s (watchdog)"  # its watchdog fired at 5 s
    assert checks["stall-watchdog"].ranks == [0, 1]
    assert not live.ended()


def test_calls_of_many_processes_taken_in_at_once_are_each_process_alone() -> None:
    """One batch of several processes' calls (each its own async shapes, steps that go back
    when a pending call is read again, ends not yet written) leaves each process as a
    call-by-call fold of its own calls would: its seconds in synchronous calls per step,
    the calls pending (those not ended), the latest time."""
    rng = np.random.default_rng(5)
    live = LiveRun()
    streams, parts, want = [], [], []
    for n in range(5):
        stream = tail_module.Followed(n, f"h-{n}", 0, Path(f"h-{n}.0000.jsonl"))
        is_async = {shape: bool(rng.integers(2)) for shape in range(4)}
        shapes = [b'{"k":"shape","t":1.0,"id":%d,"op":"op%d","async":%s}' % (s, s, b"true" if a else b"false")
                  for s, a in is_async.items()]  # fmt: skip
        live.take([(stream, b"\n".join(shapes))])
        calls = np.zeros(int(rng.integers(0, 40)), CALL_DTYPE)
        calls["t"] = 100 + rng.random(len(calls)) * 10
        calls["end"] = np.where(rng.random(len(calls)) < 0.2, 0.0, calls["t"] + rng.random(len(calls)))
        calls["step"] = np.sort(rng.integers(0, 6, len(calls)))[rng.permutation(len(calls))] if n % 2 else 3
        calls["seq"], calls["gid"] = np.arange(len(calls)), n % 2
        calls["shape"] = rng.integers(0, 5, len(calls))  # 4: a shape never declared
        waited: dict[int, float] = {}
        for t, end, step, shape in calls[["t", "end", "step", "shape"]].tolist():
            if end != 0.0 and not is_async.get(shape, False):
                waited[step] = waited.get(step, 0.0) + (end - t)
        pending = {(n % 2, seq): (t, f"op{shape}" if shape < 4 else "?")
                   for t, end, seq, shape in calls[["t", "end", "seq", "shape"]].tolist() if end == 0.0}  # fmt: skip
        latest = max([0.0, *calls["t"].tolist(), *calls["end"].tolist()])
        streams.append(stream)
        parts.append(calls)
        want.append((waited, pending, latest))
    owner = np.repeat(np.arange(len(parts)), [len(p) for p in parts])
    records = np.concatenate(parts)
    live.take_calls(tail_module.Batch(streams, records, np.arange(len(records)), owner))
    for stream, (waited, pending, latest) in zip(streams, want, strict=True):
        rank = live.processes[(stream.rank, stream.process)]
        assert rank.waited.keys() == waited.keys()
        assert all(rank.waited[k] == pytest.approx(v) for k, v in waited.items())
        assert rank.pending == pending and rank.last_t == latest
    live.take_calls(tail_module.Batch(streams[:1], records[:0], np.zeros(0, np.int64), owner[:0]))
    assert not live.processes[(0, "h-0")].pending  # read again and not there: gone round the ring


def test_steps_of_many_processes_taken_in_at_once_are_each_process_alone() -> None:
    """One batch of several processes' steps-file records leaves each process as its own
    records would: its steps (number, duration), the phase its last edge says it is in, the
    latest time; a process with no record in the batch is left as it was."""
    rng = np.random.default_rng(7)
    live = LiveRun()
    streams, parts, want = [], [], []
    for n in range(6):
        stream = tail_module.Followed(n, f"h-{n}", 0, Path(f"h-{n}.0000.jsonl"))
        live.take([(stream, b'{"k":"label","t":1.0,"id":3,"text":"backward"}')])
        recs = np.zeros(int(rng.integers(0, 9)) if n != 2 else 0, STEP_DTYPE)
        recs["t"] = 50 + np.sort(rng.random(len(recs)))
        recs["kind"] = rng.integers(0, 3, len(recs))
        recs["label"] = np.where(rng.random(len(recs)) < 0.5, 3, 4)  # 4: a label never declared
        recs["step"] = np.arange(len(recs)) + 10 * n
        recs["dur"] = np.where(recs["kind"] == STEP_END, rng.random(len(recs)), 0.0)
        ends = recs[recs["kind"] == STEP_END]
        edges = recs[recs["kind"] != STEP_END]
        phase = None if not len(edges) or edges["kind"][-1] != BEGIN else "backward" if edges["label"][-1] == 3 else "?"
        latest = float(recs["t"].max()) if len(recs) else 1.0  # the label line's time
        streams.append(stream)
        parts.append(recs)
        want.append((ends["step"].tolist(), ends["dur"].tolist(), phase, latest))
    owner = np.repeat(np.arange(len(parts)), [len(p) for p in parts])
    records = np.concatenate(parts)
    live.take_steps(tail_module.Batch(streams, records, np.arange(len(records)), owner))
    assert {p for *_, p, _ in want} >= {None, "backward", "?"}
    for stream, (steps, durs, phase, latest) in zip(streams, want, strict=True):
        rank = live.processes[(stream.rank, stream.process)]
        assert [s for s, _ in rank.timed] == [s for s in steps if s > 1] and list(rank.durs) == durs
        assert rank.step == (steps[-1] if steps else 0) and rank.phase == phase and rank.last_t == latest


def test_memory_readings_of_many_processes_taken_in_at_once_are_each_process_alone() -> None:
    """Two batches of several processes' memory readings (RSS only, CUDA ones, RSS readings
    before and after a process's first CUDA one, unread RSS) leave each process as its
    readings one by one would: the CUDA allocator's figures once it has one, else RSS;
    memory now the latest reading's, the peak the highest."""
    rng = np.random.default_rng(11)
    live = LiveRun()
    streams = [tail_module.Followed(n, f"h-{n}", 0, Path(f"h-{n}.0000.jsonl")) for n in range(8)]
    want: dict[int, tuple[int | None, int | None, str]] = {n: (None, None, "rss") for n in range(8)}
    for _ in range(2):
        parts = []
        for n in range(8):
            recs = np.zeros(int(rng.integers(0, 7)), MEM_DTYPE)
            recs["rss"] = np.where(rng.random(len(recs)) < 0.2, -1, rng.integers(100, 1000, len(recs)))
            recs["device"] = np.where(rng.random(len(recs)) < (0.0 if n < 3 else 0.5), 0, -1)
            recs["alloc"], recs["max_alloc"] = rng.integers(1, 50, len(recs)), rng.integers(50, 90, len(recs))
            now, peak, metric = want[n]
            for rss, device, alloc, max_alloc in recs[["rss", "device", "alloc", "max_alloc"]].tolist():
                if device >= 0:
                    peak = None if metric != "cuda" else peak
                    metric, now, high = "cuda", alloc, max_alloc
                elif metric == "cuda" or rss < 0:
                    continue
                else:
                    now = high = rss
                peak = high if peak is None else max(peak, high)
            want[n] = (now, peak, metric)
            parts.append(recs)
        owner = np.repeat(np.arange(8), [len(p) for p in parts])
        records = np.concatenate(parts)
        live.take_mem(tail_module.Batch(streams, records, np.arange(len(records)), owner))
    got = {n: (r.mem_now, r.mem_peak, r.mem_metric) for n, r in live.ranks.items()}
    assert got == {n: w for n, w in want.items() if n in got} and len(got) == 8
    assert {m for *_, m in want.values()} == {"rss", "cuda"}


def test_a_rank_blocked_on_handles_is_not_the_slower_one() -> None:
    """Two ranks, every step 0.3 s on both: rank 0 blocked 0.15 s of it on async
    collectives' handles (the steps file's ``waited``), waiting for rank 1. Its work is
    the other half, and rank 1 is the slower one; with the waits not recorded (0) the two
    look alike and nothing is named."""

    def checks(blocked: float) -> list[tuple[str, list[int]]]:
        live = LiveRun()
        streams, parts = [], []
        for n in range(2):
            stream = tail_module.Followed(n, f"h-{n}", 0, Path(f"h-{n}.0000.jsonl"))
            live.take([(stream, b'{"k":"start","t":1.0,"rank":%d,"world_size":2}' % n)])
            recs = np.zeros(12, STEP_DTYPE)
            recs["kind"], recs["step"], recs["dur"] = STEP_END, np.arange(1, 13), 0.3
            recs["t"] = 10.0 + 0.3 * np.arange(1, 13)
            recs["waited"] = blocked if n == 0 else 0.0
            streams.append(stream)
            parts.append(recs)
        owner = np.repeat(np.arange(2), 12)
        records = np.concatenate(parts)
        live.take_steps(tail_module.Batch(streams, records, np.arange(len(records)), owner))
        return [(c.id, c.ranks) for c in live.checks(now=13.7) if c.id == "slower"]

    assert checks(0.15) == [("slower", [1])]
    assert checks(0.0) == []


def _synthetic(ranks: int, now: float) -> LiveRun:
    live = LiveRun()
    for n in range(ranks):
        r = live.processes[(n, f"node{n // 8}-{n}")] = LiveRank(n, f"node{n // 8}-{n}", host=f"node{n // 8}")
        r.started, r.world_size, r.step, r.last_step_t = now - 600, ranks, 500, now - 0.5
        r.durs.extend([1.0] * 16)
        r.timed.extend((step, 0.6 if n != 77 else 1.5) for step in range(485, 501))
        r.mem_now, r.mem_peak = 12 << 30, (13 << 30) + n * 1000
    live.processes[(512, "node64-512")].last_step_t = now - 30
    live.processes[(512, "node64-512")].step = 471
    live.processes[(513, "node64-513")].pending[(0, 9)] = (now - 29, "all_reduce")
    live.processes[(513, "node64-513")].last_step_t = now - 30
    live.processes[(900, "node112-900")].ended = ("exception", "Error: [b]x[/b]")
    return live


def test_1024_ranks_fit_an_80x24_screen_with_the_odd_ranks_named() -> None:
    now = 1_000_000.0
    live = _synthetic(1024, now)
    rows, checks, median = live.view(now)
    view = {"run_dir": Path("runs/big"), "now": now, "rows": rows, "checks": checks, "world_size": 1024,
            "median_step": median, "bytes_read": 1 << 30, "interval": 1.0, "verdict": None}  # fmt: skip
    console = Console(file=io.StringIO(), width=80, height=24, record=True, color_system=None)
    console.print(render_watch(view, 80, 24))
    lines = console.export_text().rstrip("\n").splitlines()
    assert len(lines) <= 24 and all(len(line) <= 80 for line in lines), "\n".join(lines)
    text = "\n".join(lines)
    assert "1024/1024 ranks" in text
    table = {line.split()[0]: line for line in lines[3:] if line and line[0].isdigit()}
    assert "no step 30s" in table["512"] and "all_reduce 29.0s" in next(v for k, v in table.items() if "513" in k)
    assert "Error: [b]x[/b]" in table["900"]  # text from the run stays text
    assert "slower" in table["77"]
    assert "1,020 ranks" in text and "running" in text  # the rest grouped, counted (their ranges are too long)
    assert {c.id for c in checks} >= {"ended-badly", "not-stepping", "waiting", "slower"}


def test_cli_once_and_bad_input(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["watch", str(FIXTURES / "diff" / "straggler"), "--once"])
    assert result.exit_code == 0, result.output
    assert "verdict: warning: rank 1 is the straggler" in result.output
    with pytest.raises(SystemExit) as exc:
        main(["watch", str(tmp_path)])
    assert exc.value.code == 3
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "lorascope-run", "version": 3, "launches": []}))
    result = CliRunner().invoke(cli, ["watch", str(tmp_path), "--once"])
    assert result.exit_code == 0 and "0 ranks" in result.output  # a job not started yet


def test_escape_sequences_from_the_run_are_shown_escaped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run directory's name (and any string from its records) may hold an escape
    sequence that would clear the on-call engineer's screen: watch shows it escaped."""
    monkeypatch.chdir(tmp_path)  # a short path: the screen's lines are cut at 80 columns
    shutil.copytree(FIXTURES / "diff" / "straggler", "r\x1b[2Jc")
    result = CliRunner().invoke(cli, ["watch", "r\x1b[2Jc", "--once"])
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.output, repr(result.output)
    assert "r\\x1b[2Jc" in result.output
