"""Allocator snapshots the probes write into a run directory (lorascope/probes/allocator.py),
read back as each rank's snapshot and fed to the memory detectors.

No GPU here: the run directories are real CPU runs (fixtures/) with snapshot files in
the pickle format ``torch.cuda.memory._dump_snapshot`` writes (fixtures/snapshots/) put
where and how the probe puts them. The probe's writing path runs with torch's
``_snapshot`` standing in for the device (it raises on a CPU build); the parts that need
no device (the switch, the OOM chain, the CPU build's off-switch) run for real.
"""

from __future__ import annotations

import json
import pickle
import shutil
import struct
from pathlib import Path

import pytest
import torch

from lorascope.detect.registry import run_detectors
from lorascope.ingest.load import load_bundle, rank_snapshot
from lorascope.probes import allocator as allocator_mod
from lorascope.probes.allocator import MAX_REQUESTED, AllocatorProbe, is_oom, parse_switch
from lorascope.probes.session import Session
from lorascope.rundir.format.layout import HEADER, MEM_FIELDS, offset_of
from lorascope.rundir.format.safe_pickle import load_pickle
from lorascope.rundir.format.writer import Stream, ensure_manifest, stream_prefix
from lorascope.rundir.loading.reader import load_run
from tests.helpers import FIXTURES, OOM_SNAPSHOTS, add_snapshot


