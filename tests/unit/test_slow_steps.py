"""slow-steps, job-slowdown and the pace table (detect/pace.py) on generated runs whose
ranks meet at one synchronous all_reduce a step: who set the pace since when, where in
the step, what evening it out would save, the blame per collective with clock offsets."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from lorascope.detect import job_slowdown, pace, slow_steps, straggler
from lorascope.detect.registry import run_detectors
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.rundir.loading.reader import Collective, RankData, RunData, recount

PHASES = ("forward", "backward", "optimizer")
#: Per part: data loading, forward, backward, optimizer (seconds of the rank's own work).
BASE = {"data": 0.01, "forward": 0.06, "backward": 0.10, "optimizer": 0.02}


def run_of(
    steps: int,
    ranks: int,
    extra: dict[tuple[int, str], dict[int, float]] | None = None,
    hosts: dict[int, str] | None = None,
    skew: dict[str, float] | None = None,
    seed: int = 0,
    jitter: float = 0.1,
) -> EvidenceBundle:
    """``ranks`` ranks, ``steps`` steps; each part's time is BASE with +-``jitter``
    noise, plus ``extra[(rank, part)][step]``; every step ends in an all_reduce all ranks
    leave together 10 ms after the last arrives. ``skew``: a host's clock ahead by seconds."""
    rng = random.Random(seed)
    extra, hosts, skew = extra or {}, hosts or {}, skew or {}
    data = {
        r: RankData(
            rank=r,
            start={
                "rank": r,
                "world_size": ranks,
                "local_rank": r,
                "pid": 100 + r,
                "host": hosts.get(r, "h0"),
                "device": "cpu",
                "versions": {},
                "argv": ["job.py"],
                "t": 99.0,
            },
            files=[],
        )
        for r in range(ranks)
    }
    begin = 100.0
    for step in range(1, steps + 1):
        arrive, parts = {}, {}
        for r in range(ranks):
            took = {
                p: s * rng.uniform(1 - jitter, 1 + jitter) + extra.get((r, p), {}).get(step, 0.0)
                for p, s in BASE.items()
            }
            parts[r], arrive[r] = took, begin + sum(took.values())
        end = max(arrive.values()) + 0.01
        for r, rank in data.items():
            off = skew.get(rank.host, 0.0)
            t = begin + parts[r]["data"]
            for name in PHASES:
                rank.phases.append({"k": "phase", "name": name, "edge": "begin", "step": step - 1, "t": t + off})
                t += parts[r][name]
                if name == "optimizer":  # the all_reduce closes the optimizer phase
                    rank.collectives.append(
                        Collective(
                            step,
                            "default_pg",
                            "all_reduce",
                            8,
                            "float64",
                            False,
                            "j.py:1",
                            step - 1,
                            t + off,
                            end + off,
                        )
                    )
                    t = end
                rank.phases.append({"k": "phase", "name": name, "edge": "end", "step": step - 1, "t": t + off})
            rank.steps.append(
                {
                    "k": "step",
                    "step": step,
                    "dur": end + 0.001 - begin,
                    "t": end + 0.001 + off,
                    "src": "deepspeed",
                    "loss": 1.0,
                }
            )
        begin = end + 0.001
    for rank in data.values():
        rank.groups[1] = {"gid": 1, "name": "default_pg", "ranks": list(range(ranks))}
        recount(rank)
    launch = {
        "command": ["job.py"],
        "cwd": "/",
        "start": 99.0,
        "end": begin + 1,
        "exit_status": 0,
        "host": "h0",
        "id": "l",
        "pid": 1,
    }
    run = RunData(
        path=Path("/run"),
        manifest={"format": "lorascope-run", "launches": [launch], "ranks": {}},
        ranks=data,
        warnings=[],
    )
    return EvidenceBundle(path=run.path, run=run)


def from_step(first: int, last: int, seconds: float) -> dict[int, float]:
    return dict.fromkeys(range(first, last + 1), seconds)


def test_a_rank_slow_in_data_loading_from_halfway_is_named_with_since_when_where_and_the_saving() -> None:
    """The held-out case: one rank of 3 does 250 ms more data preparation from step 20 of 40;
    straggler alone says nothing (slowest in half the steps)."""
    bundle = run_of(40, 3, {(1, "data"): from_step(20, 40, 0.25)})
    assert straggler.detect(bundle) == []
    [f] = slow_steps.detect(bundle)
    assert f.ranks == [1] and f.severity == "warning"
    assert f.details["first_step"] == 20 and f.details["to_end"] and "from step 20 on" in f.title
    assert f.details["part"] == "data" and "data loading" in f.title
    w = f.details["what_if"]
    # each planted step loses ~250 ms less the slowest other rank's noise over the median
    assert 0.22 <= w["saved_per_step_s"] <= 0.26 and w["steps"] == 21
    assert 0.25 <= w["share_of_run"] <= 0.45
    assert f.details["blame"]["late"] >= 19
    assert run_detectors(bundle)[0].id == "slow-steps"


