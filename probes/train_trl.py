"""A LoRA SFT job on TRL's ``SFTTrainer``: the test bed for lorascope on TRL launches.

A tiny random Llama built from a config and a word-level tokenizer built in memory (no
download), a tiny in-memory dataset of token sequences (``datasets.Dataset``, already
tokenized: SFTTrainer then only collates it), PEFT ``LoraConfig`` passed as
``peft_config``, on CPU over gloo (``use_cpu=True``) or CUDA. It knows nothing of lorascope.

    torchrun --nproc_per_node 2 probes/train_trl.py --steps 6                 # ZeRO-3
    torchrun --nproc_per_node 2 probes/train_trl.py --engine ddp              # plain DDP
    torchrun --nproc_per_node 2 probes/train_trl.py --engine fsdp2            # FSDP2 asked for

Engines: ``deepspeed`` (default) passes a ZeRO-3 config as ``SFTConfig(deepspeed=dict)``;
``ddp`` the Trainer's own DistributedDataParallel; ``fsdp2`` asks for FSDP version 2
(``fsdp="full_shard auto_wrap"``, ``fsdp_config={"fsdp_version": 2, ...}``): on CPU
accelerate enables FSDP for GPU-type setups only and runs plain DDP instead (lorascope's
``sharding-not-applied`` names that).

Output: one line from rank 0, ``train_trl: done global_step=N``, the Trainer's
``state.global_step`` after training.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import warnings
from typing import Any

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=("deepspeed", "ddp", "fsdp2"), default="deepspeed")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--bf16", action="store_true", help="SFTConfig(bf16=True)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, dest="local_rank")
    return p.parse_args(argv)


def quiet() -> None:
    for category in (DeprecationWarning, FutureWarning, PendingDeprecationWarning, UserWarning):
        warnings.filterwarnings("ignore", category=category)
    logging.getLogger("DeepSpeed").addFilter(lambda record: record.levelno >= logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def tokenizer(vocab: int) -> Any:
    """A word-level tokenizer over the words "t0".."t{vocab-4}" and three special tokens."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i + 3 for i in range(vocab - 3)}}
    tok = Tokenizer(WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def dataset(n: int, args: argparse.Namespace, seed: int) -> Any:
    """Arithmetic progressions mod vocab (learnable, deterministic), already tokenized."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    start = torch.randint(3, args.vocab, (n, 1), generator=g)
    stride = torch.randint(1, 8, (n, 1), generator=g)
    ids = 3 + (start - 3 + stride * torch.arange(args.seq)) % (args.vocab - 3)
    return Dataset.from_dict({"input_ids": ids.tolist()})


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
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(config)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    if args.engine == "deepspeed":
        return {
            "deepspeed": {
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
                "zero_optimization": {"stage": 3},
                "steps_per_print": 1 << 30,
            }
        }
    if args.engine == "fsdp2":
        return {
            "fsdp": "full_shard auto_wrap",
            "fsdp_config": {
                "fsdp_version": 2,
                "reshard_after_forward": True,
                "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
            },
        }
    return {}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    quiet()
    from peft import LoraConfig
    from transformers.utils import logging as hf_logging
    from trl import SFTConfig, SFTTrainer

    hf_logging.set_verbosity_error()
    cpu = not torch.cuda.is_available()
    config = SFTConfig(
        output_dir=tempfile.mkdtemp(prefix="train_trl-"),
        per_device_train_batch_size=args.micro_batch,
        max_steps=args.steps,
        learning_rate=5e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=cpu,
        ddp_backend="gloo" if cpu and int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        bf16=args.bf16,
        seed=args.seed,
        dataloader_num_workers=0,
        max_length=args.seq,
        packing=False,
        **engine_options(args),
    )
    trainer = SFTTrainer(
        model=base_model(args),
        args=config,
        train_dataset=dataset(512, args, args.seed),
        processing_class=tokenizer(args.vocab),
        peft_config=LoraConfig(
            r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
        ),
    )
    trainer.train()
    if trainer.is_world_process_zero():
        print(f"train_trl: done global_step={trainer.state.global_step}", flush=True)


if __name__ == "__main__":
    main()
