"""Every rank waits in a collective and no group's calls disagree: the diagnosis tells one
collective stuck with its whole group in it from ranks that wait for one another in
collectives of different groups (lorascope/detect/hang/waits.py). Both read "every rank
waits in the same collective: the collective itself is stuck" before, with a fix about
the network, on jobs whose ranks waited in two different collectives."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lorascope.detect.hang.diagnosis import diagnose
from lorascope.detect.hang.waits import members
from lorascope.rundir.loading.reader import RunData, load_run
from tests.helpers import Call, RankSpec, write_run


def _dump(*pending: tuple[str, int, str]) -> dict[str, Any]:
    """A dump taken 30 s into a wait in ``pending`` ((group, seq, op) each)."""
    return {
        "k": "dump",
        "reason": "request",
        "step": 4,
        "stacks": 'Thread MainThread:\n  File "train.py", line 10, in main\n',
        "pending": [
            {"group": g, "seq": seq, "op": op, "bytes": 4, "site": f"train.py:{20 + seq} in main"}
            for g, seq, op in pending
        ],
        "since_progress": 30.0,
    }


def _p2p(op: str, peer: int) -> dict[str, Any]:
    """A dump taken 30 s into point-to-point call #2 ``op`` with ``peer``, as probes that
    record a call's peer write it."""
    dump = _dump(("default_pg", 2, op))
    dump["pending"][0]["peer"] = peer
    return dump


def _live(tmp_path: Path, specs: list[RankSpec]) -> RunData:
    """SPECS as a run directory whose launcher has not ended (a live hang)."""
    run_dir = write_run(tmp_path / "run", specs)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    for launch in manifest["launches"]:
        launch["end"], launch["exit_status"] = None, None
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    return load_run(run_dir)


def _rank(calls: list[Call], dump: dict[str, Any], groups: dict[int, list[int]]) -> RankSpec:
    return RankSpec(calls=calls, ends=False, extra=[dump], groups=groups)


def test_ranks_that_issue_two_groups_calls_in_different_orders_deadlock(tmp_path: Path) -> None:
    """Rank 0 waits in g1's all_reduce #1, which rank 1 never issued; rank 1 waits in
    default_pg's barrier #2, which rank 0 never issued. Each group's own calls agree."""
    both = {1: [0, 1]}
    run = _live(
        tmp_path,
        [
            _rank([Call("all_reduce"), Call("all_reduce", gid=1, end=False)], _dump(("g1", 1, "all_reduce")), both),
            _rank([Call("all_reduce"), Call("barrier", end=False)], _dump(("default_pg", 2, "barrier")), both),
        ],
    )
    diagnosis = diagnose(run, {0: True, 1: True})
    assert diagnosis["kind"] == "crossed-collectives" and diagnosis["id"] == "hung-ranks"
    assert diagnosis["odd_ranks"] == [0, 1]
    verdict = diagnosis["verdict"]
    assert "rank 0 waits in all_reduce #1 on g1 at train.py:21 in main for rank 1" in verdict
    assert "rank 1 waits in barrier #2 on default_pg at train.py:22 in main for rank 0" in verdict
    assert "different orders" in verdict and "transport" not in diagnosis["fix"]


def test_a_group_a_rank_never_used_has_the_members_its_records_list(tmp_path: Path) -> None:
    """The probes record a group when a rank first uses it: rank 1 never used g1, and only
    rank 0's record lists g1's ranks, a list equal to default_pg's (the reader shares the
    two): rank 1 is still a member that never issued g1's call (the real job's case,
    tests/e2e/test_hang.py)."""
    run = _live(
        tmp_path,
        [
            _rank(
                [Call("all_reduce"), Call("all_reduce", gid=1, end=False)], _dump(("g1", 1, "all_reduce")), {1: [0, 1]}
            ),
            _rank([Call("all_reduce"), Call("barrier", end=False)], _dump(("default_pg", 2, "barrier")), {}),
        ],
    )
    assert members(run) == {"g1": {0, 1}, "default_pg": {0, 1}}
    assert diagnose(run, {0: True, 1: True})["kind"] == "crossed-collectives"


