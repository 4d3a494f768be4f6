"""What `lorascope analyze PATH` loads: PATH becomes an EvidenceBundle.

PATH is a lorascope run directory, one artifact file (allocator snapshot, Kineto trace,
flight-recorder dump, job log), or a folder of artifacts of one job (per-rank snapshots,
traces and dumps, and the log, in any mix). ``kind`` forces how PATH (or every file in
the folder) is read.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path

from lorascope.errors import BadInputError, UsageError
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.ingest.files import add_hta, load_file, load_files, load_single, walk_files
from lorascope.ingest.flight.reader import FlightDump, call_chain, read_flight_dump
from lorascope.ingest.kinds import KINDS
from lorascope.ingest.kineto.compare import compare_traces
from lorascope.ingest.snapshot.compare import compare_ranks
from lorascope.ingest.snapshot.reader import read_snapshot
from lorascope.rundir.format.schema import MANIFEST_FILE
from lorascope.rundir.format.sources import describe, job_source
from lorascope.rundir.loading.cluster import Cluster
from lorascope.rundir.loading.reader import Progress, RankData, RunData, load_run
from lorascope.rundir.loading.records import SnapshotRecord


def load_bundle(
    path: Path,
    kind: str | None = None,
    hta: bool | None = False,
    progress: Progress | None = None,
    cluster: Cluster | None = None,
) -> EvidenceBundle:
    """Load PATH with everything the detectors can use.

    ``hta``: add HolisticTraceAnalysis figures to GPU traces (None: when installed).
    ``progress``: told how far the reading has come (rank streams, artifacts).
    ``cluster``: where a run directory's rank streams are read (None: this machine).
    """
    if kind is not None and kind not in KINDS:
        raise UsageError(f"unknown kind {kind!r} (one of {', '.join(KINDS)})")
    if not path.exists():
        raise BadInputError(f"{path}: no such file or directory")
    bundle = EvidenceBundle(path=path)
    is_run = path.is_dir() and (path / MANIFEST_FILE).is_file()
    if kind == "rundir" and not is_run:
        raise BadInputError(f"{path} is not a lorascope run directory (no {MANIFEST_FILE})")
    if is_run and kind in (None, "rundir"):
        _load_run(bundle, path, progress, cluster)
    elif path.is_dir():
        if not load_files(bundle, list(walk_files(path, bundle.warnings)), kind, progress):
            raise BadInputError(
                f"{path}: nothing lorascope knows in this folder (no manifest.json of a run "
                "directory, no allocator snapshot, Kineto trace, flight-recorder dump or job log)"
            )
    else:
        load_single(bundle, path, kind)
    _cross_rank(bundle, hta)
    return bundle


def _load_run(bundle: EvidenceBundle, path: Path, progress: Progress | None, cluster: Cluster | None) -> None:
    """The run directory, and the traces and dumps its ranks wrote next to their streams."""
    add_run(bundle, load_run(path, progress, cluster), progress)


def bundle_of_run(
    run: RunData, path: Path, flight: Mapping[int, list[tuple[float, FlightDump]]] | None = None
) -> EvidenceBundle:
    """The bundle `load_bundle` makes of a run directory, from the run already read (as
    `lorascope hang` has it): its ranks' traces, flight-recorder dumps and snapshots, and
    the cross-rank views. ``flight``: the ranks' flight-recorder dumps already read (those
    `hang`'s verdict went by), instead of every one the ranks wrote."""
    bundle = EvidenceBundle(path=path)
    add_run(bundle, run, None, flight)
    _cross_rank(bundle, False)
    return bundle


def add_run(
    bundle: EvidenceBundle,
    run: RunData,
    progress: Progress | None,
    flight: Mapping[int, list[tuple[float, FlightDump]]] | None = None,
) -> None:
    """A run already read, and the traces and dumps its ranks wrote next to their streams
    (``flight``: its flight-recorder dumps, read already)."""
    bundle.run = run
    bundle.warnings.extend(run.warnings)
    for done, rank in enumerate(run.ranks.values(), 1):
        if progress is not None and (rank.trace_files or rank.flight_dumps):
            progress("reading traces and dumps", done, len(run.ranks))
        for name in rank.trace_files:
            if rank.rank not in bundle.traces and Path(name).is_file():
                try:
                    load_file(bundle, Path(name), "kineto", forced=True, inside=Path(name).parent)
                except BadInputError as exc:
                    bundle.warnings.append(f"rank {rank.rank}: {exc}")
        timeline = rank_flight_timeline(rank, bundle.warnings) if flight is None else flight.get(rank.rank, [])
        if timeline:
            bundle.flight_timeline[rank.rank] = timeline
            first = timeline[0][1]
            bundle.flight_records[rank.rank] = first
            bundle.warnings.extend(f"{first.path}: {w}" for w in first.warnings)
        _load_rank_snapshot(bundle, rank)


