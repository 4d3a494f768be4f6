"""Writing and reading streams: durability, torn lines, rotation, and clean errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lorascope.errors import BadInputError, FormatVersionError
from lorascope.rundir.format.schema import FORMAT_VERSION
from lorascope.rundir.format.writer import Line, Stream, record_launch, stream_prefix
from lorascope.rundir.loading.reader import load_run
from tests.helpers import Calls, Steps

START = {
    "k": "start",
    "rank": 0,
    "world_size": 1,
    "local_rank": 0,
    "pid": 42,
    "host": "h",
    "argv": [],
    "versions": {},
    "device": "cpu",
}


#: How long the SIGKILL test waits for its writer to reach 2 MB (0.1 s on an idle core).
WRITER_TIMEOUT_S = 60


def make_run(
    tmp_path: Path,
    records: list[dict],
    segment_bytes: int = 1 << 20,
    keep: int = 4,
    calls: list[dict[str, Any]] | None = None,
) -> Path:
    """A one-rank run: ``records`` in its stream (``step`` records in its steps file), ``calls`` (keyword arguments of
    :meth:`tests.helpers.Calls.call`) in its call file."""
    record_launch(tmp_path, "h-1", ["job"])
    prefix = stream_prefix(tmp_path, 0, "h", 42)
    stream = Stream(prefix, segment_bytes=segment_bytes, keep_segments=keep)
    stream.write(dict(START))
    steps = Steps(stream, prefix, 1.0) if any(rec["k"] == "step" for rec in records) else None
    for rec in records:
        if rec["k"] == "step" and steps is not None:  # into the steps file, as the probes write them
            steps.record({"t": 1.5, **rec})
        else:
            stream.write(rec)
    if calls is not None:
        writer = Calls(stream, prefix, 1.0)
        for call in calls:
            writer.call(**call)
        writer.close()
    stream.close()
    return tmp_path


def zero_param(step: Any, **extra: Any) -> dict[str, Any]:
    """A stream record of a kind the reader keeps every one of, in order (an entry into
    ZeRO-3's parameter state)."""
    return {"k": "zero_param", "what": "GatheredParameters", "op": "enter", "step": step, **extra}


def stream_file(run: Path) -> Path:
    return next((run / "ranks" / "rank-0").glob("*.jsonl"))


def test_round_trip(tmp_path: Path) -> None:
    t = time.time()
    run = load_run(
        make_run(
            tmp_path,
            [
                {"k": "group", "gid": 0, "name": "default_pg", "ranks": [0], "backend": "gloo"},
                {"k": "step", "step": 1, "dur": 0.5, "loss": 2.0, "src": "torch"},
            ],
            calls=[
                {
                    "t": t,
                    "seq": 1,
                    "nbytes": 8,
                    "end": t + 0.1,
                    "op": "all_reduce",
                    "dtype": "float32",
                    "site": "train.py:3 in main",
                },
                {"t": t + 0.2, "seq": 2, "step": 1, "nbytes": 0, "op": "barrier"},
            ],
        )
    )
    rank = run.ranks[0]
    assert rank.pid == 42 and run.warnings == []
    assert [(c.op, c.group, c.pending) for c in rank.collectives] == [
        ("all_reduce", "default_pg", False),
        ("barrier", "default_pg", True),
    ]
    assert rank.steps[0]["loss"] == 2.0


def test_torn_last_line_is_a_warning(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, [{"k": "step", "step": 1, "dur": 0.5, "loss": None, "src": "torch"}])
    with open(stream_file(run_dir), "ab") as f:
        f.write(b'{"k":"step","step":2,"du')
    run = load_run(run_dir)
    assert len(run.ranks[0].steps) == 1
    assert any("torn last record" in w for w in run.warnings)


def test_corrupt_middle_line_is_an_error(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, [{"k": "step", "step": 1, "dur": 0.5, "loss": None, "src": "torch"}])
    path = stream_file(run_dir)
    lines = path.read_bytes().split(b"\n")
    lines[1] = b"\x00garbage"
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(BadInputError, match=r"\.jsonl:2: not a JSON record"):
        load_run(run_dir)


def test_schema_violation_names_file_and_line(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, [zero_param("one")])
    with pytest.raises(BadInputError, match=r"\.jsonl:2: a 'zero_param' record field 'step' is str"):
        load_run(run_dir)


def test_stream_must_begin_with_start(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, [])
    stream_file(run_dir).write_text(json.dumps({"k": "end", "t": 1, "status": "exit", "code": 0}) + "\n")
    with pytest.raises(BadInputError, match="does not begin with a 'start' record"):
        load_run(run_dir)


def test_rotation_keeps_first_and_newest_segments(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, [zero_param(i, pad="x" * 200) for i in range(1, 101)], segment_bytes=2000, keep=2)
    files = sorted(p.name for p in (run_dir / "ranks" / "rank-0").iterdir())
    assert files[0].endswith(".0000.jsonl") and len(files) == 3
    run = load_run(run_dir)
    kept = [s["step"] for s in run.ranks[0].zero_params]
    assert kept[-1] == 100 and 1 in kept and len(kept) < 100
    assert any("rotated away" in w for w in run.warnings)


def test_newer_format_is_refused(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, [])
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["version"] = FORMAT_VERSION + 1
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FormatVersionError, match=f"format v{FORMAT_VERSION + 1} is newer"):
        load_run(run_dir)


