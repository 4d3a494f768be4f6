"""Hostile and broken inputs, through the real CLI, each in a subprocess under a 4 GiB
address-space cap and a time limit: one line and the documented exit code, never a
traceback, a hang or a memory blow-up. Every input is generated here, small on disk
(decompression bombs are gzip members repeated; big files are sparse)."""

from __future__ import annotations

import gzip
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT)}
ADDRESS_SPACE = 4 << 30
MIB = 1 << 20
START = {
    "k": "start",
    "t": 1.0,
    "rank": 0,
    "world_size": 1,
    "local_rank": 0,
    "pid": 42,
    "host": "h",
    "argv": [],
    "versions": {},
    "device": "cpu",
}


def _cap_memory(limit: int = ADDRESS_SPACE) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _lorascope(*args: str, seconds: float = 30, cap: int = ADDRESS_SPACE) -> subprocess.CompletedProcess[str]:
    """Run `lorascope ARGS` capped; fails the test past ``seconds``."""
    began = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "lorascope", *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=seconds,
        preexec_fn=lambda: _cap_memory(cap),
    )
    took = time.monotonic() - began
    assert took < seconds, f"took {took:.1f} s"
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-2000:]
    return proc


def _analyze(
    path: Path, *flags: str, limit: tuple[str, str] | None = None, seconds: float = 30
) -> subprocess.CompletedProcess[str]:
    """`lorascope [LIMIT FLAG VALUE] analyze PATH --no-hta FLAGS`."""
    return _lorascope(*(limit or ()), "analyze", str(path), "--no-hta", *flags, seconds=seconds)


