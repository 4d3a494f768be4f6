"""Loading artifacts (files users already have) into an EvidenceBundle.

A file's kind comes from :mod:`lorascope.ingest.kinds` unless forced; its rank from its
content where the format says (Kineto ``distributedInfo``), else from its path
(:mod:`lorascope.ingest.path_rank`), else the next free number (with a warning). In a
folder, a file that fails to load becomes a warning; a single file that fails is an
error.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lorascope.errors import BadInputError
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.ingest.flight.reader import FlightDump, read_flight_dump
from lorascope.ingest.kinds import describe_unknown, detect_kind
from lorascope.ingest.kineto.hta import hta_figures
from lorascope.ingest.kineto.reader import KinetoTrace, read_trace
from lorascope.ingest.logs.reader import read_log
from lorascope.ingest.path_rank import rank_from_path
from lorascope.ingest.snapshot.reader import read_snapshot
from lorascope.rundir.format.safe_open import leaves
from lorascope.rundir.loading.reader import Progress

#: Files looked at in one folder (a mis-aimed PATH, like a home directory, stays cheap).
MAX_FILES = 2000
_SKIP_DIRS = {".git", "__pycache__", "node_modules", ".venv", "bootstrap"}


def walk_files(folder: Path, warnings: list[str] | None = None) -> Iterator[Path]:
    """Regular files under FOLDER, sorted, hidden and tool folders skipped; symlinks that
    leave FOLDER are not followed (a warning in ``warnings``), FIFOs, devices and sockets
    not read."""
    count = 0
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _SKIP_DIRS)
        for name in sorted(files):
            if name.startswith("."):
                continue
            path = Path(root) / name
            if path.is_symlink() and leaves(folder, path):
                if warnings is not None:
                    warnings.append(f"{path}: a symlink out of {folder}: not followed")
                continue
            if not path.is_file():
                if warnings is not None and not path.is_dir():
                    warnings.append(f"{path}: not a regular file (a FIFO, device or socket): not read")
                continue
            count += 1
            if count > MAX_FILES:
                return
            yield path


def _free_rank(taken: dict[int, object]) -> int:
    rank = 0
    while rank in taken:
        rank += 1
    return rank


def load_file(bundle: EvidenceBundle, path: Path, kind: str, forced: bool = False, inside: Path | None = None) -> None:
    """Load one file of KIND into the bundle. BadInputError when it is not that kind.
    A log given with ``--kind log`` (forced) only has to be text, not to look like a log.
    INSIDE: a folder the file must not leave (a run directory's rank folder)."""
    if kind == "log":
        if forced and detect_kind(path) != "log":
            raise BadInputError(f"{path}: not text, so not a log ({describe_unknown(path)})")
        log = read_log(path)
        if not (forced or log.looks_like_a_log):
            raise BadInputError(
                f"{path}: text, but not a job log (no timestamps, log levels, rank prefixes "
                "or messages lorascope knows)"
            )
        bundle.logs.append(log)
        bundle.warnings.extend(f"{path}: {w}" for w in log.warnings)
        return
    #: kind -> (reader(path, rank from the name), where the bundle keeps that kind by rank)
    readers: dict[str, tuple[Callable[[Path, int | None, Path | None], Any], dict[int, Any]]] = {
        "snapshot": (read_snapshot, bundle.snapshots),
        "flight": (read_flight_dump, bundle.flight_records),
        "kineto": (read_trace, bundle.traces),
    }
    if kind not in readers:
        raise BadInputError(f"{path}: cannot load a file as {kind!r}")
    reader, store = readers[kind]
    rank = rank_from_path(path)
    artifact = reader(path, rank, inside)
    rank = artifact.rank
    if rank is None:
        rank = _free_rank(store)
        artifact.rank = rank
        bundle.warnings.append(f"{path}: no rank in the file or its name; taken as rank {rank}")
    if rank in store:
        kept, dropped = (artifact, store[rank]) if _richer(artifact, store[rank]) else (store[rank], artifact)
        bundle.warnings.append(f"two {kind} files for rank {rank}: using {kept.path}, not {dropped.path}")
        if kept is store[rank]:
            return
    store[rank] = artifact
    bundle.warnings.extend(f"{path}: {w}" for w in artifact.warnings)


def _richer(new: object, old: object) -> bool:
    """Of two dumps of one rank, the one with stacks (torch's JSON dumps have none)."""
    if isinstance(new, FlightDump) and isinstance(old, FlightDump):
        return sum(bool(e.frames) for e in new.entries) > sum(bool(e.frames) for e in old.entries)
    return False


def load_files(bundle: EvidenceBundle, files: list[Path], kind: str | None, progress: Progress | None = None) -> int:
    """Load every file (sniffed, or all as KIND); failures become warnings. Returns how many loaded."""
    loaded = 0
    errors: list[str] = []
    for done, path in enumerate(files, 1):
        if progress is not None:
            progress("reading artifacts", done, len(files))
        try:
            file_kind = kind or detect_kind(path)
            if file_kind is None or file_kind == "rundir":
                continue
            load_file(bundle, path, file_kind, forced=kind is not None)
            loaded += 1
        except BadInputError as exc:
            errors.append(str(exc))
    bundle.warnings.extend(f"skipped: {e}" for e in errors)
    if not loaded and errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise BadInputError(errors[0] + more)
    return loaded


def load_single(bundle: EvidenceBundle, path: Path, kind: str | None) -> None:
    file_kind = kind or detect_kind(path)
    if file_kind is None:
        raise BadInputError(
            f"{path}: not a run directory (it is a file), nor an artifact lorascope knows "
            f"(allocator snapshot, Kineto trace, flight-recorder dump, job log): "
            f"{describe_unknown(path)}"
        )
    if file_kind == "log" and kind is None:
        log = read_log(path)
        if not log.looks_like_a_log:
            raise BadInputError(
                f"{path}: not a run directory (it is a file), nor an artifact lorascope knows: "
                "text, but not a job log (no timestamps, log levels, rank prefixes or "
                "messages lorascope knows)"
            )
        bundle.logs.append(log)
        bundle.warnings.extend(f"{path}: {w}" for w in log.warnings)
        return
    load_file(bundle, path, file_kind, forced=kind is not None)


def add_hta(traces: dict[int, KinetoTrace]) -> None:
    """HTA figures for the GPU traces (CPU traces: HTA does not take them)."""
    gpu = {r: t.path for r, t in traces.items() if t.device != "cpu"}
    if not gpu:
        for t in traces.values():
            t.hta_note = "CPU-only trace: HTA analyses GPU traces only"
        return
    figures, note = hta_figures(gpu)
    for rank, trace in traces.items():
        trace.hta = figures.get(rank)
        if trace.hta is None:
            trace.hta_note = note or (
                "CPU-only trace: HTA analyses GPU traces only"
                if trace.device == "cpu"
                else "HTA gave no figures for this rank"
            )
