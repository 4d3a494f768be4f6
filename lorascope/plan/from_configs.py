"""The plan of a job described by its own configs: the transformers model config, the PEFT
LoRA config and the DeepSpeed config or the FSDP settings (what the probes record in a run
directory), so that a recorded run can be compared with what it should have used."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lorascope.errors import BadInputError, LorascopeError
from lorascope.plan.budget import DEFAULT_GPU_MEM, PlanInputs
from lorascope.plan.builder import Plan, build_plan
from lorascope.plan.lora import LoraSpec
from lorascope.plan.shape import ModelShape, shape_from_config
from lorascope.plan.training import FSDP_STRATEGIES, FsdpSetup, TrainingSetup, ZeroSetup

#: transformers attn_implementation -> the activation model that matches what it saves.
_ATTENTION = {
    "eager": "eager",
    "sdpa": "sdpa",
    "flash_attention_2": "flash",
    "flash_attention_3": "flash",
    "flex_attention": "flash",
    "flash": "flash",
}
_DTYPES_16 = {"bfloat16": "bf16", "float16": "fp16", "bf16": "bf16", "fp16": "fp16"}


def lora_from_config(config: Mapping[str, Any]) -> LoraSpec:
    """A LoraSpec from ``LoraConfig.to_dict()``, or from the probes' record, which maps
    adapter names to such dicts (the one adapter, or the one named "default")."""
    if not isinstance(config, Mapping):
        raise BadInputError("LoRA config must be a JSON object")
    if "r" not in config and "peft_type" not in config:
        nested = {k: v for k, v in config.items() if isinstance(v, Mapping)}
        if len(nested) == 1:
            config = next(iter(nested.values()))
        elif "default" in nested:
            config = nested["default"]
        else:
            raise BadInputError(f"LoRA config: expected one adapter's config, found adapters {sorted(nested)}")
    return LoraSpec.from_peft_dict(config)


def _ds_auto(value: Any, auto: int, key: str) -> int:
    """DeepSpeed config integers; "auto" resolves as transformers' DeepSpeed integration does."""
    if value == "auto":
        return auto
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise BadInputError(f'DeepSpeed config: {key} must be a number or "auto", got {value!r}')
    return int(value)


