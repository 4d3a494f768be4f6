"""Allocator snapshots from the probes: on a CUDA rank, the caching allocator's history
is recorded from the job's first CUDA use, and a snapshot is written next to the
rank's stream when it matters — the pickle ``torch.cuda.memory._dump_snapshot`` writes
(pytorch.org/memory_viz opens it), so that the live blocks at an OOM and the stacks
that allocated them survive the rank.

When recording starts: from ``torch.cuda._lazy_call`` (the queue torch runs right after
it initialises CUDA, or at once when CUDA is already up), so the probe never creates a
CUDA context itself and the blocks the job allocates from then on carry Python stacks.
What is recorded: ``enabled="all"`` (the alloc/free history, a ring of ``max_entries``
entries), ``context="alloc"`` (stacks of allocations and of live blocks, not of frees:
half the capture cost; only a block allocated before the ring's oldest entry and freed
within it loses its stack), ``stacks="python"`` (C++ frames are costly to symbolise at
the dump; the price: allocations made by autograd's device threads, which have no Python
stack, show no frames).

When a snapshot is written (``snapshot`` records; files ``HOST-PID.snapshot.REASON.pickle``):
- ``oom``: from the allocator's OOM observer (``torch._C._cuda_attach_out_of_memory_observer``),
  which torch calls after the failed request and before it raises, with the allocator
  unlocked: the snapshot is taken even when the training code catches the
  ``OutOfMemoryError`` and raises something else. Where the observer is missing, an
  uncaught exception whose chain holds an OOM dumps instead (the history still holds the
  ``oom`` entry the readers replay to). Once per process: a job that catches OOMs and
  retries (batch-size finders) writes one file, not one per try.
- ``signal-T`` / ``request-T`` / ``stall-T``: with the on-demand dump (``lorascope hang``) and the stall
  watchdog, at most ``MAX_REQUESTED`` per process.

Switch: ``LORASCOPE_MEMORY_HISTORY`` (``lorascope run --memory-history/--no-memory-history``):
``on`` (the default), ``off``, or a number of entries. On a CPU build of torch, or when
recording cannot start, the probe stays off silently and a ``memory_history`` record
says why; it never raises into the job (an exception escaping the lazy-init queue or the
OOM observer would replace the job's own error).
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
from pathlib import Path
from typing import Any

from lorascope.probes.session import Session

ENV_SWITCH = "LORASCOPE_MEMORY_HISTORY"
#: Alloc/free entries kept (a ring). ~0.5-1 KB of host memory each with Python stacks;
#: a 7B LoRA step makes ~10^4 allocations, so this holds the last few steps.
DEFAULT_ENTRIES = 50_000
#: Snapshots on request (signal, stall) per process; the OOM one is extra.
MAX_REQUESTED = 4
#: How deep the exception chain is searched for an OOM.
_CHAIN_DEPTH = 16


def parse_switch(text: str | None) -> tuple[bool, int]:
    """``LORASCOPE_MEMORY_HISTORY`` -> (on, max_entries); unset or unreadable means on."""
    value = (text or "").strip().lower()
    if value in ("0", "off", "no", "false"):
        return False, DEFAULT_ENTRIES
    if value.isdigit():
        return True, int(value)
    return True, DEFAULT_ENTRIES


def is_oom(exc: BaseException | None) -> bool:
    """Whether an exception, or one in its chain (``raise ... from``, or raised while
    handling), is a CUDA out-of-memory error."""
    oom_type = getattr(sys.modules.get("torch"), "OutOfMemoryError", None)
    seen = 0
    while exc is not None and seen < _CHAIN_DEPTH:
        if (oom_type is not None and isinstance(exc, oom_type)) or "CUDA out of memory" in str(exc)[:2000]:
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


class AllocatorProbe:
    def __init__(self, session: Session, out_prefix: Path, enabled: bool, max_entries: int = DEFAULT_ENTRIES) -> None:
        self.session = session
        self.enabled = enabled
        self.max_entries = max(1, max_entries)
        self.recording = False
        self.oom_observer = False
        self._prefix = out_prefix
        self._lock = threading.Lock()
        self._decided = False
        self._oom_dumped = False
        self._requested = 0
        self.install = session.guarded("allocator")(self._install)
        self.dump = session.guarded("allocator")(self._dump)
        self.after_exception = session.guarded("allocator")(self._after_exception)
        self.finish = session.guarded("allocator")(self._finish)

    # -- starting -----------------------------------------------------------------
    def _decide(self, on: bool, reason: str | None) -> None:
        """The one ``memory_history`` record of the process: on, or off and why."""
        if self._decided:
            return
        self._decided = True
        self.session.record(
            "memory_history",
            on=on,
            reason=reason,
            max_entries=self.max_entries if on else None,
            oom_observer=self.oom_observer,
        )

    def _install(self, torch: Any) -> None:
        """At ``import torch``: queue the start for when the job initialises CUDA."""
        if not self.enabled:
            self._decide(False, f"switched off ({ENV_SWITCH}={os.environ.get(ENV_SWITCH)!r})")
            return
        if not getattr(torch._C, "_has_cuda", False):
            self._decide(False, f"torch {torch.__version__} is built without CUDA")
            return
        torch.cuda._lazy_call(self._on_cuda_init)

    def _on_cuda_init(self) -> None:
        """Runs inside torch's lazy CUDA init: must never raise (torch would turn it
        into a DeferredCudaCallError in the job)."""
        try:
            if self.session.active and not self._decided:
                self._start(sys.modules["torch"])
        except Exception as exc:
            self.recording = False
            self._decide(False, f"{type(exc).__name__}: {exc}"[:500])

    def _start(self, torch: Any) -> None:
        torch.cuda.memory._record_memory_history(
            enabled="all", context="alloc", stacks="python", max_entries=self.max_entries
        )
        self.recording = True
        attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        try:
            if attach is not None:
                attach(self._on_oom)
                self.oom_observer = True
        except Exception:
            pass  # the history still serves: an uncaught OOM and the dumps on request write snapshots
        self._decide(True, None)

    def _finish(self) -> None:
        """At the end: a CUDA build whose job never touched CUDA says so."""
        if self.enabled:
            self._decide(False, "the process never initialised CUDA")

    # -- snapshots ------------------------------------------------------------------
    def _on_oom(self, device: int, alloc: int, device_allocated: int, device_free: int) -> None:
        """torch's OOM observer (the allocator is unlocked, the GIL held). An exception
        here would replace the job's OutOfMemoryError: nothing escapes."""
        try:
            if not self._oom_dumped:
                self.dump("oom", device=int(device), requested=int(alloc), device_free=int(device_free), via="observer")
        except Exception:
            pass

    def _after_exception(self, exc: BaseException) -> None:
        """An uncaught exception: if an OOM is in its chain and the observer wrote nothing."""
        if not self._oom_dumped and is_oom(exc):
            self._dump("oom", via="exception")

    def _dump(self, reason: str, **fields: Any) -> None:
        if not self.recording:
            return
        with self._lock:  # the OOM observer and the dump thread may both get here
            oom = reason == "oom"
            if (oom and self._oom_dumped) or (not oom and self._requested >= MAX_REQUESTED):
                return
            if oom:
                self._oom_dumped = True
            else:
                self._requested += 1
            began = time.perf_counter()
            data = sys.modules["torch"].cuda.memory._snapshot()
            path = self._prefix.with_name(f"{self._prefix.name}.snapshot.{reason}.pickle")
            tmp = path.with_name(path.name + ".tmp")
            with open(tmp, "wb") as f:
                pickle.dump(data, f)  # as torch.cuda.memory._dump_snapshot writes it
            os.replace(tmp, path)
            traces = data.get("device_traces") or []
            self.session.record(
                "snapshot",
                file=path.name,
                reason=reason,
                bytes=path.stat().st_size,
                ms=round((time.perf_counter() - began) * 1000, 1),
                step=self.session.step,
                trace_entries=sum(len(t) for t in traces if isinstance(t, list)),
                **fields,
            )