def test_a_transient_episode_is_named_with_its_steps() -> None:
    bundle = run_of(40, 4, {(2, "backward"): from_step(10, 17, 0.2)}, seed=3)
    [f] = slow_steps.detect(bundle)
    assert f.ranks == [2] and "in steps 10-17" in f.title and f.details["part"] == "backward"
    assert not f.details["to_end"]
    backward = next(p for p in f.details["parts"] if p["part"] == "backward")
    assert backward["own_outside_s"] == pytest.approx(0.10, rel=0.15)


def test_a_persistent_straggler_is_left_to_straggler_which_carries_the_what_if() -> None:
    bundle = run_of(20, 4, {(3, "forward"): from_step(1, 20, 0.3)}, seed=4)
    assert slow_steps.detect(bundle) == []
    [f] = straggler.detect(bundle)
    assert f.ranks == [3] and f.details["what_if"]["saved_per_step_s"] == pytest.approx(0.3, abs=0.04)


def test_a_slow_host_is_named_as_a_group_and_the_clock_offset_taken_out() -> None:
    hosts = {0: "a", 1: "a", 2: "b", 3: "b", 4: "c", 5: "c"}
    extra = {(r, "forward"): from_step(12, 30, 0.2) for r in (2, 3)}
    bundle = run_of(30, 6, extra, hosts=hosts, skew={"b": 5.0, "c": -2.0}, seed=5)
    [f] = slow_steps.detect(bundle)
    assert f.ranks == [2, 3] and "host b's ranks" in f.title and "from step 12 on" in f.title
    b = pace.blame(bundle.run)  # type: ignore[arg-type]
    assert b.offsets["b"] == pytest.approx(5.0, abs=1e-6) and b.offsets["c"] == pytest.approx(-2.0, abs=1e-6)
    assert "clock offsets against a" in " ".join(str(e.value) for e in f.evidence)
    # the group doing the median's work saves ~0.2 s a step; fixing one of its ranks alone saves nothing
    t = pace.table(bundle.run)  # type: ignore[arg-type]
    assert t is not None
    idx = range(t.steps.index(12), len(t.steps))
    assert pace.what_if_summary(t, [2, 3], idx)["saved_per_step_s"] == pytest.approx(0.2, abs=0.04)
    assert pace.what_if_summary(t, [2], idx)["saved_per_step_s"] < 0.02


def test_a_whole_job_regression_is_named_as_such_not_as_a_straggler() -> None:
    extra = {(r, "forward"): from_step(25, 40, 0.15) for r in range(4)}
    bundle = run_of(40, 4, extra, seed=6)
    assert slow_steps.detect(bundle) == [] and straggler.detect(bundle) == []
    [f] = job_slowdown.detect(bundle)
    assert f.severity == "info" and f.details["step"] == 25 and "not a straggler" in f.title
    assert "forward" in f.title


@pytest.mark.parametrize("seed", range(6))
def test_noisy_healthy_runs_stay_quiet(seed: int) -> None:
    bundle = run_of(60, 4, seed=seed, jitter=0.3)
    assert slow_steps.detect(bundle) == [] and job_slowdown.detect(bundle) == []


def test_the_strip_names_the_pace_setter_per_step() -> None:
    bundle = run_of(40, 3, {(1, "data"): from_step(20, 40, 0.25)})
    t = pace.table(bundle.run)  # type: ignore[arg-type]
    assert t is not None
    s = pace.strip(t)
    assert [r for r, first in zip(s["setter"], s["first"], strict=True) if first >= 20] == [1] * 21
    assert all(e > 0.2 for e, first in zip(s["excess_s"], s["first"], strict=True) if first >= 20)


def test_the_report_and_json_carry_the_strip_the_saving_and_the_change_point() -> None:
    from lorascope.analysis import of_bundle
    from lorascope.report.data import build_report_data
    from lorascope.report.render import render

    bundle = run_of(40, 3, {(1, "data"): from_step(20, 40, 0.25)})
    analysis = of_bundle(bundle)
    data = analysis.to_data()
    assert data["pace"]["strip"]["setter"][-1] == 1 and data["pace"]["blame"]["ranks"][0]["rank"] == 1
    assert data["pace"]["blame"]["offsets"] == "one host: no clock offset to take out"
    report = build_report_data(bundle, analysis.findings)
    [mark] = report["charts"]["pace"]["marks"]
    assert mark["ranks"] == [1] and mark["first_step"] == 20 and mark["part"] == "data"
    assert "of the run's time" in mark["saving"]
    assert report["findings"][0]["chart"] == "chart-pace"
    html = render(report)
    assert 'id="chart-pace"' in html and "evening it out would save" in html
