"""A small 2-rank gloo job for the collective paths the LoRA jobs take through libraries:
an ``async_op`` all_gather issued before the step's compute and waited for after it (as
ZeRO-3's parameter prefetch does), and a save path that calls a library's collective.
It does not import lorascope.

    torchrun --nproc_per_node 2 probes/collective_paths.py --steps 4 [--fault F]

Faults (at ``--fault-step``):
- ``save-rank0``: ``if rank == 0: lorasave.save_full(...)`` (an all_gather inside a library
  module under ``site-packages/``) while rank 1 goes on to a barrier.
- ``size-mismatch``: the ranks all_reduce tensors of different sizes (gloo aborts).
- ``async-stall``: rank 1 stalls in its own code (a stuck data loader) while rank 0 has
  issued the step's async all_gather and waits for it.
Both end when the process-group timeout (``--pg-timeout``) fires.

``--truth PREFIX`` writes, per rank, what the job itself saw to ``PREFIX.rankR`` (one
unbuffered ``os.write`` a line, so a SIGKILL loses none): the pid, then the wall time
before each collective and after it returns (``wait()`` for the async one) and after each
optimizer step. tests/e2e/test_collective_paths.py kills a rank and checks the probes'
records against it. ``--async-reduce`` makes every call async (no synchronous call
flushes the probes' queue: only their writer thread writes).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent / "site-packages"))
import lorasave


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--fault", choices=["none", "save-rank0", "async-stall", "size-mismatch"], default="none")
    parser.add_argument("--fault-step", type=int, default=3)
    parser.add_argument("--pg-timeout", type=float, default=10.0)
    parser.add_argument("--truth", help="write what the job saw to TRUTH.rankR (see above)")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="sleep this long in each step")
    parser.add_argument("--async-reduce", action="store_true", help="all_reduce with async_op=True, then wait")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    truth = os.open(f"{args.truth}.rank{rank}", os.O_WRONLY | os.O_CREAT | os.O_APPEND) if args.truth else None

    def saw(what: str) -> None:
        if truth is not None:
            os.write(truth, f"{what} {time.time():.6f}\n".encode())

    saw(f"pid {os.getpid()}")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, args.steps + 1):
        if args.fault == "async-stall" and step == args.fault_step and rank == 1:
            time.sleep(3 * args.pg_timeout)  # stuck in its own code, no collective
        gathered = torch.zeros(8 * world)
        saw("call")
        prefetch = dist.all_gather_into_tensor(gathered, torch.full((8,), float(rank)), async_op=True)
        loss = model(torch.ones(2, 8)).pow(2).mean()
        loss.backward()
        prefetch.wait()  # a rank blocked here is in the all_gather
        saw("waited")
        for p in model.parameters():
            saw("call")
            if args.async_reduce:
                dist.all_reduce(p.grad, async_op=True).wait()
                saw("waited")
            else:
                dist.all_reduce(p.grad)
                saw("returned")
        opt.step()
        saw("step")
        opt.zero_grad()
        time.sleep(args.step_seconds)
        if args.fault == "size-mismatch" and step == args.fault_step:
            dist.all_reduce(torch.ones(8 if rank == 0 else 4))  # gloo aborts the process
        if args.fault == "save-rank0" and step == args.fault_step:
            if rank == 0:
                lorasave.save_full(model.weight.detach())
            dist.barrier()
    if rank == 0:
        print(f"collective_paths: done steps={args.steps} loss={loss.item()!r}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
