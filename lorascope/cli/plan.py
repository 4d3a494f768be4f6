"""`lorascope plan`: the per-GPU memory budget of a LoRA job before launch, and what to
change so that it fits."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import click

from lorascope.analysis import strict_json
from lorascope.errors import UsageError
from lorascope.plan import PRESETS, PlanInputs, build_plan, preset_shape, render_text, shape_from_config
from lorascope.plan.from_configs import ds_precision, lora_from_config, zero_from_ds_config
from lorascope.plan.lora import LoraSpec
from lorascope.plan.shape import load_config_file
from lorascope.plan.training import (
    ATTENTION,
    CHECKPOINTING,
    FSDP_STRATEGIES,
    LOSSES,
    PRECISIONS,
    FsdpSetup,
    TrainingSetup,
)
from lorascope.text import echo
from lorascope.units import parse_bytes

_REGEX_CHARS = re.compile(r"[*()\[\]|^$\\+?{}]")


def _targets(text: str) -> str | tuple[str, ...]:
    """all-linear, a regex (PEFT full-matches a string target), or comma-separated names."""
    if text.lower() == "all-linear" or _REGEX_CHARS.search(text):
        return text
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names:
        raise UsageError("--lora-targets is empty")
    return names


def _model_name(path: Path) -> str:
    """The model directory's name for .../Meta-Llama-3-8B/config.json, else the file's stem."""
    if path.is_dir():
        return path.resolve().name
    return path.resolve().parent.name if path.name == "config.json" else path.stem


def _given(**values: Any) -> dict[str, Any]:
    return {key: value for key, value in values.items() if value is not None}


def _fsdp_setup(
    strategy: str | None, reshard_after_forward: bool | None, mixed_precision: str, offload_params: bool | None
) -> FsdpSetup | None:
    """The FSDP flags as an FsdpSetup (None without --fsdp, where they must not be given)."""
    if strategy is None:
        if reshard_after_forward is not None or mixed_precision != "none":
            raise UsageError("--reshard-after-forward and --fsdp-mixed-precision need --fsdp")
        return None
    version, name = (2, "FULL_SHARD") if strategy.lower() == "fully_shard" else (1, strategy.upper())
    if reshard_after_forward is not None:
        if version != 2:
            raise UsageError("--reshard-after-forward is FSDP2's (--fsdp fully_shard); FSDP1 sets it by strategy")
        name = "FULL_SHARD" if reshard_after_forward else "SHARD_GRAD_OP"
    return FsdpSetup(
        version=version,
        strategy=name,
        mixed_precision=mixed_precision != "none",
        reduce_fp32=mixed_precision == "param+reduce",
        offload_params=bool(offload_params),
    )


@click.command("plan")
@click.option(
    "--model",
    "model_path",
    type=click.Path(path_type=Path),
    help="A transformers config.json (or the model directory holding it).",
)
@click.option(
    "--preset",
    type=click.Choice(sorted(PRESETS), case_sensitive=False),
    help="A built-in model shape instead of --model (no download).",
)
@click.option(
    "--lora-config",
    "lora_path",
    type=click.Path(path_type=Path),
    help="A PEFT adapter_config.json; the --lora-* flags override it.",
)
@click.option("--lora-r", type=int, help="LoRA rank (PEFT default 8).")
@click.option("--lora-alpha", type=float, help="LoRA alpha (PEFT default 8).")
@click.option(
    "--lora-targets",
    help="all-linear, module names (q_proj,v_proj) or a regex (PEFT default for Llama/Mistral/Qwen2: q_proj,v_proj).",
)
@click.option("--lora-dropout", type=float, help="LoRA dropout (adds per-module input copies).")
@click.option("--rslora/--no-rslora", default=None, help="rank-stabilised scaling (no memory effect).")
@click.option("--dora/--no-dora", default=None, help="DoRA magnitude vectors.")
@click.option(
    "--precision",
    type=click.Choice(PRECISIONS),
    help="Base weights: bf16, fp16, fp32 or 4bit (NF4, bf16 compute). Default bf16, or what --ds-config enables.",
)
@click.option(
    "--fp32-adapters",
    is_flag=True,
    help="Adapters kept in fp32 over a 16-bit base (PEFT autocast, no DeepSpeed mixed precision).",
)
@click.option(
    "--ds-config",
    "ds_path",
    type=click.Path(path_type=Path),
    help="A DeepSpeed config JSON: ZeRO stage, offload, buckets, bf16/fp16. Flags override it.",
)
@click.option("--zero", type=click.IntRange(0, 3), help="ZeRO stage (default 0).")
@click.option(
    "--fsdp",
    "fsdp_strategy",
    type=click.Choice([*FSDP_STRATEGIES, "fully_shard"], case_sensitive=False),
    help="PyTorch FSDP instead of ZeRO: FSDP1's sharding strategy, or fully_shard (FSDP2).",
)
@click.option(
    "--reshard-after-forward/--no-reshard-after-forward",
    default=None,
    help="FSDP2 (--fsdp fully_shard): free each layer's unsharded parameters after its forward (default on).",
)
@click.option(
    "--fsdp-mixed-precision",
    type=click.Choice(("none", "param", "param+reduce")),
    default="none",
    show_default=True,
    help="FSDP mixed precision: fp32 shards computed in --precision; param+reduce also reduces gradients in fp32.",
)
@click.option("--offload-optimizer/--no-offload-optimizer", default=None, help="ZeRO CPU optimizer offload.")
@click.option(
    "--offload-params/--no-offload-params",
    default=None,
    help="ZeRO-3 CPU parameter offload; under --fsdp, CPUOffload(offload_params=True) / CPUOffloadPolicy.",
)
@click.option("--gpus", type=click.IntRange(min=1), default=1, show_default=True, help="GPUs per node.")
@click.option("--nodes", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--seq", type=click.IntRange(min=1), default=2048, show_default=True, help="Sequence length.")
@click.option(
    "--micro-batch",
    type=click.IntRange(min=1),
    default=None,
    help="Sequences per GPU per step (default: the DeepSpeed config's, else 1).",
)
@click.option("--checkpointing", type=click.Choice(CHECKPOINTING), default="none", show_default=True)
@click.option("--attention", type=click.Choice(ATTENTION), default="sdpa", show_default=True)
@click.option(
    "--loss",
    type=click.Choice(LOSSES),
    default="fp32-upcast",
    show_default=True,
    help="fp32-upcast: transformers' default; native: no upcast; chunked: fused/chunked CE.",
)
@click.option("--gpu-mem", default="80GiB", show_default=True, help="Memory of one GPU, e.g. 80GiB, 24GiB.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def command(
    model_path: Path | None,
    preset: str | None,
    lora_path: Path | None,
    lora_r: int | None,
    lora_alpha: float | None,
    lora_targets: str | None,
    lora_dropout: float | None,
    rslora: bool | None,
    dora: bool | None,
    precision: str | None,
    fp32_adapters: bool,
    ds_path: Path | None,
    zero: int | None,
    fsdp_strategy: str | None,
    reshard_after_forward: bool | None,
    fsdp_mixed_precision: str,
    offload_optimizer: bool | None,
    offload_params: bool | None,
    gpus: int,
    nodes: int,
    seq: int,
    micro_batch: int | None,
    checkpointing: str,
    attention: str,
    loss: str,
    gpu_mem: str,
    as_json: bool,
) -> int:
    """Per-GPU memory budget of a LoRA fine-tuning job, term by term, and what makes it fit."""
    if (model_path is None) == (preset is None):
        raise UsageError("give exactly one of --model CONFIG_JSON and --preset NAME")
    if model_path is not None:
        config = load_config_file(model_path)
        shape = shape_from_config(config, name=config.get("_name_or_path") or _model_name(model_path))
        source = str(model_path)
    else:
        assert preset is not None
        shape, source = preset_shape(preset), f"preset {preset.lower()}"

    base_lora = lora_from_config(load_config_file(lora_path)) if lora_path else LoraSpec()
    lora = dataclasses.replace(
        base_lora,
        **_given(
            r=lora_r,
            alpha=lora_alpha,
            dropout=lora_dropout,
            rslora=rslora,
            dora=dora,
            targets=_targets(lora_targets) if lora_targets is not None else None,
        ),
    )

    fsdp = _fsdp_setup(fsdp_strategy, reshard_after_forward, fsdp_mixed_precision, offload_params)
    if fsdp is not None and (ds_path or zero or offload_optimizer):
        raise UsageError("--fsdp shards without DeepSpeed: drop --ds-config, --zero and --offload-optimizer")
    ds = load_config_file(ds_path) if ds_path else {}
    zero_setup = dataclasses.replace(
        zero_from_ds_config(ds, shape.hidden),
        **_given(
            stage=zero,
            offload_optimizer=offload_optimizer,
            offload_params=offload_params if fsdp is None else None,
        ),
    )
    if ds_path and precision is None:
        precision = ds_precision(ds)
    if micro_batch is None:
        from_ds = ds.get("train_micro_batch_size_per_gpu")
        micro_batch = from_ds if isinstance(from_ds, int) and not isinstance(from_ds, bool) else 1
    setup = TrainingSetup(
        precision=precision or "bf16",
        fp32_adapters=fp32_adapters,
        zero=zero_setup,
        fsdp=fsdp,
        gpus_per_node=gpus,
        nodes=nodes,
        seq=seq,
        micro_batch=micro_batch,
        checkpointing=checkpointing,
        attention=attention,
        loss=loss,
    )
    plan = build_plan(PlanInputs(shape, lora, setup, parse_bytes(gpu_mem), source)).to_dict()
    echo(strict_json.dumps(plan, indent=2) if as_json else render_text(plan))
    return 0
