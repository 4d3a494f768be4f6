"""A real distributed LoRA fine-tuning job: the test bed for lorascope.

A tiny, randomly initialised Llama (transformers ``LlamaConfig``; no download, no
tokenizer) gets PEFT LoRA adapters on all its linear layers and is trained on a
synthetic, deterministic token dataset behind a ``DistributedSampler``. The job knows
nothing of lorascope: the profiler attaches from outside (``lorascope run -- ...``).

Launch (CPU over gloo, or CUDA over NCCL, unchanged)::

    torchrun --nproc_per_node 2 probes/train_lora.py --steps 20
    OMP_NUM_THREADS=1 deepspeed --num_gpus 2 probes/train_lora.py --steps 20
    torchrun --nproc_per_node 2 probes/train_lora.py --engine torch   # DDP, no DeepSpeed

Engines:
  deepspeed (default)  ``deepspeed.initialize`` with ZeRO stage ``--zero`` (0-3) and a
                       torch AdamW over the adapter parameters.
  torch                the same model in a plain loop under DistributedDataParallel.

Output: nothing but one line from rank 0, ``train_lora: done steps=N final_loss=X
mean_step_s=S`` (rank 0's local loss). ``--print-losses`` adds ``step N loss X`` per step
on rank 0, with ``repr`` of the float so that runs compare exactly: the same seed gives
the same losses run to run.

``--fault`` plants one failure mode (the job really exhibits it; detecting it is the
profiler's business):
  none                    healthy run.
  rank0-asymmetry-eval    every ``--eval-every`` steps all ranks run an eval forward
                          (under ZeRO-3 a forward needs every rank), but only rank 0
                          keeps the logits, so rank 0's memory grows.
  rank0-asymmetry-gather  every step all ranks ``gather`` a tensor to rank 0, which
                          keeps what it received.
  logits-spike            vocab 32000 and seq 128 (unless given) with the loss computed
                          here as ``cross_entropy(logits.float(), ...)``: the B*T*V
                          logits and their fp32 copy dominate memory.
  logits-spike-internal   the same sizes, the loss computed inside the model
                          (``labels=``; transformers upcasts the logits to fp32 there).
  reentrant-dead-grads    gradient checkpointing with ``use_reentrant=True`` and the
                          input-require-grads hooks removed: no activation entering a
                          checkpointed layer requires grad, so the adapters get none
                          and backward fails (the job crashes: that is the fault).
  reentrant-partial       the same, but the last layer is not checkpointed: the job
                          trains, and the adapters of every other layer silently get
                          no gradient.
  rank-conditional-hang   at ``--fault-step`` rank 0 runs an extra ``all_reduce`` inside
                          ``if rank == 0:`` while the other ranks wait in ``barrier()``:
                          a true hang until the process-group timeout (``--pg-timeout``).
  crossed-groups-hang     at ``--fault-step`` rank 0 all_reduces over a second process
                          group, then waits in ``barrier()``; the other ranks wait in
                          ``barrier()`` first: each waits for the other in a collective
                          the other never issued (no group's own calls disagree).
  rank-conditional-gather at ``--fault-step`` rank 0 alone gathers the ZeRO-3
                          partitioned adapters to save them (``GatheredParameters``
                          inside ``if rank == 0:``); the others go on to the next step.
  tiny-kernel-tail        preset: many layers, small hidden, ``lora_dropout`` 0.1, so a
                          step is many tiny LoRA ops.
  rank1-stall             at ``--fault-step`` rank 1 sleeps ``--stall-seconds`` while
                          fetching its batch (no collective in flight); rank 0 goes on
                          into the next collective and waits there.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import itertools
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

FAULTS = (
    "none",
    "rank0-asymmetry-eval",
    "rank0-asymmetry-gather",
    "logits-spike",
    "reentrant-dead-grads",
    "reentrant-partial",
    "rank-conditional-hang",
    "crossed-groups-hang",
    "rank-conditional-gather",
    "logits-spike-internal",
    "tiny-kernel-tail",
    "rank1-stall",
)

# Model/LoRA settings a fault switch changes unless the flag was given explicitly.
FAULT_PRESETS: dict[str, dict[str, float | int]] = {
    "logits-spike": {"vocab": 32000, "seq": 128},
    "logits-spike-internal": {"vocab": 32000, "seq": 128},
    "tiny-kernel-tail": {"layers": 12, "hidden": 32, "intermediate": 64, "lora_dropout": 0.1},
}
DEFAULTS: dict[str, float | int] = {
    "hidden": 64,
    "intermediate": 128,
    "layers": 2,
    "heads": 4,
    "kv_heads": 2,
    "vocab": 512,
    "seq": 32,
    "lora_dropout": 0.0,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=("deepspeed", "torch"), default="deepspeed")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=3, help="ZeRO stage")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--num-samples", type=int, default=1024,
                   help="dataset size; fixed so that a shorter run replays a longer one's first steps")
    # None = the default, or the fault preset's value (see FAULT_PRESETS).
    p.add_argument("--hidden", type=int)
    p.add_argument("--intermediate", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--lora-dropout", type=float)
    p.add_argument("--fault", choices=FAULTS, default="none")
    p.add_argument("--fault-step", type=int, default=5, help="step of the hang / stall")
    p.add_argument("--stall-seconds", type=float, default=3600.0)
    p.add_argument("--eval-every", type=int, default=2, help="rank0-asymmetry-eval period")
    p.add_argument("--eval-batch", type=int, default=64, help="rank0-asymmetry-eval batch")
    p.add_argument("--gather-numel", type=int, default=1 << 18, help="rank0-asymmetry-gather")
    p.add_argument("--pg-timeout", type=float, help="process-group timeout, seconds")
    p.add_argument("--print-losses", action="store_true")
    p.add_argument("--verbose", action="store_true", help="keep library warnings and logs")
    # The deepspeed launcher passes --local_rank=N; LOCAL_RANK in the environment wins.
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, dest="local_rank")
    args = p.parse_args(argv)
    preset = FAULT_PRESETS.get(args.fault, {})
    for name, default in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, preset.get(name, default))
    return args


def quiet_libraries() -> None:
    """Silence the deprecation/info chatter of transformers, PEFT, DeepSpeed and torch.

    Only the deprecation categories are filtered, never UserWarning: the reentrant
    fault's "None of the inputs have requires_grad=True" warning must show.
    Must run before deepspeed is imported (it logs its accelerator choice on import),
    which is why deepspeed, transformers and peft are imported inside functions.
    """
    # All that a healthy run emits here: FutureWarnings from transformers
    # (`is_gradient_checkpointing`) and torch c10d (`all_gather_into_tensor`,
    # `reduce_scatter_tensor`, called by DeepSpeed), and DeepSpeed's logger.
    for category in (DeprecationWarning, FutureWarning, PendingDeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    # DeepSpeed's logger resets its level when created, but keeps a filter added first.
    logging.getLogger("DeepSpeed").addFilter(lambda record: record.levelno >= logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


@dataclass
class Dist:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str


def setup_distributed(args: argparse.Namespace) -> Dist:
    """Pick the device (cuda:LOCAL_RANK set *before* init) and join the process group."""
    local_rank = int(os.environ.get("LOCAL_RANK", max(args.local_rank, 0)))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    kwargs = {}
    if args.pg_timeout is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=args.pg_timeout)
    if args.engine == "deepspeed":
        import deepspeed

        # On CPU it print()s "... shm_comm_op built successfully" once per rank.
        with contextlib.redirect_stdout(io.StringIO()) if not args.verbose else contextlib.nullcontext():
            deepspeed.init_distributed(dist_backend=backend, **kwargs)
    else:
        dist.init_process_group(backend=backend, **kwargs)
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """A random-initialised Llama with LoRA on every linear layer (lm_head excluded)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)  # identical weights and adapters on every rank
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.seq, 64),
        tie_word_embeddings=False,
        use_cache=False,
    )
    model = LlamaForCausalLM(config)
    reentrant = args.fault in ("reentrant-dead-grads", "reentrant-partial")
    if reentrant:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    if args.fault == "reentrant-partial":
        # The last layer runs without checkpointing: its adapters still learn, the loss
        # requires grad and backward succeeds, while every checkpointed layer's adapters
        # silently get no gradient.
        model.model.layers[-1].gradient_checkpointing = False
    lora = LoraConfig(
        r=args.lora_r,
        lora_alpha=2 * args.lora_r,
        lora_dropout=args.lora_dropout,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)
    if reentrant:
        removed = remove_input_require_grads_hooks(model)
        assert removed > 0, "no input-require-grads hook found: the fault would not be planted"
    if args.engine == "torch" and args.dtype == "bf16":
        model = model.to(torch.bfloat16)
    return model


