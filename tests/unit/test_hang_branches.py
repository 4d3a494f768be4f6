"""Ranks whose collectives disagree with no rank condition around the calls
(lorascope/detect/hang/branches.py): the classic is uneven data shards, where one rank is
in its next step's backward while the others left the training loop for the barrier after
it. `hang` said "rank-conditional collective: ?" there (no odd rank to name), and both
`hang` and `analyze` told the reader to move the collective out of an `if rank == 0:`
block that was not there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lorascope.detect import rank_conditional_hang
from lorascope.detect.hang import branches
from lorascope.detect.hang.diagnosis import FIXES, P2P_FIX, diagnose
from lorascope.detect.hang.divergence import first_divergence
from lorascope.ingest.flight.reader import parse_flight_dump
from lorascope.ingest.load import load_bundle
from lorascope.rundir.loading.reader import load_run
from tests.helpers import Call, RankSpec, write_run

STEPS = 4
#: Each rank's completed steps, each with its forward, backward and optimizer phases.
PHASES = [(name, step) for step in range(STEPS) for name in ("forward", "backward", "optimizer")]
BACKWARD = "train.py:30 in backward_and_step"
BARRIER = "train.py:50 in main"


def _in_next_step(*phases: str) -> list[dict[str, Any]]:
    """The edges of a rank's next step begun (``step``: the steps it had completed), the
    last phase still open."""
    edges = []
    for i, name in enumerate(phases):
        edges.append({"k": "phase", "name": name, "edge": "begin", "step": STEPS})
        if i < len(phases) - 1:
            edges.append({"k": "phase", "name": name, "edge": "end", "step": STEPS})
    return edges


def _rank(last: Call, before: list[dict[str, Any]] | None = None, **spec: Any) -> RankSpec:
    return RankSpec(
        steps=STEPS, calls=[Call("all_reduce"), last], phases=PHASES, before_calls=before or [], ends=False, **spec
    )


def test_uneven_shards_are_told_as_steps_begun_not_as_a_rank_condition(tmp_path: Path) -> None:
    """Rank 0 is in its step 5's backward, in reduce_scatter #2; ranks 1, 2 finished 4 steps
    and wait in barrier #2 after them. No rank condition encloses either call."""
    run_dir = write_run(
        tmp_path / "run",
        [
            _rank(Call("reduce_scatter", site=BACKWARD, end=False), _in_next_step("forward", "backward")),
            _rank(Call("barrier", bytes=0, site=BARRIER, end=False)),
            _rank(Call("barrier", bytes=0, site=BARRIER, end=False)),
        ],
    )
    run = load_run(run_dir)
    div = first_divergence(run)
    assert div is not None
    places = {n: branches.step_place(run.ranks[n], c) for n, c in div.calls.items() if c is not None}
    assert places[0] == branches.StepPlace(STEPS, True, "backward")
    assert places[1] == places[2] == branches.StepPlace(STEPS, False)

    diagnosis = diagnose(run)
    verdict = diagnosis["verdict"]
    assert "?" not in verdict
    assert "rank 0 calls reduce_scatter at train.py:30 in backward_and_step, in its step 5 (backward)" in verdict
    assert "ranks 1, 2 call barrier at train.py:50 in main, after their step 4, outside any step" in verdict
    assert "begun different numbers of steps" in verdict
    assert diagnosis["fix"] == branches.FIX

    [finding] = rank_conditional_hang.detect(load_bundle(run_dir))
    assert finding.title == verdict
    assert finding.fix == branches.FIX and finding.confidence == "medium"
    made = {e.label: e.value for e in finding.evidence if e.label.endswith("made it")}
    assert made == {
        "rank 0 made it": "in its step 5 (backward)",
        "rank 1 made it": "after its step 4, outside any step",
        "rank 2 made it": "after its step 4, outside any step",
    }


def test_a_branch_within_one_step_is_not_said_to_be_uneven_steps(tmp_path: Path) -> None:
    """Both ranks are in their step 5's forward and call different collectives there (a
    branch on the data): no talk of steps begun."""
    forward = _in_next_step("forward")
    run_dir = write_run(
        tmp_path / "run",
        [
            _rank(Call("all_gather", site="train.py:20 in forward", end=False), forward),
            _rank(Call("broadcast", site="train.py:24 in forward", end=False), forward),
        ],
    )
    verdict = diagnose(load_run(run_dir))["verdict"]
    assert "rank 0 calls all_gather at train.py:20 in forward, in its step 5 (forward)" in verdict
    assert "rank 1 calls broadcast at train.py:24 in forward, in its step 5 (forward)" in verdict
    assert verdict.endswith("a branch on the data or on the rank's own state took them different ways")


