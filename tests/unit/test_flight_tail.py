"""The probes write each flight-recorder dump with its tail: each process group's
collectives from a few before its last completed one, in torch's format, which `lorascope hang` reads instead of the whole dump
(tests/unit/test_flight_in_runs.py). Here on a real single-process gloo job (a subprocess:
``TORCH_FR_BUFFER_SIZE`` is read once), with two groups, one ringing past the tail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from lorascope.ingest.flight.reader import read_flight_dump
from lorascope.probes.flight import TAIL_DONE, flight_tail
from tests.helpers import free_port

JOB = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from pathlib import Path
    from lorascope.probes.flight import dump_flight_recorder
    from lorascope.probes.session import Session
    from lorascope.rundir.format.writer import Stream, stream_prefix

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
    side = dist.new_group([0])
    t = torch.ones(4)
    for i in range({many}):
        dist.all_reduce(t)
        if i % 10 == 0:
            dist.broadcast(t, 0, group=side)
    prefix = stream_prefix(Path({out!r}), 0, "h", 1)
    session = Session(Stream(prefix), 0, 0, 1, 0.0)
    dump_flight_recorder(session, prefix, "request-1")
    session.stream.close()
    dist.destroy_process_group()
""")


def test_a_dump_is_written_with_its_tail_of_each_groups_collectives_in_flight(tmp_path: Path) -> None:
    many = 100
    script = JOB.format(port=free_port(), many=many, out=str(tmp_path / "run"))
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "2000"}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    [stream] = (tmp_path / "run").rglob("*.jsonl")
    [record] = [r for line in stream.read_text().splitlines() if (r := json.loads(line))["k"] == "flight_dump"]
    whole = read_flight_dump(stream.parent / record["file"], 0)
    tail = read_flight_dump(stream.parent / record["tail"], 0)
    assert record["tail"] == "h-1.flight.request-1.tail.pickle"
    groups = {e.group for e in whole.entries}
    assert len(groups) == 2 and len(whole.entries) == many + many // 10
    for group in groups:
        done = whole.status[group].last_completed
        assert done is not None and done > TAIL_DONE
        mine = [repr(e) for e in whole.entries if e.group == group and e.seq is not None and e.seq >= done - TAIL_DONE]
        assert [repr(e) for e in tail.entries if e.group == group] == mine and len(mine) == TAIL_DONE + 1
    assert (tail.status, tail.group_ranks, tail.version) == (whole.status, whole.group_ranks, whole.version)


def test_a_group_whose_progress_is_not_stated_keeps_its_last_entries() -> None:
    entries = [{"process_group": [str(i % 3), "g"], "collective_seq_id": i // 3 + 1} for i in range(60)]
    status = {"0": {"last_completed_collective": 18}, "1": {"last_completed_collective": -1}}
    cut = flight_tail({"version": "2.10", "pg_status": status, "entries": entries}, done=2, keep=4)
    assert cut["version"] == "2.10" and cut["pg_status"] == status
    kept = [(e["process_group"][0], e["collective_seq_id"]) for e in cut["entries"]]
    assert [seq for g, seq in kept if g == "0"] == [16, 17, 18, 19, 20]  # from 2 before its last completed
    assert [seq for g, seq in kept if g == "1"] == list(range(1, 21))  # none completed: all in flight
    assert [seq for g, seq in kept if g == "2"] == [17, 18, 19, 20]  # not stated: its last 4
    assert kept == sorted(kept, key=lambda k: (k[1], k[0]))  # in their order
