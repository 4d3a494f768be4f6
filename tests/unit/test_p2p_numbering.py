"""Point-to-point calls are numbered apart from the group's collectives
(lorascope/probes/collectives.py): a send pairs rank 0 with rank 1 only, so counted with
the collectives it put ranks 0 and 1 one call ahead of a rank 2 that made none, and a
healthy job read as ranks disagreeing; one in flight names its peer, and a dump's
``made`` counts the collectives only. Two real gloo
ranks, in child processes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from lorascope.detect.hang.divergence import first_divergence
from lorascope.rundir.loading.reader import load_run
from tests.helpers import free_port

CHILD = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from lorascope.probes.collectives import CollectiveProbe
    from lorascope.probes.session import Session
    from lorascope.rundir.format.writer import Stream, ensure_manifest, stream_prefix

    run, port, rank = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    ensure_manifest(run)
    prefix = stream_prefix(run, rank, "h", 100 + rank)
    session = Session(Stream(prefix), rank, rank, 2, 0.0)
    session.record("start", rank=rank, world_size=2, local_rank=rank, pid=100 + rank, host="h", argv=[],
                   versions={}, device="cpu")
    probe = CollectiveProbe(session, prefix)
    probe.install(c10d)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    t = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(t)
        if rank == 0:
            dist.send(t, dst=1)
            dist.send(t, dst=1)
        else:
            dist.recv(t, src=0)
            dist.recv(t, src=0)
    dist.barrier()
    if rank == 1:  # in flight until rank 0 sends: what a dump's pending calls say of it
        work = dist.irecv(t, 0)
        Path(sys.argv[4]).write_text(json.dumps({"pending": probe.pending(), "made": probe.made()}))
        dist.barrier()
        work.wait()
    else:
        dist.barrier()
        dist.send(t, group_dst=1)
    session.flush()
    dist.destroy_process_group()
""")


def test_sends_and_receives_do_not_advance_the_collectives_numbers(tmp_path: Path) -> None:
    run_dir, port, pending = tmp_path / "run", str(free_port()), tmp_path / "pending.json"
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(run_dir), port, str(r), str(pending)], stderr=subprocess.PIPE, text=True
        )
        for r in range(2)
    ]
    for child in children:
        _, err = child.communicate(timeout=120)
        assert child.returncode == 0, err[-2000:]
    run = load_run(run_dir)
    for n, rank in run.ranks.items():
        collectives = [(c.op, c.seq) for c in rank.collectives if c.op in ("all_reduce", "barrier")]
        assert collectives == [
            ("all_reduce", 1),
            ("all_reduce", 2),
            ("all_reduce", 3),
            ("barrier", 4),
            ("barrier", 5),
        ], n
        p2p = [c.seq for c in rank.collectives if c.op in ("send", "recv", "irecv")]
        assert p2p == [1, 2, 3, 4, 5, 6, 7], n
    assert first_divergence(run) is None
    # a receive in flight names its peer (a hang's verdict tells whom each rank waits for)
    dumped = json.loads(pending.read_text())
    (waiting,) = dumped["pending"]
    assert (waiting["op"], waiting["seq"], waiting["peer"]) == ("irecv", 7, 0)
    # the collectives made so far on each group, sends and receives apart (`hang` tells alike ranks by them)
    assert dumped["made"] == {"default_pg": 4}  # three all_reduces and a barrier
