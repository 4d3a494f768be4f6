"""Reading and validating a run directory (analysis side).

Each rank process's JSON Lines stream is read and validated record by record; its
collective calls come from its call file, read and reduced as numpy columns
(:mod:`lorascope.rundir.loading.calls`, :mod:`lorascope.rundir.loading.callreduce`). A torn
last line (a rank killed mid-write) is skipped with a warning, and a call file's torn or
missing slots with one; anything else that breaks the format is a BadInputError naming the
file and line. Run directories of formats before v3 are refused in one line.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator, Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, fields
from operator import attrgetter
from pathlib import Path
from typing import Any, NamedTuple, TypeVar, cast

from lorascope.errors import BadInputError, FormatVersionError, NothingRecordedError
from lorascope.rundir.format import limits, ranks
from lorascope.rundir.format.limits import MAX_RECORD_DEPTH, LimitError
from lorascope.rundir.format.ops import P2P_OPS
from lorascope.rundir.format.safe_open import leaves, maybe_too_deep, open_regular, read_capped, read_head
from lorascope.rundir.format.schema import (
    CALLS_SUFFIX,
    FORMAT_VERSION,
    KEPT_CALLS_SUFFIX,
    MANIFEST_FILE,
    MEM_SUFFIX,
    RANKS_DIR,
    STEPS_SUFFIX,
    STREAM_SUFFIX,
    WARM_UP_STEPS,
    SchemaError,
    validate_manifest,
    validate_record,
)
from lorascope.rundir.loading import workers
from lorascope.rundir.loading.align import trim, windows_needed
from lorascope.rundir.loading.attachments import why_none_attached
from lorascope.rundir.loading.callreduce import (
    ReducedCalls,
    Shape,
    StepSums,
    calls_between,
    reduce_calls,
    with_kept,
)
from lorascope.rundir.loading.calls import CallRecords, empty, read_calls
from lorascope.rundir.loading.cluster import Cluster
from lorascope.rundir.loading.mem import as_records as mem_records
from lorascope.rundir.loading.mem import read_mem
from lorascope.rundir.loading.records import (
    CostRecord,
    DistInit,
    DumpRecord,
    EndRecord,
    ExceptionRecord,
    FlightDumpRecord,
    Grads,
    GradSetup,
    GroupRecord,
    HistoryRecord,
    LogitsRecord,
    MemoryHistory,
    MemReading,
    PhaseEdge,
    ProbeError,
    SignalRecord,
    SiteRecord,
    SnapshotRecord,
    StallRecord,
    StartRecord,
    StepRecord,
    UnseenPath,
    WarningRecord,
    ZeroParamRecord,
)
from lorascope.rundir.loading.reduce import (
    KEEP_WARNINGS,
    CollectiveLog,
    GroupTally,
    Rule,
    StepKeeper,
    backward_spans,
    decimate,
    share_values,
    steps_per_rank,
    totals,
)
from lorascope.rundir.loading.span import SpanRecords
from lorascope.rundir.loading.steps import as_records, backward_spans_of, handle_waits, read_steps, step_numbers

#: Told how far a long step has come: (what, done, total). The CLI draws it as a bar.
Progress = Callable[[str, int, int], None]


@dataclass(slots=True)
class Collective:
    """One collective or p2p call on one rank, its start joined with its end (if any).
    Slotted, its strings shared: a rank keeps thousands (:mod:`lorascope.rundir.loading.reduce`)."""

    seq: int
    group: str
    op: str
    bytes: int | None
    dtype: str | None
    is_async: bool
    site: str | None
    step: int
    start: float
    end: float | None = None
    err: str | None = None
    device_ms: float | None = None
    #: When a library made the call (``site`` is its frame): the caller up the stack, in
    #: library or job code, whose line sits inside a rank condition.
    via: str | None = None

    @property
    def pending(self) -> bool:
        return self.end is None

    def __reduce__(self) -> tuple[type[Collective], tuple[Any, ...]]:
        """Pickled as its fields in order: a parallel read's workers send the parent
        ~1,600 a rank, received one rank after another; the slotted default (a state
        set field by field) took ~2x as long to load and 1.5x the bytes (1,585 calls of a
        1,024-rank run: 4.2 -> 2.3 ms, 149 -> 99 KB)."""
        return (Collective, _COLLECTIVE_FIELDS(self))


_COLLECTIVE_FIELDS = attrgetter(*(f.name for f in fields(Collective)))


@dataclass
class RankData:
    """Everything one rank process wrote."""

    rank: int
    start: StartRecord
    files: list[str]
    configs: dict[str, dict[str, Any]] = field(default_factory=dict)
    mem: list[MemReading] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    phases: list[PhaseEdge] = field(default_factory=list)
    groups: dict[int, GroupRecord] = field(default_factory=dict)
    collectives: list[Collective] = field(default_factory=list)
    warnings: list[WarningRecord] = field(default_factory=list)
    exception: ExceptionRecord | None = None
    signal: SignalRecord | None = None
    end: EndRecord | None = None
    probe_errors: list[ProbeError] = field(default_factory=list)
    #: The first ``cost`` record (the probes' cost so far, cumulative) and the latest; the
    #: first is moved up to the first one at or past WARM_UP_STEPS once a later one comes.
    costs: list[CostRecord] = field(default_factory=list)
    #: Collective paths the job used that the probes cannot see (``coll_unseen``).
    unseen_collectives: list[UnseenPath] = field(default_factory=list)
    #: Call site -> {"line": source text, "conditions": enclosing if/while lines}.
    sites: dict[str, SiteRecord] = field(default_factory=dict)
    #: On-demand and stall dumps (stacks, pending collectives), oldest first.
    dumps: list[DumpRecord] = field(default_factory=list)
    stall: StallRecord | None = None
    #: Entries into and exits from ZeRO-3's parameter state (``zero_param`` records), oldest first.
    zero_params: list[ZeroParamRecord] = field(default_factory=list)
    #: torch.distributed's rank and world size, once the process group started.
    dist_init: DistInit | None = None
    grad_setup: GradSetup | None = None
    grads: Grads | None = None
    logits: list[LogitsRecord] = field(default_factory=list)
    #: The call file its collective calls were read from (None: none was).
    calls_file: str | None = None
    #: Kineto traces the rank wrote, as absolute paths.
    trace_files: list[str] = field(default_factory=list)
    #: Flight-recorder dumps the rank wrote: their ``flight_dump`` records (``t``: when,
    #: just after the dump or ending they go with), ``path`` added (absolute), oldest first.
    flight_dumps: list[FlightDumpRecord] = field(default_factory=list)
    #: What faulthandler wrote when the rank died of a fatal signal (a C++ abort, a
    #: segfault): "Fatal Python error: Aborted" and every thread's stack; None when empty.
    fatal: str | None = None
    #: Allocator snapshots the rank wrote: their ``snapshot`` records, ``path`` added
    #: (absolute), oldest first; and whether allocator history was recorded, and why not.
    snapshots: list[SnapshotRecord] = field(default_factory=list)
    memory_history: MemoryHistory | None = None
    #: The latest start or stop of allocator history under ``--memory-history auto``.
    history: HistoryRecord | None = None
    last_time: float = 0.0
    #: The rank whose records this one's are a copy of (`lorascope hang`: ranks whose
    #: answers agree are read a few at a time, :mod:`lorascope.hang.alike`); None: its own.
    told_by: int | None = None
    #: The reduction (:mod:`lorascope.rundir.loading.reduce`): ``collectives`` holds the first and
    #: the newest calls of each group, the pending ones and the windows where ranks differ;
    #: ``mem``, ``phases``, ``steps`` and ``logits`` every ``stride``-th step between the
    #: first and the last ones (stride 1: all), ``warnings`` the first ones. What was
    #: computed over everything read: per group, the calls counted (:class:`GroupTally`);
    #: per step, the time in synchronous collectives (key: step + 1, the step record's
    #: number); per op, (total seconds, completed calls); ``totals``: counts per kind,
    #: median step time, last loss.
    tallies: dict[str, GroupTally] = field(default_factory=dict)
    coll_wait: dict[int, float] = field(default_factory=dict)
    #: The same, of the calls that started outside the step's backward phases.
    coll_wait_outside_backward: dict[int, float] = field(default_factory=dict)
    #: Per step (the step record's number), the seconds its threads were blocked on async
    #: collectives' handles (``Work.wait``, ``wait_tensor``: the steps file's ``waited``),
    #: steps with none left out; and per step and phase name, the part within that phase.
    handle_wait: dict[int, float] = field(default_factory=dict)
    handle_wait_phases: dict[int, dict[str, float]] = field(default_factory=dict)
    op_totals: dict[str, tuple[float, int]] = field(default_factory=dict)
    totals: dict[str, Any] = field(default_factory=dict)
    stride: int = 1

    @property
    def pid(self) -> int:
        return int(self.start["pid"])

    @property
    def collectives_total(self) -> int:
        return sum(t.calls for t in self.tallies.values())

    @property
    def host(self) -> str:
        return str(self.start["host"])


@dataclass
class RunData:
    """A whole run directory: the launch manifest and every rank, plus reading warnings."""

    path: Path
    manifest: dict[str, Any]
    ranks: dict[int, RankData]
    warnings: list[str]
    #: What several detectors compute from the run alike, computed once (a loaded run is
    #: not changed): name -> value.
    derived: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def world_size(self) -> int | None:
        sizes = {r.start["world_size"] for r in self.ranks.values()}
        return max(sizes) if sizes else None


def _read_manifest(run_dir: Path) -> dict[str, Any]:
    path = run_dir / MANIFEST_FILE
    if not path.exists():
        raise BadInputError(f"{run_dir} is not a lorascope run directory (no {MANIFEST_FILE})")
    if leaves(run_dir, path):
        raise BadInputError(f"{path}: a symlink out of the run directory: not followed")
    data = read_capped(path, "record_bytes", "the manifest", inside=run_dir)
    try:
        manifest = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise BadInputError(f"{path}: unreadable manifest ({exc.__class__.__name__}: {str(exc)[:100]})") from None
    version = manifest.get("version") if isinstance(manifest, dict) else None
    if isinstance(version, int) and not isinstance(version, bool) and version < 1:
        raise BadInputError(f"{path}: format version {version} does not exist (v1 is the first)")
    if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
        raise FormatVersionError(
            f"{path}: run directory format v{version} is newer than this lorascope reads (v{FORMAT_VERSION}); upgrade lorascope"
        )
    if isinstance(version, int) and not isinstance(version, bool) and version < FORMAT_VERSION:
        raise FormatVersionError(
            f"{run_dir}: a run directory of format v{version}; this lorascope reads v{FORMAT_VERSION} "
            "(re-record it, or use lorascope < 0.3)"
        )
    try:
        validate_manifest(manifest)
    except SchemaError as exc:
        raise BadInputError(f"{path}: {exc}") from None
    valid: dict[str, Any] = manifest
    return valid


def _segments(run_dir: Path, rank_dir: Path, warnings: list[str]) -> dict[str, list[tuple[int, Path]]]:
    """Segment files per process (``HOST-PID``), in segment order; symlinks out of the
    run directory are not followed (warned)."""
    out: dict[str, list[tuple[int, Path]]] = {}
    try:
        names = os.listdir(rank_dir)  # not a glob: it compiles its pattern at every call (~1.6 ms)
    except OSError:
        names = []
    for name in sorted(n for n in names if n.endswith(STREAM_SUFFIX) and not n.startswith(".")):
        path = rank_dir / name
        proc, _, index = name[: -len(STREAM_SUFFIX)].rpartition(".")
        if not proc or not index.isdigit() or len(index) > 9:
            continue
        if path.is_symlink() and leaves(run_dir, path):  # else it is where its folder is (the caller's to check)
            warnings.append(f"{path}: a symlink out of the run directory: not followed")
            continue
        out.setdefault(proc, []).append((int(index), path))
    return {proc: sorted(segs) for proc, segs in out.items()}


_DECODER = json.JSONDecoder()


def _loads(line: bytes) -> Any:
    """json.loads of one line, without its encoding sniffing in the common case (plain
    UTF-8); anything else takes json.loads itself, so the result is the same."""
    try:
        return _DECODER.decode(line.decode())
    except ValueError:  # UnicodeDecodeError included
        return json.loads(line)


def _file_warnings(path: Path, long_lines: list[int], deep_lines: list[int], warnings: list[str]) -> None:
    """What was skipped of one file, one warning per cause."""
    if long_lines:
        warnings.append(
            f"{path}:{long_lines[0]}: skipped {len(long_lines)} record(s) over {limits.describe('record_bytes')}"
        )
    if deep_lines:
        warnings.append(
            f"{path}:{deep_lines[0]}: skipped {len(deep_lines)} record(s) nested deeper than {MAX_RECORD_DEPTH} levels"
        )


def decode_line(path: Path, number: int, line: bytes, warnings: list[str], deep_lines: list[int]) -> Any:
    """One line of a stream, as its parsed JSON; None for a blank line, one nested deeper
    than MAX_RECORD_DEPTH (its number goes to ``deep_lines``) or a torn last line
    (warned). A broken line that ends in a newline is a corrupt stream: BadInputError."""
    if not line.strip():
        return None
    if maybe_too_deep(line, MAX_RECORD_DEPTH):
        deep_lines.append(number)
        return None
    try:
        return _loads(line)
    except (UnicodeDecodeError, ValueError):
        if line.endswith(b"\n"):
            raise BadInputError(f"{path}:{number}: not a JSON record (the stream is corrupt)") from None
        warnings.append(
            f"{path}:{number}: skipped a torn last record ({len(line)} bytes; the process was killed while writing it)"
        )
        return None


def decode_lines(
    path: Path, numbers: list[int], lines: list[bytes], warnings: list[str], deep_lines: list[int]
) -> list[Any]:
    """:func:`decode_line` of many newline-terminated lines (given without their newlines),
    at ~2.5x the speed: the lines are decoded as one text and each record is scanned where
    its line begins. A line whose record does not span it exactly (whitespace, extra data,
    an error) is decoded alone, as are all lines of a text that is not ASCII."""
    text = b"\n".join(lines)
    if not text.isascii():
        return [
            decode_line(path, n, line + b"\n", warnings, deep_lines) for n, line in zip(numbers, lines, strict=True)
        ]
    scan, decoded = _DECODER.scan_once, text.decode()  # type: ignore[attr-defined]  # the C scanner behind raw_decode
    out: list[Any] = []
    at = 0
    for number, line in zip(numbers, lines, strict=True):
        begin, at = at, at + len(line) + 1
        if line[:1] == b"{" and not maybe_too_deep(line, MAX_RECORD_DEPTH):
            try:
                rec, end = scan(decoded, begin)
            except (StopIteration, ValueError):
                end = -1
            if end == at - 1:
                out.append(rec)
                continue
        out.append(decode_line(path, number, line + b"\n", warnings, deep_lines))
    return out


#: Bytes of a stream read at a time (cut at the last newline), its lines decoded together.
BLOCK_BYTES = 1 << 20

#: What a ``calls_step`` record's line holds (the writer's compact JSON; inside a string a
#: quote is escaped, so no other record's text holds it).
CALLS_STEP_LINE = b'"k":"calls_step"'


def _iter_records(path: Path, warnings: list[str], skip: bytes | None = None) -> Iterator[tuple[int, Any]]:
    """Yield (line number, record) pairs, a block of lines decoded at a time
    (:func:`decode_lines`); a torn final line is a warning, not an error; so are records
    over the record size limit or nested deeper than MAX_RECORD_DEPTH (skipped, one
    warning per file). A line holding ``skip`` is not decoded (nor yielded)."""
    max_line = limits.current().record_bytes
    long_lines: list[int] = []
    deep_lines: list[int] = []
    number = 0
    try:
        with open_regular(path, inside=path.parent) as f:  # in its rank folder, checked by _segments
            rest = b""
            while True:
                block = f.read(BLOCK_BYTES)
                data = rest + block
                if not block:
                    break
                cut = data.rfind(b"\n")
                if cut < 0:
                    if len(data) > max_line:  # one line longer than a record may be: skipped
                        number += 1
                        long_lines.append(number)
                        while (more := f.readline(1 << 20)) and not more.endswith(b"\n"):
                            pass
                        rest = b""
                    else:
                        rest = data
                    continue
                rest = data[cut + 1 :]
                numbers, lines = [], []
                for line in data[:cut].split(b"\n"):
                    number += 1
                    if len(line) >= max_line:
                        long_lines.append(number)
                    elif skip is not None and skip in line:
                        continue
                    elif line.strip():
                        numbers.append(number)
                        lines.append(line)
                for n, rec in zip(numbers, decode_lines(path, numbers, lines, warnings, deep_lines), strict=True):
                    if rec is not None:
                        yield n, rec
            if rest:
                number += 1
                rec = decode_line(path, number, rest, warnings, deep_lines)
                if rec is not None:
                    yield number, rec
    except OSError as exc:
        raise BadInputError(f"{path}: unreadable ({exc.strerror})") from None
    finally:
        _file_warnings(path, long_lines, deep_lines, warnings)


class _Stream:
    """One process's stream records applied in the order they were written, and what its
    calls need from them (shapes, groups, errors, device times, where its call file is)."""

    def __init__(self, rank: int, warnings: list[str], budget: int, newest: int | None = None) -> None:
        self.rank = rank
        self.warnings = warnings
        self.keeper = StepKeeper(budget)
        #: Only the newest this many records of each slot file are read (None: all).
        self.newest = newest
        self.data: RankData | None = None
        #: The call shapes declared (``shape`` records), by id.
        self.shapes: dict[int, Shape] = {}
        #: The stream's ``coll_err`` records: call index -> its error; (gid, seq, whether a
        #: point-to-point call's: numbered apart) -> index.
        self.errors: dict[int, str] = {}
        self.failed: dict[tuple[int, int, bool], int] = {}
        #: ``coll_dev`` records: (gid, seq, whether a point-to-point call's, milliseconds on the device).
        self.device: list[tuple[int, int, bool, float]] = []
        #: The latest ``calls_file`` record's file, in the stream's folder, and its kept-calls
        #: file's (a ``calls_file`` record names it too, when the probes make it).
        self.calls_file: Path | None = None
        self.kept_file: Path | None = None
        #: The ``calls_step`` records: step -> its groups' sums of the calls the ring overwrote.
        self.sums: StepSums = {}
        #: The ``label`` records (what the steps file's records name), by id; the steps
        #: file's records (read before the stream: its step numbers bound what is kept);
        #: the ``loss`` records, put on their steps once every step is there.
        self.labels: dict[int, str] = {}
        self.step_table: CallRecords | None = None
        #: Per step (+1), the backward spans of its steps file (``backward_spans_of``).
        self.spans: dict[int, list[tuple[float, float]]] = {}
        #: The memory file's readings (read before the stream too), and NVML's parts of
        #: them (``nvml`` records), by reading index.
        self.mem_table: CallRecords | None = None
        self.nvml: dict[int, dict[str, Any]] = {}
        self.losses: list[dict[str, Any]] = []
        self._unknown: dict[str, tuple[str, int]] = {}
        self._dropped: tuple[str, int] | None = None

    def _started(self, path: Path, number: int) -> RankData:
        """The rank's data, once its ``start`` record has been read."""
        if self.data is None:
            raise BadInputError(f"{path}:{number}: the stream does not begin with a 'start' record")
        return self.data

    @staticmethod
    def _validated(path: Path, number: int, rec: Any) -> bool:
        """validate_record, its error as bad input at the record's line."""
        try:
            return validate_record(rec)
        except SchemaError as exc:
            raise BadInputError(f"{path}:{number}: {exc}") from None

    def record(self, path: Path, number: int, rec: Any) -> None:
        """A record: validated, then applied."""
        known = self._validated(path, number, rec)
        if not known:
            where, n = self._unknown.get(rec["k"], (f"{path}:{number}", 0))
            self._unknown[rec["k"]] = (where, n + 1)
            return
        kind = rec["k"]
        if self.data is None and kind == "start":
            self.data = RankData(rank=self.rank, start=rec, files=[])
        data = self._started(path, number)
        data.last_time = max(data.last_time, float(rec["t"]))
        if kind == "shape":
            self._declare(path, number, rec)
        elif kind == "label":
            if self.labels.setdefault(rec["id"], sys.intern(rec["text"])) != rec["text"]:
                raise BadInputError(f"{path}:{number}: label {rec['id']} is declared again with another text")
        elif kind == "loss":
            self.losses.append(rec)
        elif kind == "steps_file":
            if rec["file"] != _beside(path, STEPS_SUFFIX).name:
                self.warnings.append(f"{path}:{number}: a steps file {str(rec['file'])[:80]!r} not beside it: not read")
        elif kind == "mem_file":
            if rec["file"] != _beside(path, MEM_SUFFIX).name:
                self.warnings.append(
                    f"{path}:{number}: a memory file {str(rec['file'])[:80]!r} not beside it: not read"
                )
        elif kind == "nvml":
            self.nvml[rec["i"]] = rec["nvml"]
        elif kind == "coll_err":
            self.errors[rec["index"]] = rec["err"]
            self.failed[(rec["gid"], rec["seq"], rec.get("p2p") is True)] = rec["index"]
        elif kind == "coll_dev":
            self.device.append((rec["gid"], rec["seq"], rec.get("p2p") is True, float(rec["ms"])))
        elif kind == "calls_step":
            self.sums[rec["step"]] = [g for g in rec["groups"] if _summed(g)]
        elif kind == "calls_file":
            name = str(rec["file"])
            if Path(name).name != name:
                self.warnings.append(f"{path}:{number}: a call file {name[:80]!r} outside the rank's folder: not read")
            elif name.endswith(KEPT_CALLS_SUFFIX):
                self.kept_file = path.parent / name
            else:
                self.calls_file = path.parent / name
        else:
            _apply(data, kind, rec)
            if kind == "logits":  # step-keyed: the keeper drops what decimation will
                self.keeper.held(data)
        if kind == "dropped":  # a running total
            self._dropped = (f"{path}:{number}", rec["records"])
        if kind == "fatal_handler":
            data.fatal = _fatal_text(path.parent / str(rec["file"]), str(rec["file"]))
        if kind in ("trace_window", "flight_dump", "snapshot") and rec.get("file"):
            side = path.parent / str(rec["file"])
            if side.name != rec["file"] or not side.exists():
                self.warnings.append(f"{path}:{number}: {kind} file {rec['file']!r} is missing")
            elif leaves(path.parent, side):
                self.warnings.append(f"{side}: a symlink out of the run directory: not followed")
            elif kind == "trace_window":
                data.trace_files.append(str(side))
            elif kind == "snapshot":
                data.snapshots.append(cast(SnapshotRecord, {**rec, "path": str(side)}))
            else:
                data.flight_dumps.append(cast(FlightDumpRecord, {**rec, "path": str(side), **_tail(path, rec)}))

    def _declare(self, path: Path, number: int, rec: dict[str, Any]) -> None:
        """A ``shape`` record: its id names these fields from here on. The probes declare a
        shape again at the head of each segment, the same; other fields under a known id
        are a corrupt stream."""
        shape: Shape = (rec["op"], rec["dtype"], rec["async"], rec["site"], rec["via"])
        known = self.shapes.setdefault(rec["id"], shape)
        if known != shape:
            raise BadInputError(f"{path}:{number}: shape {rec['id']} is declared again with other fields")

    def read(self, segs: list[tuple[int, Path]]) -> None:
        """The steps file's records (its step numbers to the keeper: what is sure to be
        dropped is known from the start), then every record of the segments, in order;
        for a recent past (``newest``), not the ``calls_step`` sums: they count the calls
        of steps past the call file's ring, a record a step that a week-long run holds
        hundreds of thousands of (~10 us each)."""
        self.read_steps(segs[0][1])
        if self.step_table is not None:
            self.keeper.note_steps(step_numbers(self.step_table.records))
        skip = None if self.newest is None else CALLS_STEP_LINE
        for _, path in segs:
            for number, rec in _iter_records(path, self.warnings, skip):
                self.record(path, number, rec)
            if self.data is not None:
                self.data.files.append(str(path))

    def read_steps(self, first: Path) -> None:
        """The process's steps file and memory file beside its stream, those there are."""
        self.step_table = self._beside_stream(first, STEPS_SUFFIX, read_steps)
        self.mem_table = self._beside_stream(first, MEM_SUFFIX, read_mem)
        if self.mem_table is not None:
            self.keeper.mem += len(self.mem_table)

    def _beside_stream(
        self, first: Path, suffix: str, read: Callable[[Path, str, list[str], int | None], CallRecords]
    ) -> CallRecords | None:
        """The records of the process's slot file ``suffix``, its newest only when the
        stream says (None: it has none, or it is a symlink out of the run directory, warned)."""
        path = _beside(first, suffix)
        if not path.exists():
            return None
        if leaves(first.parent, path):
            self.warnings.append(f"{path}: a symlink out of the run directory: not followed")
            return None
        return read(path, f"rank {self.rank}", self.warnings, self.newest)

    def take_mem(self, data: RankData, drop: Rule | None = None) -> list[MemReading]:
        """The memory file's ``mem`` records (none without one; ``drop``: none that
        decimation is sure to drop), its times in ``last_time``."""
        table = self.mem_table
        if table is None or not len(table):
            return []
        data.last_time = max(data.last_time, float(table.records["t"].max()))
        return mem_records(table, self.labels, self.nvml, f"rank {self.rank}", self.warnings, drop)

    def take_steps(self, data: RankData, drop: Rule | None = None) -> tuple[list[StepRecord], list[PhaseEdge]]:
        """The steps file's step and phase records (none without one; ``drop``: no phase
        record decimation is sure to drop), its times in ``last_time``, the backward spans
        of every step in ``spans``."""
        steps: list[StepRecord] = []
        phases: list[PhaseEdge] = []
        table = self.step_table
        if table is not None and len(table):
            records = table.records
            steps, phases = as_records(records, self.labels, f"rank {self.rank}", self.warnings, drop)
            data.handle_wait, data.handle_wait_phases = handle_waits(records, self.labels, drop)
            self.spans = backward_spans_of(records, self.labels)
            data.last_time = max(data.last_time, float(records["t"].max()))
        return steps, phases

    def put_losses(self, data: RankData) -> None:
        """The ``loss`` records (a CUDA loss, read once the device got there) onto their steps."""
        for rec in self.losses:
            _apply(data, "loss", rec)

    def calls(self, first: Path) -> CallRecords:
        """The process's call records (none if it has no call file), warned as read, with
        those of its kept-calls file it does not hold (:func:`callreduce.with_kept`)."""
        path = self.calls_file
        if path is None:  # no calls_file record: the file where the probes put it, if any
            beside = _beside(first)
            path = beside if beside.exists() else None
        if path is None:
            return empty()
        if leaves(first.parent, path):
            self.warnings.append(f"{path}: a symlink out of the run directory: not followed")
            return empty()
        if self.data is not None:
            self.data.calls_file = str(path)
        summed = (
            f"; steps {min(self.sums):,}..{max(self.sums):,} are counted from their per-step sums ('calls_step')"
            if self.sums
            else ""
        )
        calls = read_calls(path, f"rank {self.rank}", self.warnings, summed, newest=self.newest)
        kept = self.kept_file or _beside(first, KEPT_CALLS_SUFFIX)
        if not kept.exists() or leaves(first.parent, kept):
            return calls
        merged = with_kept(calls, read_calls(kept, f"rank {self.rank} (kept calls)", self.warnings))
        self._errors_of_kept(merged)
        return merged

    def _errors_of_kept(self, calls: CallRecords) -> None:
        """A failed call the ring overwrote is found in the kept-calls file by its group
        and number: its error goes to the index its copy is read at."""
        if not self.failed:
            return
        copies = calls.index < 0
        rows = zip(
            calls.index[copies].tolist(),
            calls.records["gid"][copies].tolist(),
            calls.records["seq"][copies].tolist(),
            calls.records["shape"][copies].tolist(),
            strict=True,
        )
        for index, gid, seq, shape in rows:
            known = self.shapes.get(shape)
            at = self.failed.get((gid, seq, known is not None and known[0] in P2P_OPS))
            if at is not None:
                self.errors[index] = self.errors[at]

    def reduced(self, first: Path, windows: dict[str, list[tuple[int, int]]] | None) -> ReducedCalls:
        """The call file read and reduced, the device times and errors put on its calls kept."""
        data = self._started(first, 1)
        reduced = reduce_calls(
            self.calls(first),
            self.shapes,
            lambda gid: _group_name(data, gid),
            self.errors,
            windows,
            Collective,
            self.sums,
        )
        lost = sorted(key - 1 for key in reduced.unknown_steps)
        if lost and self.sums:
            self.warnings.append(
                f"rank {self.rank}: calls of steps {lost[0]:,}..{lost[-1]:,} were overwritten by the ring before "
                "the probes summed them: not counted, their time in collectives unknown"
            )
        if reduced.unshaped:
            self.warnings.append(
                f"rank {self.rank}: {reduced.unshaped:,} call(s) name a shape no 'shape' record declares "
                "(the stream lost its end?): read as op 'unknown'"
            )
        self.put_device_times(reduced.collectives)
        return reduced

    def put_device_times(self, collectives: list[Collective]) -> None:
        """The stream's ``coll_dev`` records onto the calls they name, among ``collectives``."""
        if not self.device or self.data is None:
            return
        kept = {(c.group, c.seq, c.op in P2P_OPS): c for c in collectives}  # p2p calls are numbered apart
        for gid, seq, p2p, ms in self.device:
            name = _device_group(self.data, gid)
            found = kept.get((name, seq, p2p)) if isinstance(name, str) else None
            if found is not None:
                found.device_ms = ms

    def finish(self, first: Path, budget: int, windows: dict[str, list[tuple[int, int]]] | None) -> RankData:
        """The RankData, its calls read from the call file and reduced."""
        for kind, (where, n) in self._unknown.items():
            self.warnings.append(f"{where}: skipped {n} record(s) of unknown kind {kind[:80]!r}")
        if self._dropped is not None:
            self.warnings.append(
                f"{self._dropped[0]}: the probes dropped {self._dropped[1]} record(s) (their queue was full)"
            )
        data = self.data
        if data is None:
            raise BadInputError(f"{first}: empty rank stream")
        drop = self.keeper.bounds(data)
        data.steps, data.phases = self.take_steps(data, drop)
        self.put_losses(data)
        data.mem = self.take_mem(data, drop)
        self.keeper.held(data)
        calls = self.reduced(first, windows)
        data.collectives = calls.collectives
        data.last_time = max(data.last_time, calls.last_time)
        data.tallies, data.coll_wait, data.op_totals = calls.tallies, calls.sync, calls.op_totals
        data.coll_wait_outside_backward = calls.outside_backward(self.spans)
        data.totals = totals(data, self.keeper.mem)
        data.warnings = data.warnings[:KEEP_WARNINGS]
        data.stride = decimate(data, budget)
        share_values(data)
        return data


