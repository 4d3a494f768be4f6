"""A process's collective records reduced as columns, with polars (analysis side).

Read line by line, a collective record costs ~20-35 us of Python (the regular expression of
:mod:`lorascope.rundir.loading.fastlines`, a Collective, the bounded log of
:mod:`lorascope.rundir.loading.reduce`), and they are eight records in ten. Here a stream is read
in blocks: polars picks out the lines in the probes' own layouts (the same regular
expressions), splits them into columns and reduces them a block at a time; every other
line goes back to the reader (:class:`Sink`), in order: a collective record not in the
probes' layout (an error message with escapes) joins the block's columns at its place,
a ``coll_dev`` (a CUDA call's device time) is matched to its call as the line reader
matches it, among the calls kept when the record was read. The result is what
:class:`~lorascope.rundir.loading.reduce.CollectiveLog` computes, field for field (the tests read
streams both ways and compare). Where that cannot be assured, :class:`Unsuitable` is
raised and the reader reads the stream again line by line:

* a call read before the stream's ``start`` record, or before its group's ``group``; a
  group name that is not a string;
* two calls with one (group, sequence number), a sequence number below 1, or a call
  more than one digest window behind the newest of its group (a repeated number is looked
  for among the two newest windows' only);
* times that are not all in one binade [2^(e-1), 2^e), or calls that took 2^(e-1)
  seconds or more in all. Within those bounds every sum of calls' durations is exact,
  so the order they are added in (CollectiveLog adds them in the order they started)
  does not matter. Epoch seconds (2^30..2^31) always qualify;
* a call pending for more than MAX_REORDER / 2 later calls (CollectiveLog gives up
  waiting for it at MAX_REORDER);
* a call that names a shape (format v2) no ``shape`` record before it declares;
* a line over the record size limit, or one that cannot be read.

polars runs one thread here (``POLARS_MAX_THREADS``, unless set): the reader already
runs one worker process per core.
"""

from __future__ import annotations

import bisect
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from lorascope.rundir.format import limits
from lorascope.rundir.format.safe_open import open_regular
from lorascope.rundir.loading.fastlines import CALL_LINE, END_LINE, FLAT_LAYOUTS, SHAPED_LINE, Layout, Shapes, flat_line
from lorascope.rundir.loading.reduce import (
    HEAD_CALLS,
    MAX_REORDER,
    MIX_A,
    MIX_B,
    NO_BYTES,
    TAIL_CALLS,
    WINDOW,
    GroupTally,
    Rule,
    SyncTimes,
    name_code,
)

if TYPE_CHECKING:
    import polars as pl

    from lorascope.rundir.loading.reader import Collective

#: Streams smaller than this are read line by line (importing polars costs ~0.3 s) ...
MIN_BYTES = 8 << 20
#: ... unless polars is imported already (a worker of a parallel read imports it at its
#: start): then from this size on. Per stream, polars costs ~10-20 ms more than it saves
#: below ~1 MB, and saves ~30 ms a MB above it (probes/ job streams: 0.6 MB 51 vs 41 ms
#: line by line, 1.0 MB 67 vs 80, 1.5 MB 73 vs 116, 2.2 MB 73 vs 162).
MIN_BYTES_LOADED = 1 << 20
#: Bytes read at a time (a block is cut at its last newline).
BLOCK_BYTES = 4 << 20
#: Collective records that may also come as JSON (not in the probes' layout).
_AS_JSON = frozenset({"coll", "coll_done", "coll_end"})
_PREFIX = b'{"k":"coll'


class Unsuitable(Exception):
    """The stream needs the line-by-line reader; the message says why."""


class Sink(Protocol):
    """The reader's side: every line that is not a collective record in the probes'
    layout, and what it knows of the stream's groups."""

    def decode(self, path: Path, number: int, line: bytes, deep_lines: list[int]) -> Any:
        """The line's record, or None when there is nothing to apply."""

    def decode_many(self, path: Path, numbers: list[int], lines: list[bytes], deep_lines: list[int]) -> list[Any]:
        """``decode`` of many lines, given without their newlines."""

    def record(self, path: Path, number: int, rec: Any) -> None:
        """Validate and apply one record (BadInputError if it is bad)."""

    def extend(self, path: Path, number: int, kind: str, recs: list[dict[str, Any]], last: float) -> None:
        """Apply records of one of FLAT_LAYOUTS' kinds, valid by their layout, in stream
        order (``number``: the first one's line; ``last``: a time no earlier than theirs,
        of a record of the stream)."""

    def sure_to_drop(self, kind: str) -> Rule | None:
        """Which records of ``kind`` decimation is sure to drop unless they hold a peak
        (:meth:`~lorascope.rundir.loading.reduce.StepKeeper.sure_to_drop`); None: none."""

    def dropped(self, path: Path, number: int, kind: str, count: int, last: float) -> None:
        """``count`` records of ``kind`` that were not made (``sure_to_drop``); ``last``, a
        time no earlier than theirs."""

    def check(self, path: Path, number: int, rec: Any) -> None:
        """Validate a collective record read as JSON, which is not applied (the log
        takes it); BadInputError if it is bad or comes before the stream's start."""

    #: The call shapes declared so far (format v2's ``shape`` records, which it is given).
    shapes: Shapes

    def shaped(self, path: Path, number: int, rec: dict[str, Any]) -> dict[str, Any]:
        """A validated call record read as JSON, with its shape's fields if it names one
        (BadInputError if it names an undeclared one)."""

    def group_name(self, gid: int) -> Any:
        """The name calls of group ``gid`` are kept under."""

    def device_group(self, gid: int) -> Any:
        """The name a ``coll_dev`` record of group ``gid`` looks its call up under (a
        string, else there is none)."""

    def file_done(self, path: Path, deep_lines: list[int]) -> None:
        """One segment file read to its end."""


def suits(total: int) -> bool:
    """Whether a stream of ``total`` bytes is worth reading column-wise (and polars can be
    imported)."""
    if total < MIN_BYTES and not (total >= MIN_BYTES_LOADED and "polars" in sys.modules):
        return False
    return available()


def available() -> bool:
    """Whether polars can be imported (the analysis extra installs it)."""
    os.environ.setdefault("POLARS_MAX_THREADS", "1")
    try:
        import polars  # noqa: F401
    except ImportError:
        return False
    return True