def test_a_subgroup_stuck_whole_is_named_and_the_others_wait_for_it(tmp_path: Path) -> None:
    """Ranks 0 and 1, all of g1, wait in its all_reduce #1; rank 2 waits in default_pg's
    barrier #2 for them: g1's collective itself is stuck."""
    pair = {1: [0, 1]}
    in_g1 = [Call("all_reduce"), Call("all_reduce", gid=1, end=False)]
    run = _live(
        tmp_path,
        [
            _rank(in_g1, _dump(("g1", 1, "all_reduce")), pair),
            _rank(in_g1, _dump(("g1", 1, "all_reduce")), pair),
            _rank([Call("all_reduce"), Call("barrier", end=False)], _dump(("default_pg", 2, "barrier")), {}),
        ],
    )
    assert members(run) == {"g1": {0, 1}, "default_pg": {0, 1, 2}}
    diagnosis = diagnose(run, dict.fromkeys(range(3), True))
    assert (diagnosis["kind"], diagnosis["odd_ranks"]) == ("collective-stuck", [0, 1])
    assert diagnosis["verdict"] == (
        "ranks 0, 1 wait in all_reduce #1 on g1 at train.py:21 in main, with every rank of group g1 in it: "
        "the collective itself is stuck; the others wait for them"
    )


def test_every_rank_in_one_collective_is_told_as_before(tmp_path: Path) -> None:
    calls = [Call("all_reduce"), Call("all_reduce", end=False)]
    run = _live(tmp_path, [_rank(calls, _dump(("default_pg", 2, "all_reduce")), {}) for _ in range(3)])
    diagnosis = diagnose(run, dict.fromkeys(range(3), True))
    assert (diagnosis["kind"], diagnosis["odd_ranks"]) == ("collective-stuck", [])
    assert diagnosis["verdict"] == "every rank waits in the same collective: the collective itself is stuck"


def test_a_member_that_passed_the_call_is_not_waited_for(tmp_path: Path) -> None:
    """Rank 1 issued g1's #1 (its records show it: its tally) and waits further on, in
    default_pg's #2, for rank 0; rank 0 waits in g1's #1, which every member issued:
    that collective is stuck, and rank 1 waits for it."""
    pair = {1: [0, 1]}
    run = _live(
        tmp_path,
        [
            _rank([Call("all_reduce"), Call("all_reduce", gid=1, end=False)], _dump(("g1", 1, "all_reduce")), pair),
            _rank(
                [Call("all_reduce"), Call("all_reduce", gid=1), Call("barrier", end=False)],
                _dump(("default_pg", 2, "barrier")),
                pair,
            ),
        ],
    )
    diagnosis = diagnose(run, {0: True, 1: True})
    assert (diagnosis["kind"], diagnosis["odd_ranks"]) == ("collective-stuck", [0])
    assert diagnosis["verdict"].startswith("rank 0 waits in all_reduce #1 on g1")


def test_waits_in_a_group_no_rank_recorded_are_not_told_as_one_stuck_collective(tmp_path: Path) -> None:
    """Rank 1 waits in group g9's call, which no rank recorded (its members unknown): who
    waits for whom cannot be told, and it is said so rather than guessed."""
    calls = [Call("all_reduce"), Call("all_reduce", end=False)]
    run = _live(
        tmp_path,
        [_rank(calls, _dump(("default_pg", 2, "all_reduce")), {}), _rank(calls, _dump(("g9", 1, "all_reduce")), {})],
    )
    diagnosis = diagnose(run, {0: True, 1: True})
    assert (diagnosis["kind"], diagnosis["odd_ranks"]) == ("unknown", [])
    assert diagnosis["verdict"].startswith("every rank waits in a collective, not all in the same one, and whom")


def test_ranks_that_each_send_first_to_the_other_deadlock(tmp_path: Path) -> None:
    """Each rank sends its activations to the other with a blocking send, then receives:
    both wait in send #2. Read "the collective itself is stuck", with a fix about the
    network."""
    calls = [Call("all_reduce"), Call("send", end=False)]
    run = _live(tmp_path, [_rank(calls, _dump(("default_pg", 2, "send")), {}) for _ in range(2)])
    diagnosis = diagnose(run, {0: True, 1: True})
    assert (diagnosis["kind"], diagnosis["id"]) == ("p2p-deadlock", "hung-ranks")
    assert diagnosis["verdict"] == (
        "every rank waits in a blocking send to a peer that waits in its own send (a point-to-point deadlock: no "
        "rank receives first): ranks 0, 1 in send #2 on default_pg at train.py:22 in main"
    )
    assert "one side receives first" in diagnosis["fix"]


def test_ranks_in_a_send_and_its_receive_are_not_a_p2p_deadlock(tmp_path: Path) -> None:
    """Rank 0 in send #2, rank 1 in the matching recv #2: the pair itself does not
    complete; no p2p deadlock is claimed."""
    run = _live(
        tmp_path,
        [
            _rank([Call("all_reduce"), Call("send", end=False)], _dump(("default_pg", 2, "send")), {}),
            _rank([Call("all_reduce"), Call("recv", end=False)], _dump(("default_pg", 2, "recv")), {}),
        ],
    )
    assert diagnose(run, {0: True, 1: True})["kind"] != "p2p-deadlock"


