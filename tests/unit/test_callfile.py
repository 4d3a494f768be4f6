"""The call file's writer (lorascope/rundir/format/callfile.py) against its layout table
(layout.py): what is on disk, read back with the layout's own structs."""

from __future__ import annotations

import errno
import mmap
import os
import struct
import threading
from pathlib import Path
from typing import Any

import pytest

from lorascope.rundir.format import callfile as callfile_module
from lorascope.rundir.format.callfile import CHUNK_SLOTS, CallFile
from lorascope.rundir.format.layout import (
    CALL,
    CALL_FIELDS,
    CALLS_VERSION,
    HEADER,
    HEADER_FIELDS,
    MAGIC,
    file_size,
    slot_of,
)


def _header(path: Path) -> dict[str, Any]:
    return dict(zip((f for f, _, _ in HEADER_FIELDS), HEADER.unpack_from(path.read_bytes()), strict=True))


def _slot(path: Path, slot: int) -> dict[str, Any]:
    data = path.read_bytes()
    return dict(
        zip((f for f, _, _ in CALL_FIELDS), CALL.unpack_from(data, HEADER.size + slot * CALL.size), strict=True)
    )


def test_the_layout_table_is_the_structs() -> None:
    """Each struct is its table's codes, little-endian, with no padding."""
    assert CALL.size == sum(struct.calcsize("<" + code) for _, code, _ in CALL_FIELDS) == 48
    assert HEADER.size == sum(struct.calcsize("<" + code) for _, code, _ in HEADER_FIELDS)
    assert CALL.format.startswith("<") and HEADER.format.startswith("<")


def test_a_call_and_its_end_in_one_record(tmp_path: Path) -> None:
    path = tmp_path / "r.calls"
    calls = CallFile(path, head=4, ring=8)
    first = calls.begin(100.0, 1, 4096, 0, 2, 7)
    second = calls.begin(101.0, 2, -1, 1, 2, 8)
    calls.end(first, 100.5)
    head = _header(path)
    assert (head["magic"], head["version"], head["record_size"]) == (MAGIC, CALLS_VERSION, CALL.size)
    assert (head["head"], head["ring"], head["count"]) == (4, 8, 2)
    assert _slot(path, first) == {
        "t": 100.0, "end": 100.5, "seq": 1, "bytes": 4096, "step": 0, "gid": 2, "shape": 7, "stamp": 1
    }  # fmt: skip
    assert _slot(path, second)["end"] == 0.0 and _slot(path, second)["stamp"] == 2  # in flight


def test_the_ring_keeps_the_head_and_the_newest(tmp_path: Path) -> None:
    """Records past the head go round the ring; an end that comes after its slot was
    reused is dropped, not written over the newer call."""
    path = tmp_path / "r.calls"
    calls = CallFile(path, head=3, ring=5)
    indexes = [calls.begin(float(i), i + 1, 8, 0, 0, 0) for i in range(20)]
    calls.end(indexes[4], 99.0)  # slot reused by 9, 14 and 19
    assert os.path.getsize(path) == file_size(3, 5)
    stamps = [_slot(path, s)["stamp"] for s in range(8)]
    assert stamps[:3] == [1, 2, 3]
    kept = sorted(s - 1 for s in stamps[3:])
    assert kept == [15, 16, 17, 18, 19]
    assert all(slot_of(i, 3, 5) == s for s, i in enumerate([0, 1, 2]))
    assert _slot(path, slot_of(19, 3, 5))["end"] == 0.0 and _header(path)["count"] == 20


def test_the_file_grows_by_chunks_with_its_blocks_reserved(tmp_path: Path) -> None:
    path = tmp_path / "r.calls"
    calls = CallFile(path, head=10, ring=1 << 20)
    assert os.path.getsize(path) == file_size(CHUNK_SLOTS, 0)
    for i in range(CHUNK_SLOTS + 1):
        calls.begin(1.0, i + 1, 8, 0, 0, 0)
    assert os.path.getsize(path) == file_size(2 * CHUNK_SLOTS, 0)
    assert os.stat(path).st_blocks * 512 >= os.path.getsize(path)  # reserved, not sparse
    assert _slot(path, CHUNK_SLOTS)["stamp"] == CHUNK_SLOTS + 1


