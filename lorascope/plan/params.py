"""Parameter tensors of the adapted model and their counts: the input of the model-state terms."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from lorascope.plan.lora import AdapterLayout
from lorascope.plan.shape import ModelShape, modules
from lorascope.plan.training import NF4_BYTES_PER_PARAM, TrainingSetup


@dataclass(frozen=True)
class ParamTensor:
    """One parameter tensor, as DeepSpeed sees it (the unit of partitioning and persistence)."""

    module: str
    numel: int
    trainable: bool
    #: A decoder-layer Linear weight: bitsandbytes stores it in 4 bits under QLoRA
    #: (embeddings, norms and lm_head stay in the compute dtype).
    quantizable: bool = False


def param_tensors(shape: ModelShape, layout: AdapterLayout) -> list[ParamTensor]:
    trainable_bias = {m.name for m in layout.trainable_bias_modules}
    out: list[ParamTensor] = []
    for m in modules(shape):
        if m.tied:
            continue
        out.append(ParamTensor(m.name, m.weight_numel, False, m.kind == "linear" and m.layer is not None))
        if m.bias:
            out.append(ParamTensor(m.name, m.out_features, m.name in trainable_bias))
    for adapter in layout.adapters:
        out.extend(ParamTensor(adapter.module.name + ".lora", n, True) for n in adapter.tensor_numels)
    for m in layout.saved_copies:
        out.append(ParamTensor(m.name + ".modules_to_save", m.weight_numel, True))
        if m.bias:
            out.append(ParamTensor(m.name + ".modules_to_save", m.out_features, True))
    return out


def tensor_bytes(t: ParamTensor, setup: TrainingSetup) -> float:
    """Bytes of one parameter tensor in GPU memory (its working copy, not the fp32 master)."""
    if t.trainable:
        return t.numel * setup.adapter_bytes
    if t.quantizable and setup.precision == "4bit":
        return t.numel * NF4_BYTES_PER_PARAM
    return t.numel * setup.compute_bytes


def stored_bytes(t: ParamTensor, setup: TrainingSetup) -> float:
    """Bytes of one parameter tensor as it is kept between uses: FSDP mixed precision keeps
    the sharded parameters fp32 and casts only the unsharded copies; otherwise as computed."""
    if setup.fsdp_master and not (t.quantizable and setup.precision == "4bit"):
        return t.numel * 4
    return tensor_bytes(t, setup)


@dataclass(frozen=True)
class ParamCounts:
    base: int
    trainable: int
    #: PEFT's "all params": the base model plus adapters and modules_to_save copies.
    total: int
    largest_module: str
    largest_module_numel: int

    @property
    def frozen(self) -> int:
        return self.total - self.trainable

    def to_dict(self) -> dict[str, int | str]:
        return {
            "base": self.base,
            "trainable": self.trainable,
            "frozen": self.frozen,
            "total": self.total,
            "largest_module": self.largest_module,
            "largest_module_params": self.largest_module_numel,
        }


def count_params(shape: ModelShape, layout: AdapterLayout) -> ParamCounts:
    tensors = param_tensors(shape, layout)
    per_module: dict[str, int] = defaultdict(int)
    for t in tensors:
        per_module[t.module] += t.numel
    largest = max(per_module, key=per_module.__getitem__)
    base = sum(m.numel for m in modules(shape))
    total = sum(t.numel for t in tensors)
    return ParamCounts(base, sum(t.numel for t in tensors if t.trainable), total, largest, per_module[largest])
