"""The probes/ LoRA job on the Hugging Face ``Trainer``: the test bed for lorascope's
Trainer, accelerate and ZeRO-3-through-TrainingArguments support.

The same tiny random Llama and synthetic tokens as ``train_lora.py`` (no download), PEFT
LoRA on every linear layer, trained by ``transformers.Trainer`` with periodic evaluation
and checkpoint saves, on CPU over gloo (``use_cpu=True, ddp_backend="gloo"``) or CUDA.
Like ``train_lora.py`` it knows nothing of lorascope.

    torchrun --nproc_per_node 2 probes/train_trainer.py --steps 6              # ZeRO-3
    torchrun --nproc_per_node 2 probes/train_trainer.py --engine ddp           # plain DDP
    accelerate launch --multi_gpu --num_processes 2 probes/train_trainer.py --engine ddp  # CPU too
    python probes/train_trainer.py --engine ddp                                # one process

Engines: ``deepspeed`` (default) passes a ZeRO-3 config as ``TrainingArguments(deepspeed=
dict)``; ``ddp`` is the Trainer's own DistributedDataParallel.

Adapters (``--adapter``): ``get_peft_model`` (default), ``add_adapter`` (transformers'
``model.add_adapter(LoraConfig)``), ``from_pretrained`` (``PeftModel.from_pretrained`` of
an adapter this script saves first, built by hand so that no PEFT factory runs before).

Output: one line from rank 0, ``train_trainer: done global_step=N evals=[...] saves=[...]``,
the Trainer's ``state.global_step`` after training and after each evaluation / save.

``--fault`` plants a failure mode inside a Trainer:
  none                  healthy.
  logits-spike          vocab 32000, seq 128, and a ``compute_loss`` override that takes
                        ``cross_entropy(logits.float(), ...)`` itself (the fp32 copy of
                        the B*T*V logits next to the logits).
  rank0-save-gather     ZeRO-3 only: a callback gathers the partitioned adapters on
                        rank 0 alone when the Trainer saves (``GatheredParameters``
                        inside ``if state.is_world_process_zero``); the other ranks go on
                        training: a rank-conditional collective, the job fails or hangs
                        until ``--pg-timeout``.
  rank0-eval-keep       DDP only: at each evaluation a callback on rank 0 alone runs the
                        model on ``--keep-batch`` sequences and keeps their logits ("a
                        sample of eval outputs for the dashboard"): rank 0's memory grows
                        by B*T*V*4 bytes an evaluation (vocab 4096 unless ``--vocab``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=("deepspeed", "ddp"), default="deepspeed")
    p.add_argument("--adapter", choices=("get_peft_model", "add_adapter", "from_pretrained"), default="get_peft_model")
    p.add_argument("--fault", choices=("none", "logits-spike", "rank0-save-gather", "rank0-eval-keep"), default="none")
    p.add_argument("--keep-batch", type=int, default=64, help="rank0-eval-keep: sequences kept an evaluation")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--eval-steps", type=int, default=3)
    p.add_argument("--save-steps", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--pg-timeout", type=float, help="process-group timeout, seconds")
    p.add_argument("--output-dir", default=None, help="checkpoints (default: a temporary folder)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, dest="local_rank")
    args = p.parse_args(argv)
    spike = args.fault == "logits-spike"
    args.seq = args.seq or (128 if spike else 32)
    args.vocab = args.vocab or (32000 if spike else 4096 if args.fault == "rank0-eval-keep" else 512)
    if args.fault == "rank0-save-gather" and args.engine != "deepspeed":
        p.error("rank0-save-gather needs --engine deepspeed (ZeRO-3 partitions the adapters)")
    if args.fault == "rank0-eval-keep" and args.engine != "ddp":
        p.error("rank0-eval-keep needs --engine ddp (a forward on rank 0 alone under ZeRO-3 is a hang)")
    return args


def quiet() -> None:
    for category in (DeprecationWarning, FutureWarning, PendingDeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    logging.getLogger("DeepSpeed").addFilter(lambda record: record.levelno >= logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def open_group(args: argparse.Namespace) -> None:
    """With ``use_cpu=True`` accelerate ignores ``ddp_timeout``: a short process-group
    timeout needs the group opened here, before the Trainer."""
    if args.pg_timeout is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))


class Tokens(torch.utils.data.Dataset):
    """Arithmetic progressions mod vocab (learnable, deterministic), labels = inputs."""

    def __init__(self, n: int, args: argparse.Namespace, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, args.vocab, (n, 1), generator=g)
        stride = torch.randint(1, 8, (n, 1), generator=g)
        self.ids = (start + stride * torch.arange(args.seq)) % args.vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def lora_config() -> Any:
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")


def base_model(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max(args.seq, 64),
        tie_word_embeddings=False,
        use_cache=False,
    )
    return LlamaForCausalLM(config)


def saved_adapter(model: Any, folder: Path) -> Path:
    """An adapter folder as PEFT writes it (config + safetensors), built by hand from
    the model's shapes: no PEFT factory runs in this process before from_pretrained."""
    from safetensors.torch import save_file

    config = lora_config()
    targets = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    g = torch.Generator().manual_seed(1)
    weights = {}
    for name in targets:
        linear = model.get_submodule(name)
        prefix = f"base_model.model.{name}"
        weights[f"{prefix}.lora_A.weight"] = torch.randn(config.r, linear.in_features, generator=g) * 0.02
        weights[f"{prefix}.lora_B.weight"] = torch.zeros(linear.out_features, config.r)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "adapter_model.safetensors"))
    cfg = config.to_dict()
    cfg["target_modules"] = sorted({n.rsplit(".", 1)[-1] for n in targets})
    cfg["base_model_name_or_path"] = None
    (folder / "adapter_config.json").write_text(json.dumps(cfg, default=sorted))
    return folder