def test_a_launch_raises_an_older_manifests_version(tmp_path: Path) -> None:
    """A run directory first written by an older lorascope says the newer format once a
    launch of this one writes into it (its ranks write that format); an older lorascope
    then refuses it rather than misread it."""
    run_dir = make_run(tmp_path, [])
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["version"] = 1
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FormatVersionError, match="format v1; this lorascope reads v3"):
        load_run(run_dir)
    record_launch(run_dir, "h-2", ["job"])
    assert json.loads((run_dir / "manifest.json").read_text())["version"] == FORMAT_VERSION == 3
    load_run(run_dir)


def test_sigkill_mid_stream_leaves_every_record(tmp_path: Path) -> None:
    """A writer SIGKILLed while writing as fast as it can: every line before the last is whole."""
    record_launch(tmp_path, "h-1", ["job"])
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from lorascope.rundir.format.writer import Stream, stream_prefix\n"
        f"s = Stream(stream_prefix(Path({str(tmp_path)!r}), 0, 'h', 42))\n"
        f"s.write({START!r})\n"
        "print('ready', flush=True)\n"
        "i = 0\n"
        "while True:\n"
        "    i += 1\n"
        f"    s.write({{**{zero_param(0)!r}, 'step': i, 'pad': 'y' * (i % 997)}})\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    deadline = time.monotonic() + WRITER_TIMEOUT_S
    while (size := stream_file(tmp_path).stat().st_size) < 2_000_000:
        if (status := proc.poll()) is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            how = "still running" if status is None else f"it exited with {status}"
            pytest.fail(f"the writer wrote {size:,} bytes, not 2 MB, within {WRITER_TIMEOUT_S} s ({how})")
        time.sleep(0.005)  # the writer needs the CPU more than this loop does (2 cores, shared)
    proc.kill()
    proc.wait()
    run = load_run(tmp_path)
    steps = [s["step"] for s in run.ranks[0].zero_params]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) > 1000
    assert run.ranks[0].end is None


COLL = {"op": "all_gather_into_tensor", "nbytes": 32, "dtype": "float32", "async": True, "site": None, "step": 0}


def test_a_calls_end_and_error_come_from_its_record_and_its_coll_err(tmp_path: Path) -> None:
    """A call's end is written into its own record; its error is a ``coll_err`` record
    naming its index; a call never ended is pending."""
    run = load_run(
        make_run(
            tmp_path,
            [{"k": "group", "gid": 0, "name": "default_pg", "ranks": [0], "backend": "gloo"}],
            calls=[
                {"t": 10.0, "seq": 1, "end": 10.5, **COLL},
                {"t": 11.0, "seq": 2, "end": 11.5, **COLL},
                {"t": 12.0, "seq": 3, "end": 12.25, "err": "RuntimeError('x')", **COLL},
                {"t": 13.0, "seq": 4, **COLL},
            ],
        )
    )
    colls = run.ranks[0].collectives
    assert [(c.seq, c.start, c.end, c.err, c.pending) for c in colls] == [
        (1, 10.0, 10.5, None, False),
        (2, 11.0, 11.5, None, False),
        (3, 12.0, 12.25, "RuntimeError('x')", False),
        (4, 13.0, None, None, True),
    ]
    assert run.warnings == []


class Ended(Line):
    """A queued record formatted by the writer (a ``Line``), counting its formatting."""

    def __init__(self) -> None:
        super().__init__("", ())
        self.encoded = 0

    def encode(self) -> str:
        self.encoded += 1
        return json.dumps({**zero_param(self.encoded), "t": 1.0}) + "\n"


