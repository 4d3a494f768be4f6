"""FSDP settings, recorded when the job shards its model: a ``config`` record named
``fsdp`` (the way the LoRA and DeepSpeed configs are recorded).

- FSDP2 (``fully_shard``): after each call, the settings of every unit so far: its mesh,
  ``reshard_after_forward``, mixed-precision policy and offload policy, each as the list
  of distinct values the units use (a root left unresharded next to resharded layers
  shows as ``[true, false]``), and ``by_unit``: which module class has which setting and
  the dtypes its parameters are stored in. The record is written again at each call; the
  reader keeps the last.
- FSDP1 (``FullyShardedDataParallel``): once the outermost instance is built (the
  auto-wrapped units inside it are built first): the effective sharding strategy (FSDP1
  turns FULL_SHARD into NO_SHARD on one rank), the mesh, mixed precision, CPU offload,
  ``use_orig_params`` and how many units.

Activation checkpointing (torch's ``checkpoint_wrapper``, reentrant or not) is recorded
with the other checkpointing settings in ``grad_setup`` (:mod:`lorascope.probes.grads`).
Nothing here runs on the training hot path.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from lorascope.probes.session import Session

#: Kinds of FSDP2 units told apart in the ``by_unit`` list (a model's layers are one).
MAX_UNIT_KINDS = 16


def _dtype(value: Any) -> str | None:
    return None if value is None else str(value).removeprefix("torch.")


def mesh_settings(mesh: Any) -> dict[str, Any] | None:
    """A device mesh as plain data (None: the default, the world on the current device)."""
    if mesh is None:
        return None
    names = getattr(mesh, "mesh_dim_names", None)
    return {
        "shape": [int(n) for n in mesh.shape],
        "dim_names": list(names) if names else None,
        "device": str(getattr(mesh, "device_type", "")) or None,
    }


def mixed_precision_settings(policy: Any) -> dict[str, Any] | None:
    """FSDP2's ``MixedPrecisionPolicy`` or FSDP1's ``MixedPrecision``; None when no dtype is
    set (full precision)."""
    if policy is None:
        return None
    fields = ("param_dtype", "reduce_dtype", "output_dtype", "buffer_dtype")
    out: dict[str, Any] = {f: _dtype(getattr(policy, f)) for f in fields if hasattr(policy, f)}
    if not any(out.values()):
        return None
    for flag in ("cast_forward_inputs", "keep_low_precision_grads"):
        if hasattr(policy, flag):
            out[flag] = bool(getattr(policy, flag))
    return out


def offload_settings(policy: Any) -> dict[str, Any] | None:
    """FSDP2's ``CPUOffloadPolicy`` (None for the base ``OffloadPolicy``: no offload)."""
    if policy is None or type(policy).__name__ == "OffloadPolicy":
        return None
    return {"policy": type(policy).__name__, "pin_memory": bool(getattr(policy, "pin_memory", False))}