def remove_input_require_grads_hooks(model: torch.nn.Module) -> int:
    """Remove every forward hook that makes the embedding output require grad.

    transformers' ``gradient_checkpointing_enable`` and PEFT's ``get_peft_model`` each
    register one (``make_inputs_require_grads`` / ``make_inputs_require_grad``), and
    each registration overwrites the handle the previous one stored, so
    ``disable_input_require_grads()`` alone leaves the first hook in place. Match them
    by function name on the embedding module instead. Returns how many were removed.
    """
    embeddings = model.get_input_embeddings()
    doomed = [
        key
        for key, hook in embeddings._forward_hooks.items()
        if getattr(hook, "__name__", "").startswith("make_inputs_require_grad")
    ]
    for key in doomed:
        del embeddings._forward_hooks[key]
    for module in model.modules():  # drop the now-dead handles too
        if hasattr(module, "_require_grads_hooks"):
            module._require_grads_hooks = []
    return len(doomed)


def synthetic_tokens(n: int, args: argparse.Namespace, seed: int) -> torch.Tensor:
    """``n`` learnable sequences: arithmetic progressions mod vocab, random start/stride."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, args.vocab, (n, 1), generator=g)
    stride = torch.randint(1, 8, (n, 1), generator=g)
    return (start + stride * torch.arange(args.seq)) % args.vocab


def batches(args: argparse.Namespace, d: Dist) -> Iterator[torch.Tensor]:
    """This rank's micro-batches for ``args.steps`` steps, re-shuffled each epoch."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    data = TensorDataset(synthetic_tokens(args.num_samples, args, args.seed))
    sampler = DistributedSampler(data, num_replicas=d.world, rank=d.rank, shuffle=True,
                                 seed=args.seed, drop_last=True)
    loader = DataLoader(data, batch_size=args.micro_batch, sampler=sampler, drop_last=True)
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        for (input_ids,) in loader:
            yield input_ids.to(d.device)


