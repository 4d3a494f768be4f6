"""The ZeRO-3 parameter-state probe on a stand-in for deepspeed's GatheredParameters (the
real one is exercised by tests/e2e/test_hang.py): each entry and exit is a record with
the job's call site and the rank condition around it; a failure switches the probe off
and never reaches the job."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

from lorascope.probes.collectives import CollectiveProbe
from lorascope.probes.session import Session
from lorascope.probes.zero_params import ZeroParamProbe
from lorascope.rundir.format.writer import Stream, ensure_manifest, stream_prefix


class Gathered:
    """What the probe reads of deepspeed.zero.GatheredParameters: enabled, params, src_rank."""

    def __init__(self, params: list[Any], enabled: bool = True) -> None:
        self.enabled, self.params, self.src_rank = enabled, params, None
        self.entered = 0

    def __enter__(self) -> Gathered:
        self.entered += 1
        return self

    def __exit__(self, *exc: Any) -> bool:
        return False


class Broken(Gathered):
    @property  # type: ignore[override]
    def params(self) -> list[Any]:
        raise RuntimeError("no params here")

    @params.setter
    def params(self, value: list[Any]) -> None:
        pass


def _records(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for p in sorted(run.glob("ranks/*/*.jsonl")) for line in p.read_text().splitlines()]


def test_entries_are_recorded_with_site_and_condition(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ensure_manifest(run)
    session = Session(Stream(stream_prefix(run, 0, "h", 1)), 0, 0, 2, 0.0)
    probe = ZeroParamProbe(session, CollectiveProbe(session, stream_prefix(run, 0, "h", 1)))
    probe.install(types.SimpleNamespace(GatheredParameters=Gathered))
    rank = 0
    persistent = types.SimpleNamespace(ds_persist=True)
    if rank == 0:
        with Gathered([persistent, object()]) as ctx:
            pass
    with Gathered([], enabled=False):  # a no-op context: no record
        pass
    session.stream.close()
    assert ctx.entered == 1
    zero = [r for r in _records(run) if r["k"] == "zero_param"]
    assert [(r["op"], r["params"], r["persistent"]) for r in zero] == [("enter", 2, 1), ("exit", 2, 1)]
    site = zero[0]["site"]
    assert site.startswith(f"{__file__}:") and site.endswith("in test_entries_are_recorded_with_site_and_condition")
    [described] = [r for r in _records(run) if r["k"] == "site" and r["site"] == site]
    assert "if rank == 0:" in described["conditions"]


def test_a_failing_probe_switches_off_and_the_job_goes_on(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ensure_manifest(run)
    session = Session(Stream(stream_prefix(run, 0, "h", 1)), 0, 0, 2, 0.0)
    probe = ZeroParamProbe(session, CollectiveProbe(session, stream_prefix(run, 0, "h", 1)))
    probe.install(types.SimpleNamespace(GatheredParameters=Broken))
    with Broken([]) as ctx:
        pass
    with Broken([]):
        pass
    session.stream.close()
    assert ctx.entered == 1
    errors = [r for r in _records(run) if r["k"] == "probe_error"]
    assert [e["probe"] for e in errors] == ["zero-params"] and "no params here" in errors[0]["error"]
