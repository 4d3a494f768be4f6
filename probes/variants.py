"""Scenarios the detectors were not developed on: other eval, save and per-rank code
around the same real LoRA job (``train_lora.py``'s model, data and engines).

Every flag of ``train_lora.py`` applies (model shape, engine, ZeRO stage ...); ``--variant``
adds the code that differs. Like ``train_lora.py`` it knows nothing of lorascope.

    torchrun --nproc_per_node 2 probes/variants.py --variant eval-metrics --steps 12

Variants:
  eval-allreduce     every ``--eval-every`` steps every rank evaluates a batch and the
                     ranks all_reduce the mean loss (healthy: nothing is kept).
  save-rank0-file    every ``--eval-every`` steps rank 0 writes the adapters' state dict
                     to a temporary file, the others go on (healthy under DDP and ZeRO
                     0-2; under ZeRO-3 use GatheredParameters on every rank).
  eval-metrics       every ``--eval-every`` steps every rank evaluates a batch; the
                     predictions are gathered with ``all_gather_object`` and rank 0 keeps
                     them in a metrics history (a compute_metrics that keeps the logits):
                     rank 0's memory grows in the eval phase.
  save-rank0-keep    rank 0 serialises the model's state dict every step into an
                     in-memory buffer it keeps (a "last checkpoints" list that never
                     shrinks; DDP): rank 0's memory grows outside any engine phase.
  straggler          rank 1 does ``--straggle-ms`` of extra CPU work before every step
                     (an uneven data shard or a slower host): the other ranks wait for it
                     at every collective.
  log-broadcast-hang at ``--fault-step`` rank 0 broadcasts its log line with
                     ``broadcast_object_list`` inside ``if dist.get_rank() == 0:`` (a
                     logging helper); the other ranks are in the next step's collectives.
"""

from __future__ import annotations

import io
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_lora as base  # the job this one varies

VARIANTS = ("eval-allreduce", "save-rank0-file", "eval-metrics", "save-rank0-keep", "straggler", "log-broadcast-hang")


def parse_args(argv: list[str] | None = None):  # type: ignore[no-untyped-def]
    args, rest = _own_args(argv)
    parsed = base.parse_args(rest)
    parsed.variant, parsed.straggle_ms = args.variant, args.straggle_ms
    return parsed


def _own_args(argv: list[str] | None):  # type: ignore[no-untyped-def]
    import argparse

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--variant", choices=VARIANTS, required=True)
    p.add_argument("--straggle-ms", type=float, default=150.0)
    return p.parse_known_args(argv)


def busy(ms: float) -> None:
    """CPU work, not a sleep: a slower rank computes, it does not idle."""
    end = time.perf_counter() + ms / 1000
    x = 0
    while time.perf_counter() < end:
        x += sum(range(1000))


def evaluate(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return base.eval_forward(model, ids)


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def log_on_rank0(line: str) -> None:
    """The bug: a logging helper that broadcasts from inside a rank condition."""
    if dist.get_rank() == 0:
        dist.broadcast_object_list([line], src=0)


class Variant:
    def __init__(self, args, d: base.Dist) -> None:  # type: ignore[no-untyped-def]
        self.args, self.d = args, d
        self.history: list[object] = []  # what rank 0 keeps
        self.eval_ids = base.synthetic_tokens(args.eval_batch, args, args.seed + 1).to(d.device)

    def before_step(self, step: int, model: torch.nn.Module) -> None:
        v = self.args.variant
        if v == "straggler" and self.d.rank == 1:
            busy(self.args.straggle_ms)
        if v == "log-broadcast-hang" and step == self.args.fault_step:
            log_on_rank0(f"step {step}")

    def after_step(self, step: int, model: torch.nn.Module) -> None:
        v, every = self.args.variant, self.args.eval_every
        if v == "eval-allreduce" and step % every == 0:
            logits = evaluate(model, self.eval_ids)
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.size(-1)), self.eval_ids[:, 1:].reshape(-1)
            )
            dist.all_reduce(loss)
            del logits
        elif v == "eval-metrics" and step % every == 0:
            logits = evaluate(model, self.eval_ids)
            gathered: list[object] = [None] * self.d.world
            dist.all_gather_object(gathered, logits)
            if self.d.rank == 0:
                self.history.append(gathered)
        elif v == "save-rank0-file" and step % every == 0 and self.d.rank == 0:
            with tempfile.TemporaryDirectory() as tmp:
                torch.save(adapter_state(model), os.path.join(tmp, "adapters.pt"))
        elif v == "save-rank0-keep" and self.d.rank == 0:
            buffer = io.BytesIO()
            torch.save(model.state_dict(), buffer)  # the whole model (DDP: unsharded)
            self.history.append(buffer)


def train(args, d: base.Dist) -> float:  # type: ignore[no-untyped-def]
    model = base.build_model(args)
    trainer = base.deepspeed_trainer(model, args) if args.engine == "deepspeed" else base.torch_trainer(model, args, d)
    trainer.model.train()
    variant = Variant(args, d)
    data = base.batches(args, d)
    loss_value = float("nan")
    for step in range(1, args.steps + 1):
        variant.before_step(step, trainer.model)
        loss = base.compute_loss(trainer.model, next(data), explicit_upcast=False)
        trainer.backward_and_step(loss)
        variant.after_step(step, trainer.model)
        loss_value = loss.item()
    return loss_value


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.verbose:
        base.quiet_libraries()
    d = base.setup_distributed(args)
    final_loss = train(args, d)
    if d.rank == 0:
        print(f"variants: done variant={args.variant} steps={args.steps} final_loss={final_loss!r}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