@dataclass
class Trainer:
    """What the loop needs from an engine: a forward callable and an optimiser step."""

    model: torch.nn.Module
    backward_and_step: Callable[[torch.Tensor], None]


def zero_extra(args: argparse.Namespace) -> dict[str, int]:
    """ZeRO-3 keeps parameters under 1e5 elements whole on every rank: all of this tiny
    model's. The save planting partitions them, as a real model's would be, so that
    gathering them takes collectives."""
    return {"stage3_param_persistence_threshold": 0} if args.fault == "rank-conditional-gather" else {}


def deepspeed_trainer(model: torch.nn.Module, args: argparse.Namespace) -> Trainer:
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": args.zero, **zero_extra(args)},
        "bf16": {"enabled": args.dtype == "bf16"},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    def backward_and_step(loss: torch.Tensor) -> None:
        engine.backward(loss)
        engine.step()

    return Trainer(engine, backward_and_step)


def torch_trainer(model: torch.nn.Module, args: argparse.Namespace, d: Dist) -> Trainer:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = model.to(d.device)
    ddp = DDP(model, device_ids=[d.local_rank] if d.device.type == "cuda" else None)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)

    def backward_and_step(loss: torch.Tensor) -> None:
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Trainer(ddp, backward_and_step)


def compute_loss(model: torch.nn.Module, input_ids: torch.Tensor, explicit_upcast: bool) -> torch.Tensor:
    """Causal LM loss (labels = input_ids).

    With ``explicit_upcast`` (logits-spike) the loss is computed here, the way many
    training scripts do it, so the logits and their fp32 copy both exist at once.
    """
    if not explicit_upcast:
        return model(input_ids=input_ids, labels=input_ids).loss
    logits = model(input_ids=input_ids).logits
    shifted = logits[:, :-1, :].float()
    return torch.nn.functional.cross_entropy(
        shifted.reshape(-1, shifted.size(-1)), input_ids[:, 1:].reshape(-1)
    )


