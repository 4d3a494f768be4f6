"""Reading and validating a run directory (analysis side).

A torn last line (a rank killed mid-write) is skipped with a warning; anything else that
breaks format v1 is a BadInputError naming the file and line.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorascope.errors import BadInputError, FormatVersionError, NothingRecordedError
from lorascope.rundir import limits
from lorascope.rundir.attachments import why_none_attached
from lorascope.rundir.limits import MAX_RECORD_DEPTH, LimitError
from lorascope.rundir.safe_open import leaves, maybe_too_deep, open_regular, read_capped
from lorascope.rundir.schema import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    RANKS_DIR,
    STREAM_SUFFIX,
    SchemaError,
    validate_manifest,
    validate_record,
)

#: Told how far a long step has come: (what, done, total). The CLI draws it as a bar.
Progress = Callable[[str, int, int], None]


@dataclass
class Collective:
    """One collective or p2p call on one rank, its start joined with its end (if any)."""

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


@dataclass
class RankData:
    """Everything one rank process wrote."""

    rank: int
    start: dict[str, Any]
    files: list[str]
    configs: dict[str, dict[str, Any]] = field(default_factory=dict)
    mem: list[dict[str, Any]] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    phases: list[dict[str, Any]] = field(default_factory=list)
    groups: dict[int, dict[str, Any]] = field(default_factory=dict)
    collectives: list[Collective] = field(default_factory=list)
    warnings: list[dict[str, Any]] = field(default_factory=list)
    exception: dict[str, Any] | None = None
    signal: dict[str, Any] | None = None
    end: dict[str, Any] | None = None
    probe_errors: list[dict[str, Any]] = field(default_factory=list)
    #: Collective paths the job used that the probes cannot see (``coll_unseen``).
    unseen_collectives: list[dict[str, Any]] = field(default_factory=list)
    #: Call site -> {"line": source text, "conditions": enclosing if/while lines}.
    sites: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: On-demand and stall dumps (stacks, pending collectives), oldest first.
    dumps: list[dict[str, Any]] = field(default_factory=list)
    stall: dict[str, Any] | None = None
    #: torch.distributed's rank and world size, once the process group started.
    dist_init: dict[str, Any] | None = None
    grad_setup: dict[str, Any] | None = None
    grads: dict[str, Any] | None = None
    logits: list[dict[str, Any]] = field(default_factory=list)
    #: Kineto traces and flight-recorder dumps the rank wrote, as absolute paths.
    trace_files: list[str] = field(default_factory=list)
    flight_files: list[str] = field(default_factory=list)
    #: What faulthandler wrote when the rank died of a fatal signal (a C++ abort, a
    #: segfault): "Fatal Python error: Aborted" and every thread's stack; None when empty.
    fatal: str | None = None
    #: Allocator snapshots the rank wrote: their ``snapshot`` records, ``path`` added
    #: (absolute), oldest first; and whether allocator history was recorded, and why not.
    snapshots: list[dict[str, Any]] = field(default_factory=list)
    memory_history: dict[str, Any] | None = None
    last_time: float = 0.0

    @property
    def pid(self) -> int:
        return int(self.start["pid"])

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
    data = read_capped(path, "record_bytes", "the manifest")
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
    for path in sorted(rank_dir.glob("*" + STREAM_SUFFIX)):
        stem = path.name[: -len(STREAM_SUFFIX)]
        proc, _, index = stem.rpartition(".")
        if not proc or not index.isdigit() or len(index) > 9:
            continue
        if leaves(run_dir, path):
            warnings.append(f"{path}: a symlink out of the run directory: not followed")
            continue
        out.setdefault(proc, []).append((int(index), path))
    return {proc: sorted(segs) for proc, segs in out.items()}


def _iter_records(path: Path, warnings: list[str]) -> Iterator[tuple[int, Any]]:
    """Yield (line number, record) pairs, reading line by line; a torn final line is a
    warning, not an error; so are records over the record size limit or nested deeper
    than MAX_RECORD_DEPTH (skipped, one warning per file)."""
    max_line = limits.current().record_bytes
    long_lines: list[int] = []
    deep_lines: list[int] = []
    number = 0
    try:
        with open_regular(path) as f:
            while line := f.readline(max_line + 1):
                number += 1
                if len(line) > max_line and not line.endswith(b"\n"):
                    long_lines.append(number)
                    while (rest := f.readline(1 << 20)) and not rest.endswith(b"\n"):
                        pass
                    continue
                if not line.strip():
                    continue
                if maybe_too_deep(line, MAX_RECORD_DEPTH):
                    deep_lines.append(number)
                    continue
                try:
                    rec = json.loads(line)
                except (UnicodeDecodeError, ValueError):
                    if line.endswith(b"\n"):
                        raise BadInputError(f"{path}:{number}: not a JSON record (the stream is corrupt)") from None
                    warnings.append(
                        f"{path}:{number}: skipped a torn last record "
                        f"({len(line)} bytes; the process was killed while writing it)"
                    )
                    continue
                yield number, rec
    except OSError as exc:
        raise BadInputError(f"{path}: unreadable ({exc.strerror})") from None
    finally:
        if long_lines:
            warnings.append(
                f"{path}:{long_lines[0]}: skipped {len(long_lines)} record(s) over {limits.describe('record_bytes')}"
            )
        if deep_lines:
            warnings.append(
                f"{path}:{deep_lines[0]}: skipped {len(deep_lines)} record(s) nested deeper than "
                f"{MAX_RECORD_DEPTH} levels"
            )


def _load_process(rank: int, segs: list[tuple[int, Path]], warnings: list[str]) -> RankData:
    indices = [i for i, _ in segs]
    gaps = [(a + 1, b - 1) for a, b in zip([-1, *indices], indices, strict=False) if b > a + 1]
    if gaps:
        warnings.append(
            f"rank {rank}: stream segments {gaps[0][0]}-{gaps[-1][1]} were rotated away "
            f"(bounded stream); the first and the newest segments are kept"
        )
    total = 0
    for _, path in segs:
        with contextlib.suppress(OSError):
            total += path.stat().st_size
    if total > limits.current().stream_bytes:
        raise LimitError(f"rank {rank}", f"its stream ({total:,} bytes in {len(segs)} segment(s))", "stream_bytes")
    unknown: dict[str, tuple[str, int]] = {}
    data: RankData | None = None
    pending: dict[tuple[int, int], Collective] = {}
    dropped: tuple[str, int] | None = None
    for _, path in segs:
        for number, rec in _iter_records(path, warnings):
            try:
                known = validate_record(rec)
            except SchemaError as exc:
                raise BadInputError(f"{path}:{number}: {exc}") from None
            if not known:
                where, n = unknown.get(rec["k"], (f"{path}:{number}", 0))
                unknown[rec["k"]] = (where, n + 1)
                continue
            kind = rec["k"]
            if data is None:
                if kind != "start":
                    raise BadInputError(f"{path}:{number}: the stream does not begin with a 'start' record")
                data = RankData(rank=rank, start=rec, files=[])
            data.last_time = max(data.last_time, float(rec["t"]), float(rec["end"]) if kind == "coll_done" else 0.0)
            _apply(data, kind, rec, pending)
            if kind == "dropped":  # a running total
                dropped = (f"{path}:{number}", rec["records"])
            if kind == "fatal_handler":
                data.fatal = _fatal_text(path.parent / str(rec["file"]), str(rec["file"]))
            if kind in ("trace_window", "flight_dump", "snapshot") and rec.get("file"):
                side = path.parent / str(rec["file"])
                if side.name != rec["file"] or not side.exists():
                    warnings.append(f"{path}:{number}: {kind} file {rec['file']!r} is missing")
                elif leaves(path.parent, side):
                    warnings.append(f"{side}: a symlink out of the run directory: not followed")
                elif kind == "trace_window":
                    data.trace_files.append(str(side))
                elif kind == "snapshot":
                    data.snapshots.append({**rec, "path": str(side)})
                else:
                    data.flight_files.append(str(side))
        if data is not None:
            data.files.append(str(path))
    for kind, (where, n) in unknown.items():
        warnings.append(f"{where}: skipped {n} record(s) of unknown kind {kind[:80]!r}")
    if dropped is not None:
        warnings.append(f"{dropped[0]}: the probes dropped {dropped[1]} record(s) (their queue was full)")
    if data is None:
        raise BadInputError(f"{segs[0][1]}: empty rank stream")
    data.collectives.sort(key=lambda c: c.start)
    return data


#: Kinds kept as lists on RankData (attribute names), and kinds of which the last is kept.
_LISTED = {
    "mem": "mem",
    "step": "steps",
    "phase": "phases",
    "warning": "warnings",
    "probe_error": "probe_errors",
    "coll_unseen": "unseen_collectives",
    "dump": "dumps",
    "logits": "logits",
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
}


def _apply(data: RankData, kind: str, rec: dict[str, Any], pending: dict[tuple[int, int], Collective]) -> None:
    if kind in _LISTED:
        getattr(data, _LISTED[kind]).append(rec)
    elif kind in _LATEST:
        setattr(data, _LATEST[kind], rec)
    elif kind == "config":
        data.configs[rec["name"]] = rec["value"]
    elif kind == "site":
        data.sites[rec["site"]] = rec
    elif kind == "group":
        data.groups[rec["gid"]] = rec
    elif kind == "loss":  # a CUDA loss, read once the device got there
        for step in reversed(data.steps):
            if step["step"] == rec["step"]:
                step["loss"] = rec["loss"]
                if rec.get("text"):
                    step["loss_text"] = rec["text"]
                break
    elif kind == "coll" or kind == "coll_done":
        group = data.groups.get(rec["gid"], {}).get("name", str(rec["gid"]))
        coll = Collective(
            seq=rec["seq"],
            group=group,
            op=rec["op"],
            bytes=rec["bytes"],
            dtype=rec["dtype"],
            is_async=rec["async"],
            site=rec["site"],
            step=rec["step"],
            start=float(rec["t"]),
            via=rec["via"] if isinstance(rec.get("via"), str) else None,
        )
        if kind == "coll":
            pending[(rec["gid"], rec["seq"])] = coll
        else:  # the call had ended when it was written
            coll.end, coll.err = float(rec["end"]), rec["err"]
        data.collectives.append(coll)
    elif kind == "coll_end":
        ended = pending.pop((rec["gid"], rec["seq"]), None)
        if ended is not None:
            ended.end, ended.err = float(rec["t"]), rec["err"]
    elif kind == "coll_dev":
        for coll in reversed(data.collectives):
            if coll.seq == rec["seq"] and data.groups.get(rec["gid"], {}).get("name") == coll.group:
                coll.device_ms = float(rec["ms"])
                break


def _probe_errors(run_dir: Path, most: int = 50) -> list[str]:
    """The first lines of probe-errors.log (each cut at 1 KiB)."""
    path = run_dir / "probe-errors.log"
    if not path.exists():
        return []
    if leaves(run_dir, path):
        return [f"{path}: a symlink out of the run directory: not followed"]
    out: list[str] = []
    with open_regular(path) as f:
        while len(out) < most and (raw := f.readline(1024)):
            line = raw.decode("utf-8", "replace").strip()
            if line:
                out.append(line.removeprefix("lorascope: "))
    return out


def load_run(path: str | Path, progress: Progress | None = None) -> RunData:
    """Load and validate a run directory. Raises BadInputError with a one-line reason.
    ``progress`` is told after each rank."""
    run_dir = Path(path)
    if not run_dir.exists():
        raise BadInputError(f"{run_dir}: no such file or directory")
    if not run_dir.is_dir():
        raise BadInputError(f"{run_dir} is not a run directory (it is a file)")
    manifest = _read_manifest(run_dir)
    warnings: list[str] = []
    processes: list[RankData] = []
    ranks_dir = run_dir / RANKS_DIR
    rank_dirs = sorted(ranks_dir.glob("rank-*")) if ranks_dir.is_dir() else []
    for done, rank_dir in enumerate(rank_dirs, 1):
        if progress is not None:
            progress("reading rank streams", done, len(rank_dirs))
        suffix = rank_dir.name.removeprefix("rank-")
        if not suffix.isdigit() or len(suffix) > 9:
            continue
        if leaves(run_dir, rank_dir):
            warnings.append(f"{rank_dir}: a symlink out of the run directory: not followed")
            continue
        procs = _segments(run_dir, rank_dir, warnings)
        if not procs:
            warnings.append(f"rank {suffix}: no stream files in {rank_dir}")
            continue
        processes.extend(_load_process(int(suffix), segs, warnings) for segs in procs.values())
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
        why = why_none_attached(run_dir, [launch["command"] for launch in manifest["launches"]])
        raise NothingRecordedError(f"{run_dir}: no process attached the probes, nothing to analyse: {why}")
    expected = max(r.start["world_size"] for r in ranks.values())
    absent = sorted(set(range(expected)) - set(ranks))
    if absent:
        warnings.append(f"world size is {expected} but ranks {absent} wrote no stream")
    return RunData(path=run_dir, manifest=manifest, ranks=dict(sorted(ranks.items())), warnings=warnings)


#: What is read of a faulthandler file, at most (the head names the signal, then stacks).
MAX_FATAL_BYTES = 64 * 1024


def _fatal_text(path: Path, name: str) -> str | None:
    """The text faulthandler left, if it wrote any (it is empty unless the rank died of a
    fatal signal)."""
    if Path(name).name != name or not path.is_file():
        return None
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_FATAL_BYTES).decode("utf-8", "replace").strip()
    except OSError:
        return None
    return text or None


def _drop_launchers(processes: list[RankData], warnings: list[str]) -> list[RankData]:
    """A lone process (no rank variables) whose children attached as ranks was their
    launcher, not a rank: its stream is left out."""
    parents = {(d.host, d.start.get("probed_parent")) for d in processes if d.start.get("probed_parent")}
    kept = []
    for data in processes:
        if data.start.get("rank_source") == "lone" and (data.host, data.pid) in parents:
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
