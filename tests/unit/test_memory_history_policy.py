"""``--memory-history auto``: when a CUDA rank records the allocator's history
(lorascope/probes/history_policy.py), replayed over recorded GPU runs (fixtures/gpu/) and
over generated readings; the probe's starts and stops with torch's recording call
standing in for the device (it raises on a CPU build); the switch and the run command."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lorascope.ingest.load import load_bundle
from lorascope.probes import allocator as allocator_mod
from lorascope.probes.allocator import AllocatorProbe, parse_switch
from lorascope.probes.history_policy import FIRST_STEPS, HistoryPolicy, replay
from lorascope.probes.session import Session
from lorascope.rundir.format.safe_pickle import load_pickle
from lorascope.rundir.format.writer import Stream, ensure_manifest, stream_prefix
from lorascope.rundir.loading.reader import load_run
from tests.helpers import FIXTURES, OOM_SNAPSHOTS

GIB = 2**30


def _device_total(run: Any) -> int:
    """The device's memory, from the NVML samples of a recorded GPU run."""
    return next(m["nvml"]["total"] for r in run.ranks.values() for m in r.mem if isinstance(m.get("nvml"), dict))


def _steps_on(mem: list[dict[str, Any]], toggles: list[dict[str, Any]]) -> set[int]:
    """The steps at which history was on, from the decisions over a rank's readings."""
    on, at, steps = False, iter(toggles), set()
    nxt = next(at, None)
    for record in mem:
        if record["src"] == "sampler":
            continue
        if nxt is not None and record["src"] == nxt["src"] and record["step"] == nxt["step"]:
            on, nxt = nxt["on"], next(at, None)
        if on and record["src"] != "step":  # a step's end carries the next step's number
            steps.add(record["step"])
    return steps


@pytest.mark.parametrize("name", ["healthy", "single", "shared"])
def test_recorded_healthy_gpu_runs_record_only_their_first_steps(name: str) -> None:
    run = load_run(FIXTURES / "gpu" / name)
    limit = _device_total(run)
    for rank in run.ranks.values():
        toggles = list(replay(rank.mem, limit))
        assert [t["on"] for t in toggles] == [True, False]
        assert toggles[0]["why"] == f"the first {FIRST_STEPS} steps" and toggles[1]["step"] == FIRST_STEPS
        steps = {s["step"] for s in rank.steps}
        on = _steps_on(rank.mem, toggles)
        assert on == set(range(FIRST_STEPS)) and len(steps) > 3 * len(on)
        # always and off: one decision each, never changed
        assert [t["on"] for t in replay(rank.mem, limit, "always")] == [True]
        assert list(replay(rank.mem, limit, "off")) == []


def test_recorded_oom_run_records_at_its_oom() -> None:
    """The planted OOM (the logits spike under a memory cap, in the first step): history is
    on when the observer takes the snapshot, so its live blocks carry stacks."""
    run = load_run(FIXTURES / "gpu" / "oom")
    rank = run.ranks[0]
    toggles = list(replay(rank.mem, _device_total(run)))
    assert [t["on"] for t in toggles] == [True]
    oom = next(s for s in rank.snapshots if s["reason"] == "oom")
    assert oom["step"] < FIRST_STEPS


def _readings(reserved_gib: list[float], phases: dict[int, str] | None = None) -> list[dict[str, Any]]:
    """One step's edges a reading each, reserved memory per step; ``phases`` puts an
    evaluation (or a save) after that step."""
    mem: list[dict[str, Any]] = []
    for step, gib in enumerate(reserved_gib):
        cuda = {"device": 0, "alloc": int(gib * GIB * 0.8), "reserved": int(gib * GIB), "max_alloc": 0}
        for src in ("forward.begin", "forward.end", "backward.begin", "backward.end", "optimizer.begin"):
            mem.append({"src": src, "step": step, "cuda": cuda})
        mem.append({"src": "step", "step": step + 1, "cuda": cuda})
        if phases and step in phases:
            mem += [{"src": f"{phases[step]}.{e}", "step": step + 1, "cuda": cuda} for e in ("begin", "end")]
    return mem


def test_growth_towards_the_limit_starts_recording_and_hysteresis_holds_it() -> None:
    limit = 80 * GIB
    reserved = [40.0] * 10 + [60.0, 69.0, 66.0, 62.0, 61.0, 59.0, 40.0, 40.0]
    toggles = list(replay(_readings(reserved), limit))
    assert [(t["on"], t["step"]) for t in toggles] == [(True, 0), (False, 3), (True, 11), (False, 15)]
    assert toggles[2]["why"] == "reserved 86% of 80.0 GiB"
    # between 75% and 85% it stays on (66, 62, 61 GiB: 82%, 78%, 76%) and goes off under 75% (59 GiB)
    on = _steps_on(_readings(reserved), toggles)
    assert {11, 12, 13, 14} <= on and 15 not in on and 16 not in on