@pytest.fixture
def asym_run(tmp_path: Path) -> Path:
    """The recorded rank0-asymmetry CPU run, with the lora-oom snapshots as its ranks' own."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "rank0-asymmetry", run)
    for rank in (0, 1):
        add_snapshot(run, rank, OOM_SNAPSHOTS / f"rank-{rank}.pickle", "oom")
    return run


def test_run_dir_snapshot_is_analysed_as_that_ranks(asym_run: Path) -> None:
    bundle = load_bundle(asym_run)
    assert sorted(bundle.snapshots) == [0, 1]
    for rank, snap in bundle.snapshots.items():
        assert snap.rank == rank
        assert snap.path.parent == asym_run / "ranks" / f"rank-{rank}"
        assert snap.path.name.endswith(".snapshot.oom.pickle")
    assert bundle.snapshot_comparison is not None
    findings = {f.id: f for f in run_detectors(bundle)}
    oom = findings["oom"]
    assert oom.ranks == [0] and str(asym_run) in oom.evidence[0].source
    assert oom.details["by_category"] and oom.details["sites"]
    # the run's own records name the asymmetry; the snapshots add what rank 0 alone holds
    asym = findings["rank0-asymmetry"]
    only = [e for e in asym.evidence if e.label.startswith("on rank 0 ")]
    assert only and all(str(asym_run) in e.source for e in only)
    # the run's logits records show no spike; the snapshots' loss-frame blocks do
    assert findings["logits-spike"].details["source"] == "snapshot"


def test_oom_snapshot_stands_for_the_rank_over_later_ones(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "rank0-asymmetry", run)
    add_snapshot(run, 0, OOM_SNAPSHOTS / "rank-0.pickle", "oom")
    add_snapshot(run, 0, FIXTURES / "snapshots" / "fragmented" / "rank-0.pickle", "signal-1795944980")
    rank0 = load_run(run).ranks[0]
    assert [s["reason"] for s in rank0.snapshots] == ["oom", "signal-1795944980"]
    assert rank_snapshot(rank0)["reason"] == "oom"
    bundle = load_bundle(run)
    assert bundle.snapshots[0].path.name.endswith(".snapshot.oom.pickle")
    assert any("2 allocator snapshots; analysed the oom one" in w for w in bundle.warnings)


def test_bad_or_missing_snapshot_files_are_warnings(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "rank0-asymmetry", run)
    evil = tmp_path / "evil.pickle"
    evil.write_bytes(pickle.dumps({"segments": [shutil.rmtree]}))  # a GLOBAL opcode: refused, never loaded
    add_snapshot(run, 0, evil, "oom")
    gone = add_snapshot(run, 1, OOM_SNAPSHOTS / "rank-1.pickle", "oom")
    gone.unlink()
    bundle = load_bundle(run)
    assert bundle.snapshots == {}
    assert any(w.startswith("rank 0: ") and "evil" not in w and "snapshot.oom.pickle" in w for w in bundle.warnings)
    assert any("snapshot file" in w and "is missing" in w for w in bundle.warnings)


# -- the probe ---------------------------------------------------------------------


def test_oom_is_found_in_the_exception_chain() -> None:
    def caught_and_reraised() -> None:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        except torch.OutOfMemoryError:
            raise ValueError("batch too large") from None  # context suppressed, still chained

    with pytest.raises(ValueError) as info:
        caught_and_reraised()
    assert is_oom(info.value)
    assert is_oom(RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; ...)"))
    assert not is_oom(ValueError("loss is nan"))
    assert not is_oom(None)


def _session(run: Path, rank: int = 0) -> tuple[Session, Path]:
    ensure_manifest(run)
    prefix = stream_prefix(run, rank, "host", 4242)
    session = Session(Stream(prefix), rank=rank, local_rank=rank, world_size=1, sample_interval=0)
    session.record(
        "start", rank=rank, world_size=1, local_rank=rank, pid=4242, host="host", argv=[], versions={}, device="cuda:0"
    )
    return session, prefix


def test_cpu_build_switches_the_probe_off_silently(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A CPU build of torch: off at import with the reason; and should the queue run
    anyway, torch's own error (``_record_memory_history`` raises here) is recorded, not raised."""
    session, prefix = _session(tmp_path / "run")
    probe = AllocatorProbe(session, prefix, "always")
    probe.install(torch)
    probe._on_cuda_init()  # already decided: nothing more
    probe.dump("signal-1")
    probe.after_exception(torch.OutOfMemoryError("CUDA out of memory."))
    session.flush()  # records are queued for the writer thread (not started here)
    rank = load_run(tmp_path / "run").ranks[0]
    assert rank.memory_history == {**rank.memory_history, "on": False}
    assert "built without CUDA" in rank.memory_history["reason"]
    assert rank.snapshots == [] and rank.probe_errors == []
    assert capsys.readouterr().err == ""
    assert not list(prefix.parent.glob("*.pickle"))
    late_session, late_prefix = _session(tmp_path / "late")
    late = AllocatorProbe(late_session, late_prefix, "always")
    late._on_cuda_init()  # runs torch's real _record_memory_history, which fails on this build
    assert not late.recording and not late.started
    late_session.flush()  # records are queued for the writer thread (not started here)
    late_history = load_run(tmp_path / "late").ranks[0].memory_history
    assert late_history["on"] is False and "record_memory_history" in late_history["reason"]
    assert capsys.readouterr().err == ""


def test_switched_off_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(allocator_mod.ENV_SWITCH, "off")
    session, prefix = _session(tmp_path / "run")
    AllocatorProbe(session, prefix, *parse_switch("off")).install(torch)
    session.flush()  # records are queued for the writer thread (not started here)
    rank = load_run(tmp_path / "run").ranks[0]
    assert rank.memory_history["on"] is False and "switched off" in rank.memory_history["reason"]


