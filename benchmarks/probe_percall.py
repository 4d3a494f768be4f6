#!/usr/bin/env python3
"""What one collective call costs the calling thread when it is probed (a script, not a test).

``probe_overhead.py`` and ``probe_costs.py`` measure the probes inside the real job, where a
pair of runs swings by tens of percent on a small shared machine. This one isolates the
probe's own work per call: the collective probe wraps a stand-in for
``torch.distributed.all_reduce`` that does nothing and returns a real, completed gloo work
(1-rank process group), called from below ``--depth`` frames the probe counts as library
frames (as DeepSpeed's are in the job), so that the call-site walk, the record (written
into the call file; in a checkout before it, queued and flushed before a synchronous call,
with ``--queued`` records waiting for the writer, as in the job) and, for an async call,
the tracking of its work and the end in its ``wait()`` are all in the figure, and the
collective itself and the writer's work are not. It prints, for synchronous and async calls, the bare and the
probed microseconds per call (the minimum over ``--reps`` repetitions of ``--calls`` calls)
and their difference: resolves ~1 us where the job-level runs resolve ~5 points.

    python benchmarks/probe_percall.py [--calls 2000] [--reps 9] [--depth 14] [--queued 25] [--src OTHER_CHECKOUT]

Run it alternately against two checkouts (``--src``) to compare them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent("""
    import json, os, sys, tempfile, time
    from pathlib import Path
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from lorascope.probes.collectives import CollectiveProbe
    from lorascope.probes.session import Session
    from lorascope.rundir.format.writer import Stream, ensure_manifest, stream_prefix

    calls, reps, depth, port, queued = (int(a) for a in sys.argv[1:6])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    done = dist.all_reduce(torch.ones(2), async_op=True)
    done.wait()
    payload = torch.ones(8)

    def all_reduce(tensor, op=None, group=None, async_op=False):
        return done if async_op else None

    run = Path(tempfile.mkdtemp(prefix="lorascope-percall-"))
    ensure_manifest(run)
    prefix = stream_prefix(run, 0, "h", 1)
    session = Session(Stream(prefix), 0, 0, 1, 0.0)
    try:
        probe = CollectiveProbe(session, prefix)
    except TypeError:  # a checkout before the call file (--src)
        probe = CollectiveProbe(session)
    probe.install(c10d)  # Work.wait, wrapped at class level: the async call ends in done.wait()
    probed = probe._wrap("all_reduce", all_reduce)

    def below(k, fn, is_async):
        if k:
            return below(k - 1, fn, is_async)
        return fn(payload, async_op=is_async)

    for code in (below.__code__, all_reduce.__code__):  # library frames to the probe
        probe._internal[id(code)] = True
        probe._kept[id(code)] = code

    def loop(fn, is_async):
        # Seconds in the calls (and their waits). Not counted: the `queued` records put on
        # the queue before each synchronous call (what the job's writer has not written yet
        # when the call comes), and the writer's work, done here between calls (there is no
        # writer thread): after every synchronous call, as the woken writer does, else
        # every 64 calls.
        stream, spent = session.stream, 0.0
        for i in range(calls):
            if not is_async:
                for n in range(queued):
                    stream.append({"k": "phase", "name": "forward", "edge": "begin", "step": n, "t": 0.0})
            began = time.perf_counter()
            below(depth, fn, is_async)
            if is_async:
                done.wait()
            spent += time.perf_counter() - began
            if not is_async or i % 64 == 63:
                stream.flush()
        return spent

    out = {}
    for name, fn in (("bare", all_reduce), ("probed", probed)):
        for is_async in (False, True):
            best = float("inf")
            for _ in range(reps):
                best = min(best, loop(fn, is_async) / calls * 1e6)
            out[f"{name} {'async' if is_async else 'sync'}"] = best
    session.stream.close()
    print(json.dumps(out))
""")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--depth", type=int, default=14, help="library frames below the caller")
    p.add_argument("--port", type=int, default=29690)
    p.add_argument(
        "--queued",
        type=int,
        default=25,
        help="records queued before each synchronous call (the ZeRO-3 CPU job's ~25: half a writer tick's)",
    )
    p.add_argument("--src", type=Path, help="import lorascope from this checkout (a before)")
    args = p.parse_args()
    env = {**os.environ, "PYTHONPATH": str((args.src or REPO).resolve())}
    cmd = [sys.executable, "-c", CHILD, *(str(v) for v in (args.calls, args.reps, args.depth, args.port, args.queued))]
    # not the repository: `-c` puts the working directory first on sys.path, before --src
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        return 1
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"per call, {args.depth} library frames below the caller (min of {args.reps} x {args.calls}):")
    for kind in ("sync", "async"):
        bare, probed = got[f"bare {kind}"], got[f"probed {kind}"]
        label = "synchronous" if kind == "sync" else "async + wait"
        print(f"  {label:13s} bare {bare:6.1f} us  probed {probed:6.1f} us  probe's cost {probed - bare:6.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
