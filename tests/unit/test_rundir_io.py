"""Writing and reading streams: durability, torn lines, rotation, and clean errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lorascope.errors import BadInputError, FormatVersionError
from lorascope.rundir.reader import load_run
from lorascope.rundir.writer import Stream, record_launch, stream_prefix

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


def make_run(tmp_path: Path, records: list[dict], segment_bytes: int = 1 << 20, keep: int = 4) -> Path:
    record_launch(tmp_path, "h-1", ["job"])
    stream = Stream(stream_prefix(tmp_path, 0, "h", 42), segment_bytes=segment_bytes, keep_segments=keep)
    for rec in [dict(START), *records]:
        stream.write(rec)
    stream.close()
    return tmp_path


def stream_file(run: Path) -> Path:
    return next((run / "ranks" / "rank-0").glob("*.jsonl"))


def test_round_trip(tmp_path: Path) -> None:
    run = load_run(
        make_run(
            tmp_path,
            [
                {"k": "group", "gid": 0, "name": "default_pg", "ranks": [0], "backend": "gloo"},
                {
                    "k": "coll",
                    "seq": 1,
                    "gid": 0,
                    "op": "all_reduce",
                    "bytes": 8,
                    "dtype": "float32",
                    "async": False,
                    "site": "train.py:3 in main",
                    "step": 0,
                },
                {"k": "coll_end", "seq": 1, "gid": 0, "err": None},
                {
                    "k": "coll",
                    "seq": 2,
                    "gid": 0,
                    "op": "barrier",
                    "bytes": 0,
                    "dtype": None,
                    "async": False,
                    "site": None,
                    "step": 1,
                },
                {"k": "step", "step": 1, "dur": 0.5, "loss": 2.0, "src": "torch"},
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
    run_dir = make_run(tmp_path, [{"k": "step", "step": "one", "dur": 0.5, "loss": None, "src": "torch"}])
    with pytest.raises(BadInputError, match=r"\.jsonl:2: a 'step' record field 'step' is str"):
        load_run(run_dir)


def test_stream_must_begin_with_start(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, [])
    stream_file(run_dir).write_text(json.dumps({"k": "end", "t": 1, "status": "exit", "code": 0}) + "\n")
    with pytest.raises(BadInputError, match="does not begin with a 'start' record"):
        load_run(run_dir)


def test_rotation_keeps_first_and_newest_segments(tmp_path: Path) -> None:
    steps = [
        {"k": "step", "step": i, "dur": 0.1, "loss": None, "src": "torch", "pad": "x" * 200} for i in range(1, 101)
    ]
    run_dir = make_run(tmp_path, steps, segment_bytes=2000, keep=2)
    files = sorted(p.name for p in (run_dir / "ranks" / "rank-0").iterdir())
    assert files[0].endswith(".0000.jsonl") and len(files) == 3
    run = load_run(run_dir)
    kept = [s["step"] for s in run.ranks[0].steps]
    assert kept[-1] == 100 and 1 in kept and len(kept) < 100
    assert any("rotated away" in w for w in run.warnings)


def test_newer_format_is_refused(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, [])
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["version"] = 2
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FormatVersionError, match="format v2 is newer"):
        load_run(run_dir)


def test_sigkill_mid_stream_leaves_every_record(tmp_path: Path) -> None:
    """A writer SIGKILLed while writing as fast as it can: every line before the last is whole."""
    record_launch(tmp_path, "h-1", ["job"])
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from lorascope.rundir.writer import Stream, stream_prefix\n"
        f"s = Stream(stream_prefix(Path({str(tmp_path)!r}), 0, 'h', 42))\n"
        f"s.write({START!r})\n"
        "print('ready', flush=True)\n"
        "i = 0\n"
        "while True:\n"
        "    i += 1\n"
        "    s.write({'k': 'step', 'step': i, 'dur': 0.1, 'loss': None, 'src': 'torch', 'pad': 'y' * (i % 997)})\n"
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
    steps = [s["step"] for s in run.ranks[0].steps]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) > 1000
    assert run.ranks[0].end is None


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
