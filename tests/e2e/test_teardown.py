"""A rank that dies in the interpreter's teardown after its job finished, under
`lorascope run` (real torchrun, 2 gloo ranks): its faulthandler file, kept enabled past
the end record, says so; `lorascope analyze` names it (failed-after-exit) instead of a
clean bill; the other rank's empty file is removed once its process is gone."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.helpers import (
    LORASCOPE,
    Finished,
    TeardownAbortWarning,
    finished_then_aborted,
    free_port,
    probed,
    torchrun,
)

pytestmark = pytest.mark.e2e

#: Rank 1 holds an object whose destructor aborts the process, as gloo's backend can when
#: the teardown destroys a process group still alive (pytorch/pytorch#190489).
JOB = """
import os, sys, torch, torch.distributed as dist

class AbortsInTeardown:
    def __del__(self, abort=os.abort):  # bound now: the teardown may have set the global os to None
        abort()

dist.init_process_group("gloo")
t = torch.ones(4)
for _ in range(3):
    dist.all_reduce(t)
if dist.get_rank() == 1 and sys.argv[1:] == []:
    held = AbortsInTeardown()
if dist.get_rank() == 1 and sys.argv[1:] == ["--once"] and not os.path.exists("aborted"):  # the harness's test
    open("aborted", "w").close()
    held = AbortsInTeardown()
dist.destroy_process_group()
print("done")
"""


def test_a_rank_aborted_in_its_teardown_is_named_not_a_clean_bill(tmp_path: Path) -> None:
    job = tmp_path / "job.py"
    job.write_text(JOB)
    fin = probed(tmp_path / "run", torchrun(free_port(), script=str(job)), rerun_teardown_abort=False)
    assert fin.proc.returncode != 0, "torchrun reports the aborted rank"
    text = subprocess.run([*LORASCOPE, "analyze", str(fin.out)], capture_output=True, text=True, timeout=60)
    assert "Fatal Python error: Aborted (faulthandler) in the interpreter's teardown, after exit 0" in text.stdout
    fatal = sorted(p.relative_to(fin.out).as_posix() for p in fin.out.glob("ranks/*/*.fatal.txt"))
    assert len(fatal) == 1 and fatal[0].startswith("ranks/rank-1/"), fatal  # rank 0's empty one is gone
    assert finished_then_aborted(fin.out)
    res = subprocess.run([*LORASCOPE, "analyze", str(fin.out), "--json"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    top = json.loads(res.stdout)["findings"][0]
    assert (top["id"], top["confidence"], top["ranks"]) == ("failed-after-exit", "high", [1])
    assert top["title"].startswith("rank 1 died of SIGABRT in the interpreter's teardown")
    afterwards = next(e["value"] for e in top["evidence"] if e["label"] == "rank 1 afterwards")
    assert afterwards.endswith(f'File "{job}", line 6 in __del__'), afterwards


def test_a_healthy_run_leaves_no_fatal_file_and_no_finding(torchrun_run: Finished) -> None:
    assert torchrun_run.proc.returncode == 0
    assert list(torchrun_run.out.glob("ranks/*/*.fatal.txt")) == []
    assert not finished_then_aborted(torchrun_run.out)
    assert "failed-after-exit" not in {f["id"] for f in torchrun_run.summary()["findings"]}


def test_the_harness_runs_a_job_again_once_when_only_its_teardown_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tests/helpers.probed: what keeps gloo's occasional teardown abort of a finished
    DeepSpeed job from failing an unrelated test, warned and with the first run kept."""
    job = tmp_path / "job.py"
    job.write_text(JOB)
    monkeypatch.chdir(tmp_path)  # where the job leaves its marker
    with pytest.warns(TeardownAbortWarning):
        fin = probed(tmp_path / "run", torchrun(free_port(), "--once", script=str(job)))
    assert fin.proc.returncode == 0, fin.proc.stderr[-2000:]
    assert finished_then_aborted(tmp_path / "run-teardown-abort") and not finished_then_aborted(fin.out)
