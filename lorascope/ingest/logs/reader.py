"""A job's log, streamed line by line: the lines that name a failure, as typed records.

The log may be large (tens of MB, several ranks interleaved): it is never loaded whole.
Lines longer than :data:`MAX_LINE` are cut (the rest skipped); gzipped logs are read
as they are. What it extracts (see :mod:`lorascope.ingest.logs.patterns`): NCCL watchdog
timeouts and progress, gloo timeouts and size mismatches, CUDA OOM messages with their
numbers, the reentrant-checkpointing warning and the errors it leads to, DeepSpeed's
allocator cache flushes, exception lines; each with its rank (from the ``[rankN]:``
prefix) and line number.
"""

from __future__ import annotations

import gzip
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from lorascope.errors import BadInputError
from lorascope.ingest.logs import patterns as P
from lorascope.rundir.format import limits
from lorascope.rundir.format.safe_open import open_regular

MAX_LINE = 64 * 1024
#: Records kept per kind (all are counted).
MAX_RECORDS = 200


@dataclass
class WatchdogTimeout:
    """``Watchdog caught collective operation timeout: WorkNCCL(SeqNum=..., OpType=...)``."""

    rank: int | None
    line: int
    seq: int
    op: str
    numel_in: int | None
    numel_out: int | None
    timeout_ms: int | None
    ran_ms: int | None
    group: str | None


@dataclass
class NcclProgress:
    """``last enqueued work: N, last completed work: M`` (the watchdog's progress line)."""

    rank: int | None
    line: int
    at_seq: int | None
    last_enqueued: int
    last_completed: int
    group: str | None


@dataclass
class OomReport:
    """A CUDA OOM message, its numbers in bytes (None where the message lacks them)."""

    rank: int | None
    line: int
    gpu: int | None
    requested: int | None
    total_capacity: int | None
    free: int | None
    process_in_use: int | None
    allocated_by_pytorch: int | None
    #: "reserved by PyTorch but unallocated" (newer torch), or reserved - allocated (older).
    reserved_unallocated: int | None
    reserved_total: int | None
    #: The process's own cap (``torch.cuda.set_per_process_memory_fraction``), when set.
    allowed: int | None
    #: Other processes on the same GPU: pid -> bytes ("Process 4413 has 1.20 GiB memory in use").
    other_processes: dict[int, int]


@dataclass
class CacheFlushes:
    """DeepSpeed: ``N pytorch allocator cache flushes since last step``."""

    rank: int | None
    line: int
    flushes: int


@dataclass
class LogLine:
    """A line that matters by itself. kinds: ``no-input-grad`` (checkpoint warning "None of
    the inputs have requires_grad=True"), ``no-grad-error`` ("loss must be a scalar tensor",
    "element 0 of tensors does not require grad"), ``gloo-timeout``, ``gloo-size-mismatch``,
    ``exception``."""

    kind: str
    rank: int | None
    line: int
    text: str


@dataclass
class LogAnalysis:
    path: Path
    lines: int
    ranks: list[int]
    watchdog_timeouts: list[WatchdogTimeout] = field(default_factory=list)
    nccl_progress: list[NcclProgress] = field(default_factory=list)
    ooms: list[OomReport] = field(default_factory=list)
    cache_flushes: list[CacheFlushes] = field(default_factory=list)
    lines_of_note: list[LogLine] = field(default_factory=list)
    #: How many of each kind the whole log holds (the lists keep the first ones).
    counts: dict[str, int] = field(default_factory=dict)
    cut_lines: int = 0
    #: Why reading stopped before the end (a size limit), if it did.
    warnings: list[str] = field(default_factory=list)
    #: Whether anything in the file looks like a job's log (see ``LOG_MARKERS``).
    looks_like_a_log: bool = False

    def of_kind(self, kind: str) -> list[LogLine]:
        return [x for x in self.lines_of_note if x.kind == kind]


def _open(path: Path) -> IO[bytes]:
    f = open_regular(path)
    gz = f.read(2) == b"\x1f\x8b"
    f.seek(0)
    return gzip.GzipFile(fileobj=f, mode="rb") if gz else f  # type: ignore[return-value]


def _lines(f: IO[bytes], result: LogAnalysis) -> Iterator[str]:
    """The log's lines, cut at MAX_LINE, up to the log size and line limits (a warning
    says where reading stopped)."""
    bound = limits.current()
    total = lines = 0
    while True:
        raw = f.readline(MAX_LINE)
        if not raw:
            return
        total += len(raw)
        if not raw.endswith(b"\n") and len(raw) == MAX_LINE:
            result.cut_lines += 1
            while total <= bound.log_bytes:  # skip the rest of an over-long line
                more = f.readline(MAX_LINE)
                total += len(more)
                if not more or more.endswith(b"\n"):
                    break
        lines += 1
        if total > bound.log_bytes or lines > bound.log_lines:
            name, what = ("log_bytes", "bytes") if total > bound.log_bytes else ("log_lines", "lines")
            result.warnings.append(
                f"read the first {lines - 1:,} lines only: the log's {what} are over {limits.describe(name)}"
            )
            return
        yield raw.decode("utf-8", "replace").rstrip("\r\n")


