"""One line of the per-GPU budget."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Term:
    key: str
    label: str
    bytes: int
    #: The formula in symbols (docs/memory-model.md defines them).
    formula: str
    #: The same formula with this plan's numbers.
    detail: str
    #: False when the term peaks at another moment than a larger alternative and is left out
    #: of the total (the logits spike and the per-layer backward working set never coincide).
    counted: bool = True
    #: Whether torch's caching allocator holds it (torch.cuda.max_memory_allocated sees it);
    #: the CUDA context and NCCL's own buffers are outside it, visible only to nvidia-smi/NVML.
    allocator: bool = True
    parts: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "key": self.key,
            "label": self.label,
            "bytes": self.bytes,
            "formula": self.formula,
            "detail": self.detail,
            "counted": self.counted,
            "allocator": self.allocator,
        }
        if self.parts:
            out["parts"] = dict(self.parts)
        return out
