"""LoRA settings and which modules they adapt, resolved the way PEFT resolves them.

The matching rules mirror PEFT 0.21 (``check_target_module_exists``,
``_maybe_include_all_linear_layers``, ``get_pattern_key``, ``_set_trainable``) so that the
trainable count equals ``PeftModel.get_nb_trainable_parameters()`` for the same model and
config; tests/unit/test_plan_params.py checks it on real PEFT models built on the meta device.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lorascope.errors import BadInputError, UsageError
from lorascope.plan.shape import ModelShape, Module, modules

ALL_LINEAR = "all-linear"
#: PEFT's default target_modules for llama, mistral and qwen2 when none are given.
PEFT_DEFAULT_TARGETS = ("q_proj", "v_proj")
BIAS_MODES = ("none", "all", "lora_only")
#: LoraConfig fields that change the parameter layout in ways this model does not follow.
_UNMODELLED = (
    "layer_replication",
    "target_parameters",
    "trainable_token_indices",
    "use_qalora",
    "use_bdlora",
    "alora_invocation_tokens",
)


@dataclass(frozen=True)
class LoraSpec:
    """The LoRA hyper-parameters that decide parameter counts and activation memory."""

    r: int = 8
    alpha: float = 8.0
    #: "all-linear", a regex (PEFT full-matches a str against module names) or module names.
    targets: str | tuple[str, ...] = PEFT_DEFAULT_TARGETS
    dropout: float = 0.0
    rslora: bool = False
    dora: bool = False
    lora_bias: bool = False
    bias: str = "none"
    rank_pattern: Mapping[str, int] = field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)
    layers_to_transform: tuple[int, ...] | None = None
    layers_pattern: tuple[str, ...] | None = None
    exclude_modules: str | tuple[str, ...] | None = None
    modules_to_save: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.r <= 0:
            raise UsageError(f"LoRA rank must be positive, got {self.r}")
        if not 0.0 <= self.dropout < 1.0:
            raise UsageError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        if self.bias not in BIAS_MODES:
            raise UsageError(f"LoRA bias must be one of {', '.join(BIAS_MODES)}, got {self.bias!r}")

    @property
    def targets_text(self) -> str:
        return self.targets if isinstance(self.targets, str) else ",".join(self.targets)

    @classmethod
    def from_peft_dict(cls, config: Mapping[str, Any]) -> LoraSpec:
        """From ``LoraConfig.to_dict()`` or an ``adapter_config.json``."""
        peft_type = str(config.get("peft_type", "LORA"))
        if "LORA" not in peft_type.upper():
            raise BadInputError(f"LoRA config: peft_type {peft_type!r} is not LoRA")
        for key in _UNMODELLED:
            if config.get(key):
                raise BadInputError(f"LoRA config: {key}={config[key]!r} is not modelled by lorascope plan")
        try:
            return cls(
                r=int(config.get("r", 8)),
                alpha=float(config.get("lora_alpha", 8)),
                targets=_targets(config.get("target_modules")),
                dropout=float(config.get("lora_dropout", 0.0) or 0.0),
                rslora=bool(config.get("use_rslora", False)),
                dora=bool(config.get("use_dora", False)),
                lora_bias=bool(config.get("lora_bias", False)),
                bias=str(config.get("bias", "none") or "none"),
                rank_pattern={str(k): int(v) for k, v in (config.get("rank_pattern") or {}).items()},
                alpha_pattern={str(k): float(v) for k, v in (config.get("alpha_pattern") or {}).items()},
                layers_to_transform=_layers(config.get("layers_to_transform")),
                layers_pattern=_names(config.get("layers_pattern")),
                exclude_modules=_names_or_regex(config.get("exclude_modules")),
                modules_to_save=_names(config.get("modules_to_save")),
            )
        except UsageError as exc:
            raise BadInputError(f"LoRA config: {exc}") from None
        except (TypeError, ValueError, AttributeError) as exc:
            raise BadInputError(f"LoRA config: unreadable value ({exc})") from None


def _targets(value: Any) -> str | tuple[str, ...]:
    if value is None:
        return PEFT_DEFAULT_TARGETS
    if isinstance(value, str):
        return value
    return tuple(sorted(str(v) for v in value))


def _names(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    return (value,) if isinstance(value, str) else tuple(str(v) for v in value)


def _names_or_regex(value: Any) -> str | tuple[str, ...] | None:
    if value is None or isinstance(value, str):
        return value or None
    return tuple(str(v) for v in value)


def _layers(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value) or None


@dataclass(frozen=True)
class Adapter:
    """The LoRA tensors added to one module."""

    module: Module
    r: int
    dora: bool
    lora_bias: bool

    @property
    def tensor_numels(self) -> tuple[int, ...]:
        """lora_A, lora_B, then lora_B.bias / the DoRA magnitude when present."""
        m = self.module
        # Linear: A is r x in, B is out x r. Embedding: A is r x vocab, B is dim x r.
        numels = [self.r * m.in_features, m.out_features * self.r]
        if self.lora_bias:
            numels.append(m.out_features)
        if self.dora:
            numels.append(m.out_features)
        return tuple(numels)

    @property
    def numel(self) -> int:
        return sum(self.tensor_numels)


@dataclass(frozen=True)
class AdapterLayout:
    """Everything a LoRA config makes trainable in one model."""

    adapters: tuple[Adapter, ...]
    #: modules_to_save: PEFT keeps the original (frozen) and trains a full copy.
    saved_copies: tuple[Module, ...]
    #: Base modules whose bias becomes trainable (bias="all" / "lora_only").
    trainable_bias_modules: tuple[Module, ...]
    notes: tuple[str, ...]

    @property
    def adapter_params(self) -> int:
        return sum(a.numel for a in self.adapters)

    @property
    def trainable(self) -> int:
        """What PEFT's get_nb_trainable_parameters() reports as trainable."""
        copies = sum(m.weight_numel + (m.out_features if m.bias else 0) for m in self.saved_copies)
        return self.adapter_params + copies + sum(m.out_features for m in self.trainable_bias_modules)

    def in_layer(self, layer: int) -> dict[str, Adapter]:
        """The adapters of decoder layer ``layer``, by short module name (q_proj, ...)."""
        return {a.module.short: a for a in self.adapters if a.module.layer == layer}

    def on(self, name: str) -> Adapter | None:
        return next((a for a in self.adapters if a.module.name == name), None)


