"""One rank's records of a time span, read again from its stream and call file (analysis side).

A loaded run keeps each process group's first and newest calls only, and the step-keyed
records of every ``stride``-th step of a long run (:mod:`lorascope.rundir.loading.reduce`): what a
detector needs, not what a timeline of steps 500 to 510 shows. An export of a span reads
each rank's stream and call file again and keeps everything that overlaps the span, at
most so many records of each kind, the first ones (the rest counted); a call in flight
through the whole span is kept past that bound (there are few: a rank blocked in one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lorascope.rundir.loading.records import MemReading, PhaseEdge, StepRecord

if TYPE_CHECKING:
    from lorascope.rundir.loading.reader import Collective


@dataclass
class SpanRecords:
    """What one rank recorded over a span: its calls, steps, phase edges and memory
    readings, each list at most ``most`` long (the first ones), and how many records were
    left out past that, of all kinds together."""

    collectives: list[Collective] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    phases: list[PhaseEdge] = field(default_factory=list)
    mem: list[MemReading] = field(default_factory=list)
    left_out: int = 0
