"""slow-steps, job-slowdown and the pace table (detect/pace.py) on generated runs whose
ranks meet at one synchronous all_reduce a step: who set the pace since when, where in
the step, what evening it out would save, the blame per collective with clock offsets."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest

from lorascope.detect import job_slowdown, pace, shifts, slow_steps, straggler
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


def test_a_step_slow_by_chance_before_the_slowness_is_not_its_start() -> None:
    """The CI run under load that read "from step 7" for a planting from step 10: one step
    slow by chance, two cold steps, then the slowness; the episode starts where it began."""
    bundle = run_of(20, 3, {(1, "data"): {7: 0.3, **from_step(10, 20, 0.3)}})
    [f] = slow_steps.detect(bundle)
    assert f.details["first_step"] == 10 and f.details["to_end"]


def test_an_episode_starts_and_ends_on_hot_steps_next_to_hot_ones() -> None:
    hot = [False] * 3 + [True, False, False] + [True] * 6 + [False, True] + [False] * 3
    assert shifts.episodes(hot, 5, 2, 0.7) == [(6, 11)]
    # hot steps alternating with cold ones within the share keep their edges
    assert shifts.episodes([True, True, False, True, True, False, True, True], 5, 2, 0.6) == [(0, 7)]


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


def test_a_rank_below_the_straggler_ratio_is_named_from_the_change_against_its_own_steps() -> None:
    """The others' work hides their waiting for it (ZeRO-3's prefetching all-gathers
    wait on a handle, inside their forward): rank 1's +80 ms from step 15 of 30 reads only
    ~1.2x the others' median, under the straggler's 1.5x, but it is a change of its excess
    over the others far above that excess's step-to-step noise."""
    extra: dict[tuple[int, str], dict[int, float]] = {(1, "forward"): from_step(15, 30, 0.08)}
    extra.update({(r, "forward"): from_step(15, 30, 0.04) for r in (0, 2, 3)})
    bundle = run_of(30, 4, extra, seed=7)
    [f] = slow_steps.detect(bundle)
    assert f.ranks == [1] and "from step 15 on" in f.title and f.details["part"] == "forward"
    assert f.details["ratio"] < 1.3
    # evening rank 1 out also ends the others' 40 ms of waiting inside their forward
    w = f.details["what_if"]
    assert w["others_rise_s"] == pytest.approx(0.04, abs=0.01)
    assert w["saved_per_step_s"] == pytest.approx(0.08, abs=0.015)


def test_a_rank_slower_off_and_on_by_as_much_as_it_varies_is_neither_straggler_nor_slow_steps() -> None:
    """A rank sharing its core with another busy process off and on: slower in most steps,
    2x the other's median, but by 0-400 ms, as much as it measures. Of 2 ranks the other
    one's noise alone was a quiet rank's and named it (the healthy sweep's one warning)."""
    rng = random.Random(0)
    bundle = run_of(40, 2, {(1, "backward"): {s: rng.uniform(0.0, 0.4) for s in range(1, 41)}}, seed=8, jitter=0.03)
    t = pace.table(bundle.run)  # type: ignore[arg-type]
    assert t is not None
    n = range(len(t.steps))
    excess = [t.work[1][i] - t.work[0][i] for i in n]
    # what named it before: >= 1.5x, slowest in >= 75% of the steps, >= 3x the other rank's noise
    assert statistics.median(t.work[1][i] / t.work[0][i] for i in n) >= 1.5
    assert sum(e > 0 for e in excess) >= 0.75 * len(excess)
    assert statistics.median(excess) >= 3 * shifts.mad(t.work[0])
    assert statistics.median(excess) < 3 * shifts.step_noise(excess)
    assert straggler.detect(bundle) == [] and slow_steps.detect(bundle) == []


def test_a_steady_straggler_of_two_ranks_is_still_named() -> None:
    bundle = run_of(40, 2, {(1, "backward"): from_step(1, 40, 0.15)}, seed=9)
    [f] = straggler.detect(bundle)
    assert f.ranks == [1] and f.details["own_noise_s"] < 0.02
    # of two ranks the median rank is the other one: the whole excess is saved
    assert f.details["what_if"]["saved_per_step_s"] == pytest.approx(0.15, abs=0.02)


def test_step_noise_ignores_a_change_of_level() -> None:
    rng = random.Random(1)
    series = [rng.gauss(0.0, 0.01) + (0.25 if i >= 20 else 0.0) for i in range(40)]
    assert shifts.mad(series) > 0.1
    assert 0.004 < shifts.step_noise(series) < 0.015


def test_two_slow_ranks_of_one_host_that_take_turns_are_named_together() -> None:
    """Two ranks of 4 on one host, each +200 ms in its forward from step 12 of 30: they
    take turns setting the pace, so neither has an episode of its own."""
    extra = {(r, "forward"): from_step(12, 30, 0.2) for r in (2, 3)}
    bundle = run_of(30, 4, extra, seed=10)
    [f] = slow_steps.detect(bundle)
    assert f.ranks == [2, 3] and f.title.startswith("ranks 2, 3 set the pace from step 12 on")
    assert f.details["what_if"]["saved_per_step_s"] == pytest.approx(0.2, abs=0.03)