def build_model(args: argparse.Namespace, scratch: Path) -> Any:
    model = base_model(args)
    if args.adapter == "get_peft_model":
        from peft import get_peft_model

        return get_peft_model(model, lora_config())
    if args.adapter == "add_adapter":
        model.add_adapter(lora_config())
        return model
    from peft import PeftModel

    folder = saved_adapter(model, scratch / f"adapter-{os.environ.get('RANK', '0')}")
    return PeftModel.from_pretrained(model, str(folder), is_trainable=True)


def deepspeed_config(args: argparse.Namespace) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": 3}
    if args.fault == "rank0-save-gather":
        zero["stage3_param_persistence_threshold"] = 0  # partition even this tiny model's adapters
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": zero,
        "steps_per_print": 1 << 30,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    quiet()
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    open_group(args)
    scratch = Path(tempfile.mkdtemp(prefix="train_trainer-"))
    output_dir = args.output_dir or str(scratch / "out")
    seen: dict[str, list[int]] = {"evals": [], "saves": []}

    class Record(TrainerCallback):
        def on_evaluate(self, targs: Any, state: Any, control: Any, **kwargs: Any) -> None:
            seen["evals"].append(state.global_step)

        def on_save(self, targs: Any, state: Any, control: Any, **kwargs: Any) -> None:
            seen["saves"].append(state.global_step)

    class SaveOnRank0(TrainerCallback):
        """The planted bug: rank 0 alone gathers the ZeRO-3 adapters to save them."""

        def on_save(self, targs: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            import deepspeed

            if state.is_world_process_zero:
                adapters = [p for n, p in model.named_parameters() if "lora_" in n]
                with deepspeed.zero.GatheredParameters(adapters):
                    _ = [p.detach().clone() for p in adapters]

    class KeepEvalSamples(TrainerCallback):
        """The planted bug: rank 0 alone keeps a sample of eval outputs at each evaluation."""

        def __init__(self) -> None:
            self.kept: list[torch.Tensor] = []
            self.sample = Tokens(args.keep_batch, args, args.seed + 2).ids

        def on_evaluate(self, targs: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            if state.is_world_process_zero:
                with torch.no_grad():  # the unwrapped model: no DDP hook, no collective
                    self.kept.append(model(input_ids=self.sample.to(model.device)).logits)

    class UpcastLoss(Trainer):
        """The planted logits spike: the loss taken here from an fp32 copy of the logits."""

        def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, **kwargs: Any) -> Any:
            ids = inputs["input_ids"]
            logits = model(input_ids=ids).logits
            shifted = logits[:, :-1, :].float()
            loss = torch.nn.functional.cross_entropy(shifted.reshape(-1, shifted.size(-1)), ids[:, 1:].reshape(-1))
            return (loss, logits) if return_outputs else loss

    targs = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=args.micro_batch,
        per_device_eval_batch_size=args.micro_batch,
        max_steps=args.steps,
        learning_rate=5e-3,
        eval_strategy="steps",
        eval_steps=args.eval_steps,
        save_strategy="steps",
        save_steps=args.save_steps,
        logging_steps=1,
        report_to=[],
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
        # gloo on CPU; for one process no backend at all (accelerate would expect a group)
        ddp_backend="gloo" if not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        deepspeed=deepspeed_config(args) if args.engine == "deepspeed" else None,
        seed=args.seed,
        dataloader_num_workers=0,
        save_only_model=True,
    )
    callbacks: list[Any] = [Record()]
    if args.fault == "rank0-save-gather":
        callbacks.append(SaveOnRank0())
    if args.fault == "rank0-eval-keep":
        callbacks.append(KeepEvalSamples())
    trainer_cls = UpcastLoss if args.fault == "logits-spike" else Trainer
    trainer = trainer_cls(
        model=build_model(args, scratch),
        args=targs,
        train_dataset=Tokens(1024, args, args.seed),
        eval_dataset=Tokens(16, args, args.seed + 1),
        callbacks=callbacks,
    )
    trainer.train()
    if trainer.is_world_process_zero():
        print(
            f"train_trainer: done global_step={trainer.state.global_step} evals={seen['evals']} saves={seen['saves']}",
            flush=True,
        )


if __name__ == "__main__":
    main()
