"""Stalls the job came back from: the probes' watchdog dumped the ranks when no step had
come for a while, and the ranks made steps again afterwards. The dumps say who held the
others up; nothing else in the run does (the job may well end with exit 0)."""

from __future__ import annotations

from dataclasses import dataclass

from lorascope.rundir.loading.ending import in_long_phase, progress_window, stepped_after
from lorascope.rundir.loading.reader import RunData
from lorascope.rundir.loading.records import DumpRecord

#: Stall dumps of different ranks this close in time are one stall (each rank's watchdog
#: fires on its own clock, within a second of the others').
SAME_STALL_S = 10.0


@dataclass(frozen=True)
class Stall:
    #: When the first rank's watchdog fired, and the steps it had done then.
    t: float
    step: int
    #: The longest a rank went without a step across it (seconds).
    paused_s: float


def recovered_stalls(run: RunData) -> list[Stall]:
    """The stalls every dumped rank came back from (made a step after), oldest first,
    leaving out those during which a rank was inside an evaluation or a save (a long one
    is no stall: the others wait for it, as they should), and those no longer than a
    moving job may go without a step (:func:`~lorascope.rundir.loading.ending.progress_window`:
    the watchdog set short with LORASCOPE_STALL_SECONDS fires in a slow step)."""
    fired = sorted((float(d["t"]), n, d) for n, r in run.ranks.items() for d in r.dumps if d.get("reason") == "stall")
    stalls: list[Stall] = []
    group: list[tuple[float, int, DumpRecord]] = []
    for item in [*fired, None]:
        if item is not None and (not group or item[0] - group[0][0] <= SAME_STALL_S):
            group.append(item)
            continue
        if group:
            found = _stall(run, group)
            if found is not None:
                stalls.append(found)
        group = [item] if item is not None else []
    return stalls


def _stall(run: RunData, group: list[tuple[float, int, DumpRecord]]) -> Stall | None:
    at = group[0][0]
    if not all(stepped_after(run.ranks[n], t) for t, n, _ in group):
        return None  # not come back from: a hang, read as one
    if any(in_long_phase(r, at) for r in run.ranks.values()):
        return None
    paused = 0.0
    for rank in run.ranks.values():
        before = [float(s["t"]) for s in rank.steps if float(s["t"]) <= at]
        after = [float(s["t"]) for s in rank.steps if float(s["t"]) > at]
        if before and after:
            paused = max(paused, after[0] - before[-1])
    if paused <= max(progress_window(r) for r in run.ranks.values()):
        return None  # no longer than a moving job may go without a step (a watchdog set short)
    step = group[0][2].get("step")
    return Stall(at, int(step) if isinstance(step, int) else 0, paused)