class FsdpProbe:
    def __init__(self, session: Session, on_model: Callable[[Any], None]) -> None:
        self.session = session
        #: Called with each sharded module (the steps probe takes the job's model from it).
        self.on_model = on_model
        self._units = 0
        self._seen: dict[str, list[Any]] = {}
        #: Each distinct (module class, root, settings, parameter dtypes) and its count.
        self._by_unit: list[dict[str, Any]] = []
        self._sharded: list[int] = []  # ids: the probe keeps no module alive
        self._building = threading.local()
        self.record_fully_shard = session.guarded("fsdp")(self._record_fully_shard)
        self.record_fsdp1 = session.guarded("fsdp")(self._record_fsdp1)

    # -- FSDP2 --------------------------------------------------------------------
    def install_fully_shard(self, module: ModuleType) -> None:
        """``torch.distributed.fsdp._fully_shard._fully_shard``: wrap ``fully_shard`` before
        the packages above it bind the name (``functools.wraps`` keeps its ``state``)."""
        original = getattr(module, "fully_shard", None)
        if original is None or getattr(original, "__lorascope__", False):
            return
        signature = inspect.signature(original)
        probe = self

        @functools.wraps(original)
        def fully_shard(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            probe.record_fully_shard(signature, args, kwargs)
            probe.on_model(out)
            return out

        fully_shard.__lorascope__ = True  # type: ignore[attr-defined]
        module.fully_shard = fully_shard  # type: ignore[attr-defined]

    def _record_fully_shard(self, signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        unit = {
            "mesh": mesh_settings(a.get("mesh")),
            "reshard_after_forward": a.get("reshard_after_forward"),
            "mixed_precision": mixed_precision_settings(a.get("mp_policy")),
            "offload": offload_settings(a.get("offload_policy")),
        }
        self._units += 1
        for key, value in unit.items():
            seen = self._seen.setdefault(key, [])
            if value not in seen:
                seen.append(value)
        self._add_unit(a.get("module"), unit)
        value = {"version": 2, "api": "fully_shard", "units": self._units, **self._seen, "by_unit": self._by_unit}
        self.session.record("config", name="fsdp", value=value)

    def _add_unit(self, module: Any, unit: dict[str, Any]) -> None:
        """Which unit has which setting: its module's class, whether it holds units sharded
        before it (the root), its reshard and mixed-precision settings, and the dtypes its
        parameters have (what they are stored in: a MixedPrecisionPolicy casts them for the
        computation only). Alike units are counted together (at most MAX_UNIT_KINDS kinds)."""
        if not hasattr(module, "modules"):
            return  # fully_shard of a list of modules
        inner = {id(m) for m in module.modules()}
        root = any(i in inner for i in self._sharded)
        self._sharded.append(id(module))
        kind = {
            "module": _unit_name(module),
            "root": root,
            "reshard_after_forward": unit["reshard_after_forward"],
            "mixed_precision": unit["mixed_precision"],
            "param_dtypes": sorted({_dtype(p.dtype) or "?" for p in module.parameters()}),
        }
        for known in self._by_unit:
            if {k: v for k, v in known.items() if k != "count"} == kind:
                known["count"] += 1
                return
        if len(self._by_unit) < MAX_UNIT_KINDS:
            self._by_unit.append({**kind, "count": 1})

    # -- FSDP1 --------------------------------------------------------------------
    def install_fsdp1(self, module: ModuleType) -> None:
        """``torch.distributed.fsdp.fully_sharded_data_parallel``: its class's ``__init__``."""
        cls = module.FullyShardedDataParallel
        original = cls.__init__
        if getattr(original, "__lorascope__", False):
            return
        probe = self

        @functools.wraps(original)
        def __init__(fsdp: Any, *args: Any, **kwargs: Any) -> None:
            depth = getattr(probe._building, "depth", 0)
            probe._building.depth = depth + 1
            try:
                original(fsdp, *args, **kwargs)
            finally:
                probe._building.depth = depth
            if depth == 0:
                probe.record_fsdp1(fsdp, cls)
                probe.on_model(fsdp)  # the wrapper: its forward unshards the root

        __init__.__lorascope__ = True  # type: ignore[attr-defined]
        cls.__init__ = __init__

    def _record_fsdp1(self, fsdp: Any, cls: type) -> None:
        strategy = getattr(fsdp, "sharding_strategy", None)
        offload = getattr(fsdp, "cpu_offload", None)
        group = getattr(fsdp, "process_group", None)
        replicate = getattr(fsdp, "_inter_node_pg", None)
        value = {
            "version": 1,
            "api": "FullyShardedDataParallel",
            "units": sum(1 for m in fsdp.modules() if isinstance(m, cls)),
            "sharding_strategy": getattr(strategy, "name", None if strategy is None else str(strategy)),
            "mesh": mesh_settings(getattr(fsdp, "_device_mesh", None)),
            "shard_world": int(group.size()) if group is not None else None,
            "replicate_world": int(replicate.size()) if replicate is not None else None,
            "mixed_precision": mixed_precision_settings(getattr(fsdp, "mixed_precision", None)),
            "cpu_offload": bool(getattr(offload, "offload_params", False)),
            "use_orig_params": bool(getattr(fsdp, "_use_orig_params", False)),
            "backward_prefetch": getattr(getattr(fsdp, "backward_prefetch", None), "name", None),
            "forward_prefetch": bool(getattr(fsdp, "forward_prefetch", False)),
        }
        self.session.record("config", name="fsdp", value=value)


def _unit_name(module: Any) -> str:
    """A unit's module class, as the job named it: fully_shard swaps the class for one named
    ``FSDP<name>``; a checkpoint wrapper is named by the module it wraps."""
    inner = getattr(module, "_checkpoint_wrapped_module", None)
    if inner is not None:
        return f"{_unit_name(inner)} (checkpointed)"
    return type(module).__name__.removeprefix("FSDP")
