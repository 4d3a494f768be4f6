"""`lorascope hang` reads each rank's recent past only (the newest RECENT_RECORDS records of
its call, steps and memory files): on a long run its verdict is the whole read's, at a
cost that does not grow with the run."""

from __future__ import annotations

import json
from pathlib import Path

from lorascope.detect.hang.diagnosis import diagnose
from lorascope.rundir.loading.reader import RECENT_RECORDS, load_run
from tests.helpers import Call, RankSpec, write_run

CALLS = 3 * RECENT_RECORDS
STEPS = 2 * RECENT_RECORDS
SUMMED = 500


def _long_run(tmp_path: Path) -> Path:
    """4 ranks, long past their newest records: rank 2 makes one all_gather of its own at the
    end; the others wait in the all_reduce it never made. Not ended (a live hang)."""
    common = [Call("all_reduce")] * (CALLS - 2)
    specs = [
        RankSpec(steps=STEPS, calls=[*common, Call("all_reduce"), Call("all_reduce", end=False)], ends=False)
        for _ in range(4)
    ]
    specs[2].calls = [*common, Call("all_reduce"), Call("all_gather", site="train.py:20 in save", end=False)]
    for spec in specs:
        spec.call_slots = (1 << 10, 1 << 13)
        # what the probes write for each step once the ring went round: its calls' sums
        spec.extra = [
            {"k": "calls_step", "step": s, "groups": [[0, "all_reduce", 7, 28, 1.5, 0.5, 0]]} for s in range(SUMMED)
        ]
    run_dir = write_run(tmp_path / "run", specs)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    for launch in manifest["launches"]:
        launch["end"], launch["exit_status"] = None, None
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    return run_dir


def test_the_recent_past_gives_the_whole_reads_verdict(tmp_path: Path) -> None:
    run_dir = _long_run(tmp_path)
    whole, recent = load_run(run_dir), load_run(run_dir, newest=RECENT_RECORDS)
    rank = recent.ranks[0]
    tally = rank.tallies["default_pg"]
    assert tally.first_seq > CALLS - RECENT_RECORDS - 2 and tally.last_seq == CALLS  # the newest calls only
    assert len(rank.steps) <= RECENT_RECORDS < len(whole.ranks[0].steps) == STEPS
    assert not [w for w in recent.warnings if "not kept" in w]  # not read by choice: nothing lost to warn of
    # the per-step sums count calls long before the newest: not read (a record a step)
    assert whole.ranks[0].tallies["default_pg"].calls == CALLS + 7 * SUMMED
    assert tally.calls == RECENT_RECORDS
    said, whole_said = diagnose(recent), diagnose(whole)
    assert said["kind"] == whole_said["kind"] == "rank-conditional-hang"
    assert said["verdict"] == whole_said["verdict"]
    assert "rank 2" in said["verdict"] and "all_gather" in said["verdict"]
    assert [r["step"] for r in said["ranks"]] == [r["step"] for r in whole_said["ranks"]] == [STEPS] * 4