class Faults:
    """The per-step fault plants; each is a no-op unless its ``--fault`` is chosen."""

    def __init__(self, args: argparse.Namespace, d: Dist) -> None:
        self.args, self.d = args, d
        self.kept_on_rank0: list[torch.Tensor] = []  # rank0-asymmetry: never freed
        self.eval_ids = synthetic_tokens(args.eval_batch, args, args.seed + 1).to(d.device)
        # crossed-groups-hang's second group, made by every rank (new_group is collective)
        self.group = dist.new_group(backend="gloo") if args.fault == "crossed-groups-hang" else None

    def before_step(self, step: int, model: torch.nn.Module) -> None:
        if step != self.args.fault_step:
            return
        if self.args.fault == "rank-conditional-hang":
            rank_conditional_collective(self.d)
        elif self.group is not None:
            crossed_group_collectives(self.d, self.group)
        elif self.args.fault == "rank-conditional-gather":
            save_adapters_on_rank0(model, self.d)

    def fetch(self, it: Iterator[torch.Tensor], step: int) -> torch.Tensor:
        if self.args.fault == "rank1-stall" and step == self.args.fault_step and self.d.rank == 1:
            time.sleep(self.args.stall_seconds)  # a data-loader stall: no collective in flight
        return next(it)

    def after_step(self, step: int, model: torch.nn.Module) -> None:
        fault = self.args.fault
        if fault == "rank0-asymmetry-eval" and step % self.args.eval_every == 0:
            logits = eval_forward(model, self.eval_ids)  # on every rank (ZeRO-3 needs it)
            if self.d.rank == 0:
                self.kept_on_rank0.append(logits)
        elif fault == "rank0-asymmetry-gather":
            self.kept_on_rank0.extend(gather_to_rank0(self.args.gather_numel, step, self.d))


def rank_conditional_collective(d: Dist) -> None:
    """The bug: a collective only rank 0 runs, while the others wait somewhere else."""
    if d.rank == 0:
        flag = torch.ones(1, dtype=torch.float32, device=d.device)
        dist.all_reduce(flag)  # no other rank ever joins this one
    else:
        dist.barrier()


def crossed_group_collectives(d: Dist, group: dist.ProcessGroup) -> None:
    """The bug: two groups' collectives in different orders on different ranks. Rank 0
    reduces over the second group, then syncs the default one; the others sync first:
    each waits for the other in a collective the other never issued."""
    flag = torch.ones(1, dtype=torch.float32, device=d.device)
    if d.rank == 0:
        dist.all_reduce(flag, group=group)
        dist.barrier()
    else:
        dist.barrier()
        dist.all_reduce(flag, group=group)


def save_adapters_on_rank0(model: torch.nn.Module, d: Dist) -> None:
    """The bug: gathering ZeRO-3-partitioned adapters to save them, on rank 0 only.
    GatheredParameters all_gathers the partitions: the other ranks never join."""
    import deepspeed

    adapters = [p for name, p in model.named_parameters() if "lora_" in name]
    if d.rank == 0:
        with deepspeed.zero.GatheredParameters(adapters):
            state = {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}
        del state


