"""The memory file (lorascope/rundir/format/callfile.py's writer with layout.MEM_FIELDS,
written by lorascope/probes/memory.py, read by lorascope/rundir/loading/mem.py): what the
reader makes of it, torn records, a kill, decimation, `lorascope watch`'s tail."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lorascope.analysis.live import LiveRun
from lorascope.rundir.format.callfile import mem_file, mem_path
from lorascope.rundir.format.layout import HEADER, MEM, MEM_FIELDS, offset_of
from lorascope.rundir.format.writer import Stream
from lorascope.rundir.loading.mem import as_records, read_mem
from lorascope.rundir.loading.reader import load_run
from lorascope.rundir.loading.tail import Tail
from tests.helpers import START, Steps, mem_records, one_rank

CUDA = {"device": 1, "alloc": 3 << 30, "reserved": 4 << 30, "max_alloc": 5 << 30}
NVML = {"used": 7 << 30, "total": 80 << 30, "pids": [41, 42], "pid_used": {"41": None, "42": 6 << 30}}
#: The four kinds of reading the probes make: RSS; and the C heap; a CUDA rank's; its sampler's.
READINGS: list[dict[str, Any]] = [
    {"src": "forward.begin", "step": 0, "rss": 100},
    {"src": "forward.end", "step": 0, "rss": 200, "heap": 150},
    {"src": "backward.begin", "step": 0, "rss": 300, "cuda": CUDA},
    {"src": "sampler", "step": 1, "rss": 400, "heap": 90, "cuda": CUDA, "nvml": NVML},
]


def test_a_reading_is_64_bytes_of_its_table() -> None:
    assert MEM.size == 64 and MEM.format.startswith("<") and [f for f, _, _ in MEM_FIELDS][-1] == "stamp"


def test_every_kind_of_reading_reads_back_as_written(tmp_path: Path) -> None:
    """RSS alone, with the heap, with the CUDA allocator's counters, and a sampler's with
    NVML's part (an ``nvml`` record): the same dicts, key for key in the same order."""
    stream = Stream(tmp_path / "r" / "h-1")
    files = Steps(stream, tmp_path / "r" / "h-1", 1.0)
    written = [{**rec, "k": "mem", "t": 1.5 + i} for i, rec in enumerate(READINGS)]
    for rec in written:
        files.record(rec)
    files.mem.close()
    stream.close()
    assert [json.dumps(m) for m in mem_records(tmp_path / "r")] == [json.dumps(m) for m in written]
    kinds = [json.loads(line)["k"] for line in next((tmp_path / "r").glob("*.jsonl")).read_text().splitlines()]
    assert "mem" not in kinds and kinds.count("nvml") == 1


def test_torn_records_are_dropped_with_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "h-1.mem"
    f = mem_file(path)
    for i in range(6):
        f.put(float(i), 100 + i, -1, -1, -1, -1, i, -1, 0)
    f.close()
    data = bytearray(path.read_bytes())
    at = HEADER.size + 2 * MEM.size + offset_of(MEM_FIELDS, "stamp")
    data[at : at + 4] = (0).to_bytes(4, "little")  # reading 2: begun, its stamp not yet written
    path.write_bytes(bytes(data[: HEADER.size + 5 * MEM.size + 9]))  # reading 5 cut
    warnings: list[str] = []
    kept = read_mem(path, "rank 0", warnings)
    assert [m["rss"] for m in as_records(kept, {0: "sampler"}, {}, "rank 0", warnings)] == [100, 101, 103, 104]
    assert any("2 memory record(s) torn or never written" in w and "index 2" in w for w in warnings), warnings
    assert any("the memory file is cut short" in w for w in warnings), warnings


