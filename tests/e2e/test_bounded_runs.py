"""A run longer than its call file's ring (run-format "Bounded growth"), on the real 2-rank
job with a ring of 1,024 calls (``LORASCOPE_CALL_SLOTS``; the default ring holds ~5,000 of
its steps): what the ring overwrote is read from the per-step sums, and the verdicts are
those of a run whose calls all stayed."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from lorascope.rundir.format.layout import COUNT_OFFSET
from tests.helpers import LORASCOPE, TRAIN, Finished, free_port, probed, torchrun

pytestmark = pytest.mark.e2e

SMALL_RING = "256,1024"


def analyze(fin: Finished) -> dict:
    res = subprocess.run([*LORASCOPE, "analyze", str(fin.out), "--json"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def _written(run: Path, rank: int) -> int:
    [calls] = (run / "ranks" / f"rank-{rank}").glob("*.calls")
    return int.from_bytes(calls.read_bytes()[COUNT_OFFSET : COUNT_OFFSET + 8], "little")


def test_a_healthy_run_past_its_ring_reads_whole_and_stays_quiet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORASCOPE_CALL_SLOTS", SMALL_RING)
    fin = probed(tmp_path / "run", torchrun(free_port(), "--steps", "50"))
    assert fin.proc.returncode == 0, fin.proc.stderr[-2000:]
    assert _written(fin.out, 0) > 2 * 1280, "the ring did not come round"
    streams = [
        json.loads(line) for line in next((fin.out / "ranks" / "rank-0").glob("*.jsonl")).read_text().splitlines()
    ]
    assert any(r["k"] == "calls_step" for r in streams)
    data = analyze(fin)
    assert not [f["title"] for f in data["findings"] if f["severity"] != "info"]
    for rank in data["ranks"]:
        assert rank["collectives"]["count"] == _written(fin.out, rank["rank"])  # every call counted
        assert rank["collectives"]["pending"] == []


def test_a_straggler_past_the_ring_is_named_as_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The straggler's waiting is read from the steps' sums where the ring overwrote the
    calls: the same finding as test_detectors' run, whose calls all stay."""
    monkeypatch.setenv("LORASCOPE_CALL_SLOTS", SMALL_RING)
    cmd = torchrun(free_port(), "--variant", "straggler", "--straggle-ms", "400", "--steps", "30")
    cmd[cmd.index(TRAIN)] = str(Path(TRAIN).with_name("variants.py"))
    fin = probed(tmp_path / "run", cmd)
    assert fin.proc.returncode == 0, fin.proc.stderr[-2000:]
    assert _written(fin.out, 1) > 1280, "the ring did not come round"
    findings = analyze(fin)["findings"]
    assert findings and findings[0]["id"] == "straggler", findings
    top = findings[0]
    assert top["ranks"] == [1] and top["details"]["persistence"] >= 0.75 and top["details"]["ratio"] >= 1.5
