"""Entries into ZeRO-3's parameter state from the job's code: ``deepspeed.zero.
GatheredParameters`` entered and left, with the call site and the rank condition around
it (the collective probe's site finder and source reader), the step and the
parameters' count.

Entering gathers the parameters and leaving re-partitions them: a rank that does it alone
(a save inside ``if rank == 0:``) changes its parameters' state even when it issues no
collective then (persistent parameters are whole already), and the next forward's
all-gathers differ between the ranks (a mismatch, a hang or a crash, a step later). The
hang diagnosis compares these records across ranks before the first collective the ranks
disagree on (``lorascope.detect.hang.zero_state``).

Light: a record at each entry and exit (not on any per-call path of the job's forward
or backward: DeepSpeed's own fetches and releases go through other methods), at most
MAX_RECORDS a process, flushed at once (the collective that fails comes right after).
Never raises into the job: a failure records why and switches this probe off.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from lorascope.probes.collectives import CollectiveProbe
from lorascope.probes.session import Session

#: ``zero_param`` records a process writes at most (a job that gathers in every forward
#: would write one per layer and step: past this many, the first ones are what counts).
MAX_RECORDS = 4096
PROBE = "zero-params"


class ZeroParamProbe:
    def __init__(self, session: Session, collectives: CollectiveProbe) -> None:
        self.session = session
        self._collectives = collectives
        self._written = 0

    def install(self, partition_parameters: ModuleType) -> None:
        """Wrap ``GatheredParameters.__enter__`` and ``__exit__`` (once)."""
        cls = partition_parameters.GatheredParameters
        if cls.__dict__.get("__lorascope__"):  # its own, not a base class's
            return
        cls.__lorascope__ = True
        probe = self
        orig_enter, orig_exit = cls.__enter__, cls.__exit__

        @functools.wraps(orig_enter)
        def __enter__(ctx: Any) -> Any:
            probe.seen(ctx, "enter")
            return orig_enter(ctx)

        @functools.wraps(orig_exit)
        def __exit__(ctx: Any, *exc: Any) -> Any:
            probe.seen(ctx, "exit")
            return orig_exit(ctx, *exc)

        cls.__enter__, cls.__exit__ = __enter__, __exit__

    def seen(self, ctx: Any, op: str) -> None:
        """Called by the wrappers above, from the job's frame two up (the site finder's
        depth: it is called straight from here)."""
        session = self.session
        if PROBE in session.disabled or not session.active or self._written >= MAX_RECORDS:
            return
        try:
            if not getattr(ctx, "enabled", False):
                return  # no ZeRO-3 parameter among them: a no-op context
            site, via = self._collectives.call_site()
            params = getattr(ctx, "params", None) or []
            session.record(
                "zero_param",
                what="GatheredParameters",
                op=op,
                site=site,
                via=via,
                params=len(params),
                persistent=sum(1 for p in params if getattr(p, "ds_persist", False)),
                modifier_rank=getattr(ctx, "src_rank", None),
                step=session.step,
            )
            self._written += 1
            session.flush()
        except Exception as exc:
            session.fail(PROBE, exc)
