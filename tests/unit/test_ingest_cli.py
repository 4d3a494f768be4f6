"""`lorascope analyze` on artifacts, through the real CLI: a summary for good inputs, one
line and a non-zero status (never a traceback) for every bad input of every loader."""

from __future__ import annotations

import gzip
import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "fixtures"
SNAPSHOT = FIX / "snapshots" / "lora-oom" / "rank-0.pickle"
FLIGHT = FIX / "flight-recorder" / "rank0-extra-allreduce" / "rank-0.pickle"
FLIGHT_JSON = FIX / "flight-recorder" / "rank0-extra-allreduce" / "rank-0.json"
TRACE = next((FIX / "healthy" / "ranks" / "rank-0").glob("*.trace.json.gz"))
LOG = FIX / "snapshots" / "lora-oom" / "job.log"
ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lorascope", "analyze", *args, "--no-hta"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )


def _truncated(src: Path) -> Callable[[Path], Path]:
    def make(tmp: Path) -> Path:
        data = src.read_bytes()
        out = tmp / f"truncated-{src.name}"
        out.write_bytes(data[: len(data) // 2])
        return out

    return make


def _trace_cut_in_its_head(tmp: Path) -> Path:
    """A trace cut before its events (a trace cut inside them is read as far as it goes)."""
    out = tmp / "cut-head.trace.json"
    out.write_bytes(gzip.decompress(TRACE.read_bytes())[:60])
    return out


def _empty(tmp: Path) -> Path:
    out = tmp / "empty"
    out.write_bytes(b"")
    return out


def _random(tmp: Path) -> Path:
    out = tmp / "random.bin"
    out.write_bytes(random.Random(5).randbytes(4096))
    return out


def _png(tmp: Path) -> Path:
    out = tmp / "picture.pickle"
    out.write_bytes(b"\x89PNG\r\n\x1a\n" + random.Random(1).randbytes(500))
    return out


def _other_json(tmp: Path) -> Path:
    out = tmp / "config.json"
    out.write_text(json.dumps({"model": "llama", "lr": 1e-4}))
    return out


def _other_pickle(tmp: Path) -> Path:
    out = tmp / "state.pickle"
    out.write_bytes(b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x02lr\x94G?\x1a6\xe2\xeb\x1cC-s.")
    return out


def _junk_folder(tmp: Path) -> Path:
    out = tmp / "junk"
    out.mkdir()
    (out / "a.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    (out / "b.json").write_text("{}")
    return out


def _empty_folder(tmp: Path) -> Path:
    out = tmp / "nothing"
    out.mkdir()
    return out


def _truncated_gz_log(tmp: Path) -> Path:
    out = tmp / "job.log.gz"
    out.write_bytes(gzip.compress(LOG.read_bytes() * 50)[:300])
    return out


#: (loader forced with --kind, or None for detection; how to make the bad input)
CASES: list[tuple[str | None, Callable[[Path], Path]]] = [
    *[(kind, make) for kind in ("snapshot", "flight", "kineto", "log") for make in (_empty, _random)],
    ("snapshot", _truncated(SNAPSHOT)),
    ("snapshot", lambda t: TRACE),
    ("snapshot", _other_pickle),
    ("flight", _truncated(FLIGHT)),
    ("flight", _truncated(FLIGHT_JSON)),
    ("flight", lambda t: SNAPSHOT),
    ("kineto", _trace_cut_in_its_head),
    ("kineto", lambda t: FLIGHT_JSON),
    ("log", _truncated_gz_log),
    ("log", lambda t: SNAPSHOT),
    ("rundir", lambda t: SNAPSHOT),
    ("rundir", _empty_folder),
    (None, _empty),
    (None, _random),
    (None, _png),
    (None, _other_json),
    (None, _other_pickle),
    (None, _truncated(SNAPSHOT)),
    (None, _trace_cut_in_its_head),
    (None, _truncated_gz_log),
    (None, _junk_folder),
    (None, _empty_folder),
]


def test_every_bad_input_is_one_line_and_a_nonzero_status(tmp_path: Path) -> None:
    jobs = []
    for i, (kind, make) in enumerate(CASES):
        case_dir = tmp_path / str(i)
        case_dir.mkdir()
        target = make(case_dir)
        jobs.append((kind, target, [str(target)] + (["--kind", kind] if kind else [])))
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda job: _cli(*job[2]), jobs))
    for (kind, target, _), proc in zip(jobs, results, strict=True):
        what = f"--kind {kind} {target.name}"
        assert proc.returncode == 3, (what, proc.returncode, proc.stderr)
        assert proc.stdout == "", what
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, (what, proc.stderr)
        assert proc.stderr.startswith("lorascope: error: "), (what, proc.stderr)


def test_summaries_and_json_for_each_kind(tmp_path: Path) -> None:
    folder = tmp_path / "job"
    folder.mkdir()
    for r in (0, 1):
        shutil.copy(FIX / "snapshots" / "lora-oom" / f"rank-{r}.pickle", folder / f"rank-{r}.pickle")
        shutil.copy(FIX / "flight-recorder" / "dtype-mismatch" / f"rank-{r}.pickle", folder / f"fr_rank_{r}")
    shutil.copy(LOG, folder / "job.log")
    shutil.copy(TRACE, folder / "rank-0.trace.json.gz")
    text, js = _cli(str(folder)), _cli(str(folder), "--json", "--fail-on", "error")
    assert text.returncode == 0, text.stderr
    for needle in (
        "oom  ERROR",
        "allocator snapshot, rank 0",
        "peak:",
        "OOM at entry",
        "kernel trace, rank 0",
        "flight-recorder dumps: ranks 0, 1",
        "disagreement: group 0 #4 (size+dtype)",
        "NCCL watchdog timeout on ALLREDUCE #118",
        "collective-mismatch",
    ):
        assert needle in text.stdout, needle
    assert js.returncode == 4
    data = json.loads(js.stdout)
    assert set(data["artifacts"]) == {
        "snapshots",
        "snapshot_comparison",
        "traces",
        "flight_records",
        "flight_alignment",
        "logs",
    }
    assert {f["id"] for f in data["findings"]} >= {"oom", "allocator-fragmentation", "collective-mismatch"}
    assert data["artifacts"]["snapshots"]["0"]["devices"][0]["ooms"][0]["index"] == 59


def test_analyze_keeps_jargon_behind_verbose() -> None:
    """A first run's `analyze` printed "probes' cost: ..." and "HTA: CPU-only trace: HTA
    analyses GPU traces only"; they are there with -v (and the cost in the report's run facts)."""
    run = str(FIX / "healthy")
    plain = subprocess.run([sys.executable, "-m", "lorascope", "analyze", run], capture_output=True, text=True, env=ENV)
    assert plain.returncode == 0, plain.stderr
    assert "probes' cost" not in plain.stdout and "HTA:" not in plain.stdout
    verbose = subprocess.run(
        [sys.executable, "-m", "lorascope", "analyze", "-v", run], capture_output=True, text=True, env=ENV
    )
    assert "HTA: CPU-only trace" in verbose.stdout  # (the fixture predates cost records: test_probe_cost)
