"""The records a rank's reading hands the detectors and the report, typed: what
:class:`~lorascope.rundir.loading.reader.RankData` holds of the step-keyed kinds. Made
from the steps file's columns (:mod:`lorascope.rundir.loading.steps`), or from stream
records of these kinds, which carry the same fields."""

from __future__ import annotations

from typing import Any, TypedDict


class _NonFinite(TypedDict, total=False):
    #: The text of a loss that was not a finite number (``loss`` is None then).
    loss_text: str


class StepRecord(_NonFinite):
    """A step's end: its number (from 1), wall seconds since the previous end, its loss."""

    k: str
    t: float
    step: int
    dur: float
    #: None where none was read; a non-finite one is None with its text in ``loss_text``.
    loss: float | None
    #: What the step's end was seen in (``deepspeed``, ``torch`` ...).
    src: str


class PhaseEdge(TypedDict):
    """A phase (``forward``, ``backward``, ``optimizer``, ``eval`` ...) begins or ends."""

    k: str
    t: float
    name: str
    #: "begin" or "end".
    edge: str
    #: Steps this rank had completed.
    step: int


class CudaFigures(TypedDict):
    """The CUDA caching allocator's counters at a reading (bytes)."""

    device: int
    alloc: int
    reserved: int
    max_alloc: int


class _Parts(TypedDict, total=False):
    #: The C heap in use (a CPU rank's allocations), where it was read.
    heap: int
    cuda: CudaFigures
    #: NVML's view of the device (a sampler's reading, now and then).
    nvml: dict[str, Any]


class MemReading(_Parts):
    """A memory reading: where it was taken (a phase edge, ``sampler``), the rank's RSS (None
    where it was not read) and the parts it has."""

    k: str
    t: float
    src: str
    step: int
    rss: int | None