def read(segs: list[tuple[int, Path]], sink: Sink, windows: dict[str, list[tuple[int, int]]] | None) -> ColumnarLog:
    """Read every segment of one process: other records to ``sink``, collective records
    reduced into the returned log; Unsuitable when the stream needs the line reader."""
    log = ColumnarLog(windows, sink.sure_to_drop)
    pending = _Pending()
    max_line = limits.current().record_bytes
    for _, path in segs:
        deep_lines: list[int] = []
        number = 0
        for lines, last in _blocks(path, max_line):
            if lines:
                _block(log, sink, pending, path, number, lines, deep_lines)
                number += len(lines)
                log.base += len(lines)
            if last:
                pending.flush(sink)
                number += 1
                held: list[tuple[int, dict[str, Any]]] = []
                devices: list[tuple[int, str, int, float]] = []
                rec = sink.decode(path, number, last, deep_lines)
                _other(log, sink, path, number, log.base, rec, held, devices, {}, None)
                if held or devices:
                    calls, ends = _held(held)
                    log.add(calls, ends, _names(sink, calls), devices)
                log.base += 1
        sink.file_done(path, deep_lines)
    pending.flush(sink)
    return log


def _blocks(path: Path, max_line: int) -> Iterator[tuple[list[bytes], bytes]]:
    """The file's newline-terminated lines, a block at a time, without their newlines;
    then (an empty list and) whatever follows the last newline, if anything."""
    try:
        with open_regular(path, inside=path.parent) as f:  # in its rank folder, checked by _segments
            rest = b""
            while chunk := f.read(BLOCK_BYTES):
                data = rest + chunk if rest else chunk
                cut = data.rfind(b"\n")
                if cut < 0:
                    rest = data
                else:
                    lines, rest = data[:cut].split(b"\n"), data[cut + 1 :]
                    if len(data) > max_line and max(map(len, lines)) > max_line:  # (no line is longer than its block)
                        raise Unsuitable("a line over the record size limit")
                    yield lines, b""
                if len(rest) > max_line:
                    raise Unsuitable("a line over the record size limit")
            if rest:
                yield [], rest
    except Unsuitable:
        raise
    except Exception as exc:  # OSError, or BadInputError from open_regular: the line reader says it
        raise Unsuitable(f"unreadable: {exc}") from None


def _other(
    log: ColumnarLog,
    sink: Sink,
    path: Path,
    number: int,
    position: int,
    rec: Any,
    held: list[tuple[int, dict[str, Any]]],
    devices: list[tuple[int, str, int, float]],
    first_call: dict[int, int],
    first_fast: int | None,
) -> None:
    """The record of a line (``number`` in its file, ``position`` in the stream) that is
    not a collective record in the probes' layout (None: nothing to apply): to the sink,
    or, a collective record all the same (an error message with escapes), validated and
    added to ``held``; a call's device time (``coll_dev``) to ``devices`` (position, group,
    sequence number, ms). ``first_call``: per group id, the position of its first call in
    this block; ``first_fast``: of its first collective record in the layout."""
    if rec is None:
        return
    if log.start_at is None and first_fast is not None and first_fast < position:
        raise Unsuitable("a collective record before the 'start' record")
    kind = rec.get("k") if isinstance(rec, dict) else None
    if kind == "coll_dev":
        sink.check(path, number, rec)
        log.last_time = max(log.last_time, float(rec["t"]))
        name = sink.device_group(rec["gid"])
        if isinstance(name, str):
            devices.append((position, name, rec["seq"], float(rec["ms"])))
        return
    if kind in _AS_JSON:
        sink.check(path, number, rec)
        rec = sink.shaped(path, number, rec)
        held.append((position, rec))
        if kind != "coll_end":
            first_call[rec["gid"]] = min(first_call.get(rec["gid"], position), position)
        return
    sink.record(path, number, rec)
    if kind == "shape":
        log.declared_at.setdefault(rec["id"], position)
    elif kind == "start" and log.start_at is None:
        log.start_at = position
    elif kind == "group":
        gid = rec["gid"]
        if gid in log.gids or first_call.get(gid, position) < position:
            raise Unsuitable(f"calls of group {gid} before its 'group' record")


