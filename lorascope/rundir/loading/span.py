"""One rank's records of a time span, read again from its stream (analysis side).

A loaded run keeps each process group's first and newest calls only, and the step-keyed
records of every ``stride``-th step of a long run (:mod:`lorascope.rundir.loading.reduce`): what a
detector needs, not what a timeline of steps 500 to 510 shows. An export of a span reads
each rank's stream again and keeps everything that overlaps the span, at most so many
records of each kind, the first ones (the rest counted), and stops reading once the
stream is past the span and no call kept waits for its end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lorascope.rundir.loading.reader import Collective

#: How far past a span's end a stream is read: a record may be written after a later one
#: (the probes hold an async call up to 30 ms and flush every 40 ms), and a call's time on
#: the device (``coll_dev``) comes at a later step's end.
SLACK_S = 30.0


@dataclass
class SpanRecords:
    """What one rank recorded over a span: its calls, steps, phase edges and memory
    readings, each list at most ``most`` long (the first ones), and how many records were
    left out past that, of all kinds together."""

    collectives: list[Collective] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    phases: list[dict[str, Any]] = field(default_factory=list)
    mem: list[dict[str, Any]] = field(default_factory=list)
    left_out: int = 0


class SpanLog:
    """The calls of one rank that overlap [start, end] (None: open), fed call by call as
    the stream is read: the first ``most`` of them, and how many more there were. A call
    that started before the span and has not ended yet is kept if it ends inside or after
    the span's start, or never ends (it was in flight through the span)."""

    def __init__(self, start: float | None, end: float | None, most: int) -> None:
        self.start = -math.inf if start is None else start
        self.end = math.inf if end is None else end
        self.most = most
        self.left_out = 0
        self._kept: dict[tuple[str, int], Collective] = {}
        #: Calls that started before the span and are in flight, by id.
        self._before: dict[int, Collective] = {}
        #: Kept calls in flight, by id.
        self._open: dict[int, Collective] = {}

    def add(self, coll: Collective) -> None:
        """A call read: its start, or (``end`` set) the whole call."""
        if not self.holds(coll.start, math.inf if coll.end is None else coll.end):
            return
        if coll.end is None and coll.start < self.start:
            self._before[id(coll)] = coll
        else:
            self._keep(coll)

    def ended(self, coll: Collective) -> None:
        """A call added before its end, now ended."""
        self._open.pop(id(coll), None)
        if self._before.pop(id(coll), None) is not None and coll.end is not None and coll.end >= self.start:
            self._keep(coll)

    def find(self, group: str, seq: int) -> Collective | None:
        return self._kept.get((group, seq))

    def past(self, t: float) -> bool:
        """Whether a call that starts at ``t`` ends the reading: the stream is past the span
        and no call it keeps, or may keep, waits for its end."""
        return t > self.end + SLACK_S and not self._open and not self._before

    def finish(self) -> list[Collective]:
        """The calls kept, in the order they started; those in flight through the whole span
        to the stream's end too, past the bound (there are few: a rank blocked in one)."""
        for coll in self._before.values():
            self._kept[(coll.group, coll.seq)] = coll
        self._before = {}
        return sorted(self._kept.values(), key=lambda c: c.start)

    def _keep(self, coll: Collective) -> None:
        if len(self._kept) >= self.most:
            self.left_out += 1
            return
        self._kept[(coll.group, coll.seq)] = coll
        if coll.end is None:
            self._open[id(coll)] = coll

    def holds(self, begin: float, end: float) -> bool:
        """Whether a record over [begin, end] overlaps the span."""
        return begin <= self.end and end >= self.start
