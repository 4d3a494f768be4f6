"""What the probes cost the job, as the job measures it: the time its threads spend in
probe code (``cost`` records), and what the analysis makes of it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from lorascope.analysis.cost import cost_text, rank_cost, run_cost
from lorascope.analysis.summary import build_summary
from lorascope.probes import memory
from lorascope.probes.kernels import KernelWindow
from lorascope.probes.session import Session
from lorascope.rundir.format.schema import WARM_UP_STEPS
from lorascope.rundir.format.writer import Stream, record_launch
from lorascope.rundir.loading.reader import load_run
from lorascope.text.summary import render_text
from tests.helpers import RankSpec, free_port, step_probe, stream_records, write_run


def test_the_job_threads_time_in_probe_code_and_its_parts_are_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Phase edges and step ends count (their heap readings and the kernel window apart);
    a cost record at the first step's end, at the warm-up's and every COST_EVERY steps,
    cumulative."""
    monkeypatch.setattr("lorascope.probes.steps.COST_EVERY", 2)
    monkeypatch.setattr("lorascope.probes.steps.WARM_UP_STEPS", 3)
    stream = Stream(tmp_path / "r" / "s")
    session = Session(stream, rank=0, local_rank=0, world_size=1, sample_interval=0)
    mem = memory.MemoryProbe(session)
    kernels = KernelWindow(session, None, tmp_path / "k")
    monkeypatch.setattr(kernels, "on_step_end", lambda: time.sleep(0.004))
    steps = step_probe(session, mem, tmp_path / "k", kernels)
    spun, stop = threading.Event(), threading.Event()

    def spin() -> None:  # a probe thread that used some CPU
        sum(range(200_000))
        spun.set()
        stop.wait()

    threading.Thread(target=spin, name="lorascope-test", daemon=True).start()
    spun.wait()
    for _ in range(4):
        steps.phase("forward", "begin")
        steps.phase("forward", "end")
        steps._optimizer_begin()
        steps._optimizer_end()
    stop.set()
    stream.close()
    costs = [r for r in stream_records(tmp_path / "r") if r["k"] == "cost"]
    assert [c["step"] for c in costs] == [1, 2, 3, 4]
    # heap at forward.begin, forward.end and optimizer.end (optimizer.begin reads RSS only)
    assert [c["heap_reads"] for c in costs] == [3, 6, 9, 12]
    assert [c["calls"] for c in costs] == [0, 0, 0, 0]  # no collective in this job
    for c in costs:
        assert c["trace_ms"] >= 4.0 * c["step"]  # the kernel window's sleep, each step
        assert c["job_ms"] >= c["trace_ms"] + c["heap_ms"] > c["trace_ms"]
    assert all(a["job_ms"] < b["job_ms"] for a, b in zip(costs, costs[1:], strict=False))
    assert costs[0]["threads_cpu_ms"]["lorascope-test"] > 0  # by the thread's own clock


def test_a_failing_probe_still_counts_and_switches_off(tmp_path: Path) -> None:
    stream = Stream(tmp_path / "r" / "s")
    session = Session(stream, rank=0, local_rank=0, world_size=1, sample_interval=0)

    def slow_failure() -> None:
        time.sleep(0.003)
        raise RuntimeError("boom")

    timed = session.guarded("steps", job_thread=True)(slow_failure)
    assert timed() is None and session.cost_ns >= 3_000_000
    assert "steps" in session.disabled
    before = session.cost_ns
    assert timed() is None and session.cost_ns - before < 3_000_000  # off: not called again
    stream.close()


def _cost(
    step: int, job: float, heap: float, trace: float, writer: float, reads: int, sites: float = 0.0
) -> dict[str, Any]:
    """Collective calls: 50 a step, 1.5 ms, once warmed up; and
    ``sites`` ms reading the source of new call sites (three)."""
    return {
        "k": "cost",
        "step": step,
        "job_ms": job,
        "calls_ms": 100.0 + 1.5 * step + sites,
        "calls": 50 * step,
        "sites_ms": sites,
        "sites": 3 if sites else 0,
        "heap_ms": heap,
        "heap_reads": reads,
        "trace_ms": trace,
        "threads_cpu_ms": {"lorascope-writer": writer},
    }


