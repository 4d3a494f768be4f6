"""`lorascope hang RUN_DIR` (or `--pid PID...`): while a job hangs, where each rank is
and why, in seconds."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from lorascope.analysis import of_run, strict_json
from lorascope.cli.options import cluster_option
from lorascope.detect.common import MIN_ALIKE_RANKS, but_for_numbers
from lorascope.detect.hang.diagnosis import NOT_HUNG, diagnose
from lorascope.detect.hung_ranks import hang_finding
from lorascope.errors import LorascopeError, UsageError
from lorascope.hang.collect import read_silent_ranks, request_dumps, stream_ends, wait_for_dumps
from lorascope.hang.pids import diagnose_pids
from lorascope.hang.targets import Target, verify
from lorascope.ingest.load import rank_flight_timeline
from lorascope.rundir.attachments import attached_processes
from lorascope.rundir.cluster import connect
from lorascope.rundir.reader import RunData
from lorascope.text import echo
from lorascope.units import rank_ranges, ranks_named


def _alike(groups: list[dict[str, Any]]) -> list[tuple[str, list[Any], bool]]:
    """The diagnosis's groups (ranks by where they are), those whose places read alike but
    for their numbers (a peer's address and port in each rank's error) as one from
    MIN_ALIKE_RANKS ranks on: (the first place, the ranks, whether merged)."""
    merged: dict[str, list[dict[str, Any]]] = {}
    for group in groups:
        merged.setdefault(but_for_numbers(str(group["where"])), []).append(group)
    out: list[tuple[str, list[Any], bool]] = []
    for same in merged.values():
        ranks = [r for g in same for r in g["ranks"]]
        if len(same) > 1 and len(ranks) >= MIN_ALIKE_RANKS:
            out.append((same[0]["where"], ranks, True))
        else:
            out += [(g["where"], g["ranks"], False) for g in same]
    return out


def _target_notes(targets: list[Target]) -> list[str]:
    """Why ranks were not signalled: a note per rank, or per reason from MIN_ALIKE_RANKS
    ranks on (1,024 "process gone" lines would push the verdict off the screen)."""
    by_why: dict[str, list[Target]] = {}
    for t in targets:
        if not t.ours:
            by_why.setdefault(t.why, []).append(t)
    notes = []
    for why, alike in by_why.items():
        if len(alike) < MIN_ALIKE_RANKS:
            notes += [f"rank {t.rank} (pid {t.pid}): {why}" for t in alike]
        else:
            notes.append(f"ranks {rank_ranges(t.rank for t in alike)} ({len(alike):,} ranks): {why}")
    return notes


def _render(diagnosis: dict[str, Any], notes: list[str]) -> str:
    lines = []
    for where, ranks, merged in _alike(diagnosis["groups"]):
        # rank numbers, or "rank N" / "pid N" labels in --pid mode
        if all(isinstance(r, int) for r in ranks):
            who = ranks_named(ranks)
        else:
            who = ", ".join(map(str, ranks))
        if merged:
            first = f"rank {ranks[0]}" if isinstance(ranks[0], int) else str(ranks[0])
            where = f"{where} ({len(ranks):,} ranks alike but for their numbers; {first}'s shown)"
        # "died: ...", "in its own code at ...", or the collective it waits in
        verb = "" if where.startswith(("died", "exited")) else ("is " if len(ranks) == 1 else "are ")
        if verb and not where.startswith("in "):
            verb += "in "
        if len(ranks) > 1:
            where = where.replace("in its own code", "in their own code", 1)
        lines.append(f"{who:<10} {verb}{where}")
    lines.append(f"verdict: {diagnosis['verdict']}")
    lines.append(f"fix: {diagnosis['fix']}")
    lines.extend(f"note: {n}" for n in notes)
    return "\n".join(lines)


def _write_html(run: RunData, run_dir: Path, diagnosis: dict[str, Any], out: Path) -> str:
    """The hang's HTML report, best effort: the verdict is out already, and the light
    install (no jinja2) or an unwritable place must not take it back."""
    try:
        from lorascope.report.write import write_report
    except ImportError as exc:
        return f"no HTML report: {exc} (pip install 'lorascope[analysis]')"
    analysis = of_run(run, run_dir)
    if diagnosis["kind"] not in NOT_HUNG:  # else the page says what `analyze` says
        others = [f for f in analysis.findings if f.id != "hung-ranks"]
        analysis.findings = [hang_finding(run, diagnosis), *others]
    try:
        write_report(analysis, out, fresh=out.parent == run_dir)
    except LorascopeError as exc:
        return f"no HTML report: {exc}"
    return f"report: {out}"


@click.command("hang")
@click.argument("run_dir", type=click.Path(path_type=Path), required=False)
@click.option(
    "--pid",
    "pids",
    type=int,
    multiple=True,
    help="Diagnose these processes (a job not started under `lorascope run`), with py-spy.",
)
@click.option(
    "--wait",
    "wait_s",
    type=float,
    default=3.0,
    show_default=True,
    help="Seconds to wait for the ranks' dumps before falling back to py-spy.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the diagnosis as JSON.")
@click.option(
    "--html",
    "html",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Where to write the HTML report (default: RUN_DIR/hang-<time>.html).",
)
@click.option("--no-html", is_flag=True, help="Write no HTML report.")
@cluster_option
def command(
    run_dir: Path | None,
    pids: tuple[int, ...],
    wait_s: float,
    as_json: bool,
    html: Path | None,
    no_html: bool,
    cluster: str | None,
) -> int:
    """Diagnose a hung job now: dump every rank's stacks and pending collectives (the job
    keeps running), then say which rank diverged where, and the fix."""
    if run_dir is None and not pids:
        raise UsageError("give a run directory, or the job's processes with --pid (once each: --pid 101 --pid 102)")
    if run_dir is not None and pids:
        if str(run_dir).isdigit() and not run_dir.exists():  # `--pid 101 102`: 102 read as the run directory
            more = " ".join(f"--pid {p}" for p in (*pids, int(str(run_dir))))
            raise UsageError(f"{run_dir} is not a run directory: --pid takes one process each ({more})")
        raise UsageError("give a run directory or --pid, not both")
    if pids:
        diagnosis = diagnose_pids(list(pids))
        echo(
            strict_json.dumps({**diagnosis, "notes": []}, indent=2, sort_keys=True)
            if as_json
            else _render(diagnosis, [])
        )
        return 0
    assert run_dir is not None
    # The processes to signal, from each stream's first record (the whole run is read once,
    # after the dumps: on a large run a read takes minutes).
    targets = [verify(start, run_dir) for start in attached_processes(run_dir)]
    ends = stream_ends(run_dir, [t for t in targets if t.ours and t.alive])
    asked = request_dumps(targets)
    with connect(cluster) as on:
        run, silent = wait_for_dumps(
            run_dir, {(t.host, t.pid): ends[(t.host, t.pid)] for t in targets if t.ours and t.alive}, asked, wait_s, on
        )
    analysed = {(r.host, r.pid): n for n, r in run.ranks.items()}  # the process analysed per rank
    by_process = {(t.host, t.pid): t for t in targets if (t.host, t.pid) in analysed}
    mine = sorted((replace(t, rank=analysed[key]) for key, t in by_process.items()), key=lambda t: t.rank)
    notes = _target_notes(mine)
    notes += read_silent_ranks(run, silent, wait_s)
    flight = {n: found for n, r in run.ranks.items() if (found := rank_flight_timeline(r, notes))}
    diagnosis = diagnose(run, {t.rank: t.alive for t in mine}, flight)
    out = None if no_html else html or run_dir / time.strftime("hang-%Y%m%d-%H%M%S.html")
    if as_json:
        if out is not None:
            notes.append(_write_html(run, run_dir, diagnosis, out))
        echo(strict_json.dumps({**diagnosis, "notes": notes}, indent=2, sort_keys=True, default=str))
    else:
        echo(_render(diagnosis, notes))  # the verdict first: the page can take seconds
        if out is not None:
            echo(f"note: {_write_html(run, run_dir, diagnosis, out)}")
    return 0
