"""Model-state terms against DeepSpeed's own estimators, where both model the same thing.

DeepSpeed's estimators assume full fine-tuning: every parameter trained, 16-bit weights, an
fp32 master copy and Adam. Two comparisons follow from that (docs/memory-model.md, "Against
DeepSpeed's estimator"): (1) with every parameter trainable the plan must give DeepSpeed's
per-GPU figure; (2) under LoRA, the plan's adapter states must be DeepSpeed's figure for the
trainable parameters alone, and the frozen base only its 16-bit weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import re

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    stage2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")

from lorascope.plan import model_states  # noqa: E402
from lorascope.plan.lora import AdapterLayout, LoraSpec, resolve  # noqa: E402
from lorascope.plan.params import ParamTensor, count_params, param_tensors  # noqa: E402
from lorascope.plan.presets import preset_config, preset_shape  # noqa: E402
from lorascope.plan.shape import shape_from_config  # noqa: E402
from lorascope.plan.training import TrainingSetup, ZeroSetup  # noqa: E402

GIB = 1 << 30
NO_ADAPTERS = AdapterLayout((), (), (), ())
STATE_KEYS = ("base_weights", "adapter_weights", "adapter_gradients", "optimizer_states", "master_weights")


def full_finetune(preset: str) -> list[ParamTensor]:
    """The base model's parameters, all trainable: what DeepSpeed's estimators assume."""
    return [dataclasses.replace(t, trainable=True) for t in param_tensors(preset_shape(preset), NO_ADAPTERS)]


def states(tensors: list[ParamTensor], setup: TrainingSetup, keys: tuple[str, ...] = STATE_KEYS) -> int:
    terms = model_states.weight_terms(tensors, setup) + model_states.optimizer_terms(tensors, setup)
    return sum(t.bytes for t in terms if t.key in keys)


def setup(stage: int, gpus: int, nodes: int = 1, **zero: object) -> TrainingSetup:
    return TrainingSetup(zero=ZeroSetup(stage=stage, **zero), gpus_per_node=gpus, nodes=nodes)


def gpu_column(printed: str) -> dict[str, float]:
    """The per-GPU GB column of an *_all_live / *_all_cold table, by options, normalised
    ("offload_param=cpu,offload_optimizer=none,zero_init=1": the enum prints differently
    across Python versions)."""
    rows = re.findall(r"^\s*([\d.]+)GB \|\s*([\d.]+)GB \| (.+)$", printed, flags=re.MULTILINE)
    return {re.sub(r"OffloadDeviceEnum\.|\s", "", options): float(gpu) for _, gpu, options in rows}


@pytest.mark.parametrize(("preset", "gpus", "nodes"), [("llama-3-8b", 8, 1), ("llama-3-70b", 8, 2), ("qwen2-7b", 4, 1)])
@pytest.mark.parametrize("offload", [False, True])
def test_zero2_full_finetune_equals_deepspeed(preset: str, gpus: int, nodes: int, offload: bool) -> None:
    tensors = full_finetune(preset)
    total = sum(t.numel for t in tensors)
    _, ds_gpu = stage2.estimate_zero2_model_states_mem_needs(total, gpus, nodes, cpu_offload=offload)
    assert states(tensors, setup(2, gpus, nodes, offload_optimizer=offload)) == pytest.approx(ds_gpu, abs=8)


@pytest.mark.parametrize(("preset", "gpus", "nodes"), [("llama-3-8b", 8, 1), ("llama-3-70b", 8, 2)])
@pytest.mark.parametrize(("offload", "offload_params"), [(False, False), (True, False), (True, True)])
def test_zero3_full_finetune_equals_deepspeed_with_fp32_grad_accumulation(
    preset: str, gpus: int, nodes: int, offload: bool, offload_params: bool
) -> None:
    """DeepSpeed's 18 bytes per parameter are ZeRO-3's holdings with grad_accum_dtype fp32
    (no persistent parameters, which the estimator ignores)."""
    tensors = full_finetune(preset)
    total = sum(t.numel for t in tensors)
    largest = count_params(preset_shape(preset), NO_ADAPTERS).largest_module_numel
    _, ds_gpu, _ = stage3.estimate_zero3_model_states_mem_needs(
        total, largest, gpus, nodes, cpu_offload=offload, cpu_offload_params=offload_params
    )
    plan = setup(
        3,
        gpus,
        nodes,
        offload_optimizer=offload,
        offload_params=offload_params,
        param_persistence_threshold=0,
        grad_accum_dtype="fp32",
    )
    gathered = model_states.gathered_term(tensors, plan).bytes
    assert states(tensors, plan) + gathered == pytest.approx(ds_gpu, abs=8)


def test_zero3_default_grad_accumulation_adds_the_16bit_gradient_partition() -> None:
    """With DeepSpeed's default (gradients accumulated in the 16-bit model dtype) ZeRO-3 keeps
    that partition and builds an fp32 copy at the step: 2 bytes per parameter per GPU more."""
    tensors = full_finetune("llama-3-8b")
    total = sum(t.numel for t in tensors)
    largest = count_params(preset_shape("llama-3-8b"), NO_ADAPTERS).largest_module_numel
    # 16 GPUs: each rank's partition (~0.5e9) is under one optimizer sub-group (1e9 elements).
    _, ds_gpu, _ = stage3.estimate_zero3_model_states_mem_needs(
        total, largest, 8, 2, cpu_offload=False, cpu_offload_params=False
    )
    plan = setup(3, 8, 2, param_persistence_threshold=0)
    ours = states(tensors, plan) + model_states.gathered_term(tensors, plan).bytes
    assert ours - ds_gpu == pytest.approx(2 * total / 16, abs=8)


def test_all_cold_tables_for_llama3_70b(capsys: pytest.CaptureFixture[str]) -> None:
    """The printed *_all_cold tables, fed our parameter counts (meta-free)."""
    tensors = full_finetune("llama-3-70b")
    total = sum(t.numel for t in tensors)
    largest = count_params(preset_shape("llama-3-70b"), NO_ADAPTERS).largest_module_numel
    stage3.estimate_zero3_model_states_mem_needs_all_cold(total, largest, num_gpus_per_node=8, num_nodes=4)
    table3 = gpu_column(capsys.readouterr().out)
    stage2.estimate_zero2_model_states_mem_needs_all_cold(total, num_gpus_per_node=8, num_nodes=4)
    table2 = gpu_column(capsys.readouterr().out)
    for options, offload, offload_params in (
        ("offload_param=none,offload_optimizer=none,zero_init=1", False, False),
        ("offload_param=none,offload_optimizer=cpu,zero_init=1", True, False),
        ("offload_param=cpu,offload_optimizer=cpu,zero_init=1", True, True),
    ):
        plan = setup(
            3,
            8,
            4,
            offload_optimizer=offload,
            offload_params=offload_params,
            param_persistence_threshold=0,
            grad_accum_dtype="fp32",
        )
        ours = states(tensors, plan) + model_states.gathered_term(tensors, plan).bytes
        assert ours / GIB == pytest.approx(table3[options], abs=0.006), options
    for options, offload in (("offload_optimizer=none", False), ("offload_optimizer=cpu", True)):
        ours = states(tensors, setup(2, 8, 4, offload_optimizer=offload))
        assert ours / GIB == pytest.approx(table2[options], abs=0.006), options


def test_all_live_on_a_real_model(capsys: pytest.CaptureFixture[str]) -> None:
    """*_all_live reads a real module (it de-duplicates parameters by data_ptr, so it needs
    storage: on the meta device every data_ptr is 0). to_empty gives storage without init."""
    config = {
        "model_type": "llama",
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 3,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "tie_word_embeddings": True,
    }
    fields = {k: v for k, v in config.items() if k != "model_type"}
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)).to(torch.bfloat16)
    model = model.to_empty(device="cpu")
    model.tie_weights()
    tensors = [dataclasses.replace(t, trainable=True) for t in param_tensors(shape_from_config(config), NO_ADAPTERS)]
    assert stage3.model_to_params(model)[0] == sum(t.numel for t in tensors)
    stage3.estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=2)
    table3 = gpu_column(capsys.readouterr().out)
    plan = setup(3, 2, param_persistence_threshold=0, grad_accum_dtype="fp32")
    ours = states(tensors, plan) + model_states.gathered_term(tensors, plan).bytes
    assert ours / GIB == pytest.approx(table3["offload_param=none,offload_optimizer=none,zero_init=1"], abs=0.006)
    stage2.estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=2)
    table2 = gpu_column(capsys.readouterr().out)
    assert states(tensors, setup(2, 2)) / GIB == pytest.approx(table2["offload_optimizer=none"], abs=0.006)


def test_meta_model_breaks_all_live_total_but_not_largest_layer() -> None:
    """Why the tests above feed *_all_cold our counts for the big models."""
    config = preset_config("llama-3-8b")
    fields = {k: v for k, v in config.items() if k != "model_type"}
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields))
    total, largest = stage3.model_to_params(model)
    counts = count_params(preset_shape("llama-3-8b"), NO_ADAPTERS)
    assert largest == counts.largest_module_numel
    assert total != counts.base  # every meta data_ptr is 0: the de-duplication keeps one tensor


@pytest.mark.parametrize("stage", [2, 3])
def test_lora_adapter_states_are_deepspeed_on_the_trainable_params(stage: int) -> None:
    """Under LoRA only the adapters carry gradients, master copy and moments: DeepSpeed's
    formula applied to the trainable count; the frozen base costs its 16-bit weights."""
    shape = preset_shape("llama-3-8b")
    spec = LoraSpec(r=16, targets="all-linear")
    tensors = param_tensors(shape, resolve(spec, shape))
    trainable = sum(t.numel for t in tensors if t.trainable)
    frozen = sum(t.numel for t in tensors if not t.trainable)
    assert trainable == 41_943_040
    adapter_keys = STATE_KEYS[1:]
    if stage == 2:
        plan = setup(2, 8)
        _, ds_gpu = stage2.estimate_zero2_model_states_mem_needs(trainable, 8, 1, cpu_offload=False)
        assert states(tensors, plan, ("base_weights",)) == 2 * frozen
    else:
        plan = setup(3, 8, param_persistence_threshold=0, grad_accum_dtype="fp32")
        _, ds_gpu, ds_largest = stage3.estimate_zero3_model_states_mem_needs(
            trainable, 0, 8, 1, cpu_offload=False, cpu_offload_params=False
        )
        assert states(tensors, plan, ("base_weights",)) == pytest.approx(2 * frozen / 8, abs=1)
    assert states(tensors, plan, adapter_keys) == pytest.approx(ds_gpu, abs=8)
