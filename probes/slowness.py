"""The real LoRA job (``train_lora.py``'s model, data and engines) with one rank made slow
in one part of its step, from one step on: the plantings ``slow-steps``' what-if is
checked against (``benchmarks/slow_steps_check.py`` runs each planted, then without the
planting, and compares the step time predicted with the one measured).

Every flag of ``train_lora.py`` applies; these add the slowness:

  --slow-rank R      the rank made slow, or ranks "2,3" (-1: none, the run "after the fix")
  --slow-ms MS       CPU work (a busy loop, not a sleep) added per step
  --slow-from S      the first step it is added to (1: the whole run)
  --slow-steps A-B,C-D
                     only in these steps (a slowdown that comes and goes; overrides --slow-from)
  --slow-where W     data: while fetching the batch (data preparation); forward: in a
                     forward pre-hook of the model (compute inside the forward phase;
                     a pre-hook of DeepSpeed's engine would run before the phase begins)
  --pin              pin rank r to core r % cores (what a CPU hog "on its core" needs)
  --partition        ZeRO-3 partitions every parameter (``stage3_param_persistence_threshold``
                     0), as a real model's are: the forward and backward gather them
                     through async all-gathers waited on by handle (this tiny model's
                     are otherwise kept whole, and gathered only after each optimizer step)

    torchrun --nproc_per_node 3 probes/slowness.py --steps 40 --slow-rank 1 --slow-ms 250 --slow-from 20
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_lora as base  # the job this one varies


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--slow-rank", type=lambda v: {int(r) for r in v.split(",")}, default={-1})
    p.add_argument("--slow-ms", type=float, default=250.0)
    p.add_argument("--slow-from", type=int, default=1)
    p.add_argument("--slow-steps", type=steps_of, default=None)
    p.add_argument("--slow-where", choices=("data", "forward"), default="data")
    p.add_argument("--pin", action="store_true")
    p.add_argument("--partition", action="store_true")
    own, rest = p.parse_known_args(argv)
    args = base.parse_args(rest)
    for key, value in vars(own).items():
        setattr(args, key, value)
    return args


def steps_of(spec: str) -> set[int]:
    """ "10-17,26-33" -> those steps."""
    out: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return out


def slow_at(args: argparse.Namespace, step: int) -> bool:
    return step in args.slow_steps if args.slow_steps is not None else step >= args.slow_from


def busy(ms: float) -> None:
    """CPU work, not a sleep: a slower rank computes, it does not idle."""
    end = time.perf_counter() + ms / 1000
    x = 0
    while time.perf_counter() < end:
        x += sum(range(1000))


def train(args: argparse.Namespace, d: base.Dist) -> float:
    model = base.build_model(args)
    trainer = base.deepspeed_trainer(model, args) if args.engine == "deepspeed" else base.torch_trainer(model, args, d)
    trainer.model.train()
    slow = d.rank in args.slow_rank
    state = {"step": 0}
    if slow and args.slow_where == "forward":

        def pre_hook(module: torch.nn.Module, inputs: object) -> None:
            if slow_at(args, state["step"]) and module.training:
                busy(args.slow_ms)

        # on the model itself, not DeepSpeed's engine: its pre-hooks run before the forward phase begins
        getattr(trainer.model, "module", trainer.model).register_forward_pre_hook(pre_hook)
    data = base.batches(args, d)
    loss_value = float("nan")
    for step in range(1, args.steps + 1):
        state["step"] = step
        if slow and args.slow_where == "data" and slow_at(args, step):
            busy(args.slow_ms)  # the batch's preparation, on this rank only
        batch = next(data)
        loss = base.compute_loss(trainer.model, batch, explicit_upcast=False)
        trainer.backward_and_step(loss)
        loss_value = loss.item()
    return loss_value


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.verbose:
        base.quiet_libraries()
    d = base.setup_distributed(args)
    if args.pin and hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[d.rank % len(cores)]})
        torch.set_num_threads(1)
    if args.partition:
        base.zero_extra = lambda _: {"stage3_param_persistence_threshold": 0}
    final_loss = train(args, d)
    if d.rank == 0:
        print(f"slowness: done steps={args.steps} final_loss={final_loss!r}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
