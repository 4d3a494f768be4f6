"""A rank slow in one part of its step from halfway on, planted in the real LoRA job
(``probes/slowness.py``): `lorascope analyze` names it as slow-steps, since the step it
began, in the part it was planted in, with the saving; ``--json`` carries the pace."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from lorascope.rundir.loading.reader import load_run
from tests.helpers import LORASCOPE, TRAIN, free_port, probed, torchrun

pytestmark = pytest.mark.e2e

SLOWNESS = str(Path(TRAIN).with_name("slowness.py"))


def planted(tmp_path: Path, nproc: int, *args: str) -> dict:
    cmd = torchrun(free_port(), *args, nproc=nproc, script=SLOWNESS)
    fin = probed(tmp_path / "run", cmd)
    assert fin.proc.returncode == 0, fin.proc.stderr[-2000:]
    res = subprocess.run([*LORASCOPE, "analyze", str(fin.out), "--json"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    data: dict = json.loads(res.stdout)
    data["run_dir"] = str(fin.out)
    return data


def check_handle_waits(run_dir: Path) -> None:
    """Every rank's time blocked on async collectives' handles is recorded (ZeRO-3's
    all-gathers of the updated partitions after each step are waited on by handle), and
    it lies within the async calls' own time: the waits a synchronous call makes on its
    own work are the call's, not counted again."""
    run = load_run(run_dir)
    for rank in run.ranks.values():
        steps = [s["step"] for s in rank.steps if s["step"] > 1]
        assert sum(1 for s in steps if rank.handle_wait.get(s, 0.0) > 0) >= len(steps) - 1, rank.rank
        calls: dict[int, float] = {}
        for c in rank.collectives:
            if c.is_async and c.end is not None:
                calls[c.step + 1] = calls.get(c.step + 1, 0.0) + (c.end - c.start)
        for s in steps:
            assert rank.handle_wait.get(s, 0.0) <= calls.get(s, 0.0) + 0.002, (rank.rank, s)
            assert rank.handle_wait_phases.get(s, {}).get("backward", 0.0) == 0.0  # only sync calls there


def check(data: dict, rank: int, first: int, part: str) -> None:
    findings = data["findings"]
    assert findings and findings[0]["id"] == "slow-steps", [f["title"] for f in findings]
    top = findings[0]
    assert top["ranks"] == [rank] and top["severity"] == "warning"
    # the first hot step: the planted one, or the next (the probe's step begins at the previous
    # end); or up to two before, slow by chance on a loaded machine (docs/detectors.md)
    assert first - 2 <= top["details"]["first_step"] <= first + 1 and top["details"]["to_end"]
    assert top["details"]["part"] == part
    assert top["details"]["what_if"]["share_of_run"] >= 0.1
    assert data["pace"]["strip"]["setter"][-1] == rank


def test_a_rank_slow_in_its_data_loading_from_halfway_is_named(tmp_path: Path) -> None:
    """The case `analyze` once called "no problem found": one rank of 3 does 300 ms of extra
    CPU work preparing its batch from step 10 of 20 on (the job's step ~2x from then)."""
    data = planted(tmp_path, 3, "--steps", "20", "--slow-rank", "1", "--slow-ms", "300", "--slow-from", "10")
    check(data, 1, 10, "data")
    check_handle_waits(Path(data["run_dir"]))


@pytest.mark.slow
def test_a_rank_slow_in_its_forward_from_halfway_is_named(tmp_path: Path) -> None:
    """400 ms in the forward: the fast ranks' own work moves with the slow rank's (3 ranks
    share the 2 cores of the test machine), so a rank's extra compute reads as less than
    its share; the episode is named from the change against its own steps before step 10."""
    data = planted(
        tmp_path,
        3,
        "--steps",
        "20",
        "--slow-rank",
        "2",
        "--slow-ms",
        "400",
        "--slow-from",
        "10",
        "--slow-where",
        "forward",
    )
    check(data, 2, 10, "forward")