def _tail(stream: Path, rec: dict[str, Any]) -> dict[str, str]:
    """A flight-recorder dump's tail (``tail_path``), when its file is there, in the folder."""
    name = rec.get("tail")
    side = stream.parent / str(name)
    if not isinstance(name, str) or side.name != name or not side.is_file() or leaves(stream.parent, side):
        return {}
    return {"tail_path": str(side)}


def _load_process(job: Job, warnings: list[str]) -> RankData:
    """One process's stream and call file, reduced while they are read (see
    :mod:`lorascope.rundir.loading.reduce`): step-keyed records within the job's budget
    of steps, the collectives of its windows kept in full besides the bounded ones."""
    rank, segs = job.rank, job.segs
    indices = [i for i, _ in segs]
    gaps = [(a + 1, b - 1) for a, b in zip([-1, *indices], indices, strict=False) if b > a + 1]
    if gaps:
        warnings.append(
            f"rank {rank}: stream segments {gaps[0][0]}-{gaps[-1][1]} were rotated away "
            f"(bounded stream); the first and the newest segments are kept"
        )
    total = 0
    # its steps and readings count with its stream, read whole (a recent read takes a
    # bounded part of them)
    beside = (_beside(segs[0][1], STEPS_SUFFIX), _beside(segs[0][1], MEM_SUFFIX)) if job.newest is None else ()
    for path in [*(p for _, p in segs), *beside]:
        with contextlib.suppress(OSError):
            total += path.stat().st_size
    if total > limits.current().stream_bytes:
        files = ", its steps and memory files" if beside else ""
        raise LimitError(
            f"rank {rank}", f"its stream ({total:,} bytes in {len(segs)} segment(s){files})", "stream_bytes"
        )
    stream = _Stream(rank, warnings, job.budget, job.newest)
    stream.read(segs)
    return stream.finish(segs[0][1], job.budget, job.windows)


