"""probes/train_lora.py's model and engines in a loop over uneven data shards: each rank
trains on ``data[rank::world]`` until its shard runs out, then waits in a barrier. With
``--num-samples`` not a multiple of ``world x --micro-batch`` the first ranks' shards are
a batch longer: they go on into another step while the others wait in the barrier after
their loop, and the job hangs. No rank condition encloses either call::

    torchrun --nproc_per_node 2 probes/uneven_shards.py --num-samples 41 --micro-batch 4
    torchrun --nproc_per_node 2 probes/uneven_shards.py --num-samples 41 --engine torch

(A file of its own: train_lora.py's line numbers are what recorded runs point into.)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_lora


def shard(args: argparse.Namespace, d: train_lora.Dist) -> Iterator[torch.Tensor]:
    """This rank's micro-batches: every world-th sample from its rank on, once (the last
    batch short when the shard is not a multiple of the micro-batch)."""
    mine = train_lora.synthetic_tokens(args.num_samples, args, args.seed)[d.rank :: d.world]
    for i in range(0, len(mine), args.micro_batch):
        yield mine[i : i + args.micro_batch].to(d.device)


def main(argv: list[str] | None = None) -> None:
    args = train_lora.parse_args(argv)
    train_lora.quiet_libraries()
    d = train_lora.setup_distributed(args)
    model = train_lora.build_model(args)
    trainer = (
        train_lora.deepspeed_trainer(model, args)
        if args.engine == "deepspeed"
        else train_lora.torch_trainer(model, args, d)
    )
    trainer.model.train()
    steps = 0
    for input_ids in shard(args, d):
        loss = train_lora.compute_loss(trainer.model, input_ids, explicit_upcast=False)
        trainer.backward_and_step(loss)
        steps += 1
    print(f"uneven_shards: rank {d.rank} done steps={steps}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    train_lora.lone_process_defaults()
    main()
