"""Memory outside the model states and activations: the CUDA context, NCCL's buffers, and
DeepSpeed's gradient buckets and ZeRO-3 prefetch, or FSDP's reduce-scatter and all-gather
buffers.

The two fixed figures are typical values, not derived: a PyTorch CUDA context with cuBLAS
workspaces takes roughly 0.4-0.6 GiB on Ampere/Hopper with lazy module loading, and NCCL's
per-communicator buffers a few hundred MiB on a node of 8. Both are counted outside torch's
caching allocator (nvidia-smi sees them, torch.cuda.max_memory_allocated does not), though
cuBLAS's workspaces are in fact allocated through it (2 x 32 MiB on an H200: see
plan-deviation's CUDA tolerance): the plan's allocator-held figure is that much short.
"""

from __future__ import annotations

from collections.abc import Sequence

from lorascope.plan import fsdp as fsdp_units
from lorascope.plan.params import ParamTensor
from lorascope.plan.terms import Term
from lorascope.plan.training import NF4_BYTES_PER_PARAM, TrainingSetup
from lorascope.units import count

FRAMEWORK_BYTES = 512 << 20
NCCL_BYTES = 256 << 20
#: DeepSpeed's engine without ZeRO all-reduces gradients flattened in buckets of this many elements.
ALLREDUCE_BUCKET = 500_000_000


def _fsdp_buffers(tensors: Sequence[ParamTensor], setup: TrainingSetup) -> Term:
    """One unit's gradient on its way through the reduce-scatter, and FSDP2's flat
    all-gather output (both transient, taken at once as an upper estimate)."""
    assert setup.fsdp is not None
    grads, gather = fsdp_units.reduce_scatter_bytes(tensors, setup)
    reduce = "fp32" if setup.fsdp.reduce_fp32 else "param_dtype"
    detail = f"largest unit's unsharded gradient + its {reduce} reduce-scatter copy and 1/{setup.shard_world} output"
    if gather:
        detail += " + the largest unit's flat all-gather output (FSDP2 copies it out to the parameters)"
    return Term(
        "fsdp_buffers",
        "FSDP reduce-scatter / all-gather buffers",
        round(grads + gather),
        "unit gradient x (a + r) + r/S (+ one unit's all-gather output, FSDP2)",
        detail,
    )


def _deepspeed_buffers(tensors: Sequence[ParamTensor], setup: TrainingSetup) -> Term:
    zero, n = setup.zero, setup.world
    p_t = sum(t.numel for t in tensors if t.trainable)
    if zero.stage == 0:
        buckets = min(p_t, ALLREDUCE_BUCKET) * setup.adapter_bytes if n > 1 else 0
        detail = f"gradient all-reduce flattening: min(P_train, {count(ALLREDUCE_BUCKET)}) x {setup.adapter_bytes} B"
        formula = "a min(P_train, 5e8)"
    elif zero.stage < 3:
        copies = 2 if zero.overlapping else 1
        if zero.contiguous_gradients:
            # Allocated at full reduce_bucket_size, however few parameters train.
            buckets = zero.reduce_bucket_size * setup.grad_bytes * copies
            detail = (
                f"reduce bucket {count(zero.reduce_bucket_size)} elements x {setup.grad_bytes} B"
                f" x {copies} (overlap_comm {'on' if copies == 2 else 'off'})"
            )
            formula = "g reduce_bucket_size x (2 if overlap_comm)"
        else:
            buckets = min(p_t, zero.reduce_bucket_size) * setup.grad_bytes
            detail = f"gradient flattening: min(P_train, reduce_bucket_size) x {setup.grad_bytes} B"
            formula = "g min(P_train, reduce_bucket_size)"
    else:
        bucket = zero.reduce_bucket_size * setup.adapter_bytes if zero.contiguous_gradients else 0
        per_param = NF4_BYTES_PER_PARAM if setup.precision == "4bit" else setup.compute_bytes
        prefetch = zero.prefetch_bucket_size * per_param
        buckets = round(bucket + prefetch)
        detail = (
            f"reduce bucket {count(zero.reduce_bucket_size if zero.contiguous_gradients else 0)} "
            f"x {setup.adapter_bytes} B + prefetch {count(zero.prefetch_bucket_size)} params"
        )
        formula = "a reduce_bucket_size + prefetch_bucket_size x bytes/param"
    return Term("deepspeed_buffers", "DeepSpeed buckets (gradients, prefetch)", round(buckets), formula, detail)


def buffer_terms(tensors: Sequence[ParamTensor], setup: TrainingSetup) -> list[Term]:
    n = setup.world
    return [
        _fsdp_buffers(tensors, setup) if setup.fsdp is not None else _deepspeed_buffers(tensors, setup),
        Term(
            "nccl",
            "NCCL communicator buffers",
            NCCL_BYTES if n > 1 else 0,
            "fixed (typical)",
            "outside torch's allocator" if n > 1 else "single GPU: no communicator",
            allocator=False,
        ),
        Term(
            "framework",
            "CUDA context, cuBLAS workspace",
            FRAMEWORK_BYTES,
            "fixed (typical)",
            "outside torch's allocator",
            allocator=False,
        ),
    ]