def test_records_are_queued_until_a_flush(tmp_path: Path) -> None:
    """``append`` only queues (nothing is formatted or written on the calling thread);
    ``flush`` and ``write`` write everything queued, in order."""
    record_launch(tmp_path, "h-1", ["job"])
    stream = Stream(stream_prefix(tmp_path, 0, "h", 42))
    stream.write(dict(START, t=0.5))
    lazy = Ended()
    stream.append(lazy)
    stream.append({"k": "warning", "t": 1.0, "category": "UserWarning", "message": "m", "filename": "f", "lineno": 1})
    assert lazy.encoded == 0 and stream_file(tmp_path).read_text().count("\n") == 1
    stream.flush()
    assert lazy.encoded == 1 and stream_file(tmp_path).read_text().count("\n") == 3
    stream.append({"k": "warning", "t": 2.0, "category": "UserWarning", "message": "m", "filename": "f", "lineno": 2})
    stream.write({"k": "end", "t": 3.0, "status": "exit", "code": 0})
    kinds = [json.loads(line)["k"] for line in stream_file(tmp_path).read_text().splitlines()]
    assert kinds == ["start", "zero_param", "warning", "warning", "end"]


def test_writer_thread_flushes_within_its_interval(tmp_path: Path) -> None:
    record_launch(tmp_path, "h-1", ["job"])
    stream = Stream(stream_prefix(tmp_path, 0, "h", 42))
    stream.write(dict(START, t=0.5))
    stream.start_writer(interval=0.02)
    stream.append({**zero_param(1), "t": 1.0})
    deadline = time.monotonic() + 5
    while "zero_param" not in stream_file(tmp_path).read_text():
        assert time.monotonic() < deadline, "the writer thread never flushed"
        time.sleep(0.005)
    stream.close()


def test_a_full_queue_drops_and_says_how_many(tmp_path: Path) -> None:
    record_launch(tmp_path, "h-1", ["job"])
    stream = Stream(stream_prefix(tmp_path, 0, "h", 42), queue_records=3)
    stream.write(dict(START, t=0.5))
    for i in range(1, 11):
        stream.append({**zero_param(i), "t": 1.0 + i})
    assert stream.dropped == 7
    stream.close()
    run = load_run(tmp_path)
    assert [s["step"] for s in run.ranks[0].zero_params] == [1, 2, 3]
    assert any("the probes dropped 7 record(s) (their queue was full)" in w for w in run.warnings)