def test_threads_write_whole_records(tmp_path: Path) -> None:
    path = tmp_path / "r.calls"
    calls = CallFile(path, head=16, ring=1 << 16)

    def job(gid: int) -> None:
        for i in range(3000):
            calls.end(calls.begin(float(i), i + 1, 8, 0, gid, 0), float(i) + 0.5)

    threads = [threading.Thread(target=job, args=(g,)) for g in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    records = [_slot(path, s) for s in range(12000)]
    assert sorted(r["stamp"] for r in records) == list(range(1, 12001))
    assert all(r["end"] == r["t"] + 0.5 for r in records)
    assert sorted((r["gid"], r["seq"]) for r in records) == [(g, i + 1) for g in range(4) for i in range(3000)]


def test_without_a_shared_mapping_the_same_bytes_by_pwrite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> mmap.mmap:
        raise OSError(errno.ENODEV, "No such device")

    monkeypatch.setattr(callfile_module.mmap, "mmap", refuse)
    path = tmp_path / "r.calls"
    calls = CallFile(path, head=2, ring=4)
    assert calls.how == "pwrite (No such device)"
    for i in range(7):
        calls.end(calls.begin(float(i), i + 1, 8, 0, 0, 3), i + 0.25)
    assert _header(path)["count"] == 7
    assert [_slot(path, s)["stamp"] for s in range(6)] == [1, 2, 7, 4, 5, 6]
    assert _slot(path, 2)["end"] == 6.25


def test_a_full_disk_turns_the_file_off_and_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No room for the next chunk: the job's call goes on, the file is off, once."""
    errors: list[BaseException] = []
    path = tmp_path / "r.calls"
    calls = CallFile(path, head=1 << 20, ring=2, on_error=errors.append)

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(callfile_module.os, "posix_fallocate", full)
    got = [calls.begin(1.0, i + 1, 8, 0, 0, 0) for i in range(CHUNK_SLOTS + 3)]
    assert got[:CHUNK_SLOTS] == list(range(CHUNK_SLOTS)) and set(got[CHUNK_SLOTS:]) == {-1}
    assert not calls.alive and len(errors) == 1 and "No space left" in str(errors[0])
    calls.end(5, 2.0)  # off: nothing, no exception


def test_a_forked_child_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "r.calls"
    calls = CallFile(path, head=4, ring=8)
    calls.begin(1.0, 1, 8, 0, 0, 0)
    pid = os.fork()
    if pid == 0:  # the child: its copy is off
        code = 0 if calls.begin(2.0, 2, 8, 0, 0, 0) == -1 and not calls.alive else 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _header(path)["count"] == 1 and _slot(path, 1)["stamp"] == 0


def test_calls_the_ring_overwrites_are_summed_per_step_first(tmp_path: Path) -> None:
    """The probes' writer thread folds every call past the head into its step's sums once
    half the ring is used, each step's record once the step is over; a call not ended
    when folded is counted as such. Read back, the sums are exactly the calls' own."""
    from lorascope.probes.callsteps import CallSteps

    calls = CallFile(tmp_path / "r.calls", head=10, ring=64)
    written: list[dict[str, Any]] = []
    kept = CallFile(tmp_path / "r.kept-calls", head=0, ring=64)
    keep = {0, 5, 7}  # 0: its calls in the head; 7: a step without a call (an eval)
    steps = CallSteps(calls, ["all_reduce", "all_gather"].__getitem__, written.append, keep, lambda: kept)
    made: list[tuple[int, int, int, int, float | None]] = []  # step, gid, shape, bytes, ms
    for step in range(12):
        for i in range(0 if step == 7 else 10):
            shape, nbytes = i % 2, 100 * (i + 1)
            index = calls.begin(1000.0 + step + i / 100, i, nbytes, step, 3, shape)
            ms = None if (step, i) == (5, 9) else 2.0 + i
            if ms is not None:
                calls.end(index, 1000.0 + step + i / 100 + ms / 1e3)
            made.append((step, 3, shape, nbytes, ms))
            if steps.due():
                steps.look(step)
    assert calls.count == 110 and steps.folded > 64  # past the ring: the first laps were folded in time
    assert keep == set()  # the steps folded past are forgotten: what is kept stays bounded
    by_step = {rec["step"]: rec["groups"] for rec in written}
    assert sorted(by_step) == [s for s in range(min(by_step), max(by_step) + 1) if s != 7]
    for step, groups in by_step.items():
        for gid, op, n, nbytes, ms, longest, open_ in groups:
            mine = [m for m in made[10:] if m[0] == step and m[2] == ["all_reduce", "all_gather"].index(op)]
            assert (gid, n, nbytes) == (3, len(mine), sum(m[3] for m in mine))
            ended = [m[4] for m in mine if m[4] is not None]
            assert ms == pytest.approx(sum(ended), abs=1e-2) and longest == pytest.approx(max(ended), abs=1e-3)
            assert open_ == len(mine) - len(ended)
    assert [g[6] for g in by_step[5] if g[1] == "all_gather"] == [1]  # (5, 9): never ended
    copies = [_slot(tmp_path / "r.kept-calls", s) for s in range(10)]  # step 5 kept whole
    assert [(c["step"], c["seq"], c["shape"], c["bytes"]) for c in copies] == [
        (5, i, i % 2, 100 * (i + 1)) for i in range(10)
    ]
    assert [c["end"] > 0 for c in copies] == [True] * 9 + [False]