def rank_flight_timeline(
    rank: RankData,
    warnings: list[str],
    since: float = -math.inf,
    read: Callable[[Path, int], FlightDump] | None = None,
) -> list[tuple[float, FlightDump]]:
    """Every flight-recorder dump the rank wrote next to its stream (those recorded at
    ``since`` or later), with the time of its record, oldest first; one that does not
    read is a warning. ``read``: how a dump file is read (default: read_flight_dump, in
    its folder)."""
    out = []
    for record in rank.flight_dumps:
        if float(record["t"]) < since:
            continue
        path = Path(record["path"])
        if not path.is_file():
            continue
        try:
            found = read(path, rank.rank) if read else read_flight_dump(path, rank.rank, inside=path.parent)
            out.append((float(record["t"]), found))
        except BadInputError as exc:
            warnings.append(f"rank {rank.rank}: {exc}")
    return out


def rank_snapshot(rank: RankData) -> SnapshotRecord | None:
    """The allocator snapshot that stands for a rank: the one taken at its OOM, else its
    latest (a rank writes one per OOM, hang request or stall)."""
    if not rank.snapshots:
        return None
    return next((s for s in rank.snapshots if s["reason"] == "oom"), rank.snapshots[-1])


def _load_rank_snapshot(bundle: EvidenceBundle, rank: RankData) -> None:
    """The rank's own snapshot, analysed as that rank's (read with the safe unpickler)."""
    chosen = rank_snapshot(rank)
    history = rank.memory_history
    used_cuda = any(isinstance(m.get("cuda"), dict) for m in rank.mem)
    if used_cuda and history is not None and not history.get("on") and "switched off" not in str(history.get("reason")):
        bundle.warnings.append(f"rank {rank.rank}: no allocator history on this CUDA rank: {history.get('reason')}")
    if chosen is None or rank.rank in bundle.snapshots:
        return
    try:
        snapshot = read_snapshot(Path(chosen["path"]), rank.rank, inside=Path(chosen["path"]).parent)
    except BadInputError as exc:
        bundle.warnings.append(f"rank {rank.rank}: {exc}")
        return
    bundle.snapshots[rank.rank] = snapshot
    bundle.warnings.extend(f"{snapshot.path}: {w}" for w in snapshot.warnings)
    if "history" in chosen and chosen["history"] is None:
        bundle.warnings.append(
            f"rank {rank.rank}: its {chosen['reason']} snapshot was taken with allocator history off "
            f"(--memory-history {history.get('mode', 'auto') if history else 'auto'}): blocks allocated while it was off show "
            "no stacks; --memory-history always records every allocation"
        )
    if len(rank.snapshots) > 1:
        bundle.warnings.append(
            f"rank {rank.rank}: {len(rank.snapshots)} allocator snapshots; analysed the "
            f"{chosen['reason']} one ({Path(chosen['path']).name})"
        )


def _cross_rank(bundle: EvidenceBundle, hta: bool | None) -> None:
    if bundle.traces and hta is not False:
        add_hta(bundle.traces)
    bundle.snapshot_comparison = compare_ranks(bundle.snapshots)
    bundle.trace_comparison = compare_traces(bundle.traces)
    if bundle.flight_records:
        _add_sources(bundle)


def _add_sources(bundle: EvidenceBundle) -> None:
    """The source line and enclosing conditions of every call site in the flight-recorder
    dumps and of the frames above it up to the job's own code, where the files are readable
    here and under the job's roots (the dumps carry only file:line, and may name any file)."""
    sites = {f for dump in bundle.flight_records.values() for e in dump.entries for f in call_chain(e.frames)}
    roots = source_roots(bundle.run)
    for site in sorted(s for s in sites if s)[:MAX_SOURCE_SITES]:
        path, _, rest = site.partition(":")
        line = rest.split(" ", 1)[0]
        if line.isdigit() and len(line) < 10:
            lines = job_source(path, roots)
            if lines is not None:
                bundle.sources[site] = describe(path, int(line), lines)


#: Call sites whose source is read, at most (a dump may name any number of files).
MAX_SOURCE_SITES = 4096


def source_roots(run: RunData | None) -> tuple[str, ...]:
    """Where the job's own source files are: the working directory each launch recorded
    and the folder of each rank's script; for dumps given without a run directory, the
    current directory (run lorascope from the job's checkout)."""
    if run is None:
        return (os.getcwd(),)
    cwds = [c for launch in run.manifest["launches"] if isinstance(c := launch.get("cwd"), str) and os.path.isabs(c)]
    roots = set(cwds)
    for rank in run.ranks.values():
        argv = rank.start.get("argv")
        script = argv[0] if isinstance(argv, list) and argv and isinstance(argv[0], str) else ""
        if script.endswith(".py"):
            bases = [""] if os.path.isabs(script) else cwds
            roots.update(os.path.dirname(os.path.join(base, script)) for base in bases)
    return tuple(sorted(roots))
