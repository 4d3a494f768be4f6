"""Activation checkpointing's use_reentrant, read through the wrappers frameworks put around
torch's checkpoint (LLaMA-Factory's closure around a partial, nested partials), on a real
transformers model; a setting that cannot be read prints as unknown, never as a known kind."""

from __future__ import annotations

import functools
from collections.abc import Callable
from functools import WRAPPER_ASSIGNMENTS, wraps
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lorascope.detect.common import reentrancy  # noqa: E402
from lorascope.probes.grads import UNKNOWN, checkpointing_settings  # noqa: E402
from lorascope.text.summary import sharding_text  # noqa: E402


def _model() -> Any:
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2
    )
    return transformers.LlamaForCausalLM(config)


def llamafactory_style(gradient_checkpointing_func: Callable[..., Any]) -> Callable[..., Any]:
    """LLaMA-Factory 0.9's get_custom_gradient_checkpointing_func (model_utils/checkpointing.py),
    as it wraps the partial it is given: one level deeper than transformers' own."""

    @wraps(gradient_checkpointing_func, assigned=(*WRAPPER_ASSIGNMENTS, "__self__"))
    def custom_gradient_checkpointing_func(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return gradient_checkpointing_func(func, *args, **kwargs)

    return custom_gradient_checkpointing_func


def _enable(model: Any, func: Callable[..., Any]) -> Any:
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=func)
    return model


def _text(settings: dict[str, Any]) -> str:
    return sharding_text({"engine": None, "settings": {}, "checkpointing": settings})


def test_transformers_own_setting_is_read() -> None:
    model = _model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert checkpointing_settings(model) == {"enabled": True, "use_reentrant": [False]}


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_closure_around_the_partial_is_read_through(reentrant: bool) -> None:
    """LLaMA-Factory's default (use_reentrant=True inside its own wrapper) was recorded as
    ``[]`` and printed as "non-reentrant"."""
    checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=reentrant)
    model = _enable(_model(), llamafactory_style(checkpoint))
    settings = checkpointing_settings(model)
    assert settings["use_reentrant"] == [reentrant]
    assert _text(settings).endswith("activation checkpointing " + ("reentrant" if reentrant else "non-reentrant"))


def test_torch_checkpoint_without_a_setting_is_torchs_default() -> None:
    model = _enable(_model(), functools.partial(functools.partial(torch.utils.checkpoint.checkpoint)))
    assert checkpointing_settings(model)["use_reentrant"] == [True]


def test_an_opaque_checkpoint_function_is_unknown() -> None:
    class Opaque:
        def __call__(self, func: Callable[..., Any], *args: Any) -> Any:
            return torch.utils.checkpoint.checkpoint(func, *args, use_reentrant=True)

    model = _enable(_model(), Opaque())
    settings = checkpointing_settings(model)
    assert settings["use_reentrant"] == [UNKNOWN]
    text = _text(settings)
    assert "use_reentrant unknown" in text
    assert "non-reentrant" not in text


def test_an_empty_or_old_record_is_not_read_as_non_reentrant() -> None:
    """Records written before the probe read through wrappers: ``[]`` or ``[None]``."""
    assert reentrancy([]) == "(use_reentrant unknown)"
    assert reentrancy([None]) == "(use_reentrant unknown)"
    assert reentrancy([False]) == "non-reentrant"
    assert reentrancy([True, UNKNOWN]) == "reentrant (some modules' use_reentrant unknown)"
    assert reentrancy([False, True]) == "reentrant and non-reentrant"
