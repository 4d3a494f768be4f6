"""A rank-only entry into ZeRO-3's parameter state before the first collective the ranks
disagree on: the held-out crash (rank 0 alone entered GatheredParameters at a save under
`if rank == 0:`; the next forward's all_gather had different sizes on the two ranks and
gloo aborted rank 1) is named by it, not as a size mismatch of the all_gather's line."""

from __future__ import annotations

from pathlib import Path

from lorascope.detect import collective_mismatch, rank_conditional_hang
from lorascope.detect.hang.diagnosis import diagnose
from lorascope.ingest.load import load_bundle
from lorascope.rundir.loading.reader import load_run
from tests.helpers import Call, RankSpec, write_run

SAVE = "/job/train.py:33 in save"
FORWARD = "/job/train.py:88 in forward"
ENTER = {"k": "zero_param", "what": "GatheredParameters", "op": "enter", "site": SAVE, "via": None, "step": 3}
LEAVE = {**ENTER, "op": "exit"}
ABORT = ("RuntimeError", "[gloo] Received data size doesn't match expected size")


def _run(root: Path, entered: bool) -> Path:
    zero = [ENTER, LEAVE] if entered else []
    ranks = [
        RankSpec(
            calls=[Call("all_reduce"), Call("all_gather_into_tensor", bytes=2048, site=FORWARD, end=False)],
            ends=False,
            sites={SAVE: ("with deepspeed.zero.GatheredParameters(params):", ["if rank == 0:"])},
            before_calls=zero,
        ),
        RankSpec(
            calls=[Call("all_reduce"), Call("all_gather_into_tensor", bytes=1024, site=FORWARD, end=False)],
            exception=ABORT,
        ),
    ]
    return write_run(root, ranks, exit_status=1)


def test_the_held_out_crash_names_the_rank_only_gather(tmp_path: Path) -> None:
    run_dir = _run(tmp_path / "run", entered=True)
    bundle = load_bundle(run_dir)
    assert collective_mismatch.detect(bundle) == []
    [finding] = rank_conditional_hang.detect(bundle)
    assert finding.ranks == [0] and finding.confidence == "high"
    assert finding.title.startswith(
        f"rank 0 alone entered deepspeed.zero.GatheredParameters at {SAVE}, under `if rank == 0:` (after step 3), "
        "before collective #2 on default_pg"
    )
    assert "GatheredParameters" in finding.fix
    diagnosis = diagnose(load_run(run_dir))
    assert diagnosis["odd_ranks"] == [0] and diagnosis["first_diverged"]["rank_only"]["site"] == SAVE
    assert "rank-only call into ZeRO-3's parameter state" in diagnosis["verdict"]


def test_without_the_entry_it_is_still_a_size_mismatch(tmp_path: Path) -> None:
    bundle = load_bundle(_run(tmp_path / "run", entered=False))
    assert rank_conditional_hang.detect(bundle) == []
    [finding] = collective_mismatch.detect(bundle)
    assert "with different sizes" in finding.title


def test_entries_every_rank_made_explain_nothing(tmp_path: Path) -> None:
    """Every rank entered the same site as often (a gather all ranks run): not rank-only."""
    calls = [Call("all_reduce"), Call("all_gather_into_tensor", bytes=2048, site=FORWARD, end=False)]
    ranks = [RankSpec(calls=calls, ends=False, before_calls=[ENTER, LEAVE]) for _ in range(2)]
    ranks[1].calls = [Call("all_reduce"), Call("all_gather_into_tensor", bytes=1024, site=FORWARD, end=False)]
    bundle = load_bundle(write_run(tmp_path / "run", ranks))
    assert rank_conditional_hang.detect(bundle) == []
    assert len(collective_mismatch.detect(bundle)) == 1
