"""Gradient health after the first backward, and the settings that decide it.

Before the first backward (so a crash in it cannot hide them): the gradient-checkpointing
settings the model's modules carry (``use_reentrant``) and whether an input-require-grads
hook is registered on an embedding. After it (between backward and step): for every
trainable tensor, whether its gradient is missing, all zero, or present.

Under ZeRO-3 each rank looks at its own partition only (``safe_get_local_grad``), under
FSDP2 at its shard of each gradient (a DTensor's ``to_local()``): no collective is added, so a probe failing on one rank can never hang the others; the
analysis combines the ranks (a gradient is all zero when every partition is). Under
ZeRO-1/2 the gradient is assembled with ``safe_get_full_grad``, which every rank calls
for the same tensors in the same order. The all-zero test reads the values, a device
synchronisation paid once, at the first step only.
"""

from __future__ import annotations

import functools
from typing import Any

from lorascope.probes.session import Session

#: One character per trainable tensor in the ``grads`` record.
STATUS_NONE, STATUS_ZERO, STATUS_OK = "n", "z", "o"


def checkpointing_settings(model: Any) -> dict[str, Any]:
    """What the model's modules say about activation checkpointing: transformers'
    ``gradient_checkpointing`` flags, and torch's ``checkpoint_wrapper`` modules (FSDP
    jobs' ``apply_activation_checkpointing``; ``wrappers`` counts them)."""
    enabled = False
    reentrant: set[Any] = set()
    wrappers = 0
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False):
            enabled = True
            func = getattr(module, "_gradient_checkpointing_func", None)
            if func is not None:
                reentrant.add(reentrant_of(func))
        impl = getattr(module, "checkpoint_impl", None)
        if impl is not None and hasattr(module, "_checkpoint_wrapped_module"):
            enabled = True
            wrappers += 1
            reentrant.add(getattr(impl, "name", str(impl)) == "REENTRANT")
    out: dict[str, Any] = {"enabled": enabled, "use_reentrant": sorted(reentrant, key=repr)}
    if wrappers:
        out["wrappers"] = wrappers
    return out


#: How deep :func:`reentrant_of` looks through wrappers before it gives up.
UNWRAP_DEPTH = 6
#: What ``use_reentrant`` is recorded as when the wrappers do not tell.
UNKNOWN = "unknown"


def reentrant_of(func: Any, depth: int = 0) -> bool | str:
    """The ``use_reentrant`` the checkpoint function ``func`` runs torch's checkpoint with,
    read through the wrappers frameworks put around it: ``functools.partial`` (transformers'
    own, nested ones), ``functools.wraps``' ``__wrapped__`` and the callables a closure holds
    (LLaMA-Factory's ``custom_gradient_checkpointing_func`` around a partial). Torch's
    ``checkpoint`` reached with no setting runs reentrant (its default up to 2.13, with a
    warning). ``UNKNOWN`` when the wrappers do not tell, or disagree."""
    if depth > UNWRAP_DEPTH:
        return UNKNOWN
    if isinstance(func, functools.partial):
        if "use_reentrant" in func.keywords and func.keywords["use_reentrant"] is not None:
            return bool(func.keywords["use_reentrant"])
        return reentrant_of(func.func, depth + 1)
    if getattr(func, "__module__", None) == "torch.utils.checkpoint" and getattr(func, "__name__", "") == "checkpoint":
        return True
    inner = getattr(func, "__wrapped__", None)
    if inner is not None:
        return reentrant_of(inner, depth + 1)
    found = {
        reentrant_of(cell.cell_contents, depth + 1)
        for cell in getattr(func, "__closure__", None) or ()
        if _filled(cell) and callable(cell.cell_contents) and not isinstance(cell.cell_contents, type)
    }
    found.discard(UNKNOWN)
    return found.pop() if len(found) == 1 else UNKNOWN


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True


def input_require_grads_hooks(model: Any) -> int:
    """How many forward hooks named like transformers'/PEFT's make_inputs_require_grad(s)."""
    count = 0
    for module in model.modules():
        for hook in getattr(module, "_forward_hooks", {}).values():
            if "require_grad" in getattr(hook, "__name__", ""):
                count += 1
    return count


class GradProbe:
    def __init__(self, session: Session) -> None:
        self.session = session
        self._setup_done = False
        self._grads_done = False
        self.before_backward = session.guarded("grads", job_thread=True)(self._before_backward)
        self.after_backward = session.guarded("grads", job_thread=True)(self._after_backward)

    def _before_backward(self, model: Any) -> None:
        if self._setup_done or model is None:
            return
        self._setup_done = True
        self.session.record(
            "grad_setup",
            step=self.session.step,
            checkpointing=checkpointing_settings(model),
            input_require_grads_hooks=input_require_grads_hooks(model),
            training=bool(getattr(model, "training", True)),
        )

    def _after_backward(self, model: Any, zero_stage: int | None = None) -> None:
        if self._grads_done or model is None:
            return
        self._grads_done = True
        names: list[str] = []
        status: list[str] = []
        sharded = zero_stage == 3
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            names.append(name)
            status.append(self._status(param, zero_stage))
            # FSDP2's DTensor gradients, and FSDP1's original parameters (use_orig_params,
            # named under _fsdp_wrapped_module): views of this rank's shard of the flat one.
            sharded = sharded or hasattr(param.grad, "to_local") or "_fsdp_wrapped_module." in name
        self.session.record(
            "grads",
            step=self.session.step,
            names=names,
            status="".join(status),
            scope="local-partition" if sharded else "full",
        )

    @staticmethod
    def _status(param: Any, zero_stage: int | None) -> str:
        grad = param.grad
        if grad is None and zero_stage == 3 and hasattr(param, "ds_id"):
            from deepspeed.utils import safe_get_local_grad

            grad = safe_get_local_grad(param)
        elif grad is None and zero_stage in (1, 2):
            from deepspeed.utils import safe_get_full_grad

            grad = safe_get_full_grad(param)
        if grad is None:
            return STATUS_NONE
        if hasattr(grad, "to_local"):  # FSDP2's DTensor: this rank's shard, no collective
            grad = grad.to_local()
        return STATUS_ZERO if int(grad.count_nonzero()) == 0 else STATUS_OK