def recount(data: RankData) -> RankData:
    """Compute what the reader counts while it reads (tallies, sums, totals) from the
    lists of a RankData built in memory (a test's, a synthetic run's), which keeps them all."""
    log = CollectiveLog()
    for coll in sorted(data.collectives, key=lambda c: c.start):
        log.add(coll)
    data.collectives = log.finish()
    data.tallies, data.coll_wait, data.op_totals = log.tallies, log.sync.sums, log.op_totals
    data.coll_wait_outside_backward = log.outside_backward(backward_spans(data.phases))
    data.totals = totals(data, len(data.mem))
    return data


#: Kinds kept as lists on RankData (attribute names), and kinds of which the last is kept.
_LISTED = {
    "warning": "warnings",
    "probe_error": "probe_errors",
    "coll_unseen": "unseen_collectives",
    "dump": "dumps",
    "logits": "logits",
    "zero_param": "zero_params",
}
_LATEST = {
    "exception": "exception",
    "signal": "signal",
    "end": "end",
    "stall": "stall",
    "dist_init": "dist_init",
    "grad_setup": "grad_setup",
    "grads": "grads",
    "memory_history": "memory_history",
    "history": "history",
}


def _apply(data: RankData, kind: str, rec: dict[str, Any]) -> None:
    """A validated record of a kind RankData keeps."""
    if kind in _LISTED:
        getattr(data, _LISTED[kind]).append(rec)
    elif kind in _LATEST:
        setattr(data, _LATEST[kind], rec)
    elif kind == "config":
        data.configs[rec["name"]] = rec["value"]
    elif kind == "cost":
        costs = data.costs
        if len(costs) == 2 and costs[0]["step"] < WARM_UP_STEPS <= costs[1]["step"] < rec["step"]:
            costs[0] = costs[1]  # past the probes' warm-up, with a step after it
        costs[1:] = [cast(CostRecord, rec)]
    elif kind == "site":
        data.sites[rec["site"]] = cast(SiteRecord, rec)
    elif kind == "group":
        data.groups[rec["gid"]] = cast(GroupRecord, rec)
    elif kind == "loss":  # a CUDA loss, read once the device got there
        for step in reversed(data.steps):
            if step["step"] == rec["step"]:
                step["loss"] = rec["loss"]
                if rec.get("text"):
                    step["loss_text"] = rec["text"]
                break


