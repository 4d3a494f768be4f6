"""Collectives some ranks made alone before the ranks' calls first disagree
(lorascope/detect/hang/rank_only_calls.py). The classic: an evaluation on rank 0 only
under ZeRO-3; its forward's gathers pair with the other ranks' next training gathers, and
the ops part later, where no rank condition encloses either call. `hang` and `analyze`
said "a branch on the data" there, with the uneven-data fix."""

from __future__ import annotations

from pathlib import Path

from lorascope.detect import collective_mismatch, rank_conditional_hang
from lorascope.detect.hang import branches, rank_only_calls
from lorascope.detect.hang.diagnosis import diagnose
from lorascope.detect.hang.divergence import first_divergence
from lorascope.ingest.load import load_bundle
from lorascope.rundir.loading.reader import load_run
from tests.helpers import Call, RankSpec, write_run

FORWARD = "train.py:20 in forward"
BACKWARD = "train.py:30 in backward_and_step"
EVALUATE = "train.py:60 in main"
SITES = {
    FORWARD: ("return model(batch).loss", []),
    EVALUATE: ("print(evaluate(model))", ["if step % 4 == 0 and dist.get_rank() == 0:"]),
}


#: Rank 0's calls: a training gather, its evaluation's gather (the probes named the caller
#: under the rank condition), then its next training gather, waiting.
EVALUATED_ALONE = (
    Call("all_gather", site=FORWARD),
    Call("all_gather", site=FORWARD, via=EVALUATE),
    Call("all_gather", site=FORWARD, end=False),
)


def _rank(*calls: Call, sites: dict[str, tuple[str, list[str]]] | None = None) -> RankSpec:
    return RankSpec(calls=[Call("all_reduce"), *calls], ends=False, sites=SITES if sites is None else sites)


def _training(last: Call, gathers: int = 2) -> RankSpec:
    """A rank that trains: its forward's gathers, then ``last``."""
    return _rank(*[Call("all_gather", site=FORWARD)] * gathers, last)


def test_an_evaluation_on_rank_0_is_named_with_its_condition(tmp_path: Path) -> None:
    """Rank 0's gather #3 came from its evaluation under `if ... dist.get_rank() == 0:` (the
    probes named the caller); it paired with rank 1's training gather #3, and at #4 rank 0
    gathers in its training forward while rank 1 reduce-scatters in its backward."""
    run_dir = write_run(
        tmp_path / "run",
        [
            _rank(*EVALUATED_ALONE),
            _training(Call("reduce_scatter", site=BACKWARD, end=False)),
        ],
    )
    run = load_run(run_dir)
    div = first_divergence(run)
    assert div is not None and div.seq == 4
    found = rank_only_calls.before(run, div)
    assert found is not None
    assert (found.first, found.last, found.ranks, found.others) == (3, 3, [0], [1])
    assert found.condition == ("if step % 4 == 0 and dist.get_rank() == 0:", EVALUATE)

    diagnosis = diagnose(run)
    assert diagnosis["odd_ranks"] == [0]
    assert diagnosis["verdict"].startswith(
        "rank 0 alone made all_gather #3 on default_pg at train.py:20 in forward, called from train.py:60 in main "
        "under `if step % 4 == 0 and dist.get_rank() == 0:`"
    )
    assert "it paired with rank 1's all_gather at train.py:20 in forward" in diagnosis["verdict"]
    assert "until collective #4 on default_pg" in diagnosis["verdict"]
    assert diagnosis["fix"] == rank_only_calls.FIX
    assert diagnosis["first_diverged"]["rank_only_calls"]["first"] == 3

    [finding] = rank_conditional_hang.detect(load_bundle(run_dir))
    assert finding.title == diagnosis["verdict"]
    assert finding.confidence == "high" and finding.ranks == [0]
    assert finding.fix == rank_only_calls.FIX
    rows = {e.label: e.value for e in finding.evidence}
    assert rows["rank 0 rank-only call before it"].startswith("all_gather #3 at train.py:20 in forward")
    assert rows["rank 0 called it from"] == (
        "print(evaluate(model))   inside `if step % 4 == 0 and dist.get_rank() == 0:`"
    )
    assert rows["rank 1 paired it with"].startswith("all_gather #3 at train.py:20 in forward")


def test_an_evaluation_told_by_its_phase_alone(tmp_path: Path) -> None:
    """No rank condition was read (a flag set from the rank elsewhere): rank 0 made gathers
    #2 and #3 in an evaluation, ranks 1 and 2 in training; named from the eval phase, at
    medium confidence."""
    run_dir = write_run(
        tmp_path / "run",
        [
            _rank(
                Call("all_gather", site=FORWARD, phase="eval"),
                Call("all_gather", site=FORWARD, phase="eval"),
                Call("all_gather", site=FORWARD, end=False),
            ),
            _training(Call("reduce_scatter", site=BACKWARD, end=False)),
            _training(Call("reduce_scatter", site=BACKWARD, end=False)),
        ],
    )
    diagnosis = diagnose(load_run(run_dir))
    assert diagnosis["odd_ranks"] == [0]
    assert diagnosis["verdict"].startswith(
        "rank 0 alone made 2 collectives (#2-#3), the first all_gather, on default_pg at train.py:20 in forward "
        "in an evaluation the others did not run (after its step 4; no rank condition was read around it): "
        "it paired with ranks 1, 2's all_gather"
    )
    [finding] = rank_conditional_hang.detect(load_bundle(run_dir))
    assert finding.confidence == "medium"
    assert {e.label: e.value for e in finding.evidence}["rank 0 made it"] == "in its step 5 (eval)"


