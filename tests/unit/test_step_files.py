"""The steps file (lorascope/rundir/format/callfile.py's writer with layout.STEP_FIELDS, read
by lorascope/rundir/loading/steps.py): what is on disk, what the reader makes of it, torn
and cut records, a kill, `lorascope watch`'s tail."""

from __future__ import annotations

import errno
import json
import math
import mmap
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lorascope.errors import BadInputError
from lorascope.rundir.format import callfile as callfile_module
from lorascope.rundir.format.callfile import CHUNK_SLOTS, step_file, steps_path
from lorascope.rundir.format.layout import (
    BEGIN,
    END,
    HEADER,
    HEADER_FIELDS,
    STEP,
    STEP_END,
    STEP_FIELDS,
    STEP_V1,
    STEPS_HEAD,
    STEPS_MAGIC,
    STEPS_RING,
    STEPS_VERSION,
    file_size,
    offset_of,
)
from lorascope.rundir.loading.calls import STEP_DTYPE
from lorascope.rundir.loading.reader import RECENT_RECORDS, load_run
from lorascope.rundir.loading.steps import as_records, read_steps
from lorascope.rundir.loading.tail import Tail
from tests.helpers import START, Call, RankSpec, one_rank, write_run


def _header(path: Path) -> dict[str, Any]:
    return dict(zip((f for f, _, _ in HEADER_FIELDS), HEADER.unpack_from(path.read_bytes()), strict=True))


def test_a_step_record_is_48_bytes_of_its_table() -> None:
    assert STEP.size == 48 and STEP.format.startswith("<") and [f for f, _, _ in STEP_FIELDS][-1] == "stamp"


def test_records_read_back_as_the_stream_held_them(tmp_path: Path) -> None:
    """Phase edges and steps written with the probes' writer read back as the records the
    stream held before: key order, values, a loss none was read for as None."""
    path = tmp_path / "h-1.steps"
    f = step_file(path)
    f.put(10.5, 0.0, math.nan, 0.0, 0, 0, BEGIN)
    f.put(10.75, 0.0, math.nan, 0.0, 0, 0, END)
    f.put(11.0, 0.512345, 2.25, 0.0, 1, 1, STEP_END)
    f.put(12.0, 0.5, math.nan, 0.0, 2, 1, STEP_END)
    head = _header(path)
    assert (head["magic"], head["version"], head["record_size"], head["ring"], head["count"]) == (
        STEPS_MAGIC, STEPS_VERSION, STEP.size, 0, 4
    )  # fmt: skip
    warnings: list[str] = []
    table = read_steps(path, "rank 0", warnings)
    steps, phases = as_records(table.records, {0: "forward", 1: "torch"}, "rank 0", warnings)
    assert not warnings
    assert [json.dumps(p) for p in phases] == [
        json.dumps({"name": "forward", "edge": "begin", "step": 0, "k": "phase", "t": 10.5}),
        json.dumps({"name": "forward", "edge": "end", "step": 0, "k": "phase", "t": 10.75}),
    ]
    assert [json.dumps(s) for s in steps] == [
        json.dumps({"step": 1, "dur": 0.512345, "loss": 2.25, "src": "torch", "k": "step", "t": 11.0}),
        json.dumps({"step": 2, "dur": 0.5, "loss": None, "src": "torch", "k": "step", "t": 12.0}),
    ]


def test_the_file_grows_by_chunks_without_a_ring(tmp_path: Path) -> None:
    path = tmp_path / "h-1.steps"
    f = step_file(path)
    assert os.path.getsize(path) == file_size(CHUNK_SLOTS, 0, STEP)
    n = 3 * CHUNK_SLOTS + 5
    for i in range(n):
        f.put(float(i), 0.0, math.nan, 0.0, i, 0, BEGIN)
    assert os.path.getsize(path) == file_size(4 * CHUNK_SLOTS, 0, STEP)
    table = read_steps(path, "rank 0", [])
    assert table.records["step"].tolist() == list(range(n))  # every one kept, in order