@pytest.mark.parametrize("death", ["SIGKILL", "abort"])
def test_a_killed_process_leaves_every_reading_the_probe_made(tmp_path: Path, death: str) -> None:
    """The memory probe's readings, the last one just before the process dies (no flush,
    no close, no exit handler), are all on disk: the page cache holds the shared mapping."""
    n = 5000  # across chunks
    kill = "os.kill(os.getpid(), signal.SIGKILL)" if death == "SIGKILL" else "os.abort()"
    code = (
        "import os, signal\n"
        "from pathlib import Path\n"
        "from lorascope.probes.memory import MemoryProbe\n"
        "from lorascope.probes.session import Session\n"
        "from lorascope.rundir.format.writer import Stream\n"
        f"session = Session(Stream(Path({str(tmp_path / 'r' / 'h-1')!r})), 0, 0, 1, 0)\n"
        "probe = MemoryProbe(session)\n"
        f"for i in range({n}):\n"
        "    session.step = i\n"
        "    probe.sample('sampler', from_main_thread=False)\n"
        "print('read', flush=True)\n"
        f"{kill}\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout == "read\n" and proc.returncode == (-signal.SIGKILL if death == "SIGKILL" else -signal.SIGABRT)
    got = mem_records(tmp_path / "r")
    assert [m["step"] for m in got] == list(range(n)) and {m["src"] for m in got} == {"sampler"}
    assert all(m["rss"] > 0 and m["heap"] > 0 for m in got)


def _run(tmp_path: Path, steps: int) -> Path:
    """A one-rank run of ``steps`` steps with every kind of reading in its memory file, a
    peak in the middle of the run."""
    run = tmp_path / f"run{steps}"
    stream, files = one_rank(run)
    for step in range(steps):
        t = 2.0 + step
        files.step(t + 0.9, step + 1, 0.9)
        for i, reading in enumerate(READINGS):
            rec = {**reading, "step": step, "rss": reading["rss"] + step % 7, "k": "mem", "t": t + 0.1 * i}
            if step == steps // 2 + 1 and i == 1:
                rec["rss"] = 1 << 40  # a peak on a step decimation drops
            if step % 50 and "nvml" in rec:
                del rec["nvml"]
            files.reading(rec)
    stream.write({"k": "end", "t": 2.5 + steps, "status": "exit", "code": 0})
    files.file.close()
    files.mem.close()
    stream.close()
    return run


@pytest.mark.parametrize("steps", [6, 700])
def test_a_memory_file_is_decimated_as_it_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, steps: int) -> None:
    """What the reader keeps of the memory file's readings is what decimating the whole
    run keeps: every reading of a short run; past the step budget the steps kept and each
    column's peak; the totals of every reading."""
    from lorascope.rundir.loading import reader
    from lorascope.rundir.loading.reduce import decimate

    run = _run(tmp_path, steps)
    whole = load_run(run).ranks[0]
    assert whole.stride == 1 and len(whole.mem) == 4 * steps
    monkeypatch.setattr(reader, "steps_per_rank", lambda ranks: 64)
    read = load_run(run).ranks[0]
    assert read.stride == decimate(whole, 64) and (read.stride > 1) == (steps > 64)
    assert [json.dumps(m) for m in read.mem] == [json.dumps(m) for m in whole.mem]
    assert read.totals == whole.totals and read.totals["mem"] == 4 * steps
    assert read.last_time == whole.last_time == 2.5 + steps
    assert any(m["rss"] == 1 << 40 for m in read.mem)
    if steps > 64:
        assert len(read.mem) < 4 * steps // 2


def test_watch_follows_the_memory_file(tmp_path: Path) -> None:
    """`lorascope watch`'s tail reads the readings written since its last look, and the
    live state takes the latest and the highest: RSS, or a CUDA rank's allocator."""
    folder = tmp_path / "ranks" / "rank-0"
    folder.mkdir(parents=True)
    (folder / "h-1.0000.jsonl").write_text(json.dumps({**START, "t": 1.0}) + "\n")
    f = mem_file(mem_path(folder / "h-1"))
    f.put(2.0, 500, -1, -1, -1, -1, 0, -1, 0)
    f.put(2.5, 300, 20, -1, -1, -1, 1, -1, 0)
    tail, live = Tail(tmp_path), LiveRun()

    def looked() -> list[Any]:
        list(tail.look())
        batches = list(tail.look_mem(now=True))  # every look (not every MEM_LOOK_S)
        for batch in batches:
            live.take_mem(batch)
        return [batch.records for batch in batches]

    [first] = looked()
    assert first["rss"].tolist() == [500, 300]
    assert (live.ranks[0].mem_now, live.ranks[0].mem_peak, live.ranks[0].mem_metric) == (300, 500, "rss")
    assert looked() == []
    f.put(3.0, 900, -1, 10, 20, 70, 2, 0, 0)
    [more] = looked()
    assert more["alloc"].tolist() == [10]
    # from its first CUDA reading on, the allocator's figures (its peak, not RSS's)
    assert (live.ranks[0].mem_now, live.ranks[0].mem_peak, live.ranks[0].mem_metric) == (10, 70, "cuda")
