"""The shape of a Llama-style decoder, read from a transformers ``config.json``, and the
modules a transformers model of that shape has, named exactly as ``named_modules()`` names
them (PEFT matches LoRA targets against those names)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorascope.errors import BadInputError
from lorascope.rundir.format.safe_open import loads_json, read_capped

#: Model types whose transformers implementation this model follows term by term.
KNOWN_MODEL_TYPES = ("llama", "mistral", "qwen2")
#: Keys that mark a mixture-of-experts config: its MLP is not one gate/up/down triple.
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")

#: The seven linear layers of one decoder layer, as (suffix under ``model.layers.N.``).
ATTENTION_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP_LINEARS = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@dataclass(frozen=True)
class ModelShape:
    """What the memory model needs to know about the base model."""

    name: str
    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool

    @property
    def q_width(self) -> int:
        """Output width of q_proj (and input width of o_proj): heads x head_dim."""
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim


@dataclass(frozen=True)
class Module:
    """One module that owns parameters directly (DeepSpeed's and PEFT's unit)."""

    name: str
    kind: str  # "linear" | "embedding" | "norm"
    layer: int | None
    in_features: int
    out_features: int
    bias: bool = False
    #: lm_head whose weight *is* the input embedding's (tie_word_embeddings): owns no storage.
    tied: bool = False

    @property
    def short(self) -> str:
        return self.name.rsplit(".", 1)[-1]

    @property
    def weight_numel(self) -> int:
        return self.in_features * self.out_features if self.kind != "norm" else self.out_features

    @property
    def numel(self) -> int:
        """Parameters this module adds to the model (0 for a tied lm_head)."""
        if self.tied:
            return 0
        return self.weight_numel + (self.out_features if self.bias else 0)


def modules(shape: ModelShape) -> list[Module]:
    """Every parameter-owning module, in ``named_modules()`` order."""
    h, q, kv, inter = shape.hidden, shape.q_width, shape.kv_width, shape.intermediate
    out = [Module("model.embed_tokens", "embedding", None, shape.vocab, h)]
    widths = {
        "self_attn.q_proj": (h, q, shape.qkv_bias),
        "self_attn.k_proj": (h, kv, shape.qkv_bias),
        "self_attn.v_proj": (h, kv, shape.qkv_bias),
        "self_attn.o_proj": (q, h, shape.o_bias),
        "mlp.gate_proj": (h, inter, shape.mlp_bias),
        "mlp.up_proj": (h, inter, shape.mlp_bias),
        "mlp.down_proj": (inter, h, shape.mlp_bias),
    }
    for i in range(shape.layers):
        prefix = f"model.layers.{i}."
        for suffix in ATTENTION_LINEARS + MLP_LINEARS:
            fan_in, fan_out, bias = widths[suffix]
            out.append(Module(prefix + suffix, "linear", i, fan_in, fan_out, bias))
        out.append(Module(prefix + "input_layernorm", "norm", i, h, h))
        out.append(Module(prefix + "post_attention_layernorm", "norm", i, h, h))
    out.append(Module("model.norm", "norm", None, h, h))
    out.append(Module("lm_head", "linear", None, h, shape.vocab, tied=shape.tied_embeddings))
    return out


def _positive_int(config: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise BadInputError(f"model config: {key} must be a positive integer, got {value!r}")
    return value


def shape_from_config(config: Mapping[str, Any], name: str | None = None) -> ModelShape:
    """A ModelShape from a transformers config dict (``config.json`` or ``config.to_dict()``)."""
    if not isinstance(config, Mapping):
        raise BadInputError("model config must be a JSON object")
    missing = [key for key in _REQUIRED if key not in config]
    if missing:
        nested = " (it has a text_config: give that part)" if "text_config" in config else ""
        raise BadInputError(f"model config lacks {', '.join(missing)}: not a decoder-only LM config{nested}")
    for key in _MOE_KEYS:
        value = config.get(key)
        if isinstance(value, int) and value > 1:
            raise BadInputError(f"model config has {key}={value}: mixture-of-experts models are not modelled")
    model_type = str(config.get("model_type") or "unknown")
    hidden = _positive_int(config, "hidden_size")
    heads = _positive_int(config, "num_attention_heads")
    kv_heads = _positive_int(config, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise BadInputError(
            f"model config: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        )
    head_dim = config.get("head_dim") or None
    if head_dim is None:
        if hidden % heads:
            raise BadInputError(f"model config: hidden_size {hidden} is not divisible by num_attention_heads {heads}")
        head_dim = hidden // heads
    head_dim = _positive_int({"head_dim": head_dim}, "head_dim")
    attention_bias = bool(config.get("attention_bias", False))
    return ModelShape(
        name=name or str(config.get("_name_or_path") or model_type),
        model_type=model_type,
        hidden=hidden,
        intermediate=_positive_int(config, "intermediate_size"),
        layers=_positive_int(config, "num_hidden_layers"),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=_positive_int(config, "vocab_size"),
        # LlamaConfig, MistralConfig and Qwen2Config all default to untied embeddings.
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        # Qwen2 hard-codes bias on q/k/v (not o); Llama has one switch for all four.
        qkv_bias=True if model_type == "qwen2" else attention_bias,
        o_bias=False if model_type == "qwen2" else attention_bias,
        mlp_bias=bool(config.get("mlp_bias", False)),
    )


def load_config_file(path: Path) -> dict[str, Any]:
    """Read a config.json (or a model directory holding one); BadInputError on any failure
    (a FIFO or a device is refused, a file over the record size limit too: a config is a
    few KiB)."""
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise BadInputError(f"{path}: no such file")
    data = loads_json(read_capped(path, "record_bytes", "the config"), path, "the config")
    if not isinstance(data, dict):
        raise BadInputError(f"{path}: expected a JSON object")
    return data
