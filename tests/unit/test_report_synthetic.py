"""The small synthetic run directories the report tests use (tests.helpers.write_run, the
real writer) load back as intended."""

from __future__ import annotations

from pathlib import Path

from lorascope.ingest.load import load_bundle
from tests.helpers import Call, RankSpec, write_run


def test_synthetic_run_loads(tmp_path: Path) -> None:
    hang = [
        RankSpec(calls=[Call("all_reduce"), Call("all_reduce", end=False)]),
        RankSpec(calls=[Call("all_reduce"), Call("barrier", bytes=0, dtype=None, end=False)], ends=False),
    ]
    bundle = load_bundle(write_run(tmp_path, hang))
    run = bundle.run
    assert run is not None and sorted(run.ranks) == [0, 1]
    assert [c.pending for c in run.ranks[1].collectives] == [False, True]
    assert run.ranks[1].end is None and run.ranks[0].end is not None