def test_torn_and_cut_records_are_dropped_with_a_warning(tmp_path: Path) -> None:
    """A slot whose stamp is not its index's (never written, or torn) is dropped; a file
    cut in a record is read as far as it goes; a bad header is one warning, no steps."""
    path = tmp_path / "h-1.steps"
    f = step_file(path)
    for i in range(6):
        f.put(float(i), 1.0, 1.0, 0.0, i + 1, 0, STEP_END)
    f.close()
    data = bytearray(path.read_bytes())
    at = HEADER.size + 2 * STEP.size + offset_of(STEP_FIELDS, "stamp")
    data[at : at + 4] = (0).to_bytes(4, "little")  # record 2: begun, its stamp not yet written
    path.write_bytes(bytes(data[: HEADER.size + 5 * STEP.size + 17]))  # record 5 cut
    warnings: list[str] = []
    table = read_steps(path, "rank 0", warnings)
    assert table.records["step"].tolist() == [1, 2, 4, 5]
    assert any("2 step record(s) torn or never written" in w and "index 2" in w for w in warnings), warnings  # 2 and 5
    assert any("the step file is cut short" in w for w in warnings), warnings
    path.write_bytes(b"LSCALLS\0" + bytes(data[8 : HEADER.size]))
    warnings = []
    assert len(read_steps(path, "rank 0", warnings)) == 0
    assert warnings == [f"{path}: not a step file (its first bytes are b'LSCALLS\\x00'); rank 0's steps are not read"]


def test_without_a_shared_mapping_the_same_records_by_pwrite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> mmap.mmap:
        raise OSError(errno.ENODEV, "No such device")

    monkeypatch.setattr(callfile_module.mmap, "mmap", refuse)
    path = tmp_path / "h-1.steps"
    f = step_file(path)
    assert f.how == "pwrite (No such device)"
    for i in range(CHUNK_SLOTS + 3):
        f.put(float(i), 0.5, 1.0, 0.0, i + 1, 0, STEP_END)
    assert read_steps(path, "rank 0", []).records["step"].tolist() == list(range(1, CHUNK_SLOTS + 4))


@pytest.mark.parametrize("death", ["SIGKILL", "abort"])
def test_a_killed_process_leaves_every_step_it_wrote(tmp_path: Path, death: str) -> None:
    """A process that dies right after a record (no flush, no close, no exit handler)
    leaves it on disk: the page cache holds what was stored into the shared mapping."""
    path = tmp_path / "h-1.steps"
    n = 3 * CHUNK_SLOTS + 17  # across chunks
    kill = "os.kill(os.getpid(), signal.SIGKILL)" if death == "SIGKILL" else "os.abort()"
    code = (
        "import math, os, signal, sys\n"
        "from lorascope.rundir.format.callfile import step_file\n"
        f"f = step_file(__import__('pathlib').Path({str(path)!r}))\n"
        f"for i in range({n}):\n"
        "    f.put(float(i), 0.25, float(i), 0.0, i + 1, 0, 2)\n"
        "print('written', flush=True)\n"
        f"{kill}\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout == "written\n" and proc.returncode == (
        -signal.SIGKILL if death == "SIGKILL" else -signal.SIGABRT
    )
    warnings: list[str] = []
    table = read_steps(path, "rank 0", warnings)
    assert table.records["step"].tolist() == list(range(1, n + 1)) and not warnings
    assert table.records["loss"].tolist() == [float(i) for i in range(n)]


def _run(tmp_path: Path, steps_made: int = 6) -> Path:
    """A one-rank run whose phase edges and steps (one a CUDA loss given later, one
    without a loss) are in its steps file, a reading after each step in its memory file."""
    run = tmp_path / f"run{steps_made}"
    stream, steps = one_rank(run)
    for step in range(steps_made):
        t = 2.0 + step
        for name, at in (("forward", 0.0), ("backward", 0.5)):
            steps.phase(t + at, name, "begin", step)
            steps.phase(t + at + 0.25, name, "end", step)
        steps.step(t + 0.9, step + 1, 0.9, None if step == 2 else 1.0 / (step + 1), "deepspeed")
        steps.reading({"t": t + 0.95, "src": "step", "step": step + 1, "rss": 1000 + step})
    stream.write({"k": "loss", "t": 2.0 + steps_made, "step": 3, "loss": 0.3})
    stream.write({"k": "end", "t": 2.5 + steps_made, "status": "exit", "code": 0})
    stream.close()
    return run


