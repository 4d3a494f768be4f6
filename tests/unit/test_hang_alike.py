"""Ranks whose answers agree are read a few at a time (`lorascope.hang.alike`): the others
are told by a copy of an alike rank's records under their own identity and answer, and
the diagnosis is the one a read of every rank gives, whatever the hang."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import pytest

from lorascope.cli.hang_verdict import _read_told
from lorascope.detect.hang.diagnosis import diagnose
from lorascope.hang.alike import READ_ALIKE, answer_key
from lorascope.hang.ask import Asked, stream_ends
from lorascope.hang.collect import _answers, wait_for_dumps
from lorascope.rundir.loading.attachments import attached_processes
from lorascope.rundir.loading.reader import RunData
from lorascope.rundir.loading.records import StartRecord
from tests.helpers import T0, Call, RankSpec, write_run
from tests.unit.test_hang_wait import append, processes

RANKS = 12
ODD = 7
STEP = "train.py:9 in step"
EXTRA = "train.py:50 in log"
WAITING = 'Thread MainThread:\n  File "train.py", line 30, in <module>\n  File "train.py", line 9, in step\n'
LOADER = 'Thread MainThread:\n  File "train.py", line 30, in <module>\n  File "train.py", line 21, in fetch\n'
LOGGING = 'Thread MainThread:\n  File "train.py", line 30, in <module>\n  File "train.py", line 50, in log\n'
DONE = [Call("all_reduce", site=STEP)] * 3


def answer(
    request: str, t: float, rank: int = 0, made: int = 4, site: str | None = STEP, **changed: Any
) -> dict[str, Any]:
    """A rank's dump for ``request``: in the all_reduce #4 made at ``site`` (None: in no
    call), with what differs between alike ranks (``since``, ``mem``)."""
    pending = [] if site is None else [{"group": "default_pg", "seq": 4, "op": "all_reduce", "bytes": 4, "site": site}]
    return {
        "k": "dump",
        "t": t,
        "reason": "request",
        "request": request,
        "step": 4,
        "stacks": {None: LOADER, STEP: WAITING, EXTRA: LOGGING}[site],
        "pending": [{**p, "since": 3.0 + rank} for p in pending],
        "made": {"default_pg": made},
        "mem": {"rss": 1000 + rank},
        "since_progress": 600.0 + rank,
        **changed,
    }


def test_answers_alike_but_for_how_long_share_a_key() -> None:
    one = answer("r", 1.0)
    assert answer_key(one) == answer_key(answer("r", 2.0, rank=1)) is not None
    assert answer_key(answer("r", 1.0, step=5)) != answer_key(one)
    assert answer_key(answer("r", 1.0, made=5)) != answer_key(one)
    assert answer_key(answer("r", 1.0, stacks=LOADER)) != answer_key(one)
    assert answer_key(answer("r", 1.0, pending=[{**one["pending"][0], "bytes": 8}])) != answer_key(one)


def test_an_answer_without_made_or_with_odd_fields_is_read_whole() -> None:
    assert answer_key({k: v for k, v in answer("r", 1.0).items() if k != "made"}) is None
    assert answer_key(answer("r", 1.0, made=True)) is None
    assert answer_key(answer("r", 1.0, pending=["all_reduce"])) is None


#: The hangs: rank ODD's records and its answer (None: it answers nothing), and the
#: diagnosis's kind. The other ranks wait in all_reduce #4 (STEP).
HANGS: dict[str, tuple[RankSpec, dict[str, Any] | None, str]] = {
    "in its data loader": (RankSpec(ends=False, calls=DONE), {"made": 3, "site": None}, "stuck-outside"),
    "in an all_reduce only it makes": (
        RankSpec(
            ends=False,
            calls=[*DONE, Call("all_reduce", bytes=8, site=EXTRA, end=False)],
            sites={EXTRA: ("dist.all_reduce(loss)", ["if rank == 7:"])},
        ),
        {"site": EXTRA, "size": 8},
        "rank-conditional-hang",
    ),
    "dead": (RankSpec(calls=DONE, exception=("RuntimeError", "CUDA error: out of memory")), None, "dead-rank"),
    "nowhere: every rank in the same all_reduce": (
        RankSpec(ends=False, calls=[*DONE, Call("all_reduce", site=STEP, end=False)]),
        {},
        "collective-stuck",
    ),
}


def read(tmp_path: Path, hang: str, alike: bool) -> RunData:
    """The run of RANKS ranks, rank ODD as ``hang`` says, read as `hang` reads it once every
    rank answered: alike ranks a few at a time, or (not ``alike``) every rank whole."""
    odd, odd_answer, _ = HANGS[hang]
    waiting = RankSpec(ends=False, calls=[*DONE, Call("all_reduce", site=STEP, end=False)])
    run_dir = write_run(tmp_path / ("alike" if alike else "all"), [odd if n == ODD else waiting for n in range(RANKS)])
    ends = stream_ends(run_dir, processes(run_dir))
    since = T0 + 1000  # after the ranks' records (their times are fixed)
    for n in range(RANKS):
        said = (
            answer("req", since, n)
            if n != ODD
            else None
            if odd_answer is None
            else answer("req", since, n, **odd_answer)
        )
        if said is not None:
            append(sorted((run_dir / "ranks" / f"rank-{n}").glob("*.jsonl"))[0], json.dumps(said) + "\n")
    starts = {(s["host"], s["pid"]): cast(StartRecord, s) for s in attached_processes(run_dir)} if alike else None
    run, _ = wait_for_dumps(run_dir, ends, Asked(since, "req", frozenset()), wait_s=1.0, starts=starts)
    return run


def test_alike_ranks_are_told_by_a_few_read_whole(tmp_path: Path) -> None:
    run = read(tmp_path, "in its data loader", alike=True)
    assert sorted(run.ranks) == list(range(RANKS))
    told = {n: r.told_by for n, r in run.ranks.items() if r.told_by is not None}
    assert len(told) == RANKS - 1 - READ_ALIKE and ODD not in told
    for n, by in told.items():
        rank, source = run.ranks[n], run.ranks[by]
        assert source.told_by is None
        assert rank.rank == rank.start["rank"] == n and rank.pid != source.pid
        assert [d["since_progress"] for d in rank.dumps] == [600.0 + n]  # its own answer
        assert rank.collectives == source.collectives and rank.collectives is not source.collectives
        assert rank.tallies == source.tallies and rank.tallies is not source.tallies


@pytest.mark.parametrize("hang", sorted(HANGS))
def test_the_diagnosis_is_the_one_every_rank_read_whole_gives(tmp_path: Path, hang: str) -> None:
    alike, whole = read(tmp_path, hang, alike=True), read(tmp_path, hang, alike=False)
    assert not any(r.told_by is not None for r in whole.ranks.values())
    told, every = diagnose(alike), diagnose(whole)
    assert told["kind"] == every["kind"] == HANGS[hang][2]
    assert told["odd_ranks"] == every["odd_ranks"] == ([] if HANGS[hang][2] == "collective-stuck" else [ODD])
    assert told["verdict"] == every["verdict"] and told["groups"] == every["groups"]
    assert [{k: v for k, v in s.items() if k != "told_by"} for s in told["ranks"]] == every["ranks"]
    alike_ranks = RANKS - (0 if HANGS[hang][2] == "collective-stuck" else 1)
    assert sum("told_by" in s for s in told["ranks"]) == alike_ranks - READ_ALIKE


def test_the_page_reads_every_rank_whole_and_keeps_the_stacks_read_from_outside(tmp_path: Path) -> None:
    run = read(tmp_path, "dead", alike=True)
    assert any(r.told_by is not None for r in run.ranks.values())
    spied = {"k": "dump", "t": T0 + 1001, "reason": "py-spy", "step": 0, "stacks": LOADER, "pending": []}
    run.ranks[ODD].dumps.append(cast(Any, spied))
    again = _read_told(run, run.path)
    assert sorted(again.ranks) == sorted(run.ranks) and not any(r.told_by is not None for r in again.ranks.values())
    assert again.ranks[ODD].dumps[-1] == spied
    for n, rank in again.ranks.items():
        assert rank.dumps[-1]["reason"] == ("py-spy" if n == ODD else "request")


def test_an_answer_read_again_as_its_stream_grows_is_kept_once(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", [RankSpec(ends=False)])
    ((key, grown),) = stream_ends(run_dir, processes(run_dir)).items()
    stream = sorted((run_dir / "ranks" / "rank-0").glob("*.jsonl"))[0]
    asked = Asked(T0 + 1000, "req", frozenset())
    append(stream, json.dumps(answer("req", T0 + 1000)) + "\n")
    assert _answers(grown, asked, key) == {"dump"}
    flight = {"k": "flight_dump", "t": T0 + 1000, "file": "gone.pickle", "reason": "request", "bytes": 0}
    append(stream, json.dumps(flight) + "\n")  # the growth is read again from the request on
    assert _answers(grown, asked, key) == {"dump", "flight_dump"}
    assert grown.answer is not None and grown.answer["request"] == "req"
