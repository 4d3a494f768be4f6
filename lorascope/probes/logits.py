"""The logits at the first steps: shape, dtype and bytes of the output projection's
output and of the loss input (B·T·V), with a memory reading right before and after the
loss. Only the first ``MAX_CALLS`` calls of each are looked at; then the wrappers step
aside (the hot path pays nothing afterwards)."""

from __future__ import annotations

import functools
from typing import Any

from lorascope.probes.memory import MemoryProbe
from lorascope.probes.session import Session

MAX_CALLS = 2


def _tensor_facts(tensor: Any) -> dict[str, Any]:
    return {
        "shape": [int(d) for d in tensor.shape],
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "bytes": int(tensor.numel() * tensor.element_size()),
    }


class LogitsProbe:
    def __init__(self, session: Session, memory: MemoryProbe) -> None:
        self.session = session
        self.memory = memory
        self._loss_calls = 0
        self._head_calls = 0
        self._hooked_heads: set[int] = set()
        self.watch_model = session.guarded("logits")(self._watch_model)
        self._record = session.guarded("logits", job_thread=True)(self._record_logits)
        self._reading = session.guarded("logits", job_thread=True)(memory.reading)

    def install(self, torch: Any) -> None:
        """Wrap torch.nn.functional.cross_entropy (transformers' causal-LM loss calls it
        through the module attribute, as do most training scripts)."""
        functional = torch.nn.functional
        original = functional.cross_entropy
        if getattr(original, "__lorascope__", False):
            return
        probe = self

        @functools.wraps(original)
        def cross_entropy(input: Any, target: Any, *args: Any, **kwargs: Any) -> Any:
            if probe._loss_calls >= MAX_CALLS or "logits" in probe.session.disabled:
                return original(input, target, *args, **kwargs)
            probe._loss_calls += 1
            before = probe._reading()
            out = original(input, target, *args, **kwargs)
            probe._record("loss_input", input, before, probe._reading())
            return out

        cross_entropy.__lorascope__ = True  # type: ignore[attr-defined]
        functional.cross_entropy = cross_entropy

    def _watch_model(self, model: Any) -> None:
        """A forward hook on the output projection (lm_head) for the first calls."""
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is None or id(head) in self._hooked_heads:
            return
        self._hooked_heads.add(id(head))
        probe = self

        def hook(module: Any, inputs: Any, output: Any) -> None:
            if probe._head_calls >= MAX_CALLS:
                handle.remove()
                return
            probe._head_calls += 1
            if hasattr(output, "shape"):
                probe._record("lm_head_output", output, None, None)

        handle = head.register_forward_hook(hook)

    def _record_logits(
        self, where: str, tensor: Any, before: dict[str, Any] | None, after: dict[str, Any] | None
    ) -> None:
        fields = _tensor_facts(tensor)
        fields["vocab"] = fields["shape"][-1] if fields["shape"] else None
        fields["tokens"] = int(tensor.numel() // fields["vocab"]) if fields["vocab"] else None
        fields["requires_grad"] = bool(getattr(tensor, "requires_grad", False))
        if before is not None:
            fields["mem_before"], fields["mem_after"] = before, after
        self.session.record("logits", where=where, step=self.session.step, **fields)