def _group_name(data: RankData, gid: int) -> Any:
    """The name a call of group ``gid`` is kept under: its ``group`` record's name, else the id."""
    return data.groups[gid]["name"] if gid in data.groups else str(gid)


def _device_group(data: RankData, gid: int) -> Any:
    """The name a ``coll_dev`` record of group ``gid`` looks its call up under (a string,
    else there is none)."""
    group = data.groups.get(gid)
    return None if group is None else group["name"]


def _probe_errors(run_dir: Path, most: int = 50) -> list[str]:
    """The first lines of probe-errors.log (each cut at 1 KiB)."""
    path = run_dir / "probe-errors.log"
    if not path.exists():
        return []
    if leaves(run_dir, path):
        return [f"{path}: a symlink out of the run directory: not followed"]
    out: list[str] = []
    with open_regular(path, inside=run_dir) as f:
        while len(out) < most and (raw := f.readline(1024)):
            line = raw.decode("utf-8", "replace").strip()
            if line:
                out.append(line.removeprefix("lorascope: "))
    return out


#: Below this many bytes of rank streams the ranks are read in this process: a worker
#: pool's start (~0.1 s a worker) costs more than it saves (measured: benchmarks/rundir_scale.py).
POOL_MIN_BYTES = 48 << 20

_Rec = TypeVar("_Rec")

