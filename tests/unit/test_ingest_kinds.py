"""Kinds by content, --kind, ranks from paths, and a folder of one job's artifacts loaded
into one bundle."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import pytest

from lorascope.detect.hang.flight_align import flight_alignment
from lorascope.errors import BadInputError, UsageError
from lorascope.ingest.kinds import detect_kind
from lorascope.ingest.load import load_bundle
from lorascope.ingest.path_rank import rank_from_path

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "fixtures"


@pytest.mark.parametrize(
    "path, kind",
    [
        (FIX / "snapshots" / "lora-oom" / "rank-0.pickle", "snapshot"),
        (FIX / "snapshots" / "lora-oom" / "job.log", "log"),
        (FIX / "flight-recorder" / "healthy" / "rank-0.pickle", "flight"),
        (FIX / "flight-recorder" / "rank0-extra-allreduce" / "rank-1.json", "flight"),
        (FIX / "healthy", "rundir"),
        (next((FIX / "healthy" / "ranks" / "rank-0").glob("*.trace.json.gz")), "kineto"),
        (FIX / "healthy" / "manifest.json", None),
        (FIX, None),
    ],
)
def test_kind_by_content(path: Path, kind: str | None) -> None:
    assert detect_kind(path) == kind


def test_kind_ignores_names(tmp_path: Path) -> None:
    disguised = tmp_path / "notes.txt"
    shutil.copy(FIX / "flight-recorder" / "healthy" / "rank-0.pickle", disguised)
    assert detect_kind(disguised) == "flight"


@pytest.mark.parametrize(
    "name, rank",
    [
        ("rank-3.pickle", 3),
        ("snapshot_rank7.pickle", 7),
        ("nccl_trace_rank_12", 12),
        ("oom_snapshot_2.pickle", 2),
        ("trace.json.gz", None),
        ("snapshot_1716000000.pickle", None),
        ("ranks/rank-5/x.json.gz", 5),
        ("4/dump.pkl", 4),
    ],
)
def test_rank_from_path(name: str, rank: int | None) -> None:
    assert rank_from_path(Path(name)) == rank


def test_mixed_folder_of_one_job(tmp_path: Path) -> None:
    for r in (0, 1):
        shutil.copy(FIX / "snapshots" / "lora-oom" / f"rank-{r}.pickle", tmp_path / f"snapshot_rank{r}.pickle")
        shutil.copy(
            FIX / "flight-recorder" / "rank0-extra-allreduce" / f"rank-{r}.pickle", tmp_path / f"nccl_trace_rank_{r}"
        )
    shutil.copy(FIX / "snapshots" / "lora-oom" / "job.log", tmp_path / "job.log")
    traces = tmp_path / "traces"
    traces.mkdir()
    shutil.copy(next((FIX / "healthy" / "ranks" / "rank-0").glob("*.trace.json.gz")), traces / "anything.json.gz")
    (tmp_path / "README").write_text("notes about the job\n")
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
    bundle = load_bundle(tmp_path, hta=False)
    assert sorted(bundle.snapshots) == [0, 1] and sorted(bundle.flight_records) == [0, 1]
    assert list(bundle.traces) == [0] and len(bundle.logs) == 1
    assert bundle.snapshot_comparison is not None and flight_alignment(bundle) is not None
    assert flight_alignment(bundle).first_disagreement is not None
    assert any("README" in w and "not a job log" in w for w in bundle.warnings)


def test_forced_kind(tmp_path: Path) -> None:
    snap = FIX / "snapshots" / "fragmented" / "rank-0.pickle"
    assert list(load_bundle(snap, kind="snapshot").snapshots) == [0]
    with pytest.raises(BadInputError, match="not a flight-recorder dump"):
        load_bundle(snap, kind="flight")
    with pytest.raises(BadInputError, match="not a lorascope run directory"):
        load_bundle(tmp_path, kind="rundir")
    with pytest.raises(UsageError):
        load_bundle(snap, kind="nonsense")
    (tmp_path / "a.log").write_text("plain words\n")
    with pytest.raises(BadInputError, match="not a job log"):
        load_bundle(tmp_path / "a.log")
    assert load_bundle(tmp_path / "a.log", kind="log").logs[0].lines == 1  # forced: any text
    with pytest.raises(BadInputError, match="not text"):
        load_bundle(snap, kind="log")


def test_run_directory_loads_its_traces() -> None:
    bundle = load_bundle(FIX / "healthy", hta=None)
    assert bundle.run is not None and sorted(bundle.traces) == [0, 1]
    assert bundle.traces[0].hta is None and "CPU" in (bundle.traces[0].hta_note or "")
    assert bundle.trace_comparison is not None


def test_unknown_rank_gets_the_next_free_one(tmp_path: Path) -> None:
    for name in ("a.pickle", "b.pickle"):
        shutil.copy(FIX / "snapshots" / "fragmented" / "rank-0.pickle", tmp_path / name)
    with gzip.open(tmp_path / "c.json.gz", "wb") as f:
        f.write(gzip.decompress((next((FIX / "healthy" / "ranks" / "rank-1").glob("*.trace.json.gz"))).read_bytes()))
    bundle = load_bundle(tmp_path, hta=False)
    assert sorted(bundle.snapshots) == [0, 1] and list(bundle.traces) == [1]
    assert sum("taken as rank" in w for w in bundle.warnings) == 2