def _held(held: list[tuple[int, dict[str, Any]]]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Collective records read as JSON, as the columns of :func:`_calls` and :func:`_ends`."""
    import polars as pl

    calls, ends = [], []
    for n, rec in held:
        if rec["k"] == "coll_end":
            ends.append((n, float(rec["t"]), rec["seq"], rec["gid"], rec["err"]))
            continue
        done = rec["k"] == "coll_done"
        via = rec.get("via")
        calls.append(
            (
                n, done, float(rec["t"]), rec["seq"], rec["gid"], rec["op"], rec["bytes"], rec["dtype"], rec["async"],
                rec["site"], rec["step"], via if isinstance(via, str) else None,
                float(rec["end"]) if done else None, rec["err"] if done else None,
            )
        )  # fmt: skip
    return (
        pl.DataFrame(calls, schema={k: getattr(pl, v) for k, v in _CALL_SCHEMA.items()}, orient="row"),
        pl.DataFrame(ends, schema={k: getattr(pl, v) for k, v in _END_SCHEMA.items()}, orient="row"),
    )


def _block(
    log: ColumnarLog, sink: Sink, pending: _Pending, path: Path, before: int, lines: list[bytes], deep: list[int]
) -> None:
    """One block of a file (``before``: its lines before the block): the other lines to the
    sink in order, then the collective records to the log; its ``mem`` and ``phase``
    lines to ``pending``, each kind unless other records of it (or no ``start`` record
    yet) need them applied in order."""
    import polars as pl

    raw = pl.Series(lines, dtype=pl.Binary)
    where = raw.bin.starts_with(_PREFIX).arg_true()
    frame = pl.DataFrame({"pos": where, "l": raw.gather(where).cast(pl.String, strict=False)})
    # (a coll_done without its end is left to JSON, which says why; a line in one layout
    # is in no other: the others are looked for among the lines left)
    is_shaped = frame["l"].str.contains(SHAPED_LINE).fill_null(False)
    shaped = _shaped_calls(frame.filter(is_shaped), log.base)
    shaped = shaped.filter(~(pl.col("done") & pl.col("end").is_null()))
    frame = frame.filter(~is_shaped)
    calls = _calls(frame.filter(pl.col("l").str.contains(CALL_LINE).fill_null(False)), log.base)
    calls = calls.filter(~(pl.col("done") & pl.col("end").is_null()))
    ends = _ends(frame.filter(pl.col("l").str.contains(END_LINE).fill_null(False)), log.base)
    positions = pl.concat([calls["n"], shaped["n"], ends["n"]])
    # (scatter's indices sorted: polars 1.30 and 1.33 refuse others, "set indices must be sorted")
    fast = pl.Series("fast", [False] * len(lines), dtype=pl.Boolean).scatter((positions - log.base).sort(), True)
    starts = pl.concat([calls.select("gid", "n"), shaped.select("gid", "n")])
    first_call = dict(starts.group_by("gid").agg(pl.col("n").min()).iter_rows()) if starts.height else {}
    first = int(positions.min()) if positions.len() else None  # type: ignore[arg-type]
    held: list[tuple[int, dict[str, Any]]] = []
    devices: list[tuple[int, str, int, float]] = []
    flat = _Flat(raw, sink, path, before)
    if flat.positions:
        fast = fast.scatter(sorted(flat.positions), True)
    others = (~fast).arg_true().to_list()
    recs = sink.decode_many(path, [before + i + 1 for i in others], [lines[i] for i in others], deep)
    if log.start_at is None:
        pending.flush(sink)
    else:  # (a kind whose records this block also has as JSON, a CUDA rank's mem, in order)
        kinds = {rec.get("k") for rec in recs if isinstance(rec, dict)}
        inline = [kind for kind in _DEFERRED if kind in kinds]
        pending.flush(sink, inline)
        pending.add(flat, [kind for kind in _DEFERRED if kind not in inline])
    flat.make()
    for i, rec in zip(others, recs, strict=True):
        flat.apply_before(i)
        _other(log, sink, path, before + i + 1, log.base + i, rec, held, devices, first_call, first)
    flat.apply_before(len(lines))
    if shaped.height:
        calls = pl.concat([calls, _with_shapes(shaped, sink.shapes, log.declared_at)]).sort("n")
    if held:
        more_calls, more_ends = _held(held)
        calls, ends = pl.concat([calls, more_calls]).sort("n"), pl.concat([ends, more_ends]).sort("n")
        first = min(held[0][0], first) if first is not None else held[0][0]
    if first is not None and (log.start_at is None or log.start_at > first):
        raise Unsuitable("a collective record before the 'start' record")
    if first is not None or devices:
        log.add(calls, ends, _names(sink, calls), devices)


class _Flat:
    """A block's lines in one of FLAT_LAYOUTS' layouts, as columns (per kind, a frame per
    layout), then as records (:meth:`make`: made dicts as ``json.loads`` makes them: the
    same keys in the same order, the same values and types), applied to the sink in
    stream order with the block's other lines."""

    def __init__(self, raw: pl.Series, sink: Sink, path: Path, before: int) -> None:
        self.sink, self.path, self.before = sink, path, before
        #: Per kind, its lines' columns (``pos`` in the block, the layout's fields, t) per layout.
        self.frames: dict[str, list[tuple[Layout, pl.DataFrame]]] = {}
        #: Per kind: its records' positions in the block, the records; how many applied.
        self.kinds: list[tuple[str, list[int], list[dict[str, Any]]]] = []
        self.applied: list[int] = []
        #: Every line's position; the latest time of any (the sink keeps the latest).
        self.positions: list[int] = []
        self.latest = 0.0
        for kind, layouts in FLAT_LAYOUTS.items():
            for layout in layouts:
                frame = _flat_columns(raw, kind, layout)
                if frame is not None:
                    self.frames.setdefault(kind, []).append((layout, frame))
                    self.positions.extend(frame["pos"].to_list())
                    self.latest = max(self.latest, float(frame["t"].max()))  # type: ignore[arg-type]

    def make(self) -> None:
        """The records of the kinds whose columns are still here, to be applied."""
        for kind, frames in self.frames.items():
            positions, recs = _made(kind, frames)
            self.kinds.append((kind, positions, recs))
            self.applied.append(0)

    def apply_before(self, end: int) -> None:
        """Apply the records at block positions below ``end`` not applied yet, each kind's
        in order, the kind that comes first first (its line is the one a stream without a
        ``start`` record before it is faulted at)."""
        due = []
        for i, (kind, positions, recs) in enumerate(self.kinds):
            done = self.applied[i]
            upto = bisect.bisect_left(positions, end, done)
            if upto > done:
                due.append((positions[done], kind, recs[done:upto]))
                self.applied[i] = upto
        for first, kind, recs in sorted(due, key=lambda d: d[0]):
            self.sink.extend(self.path, self.before + first + 1, kind, recs, self.latest)


#: The kinds of FLAT_LAYOUTS held as columns across blocks (:class:`_Pending`); the
#: ``step`` records are applied at once (a later ``loss`` record may change one).
_DEFERRED = ("mem", "phase")
#: The types of FLAT_LAYOUTS' values that :func:`~lorascope.rundir.loading.reduce._peaks` looks at.
_NUMERIC = frozenset({"int", "opt_int", "float", "opt_float"})
#: Lines held as columns before they are applied, at most (~60 bytes each).
PENDING_LINES = 1 << 16


class _Pending:
    """Blocks' ``mem`` and ``phase`` lines as columns, until they are applied (a kind's
    before any other record of it, all past PENDING_LINES and at the end): those
    decimation is then sure to drop (the sink's ``sure_to_drop``) are never made records,
    only counted: most of a long run's. A record a block applies at once has the steps
    before it only, so most of its lines were of steps too recent to be sure of. Kept,
    whatever their step: a record that may hold a peak (the first highest value of a
    field in its block: one before it holds as much otherwise) and the ``backward`` phase
    edges (the time outside backward is taken from all)."""

    def __init__(self) -> None:
        #: (path, lines before the block, latest time, kind, that kind's frames), in order.
        self.blocks: list[tuple[Path, int, float, str, list[tuple[Layout, pl.DataFrame]]]] = []
        self.lines = 0

    def add(self, flat: _Flat, kinds: list[str]) -> None:
        """Take ``kinds``' columns of ``flat`` (a block whose other lines hold none)."""
        for kind in kinds:
            frames = flat.frames.pop(kind, None)
            if frames:
                self.blocks.append((flat.path, flat.before, flat.latest, kind, frames))
                self.lines += sum(frame.height for _, frame in frames)
        if self.lines > PENDING_LINES:
            self.flush(flat.sink)

    def flush(self, sink: Sink, kinds: Iterable[str] = _DEFERRED) -> None:
        """Apply every line held of ``kinds``, in order, but those sure to be dropped."""
        rules = {kind: sink.sure_to_drop(kind) for kind in kinds}
        if not rules:
            return
        held = [block for block in self.blocks if block[3] not in rules]
        for path, before, latest, kind, frames in self.blocks:
            if kind not in rules:
                continue
            rule = rules[kind]
            if rule is not None:
                kept = []
                for layout, frame in frames:
                    gone = _sure_to_drop(kind, layout, rule)
                    out = frame.filter(gone)
                    kept.append((layout, frame.filter(~gone)))
                    if out.height:
                        sink.dropped(path, before + int(out["pos"][0]) + 1, kind, out.height, latest)
                frames = kept
            positions, recs = _made(kind, frames)
            if recs:
                sink.extend(path, before + positions[0] + 1, kind, recs, latest)
        self.blocks = held
        self.lines = sum(frame.height for *_, frames in held for _, frame in frames)


def _flat_columns(raw: pl.Series, kind: str, layout: Layout) -> pl.DataFrame | None:
    """The block's lines in one layout of ``kind`` as columns: ``pos`` (in the block), the
    layout's fields, t (None: no line)."""
    import polars as pl

    first = f'{{"{layout[0][0]}":'
    where = raw.bin.starts_with(first.encode()).arg_true()
    if not where.len():
        return None
    frame = pl.DataFrame({"pos": where, "l": raw.gather(where).cast(pl.String, strict=False)})
    frame = frame.filter(pl.col("l").str.contains(flat_line(kind, layout)).fill_null(False))
    if not frame.height:
        return None
    # the layout's fields (the first after ``{"``), then k and t (before its closing brace)
    n = len(layout) + 2
    values = [
        _flat_value(pl.col(f"f{i}").str.slice(len(key) + (4 if i == 0 else 2)), value).alias(key)
        for i, (key, value) in enumerate(layout)
    ]
    t = _value(pl.col(f"f{n - 1}"), "t").cast(pl.Float64).alias("t")
    return _pieces(frame, n).select("pos", *values, t)


def _made(kind: str, frames: list[tuple[Layout, pl.DataFrame]]) -> tuple[list[int], list[dict[str, Any]]]:
    """The records of a kind's columns (a frame per layout), in the order of their lines:
    their positions, the records."""
    pairs: list[tuple[int, dict[str, Any]]] = []
    for layout, frame in frames:
        # made a key at a time (a record's keys in the layout's order): ~5x faster than a
        # dict(zip(keys, row)) per record
        recs: list[dict[str, Any]] = [{} for _ in range(frame.height)]
        for key, values in [
            *((key, frame[key].to_list()) for key, _ in layout),
            ("k", [kind] * frame.height),
            ("t", frame["t"].to_list()),
        ]:
            for rec, value in zip(recs, values, strict=True):
                rec[key] = value
        pairs.extend(zip(frame["pos"].to_list(), recs, strict=True))
    if len(frames) > 1:
        pairs.sort(key=lambda pair: pair[0])
    return [p for p, _ in pairs], [rec for _, rec in pairs]


def _dropped_steps(step: pl.Expr, rule: Rule) -> pl.Expr:
    """:func:`~lorascope.rundir.loading.reduce.sure_dropped` as an expression (null where the step is)."""
    low, high, stride = rule
    gone = (step < high) & (step % stride != 0)
    return gone if low is None else gone & (step > low)


def _sure_to_drop(kind: str, layout: Layout, rule: Rule) -> pl.Expr:
    """Whether a line of the layout's columns need not be made a record: its step is one
    decimation is sure to drop (``rule``: low, high, stride), it holds no field's first
    highest value among the columns, and it is not a backward phase edge."""
    import polars as pl

    gone = _dropped_steps(pl.col("step"), rule)
    if kind == "phase":
        gone = gone & (pl.col("name") != "backward")
    for key, value in layout:
        if value in _NUMERIC and key != "step":
            gone = gone & (pl.int_range(pl.len()) != pl.col(key).arg_max()).fill_null(True)
    return gone.fill_null(False)


def _flat_value(text: pl.Expr, value: str) -> pl.Expr:
    """A value of FLAT_LAYOUTS' type ``value`` from its JSON text."""
    import polars as pl

    if value == "str":
        return _string(text)  # (never null: the layout says so)
    dtype = pl.Int64 if value.endswith("int") else pl.Float64
    return _nullable(text, dtype) if value.startswith("opt_") else text.cast(dtype)


def _names(sink: Sink, calls: pl.DataFrame) -> dict[int, str]:
    """The group names of the calls' group ids (the line reader's, which must be strings)."""
    names = {gid: sink.group_name(gid) for gid in calls["gid"].unique().to_list()}
    if not all(isinstance(name, str) for name in names.values()):
        raise Unsuitable("a group name that is not a string")
    return names


_CALL_SCHEMA = {
    "n": "Int64", "done": "Boolean", "t": "Float64", "seq": "Int64", "gid": "Int64", "op": "String", "bytes": "Int64",
    "dtype": "String", "async": "Boolean", "site": "String", "step": "Int64", "via": "String", "end": "Float64",
    "err": "String",
}  # fmt: skip
#: The columns a call's shape gives it (format v2), in SHAPE_FIELDS' order.
_SHAPE_COLUMNS = ("op", "bytes", "dtype", "async", "site")
_END_SCHEMA = {"n": "Int64", "t": "Float64", "seq": "Int64", "gid": "Int64", "err": "String"}


def _pieces(frame: pl.DataFrame, n: int) -> pl.DataFrame:
    """Lines (``pos``, ``l``) in one of the probes' layouts split into their ``n`` pieces
    ``f0``.., the line's closing brace left out: the layout is known, and no string in it
    holds a double quote, so ``,"`` only ever separates fields (a missing piece is null)."""
    import polars as pl

    fields = [f"f{i}" for i in range(n)]
    line = pl.col("l").str.strip_suffix("}")
    return frame.select(pl.col("pos"), line.str.split_exact(',"', n - 1).struct.rename_fields(fields)).unnest("l")


def _value(piece: pl.Expr, key: str) -> pl.Expr:
    """The value text of a ``key":value`` piece."""
    return piece.str.slice(len(key) + 2)


def _string(value: pl.Expr) -> pl.Expr:
    """A string's JSON text, or null (the layouts' strings hold no double quote)."""
    import polars as pl

    return pl.when(value == "null").then(None).otherwise(value.str.strip_chars('"'))


def _nullable(value: pl.Expr, dtype: Any) -> pl.Expr:
    """A number's JSON text, or null, as ``dtype``."""
    import polars as pl

    return pl.when(value == "null").then(None).otherwise(value).cast(dtype)


def _calls(frame: pl.DataFrame, base: int) -> pl.DataFrame:
    """``coll`` and ``coll_done`` lines (``pos``, ``l``) that match CALL_LINE, as columns
    (pieces: k, t, seq, gid, op, bytes, dtype, async, site, step, ...: :func:`_split_calls`)."""
    import polars as pl

    return _split_calls(
        frame,
        base,
        [
            ("op", _string),
            ("bytes", lambda v: _nullable(v, pl.Int64)),
            ("dtype", _string),
            ("async", lambda v: v == "true"),
            ("site", _string),
        ],
    )


def _shaped_calls(frame: pl.DataFrame, base: int) -> pl.DataFrame:
    """``coll`` and ``coll_done`` lines that match SHAPED_LINE (format v2: the call names
    its shape), as columns: those of :func:`_calls` but the shape's, and ``sh`` (pieces:
    k, t, seq, gid, sh, step, ...: :func:`_split_calls`)."""
    import polars as pl

    return _split_calls(frame, base, [("sh", lambda v: v.cast(pl.Int64))])


def _split_calls(
    frame: pl.DataFrame, base: int, middle: list[tuple[str, Callable[[pl.Expr], pl.Expr]]]
) -> pl.DataFrame:
    """Call lines (``pos``, ``l``) of one layout as columns (:func:`_pieces`): k, t, seq,
    gid, then the ``middle`` ones (each key's value text to its column), then step, ``via``
    (if any) and ``end``, ``err`` (coll_done)."""
    import polars as pl

    step = 4 + len(middle)  # the index of the step piece; via / end / err follow it
    parts = _pieces(frame, step + 4)
    f = pl.col
    has_via = f(f"f{step + 1}").str.starts_with('via":').fill_null(False)
    end_piece = pl.when(has_via).then(f(f"f{step + 2}")).otherwise(f(f"f{step + 1}"))
    err_piece = pl.when(has_via).then(f(f"f{step + 3}")).otherwise(f(f"f{step + 2}"))
    done = f("f0") == '{"k":"coll_done"'
    has_end = done & end_piece.str.starts_with('end":').fill_null(False)
    return parts.select(
        (f("pos").cast(pl.Int64) + base).alias("n"),
        done.alias("done"),
        _value(f("f1"), "t").cast(pl.Float64).alias("t"),
        _value(f("f2"), "seq").cast(pl.Int64).alias("seq"),
        _value(f("f3"), "gid").cast(pl.Int64).alias("gid"),
        *(column(_value(f(f"f{4 + i}"), key)).alias(key) for i, (key, column) in enumerate(middle)),
        _value(f(f"f{step}"), "step").cast(pl.Int64).alias("step"),
        pl.when(has_via).then(_string(_value(f(f"f{step + 1}"), "via"))).alias("via"),
        pl.when(has_end).then(_value(end_piece, "end").cast(pl.Float64)).alias("end"),
        pl.when(has_end).then(_string(_value(err_piece, "err"))).alias("err"),
    )


def _with_shapes(shaped: pl.DataFrame, shapes: Shapes, declared_at: dict[int, int]) -> pl.DataFrame:
    """Calls that name their shape, with its fields, as the columns of :func:`_calls`;
    Unsuitable if one names a shape no ``shape`` record before it declares (the line
    reader says which)."""
    import polars as pl

    table = pl.DataFrame(
        [(sh, declared_at.get(sh), *shape) for sh, shape in shapes.items()],
        schema={"sh": pl.Int64, "at": pl.Int64, **{k: getattr(pl, _CALL_SCHEMA[k]) for k in _SHAPE_COLUMNS}},
        orient="row",
    )
    out = shaped.join(table, on="sh", how="left", maintain_order="left")
    if (out["at"].is_null() | (out["at"] > out["n"])).any():
        raise Unsuitable("a call that names a shape not declared before it")
    return out.select(list(_CALL_SCHEMA))


def _ends(frame: pl.DataFrame, base: int) -> pl.DataFrame:
    """``coll_end`` lines that match END_LINE, as columns: n (the stream position), t, seq, gid, err."""
    import polars as pl

    parts = _pieces(frame, 5)
    f = pl.col
    return parts.select(
        (f("pos").cast(pl.Int64) + base).alias("n"),
        _value(f("f1"), "t").cast(pl.Float64).alias("t"),
        _value(f("f2"), "seq").cast(pl.Int64).alias("seq"),
        _value(f("f3"), "gid").cast(pl.Int64).alias("gid"),
        _string(_value(f("f4"), "err")).alias("err"),
    )


def _mix(z: pl.Expr) -> pl.Expr:
    """:func:`~lorascope.rundir.loading.reduce.mix` of a UInt64 column (polars' integer
    arithmetic wraps; a test holds it to that)."""
    import polars as pl

    z = z.xor(z // (1 << 30)) * pl.lit(MIX_A, dtype=pl.UInt64)
    z = z.xor(z // (1 << 27)) * pl.lit(MIX_B, dtype=pl.UInt64)
    return z.xor(z // (1 << 31))


def _window_sums(rows: pl.DataFrame) -> pl.DataFrame:
    """Per window index (``w``) of the calls ``rows``, the sums modulo 2^64 of their
    :func:`~lorascope.rundir.loading.reduce.call_hashes` (the two columns of a digest). Each
    hash's steps are columns of their own: an expression nesting :func:`_mix` in
    :func:`_mix` repeats its inner one (4 ms, not 0.1 ms, a 28,000-call block)."""
    import polars as pl

    def code(column: str) -> pl.Expr:
        names = {name: name_code(name) for name in rows[column].unique().to_list() if name is not None}
        by_name = pl.col(column).replace_strict(names, default=None, return_dtype=pl.UInt64)
        return by_name.fill_null(pl.lit(name_code(None), dtype=pl.UInt64))

    f = pl.col
    size = f("bytes").reinterpret(signed=False).fill_null(pl.lit(NO_BYTES, dtype=pl.UInt64))
    return (
        rows.select("w", f("seq").cast(pl.UInt64).xor(code("op")).alias("h"), size.alias("size"), code("dtype"))
        .select("w", _mix(f("h")).xor(f("size")).alias("h"), "dtype")
        .select("w", _mix(f("h")).alias("op_size"), "dtype")
        .select("w", "op_size", f("op_size").xor(f("dtype")).alias("full"))
        .select("w", "op_size", _mix(f("full")).alias("full"))
        .group_by("w", maintain_order=True)
        .agg(f("op_size").sum(), f("full").sum())
    )


class _FrameSyncTimes(SyncTimes):
    """:class:`~lorascope.rundir.loading.reduce.SyncTimes` whose calls come a block at a time, as a
    frame (step + 1, start ``t``, seconds ``took``); those of calls ended in a later block
    than their start come one by one (:meth:`add`)."""

    def __init__(self, sure_to_drop: Callable[[str], Rule | None]) -> None:
        super().__init__(sure_to_drop)
        self.blocks: list[pl.DataFrame] = []

    def add_block(self, sync: pl.DataFrame) -> None:
        import polars as pl

        for step, took in sync.group_by("step", maintain_order=True).agg(pl.col("took").sum()).iter_rows():
            self.sums[step] = self.sums.get(step, 0.0) + took
        self.blocks.append(sync)
        self.grew(sync.height)

    def forget_more(self, rule: Rule) -> int:
        """The frames' calls of dropped steps forgotten (the rest made one frame)."""
        import polars as pl

        gone = _dropped_steps(pl.col("step"), rule).fill_null(False)
        self.blocks = [pl.concat(self.blocks).filter(~gone)] if self.blocks else []
        return sum(f.height for f in self.blocks)


class ColumnarLog:
    """What :class:`~lorascope.rundir.loading.reduce.CollectiveLog` keeps and counts, fed a block
    of calls and ends at a time (see the module's docstring for when it declines)."""

    def __init__(
        self, windows: dict[str, list[tuple[int, int]]] | None, sure_to_drop: Callable[[str], Rule | None]
    ) -> None:
        self.tallies: dict[str, GroupTally] = {}
        self.sync = _FrameSyncTimes(sure_to_drop)
        self.op_totals: dict[str, tuple[float, int]] = {}
        self.last_time = 0.0
        #: Lines of the stream before the current block; where the start record was.
        self.base = 0
        self.start_at: int | None = None
        #: Group ids that have had calls.
        self.gids: set[int] = set()
        #: Shape id -> the stream position of its first ``shape`` record.
        self.declared_at: dict[int, int] = {}
        self.windows = windows or {}
        self._head: dict[str, pl.DataFrame] = {}
        self._tail: dict[str, pl.DataFrame] = {}
        self._extra: list[pl.DataFrame] = []
        #: Per group: the sequence numbers of its two newest windows' calls, by window
        #: index; the newest window index.
        self._recent: dict[str, dict[int, set[int]]] = {}
        self._newest: dict[str, int] = {}
        #: Calls without an end yet: (gid, seq) -> (call number, start, op, async, step, group).
        self._pending: dict[tuple[int, int], tuple[int, float, str, bool, int, str]] = {}
        #: Ends of calls read in an earlier block than their end: (gid, seq) -> (end, err).
        self._late_ends: dict[tuple[int, int], tuple[float, str | None]] = {}
        self._calls = 0
        self._binade: int | None = None
        self._took = 0.0

    def add(
        self,
        calls: pl.DataFrame,
        ends: pl.DataFrame,
        names: dict[int, str],
        devices: list[tuple[int, str, int, float]],
    ) -> None:
        """One block's calls (``_calls``) and ends (``_ends``), both in stream order, and
        its device times (position, group, sequence number, ms)."""
        import polars as pl

        calls = calls.with_columns(
            pl.col("gid").replace_strict(names, return_dtype=pl.String, default=None).alias("group"),
            pl.lit(None, dtype=pl.Float64).alias("device_ms"),
            (pl.int_range(pl.len(), dtype=pl.Int64) + self._calls).alias("call"),
            pl.when(pl.col("done")).then(pl.col("n")).alias("end_n"),
        )
        self._calls += calls.height
        late = self._match_ends(calls, ends)
        if late.height:
            calls = (
                calls.join(late, on=["gid", "seq"], how="left", maintain_order="left")
                .with_columns(
                    pl.coalesce("end", "e_end").alias("end"),
                    pl.when(pl.col("e_n").is_not_null()).then(pl.col("e_err")).otherwise(pl.col("err")).alias("err"),
                    pl.coalesce("end_n", "e_n").alias("end_n"),
                )
                .drop("e_end", "e_err", "e_n")
            )
        self._exact(calls, ends)
        self.gids.update(calls["gid"].unique().to_list())
        evicted: list[pl.DataFrame] = []
        for (group,), rows in calls.partition_by("group", maintain_order=True, as_dict=True).items():
            if str(group) not in self.tallies:
                self.tallies[str(group)] = GroupTally(first_seq=int(rows["seq"][0]))
            self._windows(str(group), rows)
            evicted.extend(self._keep(str(group), rows))
        fresh = pl.concat(evicted).sort("evictor") if evicted else None
        if devices:
            fresh = self._device_times(devices, fresh)
        if fresh is not None:
            self._extra.append(fresh.drop("evictor"))
        self._sum(calls.filter(pl.col("end").is_not_null()))
        for row in calls.filter(pl.col("end").is_null() & ~pl.col("done")).iter_rows(named=True):
            self._pending[(row["gid"], row["seq"])] = (
                row["call"], row["t"], row["op"], row["async"], row["step"], row["group"]
            )  # fmt: skip
        if self._pending and self._calls - min(p[0] for p in self._pending.values()) > MAX_REORDER // 2:
            raise Unsuitable("a call pending for too many later calls")
        for column in (calls["t"], calls["end"], ends["t"]):
            if column.len() and column.null_count() < column.len():
                self.last_time = max(self.last_time, float(column.max()))  # type: ignore[arg-type]

    def _match_ends(self, calls: pl.DataFrame, ends: pl.DataFrame) -> pl.DataFrame:
        """Ends matched to their calls, as the line reader does (the first end read after a
        call ends it): those of earlier blocks' calls are taken in (sums, tallies, tails);
        returns (gid, seq, e_end, e_err, e_n) of this block's calls ended in it."""
        import polars as pl

        if not ends.height:
            return pl.DataFrame()
        on = ["gid", "seq"]
        rest = ends.with_row_index("i")
        if self._pending:
            pending = pl.DataFrame(list(self._pending), schema={"gid": pl.Int64, "seq": pl.Int64}, orient="row")
            earlier = (
                rest.join(pending, on=on, how="semi", maintain_order="left")
                .unique(on, keep="first", maintain_order=True)
                .select(
                    "i",
                    "gid",
                    "seq",
                    pl.col("t").alias("e_end"),
                    pl.col("err").alias("e_err"),
                    pl.col("n").alias("e_n"),
                )
            )
            if earlier.height:
                for _, gid, seq, t, err, _ in earlier.iter_rows():
                    self._late_ends[(gid, seq)] = (t, err)
                    self._ended((gid, seq), self._pending.pop((gid, seq)), t)
                fix = earlier.drop("i")
                for group, tail in self._tail.items():
                    self._tail[group] = (
                        tail.join(fix, on=on, how="left", maintain_order="left")
                        .with_columns(pl.coalesce("end_n", "e_n").alias("end_n"))
                        .drop("e_end", "e_err", "e_n")
                    )
                rest = rest.filter(~pl.col("i").is_in(earlier["i"].implode()))
        # (two calls with one group and sequence number: the block is declined by _windows)
        mine = calls.filter(~pl.col("done")).select(*on, pl.col("n").alias("c_n"))
        return (
            rest.join(mine, on=on, maintain_order="left")
            .filter(pl.col("c_n") < pl.col("n"))
            .unique(on, keep="first", maintain_order=True)
            .select(*on, pl.col("t").alias("e_end"), pl.col("err").alias("e_err"), pl.col("n").alias("e_n"))
        )

    def _ended(self, key: tuple[int, int], call: tuple[int, float, str, bool, int, str], end: float) -> None:
        """An earlier block's call ended: counted and summed."""
        _, start, op, is_async, step, group = call
        tally = self.tallies[group]
        tally.last_done = max(tally.last_done, key[1])
        took = end - start
        self._check_time(start, end)
        self._took += abs(took)
        self._add(op, is_async, step, start, took)

    def _add(self, op: str, is_async: bool, step: int, start: float, took: float) -> None:
        total, n = self.op_totals.get(op, (0.0, 0))
        self.op_totals[op] = (total + took, n + 1)
        if not is_async:
            self.sync.add(step + 1, start, took)

    def _check_time(self, *values: float | None) -> None:
        for value in values:
            if value is None:
                continue
            if not value > 0:
                raise Unsuitable("a time that is not positive")
            binade = math.frexp(value)[1]
            if self._binade is None:
                self._binade = binade
            elif binade != self._binade:
                raise Unsuitable("times in more than one binade: sums would depend on their order")

    def _exact(self, calls: pl.DataFrame, ends: pl.DataFrame) -> None:
        """Unsuitable unless every sum of the calls' times is exact (module docstring)."""
        import polars as pl

        for column in (calls["t"], calls["end"], ends["t"]):
            self._check_time(column.min(), column.max())  # type: ignore[arg-type]
        done = calls.filter(pl.col("end").is_not_null())
        self._took += float((done["end"] - done["t"]).abs().sum())
        assert self._binade is not None or not done.height
        if self._binade is not None and self._took >= 2.0 ** (self._binade - 1):
            raise Unsuitable("calls that took too long in all for exact sums")

    def _windows(self, group: str, rows: pl.DataFrame) -> None:
        """The calls' hashes summed into their windows' digests
        (:meth:`CollectiveLog._hash`); Unsuitable for a repeated sequence number, which
        is looked for among the two newest windows' (so no call may be further behind)."""
        import polars as pl

        if rows["seq"].min() < 1:  # type: ignore[operator]
            raise Unsuitable("a sequence number below 1")
        if rows["seq"].is_duplicated().any():
            raise Unsuitable("two calls with one group and sequence number")
        carried = self._newest.get(group)
        rows = rows.with_columns(((pl.col("seq") - 1) // WINDOW).alias("w"))
        behind = rows.select(
            pl.max_horizontal(pl.col("w").cum_max().shift(1), pl.lit(carried, dtype=pl.Int64)).alias("b")
        )["b"]
        if (rows["w"] < behind - 1).fill_null(False).any():
            raise Unsuitable("a call more than a digest window behind the newest of its group")
        newest = int(rows["w"].max())  # type: ignore[arg-type]
        if carried is not None:
            newest = max(newest, carried)
        self._newest[group] = newest
        recent = self._recent.setdefault(group, {})
        old = [seq for seqs in recent.values() for seq in seqs]
        if old and rows["seq"].is_in(pl.Series(old, dtype=pl.Int64).implode()).any():
            raise Unsuitable("two calls with one group and sequence number")
        for w, seq in rows.filter(pl.col("w") >= newest - 1).select("w", "seq").iter_rows():
            recent.setdefault(w, set()).add(seq)
        for w in [w for w in recent if w < newest - 1]:
            del recent[w]
        tally = self.tallies[group]
        for w, op_size, full in _window_sums(rows).iter_rows():
            tally.add_to_digest(w, op_size, full)

    def _keep(self, group: str, rows: pl.DataFrame) -> list[pl.DataFrame]:
        """Counted, and kept as CollectiveLog keeps them: the first HEAD_CALLS of the group,
        its newest TAIL_CALLS, and those that leave the newest while pending (or inside a
        window asked for); returns the latter, with the position of the call that pushed
        each out (``evictor``)."""
        import polars as pl

        tally = self.tallies[group]
        tally.calls += rows.height
        tally.last_seq = max(tally.last_seq, int(rows["seq"].max()))  # type: ignore[arg-type]
        done = rows.filter(pl.col("end").is_not_null())["seq"]
        if done.len():
            tally.last_done = max(tally.last_done, int(done.max()))  # type: ignore[arg-type]
        tally.ops.update(rows["op"].unique().to_list())
        head = self._head.get(group)
        room = HEAD_CALLS - (head.height if head is not None else 0)
        if room > 0:
            first = rows.head(room)
            self._head[group] = first if head is None else pl.concat([head, first])
            tally.head_last = int(first["seq"][-1])
            rows = rows.slice(room)
        if not rows.height:
            return []
        tail = self._tail.get(group)
        both = rows if tail is None else pl.concat([tail, rows])
        self._tail[group] = both.tail(TAIL_CALLS)
        tally.tail_first = int(self._tail[group]["seq"][0])
        if both.height <= TAIL_CALLS:
            return []
        out = both.head(both.height - TAIL_CALLS).with_columns(both["n"].slice(TAIL_CALLS).alias("evictor"))
        keep = pl.col("end_n").is_null() | (pl.col("end_n") > pl.col("evictor"))
        for lo, hi in self.windows.get(group, ()):
            keep = keep | pl.col("seq").is_between(lo, hi)
        return [out.filter(keep)]

    def _device_times(
        self, devices: list[tuple[int, str, int, float]], fresh: pl.DataFrame | None
    ) -> pl.DataFrame | None:
        """Device times onto their calls, as :meth:`CollectiveLog.find` finds them when the
        record is read: the call of the group with that sequence number read before it and
        still among the group's first or newest calls then (here: kept from the start, in
        the newest now, or pushed out of the newest by a call read after the record); the
        last record of a call wins. Returns ``fresh`` (this block's calls pushed out of the
        newest, with their ``evictor``) with its times."""
        import polars as pl

        times = pl.DataFrame(
            devices, schema={"p": pl.Int64, "group": pl.String, "seq": pl.Int64, "ms": pl.Float64}, orient="row"
        )

        def onto(pool: pl.DataFrame, pushed_out: bool = False) -> pl.DataFrame:
            found = pool.select("group", "seq", "n", *(["evictor"] if pushed_out else [])).join(
                times, on=["group", "seq"]
            )
            found = found.filter(pl.col("n") < pl.col("p"))
            if pushed_out:
                found = found.filter(pl.col("evictor") > pl.col("p"))
            if not found.height:
                return pool
            last = found.sort("p").group_by("group", "seq").agg(pl.col("ms").last())
            return (
                pool.join(last, on=["group", "seq"], how="left", maintain_order="left")
                .with_columns(pl.coalesce("ms", "device_ms").alias("device_ms"))
                .drop("ms")
            )

        for group in set(times["group"].to_list()):
            for pools in (self._tail, self._head):
                if group in pools:
                    pools[group] = onto(pools[group])
        return None if fresh is None else onto(fresh, pushed_out=True)

    def _sum(self, done: pl.DataFrame) -> None:
        """Completed calls into the per-op totals and the per-step synchronous waits."""
        import polars as pl

        if not done.height:
            return
        done = done.with_columns((pl.col("end") - pl.col("t")).alias("took"))
        for op, took, n in done.group_by("op", maintain_order=True).agg(pl.col("took").sum(), pl.len()).iter_rows():
            total, calls = self.op_totals.get(op, (0.0, 0))
            self.op_totals[op] = (total + took, calls + n)
        self.sync.add_block(done.filter(~pl.col("async")).select((pl.col("step") + 1).alias("step"), "t", "took"))

    def finish(self, make: type[Collective]) -> list[Collective]:
        """The kept calls as ``make`` objects, in the order they started."""
        pools = [*self._head.values(), *self._tail.values(), *self._extra]
        calls: list[Collective] = []
        intern, late = sys.intern, self._late_ends
        columns = [
            "seq",
            "group",
            "op",
            "bytes",
            "dtype",
            "async",
            "site",
            "step",
            "t",
            "end",
            "err",
            "device_ms",
            "via",
        ]
        for pool in pools:
            rows = pool.select([*columns, "gid"]).iter_rows()
            for seq, group, op, size, dtype, is_async, site, step, t, end, err, device_ms, via, gid in rows:
                if end is None and (gid, seq) in late:
                    end, err = late[(gid, seq)]
                calls.append(
                    make(
                        seq,
                        group,
                        intern(op),
                        size,
                        None if dtype is None else intern(dtype),
                        is_async,
                        None if site is None else intern(site),
                        step,
                        t,
                        end,
                        err,
                        device_ms,
                        None if via is None else intern(via),
                    )
                )
        calls.sort(key=lambda c: c.start)
        return calls

    def outside_backward(self, spans: dict[int, list[tuple[float, float]]]) -> dict[int, float]:
        """As :meth:`CollectiveLog.outside_backward`
        (:func:`~lorascope.rundir.loading.reduce.sync_outside_backward`), as columns: a call's
        seconds count unless a backward span of its step holds its start (the sums are
        exact in any order: ``_exact``)."""
        import polars as pl

        schema = {"step": pl.Int64, "t": pl.Float64, "took": pl.Float64}
        late = [(step, start, took) for step, calls in self.sync.calls.items() for start, took in calls]
        calls = pl.concat([*self.sync.blocks, pl.DataFrame(late, schema=schema, orient="row")]).with_row_index("i")
        backward = pl.DataFrame(
            [(step, b, e) for step, pairs in spans.items() for b, e in pairs],
            schema={"step": pl.Int64, "b": pl.Float64, "e": pl.Float64},
            orient="row",
        )
        inside = calls.join(backward, on="step").filter((pl.col("b") <= pl.col("t")) & (pl.col("t") <= pl.col("e")))[
            "i"
        ]
        outside = calls.filter(~pl.col("i").is_in(inside.implode()))
        return dict(outside.group_by("step", maintain_order=True).agg(pl.col("took").sum()).iter_rows())
