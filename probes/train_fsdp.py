"""The probes/ LoRA job sharded by PyTorch FSDP instead of DeepSpeed: the test bed for
lorascope's FSDP support.

The same tiny random Llama, PEFT LoRA on every linear layer and synthetic tokens as
``train_lora.py`` (its model flags apply), trained in a plain loop with a torch AdamW over
the adapters, sharded by

- ``--fsdp 2`` (default): FSDP2, ``torch.distributed.fsdp.fully_shard`` on every decoder
  layer and on the root, ``--reshard-after-forward`` on/off, ``--mixed-precision bf16``
  (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``), ``--cpu-offload``
  (``CPUOffloadPolicy``);
- ``--fsdp 1``: FSDP1, ``FullyShardedDataParallel`` with a decoder-layer auto-wrap policy,
  ``use_orig_params=True`` (frozen base and trainable adapters share the flat parameter),
  ``--sharding FULL_SHARD|SHARD_GRAD_OP|HYBRID_SHARD|NO_SHARD`` (HYBRID_SHARD over a
  1 x world device mesh), ``--mixed-precision``, ``--cpu-offload`` (``CPUOffload``; it
  pins host memory, so CUDA only). On CPU FSDP1 needs ``device_id=cpu`` (without it, it
  looks for an accelerator and stops).

On CPU over gloo, or CUDA over NCCL. It knows nothing of lorascope::

    torchrun --nproc_per_node 2 probes/train_fsdp.py --steps 10
    torchrun --nproc_per_node 2 probes/train_fsdp.py --fsdp 1 --sharding SHARD_GRAD_OP
    torchrun --nproc_per_node 2 probes/train_fsdp.py --plant rank0-full-state-dict-save --pg-timeout 20

Output: one line from rank 0, ``train_fsdp: done steps=N final_loss=X mean_step_s=S``;
``--print-losses`` adds ``step N loss X``.

``--plant`` plants one failure mode (the job really exhibits it):
  none                        healthy.
  rank0-full-state-dict-save  at ``--plant-step`` rank 0 alone takes a full state dict
                              (``get_model_state_dict(full_state_dict=True)``, which
                              all-gathers every sharded parameter) inside ``if rank == 0:``
                              to save it; the other ranks go on to the next step: the
                              classic FSDP save hang (gloo may abort on mismatched sizes
                              instead; pass ``--pg-timeout``).
  rank0-state-dict-gather     every ``--save-every`` steps all ranks take the full state
                              dict with ``cpu_offload=True`` (only rank 0 receives it) and
                              rank 0 keeps it (a "last checkpoints" history): healthy
                              collectives, rank 0's memory grows in the save phase
                              (vocab 8192 unless given, ~4.5 MB a copy).
  reentrant-checkpoint        torch's ``apply_activation_checkpointing`` with
                              ``checkpoint_wrapper(checkpoint_impl=CheckpointImpl.REENTRANT)``
                              on every decoder layer but the last, with the base frozen and
                              no input-require-grads hook: nothing entering a checkpointed
                              layer requires grad, so its adapters silently get no gradient
                              while the last layer's train.
  logits-spike                vocab 32000 and seq 128 (unless given), the loss as
                              ``cross_entropy(logits.float(), ...)`` here.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_lora as base  # the model, data and helpers this job shares

PLANTS = ("none", "rank0-full-state-dict-save", "rank0-state-dict-gather", "reentrant-checkpoint", "logits-spike")
PLANT_PRESETS: dict[str, dict[str, float | int]] = {
    "logits-spike": {"vocab": 32000, "seq": 128},
    "rank0-state-dict-gather": {"vocab": 8192},
}
SHARDINGS = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fsdp", type=int, choices=(1, 2), default=2, help="FSDP1 or FSDP2 (fully_shard)")
    p.add_argument("--sharding", choices=SHARDINGS, default="FULL_SHARD", help="FSDP1 sharding strategy")
    p.add_argument(
        "--reshard-after-forward",
        choices=("true", "false"),
        default="true",
        help="FSDP2: free the unsharded parameters after forward",
    )
    p.add_argument("--mixed-precision", choices=("none", "bf16"), default="none")
    p.add_argument("--cpu-offload", action="store_true", help="offload the sharded parameters to CPU")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--num-samples", type=int, default=1024)
    for name in ("hidden", "intermediate", "layers", "heads", "kv-heads", "vocab", "seq"):
        p.add_argument(f"--{name}", type=int)
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--lora-dropout", type=float)
    p.add_argument("--plant", choices=PLANTS, default="none")
    p.add_argument("--plant-step", type=int, default=3, help="step of the rank-0-only save")
    p.add_argument("--save-every", type=int, default=1, help="rank0-state-dict-gather period")
    p.add_argument("--pg-timeout", type=float, help="process-group timeout, seconds")
    p.add_argument("--print-losses", action="store_true")
    p.add_argument("--verbose", action="store_true", help="keep library warnings and logs")
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, dest="local_rank")
    args = p.parse_args(argv)
    preset = PLANT_PRESETS.get(args.plant, {})
    for name, default in base.DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, preset.get(name, default))
    if args.sharding != "FULL_SHARD" and args.fsdp != 1:
        p.error("--sharding is FSDP1's (--fsdp 1); FSDP2 uses --reshard-after-forward")
    if args.fsdp == 1 and args.cpu_offload and not torch.cuda.is_available():
        p.error("--fsdp 1 --cpu-offload needs CUDA: FSDP1's CPUOffload pins host memory")
    return args


def setup_distributed(args: argparse.Namespace) -> base.Dist:
    local_rank = int(os.environ.get("LOCAL_RANK", max(args.local_rank, 0)))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    kwargs: dict[str, Any] = {}
    if args.pg_timeout is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=args.pg_timeout)
    dist.init_process_group(backend=backend, **kwargs)
    return base.Dist(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """train_lora's model (its fault switch off) with the reentrant wrappers when planted."""
    args.fault, args.engine = "none", "fsdp"
    model = base.build_model(args)
    if args.plant == "reentrant-checkpoint":
        plant_reentrant_checkpointing(model)
    return model