def test_snapshots_written_once_per_oom_and_bounded_on_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writing path, with torch's ``_snapshot`` standing in for the device (it
    returns the lora-oom fixture, the real format)."""
    data = load_pickle(OOM_SNAPSHOTS / "rank-0.pickle")
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda *a, **k: data)
    session, prefix = _session(tmp_path / "run")
    probe = AllocatorProbe(session, prefix, "always")
    probe.started = True  # as after _record_memory_history on a CUDA rank
    probe._on_oom(0, 2 << 30, 70 << 30, 1 << 30)  # the allocator's observer
    probe._on_oom(0, 2 << 30, 70 << 30, 1 << 30)  # a job that retries: no second file
    probe.after_exception(torch.OutOfMemoryError("CUDA out of memory."))  # already dumped
    for i in range(MAX_REQUESTED + 2):
        probe.dump(f"signal-{i}")
    session.flush()  # records are queued for the writer thread (not started here)
    rank = load_run(tmp_path / "run").ranks[0]
    assert [s["reason"] for s in rank.snapshots] == ["oom"] + [f"signal-{i}" for i in range(MAX_REQUESTED)]
    oom = rank.snapshots[0]
    assert oom["via"] == "observer" and oom["requested"] == 2 << 30 and oom["device_free"] == 1 << 30
    assert oom["trace_entries"] == sum(len(t) for t in data["device_traces"])
    assert Path(oom["path"]).stat().st_size == oom["bytes"]
    assert not list(prefix.parent.glob("*.tmp"))
    bundle = load_bundle(tmp_path / "run")
    assert bundle.snapshots[0].main is not None and bundle.snapshots[0].main.ooms


def test_oom_observer_never_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception out of the observer would replace the job's OutOfMemoryError."""

    def broken(*_a: object, **_k: object) -> dict:
        raise RuntimeError("snapshot failed")

    monkeypatch.setattr(torch.cuda.memory, "_snapshot", broken)
    session, prefix = _session(tmp_path / "run")
    probe = AllocatorProbe(session, prefix, "always")
    probe.started = True
    probe._on_oom(0, 1, 2, 3)
    session.flush()  # records are queued for the writer thread (not started here)
    rank = load_run(tmp_path / "run").ranks[0]
    assert rank.snapshots == []
    assert [e["probe"] for e in rank.probe_errors] == ["allocator"]


def test_uncaught_oom_dumps_when_no_observer_did(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = load_pickle(OOM_SNAPSHOTS / "rank-1.pickle")
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda *a, **k: data)
    session, prefix = _session(tmp_path / "run")
    probe = AllocatorProbe(session, prefix, "always")
    probe.started = True
    probe.after_exception(ValueError("not memory"))
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        except torch.OutOfMemoryError as exc:
            raise RuntimeError("step failed") from exc
    except RuntimeError as exc:
        probe.after_exception(exc)
    session.flush()  # records are queued for the writer thread (not started here)
    [snap] = load_run(tmp_path / "run").ranks[0].snapshots
    assert snap["reason"] == "oom" and snap["via"] == "exception"


def test_a_cuda_rank_without_history_says_why(tmp_path: Path) -> None:
    """Recording failed on a rank that used CUDA: the analysis warns, naming torch's error
    (a CPU rank, or one switched off by the user, is not worth a line)."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "healthy", run)
    for rank, reason in ((0, "RuntimeError: cudaMallocAsync does not yet support recordHistory"), (1, "switched off")):
        stream = next((run / "ranks" / f"rank-{rank}").glob("*.0000.jsonl"))
        # the recording's own history records (a CPU rank's) go: the planted one says it
        lines = [
            line for line in stream.read_text().splitlines(keepends=True) if json.loads(line)["k"] != "memory_history"
        ]
        t = json.loads(lines[1])["t"]
        planted = {"on": False, "reason": reason, "k": "memory_history", "t": t}
        stream.write_text(lines[0] + json.dumps(planted) + "\n" + "".join(lines[1:]))
        # the rank's first reading becomes a CUDA rank's (its allocator's counters read)
        mem = next((run / "ranks" / f"rank-{rank}").glob("*.mem"))
        data = bytearray(mem.read_bytes())
        codes = {name: code for name, code, _ in MEM_FIELDS}
        for name, value in (("alloc", 1), ("reserved", 2), ("max_alloc", 1), ("device", 0)):
            struct.pack_into("<" + codes[name], data, HEADER.size + offset_of(MEM_FIELDS, name), value)
        mem.write_bytes(bytes(data))
    warnings = [w for w in load_bundle(run).warnings if "allocator history" in w]
    assert warnings == [
        "rank 0: no allocator history on this CUDA rank: RuntimeError: cudaMallocAsync does not yet support recordHistory"
    ]
