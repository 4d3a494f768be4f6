"""Model states per GPU: frozen base weights, adapter weights, their gradients, the
optimizer's moments and fp32 master copy, and the parameters ZeRO-3 gathers to compute.

DeepSpeed behaviour followed here (0.19): with bf16/fp16 the engine casts every parameter
to the 16-bit dtype; only parameters with requires_grad enter the optimizer, so the frozen
base gets no gradient, master copy or moments at any stage. ZeRO-1/2 partition only what
the optimizer owns (the frozen base stays replicated); ZeRO-3 partitions every parameter,
frozen or not, except those at or under ``stage3_param_persistence_threshold`` elements,
which stay whole on every rank next to their partition.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

from lorascope.plan.params import ParamTensor, tensor_bytes
from lorascope.plan.terms import Term
from lorascope.plan.training import TrainingSetup
from lorascope.units import count

ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq, fp32
MASTER_BYTES = 4


def _resident(tensors: Sequence[ParamTensor], setup: TrainingSetup, size: Callable[[ParamTensor], float]) -> float:
    """Bytes of these parameters that live on each GPU under the ZeRO stage."""
    zero, n = setup.zero, setup.world
    if zero.stage < 3:
        return sum(size(t) for t in tensors)
    total = 0.0
    for t in tensors:
        if t.numel <= zero.param_persistence_threshold:
            # Persistent: kept gathered, and its partition stays allocated too (unless offloaded).
            total += size(t) * (1 if zero.offload_params else 1 + 1 / n)
        elif not zero.offload_params:
            total += size(t) / n
    return total


def _placement(setup: TrainingSetup) -> str:
    zero = setup.zero
    if zero.stage < 3:
        return f"replicated (ZeRO-{zero.stage} does not partition parameters)"
    if zero.offload_params:
        return "partitions offloaded to CPU; params <= persistence threshold stay whole"
    return f"/ {setup.world} GPUs (ZeRO-3); params <= {count(zero.param_persistence_threshold)} elements stay whole"


def weight_terms(tensors: Sequence[ParamTensor], setup: TrainingSetup) -> list[Term]:
    frozen = [t for t in tensors if not t.trainable]
    trainable = [t for t in tensors if t.trainable]
    p_f = sum(t.numel for t in frozen)
    p_t = sum(t.numel for t in trainable)
    base = _resident(frozen, setup, lambda t: tensor_bytes(t, setup))
    if setup.precision == "4bit":
        quantized = sum(t.numel for t in frozen if t.quantizable)
        base_detail = (
            f"{count(quantized)} NF4 layer weights x 0.516 B + {count(p_f - quantized)} others "
            f"x {setup.compute_bytes} B, {_placement(setup)}"
        )
        base_formula = "(0.516 P_q + s P_other) [/N]"
    else:
        base_detail = f"{count(p_f)} x {setup.compute_bytes} B, {_placement(setup)}"
        base_formula = "s P_frozen [/N]"
    adapters = _resident(trainable, setup, lambda t: tensor_bytes(t, setup))
    return [
        Term("base_weights", f"base weights (frozen, {setup.precision})", round(base), base_formula, base_detail),
        Term(
            "adapter_weights",
            f"adapter weights ({'fp32' if setup.adapter_bytes == 4 else '16-bit'})",
            round(adapters),
            "a P_train [/N]",
            f"{count(p_t)} x {setup.adapter_bytes} B, {_placement(setup)}",
        ),
    ]


def optimizer_terms(tensors: Sequence[ParamTensor], setup: TrainingSetup) -> list[Term]:
    """Gradients, Adam moments and master weights of the trainable parameters."""
    zero, n = setup.zero, setup.world
    p_t = sum(t.numel for t in tensors if t.trainable)
    g = setup.grad_bytes
    # The optimizer steps on fp32: with 16-bit gradients DeepSpeed first builds an fp32 copy
    # of this rank's gradient partition (a no-op when gradients are already fp32).
    fp32_copy = MASTER_BYTES if setup.mixed_precision and g != 4 else 0
    shard = p_t / n if zero.stage >= 1 else p_t
    offloaded = zero.offload_optimizer

    grads: float
    if zero.stage == 0:
        grads, grad_formula = p_t * (g + fp32_copy), "(g + c) P_train"
    elif zero.stage == 1:
        grads = p_t * g + (0 if offloaded else shard * fp32_copy)
        grad_formula = "g P_train + c P_train/N"
    elif offloaded:
        grads, grad_formula = 0, "0 (reduced gradients go to CPU)"
    elif zero.stage == 2:
        grads, grad_formula = shard * (g + fp32_copy), "(g + c) P_train/N"
    else:
        # ZeRO-3 keeps a flat gradient partition (grad_accum_dtype) for the whole run and
        # builds the fp32 copy one optimizer sub-group at a time.
        grads = shard * g + min(shard, zero.sub_group_size) * fp32_copy
        grad_formula = "g P_train/N + c min(P_train/N, sub_group_size)"
    grad_detail = f"{count(p_t)} trainable, g = {g} B kept, c = {fp32_copy} B fp32 copy at the step" + (
        f", ZeRO-{zero.stage} over {n} GPUs" if zero.stage else ""
    )

    where = "on CPU (offload_optimizer)" if offloaded else (f"/ {n} GPUs" if zero.stage else "replicated")
    adam = 0 if offloaded else shard * ADAM_STATE_BYTES
    master = 0 if offloaded or not setup.mixed_precision else shard * MASTER_BYTES
    if setup.mixed_precision:
        master_detail = f"{count(p_t)} x 4 B, {where}"
    else:
        master_detail = "none: the trainable weights are fp32 and are their own master copy"
    return [
        Term("adapter_gradients", "adapter gradients", round(grads), grad_formula, grad_detail),
        Term(
            "optimizer_states",
            "optimizer state (Adam m, v fp32)",
            round(adam),
            "8 P_train [/N]",
            f"{count(p_t)} x 8 B, {where}",
        ),
        Term("master_weights", "master weights (fp32)", round(master), "4 P_train [/N]", master_detail),
    ]


def gathered_term(tensors: Sequence[ParamTensor], setup: TrainingSetup) -> Term:
    """ZeRO-3 all-gathers a module's full parameters to run it (and, in backward, holds the
    full 16-bit gradient of a trainable one before reduce-scattering it). The largest
    module bounds what one fetch holds; the prefetch bucket is under communication buffers."""
    if setup.zero.stage < 3:
        return Term(
            "zero3_gathered",
            "ZeRO-3 gathered parameters",
            0,
            "0 (ZeRO-3 only)",
            f"ZeRO-{setup.zero.stage} keeps parameters whole",
        )
    per_module: dict[str, float] = defaultdict(float)
    for t in tensors:
        per_module[t.module] += tensor_bytes(t, setup) + (t.numel * setup.adapter_bytes if t.trainable else 0)
    largest = max(per_module, key=per_module.__getitem__)
    return Term(
        "zero3_gathered",
        "ZeRO-3 gathered parameters",
        round(per_module[largest]),
        "bytes of the largest module (+ its 16-bit gradient if trainable)",
        f"{largest}: whole on every GPU while it runs",
    )