def test_an_if_else_pair_is_no_rank_only_call(tmp_path: Path) -> None:
    """Rank 0's gather #3 sits in `if rank == 0:`, rank 1's in its `else`: a matched pair,
    not a rank-only call; the divergence stays a branch on the data."""
    sites = {**SITES, "train.py:70 in main": ("load()", ["else of: if rank == 0:"])}
    sites[EVALUATE] = ("load()", ["if rank == 0:"])
    run_dir = write_run(
        tmp_path / "run",
        [
            _rank(
                *EVALUATED_ALONE,
                sites=sites,
            ),
            _rank(
                Call("all_gather", site=FORWARD),
                Call("all_gather", site=FORWARD, via="train.py:70 in main"),
                Call("reduce_scatter", site=BACKWARD, end=False),
                sites=sites,
            ),
        ],
    )
    run = load_run(run_dir)
    div = first_divergence(run)
    assert div is not None
    assert rank_only_calls.before(run, div) is None
    assert diagnose(run)["fix"] == branches.FIX


def test_every_rank_evaluating_together_is_no_rank_only_call(tmp_path: Path) -> None:
    """Both ranks evaluated (their gathers #2 in an eval phase): nothing rank-only."""
    run_dir = write_run(
        tmp_path / "run",
        [
            _rank(Call("all_gather", site=FORWARD, phase="eval"), Call("all_gather", site=FORWARD, end=False)),
            _rank(Call("all_gather", site=FORWARD, phase="eval"), Call("reduce_scatter", site=BACKWARD, end=False)),
        ],
    )
    run = load_run(run_dir)
    div = first_divergence(run)
    assert div is not None
    assert rank_only_calls.before(run, div) is None


def test_sizes_that_differ_after_a_rank_only_call_are_not_a_mismatch(tmp_path: Path) -> None:
    """After rank 0's evaluation gather, the ranks' gathers of the same line pair across
    layers and their sizes differ: collective-mismatch leaves it to the rank-only calls."""
    run_dir = write_run(
        tmp_path / "run",
        [
            _rank(
                Call("all_gather", site=FORWARD, via=EVALUATE),
                Call("all_gather", bytes=8, site=FORWARD, end=False),
            ),
            _rank(Call("all_gather", site=FORWARD), Call("all_gather", bytes=16, site=FORWARD, end=False)),
        ],
    )
    bundle = load_bundle(run_dir)
    assert collective_mismatch.detect(bundle) == []
    [finding] = rank_conditional_hang.detect(bundle)
    assert finding.title.startswith("rank 0 alone made all_gather #2 on default_pg")


def test_an_evaluation_that_ran_longer_on_one_rank(tmp_path: Path) -> None:
    """Both ranks evaluated after step 4 (generation until each rank's sequences end): rank
    0 ran 3 forwards in it, rank 1 one; rank 0's extra gather #3 paired with rank 1's
    training gather. Told as the longer evaluation, with the synced-generation fix, not as
    an evaluation rank 1 did not run."""
    run_dir = write_run(
        tmp_path / "run",
        [
            _rank(
                *[Call("all_gather", site=FORWARD, phase="eval")] * 2,
                Call("all_gather", site=FORWARD, end=False, phase="eval"),
            ),
            _rank(
                Call("all_gather", site=FORWARD, phase="eval"),
                Call("all_gather", site=FORWARD),
                Call("reduce_scatter", site=BACKWARD, end=False),
            ),
        ],
    )
    run = load_run(run_dir)
    div = first_divergence(run)
    assert div is not None and div.seq == 4
    found = rank_only_calls.before(run, div)
    assert found is not None and (found.first, found.last, found.evals) == (3, 3, {0: 3, 1: 1})
    diagnosis = diagnose(run)
    assert diagnosis["verdict"].startswith(
        "rank 0 ran more forwards in its evaluation after step 4 than the others (rank 0 ran 3, rank 1 ran 1): "
        "its extra all_gather #3 on default_pg at train.py:20 in forward: it paired with rank 1's all_gather"
    )
    assert diagnosis["fix"] == rank_only_calls.LONGER_FIX
    [finding] = rank_conditional_hang.detect(load_bundle(run_dir))
    assert finding.fix == rank_only_calls.LONGER_FIX and finding.confidence == "medium"


def test_an_evaluation_still_running_on_one_rank_meets_the_others_next_call(tmp_path: Path) -> None:
    """Evaluation shards of different lengths: rank 0 is in its third evaluation forward's
    gather #4 while rank 1, done after two, all_reduces the losses. The diverging call is
    the rank-only one; read "a branch on the data"."""
    reduce_losses = "train.py:40 in evaluate"
    run_dir = write_run(
        tmp_path / "run",
        [
            _rank(
                *[Call("all_gather", site=FORWARD, phase="eval")] * 2,
                Call("all_gather", site=FORWARD, end=False, phase="eval"),
            ),
            _rank(
                *[Call("all_gather", site=FORWARD, phase="eval")] * 2, Call("all_reduce", site=reduce_losses, end=False)
            ),
        ],
    )
    diagnosis = diagnose(load_run(run_dir))
    assert diagnosis["odd_ranks"] == [0]
    assert diagnosis["verdict"].startswith(
        "rank 0 ran more forwards in its evaluation after step 4 than the others (rank 0 ran 3, rank 1 ran 2): its "
        "extra all_gather #4 on default_pg at train.py:20 in forward: it met rank 1's all_reduce at train.py:40 in "
        "evaluate, where the ranks' calls first disagree"
    )
    assert diagnosis["fix"] == rank_only_calls.LONGER_FIX
