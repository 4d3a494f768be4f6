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

When history is recorded: ``LORASCOPE_MEMORY_HISTORY`` (``lorascope run --memory-history``)
is ``auto`` (the default: the first steps, evaluation and save phases, and while reserved
memory is near the rank's limit; ``probes/history_policy.py``), ``always``, or ``off``,
optionally followed by ``:ENTRIES`` (a bare number sets the entries, mode ``auto``). Each
start and stop under ``auto`` is a ``history`` record. With history off a snapshot is still
written at an OOM, a hang dump or a stall: its live blocks allocated while recording was
off show no stacks. On a CPU build of torch, or when recording cannot start, the probe
stays off silently and a ``memory_history`` record says why; it never raises into the job
(an exception escaping the lazy-init queue or the OOM observer would replace the job's own
error).
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
from pathlib import Path
from typing import Any

from lorascope.probes.history_policy import MODES, HistoryPolicy
from lorascope.probes.session import Session
from lorascope.rundir.format import safe_open

ENV_SWITCH = "LORASCOPE_MEMORY_HISTORY"
#: Alloc/free entries kept (a ring). ~0.5-1 KB of host memory each with Python stacks;
#: a 7B LoRA step makes ~10^4 allocations, so this holds the last few steps.
DEFAULT_ENTRIES = 50_000
#: Snapshots on request (signal, stall) per process; the OOM one is extra.
MAX_REQUESTED = 4
#: How deep the exception chain is searched for an OOM.
_CHAIN_DEPTH = 16


def parse_switch(text: str | None) -> tuple[str, int]:
    """``LORASCOPE_MEMORY_HISTORY`` -> (mode, max_entries): ``MODE[:ENTRIES]``, a bare
    number of entries (mode ``auto``), ``on`` for ``always``, ``0``/``no``/``false`` for
    ``off``; unset or unreadable means ``auto``."""
    mode, _, entries = (text or "").strip().lower().partition(":")
    if mode.isdigit() and not entries:
        mode, entries = ("off", "") if int(mode) == 0 else ("auto", mode)
    mode = {"on": "always", "0": "off", "no": "off", "false": "off"}.get(mode, mode)
    return (mode if mode in MODES else "auto"), (int(entries) if entries.isdigit() else DEFAULT_ENTRIES)


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
    def __init__(self, session: Session, out_prefix: Path, mode: str, max_entries: int = DEFAULT_ENTRIES) -> None:
        self.session = session
        self.policy = HistoryPolicy(mode)
        self.max_entries = max(1, max_entries)
        #: Whether the allocator is being probed (history started once: snapshots can be
        #: taken), and whether history is recorded now (``policy``).
        self.started = False
        self.recording = False
        self.oom_observer = False
        self._prefix = out_prefix
        self._lock = threading.Lock()
        self._decided = False
        self._oom_dumped = False
        self._requested = 0
        self._limit: int | None = None
        self.install = session.guarded("allocator")(self._install)
        self.dump = session.guarded("allocator")(self._dump)
        self.after_exception = session.guarded("allocator")(self._after_exception)
        self.finish = session.guarded("allocator")(self._finish)
        self.observe = session.guarded("allocator")(self._observe)

    # -- starting -----------------------------------------------------------------
    def _decide(self, on: bool, reason: str | None) -> None:
        """The one ``memory_history`` record of the process: probed, or not and why."""
        if self._decided:
            return
        self._decided = True
        self.session.record(
            "memory_history",
            on=on,
            reason=reason,
            mode=self.policy.mode,
            max_entries=self.max_entries if on else None,
            oom_observer=self.oom_observer,
            limit=self._limit,
        )

    def _install(self, torch: Any) -> None:
        """At ``import torch``: queue the start for when the job initialises CUDA."""
        if self.policy.mode == "off":
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
        if self.policy.observe("cuda.init", self.session.step, None, None):
            self._record(torch, True)
        self.started = True
        self._limit = _device_limit(torch)
        attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        try:
            if attach is not None:
                attach(self._on_oom)
                self.oom_observer = True
        except Exception:
            pass  # the history still serves: an uncaught OOM and the dumps on request write snapshots
        self._decide(True, None)

    def _record(self, torch: Any, on: bool) -> None:
        """Start or stop recording (stopping clears torch's ring of alloc/free events)."""
        if on:
            torch.cuda.memory._record_memory_history(
                enabled="all", context="alloc", stacks="python", max_entries=self.max_entries
            )
        else:
            torch.cuda.memory._record_memory_history(enabled=None)
        self.recording = on

    def _observe(self, src: str, cuda: dict[str, int]) -> None:
        """A reading on the training thread at a phase edge (``MemoryProbe``): start or
        stop recording when the policy says so, with a ``history`` record."""
        if not self.started:
            return
        if src == "step":  # the limit may change (set_per_process_memory_fraction)
            self._limit = _device_limit(sys.modules["torch"]) or self._limit
        policy = self.policy
        if policy.observe(src, self.session.step, cuda.get("reserved"), self._limit):
            self._record(sys.modules["torch"], policy.on)
            self.session.record(
                "history", on=policy.on, why=policy.why, step=self.session.step, src=src, reserved=cuda.get("reserved")
            )

    def _finish(self) -> None:
        """At the end: a CUDA build whose job never touched CUDA says so."""
        if self.policy.mode != "off":
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
        if not self.started:
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
            with os.fdopen(safe_open.create(tmp), "wb") as f:
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
                history=self.policy.why if self.recording else None,
                **fields,
            )


def _device_limit(torch: Any) -> int | None:
    """The bytes the rank may use on its device: the device's memory times the process's
    ``set_per_process_memory_fraction`` (1 unless the job set it). Host-side reads, no
    sync; None where torch cannot tell (then only the steps and phases decide)."""
    try:
        dev = torch.cuda.current_device()
        total = int(torch.cuda.get_device_properties(dev).total_memory)
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        return int(total * float(fraction(dev))) if fraction is not None else total
    except Exception:
        return None
