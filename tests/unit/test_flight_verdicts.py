"""Verdicts from real gloo flight-recorder dumps alone (fixtures/flight-recorder/,
recorded by record.py and record_more.py): a collective some ranks ran and others never
did is a rank-conditional hang when a rank condition encloses it (on its call site's line
or a caller's, through a library frame), and a hang of another kind ("who waits where")
when none does. Never "no problem found" while the ranks of a group disagree.

The dumps name the source files by the absolute path they were recorded at; the tests
relocate them to this checkout (the dumps are plain data: loaded with the safe reader,
rewritten, pickled again), so the rank conditions are read here wherever the repository is.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

from lorascope.analysis import analyze
from lorascope.rundir.format.safe_pickle import load_pickle

REPO = Path(__file__).resolve().parents[2]
FR = REPO / "fixtures" / "flight-recorder"
RECORDED_AT = "/work/main/"


def _relocate(value: Any, root: str) -> Any:
    if isinstance(value, str):
        return value.replace(RECORDED_AT, root)
    if isinstance(value, list):
        return [_relocate(v, root) for v in value]
    if isinstance(value, tuple):
        return tuple(_relocate(v, root) for v in value)
    if isinstance(value, dict):
        return {_relocate(k, root): _relocate(v, root) for k, v in value.items()}
    return value


def relocated(scenario: str, tmp_path: Path) -> Path:
    out = tmp_path / scenario
    out.mkdir()
    for dump in sorted((FR / scenario).glob("rank-*.pickle")):
        data = _relocate(load_pickle(dump), str(REPO) + "/")
        (out / dump.name).write_bytes(pickle.dumps(data))
    return out


def findings(scenario: str, tmp_path: Path) -> dict[str, Any]:
    return {f.id: f for f in analyze(relocated(scenario, tmp_path)).findings}


def test_relocation_points_at_this_checkout(tmp_path: Path) -> None:
    data = load_pickle(relocated("rank1-stalls", tmp_path) / "rank-0.pickle")
    files = {f["filename"] for e in data["entries"] for f in e["frames"] if "record_more" in f["filename"]}
    assert files == {str(FR / "record_more.py")} and (FR / "record_more.py").is_file()


def test_op_missing_on_the_other_rank_inside_a_rank_condition(tmp_path: Path) -> None:
    found = findings("rank0-broadcast-missing", tmp_path)
    assert set(found) == {"rank-conditional-hang"}
    f = found["rank-conditional-hang"]
    assert f.ranks == [0] and f.confidence == "high" and f.details["seq"] == 4
    assert "broadcast" in f.title and "`if rank == 0:`" in f.title and "rank 1 never enqueued it" in f.title
    assert any("outside any collective" in str(e.value) for e in f.evidence)


def test_rank_condition_in_the_users_frame_above_a_library_call(tmp_path: Path) -> None:
    f = findings("library-save-rank0", tmp_path)["rank-conditional-hang"]
    assert f.ranks == [0] and f.confidence == "high"
    # the library's frame is the call site; the user's `if` is named with the line that led there
    assert "all_gather at savelib.py:11 in save_full, called from record_more.py:63" in f.title
    called = [e for e in f.evidence if e.label == "rank 0 called it from"]
    assert called and "savelib.save_full" in str(called[0].value) and "if rank == 0:" in str(called[0].value)


def test_missing_without_a_rank_condition_says_who_waits_where(tmp_path: Path) -> None:
    found = findings("rank1-stalls", tmp_path)
    assert set(found) == {"hung-ranks"}
    f = found["hung-ranks"]
    assert f.ranks == [1] and f.severity == "error" and f.confidence == "medium"
    assert f.title.startswith("rank 0 waits in all_reduce #4 on group 0")
    assert "rank 1 never enqueued it (outside any collective)" in f.title


@pytest.mark.parametrize(
    "scenario, verdict",
    [
        ("rank0-extra-allreduce", "rank-conditional-hang"),
        ("rank0-broadcast-missing", "rank-conditional-hang"),
        ("library-save-rank0", "rank-conditional-hang"),
        ("rank1-stalls", "hung-ranks"),
        ("dtype-mismatch", "collective-mismatch"),
        ("healthy", None),
    ],
)
def test_never_no_problem_while_ranks_disagree(scenario: str, verdict: str | None, tmp_path: Path) -> None:
    analysis = analyze(relocated(scenario, tmp_path))
    top = analysis.findings[0].id if analysis.findings else None
    assert top == verdict
    alignment = analysis.to_data()["artifacts"]["flight_alignment"]
    disagree = any(g["disagreements"] for g in alignment["groups"])
    assert disagree == (verdict is not None)


def widened(scenario: str, tmp_path: Path, world: int) -> Path:
    """The scenario's dumps at ``world`` ranks: rank 0's as recorded, rank 1's for every
    other rank (the odd rank 0 against many alike)."""
    two = relocated(scenario, tmp_path)
    out = tmp_path / f"{scenario}-{world}"
    out.mkdir()
    for rank in range(world):
        data = load_pickle(two / f"rank-{min(rank, 1)}.pickle")
        for group in data["pg_config"].values():
            group["ranks"] = str(list(range(world)))
        (out / f"rank-{rank}.pickle").write_bytes(pickle.dumps(data))
    return out


@pytest.mark.parametrize(
    "scenario, verdict, grouped",
    [
        ("rank0-broadcast-missing", "rank-conditional-hang", "ranks 1-39 at group 0 #4"),
        ("dtype-mismatch", "collective-mismatch", "ranks 1-39 #"),
    ],
)
def test_many_ranks_alike_are_one_row_of_evidence(scenario: str, verdict: str, grouped: str, tmp_path: Path) -> None:
    """At 40 ranks the same verdict, the odd rank 0 on its own rows, the 39 others one row."""
    f = next(f for f in analyze(widened(scenario, tmp_path, 40)).findings if f.id == verdict)
    labels = [e.label for e in f.evidence]
    assert any(label.startswith("rank 0") for label in labels)
    rows = [e for e in f.evidence if e.label.startswith(grouped)]
    assert len(rows) == 1 and "39 ranks alike" in str(rows[0].value), labels
    assert not any(label.startswith(("rank 1 ", "rank 39 ")) for label in labels)
    assert len(f.evidence) <= 6