#: The newest records of each slot file (calls, steps-file records, memory readings) a read
#: of a rank's recent past takes (`lorascope hang`: ranks part among their last calls, and a
#: long run's files hold millions): a ZeRO-3 job's last 2-4 steps of calls (a collective
#: completes only once all its ranks called it: the ranks of a hung job are a few calls
#: apart), ~150 steps of phase edges. Its cost is linear: ~4 ms a rank here at 1,024,
#: ~15 at 4,096 (benchmarks/hang_scale.py --steps 10000).
RECENT_RECORDS = 1024


class Job(NamedTuple):
    """One process's stream to read."""

    rank: int
    segs: list[tuple[int, Path]]
    #: The steps it keeps of its step-keyed records.
    budget: int
    #: Group -> sequence ranges of collectives to keep in full.
    windows: dict[str, list[tuple[int, int]]] | None = None
    #: Read only the newest this many records of each slot file (None: every one).
    newest: int | None = None


def read_process(job: Job, configured: limits.Limits) -> tuple[RankData | str, list[str]]:
    """Read one process's stream (a pure function of its files, run in a worker): the
    reduced RankData, or the one-line reason it is bad input, and the reading warnings."""
    limits.configure(**{f: getattr(configured, f) for f in limits.FLAGS})
    warnings: list[str] = []
    try:
        with no_cycle_collection():
            return _load_process(job, warnings), warnings
    except BadInputError as exc:
        return str(exc), warnings


