"""`lorascope hang RUN_DIR` (or `--pid PID...`): while a job hangs, where each rank is
and why, in seconds."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import click

from lorascope.cli.options import cluster_option
from lorascope.detect.common import MIN_ALIKE_RANKS
from lorascope.detect.hang.diagnosis import NOT_HUNG, FlightTimeline, diagnose, flight_since
from lorascope.detect.hung_ranks import hang_finding
from lorascope.errors import BadInputError, LorascopeError, UsageError
from lorascope.hang.alike import READ_ALIKE, told_flights, told_note
from lorascope.hang.collect import (
    expected,
    read_silent_ranks,
    request_dumps,
    silent_notes,
    stream_ends,
    wait_for_dumps,
)
from lorascope.hang.flights import EarlyFlights
from lorascope.hang.pids import diagnose_pids
from lorascope.hang.procstate import STOPPED, describe_state
from lorascope.hang.targets import Target, verify
from lorascope.rundir.loading.attachments import attached_processes
from lorascope.rundir.loading.cluster import connect
from lorascope.rundir.loading.ending import ending_of
from lorascope.rundir.loading.reader import RECENT_RECORDS, RunData, load_run, no_cycle_collection
from lorascope.rundir.loading.records import StartRecord
from lorascope.text import echo
from lorascope.text.findings import quiet
from lorascope.text.hang import Place, render_hang
from lorascope.units import rank_ranges


def _target_notes(targets: list[Target]) -> list[str]:
    """Why ranks were not signalled: a note per rank, or per reason from MIN_ALIKE_RANKS
    ranks on (1,024 "process gone" lines would push the verdict off the screen)."""
    by_why: dict[str, list[Target]] = {}
    for t in targets:
        if not t.ours and (t.local or not t.alive):  # another host's: asked through the run directory
            by_why.setdefault(t.why, []).append(t)
    notes = []
    for why, alike in by_why.items():
        if len(alike) < MIN_ALIKE_RANKS:
            notes += [f"rank {t.rank} (pid {t.pid}): {why}" for t in alike]
        else:
            notes.append(f"ranks {rank_ranges(t.rank for t in alike)} ({len(alike):,} ranks): {why}")
    return notes


def _gone(run: RunData, targets: list[Target]) -> tuple[bool, bool]:
    """(whether no process of the job is alive: every rank ended, its record says how, or
    its process on this host is gone; whether its records alone tell every ending). A
    rank on another host without an ending may still run: the job is not over."""
    gone = {(t.host, t.pid) for t in targets if t.local and not t.alive}
    known = [ending_of(r).known for r in run.ranks.values()]
    over = bool(run.ranks) and all(k or (r.host, r.pid) in gone for k, r in zip(known, run.ranks.values(), strict=True))
    return over, all(known)


def _as_over(run: RunData, run_dir: Path, diagnosis: dict[str, Any], recorded: bool) -> dict[str, Any]:
    """A job that is over, not a live verdict ("the others wait for it") about processes
    gone: when its records tell how every rank ended, in `lorascope analyze`'s words (its
    top finding, or its headline); else (a rank gone without a word, which only this host's
    /proc tells) the diagnosis, in the past."""
    over = "the job is over (no process of it is alive)"
    if not recorded:
        verdict = str(diagnosis["verdict"]).replace(
            "; the others wait for it or failed after it", "; the others failed after it"
        )
        return {**diagnosis, "kind": "over", "verdict": f"{over}: {verdict}"}
    from lorascope.analysis import of_run  # only for a job over: the live verdict needs no detector

    analysis = of_run(run, run_dir)
    findings = analysis.findings
    if findings:
        top = findings[0]
        more = f" (and {len(findings) - 1} more: `lorascope analyze`)" if len(findings) > 1 else ""
        said, fix, odd, finding_id = f"{top.id}: {top.title}{more}", top.fix, list(top.ranks), top.id
    else:
        said, fix, odd, finding_id = quiet(analysis.to_data()), OVER_FIX, [], "none"
    return {
        **diagnosis,
        "id": finding_id,
        "kind": "over",
        "verdict": f"{over}; its run directory, as `lorascope analyze` reads it: {said}",
        "fix": fix,
        "odd_ranks": odd,
        "first_diverged": None,
    }


#: The fix of a job that is over, with no finding.
OVER_FIX = "Nothing is live to diagnose: `lorascope analyze RUN_DIR` and `lorascope report RUN_DIR` read what it left."


def _places(run: RunData) -> dict[int, Place]:
    """Each rank's host and local rank (its start record's), on a job that spans hosts
    (on one, they add nothing)."""
    if len({r.host for r in run.ranks.values()}) < 2:
        return {}
    out: dict[int, Place] = {}
    for n, r in run.ranks.items():
        local = r.start.get("local_rank")
        out[n] = (r.host, local if isinstance(local, int) and not isinstance(local, bool) else None)
    return out


def _write_html(run: RunData, run_dir: Path, diagnosis: dict[str, Any], out: Path, flight: FlightTimeline) -> str:
    """The hang's HTML report, best effort: the verdict is out already, and the light
    install (no jinja2) or an unwritable place must not take it back. A live hang's
    flight-recorder evidence is what the verdict went by (at 1,024 ranks every dump read
    again whole would take minutes). Ranks told by alike ranks' records are read whole
    for it: a page shows each rank's own memory and steps."""
    from lorascope.analysis import of_run

    try:
        from lorascope.report.write import write_report
    except ImportError as exc:
        return f"no HTML report: {exc} (pip install 'lorascope[analysis]')"
    told = {n for n, r in run.ranks.items() if r.told_by is not None}
    if told:
        try:
            run = _read_told(run, run_dir)
        except BadInputError as exc:
            return f"no HTML report: {exc}"
        flight = {n: f for n, f in flight.items() if n not in told}  # the copies the verdict went by
    live = diagnosis["kind"] not in (*NOT_HUNG, "over")  # else the page says what `analyze` says
    analysis = of_run(run, run_dir, flight if live else None)
    if live:
        others = [f for f in analysis.findings if f.id != "hung-ranks"]
        analysis.findings = [hang_finding(run, diagnosis), *others]
    try:
        write_report(analysis, out, fresh=out.parent == run_dir)
    except LorascopeError as exc:
        return f"no HTML report: {exc}"
    return f"report: {out}"