def test_a_rank_condition_keeps_the_rank_conditional_verdict(tmp_path: Path) -> None:
    """The same calls with rank 1's barrier inside `if rank != 0:`: that rank is named, with
    the rank-condition fix."""
    sites = {BARRIER: ("dist.barrier()", ["if rank != 0:"])}
    run_dir = write_run(
        tmp_path / "run",
        [
            _rank(Call("reduce_scatter", site=BACKWARD, end=False), _in_next_step("forward", "backward"), sites=sites),
            _rank(Call("barrier", bytes=0, site=BARRIER, end=False), sites=sites),
        ],
    )
    diagnosis = diagnose(load_run(run_dir))
    assert diagnosis["odd_ranks"] == [1]
    assert diagnosis["verdict"].startswith("rank-conditional collective (rank 1)")
    assert diagnosis["fix"] == FIXES["rank-conditional-hang"]
    [finding] = rank_conditional_hang.detect(load_bundle(run_dir))
    assert finding.fix == rank_conditional_hang.FIX


def test_no_place_is_claimed_where_the_phase_edges_do_not_reach_the_call(tmp_path: Path) -> None:
    """Ranks without phase edges (a loop the probes see no phases of): the calls are named,
    with no step place and no claim about steps begun."""
    run_dir = write_run(
        tmp_path / "run",
        [
            RankSpec(
                steps=STEPS, calls=[Call("all_reduce"), Call("reduce_scatter", site=BACKWARD, end=False)], ends=False
            ),
            RankSpec(
                steps=STEPS, calls=[Call("all_reduce"), Call("barrier", bytes=0, site=BARRIER, end=False)], ends=False
            ),
        ],
    )
    run = load_run(run_dir)
    div = first_divergence(run)
    assert div is not None
    assert all(branches.step_place(run.ranks[n], c) is None for n, c in div.calls.items() if c is not None)
    verdict = diagnose(run)["verdict"]
    assert "rank 0 calls reduce_scatter at train.py:30 in backward_and_step; rank 1 calls barrier" in verdict
    assert "step" not in verdict.split("first disagree", 1)[1].replace("backward_and_step", "")


TRAIN = "/job/train.py"
FORWARD_SITE = f"{TRAIN}:347 in compute_loss"


#: A flight-recorder call: (op, line, function) in TRAIN.
FlightCall = tuple[str, int, str]
BROADCAST: FlightCall = ("broadcast", 347, "compute_loss")
BARRIER_CALL: FlightCall = ("barrier", 29, "main")
GRADS: FlightCall = ("all_reduce", 333, "backward_and_step")


def _flight(last: list[FlightCall], done: int, world: int) -> dict[str, Any]:
    """A gloo flight-recorder dump as torch writes it: two all_reduces on default_pg, then
    ``last``; the first ``done`` completed."""
    calls = [("all_reduce", 88, "step")] * 2 + last
    return {
        "version": "2.10",
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": str(list(range(world)))}},
        "pg_status": {"0": {"last_enqueued_collective": len(calls), "last_started_collective": -1,
                            "last_completed_collective": done}},
        "entries": [
            {"record_id": seq, "pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": seq,
             "p2p_seq_id": 0, "profiling_name": f"gloo:{name}", "input_sizes": [[4]], "output_sizes": [[4]],
             "input_dtypes": ["Float"], "output_dtypes": ["Float"], "state": "scheduled", "retired": seq <= done,
             "is_p2p": False, "frames": [{"name": fn, "filename": TRAIN, "line": ln}]}
            for seq, (name, ln, fn) in enumerate(calls, 1)
        ],
    }  # fmt: skip


