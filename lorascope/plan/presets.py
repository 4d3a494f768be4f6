"""Built-in model shapes, as the transformers config fields of the published checkpoints
(no download). Each preset goes through the same parser as a user's config.json."""

from __future__ import annotations

from typing import Any

from lorascope.errors import UsageError
from lorascope.plan.shape import ModelShape, shape_from_config


def _cfg(
    model_type: str, hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int, tied: bool = False
) -> dict[str, Any]:
    return {
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
    }


#: preset name -> (display name, config fields). Figures from each model's config.json.
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-3-8b": ("Llama-3-8B", _cfg("llama", 4096, 14336, 32, 32, 8, 128256)),
    "llama-3-70b": ("Llama-3-70B", _cfg("llama", 8192, 28672, 80, 64, 8, 128256)),
    "llama-3.2-1b": ("Llama-3.2-1B", _cfg("llama", 2048, 8192, 16, 32, 8, 128256, tied=True)),
    "llama-2-7b": ("Llama-2-7B", _cfg("llama", 4096, 11008, 32, 32, 32, 32000)),
    "mistral-7b": ("Mistral-7B-v0.1", _cfg("mistral", 4096, 14336, 32, 32, 8, 32000)),
    "qwen2-7b": ("Qwen2-7B", _cfg("qwen2", 3584, 18944, 28, 28, 4, 152064)),
    "qwen2-0.5b": ("Qwen2-0.5B", _cfg("qwen2", 896, 4864, 24, 14, 2, 151936, tied=True)),
    # The probes' test-bed job (probes/train_lora.py defaults): a random 2-layer Llama.
    "tiny-llama": ("tiny Llama (probes test bed)", _cfg("llama", 64, 128, 2, 4, 2, 512)),
}


def preset_shape(name: str) -> ModelShape:
    try:
        display, config = PRESETS[name.lower()]
    except KeyError:
        raise UsageError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
    return shape_from_config(config, name=display)


def preset_config(name: str) -> dict[str, Any]:
    """The config fields of a preset (a copy), e.g. to build the model in tests."""
    return dict(PRESETS[name.lower()][1])
