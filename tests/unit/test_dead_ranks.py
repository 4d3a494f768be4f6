"""A rank that died is a death, not a hang: hung-ranks' dead-rank finding has its own
wording, and says when the rank died (after which step, at what time)."""

from __future__ import annotations

import time
from pathlib import Path

from lorascope.detect import hung_ranks
from lorascope.ingest.load import load_bundle
from lorascope.text.findings import render_findings
from tests.helpers import Call, RankSpec, write_run


def test_a_sigkilled_rank_is_named_as_a_death_with_its_step_and_time(tmp_path: Path) -> None:
    """Rank 1 SIGKILLed after 2 steps (its stream just stops); rank 0's all_reduce fails then.
    Read before: "rank 1 died first: ..." then "why: A distributed job hangs when ...", and
    neither its step nor its time in the finding."""
    failed = RankSpec(
        calls=[Call("all_reduce"), Call("all_reduce", end=False)],
        exception=("RuntimeError", "Connection closed by peer [127.0.0.1]:29500"),
    )
    run = write_run(tmp_path / "run", [failed, RankSpec(steps=2, ends=False)], exit_status=1)
    bundle = load_bundle(run)
    [finding] = hung_ranks.detect(bundle)
    assert finding.ranks == [1]
    died = bundle.run.ranks[1].last_time
    clock = time.strftime("%H:%M:%S UTC", time.gmtime(died))
    assert finding.title.startswith(f"rank 1 died first, after step 2, at {clock}: ")
    assert not finding.explanation.startswith("A distributed job hangs")
    assert "died" in finding.explanation
    ev = finding.evidence[0]
    assert ev.label == "rank 1 died"
    assert ev.value.startswith(f"after 2 steps, at {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(died))}")
    text = render_findings([finding], {})
    assert "why: A rank died" in text
