"""When a CUDA rank records the caching allocator's history (``--memory-history``).

Recording costs ~6 us per allocation (a Python stack captured at each one): +18% of a
17 ms step on the GPU check's small job. What it buys is the stacks in an allocator
snapshot: which code allocated the blocks live at an OOM, a hang or a stall. ``auto``
records where those are made and where OOMs happen, and nowhere else:

- the first ``FIRST_STEPS`` steps (from the job's first CUDA use: the model's weights,
  the optimizer's states, the first forward's and backward's activations — blocks that
  stay live keep their stacks after recording stops);
- every phase outside the training loop (evaluation, a save: rank 0's gathered outputs);
- whenever the allocator's reserved memory is at ``ON_SHARE`` of the memory the rank may
  use (the device's, times ``set_per_process_memory_fraction``), until it is back under
  ``OFF_SHARE``: a job growing towards an OOM.

``always`` records from the first CUDA use to the end, ``off`` never. The decision is a
pure function of what the probes read at every phase edge (the reserved bytes, the step,
the edge's name), so it can be replayed over a recorded run (``replay``) and tested
without a GPU. Stopping recording clears torch's ring of alloc/free events (not the stacks
of live blocks): a snapshot's history starts at the last time recording started.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

MODES = ("auto", "always", "off")
#: Steps recorded from the start under ``auto``.
FIRST_STEPS = 3
#: Reserved memory, as a share of what the rank may use, that starts recording ...
ON_SHARE = 0.85
#: ... and the share it must fall under before recording stops again (hysteresis: a job
#: that hovers at the threshold does not toggle at every edge).
OFF_SHARE = 0.75
#: The training loop's phases (``probes/steps.py``); any other phase is an evaluation, a
#: save or a user's span, recorded under ``auto``.
LOOP_PHASES = frozenset({"forward", "backward", "optimizer", "step"})


@dataclass
class HistoryPolicy:
    """The ``auto`` decision, fed one reading at a time (``observe``)."""

    mode: str = "auto"
    first_steps: int = FIRST_STEPS
    on_share: float = ON_SHARE
    off_share: float = OFF_SHARE
    #: Whether history is recorded now, and why (None while off).
    on: bool = False
    why: str | None = None
    _open: list[str] = field(default_factory=list)

    def observe(self, src: str, step: int, reserved: int | None, limit: int | None) -> bool:
        """One reading at a phase edge (``src`` as in ``mem`` records: ``eval.begin``,
        ``forward.end``, ``step`` ...) with the steps done before it, the allocator's
        reserved bytes and the bytes the rank may use. Returns whether the decision
        changed (``on`` and ``why`` then say to what)."""
        phase, _, edge = src.partition(".")
        if edge and phase not in LOOP_PHASES:
            if edge == "begin" and phase not in self._open:
                self._open.append(phase)
            elif edge == "end" and phase in self._open:
                self._open.remove(phase)
        why = self._reason(step, reserved, limit)
        changed = (why is not None) != self.on
        self.on, self.why = why is not None, why
        return changed

    def _reason(self, step: int, reserved: int | None, limit: int | None) -> str | None:
        if self.mode != "auto":
            return "always" if self.mode == "always" else None
        if step < self.first_steps:
            return f"the first {self.first_steps} steps"
        if self._open:
            return f"{self._open[-1]} phase"
        if reserved is not None and limit:
            share = reserved / limit
            held = self.on and self.why is not None and self.why.startswith("reserved")
            if share >= self.on_share or (held and share >= self.off_share):
                return f"reserved {share:.0%} of {limit / 2**30:.1f} GiB"
        return None


def replay(mem: Iterable[dict[str, Any]], limit: int | None, mode: str = "auto") -> Iterator[dict[str, Any]]:
    """The decisions ``HistoryPolicy`` takes over a rank's recorded ``mem`` records (those
    read on the training thread: the sampler's are not seen by the probe), as the
    ``history`` records the probe writes: ``{"on", "why", "step", "src"}``."""
    policy = HistoryPolicy(mode)
    for record in mem:
        src = str(record.get("src"))
        if src == "sampler":
            continue
        cuda = record.get("cuda")
        reserved = cuda.get("reserved") if isinstance(cuda, dict) else None
        if policy.observe(src, int(record.get("step") or 0), reserved, limit):
            yield {"on": policy.on, "why": policy.why, "step": record.get("step"), "src": src}