def test_a_rank_that_became_slow_is_slow_steps_even_when_slowest_in_most_steps() -> None:
    """Slow from step 8 of 30: slowest in >= 75% of the steps, so the straggler's
    persistence holds, but it was not slow before: slow-steps names it, since when, and
    its what-if covers the steps since the change, not the 6 before."""
    bundle = run_of(30, 4, {(1, "forward"): from_step(8, 30, 0.3)}, seed=12)
    assert straggler.detect(bundle) == []
    [f] = slow_steps.detect(bundle)
    assert f.ranks == [1] and "from step 8 on" in f.title
    w = f.details["what_if"]
    assert w["steps"] == 23 and w["baseline_steps"] == 6
    assert w["saved_per_step_s"] == pytest.approx(0.3, abs=0.04)


def test_a_rank_slow_all_along_and_slower_later_stays_the_straggler() -> None:
    extra = {(1, "forward"): {s: 0.15 + (0.2 if s >= 20 else 0.0) for s in range(1, 41)}}
    bundle = run_of(40, 4, extra, seed=16)
    [f] = straggler.detect(bundle)
    assert f.ranks == [1] and f.details["what_if"]["steps"] == 39


def test_neighbours_slowed_by_a_slow_rank_are_not_a_whole_job_regression() -> None:
    """3 ranks on 2 cores: rank 1's +250 ms of data preparation from step 20 also slows
    the others' own work by 90 ms (their forward): every rank's work rose >= 1.3x, but
    the median rank's by a third of the step's rise; the rest is waiting for rank 1."""
    extra: dict[tuple[int, str], dict[int, float]] = {(1, "data"): from_step(20, 40, 0.25)}
    extra.update({(r, "forward"): from_step(20, 40, 0.09) for r in (0, 2)})
    bundle = run_of(40, 3, extra, seed=13)
    assert job_slowdown.detect(bundle) == []
    [f] = slow_steps.detect(bundle)
    assert f.ranks == [1] and f.details["part"] == "data"
    assert f.details["what_if"]["saved_per_step_s"] == pytest.approx(0.25, abs=0.03)


def test_the_others_are_replayed_at_their_own_work_when_it_fell_beside_the_slow_rank() -> None:
    """On cores shared with the slow rank the others' own work can fall beside it (60 ms
    here) and rise again without it: the replay puts them back at their own work."""
    extra: dict[tuple[int, str], dict[int, float]] = {(1, "forward"): from_step(15, 30, 0.3)}
    extra.update({(r, "forward"): from_step(15, 30, -0.06) for r in (0, 2, 3)})
    bundle = run_of(30, 4, extra, seed=14, jitter=0.05)
    [f] = slow_steps.detect(bundle)
    w = f.details["what_if"]
    assert w["others_rise_s"] == pytest.approx(-0.06, abs=0.01)
    # the others' 60 ms come back: 300 ms less the slowest other's noise, not 360 ms
    assert 0.27 <= w["saved_per_step_s"] <= 0.31


def test_two_slow_ranks_are_named_together_though_a_third_set_the_pace_before() -> None:
    """Before step 12 rank 1 is a little slower and sets the pace in most steps, within
    the noise: only the ranks with hot steps make the group."""
    extra: dict[tuple[int, str], dict[int, float]] = {(r, "forward"): from_step(12, 30, 0.2) for r in (2, 3)}
    extra[(1, "forward")] = from_step(1, 11, 0.008)
    bundle = run_of(30, 4, extra, seed=15)
    t = pace.table(bundle.run)  # type: ignore[arg-type]
    assert t is not None
    assert sum(t.setter(i) == 1 for i in range(len(t.steps))) >= 5
    [f] = slow_steps.detect(bundle)
    assert f.ranks == [2, 3] and "from step 12 on" in f.title


def test_a_whole_run_straggler_is_told_from_the_others_waiting_on_handles() -> None:
    """Two ranks, rank 1 +200 ms in its forward all run long, rank 0 blocked the same 200 ms
    on a prefetched all-gather's handle inside its forward (ZeRO-3): no step without the
    slowness to take a baseline from. With the waits recorded (the steps file's ``waited``)
    rank 0's work leaves them out, the straggler is named and the replay saves the 200 ms;
    without them (0: not recorded) its waiting reads as work, and the two ranks look alike."""

    def bundle(recorded: bool) -> EvidenceBundle:
        extra = {(r, "forward"): from_step(1, 24, 0.2) for r in (0, 1)}
        b = run_of(24, 2, extra, seed=3, jitter=0.05)
        if recorded:
            rank = b.run.ranks[0]
            rank.handle_wait = from_step(1, 24, 0.2)
            rank.handle_wait_phases = {s: {"forward": 0.2} for s in range(1, 25)}
        return b

    [f] = straggler.detect(bundle(True))
    assert f.ranks == [1] and f.details["what_if"]["saved_per_step_s"] == pytest.approx(0.2, abs=0.03)
    t = pace.table(bundle(True).run)
    assert t is not None and statistics.median(t.parts_of(0)["forward"]) == pytest.approx(0.06, abs=0.01)
    assert straggler.detect(bundle(False)) == []
