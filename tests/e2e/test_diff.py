"""`lorascope diff` on a pair recorded live: the same real 2-rank job with LoRA r 8 and 16
(the recorded pairs in fixtures/diff/ cover the other scenarios, in tests/unit/test_diff.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.helpers import LORASCOPE, free_port, probed, torchrun


@pytest.mark.slow
def test_diff_of_two_live_runs_names_the_lora_rank_and_its_terms(tmp_path: Path) -> None:
    runs = {}
    for r in (8, 16):
        runs[r] = probed(tmp_path / f"r{r}", torchrun(free_port(), "--steps", "4", "--lora-r", str(r)))
        assert runs[r].proc.returncode == 0, runs[r].proc.stderr[-2000:]
    out = tmp_path / "diff.html"
    res = subprocess.run(
        [*LORASCOPE, "diff", str(runs[8].out), str(runs[16].out), "--json", "--html", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    rows = {r["name"]: (r["a"], r["b"]) for r in data["config"]["headline"]}
    assert rows["lora.r"] == (8, 16) and rows["lora.lora_alpha"] == (16, 32)
    adapters = next(t for t in data["plan"]["terms"] if "adapter" in t["label"] and "weights" in t["label"])
    assert adapters["b"] == 2 * adapters["a"]
    assert data["shared"]["steps"] == 4 and not data["shared"]["notes"]
    assert "LoRA r" in out.read_text()