#: One process's stream read again for a span: (rank, its segment files, the span's start
#: and end in epoch seconds or None, the most records of each kind kept).
_SpanJob = tuple[int, list[str], float | None, float | None, int]


def read_span(job: _SpanJob, configured: limits.Limits) -> tuple[SpanRecords | str, list[str]]:
    """Read one process's stream and call file again for what overlaps a span (a pure
    function of its files, run in a worker; :mod:`lorascope.rundir.loading.span`): its
    records, or the one-line reason it is bad input, and the reading warnings."""
    limits.configure(**{f: getattr(configured, f) for f in limits.FLAGS})
    warnings: list[str] = []
    rank, files, start, end, most = job
    try:
        with no_cycle_collection():
            return _read_span(rank, [Path(f) for f in files], (start, end), most, warnings), warnings
    except BadInputError as exc:
        return str(exc), warnings


def _read_span(
    rank: int, paths: list[Path], span: tuple[float | None, float | None], most: int, warnings: list[str]
) -> SpanRecords:
    """The stream read, its records applied as a whole read does, but only the step-keyed
    records that overlap ``span`` kept (the first ``most`` of each kind), and the calls
    that overlap it (:func:`~lorascope.rundir.loading.callreduce.calls_between`)."""
    stream = _Stream(rank, warnings, 1 << 62)  # a budget nothing is dropped for
    lo = -math.inf if span[0] is None else span[0]
    hi = math.inf if span[1] is None else span[1]
    out = SpanRecords()
    stream.read_steps(paths[0])
    for path in paths:
        for number, rec in _iter_records(path, warnings):
            stream.record(path, number, rec)
    data = stream.data
    if data is None:
        raise BadInputError(f"{paths[0]}: empty rank stream")
    steps, phases = stream.take_steps(data)
    # a step from its begin (its end less its duration), a phase edge and a reading at its time
    out.left_out += _keep_within(data.steps, [(s["t"] - s["dur"], s["t"], s) for s in steps], lo, hi, most)
    out.left_out += _keep_within(data.phases, [(p["t"], p["t"], p) for p in phases], lo, hi, most)
    out.left_out += _keep_within(data.mem, [(m["t"], m["t"], m) for m in stream.take_mem(data)], lo, hi, most)
    stream.put_losses(data)
    out.collectives, left_out = calls_between(
        stream.calls(paths[0]),
        stream.shapes,
        lambda gid: _group_name(data, gid),
        stream.errors,
        (lo, hi),
        most,
        Collective,
    )
    stream.put_device_times(out.collectives)
    out.steps, out.phases, out.mem = data.steps, data.phases, data.mem
    out.left_out += left_out
    return out


def _keep_within(held: list[_Rec], recs: list[tuple[float, float, _Rec]], lo: float, hi: float, most: int) -> int:
    """Append to ``held`` the records (begun, ended, record) that overlap [lo, hi], while it
    holds fewer than ``most``; how many of those were left out."""
    left_out = 0
    for begun, ended, rec in recs:
        if not begun <= hi or not ended >= lo:
            continue
        if len(held) >= most:
            left_out += 1
            continue
        held.append(rec)
    return left_out


def records_between(
    run: RunData,
    start: float | None,
    end: float | None,
    most: int,
    progress: Progress | None = None,
    cluster: Cluster | None = None,
) -> dict[int, SpanRecords]:
    """Per rank, everything it recorded that overlaps [start, end] (None: open), read again
    from the stream of the process analysed: at most ``most`` records of each kind, the
    first ones (see :mod:`lorascope.rundir.loading.span`)."""
    jobs: list[_SpanJob] = [(n, data.files, start, end, most) for n, data in run.ranks.items()]
    total = 0
    for data in run.ranks.values():
        for name in data.files:
            with contextlib.suppress(OSError):
                total += Path(name).stat().st_size
    parallel = cluster is None and len(jobs) > 1 and workers.available() > 1 and total >= POOL_MIN_BYTES
    out: dict[int, SpanRecords] = {}
    with contextlib.closing(_run_jobs(read_span, jobs, parallel, cluster)) as results:
        for done, ((n, *_), (found, _warnings)) in enumerate(zip(jobs, results, strict=True), 1):
            if progress is not None:
                progress("reading the span again", done, len(jobs))
            if isinstance(found, str):
                raise BadInputError(found)
            out[n] = found
    return out