def test_a_step_costs_the_difference_between_the_first_record_and_the_latest(tmp_path: Path) -> None:
    """The reader keeps the first cost record and the latest (none here is at or past the
    probes' warm-up but the last); the one-off start (before the first) and the kernel
    window are not a step's cost."""
    specs = [
        RankSpec(
            steps=101,
            extra=[
                _cost(1, 900.0, 0.5, 0.0, 40.0, 4),
                _cost(10, 900.0 + job / 10, 5.0, 120.0, 60.0, 40),
                _cost(101, 900.0 + job + 250.0 + 60.0, 100.5, 250.0, 140.0, 404, sites=60.0),
            ],
        )
        for job in (300.0, 500.0)
    ]  # steps of 500 and 510 ms
    run = load_run(write_run(tmp_path / "run", specs))
    assert [c["step"] for c in run.ranks[0].costs] == [1, 101]
    cost0 = rank_cost(run.ranks[0])
    assert cost0 is not None
    assert cost0["steps"] == 100 and cost0["job_ms_per_step"] == 3.0 and cost0["heap_ms_per_step"] == 1.0
    assert cost0["heap_reads_per_step"] == 4.0 and cost0["trace_window_ms"] == 250.0
    # the new sites' 60 ms (after the first record: a barrier at the end) are no step's
    assert (cost0["calls_ms_per_step"], cost0["calls_per_step"]) == (1.5, 50)
    assert (cost0["new_sites"], cost0["new_sites_ms"]) == (3, 60.0)
    assert cost0["threads_cpu_ms_per_step"] == 1.0 and cost0["share_of_step"] == pytest.approx(0.006)
    summary = build_summary(run)
    cost = summary["probe_cost"]
    assert cost["ranks"] == 2 and cost["job_ms_per_step"] == 4.0  # the median of 3 and 5 ms
    assert cost["most"]["rank"] == 1 and cost["most"]["share_of_step"] == pytest.approx(5 / 510, abs=1e-5)
    # jargon for a first run: shown with `analyze -v` (and in the report's run facts)
    assert "probes' cost" not in render_text(summary)
    text = render_text(summary, verbose=True)
    assert (
        "probes' cost: 4.00 ms a step in probe code on the job's threads (0.8% of the median step): "
        "collective calls 1.50 ms (50 a step), "
        "C heap readings 1.00 ms (4 a step), phase edges and step ends 1.50 ms; "
        "once: the kernel trace window 250 ms, reading the source of 3 new call sites 60 ms; "
        "1.00 ms CPU a step on the probes' own threads; "
        "median of 2 ranks, most on rank 1 (1.0%)"
    ) in text
    assert cost_text(cost) in text
    # counts a step to a tenth (a run's read "53.165 a step")
    uneven = cost_text({**cost, "calls_per_step": 53.165, "heap_reads_per_step": 6.17})
    assert "(53.2 a step)" in uneven and "(6.2 a step)" in uneven


def test_a_step_is_measured_from_the_end_of_the_probes_warm_up(tmp_path: Path) -> None:
    """Through WARM_UP_STEPS the probes read the C heap at every phase edge: a step's cost
    is measured from the record at its end once a later one follows (a record at or past
    it with no later step stays the latest; an older run's first record past it is the one
    at step 100)."""

    def kept(steps: list[int]) -> list[int]:
        records = [_cost(s, 900.0 + 2.0 * s, 0.1 * s, 0.0, 40.0 + s, 4 * s) for s in steps]
        run = load_run(
            write_run(tmp_path / f"run-{len(list(tmp_path.iterdir()))}", [RankSpec(steps=steps[-1], extra=records)])
        )
        return [c["step"] for c in run.ranks[0].costs]

    assert WARM_UP_STEPS == memory.HEAP_DENSE_STEPS == 20
    assert kept([1, 20, 40]) == [20, 40]
    assert kept([1, 20, 100, 200, 250]) == [20, 250]
    assert kept([1, 100, 200, 230]) == [100, 230]  # written before the warm-up record
    assert kept([1, 20, 20]) == [1, 20]  # a run that ended at the warm-up's end
    assert kept([1, 100, 100]) == [1, 100]
    assert kept([1, 12]) == [1, 12]  # a short run: from its first step
    assert kept([1, 19, 25]) == [1, 25]


