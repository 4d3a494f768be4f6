"""failed-after-exit: a job that failed after its ranks had finished (lorascope/detect/
failed_after_exit.py), how such a rank's ending reads (lorascope/rundir/loading/ending.py), and
`lorascope run` removing the empty faulthandler files of its finished processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from lorascope.detect import failed_after_exit
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.rundir.loading.attachments import remove_empty_fatal_files
from lorascope.rundir.loading.ending import ended_badly_headline, ending_of
from lorascope.rundir.loading.reader import load_run
from lorascope.text.findings import quiet
from tests.helpers import LORASCOPE, RankSpec, finished_then_aborted, write_run

#: What faulthandler writes when gloo's threads abort a rank in the interpreter's teardown.
ABORTED = (
    "Fatal Python error: Aborted\n\nCurrent thread 0x00007fc08fa02b80 (most recent call first):\n"
    "  <no Python frame>\n\nExtension modules: torch._C (total: 1)\n"
)


def findings(run_dir: Path) -> list:
    return failed_after_exit.detect(EvidenceBundle(path=run_dir, run=load_run(run_dir)))


def test_a_rank_aborted_after_its_end_record_is_named_with_the_launchers_status(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", [RankSpec(fatal=""), RankSpec(fatal=ABORTED)], exit_status=1)
    end = ending_of(load_run(run_dir).ranks[1])
    assert end.teardown and end.status == "signal" and end.code == -6 and end.fatal
    assert end.detail is not None and "teardown, after exit 0" in end.detail.splitlines()[0]
    assert not ending_of(load_run(run_dir).ranks[0]).teardown  # an empty file: no word
    (finding,) = findings(run_dir)
    assert finding.ranks == [1] and finding.severity == "error" and finding.confidence == "high"
    assert finding.title.startswith("rank 1 died of SIGABRT in the interpreter's teardown")
    assert finding.title.endswith("the launcher exited 1")
    values = {e.label: str(e.value) for e in finding.evidence}
    assert values["rank 1 exit"] == "end record: exit 0"
    assert "Aborted; innermost: no Python frame (C++ code" in values["rank 1 afterwards"]
    assert "exited 1" in values["launcher"]
    sources = {e.label: e.source for e in finding.evidence}
    assert sources["rank 1 afterwards"].startswith("ranks/rank-1/h-101.fatal.txt")


def test_many_ranks_aborted_alike_are_one_group_of_evidence(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", [RankSpec(fatal=ABORTED) for _ in range(8)], exit_status=1)
    (finding,) = findings(run_dir)
    assert finding.ranks == list(range(8)) and finding.title.startswith("ranks 0-7 died of SIGABRT")
    assert len(finding.evidence) == 3  # one group's two rows and the launcher, not 17 rows


def test_a_failed_launcher_whose_ranks_all_exited_cleanly_is_not_a_clean_bill(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", [RankSpec(), RankSpec()], exit_status=1)
    (finding,) = findings(run_dir)
    assert finding.confidence == "low" and finding.severity == "error" and finding.ranks == [0, 1]
    assert finding.title.startswith("the launcher exited 1, yet every rank recorded exit 0")
    res = subprocess.run([*LORASCOPE, "analyze", str(run_dir), "--json"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["findings"][0]["id"] == "failed-after-exit"


def test_nothing_to_say_when_the_ranks_explain_the_status_or_nothing_failed(tmp_path: Path) -> None:
    healthy = write_run(tmp_path / "healthy", [RankSpec(), RankSpec(fatal="")])
    assert findings(healthy) == []
    crashed = write_run(tmp_path / "crashed", [RankSpec(exception=("RuntimeError", "boom")), RankSpec()], exit_status=1)
    assert findings(crashed) == []  # the rank's exception says how it failed
    # A rank that died of a fatal signal before recording its exit did not finish its job.
    died = write_run(tmp_path / "died", [RankSpec(ends=False, fatal=ABORTED), RankSpec()], exit_status=1)
    assert not ending_of(load_run(died).ranks[0]).teardown and findings(died) == []
    # Stopped by the user: lorascope forwarded the signal.
    stopped = write_run(tmp_path / "stopped", [RankSpec(), RankSpec()], exit_status=130)
    manifest = json.loads((stopped / "manifest.json").read_text())
    manifest["launches"][0]["signals"] = ["SIGINT"]
    (stopped / "manifest.json").write_text(json.dumps(manifest))
    assert findings(stopped) == []


def test_empty_fatal_files_of_finished_processes_on_this_host_are_removed(tmp_path: Path) -> None:
    dead_pid = subprocess.Popen(["true"])  # a pid that has exited (reaped)
    dead_pid.wait()
    ranks = tmp_path / "ranks"
    procs = [
        {"rank": 0, "host": "here", "pid": dead_pid.pid},  # gone, empty: removed
        {"rank": 1, "host": "here", "pid": dead_pid.pid},  # gone, but it wrote: kept
        {"rank": 2, "host": "here", "pid": os.getpid()},  # alive: kept
        {"rank": 3, "host": "there", "pid": dead_pid.pid},  # another host's: kept
    ]
    for p in procs:
        (ranks / f"rank-{p['rank']}").mkdir(parents=True)
        (ranks / f"rank-{p['rank']}" / f"{p['host']}-{p['pid']}.fatal.txt").write_text(
            ABORTED if p["rank"] == 1 else ""
        )
    remove_empty_fatal_files(tmp_path, procs, "here")
    assert sorted(f.parent.name for f in ranks.glob("*/*.fatal.txt")) == ["rank-1", "rank-2", "rank-3"]


def test_the_harness_reruns_only_a_job_that_finished_then_aborted(tmp_path: Path) -> None:
    """tests/helpers.finished_then_aborted: what `probed` runs again once."""
    assert finished_then_aborted(write_run(tmp_path / "a", [RankSpec(), RankSpec(fatal=ABORTED)], exit_status=1))
    assert not finished_then_aborted(write_run(tmp_path / "b", [RankSpec(), RankSpec()], exit_status=1))
    crashed = [RankSpec(exception=("RuntimeError", "boom")), RankSpec(fatal=ABORTED)]
    assert not finished_then_aborted(write_run(tmp_path / "c", crashed, exit_status=1))
    died = [RankSpec(ends=False, fatal=ABORTED), RankSpec()]
    assert not finished_then_aborted(write_run(tmp_path / "d", died, exit_status=1))


def test_a_script_python_could_not_open_ends_with_exit_2_and_says_why(tmp_path: Path) -> None:
    """``python /no/such.py`` exits 2 after the exit handlers ran, with no exception and no
    ``sys.exit``: its end record read "exit 0", a clean exit, and the launcher's failure was
    put on the interpreter's teardown."""
    out = tmp_path / "run"
    env = [f"{k}=0" for k in ("RANK", "LOCAL_RANK")] + ["WORLD_SIZE=1"]
    job = ["env", *env, sys.executable, str(tmp_path / "missing.py")]
    res = subprocess.run(
        [*LORASCOPE, "run", "--out", str(out), "--", *job], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 2, res.stderr[-2000:]
    end = ending_of(load_run(out).ranks[0])
    assert (end.status, end.code) == ("exit", 2)
    assert end.detail == f"python could not open the script {str(tmp_path / 'missing.py')!r}: it never ran"
    assert findings(out) == []  # the rank's own ending explains the launcher's status
    text = subprocess.run([*LORASCOPE, "analyze", str(out)], capture_output=True, text=True, timeout=60).stdout
    assert text.startswith("no detector named a cause, but rank 0 ended badly: python could not open the script")


def test_the_ranks_that_ended_badly_are_named_together_when_they_ended_alike() -> None:
    assert ended_badly_headline([(0, 5.0, "exit 2", None), (1, 5.0, "exit 2", None)]) == (
        "no detector named a cause, but ranks 0, 1 all ended badly: exit 2"
    )
    assert ended_badly_headline([(1, 2.0, "SIGTERM", None), (2, 1.0, "exit 1", None), (3, None, "SIGTERM", None)]) == (
        "no detector named a cause, but rank 2 ended badly first: exit 1 (ranks 1, 3 ended otherwise after it)"
    )


def test_the_rank_that_ended_badly_first_leads_the_headline() -> None:
    """A rank that died of its own error first, and a peer whose connection then closed:
    the headline led with the lowest rank, the consequence (run by hand: rank 1's
    ModuleNotFoundError under rank 0's "Connection closed by peer")."""
    ranks = [
        {"rank": 0, "ended": {"status": "exception", "code": 1, "detail": "RuntimeError: Connection closed", "t": 9.0}},
        {"rank": 1, "ended": {"status": "exception", "code": 1, "detail": "ModuleNotFoundError: x", "t": 5.0}},
        {"rank": 2, "ended": {"status": "exit", "code": 0, "detail": None, "t": 12.0}},
    ]
    assert quiet({"ranks": ranks}) == (
        "no detector named a cause, but rank 1 ended badly first: ModuleNotFoundError: x "
        "(rank 0 ended otherwise after it)"
    )


def test_an_exceptions_ending_reads_without_cpp_source_locations(tmp_path: Path) -> None:
    """gloo's "[/__w/pytorch/.../pair.cc:537] " before its message pushed "Connection reset by
    peer" past every one-line reading of the ending (the rank table, `hang`, the evidence)."""
    message = (
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"
    )
    run_dir = write_run(tmp_path / "run", [RankSpec(exception=("RuntimeError", message)), RankSpec()])
    end = ending_of(load_run(run_dir).ranks[0])
    assert end.detail == "RuntimeError: Read error: Connection reset by peer"
    text = subprocess.run([*LORASCOPE, "analyze", str(run_dir)], capture_output=True, text=True, timeout=60).stdout
    assert "exception: RuntimeError: Read error: Connection reset by peer" in text and "pair.cc" not in text


def test_a_job_stopped_from_outside_is_said_to_be_stopped_not_to_have_ended_badly(tmp_path: Path) -> None:
    """Ctrl-C on `lorascope run` (run by hand): every rank raised KeyboardInterrupt, and
    the headline read "no detector named a cause, but ranks 0, 1 all ended badly:
    KeyboardInterrupt:" (an exception without a message kept the colon)."""
    run = write_run(tmp_path / "r", [RankSpec(exception=("KeyboardInterrupt", ""), ends=False)])
    end = ending_of(load_run(run).ranks[0])
    assert (end.status, end.detail) == ("exception", "KeyboardInterrupt")
    moving = {"since_step_s": 0.2, "moving": True}
    assert ended_badly_headline([(1, 5.0, "KeyboardInterrupt", moving), (0, 5.0, "KeyboardInterrupt", moving)]) == (
        "no problem found before the job was stopped from outside: ranks 0, 1 got KeyboardInterrupt "
        "(Ctrl-C, or SIGINT from a launcher passing it on)"
    )
    assert ended_badly_headline([(0, 5.0, "SIGTERM", moving), (1, 5.1, "KeyboardInterrupt", moving)]).startswith(
        "no problem found before the job was stopped from outside: rank 0 got SIGTERM (kill, a launcher, "
        "or a scheduler's time limit or preemption); rank 1 got KeyboardInterrupt"
    )
    # a rank that failed by itself is not a stop from outside, whatever the others got
    assert ended_badly_headline([(0, 5.0, "SIGTERM", None), (1, 4.0, "RuntimeError: boom", None)]).startswith(
        "no detector named a cause, but rank 1 ended badly first: RuntimeError: boom"
    )
