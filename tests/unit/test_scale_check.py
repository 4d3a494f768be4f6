"""benchmarks/scale_check.sh, the device machine's analysis-at-scale check, run small here:
it must write a run directory of the steps the disk allows, name the three plantings,
print the 10,000-step projection and leave its figures in $OUT; and refuse in one line a
disk that holds too little."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "scale_check.sh"


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHON": sys.executable, "SCALE_DIR": str(tmp_path / "runs"), **env},
    )


def test_a_small_scale_check_names_the_plantings_and_projects(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    res = _run(tmp_path, SCALE_RANKS="4", SCALE_STEPS="500", OUT=str(out))
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("scale_check: 4 ranks x 500 steps under ")
    assert "named: {'rank0-asymmetry': True, 'straggler': True, 'rank-conditional-hang': True}" in res.stdout
    assert "at 10,000 steps, linear in bytes read: " in res.stdout
    assert "named: {'rank0-asymmetry': True" in (out / "scale.txt").read_text()
    assert not (tmp_path / "runs" / "4x500").exists()  # each run directory is deleted once measured


def test_a_disk_too_small_for_the_ranks_is_refused_in_one_line(tmp_path: Path) -> None:
    res = _run(tmp_path, SCALE_RANKS=str(10**12))
    assert res.returncode == 2
    assert res.stdout == ""
    assert res.stderr.count("\n") == 1 and "not enough for 1000000000000 ranks x 500 steps" in res.stderr
