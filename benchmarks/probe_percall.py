#!/usr/bin/env python3
"""What one collective call costs the calling thread when it is probed (a script, not a test).

``probe_overhead.py`` and ``probe_costs.py`` measure the probes inside the real job, where a
pair of runs swings by tens of percent on a small shared machine. This one isolates the
probe's own work per call: the collective probe wraps a stand-in for
``torch.distributed.all_reduce`` that does nothing and returns a real, completed gloo work
(1-rank process group), called from below ``--depth`` frames the probe counts as library
frames (as DeepSpeed's are in the job), so that the call-site walk, the record, the queue,
the flush before a synchronous call (format and one ``os.write``) and, for an async call,
the tracking of its work and the end in its ``wait()`` are all in the figure, and the
collective itself is not. It prints, for synchronous and async calls, the bare and the
probed microseconds per call (the minimum over ``--reps`` repetitions of ``--calls`` calls)
and their difference: resolves ~1 us where the job-level runs resolve ~5 points.

    python benchmarks/probe_percall.py [--calls 2000] [--reps 9] [--depth 14] [--src OTHER_CHECKOUT]

Run it alternately against two checkouts (``--src``) to compare them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
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
    from lorascope.rundir.writer import Stream, ensure_manifest, stream_prefix

    calls, reps, depth, port = (int(a) for a in sys.argv[1:5])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    done = dist.all_reduce(torch.ones(2), async_op=True)
    done.wait()
    payload = torch.ones(8)

    def all_reduce(tensor, op=None, group=None, async_op=False):
        return done if async_op else None

    run = Path(tempfile.mkdtemp(prefix="lorascope-percall-"))
    ensure_manifest(run)
    session = Session(Stream(stream_prefix(run, 0, "h", 1)), 0, 0, 1, 0.0)
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
        queue = session.stream._queue
        for _ in range(calls):
            below(depth, fn, is_async)
            if is_async:
                done.wait()
            if len(queue) > 10000:  # no writer thread here: keep the queue small
                queue.clear()

    out = {}
    for name, fn in (("bare", all_reduce), ("probed", probed)):
        for is_async in (False, True):
            best = float("inf")
            for _ in range(reps):
                start = time.perf_counter()
                loop(fn, is_async)
                best = min(best, (time.perf_counter() - start) / calls * 1e6)
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
    p.add_argument("--src", type=Path, help="import lorascope from this checkout (a before)")
    args = p.parse_args()
    env = {**os.environ, "PYTHONPATH": str((args.src or REPO).resolve())}
    cmd = [sys.executable, "-c", CHILD, str(args.calls), str(args.reps), str(args.depth), str(args.port)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
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
