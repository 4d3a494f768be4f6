"""A light torch.distributed job for many ranks on few cores: a 4x4 linear layer, its
gradients all-reduced by hand each step (gloo, CPU), an optimizer step. For the tests
that need 16 ranks, not a real model (probes/train_lora.py is the real job).

``--hang-rank R --hang-step S`` plants a rank-conditional hang: at step S rank R alone
runs an extra ``all_reduce`` (inside ``if rank == hang_rank:``) while the others wait in
``barrier()``; it lasts until the process-group timeout (``--pg-timeout``)::

    torchrun --nproc_per_node 16 probes/tiny_ranks.py --steps 400 --hang-rank 11 --hang-step 5
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--hang-rank", type=int, default=-1)
    p.add_argument("--hang-step", type=int, default=5)
    p.add_argument("--step-seconds", type=float, default=0.2, help="sleep per step (keeps 16 ranks light)")
    p.add_argument("--pg-timeout", type=float, default=600.0)
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank, hang_rank = dist.get_rank(), args.hang_rank
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, args.steps + 1):
        loss = model(torch.ones(2, 4)).square().mean()
        loss.backward()
        for param in model.parameters():
            dist.all_reduce(param.grad)
        optimizer.step()
        optimizer.zero_grad()
        if step == args.hang_step:
            if rank == hang_rank:
                dist.all_reduce(torch.ones(1))  # no other rank ever joins this one
            else:
                dist.barrier()
        time.sleep(args.step_seconds)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
