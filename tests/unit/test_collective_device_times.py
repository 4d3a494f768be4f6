"""CUDA device times of collectives (lorascope/probes/collectives.py) are read lazily: at
a step end, only event pairs the device has finished are resolved, in call order, and
nothing ever waits. No GPU here: the events are stand-ins with CUDA events' query /
elapsed_time contract (benchmarks/gpu_check.sh checks the real ones)."""

from __future__ import annotations

from pathlib import Path

from lorascope.probes.collectives import CollectiveProbe, _Call
from lorascope.probes.session import Session
from lorascope.rundir.format.writer import Stream, ensure_manifest, stream_prefix
from lorascope.rundir.loading.reader import load_run


class Event:
    """A CUDA event's contract: query() never blocks; elapsed_time() needs both done."""

    def __init__(self, at_ms: float, done: bool) -> None:
        self.at_ms, self.done = at_ms, done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: Event) -> float:
        assert self.done and end.done, "elapsed_time on an unfinished event would synchronise"
        return end.at_ms - self.at_ms


def test_only_finished_pairs_resolve_in_call_order(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ensure_manifest(run)
    session = Session(Stream(stream_prefix(run, 0, "h", 1)), rank=0, local_rank=0, world_size=1, sample_interval=0)
    session.record("start", rank=0, world_size=1, local_rank=0, pid=1, host="h", argv=[], versions={}, device="cuda:0")
    session.record("group", gid=0, name="default_pg", ranks=[0], backend="nccl")
    probe = CollectiveProbe(session, stream_prefix(run, 0, "h", 1))
    key = ("all_reduce", "float32", False, None, None)
    shape = probe._shapes.declare(key)
    calls = []
    for seq in (1, 2, 3):  # three calls, each ended, in the call file as the probe writes them
        index = probe.calls.begin(float(seq), seq, 4, 0, 0, shape)
        probe.calls.end(index, seq + 0.5)
        calls.append(_Call(index, float(seq), seq, 0, 4, key, 0))
    # and a send, numbered apart from the collectives (#1 of its own count: counter ~gid)
    send_key = ("send", "float32", False, None, None)
    index = probe.calls.begin(3.8, 1, 4, 0, 0, probe._shapes.declare(send_key))
    probe.calls.end(index, 3.9)
    calls.append(_Call(index, 3.8, 1, 0, 4, send_key, ~0))
    pairs = [
        (Event(0.0, True), Event(1.5, True)),
        (Event(2.0, True), Event(2.25, False)),
        (Event(3, True), Event(4, True)),
        (Event(5, True), Event(5.125, True)),
    ]
    for n, (call, (start, end)) in enumerate(zip(calls, pairs, strict=True), 1):
        probe._events.append((call, start, end, 0.001 * n))

    probe.resolve_device_times()  # the second is still running: it and all after it wait
    assert [e[0].seq for e in probe._events] == [2, 3, 1]
    pairs[1][1].done = True
    probe.resolve_device_times()
    assert not probe._events

    session.flush()  # records are queued for the stream's writer thread (not started here)
    colls = load_run(run).ranks[0].collectives
    # all_reduce #1 keeps its own time: the send #1's is the send's
    assert [(c.op, c.seq, c.device_ms) for c in colls] == [
        ("all_reduce", 1, 1.5),
        ("all_reduce", 2, 0.25),
        ("all_reduce", 3, 1.0),
        ("send", 1, 0.125),
    ]
    dev = [
        line for line in next((run / "ranks" / "rank-0").glob("*.jsonl")).read_text().splitlines() if "coll_dev" in line
    ]
    assert '"host_ms":1.0' in dev[0] and '"host_ms":3.0' in dev[2] and '"p2p":true' in dev[3]
    assert "collectives" not in session.disabled
