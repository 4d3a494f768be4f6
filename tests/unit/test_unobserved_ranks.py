"""unobserved-ranks: ranks of the world that wrote no stream are named, so that a run half
of whose ranks nobody watched does not read "no problem found"."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from lorascope.detect import unobserved_ranks
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.rundir.loading.reader import load_run
from tests.helpers import LORASCOPE, RankSpec, write_run


def test_ranks_without_a_stream_are_named_and_the_verdict_is_not_a_clean_bill(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", [RankSpec() for _ in range(6)])
    for n in (1, 3, 4, 5):
        shutil.rmtree(run_dir / "ranks" / f"rank-{n}")
    (finding,) = unobserved_ranks.detect(EvidenceBundle(path=run_dir, run=load_run(run_dir)))
    assert finding.ranks == [1, 3, 4, 5] and finding.severity == "warning" and finding.confidence == "high"
    assert finding.title == "ranks 1, 3-5 of 6 were not observed (no stream): no verdict covers them"
    assert {e.label: e.value for e in finding.evidence} == {"world size": 6, "ranks with a stream": "0, 2"}
    res = subprocess.run([*LORASCOPE, "analyze", str(run_dir), "--json"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "unobserved-ranks" in {f["id"] for f in json.loads(res.stdout)["findings"]}
    # Alone (rank 0's planted extra memory removed), it is the verdict, not "no problem found".
    only = write_run(tmp_path / "only", [RankSpec(), RankSpec()])
    shutil.rmtree(only / "ranks" / "rank-1")
    res = subprocess.run([*LORASCOPE, "analyze", str(only)], capture_output=True, text=True, timeout=60)
    assert res.stdout.startswith("unobserved-ranks  WARNING  confidence high  rank 1\n"), res.stdout[:300]
    html = tmp_path / "r.html"
    subprocess.run([*LORASCOPE, "report", str(only), "-o", str(html)], check=True, capture_output=True, timeout=120)
    assert "no problem found" not in html.read_text() and "rank 1 of 2 was not observed" in html.read_text()


def test_every_rank_observed_is_nothing_to_say(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", [RankSpec(), RankSpec()])
    assert unobserved_ranks.detect(EvidenceBundle(path=run_dir, run=load_run(run_dir))) == []
    res = subprocess.run([*LORASCOPE, "analyze", str(run_dir), "--json"], capture_output=True, text=True, timeout=60)
    assert "unobserved-ranks" not in {f["id"] for f in json.loads(res.stdout)["findings"]}
