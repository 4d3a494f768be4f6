"""Trainable and total parameter counts of `lorascope plan` against PEFT's own count
(`get_nb_trainable_parameters()`) on real transformers models built on the meta device."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from lorascope.plan.lora import LoraSpec, resolve  # noqa: E402
from lorascope.plan.params import count_params  # noqa: E402
from lorascope.plan.presets import preset_config  # noqa: E402
from lorascope.plan.shape import shape_from_config  # noqa: E402

_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_CONFIGS = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config"}


def peft_counts(config: dict[str, Any], **lora: Any) -> tuple[int, int]:
    """(trainable, all) as PEFT reports them for the model with this config."""
    fields = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = getattr(transformers, _CONFIGS[config["model_type"]])(**fields)
    with torch.device("meta"):
        model = getattr(transformers, _CLASSES[config["model_type"]])(hf_config)
        model = peft.get_peft_model(model, peft.LoraConfig(**lora))
    return model.get_nb_trainable_parameters()


def planned_counts(config: dict[str, Any], **lora: Any) -> tuple[int, int]:
    spec = LoraSpec.from_peft_dict(peft.LoraConfig(**lora).to_dict())
    shape = shape_from_config(config)
    counts = count_params(shape, resolve(spec, shape))
    return counts.trainable, counts.total


def test_llama3_8b_all_linear_r16_is_41943040() -> None:
    config = preset_config("llama-3-8b")
    lora = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}
    assert planned_counts(config, **lora)[0] == 41_943_040
    assert planned_counts(config, **lora) == peft_counts(config, **lora)


def test_llama3_70b_attention_r16_is_65536000() -> None:
    config = preset_config("llama-3-70b")
    lora = {"r": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    assert planned_counts(config, **lora)[0] == 65_536_000
    assert planned_counts(config, **lora) == peft_counts(config, **lora)


@pytest.mark.parametrize(
    ("preset", "lora"),
    [
        ("mistral-7b", {"r": 8}),  # PEFT's default targets: q_proj, v_proj
        ("mistral-7b", {"r": 64, "target_modules": ["gate_proj", "up_proj", "down_proj"]}),
        ("qwen2-7b", {"r": 16, "target_modules": "all-linear", "use_rslora": True}),
        ("qwen2-7b", {"r": 8, "target_modules": ["q_proj", "k_proj"], "bias": "all"}),
        ("qwen2-0.5b", {"r": 32, "target_modules": "all-linear", "lora_dropout": 0.05}),
        ("llama-3.2-1b", {"r": 16, "target_modules": ["q_proj", "v_proj", "lm_head"]}),
        ("llama-2-7b", {"r": 8, "target_modules": r".*\.layers\.(0|1|2)\..*_proj"}),
        ("llama-2-7b", {"r": 4, "target_modules": ["q_proj", "v_proj"], "layers_to_transform": [0, 5, 31]}),
        ("tiny-llama", {"r": 8, "target_modules": "all-linear", "rank_pattern": {"down_proj": 2, "q_proj": 16}}),
        ("tiny-llama", {"r": 4, "target_modules": "all-linear", "exclude_modules": ["o_proj"]}),
        ("tiny-llama", {"r": 4, "target_modules": ["q_proj", "v_proj"], "use_dora": True}),
        ("tiny-llama", {"r": 4, "target_modules": ["q_proj", "embed_tokens"], "modules_to_save": ["lm_head"]}),
        ("qwen2-0.5b", {"r": 4, "target_modules": ["q_proj"], "lora_bias": True, "bias": "lora_only"}),
    ],
)
def test_counts_equal_peft(preset: str, lora: dict[str, Any]) -> None:
    config = preset_config(preset)
    assert planned_counts(config, **lora) == peft_counts(config, **lora)


def test_expanded_target_set_as_recorded_after_get_peft_model() -> None:
    """After get_peft_model, PEFT's config holds all-linear expanded to full module names."""
    config = preset_config("tiny-llama")
    fields = {k: v for k, v in config.items() if k != "model_type"}
    with torch.device("meta"):
        model = peft.get_peft_model(
            transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)),
            peft.LoraConfig(r=8, target_modules="all-linear"),
        )
    recorded = model.peft_config["default"].to_dict()
    assert not isinstance(recorded["target_modules"], str)
    shape = shape_from_config(config)
    assert (
        count_params(shape, resolve(LoraSpec.from_peft_dict(recorded), shape)).trainable
        == model.get_nb_trainable_parameters()[0]
    )


def test_base_count_equals_model_parameters() -> None:
    for preset in ("llama-3-8b", "qwen2-0.5b"):
        config = preset_config(preset)
        fields = {k: v for k, v in config.items() if k != "model_type"}
        with torch.device("meta"):
            model = getattr(transformers, _CLASSES[config["model_type"]])(
                getattr(transformers, _CONFIGS[config["model_type"]])(**fields)
            )
        shape = shape_from_config(config)
        assert count_params(shape, resolve(LoraSpec(), shape)).base == sum(p.numel() for p in model.parameters())