def _one_line(proc: subprocess.CompletedProcess[str], code: int, *words: str) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code, (proc.returncode, proc.stderr[-1000:])
    assert len(lines) == 1, proc.stderr[-1000:]
    assert lines[0].startswith("lorascope: error: "), lines[0]
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def _bomb(path: Path, head: bytes, filler: bytes, inflated: int) -> Path:
    """A gzip file of HEAD then FILLER up to INFLATED bytes, as repeated 16 MiB members."""
    member = gzip.compress(filler * (16 * MIB // len(filler)), compresslevel=9)
    with open(path, "wb") as f:
        f.write(gzip.compress(head))
        for _ in range(inflated // (16 * MIB) + 1):
            f.write(member)
    assert path.stat().st_size < 4 * MIB
    return path


# --- whole-file JSON: Kineto traces, flight-recorder dumps -------------------------------


def test_kineto_whitespace_bomb_stops_at_the_json_limit(tmp_path: Path) -> None:
    bomb = _bomb(tmp_path / "trace.json.gz", b'{"traceEvents": [', b" ", 1100 * MIB)
    _one_line(_analyze(bomb), 3, "over the 1 GiB limit", "--max-json-size")


def test_kineto_event_array_bomb_and_the_flag(tmp_path: Path) -> None:
    event = b'{"ph":"X","ts":1,"dur":1,"pid":1,"tid":1,"name":"k","cat":"kernel"},'
    bomb = _bomb(tmp_path / "trace.json.gz", b'{"traceEvents": [', event, 200 * MIB)
    _one_line(_analyze(bomb, limit=("--max-json-size", "64MiB")), 3, "over the 64 MiB limit", "--max-json-size")


def test_flight_json_bomb(tmp_path: Path) -> None:
    bomb = _bomb(tmp_path / "dump.json.gz", b'{"pg_config": {}, "entries": [', b"\n", 300 * MIB)
    _one_line(_analyze(bomb, limit=("--max-json-size", "256MiB")), 3, "dump", "over the 256 MiB limit")


def test_json_nested_100k_levels(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    path.write_bytes(b'{"traceEvents": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    _one_line(_analyze(path), 3, "nested deeper")


def test_truncated_gzip_and_gzip_of_random_bytes(tmp_path: Path) -> None:
    """A trace cut short is read as far as it goes, with warnings; random bytes are not."""
    whole = gzip.compress(json.dumps({"traceEvents": [{"ph": "X", "ts": 1, "dur": 1}] * 5000}).encode())
    truncated = tmp_path / "trace.json.gz"
    truncated.write_bytes(whole[: len(whole) // 2])
    proc = _analyze(truncated, "--json")
    assert proc.returncode == 0, proc.stderr
    warnings = json.loads(proc.stdout)["warnings"]
    assert any("ends inside its compressed stream" in w for w in warnings)
    assert any("breaks off inside its events" in w for w in warnings)
    noise = tmp_path / "noise.json.gz"
    noise.write_bytes(b"\x1f\x8b\x08\x00" + random.Random(3).randbytes(8192))
    _one_line(_analyze(noise), 3, "gzip")


def test_non_utf8_json(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    path.write_bytes(b'{"traceEvents": [{"ph": "X", "name": "\xff\xfe\xc3", "ts": 1, "dur": 2}]}')
    _one_line(_analyze(path), 3, "not valid JSON")


def test_nan_infinity_and_absurd_integers_in_a_trace(tmp_path: Path) -> None:
    good = {"ph": "X", "ts": 10, "dur": 5, "pid": 1, "tid": 1, "name": "op", "cat": "cpu_op"}
    text = json.dumps({"traceEvents": [good]})[:-2] + (
        ', {"ph": "X", "ts": NaN, "dur": Infinity, "pid": 1, "tid": 1, "name": "a", "cat": "cpu_op"}'
        ', {"ph": "X", "ts": 1' + "0" * 400 + ', "dur": -Infinity, "pid": 1, "tid": 1, "name": "b", "cat": "cpu_op"}'
        ', {"ph": "X", "ts": 1e308, "dur": 1e308, "pid": 1, "tid": 2, "name": "gloo:all_reduce",'
        ' "args": {"Input Dims": [[' + "9" * 30 + "]]}}]}"
    )
    text = text[:-2] + ', {"ph": "X", "ts": 5, "dur": 1' + "0" * 400 + ', "name": "k", "cat": "kernel"}]}'
    path = tmp_path / "trace.json"
    path.write_text(text)
    proc = _analyze(path, "--json")
    assert proc.returncode == 0, proc.stderr
    assert any(
        "4 timed events with NaN, infinite or absurd times were dropped" in w
        for w in json.loads(proc.stdout)["warnings"]
    )


# --- the safe unpickler ------------------------------------------------------------------


def test_pickle_memo_index_jumps(tmp_path: Path) -> None:
    """~200 LONG_BINPUTs 16 M apart in 1 KB: the memo would reach 3.6 GB."""
    body = b"".join(b"N" + b"r" + ((i + 1) * (16 << 20)).to_bytes(4, "little") + b"0" for i in range(200))
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(b"\x80\x04\x8c\x08segments0" + body + b"N.")
    assert path.stat().st_size < 2048
    _one_line(_analyze(path), 3, "memo index")


@pytest.mark.parametrize(
    "opcode",
    [
        b"\x8e" + (1 << 62).to_bytes(8, "little"),  # BINBYTES8
        b"\x8d" + (1 << 40).to_bytes(8, "little"),  # BINUNICODE8
        b"X" + (0xFFFFFFFF).to_bytes(4, "little"),  # BINUNICODE
        b"\x8b" + (0x7FFFFFFF).to_bytes(4, "little"),  # LONG4
    ],
)
def test_pickle_huge_declared_lengths(tmp_path: Path, opcode: bytes) -> None:
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(b"\x80\x04\x8c\x08segments0" + opcode + b"abc")
    _one_line(_analyze(path), 3, "truncated")


# --- run directories ---------------------------------------------------------------------


def _run_dir(tmp_path: Path, lines: list[bytes] | None = None, records: list[dict] | None = None) -> Path:
    run = tmp_path / "run"
    (run / "ranks" / "rank-0").mkdir(parents=True)
    manifest = {"format": "lorascope-run", "version": 3, "launches": []}
    (run / "manifest.json").write_text(json.dumps(manifest))
    body = [json.dumps(r).encode() for r in [START, *(records or [])]] + (lines or [])
    (run / "ranks" / "rank-0" / "h-42.0000.jsonl").write_bytes(b"".join(line + b"\n" for line in body))
    return run


def test_fifo_rank_stream_is_refused_at_once(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    stream = run / "ranks" / "rank-0" / "h-42.0000.jsonl"
    stream.unlink()
    os.mkfifo(stream)
    _one_line(_analyze(run, seconds=20), 3, "a FIFO", "refused")


def test_fifo_and_device_given_as_artifacts(tmp_path: Path) -> None:
    fifo = tmp_path / "trace.json"
    os.mkfifo(fifo)
    _one_line(_analyze(fifo, seconds=20), 3, "a FIFO", "refused")
    _one_line(_analyze(Path("/dev/zero"), seconds=20), 3, "a character device", "refused")


def test_fifo_manifest(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    (run / "manifest.json").unlink()
    os.mkfifo(run / "manifest.json")
    _one_line(_analyze(run, seconds=20), 3, "nothing lorascope knows in this folder")


def test_symlinks_out_of_the_run_directory_are_not_followed(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    (run / "ranks" / "rank-1").mkdir()
    (run / "ranks" / "rank-1" / "h-43.0000.jsonl").symlink_to("/dev/zero")
    outside = tmp_path / "secret.jsonl"
    outside.write_text(json.dumps({**START, "rank": 2, "host": "SECRET-HOST"}) + "\n")
    (run / "ranks" / "rank-2").mkdir()
    (run / "ranks" / "rank-2" / "h-44.0000.jsonl").symlink_to(outside)
    proc = _analyze(run, "--json", seconds=20)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert [r["rank"] for r in data["ranks"]] == [0]
    assert sum("a symlink out of the run directory: not followed" in w for w in data["warnings"]) == 2
    assert "SECRET-HOST" not in proc.stdout


def test_a_500_mb_line_is_skipped_in_bounded_memory(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    stream = run / "ranks" / "rank-0" / "h-42.0000.jsonl"
    with open(stream, "ab") as f:  # sparse: 500 MB of NULs and no newline, nothing on disk
        f.truncate(stream.stat().st_size + 500 * MIB)
    proc = _lorascope("analyze", str(run), "--json", seconds=30, cap=1 << 30)
    assert proc.returncode == 0, proc.stderr
    warnings = json.loads(proc.stdout)["warnings"]
    assert any("skipped 1 record(s) over the 16 MiB limit" in w and "--max-record-size" in w for w in warnings)


def test_a_record_nested_100k_levels(tmp_path: Path) -> None:
    deep = b'{"k": "mem", "t": 2, "v": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    run = _run_dir(tmp_path, lines=[deep], records=[{"k": "end", "t": 3, "status": "exit", "code": 0}])
    proc = _analyze(run, "--json")
    assert proc.returncode == 0, proc.stderr
    assert any("nested deeper than 64 levels" in w for w in json.loads(proc.stdout)["warnings"])


@pytest.mark.parametrize("world_size", [10**29, 2**40, 0])
def test_absurd_world_size(tmp_path: Path, world_size: int) -> None:
    run = _run_dir(tmp_path)
    stream = run / "ranks" / "rank-0" / "h-42.0000.jsonl"
    stream.write_text(json.dumps({**START, "world_size": world_size}) + "\n")
    _one_line(_analyze(run), 3, "world size" if world_size < 2**63 else "out of range")


def test_absurd_times_and_sequence_numbers(tmp_path: Path) -> None:
    """Sequence numbers 10^18 apart on two ranks: compared as numbers, not as a range."""
    run = _run_dir(tmp_path, records=[{"k": "group", "t": 2, "gid": 0, "name": "0", "ranks": None, "backend": "gloo"}])
    coll = {"k": "coll", "t": 3, "gid": 0, "op": "all_reduce", "bytes": 4, "dtype": "f32", "async": False}
    with open(run / "ranks" / "rank-0" / "h-42.0000.jsonl", "a") as f:
        f.write(json.dumps({**coll, "seq": 1, "site": None, "step": 0}) + "\n")
    (run / "ranks" / "rank-1").mkdir()
    lines = [
        {**START, "rank": 1, "world_size": 2, "pid": 43},
        {"k": "group", "t": 2, "gid": 0, "name": "0", "ranks": None, "backend": "gloo"},
        {**coll, "seq": 10**18, "site": None, "step": 0, "op": "broadcast"},
    ]
    (run / "ranks" / "rank-1" / "h-43.0000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert _analyze(run, seconds=30).returncode == 0
    bad_time = _run_dir(tmp_path / "t", lines=[b'{"k": "mem", "t": 1' + b"0" * 400 + b', "src": "s", "step": 0}'])
    _one_line(_analyze(bad_time), 3, "out of range")


def test_stream_over_the_stream_limit(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    stream = run / "ranks" / "rank-0" / "h-42.0000.jsonl"
    with open(stream, "ab") as f:
        f.truncate(600 * MIB)  # sparse
    _one_line(_analyze(run), 3, "over the 512 MiB limit", "--max-stream-size")


# --- logs --------------------------------------------------------------------------------


def test_log_bombs_stop_at_the_log_limits(tmp_path: Path) -> None:
    head = b"[rank0]: 2024-01-01 12:00:00 INFO step 1\n"
    wide = _bomb(tmp_path / "wide.log.gz", head, b" ", 200 * MIB)
    proc = _analyze(wide, "--json", limit=("--max-log-size", "64MiB"))
    assert proc.returncode == 0, proc.stderr
    assert any("over the 64 MiB limit" in w and "--max-log-size" in w for w in json.loads(proc.stdout)["warnings"])
    tall = _bomb(tmp_path / "tall.log.gz", head, b"a\n", 64 * MIB)
    proc = _analyze(tall, "--json", limit=("--max-log-lines", "100000"))
    assert proc.returncode == 0, proc.stderr
    assert any("read the first 100,000 lines only" in w for w in json.loads(proc.stdout)["warnings"])


# --- the CLI's last line of defence --------------------------------------------------------


def test_memory_error_is_one_line_and_debug_shows_the_traceback(tmp_path: Path) -> None:
    """A limit raised past what the machine (here: a 512 MiB address space) can hold."""
    bomb = _bomb(tmp_path / "trace.json.gz", b'{"traceEvents": [', b" ", 640 * MIB)
    args = ["--max-json-size", "8GiB", "analyze", str(bomb), "--no-hta"]
    _one_line(_lorascope(*args, cap=512 * MIB), 5, "out of memory")
    debug = subprocess.run(
        [sys.executable, "-m", "lorascope", "--debug", *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=30,
        preexec_fn=lambda: _cap_memory(512 * MIB),
    )
    assert debug.returncode == 5
    assert "Traceback" in debug.stderr and "MemoryError" in debug.stderr


# --- lorascope run: the job's exit status whatever happens to the run directory ------------

_JOB_EXIT = 7


def _run(out: Path, job: str) -> subprocess.CompletedProcess[str]:
    env = {**ENV, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "lorascope", "run", "--out", str(out), "--", sys.executable, "-c", job],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_run_keeps_the_job_status_when_the_run_directory_vanishes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    job = f"import os, shutil, sys; d = os.environ['LORASCOPE_RUN_DIR']; shutil.rmtree(d); open(d, 'w').close(); sys.exit({_JOB_EXIT})"
    proc = _run(out, job)
    assert proc.returncode == _JOB_EXIT, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "lorascope: warning: cannot record the launch" in proc.stderr


def test_run_keeps_the_job_status_on_a_read_only_run_directory(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        out = Path("/proc/lorascope-test-run")  # not writable even by root
    else:
        out = tmp_path / "ro" / "run"
        out.parent.mkdir()
        out.parent.chmod(0o500)
    proc = _run(out, f"import sys; sys.exit({_JOB_EXIT})")
    assert proc.returncode == _JOB_EXIT, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "the job runs without probes" in proc.stderr


def test_run_keeps_the_job_status_on_a_full_disk(tmp_path: Path) -> None:
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("a full filesystem needs a tmpfs mount: root and mount(8) are required")
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)]).returncode:
        pytest.skip("mount -t tmpfs was refused here (no CAP_SYS_ADMIN)")
    try:
        job = (
            "import os, sys\n"
            "f = open(os.path.join(os.environ['LORASCOPE_RUN_DIR'], 'fill'), 'wb')\n"
            "try:\n    while True: f.write(b'x' * 4096); f.flush()\n"
            f"except OSError: pass\nsys.exit({_JOB_EXIT})\n"
        )
        proc = _run(disk / "run", job)
        assert proc.returncode == _JOB_EXIT, proc.stderr
        assert "Traceback" not in proc.stderr
        assert "No space left on device" in proc.stderr
    finally:
        subprocess.run(["umount", str(disk)])