def test_a_hostile_threads_object_is_read_as_far_as_it_holds_numbers(tmp_path: Path) -> None:
    first, last = _cost(1, 10.0, 1.0, 0.0, 5.0, 4), _cost(3, 20.0, 3.0, 0.0, 9.0, 12)
    first["threads_cpu_ms"] = {"lorascope-writer": 5.0, "x": "y", "z": None}
    last["threads_cpu_ms"] = {"lorascope-writer": 9.0, "x": [1], "z": True, "new": 2.0}
    run = load_run(write_run(tmp_path / "run", [RankSpec(steps=3, extra=[first, last])]))
    cost = rank_cost(run.ranks[0])
    assert cost is not None and cost["threads_cpu_ms_per_step"] == 3.0  # (9 - 5 + 2) / 2


def test_a_cost_that_reads_negative_is_not_shown(tmp_path: Path) -> None:
    """Recorded before calls that raise were counted: a hung run's new site (read in the
    call that timed out) taken from calls that never counted it. Nothing is said of it."""
    first, last = _cost(1, 900.0, 0.5, 0.0, 40.0, 4), _cost(2, 905.0, 1.0, 0.0, 45.0, 8, sites=11.0)
    last["calls_ms"] = first["calls_ms"] + 5.5  # the timed-out call's 11 ms never added
    run = load_run(write_run(tmp_path / "run", [RankSpec(steps=2, extra=[first, last])]))
    assert rank_cost(run.ranks[0]) is None
    assert "probes' cost" not in render_text(build_summary(run), verbose=True)


def test_no_cost_without_two_records(tmp_path: Path) -> None:
    """A rank killed before its second record, or an older lorascope's: nothing is said
    of it (not zero)."""
    run = load_run(write_run(tmp_path / "run", [RankSpec(steps=3, extra=[_cost(1, 900.0, 0.5, 0.0, 40.0, 4)])]))
    assert rank_cost(run.ranks[0]) is None
    assert run_cost([{"rank": 0, "probe_cost": None}]) is None


def test_a_run_without_cost_records_prints_no_cost_line(tmp_path: Path) -> None:
    run = load_run(write_run(tmp_path / "run", [RankSpec(steps=5)]))
    summary = build_summary(run)
    assert summary["probe_cost"] is None and summary["ranks"][0]["probe_cost"] is None
    assert "probes' cost" not in render_text(summary, verbose=True)


COLLECTIVES_JOB = textwrap.dedent("""
    import torch, torch.distributed as dist
    import lorascope
    lorascope.attach({out!r})
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
    t = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(t)
    dist.all_reduce(t, async_op=True).wait()
    try:
        dist.all_reduce("not a tensor")  # raises inside torch, at a new site
    except Exception:
        pass
    dist.destroy_process_group()
""")


def test_collective_calls_and_their_first_call_at_each_site_are_counted(tmp_path: Path) -> None:
    """Every call's time in the wrapper (and in the wait of an async one) counts, a call
    that raises too; the first call at each site also reads its source (a one-off, counted
    apart: within the calls' time, so that what is left of it is never negative)."""
    out = tmp_path / "run"
    record_launch(out, "test", ["job.py"])
    script = tmp_path / "job.py"
    script.write_text(COLLECTIVES_JOB.format(out=str(out), port=free_port()))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    [last] = load_run(out).ranks[0].costs  # the end's (no step ended)
    assert last["calls"] == 5 and last["sites"] == 3  # the loop's line, the async call's, the raising one's
    assert 0 < last["sites_ms"] < last["calls_ms"] <= last["job_ms"]