def _ddp_hang(
    tmp_path: Path, flights: list[tuple[list[FlightCall], int]], sites: dict[str, tuple[str, list[str]]] | None = None
) -> dict[str, Any]:
    """DDP's calls are in the flight recorder only (``flights``: each rank's calls after
    two all_reduces, and how many it completed). A rank whose last call is the barrier
    left its loop for it (the probes' own #1, pending); the others' records hold no call.
    The run's records show no divergence."""
    dump = {"k": "dump", "reason": "request", "step": STEPS, "since_progress": 30.0,
            "stacks": f'Thread MainThread:\n  File "{TRAIN}", line 347, in compute_loss\n'}  # fmt: skip
    barrier = {"group": "default_pg", "seq": 1, "op": "barrier", "bytes": 0, "site": f"{TRAIN}:29 in main"}
    specs = []
    for calls, _ in flights:
        left = calls[-1] == BARRIER_CALL
        specs.append(
            RankSpec(
                steps=STEPS,
                calls=[Call("barrier", bytes=0, site=f"{TRAIN}:29 in main", end=False)] if left else [],
                ends=False,
                extra=[{**dump, "pending": [barrier] if left else []}],
                sites=sites or {},
            )
        )
    run = load_run(write_run(tmp_path / "run", specs))
    assert first_divergence(run) is None
    timeline = {
        n: [(float(r.dumps[-1]["t"]), parse_flight_dump(_flight(*flights[n], len(flights)), n))]
        for n, r in run.ranks.items()
    }
    return diagnose(run, dict.fromkeys(run.ranks, True), timeline)


def test_a_divergence_only_the_flight_recorder_shows_is_told_not_a_rank_stuck_in_its_code(tmp_path: Path) -> None:
    """Uneven shards under DDP: rank 0 read "stuck outside any collective, in its own code
    at compute_loss" (its call is DDP's, which the probes do not see)."""
    diagnosis = _ddp_hang(tmp_path, [([BROADCAST], 2), ([BARRIER_CALL], 2)])
    assert diagnosis["kind"] == "rank-conditional-hang" and diagnosis["odd_ranks"] == []
    verdict = diagnosis["verdict"]
    assert "first disagree at collective #3 on default_pg in the flight recorder" in verdict
    assert (
        "rank 0 calls broadcast at train.py:347 in compute_loss, waiting; rank 1 calls barrier at train.py:29"
        in verdict
    )
    assert diagnosis["fix"] == branches.FIX
    state = diagnosis["ranks"][0]
    assert state["state"] == "in-collective" and state["where"].startswith(
        f"broadcast #3 on default_pg at {FORWARD_SITE}"
    )
    # rank 1 made a barrier there: it did enqueue #3 (it read "rank 1 never enqueued it")
    assert state["where"].endswith("(flight recorder: rank 1 made barrier there)")
    # rank 1's line gives the flight recorder's number beside the probes' own (#1: DDP's calls unseen)
    assert diagnosis["ranks"][1]["where"] == (
        f"barrier #1 on default_pg at {TRAIN}:29 in main "
        "(#3 in the flight recorder, which counts the calls the probes do not see)"
    )


def test_a_rank_condition_on_a_flight_recorder_call_names_its_rank(tmp_path: Path) -> None:
    """The same with rank 0's line inside `if rank == 0:` (as the probes recorded it)."""
    diagnosis = _ddp_hang(
        tmp_path, [([BROADCAST], 2), ([BARRIER_CALL], 2)], {FORWARD_SITE: ("loss = model(x)", ["if rank == 0:"])}
    )
    assert diagnosis["odd_ranks"] == [0]
    assert diagnosis["verdict"] == (
        f"rank-conditional collective (rank 0): broadcast #3 on default_pg at {FORWARD_SITE}, under `if rank == 0:` "
        "(flight recorder)"
    )
    assert diagnosis["fix"] == FIXES["rank-conditional-hang"]


def test_three_ranks_a_flight_recorder_divergence_names_the_rarest_call_and_who_waits_where(tmp_path: Path) -> None:
    """An early stop on rank 2 under DDP, 3 ranks: ranks 0, 1 issued DDP's broadcast #3,
    rank 2 the barrier; rank 1 (a receiver) completed the broadcast and waits in the
    gradient all_reduce #4. Rank 2 is the odd one (the minority), rank 1 waits in #4."""
    diagnosis = _ddp_hang(tmp_path, [([BROADCAST], 2), ([BROADCAST, GRADS], 3), ([BARRIER_CALL], 2)])
    assert diagnosis["odd_ranks"] == [2]
    assert "rank 0 calls broadcast at train.py:347 in compute_loss, waiting" in diagnosis["verdict"]
    assert "rank 2 calls barrier at train.py:29 in main, waiting" in diagnosis["verdict"]
    waits = {s["rank"]: s["where"] for s in diagnosis["ranks"]}
    assert waits[1].startswith(f"all_reduce #4 on default_pg at {TRAIN}:333 in backward_and_step")
    assert "ranks 0, 2 never enqueued it" in waits[1]


