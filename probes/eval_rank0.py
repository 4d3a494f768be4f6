"""probes/train_lora.py's model and engines with an evaluation on rank 0 only: every
``--eval-every`` steps rank 0 alone takes a validation loss (a forward under
``torch.no_grad``) inside ``if step % args.eval_every == 0 and d.rank == 0:``. Under
ZeRO-3 with partitioned parameters (``--hidden 512 --intermediate 1024``: above DeepSpeed's
persistence threshold) the forward gathers parameters: rank 0's gathers pair with the
other ranks' next training gathers, the ops part in their backward, and the job hangs::

    torchrun --nproc_per_node 2 probes/eval_rank0.py --hidden 512 --intermediate 1024 --eval-every 4

With a smaller model the parameters stay whole on every rank: no collective, no hang.
(A file of its own: train_lora.py's line numbers are what recorded runs point into.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_lora


def validation_loss(model: torch.nn.Module, input_ids: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        loss = train_lora.compute_loss(model, input_ids, explicit_upcast=False)
    model.train()
    return float(loss.item())


def main(argv: list[str] | None = None) -> None:
    args = train_lora.parse_args(argv)
    train_lora.quiet_libraries()
    d = train_lora.setup_distributed(args)
    trainer = train_lora.deepspeed_trainer(train_lora.build_model(args), args)
    trainer.model.train()
    data = train_lora.batches(args, d)
    held_out = next(data)
    for step in range(1, args.steps + 1):
        loss = train_lora.compute_loss(trainer.model, next(data), explicit_upcast=False)
        trainer.backward_and_step(loss)
        if step % args.eval_every == 0 and d.rank == 0:
            print(f"eval_rank0: step {step} validation loss {validation_loss(trainer.model, held_out)}", flush=True)
    print(f"eval_rank0: rank {d.rank} done steps={args.steps}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    train_lora.lone_process_defaults()
    main()