def test_a_forked_child_writes_nothing(tmp_path: Path) -> None:
    record_launch(tmp_path, "h-1", ["job"])
    stream = Stream(stream_prefix(tmp_path, 0, "h", 42))
    stream.write(dict(START, t=0.5))
    stream.append({**zero_param(1), "t": 1.0})
    pid = os.fork()
    if pid == 0:  # the child: its copy of the queue and descriptor are off
        code = 0 if not stream.alive else 1
        stream.write({**zero_param(99), "t": 2.0})
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    stream.close()
    assert [s["step"] for s in load_run(tmp_path).ranks[0].zero_params] == [1]


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda p: p / "absent", "no such file or directory"),
        (lambda p: (p / "f.txt").write_text("x") and p / "f.txt", "f.txt"),
        (lambda p: p, "no manifest.json"),
        (lambda p: (p / "manifest.json").write_text("{not json") and p, "unreadable manifest"),
    ],
)
def test_cli_bad_input_is_one_line(tmp_path: Path, setup, message: str) -> None:
    target = setup(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "lorascope", "analyze", str(target)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 3
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and message in proc.stderr and "Traceback" not in proc.stderr


def test_rotated_segments_declare_the_shapes_their_calls_name(tmp_path: Path) -> None:
    """A call names its shape, declared once in the stream; each new segment begins with
    every shape declared so far, so the newest segments still read whole when the ones
    between (where a shape was first declared) are rotated away."""
    from lorascope.probes.collectives import _Shapes
    from lorascope.rundir.format.callfile import CallFile, calls_path

    record_launch(tmp_path, "h-1", ["job"])
    prefix = stream_prefix(tmp_path, 0, "h", 42)
    stream = Stream(prefix, segment_bytes=4000, keep_segments=2)
    shapes = _Shapes(stream)
    stream.write(dict(START, t=1.0))
    stream.write({"k": "group", "t": 1.0, "gid": 0, "name": "default_pg", "ranks": [0], "backend": "gloo"})
    calls = CallFile(calls_path(prefix))
    stream.write(
        {"k": "calls_file", "t": 1.0, "file": calls.path.name, "how": calls.how, "head": calls.head, "ring": calls.ring}
    )
    ops = ["all_reduce", "all_gather_into_tensor", "broadcast"]
    for seq in range(1, 301):
        op = ops[0] if seq < 200 else ops[seq % 3]  # two shapes declared only after segment 1
        key = (op, None, False, f"/j/t.py:{ops.index(op)} in f", None)
        sid = shapes.ids.get(key)
        if sid is None:
            sid = shapes.declare(key)
        calls.end(calls.begin(2.0 + seq, seq, 64, seq, 0, sid), 2.5 + seq)
        stream.write({**zero_param(seq), "t": 2.6 + seq})  # the stream grows: its segments rotate
    calls.close()
    stream.close()
    files = sorted((tmp_path / "ranks" / "rank-0").glob("*.jsonl"))
    assert [int(p.name.split(".")[1]) for p in files][0] == 0 and len(files) == 3  # 0 and the newest two
    newest = [json.loads(line) for line in files[-1].read_text().splitlines()]
    assert [r["k"] for r in newest[:4]] == ["segment", "shape", "shape", "shape"]
    assert {r["id"] for r in newest[1:4]} == {0, 1, 2}
    run = load_run(tmp_path)
    assert any("rotated away" in w for w in run.warnings)
    kept = run.ranks[0].collectives
    assert kept and {c.op for c in kept} == set(ops)
    assert all(c.site == f"/j/t.py:{ops.index(c.op)} in f" and c.bytes == 64 for c in kept)


def test_phase_edges_and_their_readings_go_to_the_steps_and_memory_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A phase edge goes to the steps file and its reading to the memory file, each name a
    ``label`` record of the stream declared once (odd names included), written as the JSON
    encoder writes a record; the readings read back as the ``mem`` records they were, RSS
    alone, with the heap, a CUDA rank's allocator counters."""
    from lorascope.probes import memory
    from lorascope.probes.session import Session
    from lorascope.rundir.format.writer import _encode
    from lorascope.rundir.loading.mem import as_records as mem_records
    from lorascope.rundir.loading.mem import read_mem
    from lorascope.rundir.loading.steps import as_records, read_steps
    from tests.helpers import step_probe

    stream = Stream(tmp_path / "r" / "s")
    session = Session(stream, rank=0, local_rank=0, world_size=1, sample_interval=0)
    mem = memory.MemoryProbe(session)
    steps = step_probe(session, mem, tmp_path / "k")
    cuda = {"device": 0, "alloc": 1, "reserved": 2 << 40, "max_alloc": 3}
    given = [{"rss": 123456789}, {"rss": 5, "heap": 7}, {"rss": 9, "cuda": cuda}, {"rss": 1}]
    readings = iter(given)
    monkeypatch.setattr(mem, "reading", lambda *_, **__: next(readings))
    session.step = 12
    edges = (("forward", "begin"), ('sa"ve \\ ✓\n', "end"), ("eval", "begin"), ("forward", "end"))
    for name, edge in edges:
        steps.phase(name, edge)
    stream.close()
    lines = next((tmp_path / "r").glob("s.*.jsonl")).read_text().splitlines(True)
    written = [json.loads(line) for line in lines]
    labels = [(i, r) for i, r in enumerate(written) if r["k"] == "label"]
    sources = [f"{n}.{e}" for n, e in edges]
    assert sorted(r["text"] for _, r in labels) == sorted({n for n, _ in edges} | set(sources))  # each once
    assert all(lines[i] == _encode({"k": "label", "t": r["t"], "id": r["id"], "text": r["text"]}) for i, r in labels)
    assert not [r for r in written if r["k"] in ("mem", "phase")]
    warnings: list[str] = []
    named = {r["id"]: r["text"] for _, r in labels}
    table = read_steps(tmp_path / "r" / "s.steps", "rank 0", warnings)
    _, phases = as_records(table.records, named, "rank 0", warnings)
    assert [(p["name"], p["edge"], p["step"]) for p in phases] == [(n, e, 12) for n, e in edges] and not warnings
    got = mem_records(read_mem(tmp_path / "r" / "s.mem", "rank 0", warnings), named, {}, "rank 0", warnings)
    assert [{k: v for k, v in m.items() if k != "t"} for m in got] == [
        {"src": src, "step": 12, **fields, "k": "mem"} for src, fields in zip(sources, given, strict=True)
    ]
    assert [list(m) for m in got] == [["src", "step", *fields, "k", "t"] for fields in given] and not warnings
    assert all(isinstance(m["t"], float) and p["t"] <= m["t"] for m, p in zip(got, phases, strict=True))