def test_a_cycle_of_sends_and_receives_is_a_p2p_deadlock_named_by_peer(tmp_path: Path) -> None:
    """Three pipeline stages: rank 0 receives from rank 2, rank 1 sends to rank 0 and rank 2
    sends to rank 1. No rank's peer waits in the matching call: each is named with whom it
    waits for. Without the peers this read "the collective itself is stuck"."""
    waits = [("recv", 2), ("send", 0), ("send", 1)]
    run = _live(tmp_path, [_rank([Call("all_reduce"), Call(op, end=False)], _p2p(op, peer), {}) for op, peer in waits])
    diagnosis = diagnose(run, {0: True, 1: True, 2: True})
    assert (diagnosis["kind"], diagnosis["id"], diagnosis["odd_ranks"]) == ("p2p-deadlock", "hung-ranks", [])
    assert diagnosis["verdict"] == (
        "every rank waits in a blocking send or receive, and these ranks' peers wait in other calls (a "
        "point-to-point deadlock): rank 0 receives from rank 2 while rank 2 sends to rank 1; rank 1 sends to "
        "rank 0 while rank 0 receives from rank 2; rank 2 sends to rank 1 while rank 1 sends to rank 0"
    )
    assert "pair each send with a recv of the same rank" in diagnosis["fix"]


def test_a_matched_pair_beside_a_broken_one_names_the_broken_ranks(tmp_path: Path) -> None:
    """Ranks 0 and 1 wait in a send and its receive; rank 2 receives from rank 3, which
    receives from rank 2: ranks 2 and 3 are the odd ones."""
    waits = [("send", 1), ("recv", 0), ("recv", 3), ("recv", 2)]
    run = _live(tmp_path, [_rank([Call("all_reduce"), Call(op, end=False)], _p2p(op, peer), {}) for op, peer in waits])
    diagnosis = diagnose(run, dict.fromkeys(range(4), True))
    assert (diagnosis["kind"], diagnosis["odd_ranks"]) == ("p2p-deadlock", [2, 3])
    assert diagnosis["verdict"].endswith(
        "rank 2 receives from rank 3 while rank 3 receives from rank 2; rank 3 receives from rank 2 while rank 2 "
        "receives from rank 3"
    )


def test_a_send_and_its_receive_with_peers_are_the_transport(tmp_path: Path) -> None:
    """Rank 0 sends to rank 1, which receives from rank 0: matched, and the pair does not
    complete. Told as the pair's tags or the transport, not as a deadlock; held out: a
    send with tag 1 and its receive with tag 2 read "the collective itself is stuck"."""
    run = _live(
        tmp_path,
        [
            _rank([Call("all_reduce"), Call("send", end=False)], _p2p("send", 1), {}),
            _rank([Call("all_reduce"), Call("recv", end=False)], _p2p("recv", 0), {}),
        ],
    )
    diagnosis = diagnose(run, {0: True, 1: True})
    assert (diagnosis["kind"], diagnosis["id"]) == ("p2p-stuck", "hung-ranks")
    assert diagnosis["verdict"] == (
        "every rank waits in a send or receive whose peer waits in the matching one (rank 0 sends to rank 1), and "
        "the transfer does not complete: the transport is stuck, or the pair's tags or sizes differ"
    )
    assert "same tag" in diagnosis["fix"]


def test_a_receive_from_any_rank_is_matched_by_a_send_to_it(tmp_path: Path) -> None:
    """Rank 0 receives from any rank (``src=None``) and rank 1 sends to it; rank 2 receives
    from rank 1, which sends to rank 0 instead: rank 2 is the odd one."""
    run = _live(
        tmp_path,
        [
            _rank([Call("all_reduce"), Call("recv", end=False)], _dump(("default_pg", 2, "recv")), {}),
            _rank([Call("all_reduce"), Call("send", end=False)], _p2p("send", 0), {}),
            _rank([Call("all_reduce"), Call("recv", end=False)], _p2p("recv", 1), {}),
        ],
    )
    diagnosis = diagnose(run, dict.fromkeys(range(3), True))
    assert (diagnosis["kind"], diagnosis["odd_ranks"]) == ("p2p-deadlock", [2])
    assert diagnosis["verdict"].endswith("rank 2 receives from rank 1 while rank 1 sends to rank 0")
