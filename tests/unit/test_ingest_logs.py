"""Job logs: the lines that matter, streamed, with ranks and numbers."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from lorascope.errors import BadInputError
from lorascope.ingest.logs import reader as logs
from lorascope.ingest.logs.reader import read_log

JOB_LOG = Path(__file__).resolve().parents[2] / "fixtures" / "snapshots" / "lora-oom" / "job.log"
MiB, GiB = 1 << 20, 1 << 30

OLD_STYLE = """\
[rank2]:[E ProcessGroupNCCL.cpp:563] [Rank 2] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, Timeout(ms)=600000) ran for 600024 milliseconds before timing out.
[rank2]:[E ProcessGroupNCCL.cpp:1664] [PG 0 Rank 2] Exception (either an error or timeout) detected by watchdog at work: 5, last enqueued NCCL work: 6, last completed NCCL work: 4.
RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; 14.56 GiB already allocated; 3.44 MiB free; 14.71 GiB reserved in total by PyTorch) If reserved memory is >> allocated memory try setting max_split_size_mb to avoid fragmentation.
[default1]:RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] op.preamble.length <= op.nbytes. 8 vs 4. Received data size doesn't match expected size
[default1]:RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv operation to complete
[rank0]:AssertionError: loss must be a scalar tensor
"""


def test_the_job_log_fixture() -> None:
    log = read_log(JOB_LOG)
    assert log.ranks == [0, 1] and log.lines == 7 and log.looks_like_a_log
    (timeout,) = log.watchdog_timeouts
    assert (timeout.rank, timeout.seq, timeout.op, timeout.numel_in, timeout.timeout_ms, timeout.ran_ms) == (
        1,
        118,
        "ALLREDUCE",
        1,
        1_800_000,
        1_800_083,
    )
    (progress,) = log.nccl_progress
    assert (progress.last_enqueued, progress.last_completed, progress.group) == (118, 117, "default_pg")
    (oom,) = log.ooms
    assert oom.rank == 0 and oom.requested == 250 * MiB and oom.free == 64 * MiB
    assert oom.allocated_by_pytorch == int(75.10 * GiB) and oom.reserved_unallocated == int(1.90 * GiB)
    assert oom.other_processes == {4413: int(1.20 * GiB)}
    assert [(c.rank, c.flushes) for c in log.cache_flushes] == [(0, 3)]
    assert [x.rank for x in log.of_kind("no-input-grad")] == [1]


def test_older_messages_and_other_launchers(tmp_path: Path) -> None:
    path = tmp_path / "old.log"
    path.write_text(OLD_STYLE)
    log = read_log(path)
    assert log.ranks == [0, 1, 2]
    assert log.watchdog_timeouts[0].numel_in is None and log.watchdog_timeouts[0].timeout_ms == 600_000
    assert (log.nccl_progress[0].at_seq, log.nccl_progress[0].last_enqueued) == (5, 6)
    oom = log.ooms[0]
    assert oom.rank is None and oom.requested == 20 * MiB and oom.free == int(3.44 * MiB)
    assert oom.reserved_unallocated == int(14.71 * GiB) - int(14.56 * GiB)
    assert {k: v for k, v in log.counts.items() if k.startswith(("gloo", "no-grad"))} == {
        "gloo-size-mismatch": 1,
        "gloo-timeout": 1,
        "no-grad-error": 1,
    }


def test_streams_big_gzipped_logs_and_cuts_long_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logs, "MAX_RECORDS", 5)
    path = tmp_path / "job.log.gz"
    with gzip.open(path, "wt") as f:
        f.write("[rank0]:" + "x" * (3 * logs.MAX_LINE) + "\n")
        for i in range(20_000):
            f.write(f"[rank{i % 4}]:[2026-01-01 00:00:00] step {i} loss 1.0\n")
            if i % 1000 == 0:
                f.write(f"[rank{i % 4}]: 2 pytorch allocator cache flushes since last step\n")
    log = read_log(path)
    assert log.cut_lines == 1 and log.lines == 20_021 and log.ranks == [0, 1, 2, 3]
    assert log.counts["cache-flushes"] == 20 and len(log.cache_flushes) == 5


def test_unreadable_gzip(tmp_path: Path) -> None:
    path = tmp_path / "job.log.gz"
    path.write_bytes(gzip.compress(b"[rank0]: hello\n" * 1000)[:50])
    with pytest.raises(BadInputError, match="cannot read the log"):
        read_log(path)


def test_oom_message_with_a_per_process_cap() -> None:
    from lorascope.ingest.logs.reader import parse_oom

    report = parse_oom(
        "CUDA out of memory. Tried to allocate 64.00 MiB. GPU 0 has a total capacity of 139.80 GiB of which "
        "138.46 GiB is free. Including non-PyTorch memory, this process has 1.33 GiB memory in use. 170.00 MiB "
        "allowed; Of the allocated memory 116.84 MiB is allocated by PyTorch"
    )
    assert report is not None and report.allowed == 170 * 2**20 and report.requested == 64 * 2**20
    assert parse_oom("RuntimeError: something else") is None