def read_log(path: Path) -> LogAnalysis:
    """Stream the log. BadInputError if it cannot be read (gzip errors included)."""
    result = LogAnalysis(path=path, lines=0, ranks=[])
    ranks: set[int] = set()
    try:
        with _open(path) as f:
            for n, line in enumerate(_lines(f, result), 1):
                result.lines = n
                m = P.RANK_PREFIX.match(line)
                rank = int(m.group(1)) if m else None
                if rank is not None:
                    ranks.add(rank)
                    line = line[m.end() :]  # type: ignore[union-attr]
                if not result.looks_like_a_log and P.LOG_MARKERS.search(line):
                    result.looks_like_a_log = True
                _match(line, rank, n, result)
    except (OSError, EOFError, zlib.error) as exc:
        raise BadInputError(f"{path}: cannot read the log ({exc})") from None
    result.ranks = sorted(ranks)
    if result.ranks or result.counts:
        result.looks_like_a_log = True
    return result


def _count(result: LogAnalysis, kind: str) -> bool:
    """Count one more of ``kind``; whether to keep the record."""
    result.counts[kind] = result.counts.get(kind, 0) + 1
    return result.counts[kind] <= MAX_RECORDS


def _group(line: str) -> str | None:
    m = P.PG_NAME.search(line)
    return (m.group("desc") or m.group("pg")) if m else None


def _opt_int(text: str | None) -> int | None:
    return int(text) if text is not None else None


def _match(line: str, rank: int | None, n: int, result: LogAnalysis) -> None:
    if "WorkNCCL(" in line and (m := P.WATCHDOG.search(line)) and _count(result, "watchdog-timeout"):
        result.watchdog_timeouts.append(
            WatchdogTimeout(
                rank=rank,
                line=n,
                seq=int(m["seq"]),
                op=m["op"],
                numel_in=_opt_int(m["numel_in"]),
                numel_out=_opt_int(m["numel_out"]),
                timeout_ms=_opt_int(m["timeout_ms"]),
                ran_ms=_opt_int(m["ran_ms"]),
                group=_group(line),
            )
        )
    if "last enqueued" in line and (m := P.NCCL_PROGRESS.search(line)) and _count(result, "nccl-progress"):
        result.nccl_progress.append(
            NcclProgress(
                rank=rank,
                line=n,
                at_seq=_opt_int(m["at"]),
                last_enqueued=int(m["enqueued"]),
                last_completed=int(m["completed"]),
                group=_group(line),
            )
        )
    if "out of memory" in line and (m := P.OOM.search(line)) and _count(result, "oom"):
        result.ooms.append(_oom(line, m, rank, n))
    if "cache flushes" in line and (m := P.CACHE_FLUSHES.search(line)) and _count(result, "cache-flushes"):
        result.cache_flushes.append(CacheFlushes(rank=rank, line=n, flushes=int(m.group(1))))
    kind = None
    if "requires_grad" in line and P.NO_INPUT_GRAD.search(line):
        kind = "no-input-grad"
    elif P.NO_GRAD_ERROR.search(line):
        kind = "no-grad-error"
    elif "Timed out waiting" in line and P.GLOO_TIMEOUT.search(line):
        kind = "gloo-timeout"
    elif "doesn't match expected size" in line and P.GLOO_SIZE_MISMATCH.search(line):
        kind = "gloo-size-mismatch"
    elif ("Error" in line or "Exception" in line or "Interrupt" in line) and P.EXCEPTION.match(line.strip()):
        kind = "exception"
    if kind is not None and _count(result, kind):
        result.lines_of_note.append(LogLine(kind=kind, rank=rank, line=n, text=line.strip()[:500]))


def parse_oom(text: str, rank: int | None = None) -> OomReport | None:
    """The numbers of one CUDA OOM message (a rank's recorded exception), None if it is not one."""
    m = P.OOM.search(text)
    return _oom(text, m, rank, 0) if m else None


def _oom(line: str, m: re.Match[str], rank: int | None, n: int) -> OomReport:
    fields = {name: P.size_bytes(p.search(line)) for name, p in P.OOM_FIELDS.items()}
    gpu = P.OOM_GPU.search(line)
    unallocated = fields["reserved_unallocated"]
    if unallocated is None and fields["reserved_total"] is not None and fields["allocated_by_pytorch"] is not None:
        unallocated = max(0, fields["reserved_total"] - fields["allocated_by_pytorch"])
    return OomReport(
        rank=rank,
        line=n,
        gpu=int(gpu.group(1)) if gpu else None,
        requested=P.size_bytes(m),
        total_capacity=fields["total_capacity"],
        free=fields["free"],
        process_in_use=fields["process_in_use"],
        allocated_by_pytorch=fields["allocated_by_pytorch"],
        reserved_unallocated=unallocated,
        reserved_total=fields["reserved_total"],
        allowed=fields["allowed"],
        other_processes={int(p.group(1)): P.bytes_of(p.group(2), p.group(3)) for p in P.OTHER_PROCESS.finditer(line)},
    )