def _read_told(run: RunData, run_dir: Path) -> RunData:
    """The run read again, every rank whole (its recent past), with the stacks read from
    outside (py-spy) of the ranks that did not answer."""
    again = load_run(run_dir, newest=RECENT_RECORDS)
    for n, rank in again.ranks.items():
        was = run.ranks.get(n)
        if was is not None and was.told_by is None and (was.host, was.pid) == (rank.host, rank.pid):
            rank.dumps = was.dumps
    return again


def _as_json(data: dict[str, Any]) -> str:
    """``--json``'s text (the analysis package imported only then: the verdict needs none of it)."""
    from lorascope.analysis import strict_json

    return strict_json.dumps(data, indent=2, sort_keys=True, default=str)


def _hang_run(
    run_dir: Path, wait_s: float, as_json: bool, out: Path | None, cluster: str | None, read_all: bool
) -> None:
    """`lorascope hang RUN_DIR`: ask every rank for a dump, read each as it answers (ranks
    whose answers agree a few at a time, unless ``read_all``), diagnose, print (and write
    the HTML report to ``out``)."""
    # The processes to ask, from each stream's first record (each is read once, when it
    # answered: on a large run a read of the whole run after the dumps took seconds).
    starts = attached_processes(run_dir)
    targets = [verify(start, run_dir) for start in starts]
    waited = expected(targets, run_dir)
    ends = stream_ends(run_dir, waited)
    asked, notes = request_dumps(run_dir, targets, waited)
    waited = [t for t in waited if t.alive]  # a local one gone since
    with EarlyFlights() as flights:  # its workers (reading large dumps) end with it
        with connect(cluster) as on:
            run, silent = wait_for_dumps(
                run_dir,
                {(t.host, t.pid): ends[(t.host, t.pid)] for t in waited},
                asked,
                wait_s,
                on,
                flights.ahead,
                None if read_all else {(str(s["host"]), int(s["pid"])): cast(StartRecord, s) for s in starts},
            )
        analysed = {(r.host, r.pid): n for n, r in run.ranks.items()}  # the process analysed per rank
        by_process = {(t.host, t.pid): t for t in targets if (t.host, t.pid) in analysed}
        mine = sorted((replace(t, rank=analysed[key]) for key, t in by_process.items()), key=lambda t: t.rank)
        notes += _target_notes(mine)
        quiet_ranks, states = read_silent_ranks(run, silent, asked, wait_s)
        notes += silent_notes(quiet_ranks, wait_s)
        flight = flights.covering(
            {
                n: found
                for n, r in run.ranks.items()
                if (since := flight_since(r, run)) is not None and (found := flights.timeline(r, notes, since))
            }
        )
        flight = told_flights(run, flight)
        notes += told_note(run)
    stopped = {n: describe_state(state) or state for n, state in states.items() if state in STOPPED}
    diagnosis = diagnose(run, {t.rank: t.alive for t in mine}, flight, stopped=stopped)
    over, recorded = _gone(run, mine)
    if over and recorded:  # told, and its page made, in `lorascope analyze`'s words: of all it left
        try:
            run = load_run(run_dir)
        except BadInputError as exc:  # a limit a recent read is under: told from what was read
            notes.append(f"the run could not be read whole ({exc}): the job is told from its ranks' recent past")
            recorded = False
    if diagnosis["kind"] not in NOT_HUNG and over:  # not a live verdict on a job gone
        diagnosis = _as_over(run, run_dir, diagnosis, recorded)
    diagnosis["silent"] = quiet_ranks
    if as_json:
        if out is not None:
            notes.append(_write_html(run, run_dir, diagnosis, out, flight))
        echo(_as_json({**diagnosis, "notes": notes}))
    else:
        echo(render_hang(diagnosis, notes, _places(run)))  # the verdict first: the page can take seconds
        if out is not None:
            echo(f"note: {_write_html(run, run_dir, diagnosis, out, flight)}")


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
    help="Seconds to wait for the ranks' dumps (every host's, through the run directory) before falling back to py-spy.",
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
@click.option(
    "--read-all",
    is_flag=True,
    help=f"Read every rank's records (by default, of ranks whose answers agree, {READ_ALIKE} are read"
    " and their records tell the others).",
)
@cluster_option
def command(
    run_dir: Path | None,
    pids: tuple[int, ...],
    wait_s: float,
    as_json: bool,
    html: Path | None,
    no_html: bool,
    read_all: bool,
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
        echo(_as_json({**diagnosis, "notes": []}) if as_json else render_hang(diagnosis, []))
        return 0
    assert run_dir is not None
    with no_cycle_collection():  # the ranks' records hold no cycles: a collection would walk them all
        _hang_run(
            run_dir,
            wait_s,
            as_json,
            None if no_html else html or run_dir / time.strftime("hang-%Y%m%d-%H%M%S.html"),
            cluster,
            read_all,
        )
    return 0
