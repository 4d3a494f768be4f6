"""Reading a rank's steps file (analysis side): its steps' ends and phase edges, as the
records :class:`~lorascope.rundir.loading.reader.RankData` holds.

The file is read as numpy columns (:func:`lorascope.rundir.loading.calls.read_calls` with
the steps file's kind: its header checked, each slot kept only if its stamp names its
index, a torn or never-written record dropped with a warning, a file cut short read as far
as it goes); the records are made from the columns' lists, a phase's name and a step's
source looked up in the stream's ``label`` records.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from lorascope.rundir.format.layout import STEP_END, STEP_KINDS
from lorascope.rundir.loading.calls import STEPS, CallRecords, read_calls
from lorascope.rundir.loading.records import PhaseEdge, StepRecord
from lorascope.rundir.loading.reduce import Rule

#: What a record whose label no ``label`` record declares is read as.
UNKNOWN_LABEL = "unknown"


def read_steps(path: Path, who: str, warnings: list[str]) -> CallRecords:
    """The records of the steps file at ``path`` kept, in index order (``who``: ``rank R``,
    for the warnings)."""
    return read_calls(path, who, warnings, kind=STEPS)


def step_numbers(table: np.ndarray) -> list[int]:
    """The numbers of the step records among ``table``'s records."""
    return table["step"][table["kind"] == STEP_END].tolist()  # type: ignore[no-any-return]


def as_records(
    table: np.ndarray, labels: dict[int, str], who: str, warnings: list[str], drop: Rule | None = None
) -> tuple[list[StepRecord], list[PhaseEdge]]:
    """The ``step`` records and the ``phase`` records of ``table`` (the steps file's
    records, in index order), each kind in order, as RankData keeps them:
    ``{"step", "dur", "loss", "src", "k", "t"}`` (loss None where none was read) and
    ``{"name", "edge", "step", "k", "t"}``; with ``drop``, no phase record whose step
    decimation is sure to drop (:func:`~lorascope.rundir.loading.reduce.sure_dropped`):
    a long run's are never all made."""
    kinds = table["kind"]
    if len(kinds) and int(kinds.max()) > STEP_END:
        odd = int(np.count_nonzero(kinds > STEP_END))
        warnings.append(f"{who}: {odd:,} steps-file record(s) of an unknown kind: not read")
    unlabelled = sorted(set(np.unique(table["label"]).tolist()) - set(labels))
    if unlabelled:
        warnings.append(
            f"{who}: steps-file records name label(s) {unlabelled[:5]} no 'label' record declares "
            f"(the stream lost its end?): read as {UNKNOWN_LABEL!r}"
        )
    name = labels.get
    shared: dict[int, int] = {}  # one object per step number (the reader's summary holds and pickles them)
    ended = table[kinds == STEP_END]
    steps: list[StepRecord] = [
        {"step": step, "dur": dur, "loss": None if math.isnan(loss) else loss, "src": name(label, UNKNOWN_LABEL),
         "k": "step", "t": t}
        for t, dur, loss, step, label in zip(
            ended["t"].tolist(), ended["dur"].tolist(), ended["loss"].tolist(),
            [shared.setdefault(n, n) for n in ended["step"].tolist()],
            ended["label"].tolist(), strict=True,
        )
    ]  # fmt: skip
    edges = table[kinds < STEP_END]
    if drop is not None:
        low, high, stride = drop
        numbers = edges["step"].astype(np.int64)
        sure = (numbers < high) & (numbers % stride != 0)
        if low is not None:
            sure &= numbers > low
        edges = edges[~sure]
    edge_names = [STEP_KINDS[k] for k in range(STEP_END)]
    phases: list[PhaseEdge] = [
        {"name": name(label, UNKNOWN_LABEL), "edge": edge_names[kind], "step": step, "k": "phase", "t": t}
        for t, step, label, kind in zip(
            edges["t"].tolist(),
            [shared.setdefault(n, n) for n in edges["step"].tolist()],
            edges["label"].tolist(),
            edges["kind"].tolist(),
            strict=True,
        )
    ]
    return steps, phases


def backward_edges(table: np.ndarray, labels: dict[int, str]) -> Iterator[PhaseEdge]:
    """The ``backward`` phase edges of ``table``, as records with the fields
    :class:`~lorascope.rundir.loading.reduce.BackwardSpans` reads (made one at a time)."""
    ids = [n for n, text in labels.items() if text == "backward"]
    at = table[(table["kind"] < STEP_END) & np.isin(table["label"], ids)]
    edge_names = [STEP_KINDS[k] for k in range(STEP_END)]
    for t, step, kind in zip(at["t"].tolist(), at["step"].tolist(), at["kind"].tolist(), strict=True):
        yield {"name": "backward", "edge": edge_names[kind], "step": step, "k": "phase", "t": t}
