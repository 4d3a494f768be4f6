"""A run read while it runs (`analyze` or `report` mid-job) and `lorascope hang` on a job
that moves: calls in flight at that instant, or a rank between collectives, are not a hang
(lorascope/rundir/loading/ending.py: still_moving, moving_at; the hang diagnosis's "moving")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lorascope.analysis.summary import build_summary
from lorascope.detect import hung_ranks
from lorascope.detect.hang.diagnosis import diagnose
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.rundir.loading import ending
from lorascope.rundir.loading.ending import still_moving
from lorascope.rundir.loading.reader import RunData, load_run
from lorascope.text.findings import quiet
from tests.helpers import Call, RankSpec, write_run

IN_FLIGHT = [Call("all_reduce"), Call("all_reduce", end=False)]
STACKS = 'Thread MainThread:\n  File "train.py", line 10, in main\n'


def _dump(since: float, reason: str = "signal", pending: bool = False) -> dict[str, Any]:
    """A dump record; ``pending``: the rank is inside all_reduce #2."""
    calls = [{"group": "default_pg", "seq": 2, "op": "all_reduce", "bytes": 4, "site": "train.py:10 in main"}]
    return {
        "k": "dump",
        "reason": reason,
        "step": 4,
        "stacks": STACKS,
        "pending": calls if pending else [],
        "since_progress": since,
    }


def _run(tmp_path: Path, specs: list[RankSpec], live: bool = True) -> RunData:
    """SPECS as a run directory; ``live``: its launcher has not ended (read mid-job)."""
    run_dir = write_run(tmp_path / "run", specs)
    if live:
        manifest = json.loads((run_dir / "manifest.json").read_text())
        for launch in manifest["launches"]:
            launch["end"], launch["exit_status"] = None, None
        (run_dir / "manifest.json").write_text(json.dumps(manifest))
    return load_run(run_dir)


def _newest(run: RunData) -> float:
    return max(r.last_time for r in run.ranks.values())


def test_a_run_read_mid_job_is_not_hung(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A healthy job read mid-run, rank 1 inside a collective at that instant: hung-ranks
    said "rank 0 is a straggler still moving; the others wait for it" (an error)."""
    run = _run(tmp_path, [RankSpec(calls=IN_FLIGHT[:1], ends=False), RankSpec(calls=IN_FLIGHT, ends=False)])
    monkeypatch.setattr(ending.time, "time", lambda: _newest(run) + 1.0)
    assert still_moving(run)
    assert hung_ranks.detect(EvidenceBundle(path=run.path, run=run)) == []
    assert quiet(build_summary(run)).startswith("no problem found so far: the job is still running")


def test_a_run_that_stopped_is_read_as_before(tmp_path: Path) -> None:
    """Records older than LIVE_SECONDS (a launcher killed without recording its end), a
    rank whose last step is far behind the run's newest record (its sampler still
    writes), a stall record, a finished launch: not moving, so its pending calls count."""
    specs = [RankSpec(calls=IN_FLIGHT[:1], ends=False), RankSpec(calls=IN_FLIGHT, ends=False)]
    run = _run(tmp_path / "a", specs)
    assert not still_moving(run, _newest(run) + ending.LIVE_SECONDS + 1)
    late = {"k": "mem", "src": "sampler", "step": 4, "rss": 1 << 20}
    many = [late] * (int(ending.MOVING_MIN_S / 0.1) + 5)  # the helper writes records 0.1 s apart
    run = _run(
        tmp_path / "b", [RankSpec(calls=IN_FLIGHT[:1], ends=False), RankSpec(calls=IN_FLIGHT, ends=False, extra=many)]
    )
    assert not still_moving(run, _newest(run) + 1)
    stall = {"k": "stall", "seconds": 9.0, "limit": 5.0, "step": 4}
    run = _run(
        tmp_path / "c",
        [RankSpec(calls=IN_FLIGHT[:1], ends=False), RankSpec(calls=IN_FLIGHT, ends=False, extra=[stall])],
    )
    assert not still_moving(run, _newest(run) + 1)
    run = _run(tmp_path / "d", specs, live=False)
    assert not still_moving(run, _newest(run) + 1)
    assert hung_ranks.detect(EvidenceBundle(path=run.path, run=run))  # pending calls at the end: as before


def test_hang_on_a_moving_job_says_so(tmp_path: Path) -> None:
    """`lorascope hang` on a job that was slow, not hung: each rank's dump came a fraction
    of a step after its last step ended. It said "rank 1 is stuck outside any collective"."""
    specs = [
        RankSpec(calls=IN_FLIGHT, ends=False, extra=[_dump(0.1)]),
        RankSpec(calls=IN_FLIGHT[:1], ends=False, extra=[_dump(0.2)]),
    ]
    diagnosis = diagnose(_run(tmp_path / "a", specs))
    assert diagnosis["kind"] == "moving" and diagnosis["verdict"].startswith("not hung:")
    assert diagnosis["odd_ranks"] == []
    # one rank's dump came 30 s after its last step: a hang, diagnosed as before
    specs[1] = RankSpec(calls=IN_FLIGHT[:1], ends=False, extra=[_dump(30.0)])
    assert diagnose(_run(tmp_path / "b", specs))["kind"] != "moving"
    specs[1] = RankSpec(calls=IN_FLIGHT[:1], ends=False, extra=[_dump(0.1, reason="stall")])
    assert diagnose(_run(tmp_path / "c", specs))["kind"] != "moving"


def test_dumps_taken_while_a_finished_job_moved_are_no_hang_after_it(tmp_path: Path) -> None:
    """`lorascope hang` on a slow job that then finished: its dumps made `analyze` report
    hung-ranks (an error) on a run whose ranks all exited 0."""
    moving = [RankSpec(extra=[_dump(0.1)]), RankSpec(extra=[_dump(0.2)])]
    run = _run(tmp_path / "a", moving, live=False)
    assert hung_ranks.detect(EvidenceBundle(path=run.path, run=run)) == []
    # the same read mid-job, rank 1's dump 40 s after its last step: a hang
    hung = [
        RankSpec(calls=IN_FLIGHT, ends=False, extra=[_dump(0.1, pending=True)]),
        RankSpec(calls=IN_FLIGHT[:1], ends=False, extra=[_dump(40.0)]),
    ]
    run = _run(tmp_path / "b", hung)
    (finding,) = hung_ranks.detect(EvidenceBundle(path=run.path, run=run))
    assert finding.ranks == [1]