def test_a_send_only_one_rank_makes_gets_the_matching_receive_as_its_fix(tmp_path: Path) -> None:
    """Rank 0 sends its loss to rank 1 under `if rank == 0:`; rank 1 never receives and
    goes on into its next backward. The fix was the collective's ("run it on every rank")."""
    send = f"{TRAIN}:13 in log_loss"
    sites = {send: ("dist.send(loss, dst=1)", ["if rank == 0:"])}
    run_dir = write_run(
        tmp_path / "run",
        [
            _rank(Call("send", site=send, end=False), sites=sites),
            _rank(Call("reduce_scatter", site=BACKWARD, end=False), _in_next_step("forward", "backward"), sites=sites),
        ],
    )
    diagnosis = diagnose(load_run(run_dir))
    assert diagnosis["odd_ranks"] == [0] and "under `if rank == 0:`" in diagnosis["verdict"]
    # a send is no collective (it read "rank-conditional collective (rank 0): send #2 ...")
    assert diagnosis["verdict"].startswith("rank-conditional point-to-point send (rank 0): send #1 on default_pg")
    assert diagnosis["fix"] == P2P_FIX
    [finding] = rank_conditional_hang.detect(load_bundle(run_dir))
    assert finding.ranks == [0] and finding.fix == P2P_FIX


def test_ranks_out_of_step_since_a_skipped_batch_are_told_where(tmp_path: Path) -> None:
    """Rank 1 skipped a batch's backward and optimizer step in its step 2 (two forwards
    there); the calls paired across steps until rank 0's extra backward, at the end. Read
    as if the ranks had begun different numbers of steps (uneven shards)."""
    skipped = [
        (name, step)
        for step in range(STEPS)
        for name in (
            ("forward", "forward", "backward", "optimizer") if step == 1 else ("forward", "backward", "optimizer")
        )
    ]
    run_dir = write_run(
        tmp_path / "run",
        [
            _rank(Call("reduce_scatter", site=BACKWARD, end=False), _in_next_step("forward", "backward")),
            RankSpec(
                steps=STEPS,
                calls=[Call("all_reduce"), Call("barrier", bytes=0, site=BARRIER, end=False)],
                phases=skipped,
                ends=False,
            ),
        ],
    )
    run = load_run(run_dir)
    assert branches.out_of_step(run, [0, 1]) == (1, {0: 1, 1: 2})
    verdict = diagnose(run)["verdict"]
    assert "the ranks went out of step in step 2 (rank 1 ran 2 forwards, rank 0 ran 1 forward in it)" in verdict
    assert "begun different numbers of steps" not in verdict
    assert branches.out_of_step(load_run(write_run(tmp_path / "even", [_rank(Call("all_reduce"))] * 2)), [0, 1]) is None


def test_a_send_and_its_receive_are_no_divergence(tmp_path: Path) -> None:
    """Rank 0 sends its loss to rank 1 every step and rank 1 receives it: the probes
    numbered both with the group's collectives, and the pair read as ranks disagreeing on
    the op ("rank-conditional-hang, ERROR, confidence high" on a healthy job). Point-to-point
    calls are no part of the group's alignment."""
    sites = {f"{TRAIN}:22 in main": ("dist.send(t, dst=1)", ["if d.rank == 0:"])}
    run_dir = write_run(
        tmp_path / "run",
        [
            RankSpec(
                calls=[Call("all_reduce"), Call("send", site=f"{TRAIN}:22 in main"), Call("all_reduce")], sites=sites
            ),
            RankSpec(
                calls=[Call("all_reduce"), Call("recv", site=f"{TRAIN}:24 in main"), Call("all_reduce")], sites=sites
            ),
        ],
    )
    assert first_divergence(load_run(run_dir)) is None
    assert rank_conditional_hang.detect(load_bundle(run_dir)) == []


def test_sends_between_two_of_three_ranks_leave_the_collectives_aligned(tmp_path: Path) -> None:
    """Ranks 0 and 1 exchange a tensor each step; rank 2 makes no point-to-point call. Its
    all_reduce #2 pairs with theirs (numbered with their sends, theirs were #3)."""
    exchange = [Call("all_reduce"), Call("send"), Call("all_reduce")]
    run_dir = write_run(
        tmp_path / "run",
        [
            RankSpec(calls=exchange),
            RankSpec(calls=[Call("all_reduce"), Call("recv"), Call("all_reduce")]),
            RankSpec(calls=[Call("all_reduce"), Call("all_reduce")]),
        ],
    )
    assert first_divergence(load_run(run_dir)) is None
    assert rank_conditional_hang.detect(load_bundle(run_dir)) == []