@contextlib.contextmanager
def no_cycle_collection() -> Iterator[None]:
    """The cyclic garbage collector off while a stream is read, while the calling process
    takes in and aligns what the workers read, and while the detectors go through it
    (:func:`lorascope.analysis.of_bundle`): the records kept (~10^5 dicts a long stream,
    ~10^6 objects a 1,024-rank run) hold no cycles, but each collection walks every one
    kept so far (measured: ~9% of a 3,000-step stream's reading CPU; 1,024 ranks x 300
    steps, the calling process's CPU reading 9.4 -> 5.2 s, detecting 4.5 -> 4.0 s).
    Switched back on after, unless someone else had switched it off."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _read_all(
    jobs: list[Job], parallel: bool, progress: Progress | None, what: str, cluster: Cluster | None = None
) -> list[tuple[RankData, list[str]]]:
    """Read every job, on the cluster if given, else over a pool of worker processes when
    ``parallel``; in job order."""
    out = []
    members: dict[tuple[Any, ...], list[Any]] = {}
    with contextlib.closing(_run_jobs(read_process, jobs, parallel, cluster)) as results:
        for done, (data, warnings) in enumerate(results, 1):
            if progress is not None:
                progress(what, done, len(jobs))
            if isinstance(data, str):
                raise BadInputError(data)
            _share_members(data, members)
            out.append((data, warnings))
    return out


def _run_jobs(
    fn: Callable[[Any, limits.Limits], Any],
    jobs: list[Any],
    parallel: bool,
    cluster: Cluster | None,
) -> Generator[Any, None, None]:
    """``fn(job, limits)`` of every job, in job order: on the cluster if given, else over a
    pool of worker processes when ``parallel``, else here."""
    configured = limits.current()
    if cluster is not None:
        submitted = [cluster.submit(fn, job, configured) for job in jobs]
        for future, job in zip(submitted, jobs, strict=True):
            yield cluster.result(future, f"reading rank {job[0]}")
        return
    if not parallel:
        for job in jobs:
            yield fn(job, configured)
        return
    pool = ProcessPoolExecutor(max_workers=workers.for_jobs(len(jobs)))
    try:
        # each future let go of once its result is taken in: a result held by its
        # future too would keep its own group member lists (_share_members)
        futures = deque(pool.submit(fn, job, configured) for job in jobs)
        while futures:
            yield futures.popleft().result()
    finally:
        pool.shutdown(cancel_futures=True)


def _share_members(data: RankData, members: dict[tuple[Any, ...], list[Any]]) -> None:
    """One list object for each group's member ranks over all ranks (``members``: those
    so far): every rank records every group it is in, so at 1,024 ranks each of the
    ~2,000 lists of 1,024 ranks was its own (~70 MB)."""
    for group in data.groups.values():
        listed = group.get("ranks")
        if isinstance(listed, list):
            with contextlib.suppress(TypeError):  # unhashable members: left as they are
                group["ranks"] = members.setdefault(tuple(listed), listed)


def _stream_bytes(jobs: list[Job]) -> int:
    """The bytes the jobs read: their streams and steps files, and of their call files what
    is written (a call file is made sparse, at its full size)."""
    total = 0
    for job in jobs:
        segs = job.segs
        for path in [*(p for _, p in segs), _beside(segs[0][1], STEPS_SUFFIX)]:
            with contextlib.suppress(OSError):
                total += path.stat().st_size
        calls = _beside(segs[0][1])
        with contextlib.suppress(OSError):
            stat = calls.stat()
            total += min(stat.st_size, stat.st_blocks * 512)
    return total


def _beside(first: Path, suffix: str = CALLS_SUFFIX) -> Path:
    """A file the probes write beside a process's stream: its call file (``HOST-PID.calls``),
    or another of its suffix."""
    return first.with_name(first.name[: -len(STREAM_SUFFIX)].rpartition(".")[0] + suffix)


def _summed(group: Any) -> bool:
    """Whether a ``calls_step`` record's group entry is [gid, op, calls, bytes, ms, longest
    ms, not ended] with the types it must have (another is left out)."""
    return (
        type(group) is list
        and len(group) == 7
        and type(group[0]) is int
        and type(group[1]) is str
        and type(group[2]) is int
        and type(group[3]) is int
        and type(group[4]) in _NUMBER
        and type(group[5]) in _NUMBER
        and type(group[6]) is int
    )


_NUMBER = (int, float)


def load_run(
    path: str | Path, progress: Progress | None = None, cluster: Cluster | None = None, newest: int | None = None
) -> RunData:
    """Load and validate a run directory (``newest``: each process's recent past only, the
    newest that many records of each of its slot files). Raises BadInputError with a one-line reason.
    ``progress`` is told after each rank. Each process's stream is reduced while it is
    read (:mod:`lorascope.rundir.loading.reduce`), by worker processes when there is enough to
    read, or by the workers of ``cluster`` (:mod:`lorascope.rundir.loading.cluster`); the ranks
    are then aligned (:mod:`lorascope.rundir.loading.align`)."""
    listing = list_run(path, cluster, newest)
    jobs = listing.jobs()
    parallel = cluster is None and len(jobs) > 1 and workers.available() > 1 and _stream_bytes(jobs) >= POOL_MIN_BYTES
    if cluster is not None and jobs:
        cluster.prepare(listing.run_dir)
    with no_cycle_collection():
        results = _read_all(jobs, parallel, progress, "reading rank streams", cluster)
        return listing.assemble(jobs, results, parallel, progress, cluster)


@dataclass
class Listing:
    """A run directory's manifest and its processes' stream files, listed before they are
    read: :func:`load_run` reads them all at once; `lorascope hang` reads each process as
    it answers (:meth:`job`, :func:`read_process`), then puts them together (:meth:`assemble`)."""

    run_dir: Path
    manifest: dict[str, Any]
    #: Each rank folder's number and its processes (``HOST-PID``) with their segments.
    found: list[tuple[int, dict[str, list[tuple[int, Path]]]]]
    #: What the listing warned of.
    warnings: list[str]
    #: Each process read for its recent past only: the newest this many records of each
    #: slot file (None: every one).
    newest: int | None = None
    _where: dict[tuple[str, str], int] = field(default_factory=dict, repr=False)
    _members: dict[tuple[Any, ...], list[Any]] = field(default_factory=dict, repr=False)

    @property
    def budget(self) -> int:
        """The steps each process keeps of its step-keyed records."""
        return steps_per_rank(len(self.found))

    def jobs(self) -> list[Job]:
        """Every process's stream to read, in order."""
        return [
            Job(rank, segs, self.budget, newest=self.newest) for rank, procs in self.found for segs in procs.values()
        ]

    def job(self, rank_dir: Path, process: str) -> Job | None:
        """One process's stream to read, its segments listed again (one may have begun
        since the listing); None when it is not a process of the listing."""
        if not self._where:
            self._where.update(((procs[p][0][1].parent.name, p), rank) for rank, procs in self.found for p in procs)
        rank = self._where.get((rank_dir.name, process))
        if rank is None:
            return None
        segs = _segments(self.run_dir, rank_dir, []).get(process)
        return Job(rank, segs, self.budget, newest=self.newest) if segs else None

    def read(self, job: Job) -> tuple[RankData, list[str]]:
        """One process's stream read here (:func:`read_process`); BadInputError if it is bad."""
        data, warnings = read_process(job, limits.current())
        if isinstance(data, str):
            raise BadInputError(data)
        _share_members(data, self._members)
        return data, warnings

    def assemble(
        self,
        jobs: list[Job],
        results: list[tuple[RankData, list[str]]],
        parallel: bool = False,
        progress: Progress | None = None,
        cluster: Cluster | None = None,
    ) -> RunData:
        """The run from what each of ``jobs`` (every process of the listing, in order:
        :meth:`jobs`) read: one process per rank, the ranks aligned."""
        flat = [*self.warnings, *(w for _, warnings in results for w in warnings)]
        if self.newest is not None:
            flat.append(
                f"each rank was read for its recent past only (the newest {self.newest:,} records of its call, steps "
                "and memory files; no per-step sums of calls): `lorascope analyze` reads the whole run"
            )
        ranks = _choose(self.run_dir, self.manifest, [data for data, _ in results], flat)
        _align(ranks, jobs, results, parallel, progress, cluster)
        _from_common_attach(ranks, flat)
        return RunData(path=self.run_dir, manifest=self.manifest, ranks=ranks, warnings=flat)


def list_run(path: str | Path, cluster: Cluster | None = None, newest: int | None = None) -> Listing:
    """The run directory's manifest (validated) and its processes' stream files, to be read
    whole or (``newest``) for their recent past; BadInputError with a one-line reason."""
    run_dir = Path(path) if cluster is None else Path(path).absolute()
    if not run_dir.exists():
        raise BadInputError(f"{run_dir}: no such file or directory")
    if not run_dir.is_dir():
        raise BadInputError(f"{run_dir} is not a run directory (it is a file)")
    manifest = _read_manifest(run_dir)
    warnings: list[str] = []
    ranks_dir = run_dir / RANKS_DIR
    rank_dirs = sorted(ranks_dir.glob("rank-*")) if ranks_dir.is_dir() else []
    found: list[tuple[int, dict[str, list[tuple[int, Path]]]]] = []
    for rank_dir in rank_dirs:
        suffix = rank_dir.name.removeprefix("rank-")
        if not suffix.isdigit() or len(suffix) > 9:
            continue
        if leaves(run_dir, rank_dir):
            warnings.append(f"{rank_dir}: a symlink out of the run directory: not followed")
            continue
        seg_warnings: list[str] = []
        procs = _segments(run_dir, rank_dir, seg_warnings)
        warnings.extend(seg_warnings)
        if not procs:
            warnings.append(f"rank {suffix}: no stream files in {rank_dir}")
            continue
        found.append((int(suffix), procs))
    return Listing(run_dir, manifest, found, warnings, newest)


