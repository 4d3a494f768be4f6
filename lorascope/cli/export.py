"""`lorascope export`: lorascope's evidence in the tools users already use.

``--perfetto OUT.json.gz``: the whole job as one timeline for Perfetto (ui.perfetto.dev,
opened locally) and chrome://tracing. ``--snapshot RANK -o OUT.pickle``: that rank's
allocator snapshot as the pickle ``torch.cuda.memory._dump_snapshot`` writes, which
pytorch.org/memory_viz and ``python -m torch.cuda._memory_viz`` open."""

from __future__ import annotations

import gzip
from pathlib import Path

import click

from lorascope.analysis import analyze, strict_json
from lorascope.cli.options import cluster_option
from lorascope.errors import BadInputError, UsageError
from lorascope.export.perfetto import MAX_EVENTS, Window, step_window, timeline
from lorascope.rundir.format.safe_pickle import load_pickle
from lorascope.rundir.loading.cluster import connect
from lorascope.rundir.loading.reader import records_between
from lorascope.text import echo
from lorascope.text.progress import terminal_progress


def _steps(text: str) -> tuple[int, int]:
    first, sep, last = text.partition(":")
    try:
        return int(first), int(last if sep else first)
    except ValueError:
        raise UsageError(f"--steps {text!r}: write a step or a range, e.g. 10:20") from None


@click.command("export")
@click.argument("path", type=click.Path(path_type=Path))
@click.option(
    "--perfetto",
    "out",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Write the timeline here (Chrome trace-event JSON; gzipped when the name ends in .gz).",
)
@click.option("--snapshot", "snapshot_rank", type=int, default=None, help="Export this rank's allocator snapshot.")
@click.option(
    "-o",
    "--out",
    "snapshot_out",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Where --snapshot writes (default: snapshot-rank-RANK.pickle).",
)
@click.option("--steps", "steps", default=None, help="Only steps A:B (or one step A) of the first rank.")
@click.option("--from", "t_from", type=float, default=None, help="Only from this many seconds after the run began.")
@click.option("--to", "t_to", type=float, default=None, help="Only up to this many seconds after the run began.")
@click.option("--max-events", type=int, default=MAX_EVENTS, show_default=True, help="Write at most this many events.")
@cluster_option
def command(
    path: Path,
    out: Path | None,
    snapshot_rank: int | None,
    snapshot_out: Path | None,
    steps: str | None,
    t_from: float | None,
    t_to: float | None,
    max_events: int,
    cluster: str | None,
) -> int:
    """Export a run: as one timeline (--perfetto: a process per rank with steps, phases
    and collectives, flow arrows joining a collective across ranks, memory counters, the
    findings as instants and the kernel-trace window), or a rank's allocator snapshot
    (--snapshot) for memory_viz."""
    if (out is None) == (snapshot_rank is None):
        raise UsageError("give --perfetto OUT or --snapshot RANK (one of them)")
    if snapshot_rank is not None:
        return _snapshot(path, snapshot_rank, snapshot_out or Path(f"snapshot-rank-{snapshot_rank}.pickle"), cluster)
    assert out is not None
    if max_events < 1:
        raise UsageError("--max-events must be at least 1")
    with connect(cluster) as on, terminal_progress(True) as progress:
        analysis = analyze(path, progress=progress, cluster=on)
        run = analysis.bundle.run
        if run is None:
            raise BadInputError(f"{path}: not a lorascope run directory (export reads run directories)")
        window = Window()
        if steps is not None:
            window = step_window(run, *_steps(steps))
        elif t_from is not None or t_to is not None:
            origin = min((float(r.start["t"]) for r in run.ranks.values()), default=0.0)
            window = Window(None if t_from is None else origin + t_from, None if t_to is None else origin + t_to)
        spans = None
        if any(r.stride > 1 or r.collectives_total > len(r.collectives) for r in run.ranks.values()):
            # the loaded run keeps each group's first and newest calls (and every stride-th
            # step of a long run): the window is read again whole
            most = max(1, max_events // len(run.ranks))
            spans = records_between(run, window.start, window.end, most, progress, on)
            if steps is not None:  # the range's own steps, now that every step of it is read
                window = step_window(run, *_steps(steps), spans)
    doc = timeline(analysis, window, max_events, spans)
    data = strict_json.dumps(doc, separators=(",", ":"), default=str).encode()
    try:
        out.write_bytes(gzip.compress(data, 6) if out.name.endswith(".gz") else data)
    except OSError as exc:
        raise BadInputError(f"cannot write {out}: {exc.strerror}") from None
    note = doc["metadata"].get("truncated")
    echo(f"lorascope: {len(doc['traceEvents']):,} events written to {out}" + (f" ({note})" if note else ""), err=True)
    return 0


def _snapshot(path: Path, rank: int, out: Path, cluster: str | None) -> int:
    """Copy the rank's snapshot file (the one the analysis used: the OOM one, else the
    latest) byte for byte, after the safe reader has read it: it is already the standard
    pickle; nothing is unpickled with pickle.load."""
    with connect(cluster) as on, terminal_progress(True) as progress:
        bundle = analyze(path, progress=progress, cluster=on).bundle
    snapshot = bundle.snapshots.get(rank)
    if snapshot is None:
        have = ", ".join(map(str, sorted(bundle.snapshots))) or "none"
        raise BadInputError(f"{path}: no allocator snapshot of rank {rank} (ranks with one: {have})")
    inside = bundle.run.path if bundle.run is not None else None
    try:
        with open(out, "wb") as dst:
            try:  # read again, checked as it is copied: the copy is the bytes checked
                load_pickle(Path(snapshot.path), copy_to=dst, inside=inside)
            except BadInputError:
                dst.close()
                out.unlink()
                raise
    except OSError as exc:
        raise BadInputError(f"cannot write {out}: {exc.strerror}") from None
    echo(f"lorascope: rank {rank}'s allocator snapshot ({snapshot.path}) written to {out}", err=True)
    return 0
