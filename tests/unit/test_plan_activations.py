"""The activation model against what autograd really saves, and the loss spike against
what the allocator really holds, on tiny transformers + PEFT models on CPU.

Saved tensors are read off the autograd graph (each node's ``_saved_*`` tensors, counted
once per storage, parameters and Python scalars left out). On CPU dropout saves its mask
in the input dtype (CUDA's fused dropout saves a bool mask): the model is asked for that.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from lorascope.plan.activations import estimate, logits_bytes  # noqa: E402
from lorascope.plan.lora import LoraSpec, resolve  # noqa: E402
from lorascope.plan.shape import shape_from_config  # noqa: E402
from lorascope.plan.training import TrainingSetup  # noqa: E402

B, T = 3, 40
LLAMA = {
    "model_type": "llama",
    "hidden_size": 96,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 500,
}
QWEN2 = {**LLAMA, "model_type": "qwen2", "num_key_value_heads": 4}
_MODELS = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}


def saved_bytes(
    config: dict[str, Any], attention: str, dtype: Any, fp32_adapters: bool, **lora: Any
) -> tuple[int, int]:
    """(bytes autograd saves for backward outside the loss, bytes the loss node saves)."""
    config_cls, model_cls = _MODELS[config["model_type"]]
    fields = {k: v for k, v in config.items() if k != "model_type"}
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(
        getattr(transformers, config_cls)(**fields, attn_implementation=attention, use_cache=False)
    ).to(dtype)
    model = peft.get_peft_model(model, peft.LoraConfig(**lora), autocast_adapter_dtype=fp32_adapters)
    model.train()
    ids = torch.randint(0, config["vocab_size"], (B, T))
    loss = model(input_ids=ids, labels=ids).loss
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    body = head = 0
    stack, visited = [loss.grad_fn], set()
    saved_attrs: dict[type, list[str]] = {}
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        kind = type(node)
        if kind not in saved_attrs:
            saved_attrs[kind] = [a for a in dir(kind) if a.startswith("_saved_")]
        for attr in saved_attrs[kind]:
            value = getattr(node, attr)
            for tensor in value if isinstance(value, (tuple, list)) else (value,):
                if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
                    continue
                storage = tensor.untyped_storage()
                if storage.data_ptr() in params or storage.data_ptr() in seen:
                    continue
                seen.add(storage.data_ptr())
                if node.name() == "NllLossBackward0":
                    head += storage.nbytes()
                else:
                    body += storage.nbytes()
        stack.extend(next_node for next_node, _ in node.next_functions)
    return body, head


CASES = [
    (LLAMA, "sdpa", torch.bfloat16, False, {"target_modules": "all-linear"}),
    (LLAMA, "eager", torch.bfloat16, False, {"target_modules": "all-linear"}),
    (LLAMA, "eager", torch.bfloat16, True, {"target_modules": "all-linear"}),
    (LLAMA, "sdpa", torch.bfloat16, True, {"target_modules": ["q_proj", "v_proj"]}),
    (LLAMA, "eager", torch.bfloat16, False, {"target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.1}),
    (LLAMA, "sdpa", torch.bfloat16, False, {"target_modules": "all-linear", "lora_dropout": 0.1}),
    (LLAMA, "eager", torch.bfloat16, False, {"target_modules": ["gate_proj", "up_proj", "down_proj"]}),
    (LLAMA, "eager", torch.bfloat16, False, {"target_modules": ["k_proj", "o_proj"]}),
    (LLAMA, "sdpa", torch.bfloat16, False, {"target_modules": ["o_proj"]}),
    (LLAMA, "sdpa", torch.bfloat16, False, {"target_modules": ["q_proj", "v_proj"], "layers_to_transform": [1]}),
    (LLAMA, "eager", torch.float32, False, {"target_modules": "all-linear", "rank_pattern": {"down_proj": 2}}),
    (LLAMA, "sdpa", torch.float32, False, {"target_modules": ["v_proj", "down_proj"]}),
    (QWEN2, "eager", torch.bfloat16, False, {"target_modules": "all-linear", "lora_dropout": 0.1}),
    (QWEN2, "sdpa", torch.bfloat16, True, {"target_modules": "all-linear"}),
    (QWEN2, "eager", torch.bfloat16, True, {"target_modules": ["q_proj", "v_proj"]}),
    (QWEN2, "sdpa", torch.bfloat16, False, {"target_modules": ["k_proj", "up_proj"], "lora_dropout": 0.1}),
]


def _case_id(case: tuple[Any, ...]) -> str:
    config, attention, dtype, fp32_adapters, lora = case
    targets = lora["target_modules"]
    extras = [k for k in lora if k != "target_modules"] + (["fp32-adapters"] if fp32_adapters else [])
    return "-".join(
        [
            config["model_type"],
            attention,
            str(dtype).removeprefix("torch."),
            targets if isinstance(targets, str) else "+".join(targets),
            *extras,
        ]
    )


@pytest.mark.parametrize(
    ("config", "attention", "dtype", "fp32_adapters", "lora"), CASES, ids=[_case_id(case) for case in CASES]
)
def test_saved_activations_match_autograd(
    config: dict[str, Any], attention: str, dtype: Any, fp32_adapters: bool, lora: dict[str, Any]
) -> None:
    body, head = saved_bytes(config, attention, dtype, fp32_adapters, r=8, **lora)
    precision = "bf16" if dtype == torch.bfloat16 else "fp32"
    setup = TrainingSetup(precision=precision, fp32_adapters=fp32_adapters, attention=attention, seq=T, micro_batch=B)
    shape = shape_from_config(config)
    spec = LoraSpec.from_peft_dict(peft.LoraConfig(r=8, **lora).to_dict())
    planned = estimate(shape, resolve(spec, shape), spec, setup, mask_bytes=setup.compute_bytes)
    assert planned.saved == body
    assert head == 4 * B * T * config["vocab_size"] + 8 * B * T  # fp32 log-probs + int64 targets


def loss_peak(logits: Any, loss_fn: Any, trace: Path) -> int:
    """Peak bytes the CPU allocator adds while the loss runs forward and backward (from the
    profiler's memory events, as in a Kineto trace: "Total Allocated" after each event)."""
    from torch.profiler import ProfilerActivity, profile

    labels = torch.randint(0, logits.shape[-1], logits.shape[:-1])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss_fn(logits, labels).backward()
    prof.export_chrome_trace(str(trace))
    memory = [e["args"] for e in json.loads(trace.read_text())["traceEvents"] if e.get("name") == "[memory]"]
    assert memory, "the profiler recorded no allocations"
    before = memory[0]["Total Allocated"] - memory[0]["Bytes"]
    return max(m["Total Allocated"] for m in memory) - before


@pytest.mark.parametrize("loss", ["fp32-upcast", "native"])
def test_logits_spike_matches_the_allocator(loss: str, tmp_path: Path) -> None:
    """transformers' ForCausalLMLoss (fp32 upcast) and a plain bf16 cross-entropy, on logits
    that already exist (the model's lm_head output): the spike the plan adds on top."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    vocab, batch, seq = 4000, 2, 64
    logits = torch.randn(batch, seq, vocab, dtype=torch.bfloat16, requires_grad=True)
    if loss == "fp32-upcast":

        def loss_fn(x: Any, y: Any) -> Any:
            return ForCausalLMLoss(x, y, vocab)
    else:

        def loss_fn(x: Any, y: Any) -> Any:
            return torch.nn.functional.cross_entropy(x.view(-1, vocab), y.view(-1))

    measured = loss_peak(logits, loss_fn, tmp_path / "trace.json")
    shape = shape_from_config({**LLAMA, "vocab_size": vocab})
    planned = logits_bytes(shape, TrainingSetup(seq=seq, micro_batch=batch, loss=loss))
    assert measured == pytest.approx(planned, rel=0.01)
