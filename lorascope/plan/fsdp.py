"""What PyTorch FSDP holds beyond its shards: the units it gathers, how many are unsharded
at once, and the gradient buffers of one unit's reduce-scatter (torch 2.13).

Facts followed here, read from ``torch/distributed/fsdp``:

* Units: one per decoder layer plus the root (embeddings, final norm, output projection),
  the transformer wrap policy both versions are used with. The root keeps its parameters
  unsharded from its forward through the backward (FSDP1 ``_post_forward_reshard`` skips
  the root; FSDP2's root defaults to ``reshard_after_forward=False``).
* FULL_SHARD / HYBRID_SHARD / FSDP2 ``reshard_after_forward=True`` free a layer's
  unsharded parameters after its forward and gather them again in backward, one unit
  ahead (FSDP1 ``BackwardPrefetch.BACKWARD_PRE`` and ``limit_all_gathers``; FSDP2's
  implicit prefetch): two layer units at most. SHARD_GRAD_OP / ``False`` keep every unit
  unsharded from its forward to its backward. NO_SHARD never gathers; with mixed precision
  it keeps a low-precision copy of the whole model (``_mp_shard`` is not freed).
* Gradients: FSDP1 flattens a unit into one ``FlatParameter`` that requires grad when any
  of its parameters does (``use_orig_params=True``), so a unit holding an adapter gets a
  gradient for every element, frozen ones included, unsharded in backward and its shard
  kept. FSDP2 is per parameter: frozen parameters get no gradient.
* Reduce-scatter: FSDP1 casts the unit's flat gradient to ``reduce_dtype`` (a copy when it
  differs) and scatters into a new 1/S tensor; FSDP2 copies the unit's gradients into one
  ``reduce_dtype`` buffer and scatters it. FSDP2 also all-gathers a unit into one flat
  buffer and copies it out to the parameters, so one unit briefly exists twice.
* Sharded storage keeps the parameters' own dtype; mixed precision casts only the
  unsharded copies (and reduces in ``reduce_dtype``), so the sharded parameters, their
  gradients and torch Adam's moments (created like the parameters) are fp32 under it.
  Padding to a multiple of the shard count (under S elements a unit) is left out.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Sequence

from lorascope.plan.params import ParamTensor, tensor_bytes
from lorascope.plan.training import FsdpSetup, TrainingSetup

ROOT = "root"
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
#: Layer units unsharded at once under a resharding strategy: the one computing and the
#: one prefetched.
IN_FLIGHT = 2


def units(tensors: Sequence[ParamTensor]) -> dict[str, list[ParamTensor]]:
    """Parameter tensors by FSDP unit: ``model.layers.N`` per decoder layer, ``root`` for the rest."""
    out: dict[str, list[ParamTensor]] = defaultdict(list)
    for t in tensors:
        match = _LAYER.match(t.module + ".")
        out[f"model.layers.{match.group(1)}" if match else ROOT].append(t)
    return dict(out)


def _fsdp(setup: TrainingSetup) -> FsdpSetup:
    if setup.fsdp is None:
        raise ValueError("not an FSDP setup")
    return setup.fsdp


def unsharded_bytes(tensors: Sequence[ParamTensor], setup: TrainingSetup) -> float:
    """One unit's parameters unsharded, in the dtype they compute in."""
    return sum(tensor_bytes(t, setup) for t in tensors)


def _largest_layer(groups: dict[str, list[ParamTensor]], size: Callable[[list[ParamTensor]], float]) -> float:
    return max((size(ts) for name, ts in groups.items() if name != ROOT), default=0.0)


def held_unsharded(tensors: Sequence[ParamTensor], setup: TrainingSetup) -> tuple[float, str]:
    """Bytes of unsharded parameters held in backward, and how they are made up."""
    fsdp = _fsdp(setup)
    groups = units(tensors)
    layers = [name for name in groups if name != ROOT]

    def size(ts: list[ParamTensor]) -> float:
        return unsharded_bytes(ts, setup)

    if fsdp.strategy == "NO_SHARD":
        if not fsdp.mixed_precision:
            return 0.0, "NO_SHARD: the parameters are whole already"
        return sum(size(ts) for ts in groups.values()), "NO_SHARD + mixed precision: a low-precision copy of the model"
    root = size(groups.get(ROOT, []))
    if fsdp.reshard_after_forward:
        n = min(IN_FLIGHT, len(layers))
        return root + n * _largest_layer(groups, size), f"root + {n} layer unit(s) (the one computing, one prefetched)"
    return root + sum(
        size(groups[name]) for name in layers
    ), f"root + all {len(layers)} layer units (not resharded after forward)"


def _grad_numel(unit: Sequence[ParamTensor], fsdp: FsdpSetup) -> int:
    """Elements of a unit that get a gradient: FSDP1's flat parameter all of them when any is
    trainable, FSDP2 only the trainable parameters."""
    trainable = sum(t.numel for t in unit if t.trainable)
    if fsdp.version == 1:
        return sum(t.numel for t in unit) if trainable else 0
    return trainable


def grad_numel(tensors: Sequence[ParamTensor], setup: TrainingSetup) -> int:
    """Elements with a gradient over the whole model (before sharding)."""
    fsdp = _fsdp(setup)
    return sum(_grad_numel(ts, fsdp) for ts in units(tensors).values())


def reduce_scatter_bytes(tensors: Sequence[ParamTensor], setup: TrainingSetup) -> tuple[float, float]:
    """(the largest unit's unsharded gradient in the compute dtype plus its reduce_dtype
    copy, the largest layer unit's FSDP2 flat all-gather output: the one prefetched in
    backward; the root is gathered at the start of the forward, when little else is live)."""
    fsdp = _fsdp(setup)
    groups = units(tensors)
    grad_elems = max((_grad_numel(ts, fsdp) for ts in groups.values()), default=0)
    compute = setup.adapter_bytes
    reduce = 4 if fsdp.reduce_fp32 else compute
    shard = setup.shard_world
    grads: float
    if fsdp.strategy == "NO_SHARD":
        # All-reduced in place; only a reduce_dtype cast copies it.
        grads = grad_elems * (reduce if reduce != compute else 0)
    elif fsdp.version == 1:
        grads = grad_elems * (compute + (reduce if reduce != compute else 0)) + grad_elems * reduce / shard
    else:
        grads = grad_elems * (compute + reduce) + grad_elems * reduce / shard
    gather = _largest_layer(groups, lambda ts: unsharded_bytes(ts, setup)) if fsdp.version == 2 else 0.0
    return grads, gather
