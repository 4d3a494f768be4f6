"""How a host async collective ends (lorascope/probes/collectives.py): when the job's
``wait()`` on its work returns, or at the stream's next flush once the work has
completed; never from a callback on gloo's worker thread. A real 1-rank gloo process
group, in a child process (the probe patches ``Work.wait`` at class level)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

CHILD = textwrap.dedent("""
    import json, os, sys, threading, time
    from pathlib import Path
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from lorascope.probes.collectives import CollectiveProbe
    from lorascope.probes.session import Session
    from lorascope.rundir.format.writer import Stream, ensure_manifest, stream_prefix

    run = Path(sys.argv[1])
    ensure_manifest(run)
    session = Session(Stream(stream_prefix(run, 0, "h", 1)), 0, 0, 1, 0.0)
    session.record("start", rank=0, world_size=1, local_rank=0, pid=1, host="h", argv=[], versions={}, device="cpu")
    probe = CollectiveProbe(session, stream_prefix(run, 0, "h", 1))
    probe.install(c10d)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    dist.init_process_group("gloo", rank=0, world_size=1)
    threads = set()
    end = probe._end
    def spy(started, err):
        threads.add(threading.current_thread().name)
        end(started, err)
    probe._end = spy
    out = {}

    # 1. waited: open until the wait, which ends it
    work = dist.all_reduce(torch.ones(8), async_op=True)
    time.sleep(0.05)                     # done long since: only a callback would have ended it
    out["open_before_wait"] = len(probe._open)
    before = time.time()
    work.wait()
    out["waited_at"] = before
    out["open_after_wait"] = len(probe._open)

    # 2. never waited: ended by the next flush once completed, and pending() never shows it
    works = [dist.all_reduce(torch.ones(8), async_op=True) for _ in range(20)]
    while not all(w.is_completed() for w in works):
        time.sleep(0.001)
    out["pending_after"] = probe.pending()
    # 3. flushes racing on two threads end each call once
    more = [dist.all_reduce(torch.ones(8), async_op=True) for _ in range(200)]
    while not all(w.is_completed() for w in more):
        time.sleep(0.001)
    racers = [threading.Thread(target=session.flush) for _ in range(4)]
    for r in racers: r.start()
    session.flush()
    for r in racers: r.join()
    out["open_at_end"] = len(probe._open)
    out["threads"] = sorted(threads)
    # 4. a work that is not a probed call's passes straight through the wrapper
    last = dist.all_reduce(torch.ones(8), async_op=True)
    probe._open.clear()
    last.wait()
    out["wait_wrapped"] = bool(getattr(c10d.Work.wait, "__lorascope__", False))
    session.flush()
    print(json.dumps(out))
""")


def test_host_async_calls_end_at_their_wait_or_the_next_flush(tmp_path: Path) -> None:
    from lorascope.rundir.loading.reader import load_run
    from tests.helpers import free_port

    run = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(run), str(free_port())], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "deprecated" not in done.stderr, done.stderr[-2000:]  # e.g. torch's on Work.exception()
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["open_before_wait"] == 1 and out["open_after_wait"] == 0
    assert out["pending_after"] == [] and out["open_at_end"] == 0
    assert out["wait_wrapped"]
    # Every end was taken on a thread of the job's own (main, or a flusher), none on gloo's.
    # (Python code on a thread torch started shows as a "Dummy-N" thread.)
    assert out["threads"] and not [t for t in out["threads"] if t.startswith("Dummy")], out["threads"]
    calls = load_run(run).ranks[0].collectives
    assert len(calls) == 1 + 20 + 200 + 1
    *ended, forgotten = calls
    assert forgotten.pending and forgotten.end is None  # its wait passed through: no call of the probe's
    assert all(c.end is not None and not c.pending and c.err is None for c in ended)
    assert calls[0].end >= out["waited_at"], "the waited call ended at its wait, not at completion"
    assert len({c.seq for c in calls}) == len(calls), "a call ended twice"
    records = [json.loads(line) for p in (run / "ranks" / "rank-0").glob("*.jsonl") for line in p.open()]
    assert not [r for r in records if r["k"] == "coll_err"], "no call failed"


FAILING = textwrap.dedent("""
    import datetime, json, os, sys, time
    from pathlib import Path
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from lorascope.probes.collectives import CollectiveProbe
    from lorascope.probes.session import Session
    from lorascope.rundir.format.writer import Stream, ensure_manifest, stream_prefix

    run, port, rank = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    if rank == 1:
        dist.init_process_group("gloo", rank=1, world_size=2, timeout=datetime.timedelta(seconds=20))
        deadline = time.time() + 60
        while not (run / "issued").exists() and time.time() < deadline:
            time.sleep(0.01)
        os._exit(0)  # gone once rank 0's first call is in flight: it fails ("connection closed by peer")
    ensure_manifest(run)
    session = Session(Stream(stream_prefix(run, 0, "h", 1)), 0, 0, 2, 0.0)
    session.record("start", rank=0, world_size=2, local_rank=0, pid=1, host="h", argv=[], versions={}, device="cpu")
    probe = CollectiveProbe(session, stream_prefix(run, 0, "h", 1))
    probe.install(c10d)
    dist.init_process_group("gloo", rank=0, world_size=2, timeout=datetime.timedelta(seconds=20))
    polled = dist.all_reduce(torch.ones(8), async_op=True)   # never waited: ended by a flush
    (run / "issued").touch()
    deadline = time.time() + 60
    while not polled.is_completed() and time.time() < deadline:
        time.sleep(0.01)
    session.flush()
    waited = dist.all_reduce(torch.ones(8), async_op=True)   # its wait() raises
    try:
        waited.wait()
        raised = None
    except Exception as exc:
        raised = repr(exc)
    session.flush()
    print(json.dumps({"polled_done": polled.is_completed(), "raised": raised}))
    sys.stdout.flush()
    os._exit(0)
""")


def test_a_failed_async_call_ends_with_its_error_read_without_deprecated_apis(tmp_path: Path) -> None:
    """A host async call whose peer died ends with the work's error, whether the job waits
    for it (its wait() raises) or a flush finds it completed (the error read from the
    work's future); and the job's output carries no torch deprecation warning (the
    probes once read the error with ``Work.exception()``, which prints one)."""
    from lorascope.rundir.loading.reader import load_run
    from tests.helpers import free_port

    run, port = tmp_path / "run", str(free_port())
    peer = subprocess.Popen([sys.executable, "-c", FAILING, str(run), port, "1"], stderr=subprocess.PIPE, text=True)
    done = subprocess.run(
        [sys.executable, "-c", FAILING, str(run), port, "0"], capture_output=True, text=True, timeout=180
    )
    peer.communicate(timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["polled_done"] and out["raised"], out
    calls = load_run(run).ranks[0].collectives
    assert len(calls) == 2 and all(c.end is not None for c in calls), calls
    polled, waited = calls
    assert polled.err and polled.err.startswith(("DistBackendError", "RuntimeError")), polled.err
    assert waited.err and waited.err == out["raised"][:500]
    assert "deprecated" not in done.stderr, done.stderr[-2000:]
