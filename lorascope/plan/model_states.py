"""Model states per GPU: frozen base weights, adapter weights, their gradients, the
optimizer's moments and fp32 master copy, and the parameters ZeRO-3 or FSDP gathers to
compute (FSDP's own facts: ``lorascope.plan.fsdp``).

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

from lorascope.plan import fsdp as fsdp_units
from lorascope.plan.params import ParamTensor, stored_bytes, tensor_bytes
from lorascope.plan.terms import Term
from lorascope.plan.training import TrainingSetup
from lorascope.units import count

ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq, fp32
MASTER_BYTES = 4


def _resident(tensors: Sequence[ParamTensor], setup: TrainingSetup, size: Callable[[ParamTensor], float]) -> float:
    """Bytes of these parameters that live on each GPU under the ZeRO stage or FSDP."""
    zero, n = setup.zero, setup.world
    if setup.fsdp is not None:
        return 0.0 if setup.fsdp.offload_params else sum(size(t) for t in tensors) / setup.shard_world
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
    zero, fsdp = setup.zero, setup.fsdp
    if fsdp is not None:
        if fsdp.offload_params:
            return f"{fsdp.label}: shards offloaded to CPU"
        kept = ", kept fp32 (mixed precision)" if fsdp.mixed_precision else ""
        if fsdp.strategy == "NO_SHARD":
            return f"replicated ({fsdp.label}){kept}"
        return f"/ {setup.shard_world} GPUs ({fsdp.label}){kept}"
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
    base = _resident(frozen, setup, lambda t: stored_bytes(t, setup))
    kept = 4 if setup.fsdp_master else setup.compute_bytes
    if setup.precision == "4bit":
        quantized = sum(t.numel for t in frozen if t.quantizable)
        base_detail = (
            f"{count(quantized)} NF4 layer weights x 0.516 B + {count(p_f - quantized)} others "
            f"x {kept} B, {_placement(setup)}"
        )
        base_formula = "(0.516 P_q + s P_other) [/N]"
    else:
        base_detail = f"{count(p_f)} x {kept} B, {_placement(setup)}"
        base_formula = "s P_frozen [/N]" if setup.fsdp is None else "s_k P_frozen / S"
    adapters = _resident(trainable, setup, lambda t: stored_bytes(t, setup))
    adapter_kept = 4 if setup.fsdp_master else setup.adapter_bytes
    return [
        Term(
            "base_weights",
            f"base weights (frozen, {'fp32 shards' if setup.fsdp_master else setup.precision})",
            round(base),
            base_formula,
            base_detail,
        ),
        Term(
            "adapter_weights",
            f"adapter weights ({'fp32' if adapter_kept == 4 else '16-bit'})",
            round(adapters),
            "a P_train [/N]" if setup.fsdp is None else "a_k P_train / S",
            f"{count(p_t)} x {adapter_kept} B, {_placement(setup)}",
        ),
    ]


def _fsdp_optimizer_terms(tensors: Sequence[ParamTensor], setup: TrainingSetup) -> list[Term]:
    """FSDP: the sharded gradients FSDP keeps after each reduce-scatter (in the sharded
    parameters' dtype), and torch Adam's moments, created like the sharded parameters. The
    sharded parameters are the optimizer's: no master copy beside them."""
    assert setup.fsdp is not None
    fsdp, shard = setup.fsdp, setup.shard_world
    p_t = sum(t.numel for t in tensors if t.trainable)
    kept = 4 if fsdp.mixed_precision else setup.adapter_bytes
    with_grad = fsdp_units.grad_numel(tensors, setup)
    where = "on CPU (offload_params)" if fsdp.offload_params else f"/ {shard} GPUs ({fsdp.label})"
    if fsdp.offload_params:
        grads, grad_formula = 0.0, "0 (sharded gradients go to CPU)"
    else:
        grads = with_grad * kept / shard
        grad_formula = "a_k P_grad / S"
    if fsdp.version == 1:
        grad_detail = (
            f"{count(with_grad)} elements: every parameter of a unit holding an adapter (FSDP1's flat parameter "
            f"requires grad as a whole) x {kept} B, {where}"
        )
    else:
        grad_detail = f"{count(with_grad)} trainable x {kept} B (FSDP2: frozen parameters get no gradient), {where}"
    adam = 0.0 if fsdp.offload_params else p_t * 2 * kept / shard
    return [
        Term("adapter_gradients", "adapter gradients (sharded)", round(grads), grad_formula, grad_detail),
        Term(
            "optimizer_states",
            f"optimizer state (Adam m, v {'fp32' if kept == 4 else '16-bit'})",
            round(adam),
            "2 a_k P_train / S",
            f"{count(p_t)} x 2 x {kept} B, {where}",
        ),
        Term(
            "master_weights",
            "master weights (fp32)",
            0,
            "0 (the sharded parameters are the optimizer's)",
            "none: FSDP steps on its sharded parameters" + (", kept fp32" if fsdp.mixed_precision else ""),
        ),
    ]


def optimizer_terms(tensors: Sequence[ParamTensor], setup: TrainingSetup) -> list[Term]:
    """Gradients, Adam moments and master weights of the trainable parameters."""
    if setup.fsdp is not None:
        return _fsdp_optimizer_terms(tensors, setup)
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
    """The parameters gathered whole to compute: FSDP's unsharded units (``fsdp_unsharded``),
    else ZeRO-3's module. ZeRO-3 all-gathers a module's full parameters to run it (and, in backward, holds the
    full 16-bit gradient of a trainable one before reduce-scattering it). The largest
    module bounds what one fetch holds; the prefetch bucket is under communication buffers."""
    if setup.fsdp is not None:
        held, how = fsdp_units.held_unsharded(tensors, setup)
        return Term(
            "fsdp_unsharded",
            "FSDP unsharded parameters",
            round(held),
            "root unit + 2 layer units (reshard after forward) or all units (not), in param_dtype",
            f"{how}, {setup.fsdp.label}",
        )
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