def _layer_index(key: str, patterns: Sequence[str] | None) -> int | None:
    """The decoder-layer index in a module name, found the way PEFT finds it."""
    if not patterns:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
    else:
        match = None
        for pattern in patterns:
            match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", key)
            if match is not None:
                break
    return int(match.group("idx")) if match else None


def _is_target(spec: LoraSpec, targets: str | tuple[str, ...], key: str) -> bool:
    """PEFT's check_target_module_exists for one module name."""
    excluded = spec.exclude_modules
    if excluded:
        if isinstance(excluded, str):
            if re.fullmatch(excluded, key):
                return False
        elif key in excluded or any(key.endswith(f".{e}") for e in excluded):
            return False
    if spec.modules_to_save and any(re.match(rf"(^|.*\.){m}($|\..*)", key) for m in spec.modules_to_save):
        return False
    if isinstance(targets, str):
        return re.fullmatch(targets, key) is not None
    if key in targets:
        return True
    found = any(key.endswith(f".{t}") for t in targets)
    if found and spec.layers_to_transform:
        index = _layer_index(key, spec.layers_pattern)
        return index is not None and index in spec.layers_to_transform
    return found


def _rank(spec: LoraSpec, key: str) -> int:
    """PEFT's get_pattern_key: the first rank_pattern key that ends the module name wins."""
    for pattern, rank in spec.rank_pattern.items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return rank
    return spec.r


def resolve(spec: LoraSpec, shape: ModelShape) -> AdapterLayout:
    """Which modules get adapters, with which rank, and what else becomes trainable."""
    all_modules = modules(shape)
    candidates = [m for m in all_modules if m.kind in ("linear", "embedding")]
    targets: str | tuple[str, ...] = spec.targets
    if isinstance(targets, str) and targets.lower() == ALL_LINEAR:
        # PEFT expands all-linear to every nn.Linear except the output embedding (lm_head).
        targets = tuple(m.name for m in candidates if m.kind == "linear" and m.name != "lm_head")
    adapters = tuple(
        Adapter(m, _rank(spec, m.name), spec.dora, spec.lora_bias and m.kind == "linear")
        for m in candidates
        if _is_target(spec, targets, m.name)
    )
    if not adapters:
        raise UsageError(
            f"LoRA targets {spec.targets_text!r} match no module of this model "
            f"(its linear layers: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
            f"down_proj, lm_head; embedding: embed_tokens)"
        )
    if spec.lora_bias and spec.dora:
        raise UsageError("PEFT does not allow lora_bias together with DoRA")
    if spec.lora_bias and any(a.module.kind == "embedding" for a in adapters):
        raise UsageError("PEFT does not support lora_bias on an embedding")

    notes: list[str] = []
    copies: list[Module] = []
    for entry in spec.modules_to_save or ():
        matched = [m for m in all_modules if m.name.endswith(entry)]
        if not matched:
            notes.append(f"modules_to_save entry {entry!r} matches no parameter-owning module: ignored")
        copies.extend(m for m in matched if m not in copies)

    adapted = {a.module.name for a in adapters}
    if spec.bias == "all":
        biased = [m for m in all_modules if m.bias]
    elif spec.bias == "lora_only":
        biased = [m for m in all_modules if m.bias and m.name in adapted]
    else:
        biased = []
    return AdapterLayout(adapters, tuple(copies), tuple(biased), tuple(notes))