def test_a_steps_file_is_read_into_steps_and_phases(tmp_path: Path) -> None:
    """The reader gives the detectors the steps file's steps (a later ``loss`` record put
    on its step) and phase edges, in order, and the per-step sums over them."""
    rank = load_run(_run(tmp_path)).ranks[0]
    assert [(s["step"], s["t"], s["dur"], s["src"]) for s in rank.steps] == [
        (n + 1, 2.9 + n, 0.9, "deepspeed") for n in range(6)
    ]
    assert [s["loss"] for s in rank.steps] == [1.0, 0.5, 0.3, 0.25, 0.2, 1 / 6]
    assert [(p["name"], p["edge"], p["step"], p["t"]) for p in rank.phases[:4]] == [
        ("forward", "begin", 0, 2.0), ("forward", "end", 0, 2.25), ("backward", "begin", 0, 2.5),
        ("backward", "end", 0, 2.75),
    ]  # fmt: skip
    assert len(rank.phases) == 24 and [m["rss"] for m in rank.mem] == [1000 + n for n in range(6)]
    assert rank.totals["steps"] == 6 and rank.totals["mem"] == 6 and rank.totals["step_time_median_s"] == 0.9
    assert rank.last_time == 8.5


def test_a_long_steps_file_is_decimated_as_it_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the step budget, the phase edges and readings decimation is sure to drop are
    never made from the files (a long run's would not fit), and what is kept is what
    decimating the whole run keeps: steps, phases, memory readings, the time outside
    backward, the totals."""
    from lorascope.rundir.loading import reader
    from lorascope.rundir.loading.reduce import decimate

    run = _run(tmp_path, 700)
    whole = load_run(run).ranks[0]
    assert whole.stride == 1 and len(whole.phases) == 4 * 700
    monkeypatch.setattr(reader, "steps_per_rank", lambda ranks: 64)
    read = load_run(run).ranks[0]
    assert read.stride == decimate(whole, 64) > 1
    assert read.steps == whole.steps and read.phases == whole.phases and read.mem == whole.mem
    assert len(read.phases) < 4 * 100
    assert read.coll_wait_outside_backward == whole.coll_wait_outside_backward
    assert read.totals == whole.totals


def test_a_label_declared_again_with_another_text_is_a_corrupt_stream(tmp_path: Path) -> None:
    run = _run(tmp_path)
    [path] = (run / "ranks" / "rank-0").glob("*.jsonl")
    with open(path, "a") as f:
        f.write(json.dumps({"k": "label", "t": 9.9, "id": 0, "text": "eval"}) + "\n")
    with pytest.raises(BadInputError, match=r":\d+: label 0 is declared again with another text"):
        load_run(run)


def test_records_naming_no_label_read_as_unknown_with_a_warning(tmp_path: Path) -> None:
    run = _run(tmp_path)
    [path] = (run / "ranks" / "rank-0").glob("*.jsonl")
    path.write_text("".join(line for line in path.read_text().splitlines(True) if '"k":"label"' not in line))
    loaded = load_run(run)
    assert {s["src"] for s in loaded.ranks[0].steps} == {"unknown"}
    assert any("name label(s) [0, 1, 2] no 'label' record declares" in w for w in loaded.warnings), loaded.warnings


def test_helpers_runs_hold_their_steps_in_the_steps_file(tmp_path: Path) -> None:
    run = write_run(tmp_path, [RankSpec(steps=3, phases=[("eval", 1)], calls=[Call("all_reduce")])])
    [stream] = (run / "ranks" / "rank-0").glob("*.jsonl")
    kinds = [json.loads(line)["k"] for line in stream.read_text().splitlines()]
    assert "step" not in kinds and "phase" not in kinds and kinds.count("label") == 4  # and the readings' sources
    rank = load_run(run).ranks[0]
    assert [s["step"] for s in rank.steps] == [1, 2, 3]
    assert [(p["name"], p["edge"]) for p in rank.phases] == [("eval", "begin"), ("eval", "end")]


def test_watch_follows_the_steps_file_by_index(tmp_path: Path) -> None:
    """`lorascope watch`'s tail reads the records written since its last look, and nothing
    when none was."""
    folder = tmp_path / "ranks" / "rank-0"
    folder.mkdir(parents=True)
    (folder / "h-1.0000.jsonl").write_text(json.dumps({**START, "t": 1.0}) + "\n")
    f = step_file(steps_path(folder / "h-1"))
    f.put(2.0, 0.5, 1.0, 0.0, 1, 0, STEP_END)
    tail = Tail(tmp_path)

    def looked() -> list[Any]:
        list(tail.look())
        return [batch.records for batch in tail.look_steps()]

    [first] = looked()
    assert first["step"].tolist() == [1]
    assert looked() == []
    f.put(3.0, 0.0, math.nan, 0.0, 1, 1, BEGIN)
    f.put(3.5, 0.5, 1.0, 0.0, 2, 0, STEP_END)
    [more] = looked()
    assert more["step"].tolist() == [1, 2]
    assert more["kind"].tolist() == [BEGIN, STEP_END]


def test_a_steps_file_counts_in_the_streams_limit(tmp_path: Path) -> None:
    """What a process's steps were before they left its stream still counts against
    ``--max-stream-size``: a steps file that takes it past is refused in one line."""
    run = _run(tmp_path)
    [path] = (run / "ranks" / "rank-0").glob("*.steps")
    with open(path, "ab") as f:
        f.truncate(600 << 20)  # sparse
    with pytest.raises(
        BadInputError, match=r"rank 0: its stream \(.*, its steps and memory files\) is over the 512 MiB limit"
    ):
        load_run(run)
    # `lorascope hang` reads its newest records only: a long run's steps file is no reason to refuse it
    assert load_run(run, newest=RECENT_RECORDS).ranks[0].steps


def test_the_time_blocked_on_handles_reads_back_per_step_and_phase(tmp_path: Path) -> None:
    """A record's ``waited`` is the time blocked on async collectives' handles since its step
    began: the step's end holds the step's, a phase's is its end's less its begin's; a run
    whose records hold 0.0 (the probes recorded none) has none."""
    run = tmp_path / "run"
    stream, steps = one_rank(run)
    for step in range(3):
        t, w = 2.0 + step, 0.01 * step  # step 1 waits for none
        steps.phase(t, "forward", "begin", step, waited=w)
        steps.phase(t + 0.25, "forward", "end", step, waited=3 * w)
        steps.phase(t + 0.5, "backward", "begin", step, waited=3 * w)
        steps.phase(t + 0.75, "backward", "end", step, waited=4 * w)
        steps.step(t + 0.9, step + 1, 0.9, 1.0, "deepspeed", waited=5 * w)
    stream.write({"k": "end", "t": 6.0, "status": "exit", "code": 0})
    stream.close()
    rank = load_run(run).ranks[0]
    assert rank.handle_wait == pytest.approx({2: 0.05, 3: 0.10})
    assert rank.handle_wait_phases == {
        2: pytest.approx({"forward": 0.02, "backward": 0.01}),
        3: pytest.approx({"forward": 0.04, "backward": 0.02}),
    }
    assert load_run(_run(tmp_path)).ranks[0].handle_wait == {}


def test_a_steps_file_of_lorascope_0_3_0_reads_without_its_waits(tmp_path: Path) -> None:
    """A version-1 steps file (no ``waited``: lorascope 0.3.0's) is read, its waits 0.0
    (not recorded); another version is a one-line warning and no steps."""
    path = tmp_path / "h-1.steps"
    f = callfile_module.SlotFile(path, STEPS_HEAD, STEPS_RING, None, STEP_V1, STEPS_MAGIC, 1)
    f.put(10.5, 0.0, math.nan, 0, 0, BEGIN)
    f.put(11.0, 0.5, 2.25, 1, 1, STEP_END)
    f.close()
    warnings: list[str] = []
    table = read_steps(path, "rank 0", warnings).records
    assert not warnings and table.dtype == STEP_DTYPE
    assert table["t"].tolist() == [10.5, 11.0] and table["loss"].tolist()[1] == 2.25
    assert table["waited"].tolist() == [0.0, 0.0] and table["kind"].tolist() == [BEGIN, STEP_END]
    data = bytearray(path.read_bytes())
    HEADER.pack_into(data, 0, *(9 if name == "version" else v for (name, _, _), v in
                                zip(HEADER_FIELDS, HEADER.unpack_from(data), strict=True)))  # fmt: skip
    path.write_bytes(bytes(data))
    assert len(read_steps(path, "rank 0", warnings).records) == 0
    assert any("step file version 9; this lorascope reads version 2" in w for w in warnings), warnings
