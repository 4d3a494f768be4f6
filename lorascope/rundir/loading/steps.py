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
from pathlib import Path

import numpy as np

from lorascope.rundir.format.layout import END, STEP_END, STEP_KINDS
from lorascope.rundir.loading.calls import STEPS, STEPS_V1, CallRecords, file_version, read_calls
from lorascope.rundir.loading.records import PhaseEdge, StepRecord
from lorascope.rundir.loading.reduce import Rule

#: What a record whose label no ``label`` record declares is read as.
UNKNOWN_LABEL = "unknown"


def read_steps(path: Path, who: str, warnings: list[str], newest: int | None = None) -> CallRecords:
    """The records of the steps file at ``path`` kept, in index order (``who``: ``rank R``,
    for the warnings; ``newest``: only the newest that many). A version-1 file (lorascope
    0.3.0) reads with ``waited`` 0.0 (not recorded)."""
    if file_version(path) != STEPS_V1.version:
        return read_calls(path, who, warnings, kind=STEPS, newest=newest)
    old = read_calls(path, who, warnings, kind=STEPS_V1, newest=newest)
    records = np.zeros(len(old.records), STEPS.dtype)
    for name in STEPS_V1.dtype.names or ():
        records[name] = old.records[name]
    old.records = records
    return old


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
    edges = _undropped(table[kinds < STEP_END], drop)
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


def _undropped(edges: np.ndarray, drop: Rule | None) -> np.ndarray:
    """The phase edges of ``edges`` whose step decimation may keep (all without ``drop``)."""
    if drop is None:
        return edges
    low, high, stride = drop
    numbers = edges["step"].astype(np.int64)
    sure = (numbers < high) & (numbers % stride != 0)
    if low is not None:
        sure &= numbers > low
    return edges[~sure]  # type: ignore[no-any-return]


def backward_spans_of(table: np.ndarray, labels: dict[int, str]) -> dict[int, list[tuple[float, float]]]:
    """:func:`~lorascope.rundir.loading.reduce.backward_spans` of the ``backward`` phase
    edges of ``table`` (in index order), without a record made of each: per step (+1), an
    end pairs with the begin just before it among that step's edges (a begin without its
    end is replaced by the next one; an end without a begin pairs with nothing), the
    steps in the order of their first pair."""
    ids = [n for n, text in labels.items() if text == "backward"]
    at = table[(table["kind"] < STEP_END) & np.isin(table["label"], ids)]
    keys = at["step"].astype(np.int64) + 1
    order = np.lexsort((np.arange(len(keys)), keys))  # each step's edges together, in index order
    key, begin = keys[order], at["kind"][order] != END
    paired = np.zeros(len(key), dtype=bool)
    paired[1:] = ~begin[1:] & begin[:-1] & (key[1:] == key[:-1])
    ends = np.nonzero(paired)[0]
    ends = ends[np.argsort(order[ends], kind="stable")]  # in index order, as they were read
    times = at["t"][order]
    spans: dict[int, list[tuple[float, float]]] = {}
    for step, t0, t1 in zip(key[ends].tolist(), times[ends - 1].tolist(), times[ends].tolist(), strict=True):
        spans.setdefault(step, []).append((t0, t1))
    return spans


def handle_waits(
    table: np.ndarray, labels: dict[int, str], drop: Rule | None = None
) -> tuple[dict[int, float], dict[int, dict[str, float]]]:
    """The time blocked on async collectives' handles (the records' ``waited``: since the
    step began): per step (the step record's number), a step's end record's; per step and
    phase name, within the phase's spans (each end's less its begin's; with ``drop``, not
    of the steps decimation is sure to drop). Steps with none left out: all of them where
    the probes recorded none (0.0 throughout)."""
    waited = table["waited"]
    if not len(waited) or not np.any(waited > 0):
        return {}, {}
    kinds = table["kind"]
    ends = table[(kinds == STEP_END) & (waited > 0)]
    per_step = dict(zip(ends["step"].tolist(), ends["waited"].tolist(), strict=True))
    edges = _undropped(table[(kinds < STEP_END) & (waited > 0)], drop)
    name = labels.get
    phases: dict[int, dict[str, float]] = {}
    for step, label, kind, w in zip(
        edges["step"].tolist(), edges["label"].tolist(), edges["kind"].tolist(), edges["waited"].tolist(), strict=True
    ):
        within = phases.setdefault(step + 1, {})
        key = name(label, UNKNOWN_LABEL)
        within[key] = within.get(key, 0.0) + (w if kind == END else -w)
    for within in phases.values():
        for key, w in within.items():
            within[key] = max(0.0, w)  # a span begun and never ended reads as none
    return per_step, phases