def eval_forward(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    model.train()
    return logits


def gather_to_rank0(numel: int, step: int, d: Dist) -> list[torch.Tensor]:
    """All ranks take part; rank 0 receives world * numel floats and returns them."""
    mine = torch.full((numel,), float(step * d.world + d.rank), device=d.device)
    received = [torch.empty_like(mine) for _ in range(d.world)] if d.rank == 0 else None
    dist.gather(mine, gather_list=received, dst=0)
    return received or []


def train(args: argparse.Namespace, d: Dist) -> tuple[float, float]:
    """Run ``args.steps`` steps; return (rank-local final loss, mean step seconds)."""
    model = build_model(args)
    if args.engine == "deepspeed":
        trainer = deepspeed_trainer(model, args)
    else:
        trainer = torch_trainer(model, args, d)
    trainer.model.train()
    faults = Faults(args, d)
    data = batches(args, d)
    loss_value, step_times = float("nan"), []
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        faults.before_step(step, trainer.model)
        input_ids = faults.fetch(data, step)
        loss = compute_loss(trainer.model, input_ids, explicit_upcast=args.fault == "logits-spike")
        trainer.backward_and_step(loss)
        faults.after_step(step, trainer.model)
        loss_value = loss.item()
        step_times.append(time.perf_counter() - start)
        if args.print_losses and d.rank == 0:
            print(f"step {step} loss {loss_value!r}", flush=True)
    # Skip the first steps (warm-up) when there are enough to average.
    timed = step_times[2:] if len(step_times) > 4 else step_times
    return loss_value, sum(timed) / max(len(timed), 1)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.verbose:
        quiet_libraries()
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    d = setup_distributed(args)
    final_loss, step_s = train(args, d)
    if d.rank == 0:
        print(f"train_lora: done steps={args.steps} final_loss={final_loss!r} "
              f"mean_step_s={step_s:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


# The entry point is at the end of the file (a lone process runs as rank 0 of 1); these
# two lines keep the line numbers that recorded dumps and reports point into.


def lone_process_defaults() -> None:
    """``python probes/train_lora.py`` without a launcher: rank 0 of a world of 1 (the
    env:// rendezvous needs what a launcher would set)."""
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")


if __name__ == "__main__":
    lone_process_defaults()
    main()


# -- Faults planted after `lorascope attach` (appended: the lines above must not move) --
# ``rank-conditional-on-trigger``: the rank-conditional collective of
# ``rank-conditional-hang``, made at the step written in the file $TRAIN_LORA_TRIGGER (every
# rank reads it at each step's start), so that a test can plant it once lorascope is
# attached to the running job. Added to --fault by ``add_attach_faults()``; the job for
# it is ``probes/train_lora_attach.py``.

TRIGGER_ENV = "TRAIN_LORA_TRIGGER"


def trigger_step() -> int | None:
    """The step the trigger file names, None while there is none."""
    path = os.environ.get(TRIGGER_ENV)
    if not path:
        return None
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def rank_conditional_on_trigger(d: Dist) -> None:
    """The bug, planted after the attach: a collective only rank 0 runs."""
    if d.rank == 0:
        flag = torch.ones(1, dtype=torch.float32, device=d.device)
        dist.all_reduce(flag)  # no other rank ever joins this one
    else:
        dist.barrier()


def add_attach_faults() -> None:
    global FAULTS
    FAULTS = (*FAULTS, "rank-conditional-on-trigger")
    plain_before_step = Faults.before_step

    def before_step(self: Faults, step: int, model: torch.nn.Module) -> None:
        if self.args.fault == "rank-conditional-on-trigger":
            if step == trigger_step():
                rank_conditional_on_trigger(self.d)
            return
        plain_before_step(self, step, model)

    Faults.before_step = before_step  # type: ignore[method-assign]
