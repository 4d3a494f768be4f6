"""A stall the job came back from. Run by hand: the rank-1 stall planting with a 15 s sleep
(`--stall-seconds 15`, LORASCOPE_STALL_SECONDS=5) under ZeRO-3: the watchdog dumped both
ranks 5 s into it, the job went on and ended with exit 0, and `analyze` reported hung-ranks,
an error, "rank 1 is stuck outside any collective ... the others wait" (a hang, for a job
that finished). Now a warning that names the stall and who held the others up; the
watchdog fires again at the next stall."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from lorascope.detect import hung_ranks
from lorascope.detect.hang.diagnosis import diagnose
from lorascope.ingest.load import load_bundle
from lorascope.probes import dumps
from lorascope.probes.dumps import Dumper
from lorascope.probes.session import Session
from lorascope.rundir.format.writer import Stream, ensure_manifest, stream_prefix
from lorascope.rundir.loading.ending import still_moving
from lorascope.rundir.loading.reader import load_run
from lorascope.rundir.loading.stalls import recovered_stalls
from tests.helpers import T0, Call, RankSpec, write_run

FETCH = (
    "Thread MainThread:\n"
    '  File "/job/train.py", line 480, in <module>\n    main()\n'
    '  File "/job/train.py", line 368, in fetch\n    time.sleep(15)\n'
)
IN_BACKWARD = (
    "Thread MainThread:\n"
    '  File "/job/train.py", line 480, in <module>\n    main()\n'
    '  File "/job/train.py", line 314, in backward_and_step\n    engine.backward(loss)\n'
)
#: The helper's steps are at T0 + ~1.1-2.1 s; the stall is dumped after them, and the
#: steps that follow it come 15 s later.
STALL_AT = T0 + 3.0


def _steps_after(n: int, at: float) -> list[dict[str, Any]]:
    return [{"k": "step", "t": at + i, "step": 5 + i, "dur": 0.5, "loss": 1.0, "src": "torch"} for i in range(n)]


def _stalled_run(
    root: Path, *, recovered: bool = True, phase: str | None = None, running: bool = False, pause: float = 15.0
) -> Path:
    """Two ranks: rank 0 waits in a reduce-scatter, rank 1 sleeps in its data fetch; both
    dumped by the watchdog at STALL_AT; with ``recovered``, steps ``pause`` s later."""
    ranks = []
    for n, stacks in ((0, IN_BACKWARD), (1, FETCH)):
        extra: list[dict[str, Any]] = []
        if phase is not None:
            extra.append({"k": "phase", "t": STALL_AT - 0.5, "name": phase, "edge": "begin", "step": 4})
        pending = [{"group": "default_pg", "seq": 9, "op": "reduce_scatter_tensor", "bytes": 64, "site": "x"}]
        extra += [
            {"k": "stall", "t": STALL_AT + 0.01 * n, "seconds": 5.0, "limit": 5.0, "step": 4},
            {
                "k": "dump",
                "t": STALL_AT + 0.01 * n,
                "reason": "stall",
                "step": 4,
                "stacks": stacks,
                "pending": pending if n == 0 else [],
                "mem": None,
                "since_progress": 5.0,
            },
        ]
        if phase is not None:
            extra.append({"k": "phase", "t": STALL_AT + pause - 1.0, "name": phase, "edge": "end", "step": 4})
        if recovered:
            extra += _steps_after(3, STALL_AT + pause)
            if not running:
                extra.append({"k": "end", "t": STALL_AT + pause + 5.0, "status": "exit", "code": 0})
        else:  # the process-group timeout ends it
            timeout = "RuntimeError: Timed out waiting 30000ms for send operation to complete"
            extra += [
                {"k": "exception", "t": STALL_AT + 30.0, "type": "RuntimeError", "message": timeout, "traceback": ""},
                {"k": "end", "t": STALL_AT + 30.1, "status": "exception", "code": 1},
            ]
        ranks.append(RankSpec(calls=[Call("all_reduce")], ends=False, extra=extra))
    run_dir = write_run(root, ranks)
    if running:  # the launcher still runs, and the records are fresh
        import json

        manifest = json.loads((run_dir / "manifest.json").read_text())
        manifest["launches"][0]["end"] = None
        (run_dir / "manifest.json").write_text(json.dumps(manifest))
    return run_dir


def test_a_stall_the_job_came_back_from_is_a_warning_naming_who_held_the_others(tmp_path: Path) -> None:
    run_dir = _stalled_run(tmp_path / "run")
    [stall] = recovered_stalls(load_run(run_dir))
    assert (stall.step, round(stall.paused_s)) == (4, 16)
    [finding] = hung_ranks.detect(load_bundle(run_dir))
    assert (finding.severity, finding.ranks) == ("warning", [1])
    assert finding.title.startswith("the job stalled for 16 s after step 4, then went on; when the stall watchdog")
    assert "rank 1 is stuck outside any collective, in its own code at /job/train.py:368 in fetch" in finding.title
    assert finding.details["stall"]["step"] == 4


def test_a_stall_not_come_back_from_is_still_the_hang(tmp_path: Path) -> None:
    run_dir = _stalled_run(tmp_path / "run", recovered=False)
    assert recovered_stalls(load_run(run_dir)) == []
    [finding] = hung_ranks.detect(load_bundle(run_dir))
    assert finding.severity == "error" and finding.ranks == [1]
    assert finding.title.startswith("rank 1 is stuck outside any collective")


def test_a_long_evaluation_is_no_stall(tmp_path: Path) -> None:
    """The watchdog fires in a long evaluation (it reads steps only): the others wait for
    it, as they should."""
    run_dir = _stalled_run(tmp_path / "run", phase="eval")
    assert recovered_stalls(load_run(run_dir)) == []
    assert hung_ranks.detect(load_bundle(run_dir)) == []


def test_a_running_job_past_a_stall_is_still_moving(tmp_path: Path) -> None:
    """Read live after it came back: moving (no hang), and the stall a warning."""
    run_dir = _stalled_run(tmp_path / "run", running=True)
    run = load_run(run_dir)
    assert still_moving(run, now=run.ranks[0].last_time + 1.0)
    assert [f.severity for f in hung_ranks.detect(load_bundle(run_dir))] == ["warning"]


def test_the_watchdog_fires_again_at_the_next_stall(tmp_path: Path, monkeypatch: Any) -> None:
    """It fired once per process: a second stall, after the job came back from a first, left
    no dump. Now once a stall, the allocator snapshot with the first only (``flight`` here
    stands for both), and at most MAX_STALL_DUMPS (2 here) a process."""
    monkeypatch.setattr(dumps, "MAX_STALL_DUMPS", 2)
    run = tmp_path / "run"
    ensure_manifest(run)
    session = Session(Stream(stream_prefix(run, 0, "h", 1)), 0, 0, 1, 0.0)
    beside: list[str] = []
    dumper = Dumper(
        session,
        list,
        dict,
        lambda reason: beside.append("flight and snapshot"),
        lambda: None,
        stall_override=0.3,
        repeat_flight=lambda reason: beside.append("flight"),
    )
    session.step = 1
    dumper.progress()
    dumper.start_watchdog()
    try:
        _wait_for(lambda: len(_records(run, "stall")) == 1)
        time.sleep(0.5)
        assert len(_records(run, "stall")) == 1  # once a stall
        for step in (2, 3):
            session.step = step
            dumper.progress()  # the job came back
            time.sleep(1.0)
    finally:
        session.stream.close()  # the watchdog ends with the stream
    assert [d["reason"] for d in _records(run, "dump")] == ["stall", "stall"]
    assert beside == ["flight and snapshot", "flight"]


def _records(run: Path, kind: str) -> list[dict[str, Any]]:
    import json

    out = []
    for path in run.glob("ranks/*/*.jsonl"):
        out += [r for line in path.read_text().splitlines() if line and (r := json.loads(line))["k"] == kind]
    return out


def _wait_for(check: Any, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_a_pause_a_moving_job_may_make_is_no_stall(tmp_path: Path) -> None:
    """A watchdog set short (LORASCOPE_STALL_SECONDS=1) fires in a slow step: a pause no
    longer than 10 median steps (at least 5 s) is not reported."""
    run_dir = _stalled_run(tmp_path / "run", pause=3.0)
    assert recovered_stalls(load_run(run_dir)) == []
    assert hung_ranks.detect(load_bundle(run_dir)) == []


def test_ranks_that_stepped_after_the_dumps_hang_took_are_moving(tmp_path: Path) -> None:
    """`lorascope hang` in a long step (30 s since the last, past the dump's own window):
    the ranks made steps before the run was read, so the job moves; the dumps no longer
    say where the ranks are, and it read "no rank shows why the job is stuck"."""
    dump = {"k": "dump", "t": STALL_AT, "reason": "signal", "step": 4, "stacks": FETCH, "pending": []}
    ranks = [
        RankSpec(ends=False, extra=[{**dump, "since_progress": 30.0}, *_steps_after(2, STALL_AT + 1.0)])
        for _ in range(2)
    ]
    run = load_run(write_run(tmp_path / "run", ranks))
    assert diagnose(run)["kind"] == "moving"
