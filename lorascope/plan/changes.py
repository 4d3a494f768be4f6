"""Changes that lower the per-GPU peak, each re-planned in full and ranked by the total it
gives; when no single change fits, the greedy combination that does."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lorascope.plan.budget import EDGE, FITS, PlanInputs, compute_budget, verdict
from lorascope.plan.lora import resolve
from lorascope.units import count

#: reduce_bucket_size values offered when DeepSpeed's bucket dwarfs the trainable count.
_BUCKET_SIZES = (10_000_000, 20_000_000, 50_000_000, 100_000_000, 200_000_000)
#: A change must save at least this much to be worth listing.
_MIN_SAVING = 64 << 20


@dataclass(frozen=True)
class Change:
    label: str
    #: What to set: the lorascope flag / DeepSpeed or training option.
    how: str
    total: int
    verdict: str

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "how": self.how, "total_bytes": self.total, "verdict": self.verdict}


Candidate = tuple[str, str, PlanInputs]


def _with(inputs: PlanInputs, **setup_changes: Any) -> PlanInputs:
    return dataclasses.replace(inputs, setup=dataclasses.replace(inputs.setup, **setup_changes))


def _with_zero(inputs: PlanInputs, **zero_changes: Any) -> PlanInputs:
    return _with(inputs, zero=dataclasses.replace(inputs.setup.zero, **zero_changes))


def _with_fsdp(inputs: PlanInputs, **fsdp_changes: Any) -> PlanInputs:
    assert inputs.setup.fsdp is not None
    return _with(inputs, fsdp=dataclasses.replace(inputs.setup.fsdp, **fsdp_changes))


def _zero3(i: PlanInputs) -> Candidate | None:
    if i.setup.fsdp is None and i.setup.zero.stage < 3:
        return "ZeRO-3 (partition the frozen base too)", "--zero 3 / zero_optimization.stage 3", _with_zero(i, stage=3)
    return None


def _fsdp_full_shard(i: PlanInputs) -> Candidate | None:
    fsdp = i.setup.fsdp
    if fsdp is None or fsdp.strategy == "FULL_SHARD":
        return None
    if fsdp.version == 2:
        how = "fully_shard(..., reshard_after_forward=True) on a 1-D mesh over every GPU"
    else:
        how = "ShardingStrategy.FULL_SHARD"
    return "FSDP FULL_SHARD (shard over every GPU, reshard after forward)", how, _with_fsdp(i, strategy="FULL_SHARD")


def _fsdp_offload(i: PlanInputs) -> Candidate | None:
    fsdp = i.setup.fsdp
    if fsdp is None or fsdp.offload_params:
        return None
    how = "CPUOffloadPolicy()" if fsdp.version == 2 else "CPUOffload(offload_params=True)"
    return "FSDP CPU offload (slow)", f"--offload-params / {how}", _with_fsdp(i, offload_params=True)


def _qlora(i: PlanInputs) -> Candidate | None:
    if i.setup.precision in ("bf16", "fp16"):
        return (
            "QLoRA: 4-bit NF4 base",
            "--precision 4bit / BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_use_double_quant=True)",
            _with(i, precision="4bit"),
        )
    return None


def _checkpointing(i: PlanInputs) -> Candidate | None:
    if i.setup.checkpointing == "none":
        return (
            "activation checkpointing (non-reentrant)",
            "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})",
            _with(i, checkpointing="non-reentrant"),
        )
    return None


def _chunked_loss(i: PlanInputs) -> Candidate | None:
    if i.setup.loss != "chunked":
        return (
            "chunked / fused cross-entropy",
            "--loss chunked / Liger fused linear cross-entropy or Cut Cross-Entropy",
            _with(i, loss="chunked"),
        )
    return None


def _fused_attention(i: PlanInputs) -> Candidate | None:
    if i.setup.attention == "eager":
        return "SDPA attention", "attn_implementation='sdpa' (or 'flash_attention_2')", _with(i, attention="sdpa")
    return None


def _micro_batch(i: PlanInputs) -> Candidate | None:
    mb = i.setup.micro_batch
    if mb == 1:
        return None
    # The largest divisor of the micro-batch that fits clear of the edge (so gradient
    # accumulation keeps the global batch exactly), else 1.
    divisors = [d for d in _divisors(mb) if d < mb]
    best = next((d for d in divisors if verdict(compute_budget(_with(i, micro_batch=d)).total, i.gpu_mem) == FITS), 1)
    return (
        f"micro-batch {best}",
        f"--micro-batch {best} with gradient_accumulation_steps x{mb // best} to keep the global batch",
        _with(i, micro_batch=best),
    )


#: Trial divisions, at most, when looking for a smaller micro-batch: a micro-batch read
#: from a record may be any integer (10^12), and the loop is bounded by this, not by it.
MAX_TRIAL_DIVISORS = 1 << 16


def _divisors(n: int) -> list[int]:
    """N's divisors, largest first: every one whose smaller cofactor is at most
    MAX_TRIAL_DIVISORS (all of them for any real micro-batch)."""
    small = [d for d in range(1, min(math.isqrt(n), MAX_TRIAL_DIVISORS) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)}, reverse=True)


def _offload_optimizer(i: PlanInputs) -> Candidate | None:
    zero = i.setup.zero
    if zero.stage >= 1 and not zero.offload_optimizer:
        return (
            "offload optimizer to CPU",
            "--offload-optimizer / offload_optimizer.device cpu",
            _with_zero(i, offload_optimizer=True),
        )
    return None


def _offload_params(i: PlanInputs) -> Candidate | None:
    zero = i.setup.zero
    if zero.stage == 3 and not zero.offload_params:
        return (
            "offload parameters to CPU (slow)",
            "--offload-params / offload_param.device cpu",
            _with_zero(i, offload_params=True, offload_optimizer=True),
        )
    return None


def _bucket(i: PlanInputs) -> Candidate | None:
    zero = i.setup.zero
    trainable = resolve(i.lora, i.shape).trainable
    size = next((s for s in _BUCKET_SIZES if s >= trainable), None)
    if zero.stage >= 1 and zero.contiguous_gradients and size is not None and size < zero.reduce_bucket_size:
        return (
            f"reduce_bucket_size {size:.0e} (sized to {count(trainable)} trainable params)",
            f"zero_optimization.reduce_bucket_size {size}",
            _with_zero(i, reduce_bucket_size=size),
        )
    return None


def _no_dropout(i: PlanInputs) -> Candidate | None:
    if i.lora.dropout > 0:
        return (
            "lora_dropout 0 (no per-module input copies)",
            "LoraConfig(lora_dropout=0.0)",
            dataclasses.replace(i, lora=dataclasses.replace(i.lora, dropout=0.0)),
        )
    return None


CANDIDATES: tuple[Callable[[PlanInputs], Candidate | None], ...] = (
    _zero3,
    _fsdp_full_shard,
    _qlora,
    _checkpointing,
    _chunked_loss,
    _fused_attention,
    _micro_batch,
    _offload_optimizer,
    _offload_params,
    _fsdp_offload,
    _bucket,
    _no_dropout,
)


def _single(inputs: PlanInputs, current: int) -> list[tuple[Change, PlanInputs]]:
    out = []
    for make in CANDIDATES:
        candidate = make(inputs)
        if candidate is None:
            continue
        label, how, changed = candidate
        total = compute_budget(changed).total
        if current - total >= _MIN_SAVING:
            out.append((Change(label, how, total, verdict(total, inputs.gpu_mem)), changed))
    return sorted(out, key=lambda pair: (pair[0].verdict not in (FITS, EDGE), pair[0].total))


def suggest(inputs: PlanInputs, current: int) -> list[Change]:
    """Single changes, ranked (the ones that fit first, then by the total they give); when
    none fits, append the combination reached by greedily taking the largest saving."""
    ranked = _single(inputs, current)
    changes = [change for change, _ in ranked]
    if current <= inputs.gpu_mem or any(c.verdict in (FITS, EDGE) for c in changes):
        return changes
    labels: list[str] = []
    hows: list[str] = []
    state, total = inputs, current
    while total > inputs.gpu_mem:
        options = _single(state, total)
        if not options:
            break
        best, state = min(options, key=lambda pair: pair[0].total)
        labels.append(best.label)
        hows.append(best.how)
        total = best.total
    if len(labels) > 1:
        changes.append(
            Change("combined: " + " + ".join(labels), "; ".join(hows), total, verdict(total, inputs.gpu_mem))
        )
    return changes
