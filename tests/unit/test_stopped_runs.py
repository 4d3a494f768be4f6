"""A job stopped from outside (Ctrl-C, SIGTERM) is read as of the moment it was stopped.

Run by hand: the rank-1 stall planting (rank 1 sleeps in its data fetch, rank 0 waits in a
reduce-scatter) stopped with Ctrl-C after ~30 s read "rank 0 died first: KeyboardInterrupt;
the others wait for it" in `lorascope hang` and no finding in `analyze`; a healthy job
stopped the same way read "ranks 0, 1 all ended badly: KeyboardInterrupt:"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lorascope.analysis.summary import build_summary
from lorascope.detect import hung_ranks
from lorascope.detect.hang.diagnosis import diagnose
from lorascope.ingest.load import load_bundle
from lorascope.report.data import build_report_data
from lorascope.rundir.format.writer import record_launch
from lorascope.rundir.loading.ending import ended_badly_headline, stop_time, stopped_while_moving
from lorascope.rundir.loading.reader import load_run
from lorascope.text.findings import quiet
from tests.helpers import T0, Call, RankSpec, write_run

FETCH = (
    "Traceback (most recent call last):\n"
    '  File "/job/train.py", line 480, in <module>\n    main()\n'
    '  File "/job/train.py", line 432, in train\n    input_ids = fetch(data, step)\n'
    '  File "/job/train.py", line 368, in fetch\n    time.sleep(600)\n'
    "KeyboardInterrupt\n"
)


def _stopped(
    at: float, traceback: str = "Traceback (most recent call last):\nKeyboardInterrupt\n"
) -> list[dict[str, Any]]:
    return [
        {"k": "exception", "t": at, "type": "KeyboardInterrupt", "message": "", "traceback": traceback},
        {"k": "end", "t": at + 0.001, "status": "exception", "code": 1},
    ]


def test_a_hang_stopped_by_hand_is_named_as_it_was_when_stopped(tmp_path: Path) -> None:
    stop = T0 + 40.0  # ~37 s after the last step
    waiting = Call("reduce_scatter_tensor", end=False, ended_at=stop - 0.01, err="KeyboardInterrupt()")
    ranks = [
        RankSpec(calls=[Call("all_reduce"), waiting], ends=False, extra=_stopped(stop + 0.2)),
        RankSpec(calls=[Call("all_reduce")], ends=False, extra=_stopped(stop, FETCH)),
    ]
    run_dir = write_run(tmp_path / "run", ranks, exit_status=130)
    run = load_run(run_dir)
    assert stop_time(run) == stop
    diagnosis = diagnose(run)
    assert (diagnosis["kind"], diagnosis["odd_ranks"]) == ("stuck-outside", [1])
    assert "/job/train.py:368 in fetch" in diagnosis["verdict"]
    waiting_rank = next(s for s in diagnosis["ranks"] if s["rank"] == 0)
    assert waiting_rank["state"] == "in-collective" and waiting_rank["pending"][0]["seq"] == 2
    [finding] = hung_ranks.detect(load_bundle(run_dir))
    assert finding.ranks == [1] and "stopped from outside" in finding.confidence_reason


def test_a_healthy_job_stopped_by_hand_found_nothing_and_says_it_was_stopped(tmp_path: Path) -> None:
    ranks = [RankSpec(exception=("KeyboardInterrupt", "")), RankSpec(exception=("KeyboardInterrupt", ""))]
    run_dir = write_run(tmp_path / "run", ranks, exit_status=130)
    assert hung_ranks.detect(load_bundle(run_dir)) == []
    run = load_run(run_dir)
    assert diagnose(run)["kind"] == "stopped"
    from lorascope.analysis.summary import build_summary

    summary = build_summary(run)
    assert all(r["ended"]["stopped"]["moving"] for r in summary["ranks"])
    assert quiet(summary).startswith("no problem found before the job was stopped from outside: ranks 0, 1 got")


def test_a_stop_after_the_steps_stopped_is_not_a_clean_bill() -> None:
    """No detector named a cause, but a rank had made no step for long before the stop."""
    idle = {"since_step_s": 37.0, "moving": False}
    moving = {"since_step_s": 0.2, "moving": True}
    headline = ended_badly_headline([(0, 5.0, "KeyboardInterrupt", moving), (1, 5.0, "KeyboardInterrupt", idle)])
    assert headline.startswith("no detector named a cause, but the job was stuck when it was stopped from outside")
    assert headline.endswith("rank 1 had made no step for 37 s before it was")
    # the report's verdict is a warning then, and not for a job stopped as it moved
    assert not stopped_while_moving([(0, 5.0, "KeyboardInterrupt", moving), (1, 5.0, "KeyboardInterrupt", idle)])
    assert stopped_while_moving([(0, 5.0, "SIGTERM", moving), (1, 5.0, "KeyboardInterrupt", moving)])
    assert not stopped_while_moving([(0, 5.0, "RuntimeError: x", None), (1, 5.0, "SIGTERM", moving)])


def test_the_sigterm_a_launcher_sends_after_a_rank_failed_is_not_a_stop(tmp_path: Path) -> None:
    """torchrun SIGTERMs the other ranks once one fails: the hung-ranks fixture's rank 1
    (stuck in its data fetch) got one after rank 0's gloo timeout."""
    sigterm = [
        {"k": "signal", "t": T0 + 30.0, "signum": 15, "name": "SIGTERM", "stacks": FETCH},
        {"k": "end", "t": T0 + 30.001, "status": "signal", "code": -15},
    ]
    ranks = [RankSpec(exception=("RuntimeError", "Timed out waiting")), RankSpec(ends=False, extra=sigterm)]
    run = load_run(write_run(tmp_path / "run", ranks, exit_status=1))
    assert stop_time(run) is None and diagnose(run)["kind"] == "dead-rank"
    stopped = load_run(write_run(tmp_path / "stopped", [RankSpec(), RankSpec(ends=False, extra=sigterm)]))
    assert stop_time(stopped) == T0 + 30.0  # the other rank exited 0: a stop from outside