def _section(ds: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = ds.get(key) or {}
    if not isinstance(value, Mapping):
        raise BadInputError(f"DeepSpeed config: {key} must be an object")
    return value


def _offloaded(zero: Mapping[str, Any], key: str) -> bool:
    device = _section(zero, key).get("device", "none")
    return str(device).lower() in ("cpu", "nvme")


def zero_from_ds_config(ds: Mapping[str, Any], hidden: int) -> ZeroSetup:
    """ZeRO settings from a DeepSpeed config dict (DeepSpeed's defaults where it is silent)."""
    if not isinstance(ds, Mapping):
        raise BadInputError("DeepSpeed config must be a JSON object")
    zero = _section(ds, "zero_optimization")
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise BadInputError(f"DeepSpeed config: zero_optimization.stage must be 0-3, got {stage!r}")
    defaults = ZeroSetup()
    grad_accum = str(_section(ds, "data_types").get("grad_accum_dtype") or "").lower()

    def number(key: str, alias: str | None, auto: int, default: int) -> int:
        value = zero.get(key, zero.get(alias) if alias else None)
        return default if value is None else _ds_auto(value, auto, key)

    try:
        return ZeroSetup(
            stage=stage,
            offload_optimizer=stage > 0 and _offloaded(zero, "offload_optimizer"),
            offload_params=stage == 3 and _offloaded(zero, "offload_param"),
            reduce_bucket_size=number("reduce_bucket_size", None, hidden * hidden, defaults.reduce_bucket_size),
            prefetch_bucket_size=number(
                "stage3_prefetch_bucket_size",
                "prefetch_bucket_size",
                int(0.9 * hidden * hidden),
                defaults.prefetch_bucket_size,
            ),
            param_persistence_threshold=number(
                "stage3_param_persistence_threshold",
                "param_persistence_threshold",
                10 * hidden,
                defaults.param_persistence_threshold,
            ),
            sub_group_size=number("sub_group_size", None, defaults.sub_group_size, defaults.sub_group_size),
            contiguous_gradients=bool(zero.get("contiguous_gradients", True)),
            overlap_comm=zero.get("overlap_comm") if isinstance(zero.get("overlap_comm"), bool) else None,
            grad_accum_dtype="fp32" if grad_accum in ("fp32", "float32", "float") else None,
        )
    except LorascopeError as exc:
        raise BadInputError(f"DeepSpeed config: {exc}") from None


def _dtype_name(value: Any) -> str:
    """ "torch.bfloat16" / "bfloat16" / "bf16" -> "bfloat16"-style names, "" for None."""
    text = str(value or "").replace("torch.", "").lower()
    return {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}.get(
        text, text
    )


def _values(value: Any) -> list[Any]:
    """A setting recorded once (FSDP1) or as the distinct values of the units (FSDP2)."""
    return list(value) if isinstance(value, list) else [value]


def fsdp_from_settings(settings: Mapping[str, Any]) -> tuple[FsdpSetup, str | None]:
    """The FSDP settings the probes record (the ``fsdp`` config record) -> (FsdpSetup, the
    16-bit compute precision of its mixed precision or None). Read: ``version`` (1 or 2);
    FSDP1's ``sharding_strategy`` (a ShardingStrategy name), ``mixed_precision`` and
    ``cpu_offload``; FSDP2's per-unit lists ``reshard_after_forward`` (layers that reshard
    make it FULL_SHARD, even beside a root that does not), ``mesh`` (2-D: hybrid),
    ``mixed_precision`` and ``offload``."""
    if not isinstance(settings, Mapping):
        raise BadInputError("FSDP settings must be a JSON object")
    version = settings.get("version")
    if version not in (1, 2):
        raise BadInputError(f"FSDP settings: version must be 1 or 2, got {version!r}")
    if version == 1:
        strategy = str(settings.get("sharding_strategy") or "FULL_SHARD").rsplit(".", 1)[-1].upper()
        strategy = {"_HYBRID_SHARD_ZERO2": "HYBRID_SHARD"}.get(strategy, strategy)
    else:
        meshes = [m for m in _values(settings.get("mesh")) if isinstance(m, Mapping)]
        hybrid = any(len(m.get("shape") or []) == 2 for m in meshes)
        reshard = _values(settings.get("reshard_after_forward", True))
        keeps = all(r is False for r in reshard)
        strategy = "HYBRID_SHARD" if hybrid else ("SHARD_GRAD_OP" if keeps else "FULL_SHARD")
    if strategy not in FSDP_STRATEGIES:
        raise BadInputError(f"FSDP settings: sharding strategy {strategy!r} is not modelled")
    policies = _values(settings.get("mixed_precision"))
    if any(p is not None and not isinstance(p, Mapping) for p in policies):
        raise BadInputError("FSDP settings: mixed_precision must be an object, a list of them, or null")
    mp = next((p for p in policies if isinstance(p, Mapping)), {})
    param = _DTYPES_16.get(_dtype_name(mp.get("param_dtype")))
    reduce = _dtype_name(mp.get("reduce_dtype"))
    offload = bool(settings.get("cpu_offload")) or any(isinstance(o, Mapping) for o in _values(settings.get("offload")))
    return (
        FsdpSetup(
            version=version,
            strategy=strategy,
            mixed_precision=param is not None,
            reduce_fp32=param is not None and reduce == "float32",
            offload_params=offload,
        ),
        param,
    )


def ds_precision(ds: Mapping[str, Any]) -> str | None:
    """ "bf16"/"fp16" when the DeepSpeed config enables mixed precision, "fp32" when it
    clearly does not, None when it leaves it to the trainer ("auto")."""
    for key in ("bf16", "fp16"):
        enabled = _section(ds, key).get("enabled", False)
        if enabled == "auto":
            return None
        if enabled:
            return key
    return "fp32"


def _model_precision(model_config: Mapping[str, Any]) -> tuple[str | None, bool]:
    """(16-bit dtype the model was loaded in or None, whether its linear layers are 4-bit)."""
    quant = model_config.get("quantization_config") or {}
    four_bit = isinstance(quant, Mapping) and bool(quant.get("load_in_4bit"))
    dtype = str(model_config.get("dtype") or model_config.get("torch_dtype") or "").replace("torch.", "")
    return _DTYPES_16.get(dtype), four_bit


def inputs_from_configs(
    model_config: Mapping[str, Any],
    lora_config: Mapping[str, Any],
    ds_config: Mapping[str, Any] | None,
    world_size: int,
    seq: int,
    micro_batch: int | None = None,
    *,
    gpus_per_node: int | None = None,
    gpu_mem: int = DEFAULT_GPU_MEM,
    checkpointing: str = "none",
    attention: str | None = None,
    loss: str = "fp32-upcast",
    name: str | None = None,
    fsdp: Mapping[str, Any] | None = None,
) -> PlanInputs:
    shape: ModelShape = shape_from_config(model_config, name=name)
    ds = ds_config or {}
    zero = zero_from_ds_config(ds, shape.hidden)
    loaded_16, four_bit = _model_precision(model_config)
    mixed = ds_precision(ds) if ds_config is not None else None
    fsdp_setup, fsdp_param = fsdp_from_settings(fsdp) if fsdp is not None else (None, None)
    if fsdp_setup is not None and ds_config is not None:
        raise BadInputError("a job records either DeepSpeed or FSDP settings, not both")
    if fsdp_param is not None and not four_bit:
        # FSDP mixed precision: fp32 shards, computed in param_dtype (adapters included).
        precision, fp32_adapters = fsdp_param, False
    elif four_bit:
        precision, fp32_adapters = "4bit", mixed is None or mixed == "fp32"
    elif mixed in ("bf16", "fp16"):
        # DeepSpeed casts every parameter, adapters included, to its 16-bit dtype.
        precision, fp32_adapters = mixed, False
    elif loaded_16 is not None:
        # A 16-bit base without DeepSpeed mixed precision: PEFT's autocast_adapter_dtype
        # keeps the adapters in fp32.
        precision, fp32_adapters = loaded_16, True
    else:
        precision, fp32_adapters = "fp32", False
    if micro_batch is None:
        micro_batch = ds.get("train_micro_batch_size_per_gpu")
        if not isinstance(micro_batch, int) or isinstance(micro_batch, bool):
            raise BadInputError(
                "micro-batch size not given and not in the DeepSpeed config (train_micro_batch_size_per_gpu)"
            )
    if attention is None:
        attention = str(model_config.get("_attn_implementation") or model_config.get("attn_implementation") or "sdpa")
    if attention not in _ATTENTION:
        raise BadInputError(
            f"attention implementation {attention!r} is not modelled (known: {', '.join(sorted(_ATTENTION))})"
        )
    per_node = gpus_per_node or world_size
    if world_size < 1 or world_size % per_node:
        raise BadInputError(f"world size {world_size} is not a whole number of nodes of {per_node} GPUs")
    setup = TrainingSetup(
        precision=precision,
        fp32_adapters=fp32_adapters,
        zero=zero,
        fsdp=fsdp_setup,
        gpus_per_node=per_node,
        nodes=world_size // per_node,
        seq=seq,
        micro_batch=micro_batch,
        checkpointing=checkpointing,
        attention=_ATTENTION[attention],
        loss=loss,
    )
    return PlanInputs(shape, lora_from_config(lora_config), setup, gpu_mem, source="recorded configs")


def plan_from_configs(
    model_config: Mapping[str, Any],
    lora_config: Mapping[str, Any],
    ds_config: Mapping[str, Any] | None,
    world_size: int,
    seq: int,
    micro_batch: int | None = None,
    **options: Any,
) -> Plan:
    """The plan for a job from its recorded configs.

    ``model_config`` is a transformers ``config.to_dict()``, ``lora_config`` a PEFT
    ``LoraConfig.to_dict()`` (or the probes' {adapter name: dict} record), ``ds_config``
    the DeepSpeed config dict (None: no DeepSpeed, i.e. ZeRO off and no mixed-precision
    cast). ``micro_batch`` defaults to the config's train_micro_batch_size_per_gpu.
    Keyword options: gpus_per_node, gpu_mem (bytes), checkpointing, attention, loss, name,
    fsdp (the FSDP settings record, ``fsdp_from_settings``; with ``ds_config`` None).
    """
    return build_plan(
        inputs_from_configs(model_config, lora_config, ds_config, world_size, seq, micro_batch, **options)
    )
