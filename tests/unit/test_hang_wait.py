"""`lorascope hang` waits for the ranks' dumps by reading only what their streams gained
since the signal, then reads the run once: a dump flushed a moment after the signal
counts (a rank is not called silent because its stream was read too early), a dump in a
segment begun since counts, one from before the signal does not."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from lorascope.hang.ask import Asked, stream_ends
from lorascope.hang.collect import wait_for_dumps
from lorascope.hang.targets import Target
from lorascope.rundir.loading.attachments import attached_processes
from tests.helpers import RankSpec, write_run


def processes(run_dir: Path) -> list[Target]:
    """The run's processes, as `lorascope hang` finds them (here: taken as verified)."""
    return [Target(s["rank"], s["pid"], s["host"], alive=True, ours=True, why="") for s in attached_processes(run_dir)]


def dump_line(t: float, request: str | None = None) -> str:
    rec = {"reason": "signal", "step": 4, "stacks": "Thread MainThread:\n", "pending": [], "k": "dump", "t": t}
    if request is not None:
        rec = {**rec, "reason": "request", "request": request}
    return json.dumps(rec, separators=(",", ":")) + "\n"


def signalled(run_dir: Path, since: float) -> Asked:
    """A request that signalled every process (all on this host, on this clock)."""
    return Asked(since, "req-1", frozenset((t.host, t.pid) for t in processes(run_dir)))


def append(path: Path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


def test_a_dump_written_after_the_signal_is_waited_for(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", [RankSpec(ends=False), RankSpec(ends=False)])
    streams = {n: sorted((run_dir / "ranks" / f"rank-{n}").glob("*.jsonl")) for n in (0, 1)}
    append(streams[1][0], dump_line(time.time() - 60))  # an old dump: not an answer
    ends = stream_ends(run_dir, processes(run_dir))
    since = time.time()
    append(streams[0][0], dump_line(since + 0.01))
    # rank 1 answers 0.5 s later, in a segment it began since
    later = threading.Timer(
        0.5, append, (streams[1][0].with_name(streams[1][0].name.replace(".0000.", ".0001.")), dump_line(since + 0.5))
    )
    later.start()
    started = time.time()
    run, silent = wait_for_dumps(run_dir, ends, signalled(run_dir, since), wait_s=20)
    later.join()
    assert silent == []
    assert time.time() - started < 10  # it returned once both answered, not at the deadline
    assert [d["t"] >= since for d in run.ranks[1].dumps] == [False, True]


def test_a_rank_that_does_not_answer_is_silent_after_the_wait(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", [RankSpec(ends=False), RankSpec(ends=False)])
    ends = stream_ends(run_dir, processes(run_dir))
    since = time.time()
    append(sorted((run_dir / "ranks" / "rank-0").glob("*.jsonl"))[0], dump_line(since + 0.01))
    started = time.time()
    _, silent = wait_for_dumps(run_dir, ends, signalled(run_dir, since), wait_s=1.0)
    assert silent == [1]
    assert time.time() - started >= 1.0


def test_another_hosts_rank_answers_by_the_requests_id_whatever_its_clock(tmp_path: Path) -> None:
    """A rank on another host cannot be signalled: its probe thread answers the request
    file with a dump that carries the request's id, and its clock may be off by minutes;
    a dump without the id (the stall watchdog's, on that clock) does not answer."""
    run_dir = write_run(tmp_path / "run", [RankSpec(ends=False), RankSpec(ends=False)])
    streams = {n: sorted((run_dir / "ranks" / f"rank-{n}").glob("*.jsonl"))[0] for n in (0, 1)}
    ends = stream_ends(run_dir, processes(run_dir))
    since = time.time()
    asked = Asked(since, "req-7", frozenset())  # nothing signalled: every rank is elsewhere
    append(streams[0], dump_line(since - 300, request="req-7"))  # its clock 5 minutes behind
    append(streams[1], dump_line(since + 0.2))  # a dump, but not this request's
    run, silent = wait_for_dumps(run_dir, ends, asked, wait_s=1.0)
    assert silent == [1]
    assert run.ranks[0].dumps[-1]["request"] == "req-7"


def test_a_rank_is_read_as_soon_as_it_answered(tmp_path: Path) -> None:
    """Each process is read once its dump and flight-recorder dump are in, while the others
    are still waited for (at 1,024 ranks, reading them all after the last answer was most
    of the verdict's time)."""
    run_dir = write_run(tmp_path / "run", [RankSpec(ends=False), RankSpec(ends=False)])
    streams = {n: sorted((run_dir / "ranks" / f"rank-{n}").glob("*.jsonl"))[0] for n in (0, 1)}
    ends = stream_ends(run_dir, processes(run_dir))
    since = time.time()
    flight = json.dumps({"file": "gone.pickle", "reason": "request", "bytes": 0, "k": "flight_dump", "t": since})
    append(streams[0], dump_line(since + 0.01) + flight + "\n")
    answered: list[float] = []
    later = threading.Timer(1.5, lambda: (answered.append(time.time()), append(streams[1], dump_line(time.time()))))
    later.start()
    read: dict[int, float] = {}
    run, silent = wait_for_dumps(
        run_dir, ends, signalled(run_dir, since), wait_s=20, each=lambda rank: read.setdefault(rank.rank, time.time())
    )
    later.join()
    assert silent == [] and sorted(read) == [0, 1]
    assert read[0] < answered[0] <= read[1]  # rank 0 read before rank 1 answered
    assert [d["t"] >= since for d in run.ranks[1].dumps] == [True]