def _from_common_attach(ranks: dict[int, RankData], warnings: list[str]) -> None:
    """A run `lorascope attach` began in a running job: each rank's records begin at its
    own attach, so in each group the calls before the latest rank's first are dropped
    (one rank holding a call another was not yet watching is no divergence), and a
    warning says what the run cannot know."""
    attached = [r for r in ranks.values() if isinstance(r.start.get("attached"), dict)]
    if not attached:
        return
    first: dict[str, int] = {}
    for data in ranks.values():
        seen: dict[str, int] = {}
        for c in data.collectives:
            seen[c.group] = min(seen.get(c.group, c.seq), c.seq)
        for group, seq in seen.items():
            first[group] = max(first.get(group, seq), seq)
    for data in ranks.values():
        data.collectives = [c for c in data.collectives if c.pending or c.seq >= first.get(c.group, 0)]
    when = min(float(r.start["attached"].get("t") or r.start["t"]) for r in attached)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when))
    warnings.append(
        f"attached to a running job at {stamp} (`lorascope attach`, {len(attached)} of {len(ranks)} ranks): "
        "nothing before is known (steps are counted from the attach, memory peaks, collectives, warnings "
        "and errors before it are not recorded)"
    )


def _choose(
    run_dir: Path, manifest: dict[str, Any], processes: list[RankData], warnings: list[str]
) -> dict[int, RankData]:
    """One process per rank (the latest, warned), launchers left out; none at all is an error."""
    by_rank: dict[int, list[RankData]] = {}
    for data in _drop_launchers(processes, warnings):
        _trust_torch_rank(data, warnings)
        by_rank.setdefault(data.rank, []).append(data)
    ranks: dict[int, RankData] = {}
    for rank, loaded in by_rank.items():
        loaded.sort(key=lambda d: float(d.start["t"]))
        if len(loaded) > 1:
            warnings.append(
                f"rank {rank}: {len(loaded)} processes wrote this rank (a restart?); "
                f"the latest, pid {loaded[-1].pid}, is analysed"
            )
        ranks[rank] = loaded[-1]
    warnings.extend(_probe_errors(run_dir))
    if not ranks:
        failed = [s for launch in manifest["launches"] if (s := launch.get("exit_status"))]
        why = why_none_attached(
            run_dir, [launch["command"] for launch in manifest["launches"]], exit_status=failed[0] if failed else None
        )
        raise NothingRecordedError(f"{run_dir}: no process attached the probes, nothing to analyse: {why}")
    expected = max(r.start["world_size"] for r in ranks.values())
    absent = sorted(set(range(expected)) - set(ranks))
    if absent:
        warnings.append(f"world size is {expected} but ranks {absent} wrote no stream")
    return dict(sorted(ranks.items()))


def _align(
    ranks: dict[int, RankData],
    jobs: list[Job],
    results: list[tuple[RankData, list[str]]],
    parallel: bool,
    progress: Progress | None,
    cluster: Cluster | None,
) -> None:
    """Make the ranks' reduced records comparable: one step stride for all, the
    collective windows where they differ read again in full where a rank dropped them,
    then the calls only some ranks hold dropped."""
    stride = max(r.stride for r in ranks.values())
    for data in ranks.values():
        if data.stride != stride:
            data.stride = decimate(data, steps_per_rank(len(jobs)), stride)
    needed, reread = windows_needed(ranks)
    if reread:
        job_of = {id(data): job for job, (data, _) in zip(jobs, results, strict=True)}
        again = [(n, job_of[id(ranks[n])]._replace(windows=reread[n])) for n in sorted(reread)]
        for (n, _), (data, _) in zip(
            again,
            _read_all([j for _, j in again], parallel, progress, "reading divergence windows", cluster),
            strict=True,
        ):
            have = {(c.group, c.seq) for c in ranks[n].collectives}
            ranks[n].collectives.extend(
                c for c in data.collectives if (c.group, c.seq) not in have and _inside(c, reread[n])
            )
            ranks[n].collectives.sort(key=lambda c: c.start)
    trim(ranks, needed)


def _inside(coll: Collective, windows: dict[str, list[tuple[int, int]]]) -> bool:
    return any(lo <= coll.seq <= hi for lo, hi in windows.get(coll.group, ()))


#: What is read of a faulthandler file, at most (the head names the signal, then stacks).
MAX_FATAL_BYTES = 64 * 1024


def _fatal_text(path: Path, name: str) -> str | None:
    """The text faulthandler left, if it wrote any (it is empty unless the rank died of a
    fatal signal): a regular file in the rank's folder (a symlink out of it, a FIFO or a
    device is not read)."""
    if Path(name).name != name or not path.is_file():
        return None
    try:
        text = read_head(path, MAX_FATAL_BYTES, inside=path.parent).decode("utf-8", "replace").strip()
    except (OSError, BadInputError):
        return None
    return text or None


def _drop_launchers(processes: list[RankData], warnings: list[str]) -> list[RankData]:
    """A lone process (no rank variables) whose children attached as ranks was their
    launcher, not a rank: its stream is left out (warned, unless it is a framework's
    tool that does so on every multi-process run: ``ranks.LAUNCHING_CLIS``)."""
    parents = {(d.host, d.start.get("probed_parent")) for d in processes if d.start.get("probed_parent")}
    kept = []
    for data in processes:
        if data.start.get("rank_source") == "lone" and (data.host, data.pid) in parents:
            if not launching_cli(data.start):
                warnings.append(
                    f"pid {data.pid} on {data.host} attached as a lone process but started probed ranks: "
                    "a launcher, left out of the analysis"
                )
        else:
            kept.append(data)
    return kept


def _trust_torch_rank(data: RankData, warnings: list[str]) -> None:
    """Where torch.distributed disagrees with the rank the probes took from launcher
    variables, the process is analysed as torch's rank, and a warning says so."""
    init = data.dist_init
    if init is None:
        return
    probed = (data.rank, data.start["world_size"])
    actual = (init["rank"], init["world_size"])
    if probed == actual:
        return
    source = data.start.get("rank_source", "the environment")
    warnings.append(
        f"pid {data.pid} on {data.host} was probed as rank {probed[0]} of {probed[1]} (from {source}) but "
        f"torch.distributed says rank {actual[0]} of {actual[1]}; analysed as rank {actual[0]}"
    )
    data.rank = actual[0]
    data.start = {**data.start, "rank": actual[0], "world_size": actual[1], "probed_as": list(probed)}


def launching_cli(start: Mapping[str, Any]) -> bool:
    """Whether a process's ``start`` record names a framework's tool that starts its ranks
    itself (``ranks.LAUNCHING_CLIS``)."""
    argv = start.get("argv")  # sys.argv: the script (a console script's path) first
    return isinstance(argv, list) and bool(argv) and str(argv[0]).rsplit("/", 1)[-1] in ranks.LAUNCHING_CLIS