def decoder_layer_class() -> type[torch.nn.Module]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


def plant_reentrant_checkpointing(model: torch.nn.Module) -> None:
    """torch's checkpoint wrappers, reentrant, on every decoder layer but the last."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    last = decoder_layers(model)[-1]
    layer_cls = decoder_layer_class()
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT),
        check_fn=lambda m: isinstance(m, layer_cls) and m is not last,
    )
    base.remove_input_require_grads_hooks(model)  # whatever PEFT registered: frozen inputs


def shard_fsdp2(model: torch.nn.Module, args: argparse.Namespace, d: base.Dist) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(d.device.type, (d.world,))
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": args.reshard_after_forward == "true",
        "offload_policy": CPUOffloadPolicy(pin_memory=d.device.type == "cuda") if args.cpu_offload else OffloadPolicy(),
    }
    if args.mixed_precision == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = model.to(d.device)
    for layer in decoder_layers(model):  # a checkpoint wrapper, where planted, not the layer in it
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The PEFT model's decoder layers (or the checkpoint wrappers around them)."""
    return list(model.base_model.model.model.layers)


def shard_fsdp1(model: torch.nn.Module, args: argparse.Namespace, d: base.Dist) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    kwargs: dict[str, Any] = {}
    if args.sharding == "HYBRID_SHARD":  # replicate across "nodes", shard within one: 1 x world here
        kwargs["device_mesh"] = init_device_mesh(d.device.type, (1, d.world), mesh_dim_names=("replicate", "shard"))
    if args.mixed_precision == "bf16":
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return FSDP(
        model.to(d.device),
        auto_wrap_policy=ModuleWrapPolicy({decoder_layer_class()}),
        sharding_strategy=ShardingStrategy[args.sharding],
        cpu_offload=CPUOffload(offload_params=args.cpu_offload),
        use_orig_params=True,  # frozen base and trainable adapters in one flat parameter
        device_id=d.device,  # on CPU too: without it FSDP1 looks for an accelerator and stops
        **kwargs,
    )


def full_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The whole model's state dict, gathered to rank 0 on CPU (every rank must call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


class Plants:
    """The per-step plants; each is a no-op unless its ``--plant`` is chosen."""

    def __init__(self, args: argparse.Namespace, d: base.Dist) -> None:
        self.args, self.d = args, d
        self.saved_on_rank0: list[dict[str, Any]] = []  # rank0-state-dict-gather: never freed

    def after_step(self, step: int, model: torch.nn.Module) -> None:
        plant, rank = self.args.plant, self.d.rank
        if plant == "rank0-full-state-dict-save" and step == self.args.plant_step:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            if rank == 0:  # the bug: the other ranks never join the all-gathers of the full state dict
                state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
                del state
        elif plant == "rank0-state-dict-gather" and step % self.args.save_every == 0:
            state = full_state_dict(model)  # every rank; only rank 0 gets the tensors
            if rank == 0:
                self.saved_on_rank0.append(state)


def train(args: argparse.Namespace, d: base.Dist) -> tuple[float, float]:
    model = build_model(args)
    model = shard_fsdp2(model, args, d) if args.fsdp == 2 else shard_fsdp1(model, args, d)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    plants = Plants(args, d)
    data = base.batches(args, d)
    loss_value, step_times = float("nan"), []
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        input_ids = next(data)
        loss = base.compute_loss(model, input_ids, explicit_upcast=args.plant == "logits-spike")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        plants.after_step(step, model)
        loss_value = loss.item()
        step_times.append(time.perf_counter() - start)
        if args.print_losses and d.rank == 0:
            print(f"step {step} loss {loss_value!r}", flush=True)
    timed = step_times[2:] if len(step_times) > 4 else step_times
    return loss_value, sum(timed) / max(len(timed), 1)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.verbose:
        base.quiet_libraries()
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    d = setup_distributed(args)
    final_loss, step_s = train(args, d)
    if d.rank == 0:
        print(f"train_fsdp: done steps={args.steps} final_loss={final_loss!r} mean_step_s={step_s:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    base.lone_process_defaults()
    main()