def test_evaluation_and_save_phases_are_recorded() -> None:
    toggles = list(replay(_readings([10.0] * 12, {5: "eval", 9: "save"}), 80 * GIB))
    assert [(t["on"], t["why"], t["src"]) for t in toggles] == [
        (True, "the first 3 steps", "forward.begin"),
        (False, None, "step"),
        (True, "eval phase", "eval.begin"),
        (False, None, "eval.end"),
        (True, "save phase", "save.begin"),
        (False, None, "save.end"),
    ]


def test_without_a_limit_only_steps_and_phases_decide() -> None:
    policy = HistoryPolicy()
    assert policy.observe("cuda.init", 0, None, None) and policy.on
    assert policy.observe("step", FIRST_STEPS, 79 * GIB, None) and not policy.on
    assert not policy.observe("forward.begin", FIRST_STEPS, 79 * GIB, 0)


def test_switch() -> None:
    entries = allocator_mod.DEFAULT_ENTRIES
    assert parse_switch(None) == ("auto", entries)
    assert parse_switch("auto") == ("auto", entries)
    assert parse_switch("on") == ("always", entries)
    assert parse_switch("always:20000") == ("always", 20000)
    assert parse_switch("off") == ("off", entries)
    assert parse_switch("0") == ("off", entries)
    assert parse_switch("20000") == ("auto", 20000)
    assert parse_switch("sometimes") == ("auto", entries)


# -- the probe, with torch's recording call standing in for the device --------------------


class _FakeRecording:
    """``torch.cuda.memory._record_memory_history`` (a CPU build raises), the calls kept."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def __call__(self, enabled: str | None = "all", **kwargs: Any) -> None:
        self.calls.append(enabled)


def _session(run: Path) -> tuple[Session, Path]:
    ensure_manifest(run)
    prefix = stream_prefix(run, 0, "host", 4242)
    session = Session(Stream(prefix), rank=0, local_rank=0, world_size=1, sample_interval=0)
    session.record(
        "start", rank=0, world_size=1, local_rank=0, pid=4242, host="host", argv=[], versions={}, device="cuda:0"
    )
    return session, prefix


def test_probe_starts_and_stops_recording_with_history_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeRecording()
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", fake)
    monkeypatch.setattr(allocator_mod, "_device_limit", lambda _torch: 80 * GIB)
    session, prefix = _session(tmp_path / "run")
    probe = AllocatorProbe(session, prefix, "auto")
    probe._on_cuda_init()
    assert fake.calls == ["all"] and probe.recording
    for step in range(8):
        session.step = step
        cuda = {"device": 0, "alloc": 0, "reserved": (70 if step >= 6 else 10) * GIB, "max_alloc": 0}
        for src in ("forward.begin", "backward.end", "step"):
            probe.observe(src, cuda)
        if step == 5:
            probe.observe("eval.begin", cuda)
            probe.observe("eval.end", cuda)
    assert fake.calls == ["all", None, "all", None, "all"] and probe.recording
    session.flush()
    rank = load_run(tmp_path / "run").ranks[0]
    assert rank.memory_history is not None and rank.memory_history["mode"] == "auto"
    assert rank.memory_history["limit"] == 80 * GIB and rank.memory_history["on"]
    assert rank.history == {
        **rank.history,
        "on": True,
        "why": "reserved 88% of 80.0 GiB",
        "src": "forward.begin",
        "step": 6,
    }
    assert rank.probe_errors == []


def test_snapshot_with_history_off_says_its_blocks_lack_stacks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A snapshot taken while ``auto`` had stopped recording is still written (sizes,
    segments); the analysis says that its blocks allocated meanwhile show no stacks."""
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", _FakeRecording())
    monkeypatch.setattr(allocator_mod, "_device_limit", lambda _torch: 80 * GIB)
    data = load_pickle(OOM_SNAPSHOTS / "rank-0.pickle")
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda *a, **k: data)
    session, prefix = _session(tmp_path / "run")
    probe = AllocatorProbe(session, prefix, "auto")
    probe._on_cuda_init()
    session.step = FIRST_STEPS
    probe.observe("step", {"device": 0, "alloc": 0, "reserved": GIB, "max_alloc": 0})
    assert not probe.recording
    probe._on_oom(0, 2 * GIB, 70 * GIB, GIB)
    session.flush()
    rank = load_run(tmp_path / "run").ranks[0]
    assert [(s["reason"], s["history"]) for s in rank.snapshots] == [("oom", None)]
    bundle = load_bundle(tmp_path / "run")
    assert 0 in bundle.snapshots
    assert any("taken with allocator history off (--memory-history auto)" in w for w in bundle.warnings)


def test_run_passes_the_mode_to_the_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lorascope.cli.run import _child_env

    monkeypatch.setenv(allocator_mod.ENV_SWITCH, "always:20000")
    env = _child_env(tmp_path, tmp_path / "b", "l", 0.5, "off", "auto")
    assert env[allocator_mod.ENV_SWITCH] == "auto:20000"
    monkeypatch.delenv(allocator_mod.ENV_SWITCH)
    assert _child_env(tmp_path, tmp_path / "b", "l", 0.5, "off", "off")[allocator_mod.ENV_SWITCH] == "off"