def test_a_job_stopped_in_a_save_or_before_its_first_step_is_not_read_as_hung(tmp_path: Path) -> None:
    """No one said the job hung when it was stopped: a rank in a checkpoint save (an open
    ``save`` phase) or with no step yet is not evidence of a hang, however long ago its
    last step was."""
    stop = T0 + 40.0
    saving = [{"k": "phase", "t": T0 + 5.0, "name": "save", "edge": "begin", "step": 4}, *_stopped(stop, FETCH)]
    ranks = [
        RankSpec(calls=[Call("all_reduce"), Call("barrier", end=False)], ends=False, extra=_stopped(stop + 0.1)),
        RankSpec(calls=[Call("all_reduce")], ends=False, extra=saving),
    ]
    run = load_run(write_run(tmp_path / "save", ranks))
    assert diagnose(run)["kind"] == "stopped" and hung_ranks.detect(load_bundle(tmp_path / "save")) == []
    early = [RankSpec(steps=0, calls=[], ends=False, extra=_stopped(stop)) for _ in range(2)]
    run = load_run(write_run(tmp_path / "early", early))
    assert diagnose(run)["kind"] == "stopped"


def _sigterm(at: float) -> list[dict[str, Any]]:
    return [{"k": "signal", "t": at, "signum": 15, "name": "SIGTERM", "stacks": ""}]


def test_the_sigterm_lorascope_run_sent_after_the_launcher_was_killed_says_so(tmp_path: Path) -> None:
    """torchrun SIGKILLed from outside (exit status 137): `lorascope run` SIGTERMs the
    ranks it left behind. Read before: "ranks 0, 1 got SIGTERM (kill, a launcher, or a
    scheduler's time limit or preemption)"."""
    stop = T0 + 4.0
    run = write_run(
        tmp_path / "run",
        [RankSpec(ends=False, extra=_sigterm(stop)), RankSpec(ends=False, extra=_sigterm(stop))],
        command=["python", "-m", "torch.distributed.run", "--nproc_per_node", "2", "train.py"],
        exit_status=137,
    )
    record_launch(run, "h-1", [], leftovers={"t": stop - 0.1, "pids": [100, 101]})
    headline = quiet(build_summary(load_run(run)))
    assert "scheduler" not in headline
    assert (
        "ranks 0, 1 got SIGTERM (sent by `lorascope run` to the processes the launcher (torchrun), killed by "
        "SIGKILL (exit status 137), left behind)" in headline
    )


def test_a_rank_without_an_end_record_after_a_sigint_passed_on_says_the_job_was_stopped(tmp_path: Path) -> None:
    """`lorascope run` got SIGINT and passed it on (the manifest's ``signals``); a rank then
    ended without an end record. Read before: "no end record: killed (e.g. SIGKILL, OOM
    killer) or still running", in `analyze` and the report's "What this report could not see"."""
    run = write_run(tmp_path / "run", [RankSpec(ends=False), RankSpec(extra=_stopped(T0 + 4.0))], exit_status=130)
    record_launch(run, "h-1", [], signals=["SIGINT"])
    bundle = load_bundle(run)
    summary = build_summary(bundle.run)
    detail = summary["ranks"][0]["ended"]["detail"]
    assert "still running" not in detail and "OOM" not in detail
    assert "stopped from outside (SIGINT passed on by `lorascope run`)" in detail
    missing = build_report_data(bundle, [])["missing"]
    line = next(m for m in missing if m.startswith("rank 0:"))
    assert "SIGINT passed on by `lorascope run`" in line and "still running" not in line
    # nor is the stop read as a death: "rank 0 died first ... (SIGKILL or the OOM killer)"
    waiting = [Call("all_reduce"), Call("all_reduce", end=False)]
    both = write_run(tmp_path / "both", [RankSpec(ends=False, calls=waiting)] * 2, exit_status=130)
    record_launch(both, "h-1", [], signals=["SIGINT"])
    assert hung_ranks.detect(load_bundle(both)) == []
    assert "SIGINT passed on by `lorascope run`" in quiet(build_summary(load_run(both)))
