"""Reading a rank's memory file (analysis side): its readings, as the ``mem`` records
:class:`~lorascope.rundir.loading.reader.RankData` holds.

The file is read as numpy columns (:func:`lorascope.rundir.loading.calls.read_calls` with
the memory file's kind: its header checked, each slot kept only if its stamp names its
index, a torn or never-written record dropped with a warning, a file cut short read as far
as it goes); the records are made from the columns' lists, where each was read looked up
in the stream's ``label`` records and NVML's part in its ``nvml`` records.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import numpy as np

from lorascope.rundir.loading.calls import MEMORY, CallRecords, read_calls
from lorascope.rundir.loading.records import MemReading
from lorascope.rundir.loading.reduce import Rule
from lorascope.rundir.loading.steps import UNKNOWN_LABEL

#: The columns a reading's peaks are of (:func:`~lorascope.rundir.loading.reduce._peaks`):
#: RSS, the heap and the CUDA counters (a reading without one holds -1 there).
PEAK_COLUMNS = ("rss", "heap", "alloc", "reserved", "max_alloc", "device")


def read_mem(path: Path, who: str, warnings: list[str], newest: int | None = None) -> CallRecords:
    """The readings of the memory file at ``path`` kept, in index order (``who``: ``rank
    R``, for the warnings; ``newest``: only the newest that many)."""
    return read_calls(path, who, warnings, kind=MEMORY, newest=newest)


def _held(table: np.ndarray, drop: Rule, nvml: dict[int, dict[str, Any]], index: np.ndarray) -> np.ndarray:
    """Which readings of ``table`` decimation may keep: those whose step it is not sure to
    drop, those holding a peak of a column (the first of its highest value: what
    :func:`~lorascope.rundir.loading.reduce.decimate` keeps whatever their step), and those
    with an NVML part (its figures' peaks are the stream's)."""
    low, high, stride = drop
    numbers = table["step"].astype(np.int64)
    sure = (numbers < high) & (numbers % stride != 0)
    if low is not None:
        sure &= numbers > low
    held = ~sure
    for column in PEAK_COLUMNS:
        values = table[column]
        if column in ("alloc", "reserved", "max_alloc"):
            values = np.where(table["device"] >= 0, values, -1)
        if len(values) and int(values.max()) >= 0:
            held[int(np.argmax(values))] = True
    if nvml:
        held |= np.isin(index, np.fromiter(nvml, np.int64, len(nvml)))
    return held  # type: ignore[no-any-return]


def as_records(
    kept: CallRecords,
    labels: dict[int, str],
    nvml: dict[int, dict[str, Any]],
    who: str,
    warnings: list[str],
    drop: Rule | None = None,
) -> list[MemReading]:
    """The ``mem`` records of the memory file's readings ``kept``, in index order, as
    RankData keeps them: ``{"src", "step", "rss", "heap"?, "cuda"?: {"device",
    "alloc", "reserved", "max_alloc"}, "nvml"?, "k", "t"}`` (``rss`` None where it was not
    read); ``nvml``: NVML's parts by reading index; with ``drop``, no reading decimation is
    sure to drop (:func:`_held`): a long run's are never all made."""
    table, index = kept.records, kept.index
    unlabelled = sorted(set(np.unique(table["src"]).tolist()) - set(labels))
    if unlabelled:
        warnings.append(
            f"{who}: memory-file records name label(s) {unlabelled[:5]} no 'label' record declares "
            f"(the stream lost its end?): read as {UNKNOWN_LABEL!r}"
        )
    if drop is not None and len(table):
        held = _held(table, drop, nvml, index)
        table, index = table[held], index[held]
    name = labels.get
    part = nvml.get
    out: list[MemReading] = []
    append = out.append
    for t, rss, heap, alloc, reserved, max_alloc, step, device, src, i in zip(
        table["t"].tolist(), table["rss"].tolist(), table["heap"].tolist(), table["alloc"].tolist(),
        table["reserved"].tolist(), table["max_alloc"].tolist(), table["step"].tolist(),
        table["device"].tolist(), table["src"].tolist(), index.tolist(), strict=True,
    ):  # fmt: skip
        # its fields in the stream's order (k and t last)
        rec = cast(MemReading, {"src": name(src, UNKNOWN_LABEL), "step": step, "rss": None if rss < 0 else rss})
        if heap >= 0:
            rec["heap"] = heap
        if device >= 0:
            rec["cuda"] = {"device": device, "alloc": alloc, "reserved": reserved, "max_alloc": max_alloc}
        extra = part(i)
        if extra is not None:
            rec["nvml"] = extra
        rec["k"] = "mem"
        rec["t"] = t
        append(rec)
    return out
