"""`lorascope hang`'s verdict, once the ranks were asked (:mod:`lorascope.hang.ask`):
wait for their dumps, read each rank as it answers, diagnose, print, write the page.
Imported after the request is out: the reader and the diagnosis load (~0.3 s) while the
ranks answer."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from lorascope.detect.common import MIN_ALIKE_RANKS
from lorascope.detect.hang.diagnosis import NOT_HUNG, FlightTimeline, diagnose, flight_since
from lorascope.detect.hung_ranks import hang_finding
from lorascope.errors import BadInputError, LorascopeError
from lorascope.hang.alike import told_flights, told_note
from lorascope.hang.ask import Request
from lorascope.hang.collect import read_silent_ranks, silent_notes, wait_for_dumps
from lorascope.hang.flights import EarlyFlights
from lorascope.hang.pids import diagnose_pids
from lorascope.hang.procstate import STOPPED, describe_state
from lorascope.hang.targets import Target
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


def tell(
    run_dir: Path, request: Request, wait_s: float, as_json: bool, out: Path | None, cluster: str | None, read_all: bool
) -> None:
    """The verdict on the ranks asked by ``request``: read each as it answers (ranks whose
    answers agree a few at a time, unless ``read_all``), diagnose, print (and write the
    HTML report to ``out``)."""
    with no_cycle_collection():  # the ranks' records hold no cycles: a collection would walk them all
        _tell(run_dir, request, wait_s, as_json, out, cluster, read_all)


def _tell(
    run_dir: Path, request: Request, wait_s: float, as_json: bool, out: Path | None, cluster: str | None, read_all: bool
) -> None:
    targets, ends, asked, notes = request.targets, request.ends, request.asked, list(request.notes)
    waited = [t for t in request.waited if t.alive]  # a local one gone since
    with EarlyFlights() as flights:  # its workers (reading large dumps) end with it
        with connect(cluster) as on:
            run, silent = wait_for_dumps(
                run_dir,
                {(t.host, t.pid): ends[(t.host, t.pid)] for t in waited},
                asked,
                wait_s,
                on,
                flights.ahead,
                None if read_all else {(str(s["host"]), int(s["pid"])): cast(StartRecord, s) for s in request.starts},
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


def of_pids(pids: list[int], as_json: bool) -> None:
    """`lorascope hang --pid ...`: the processes' stacks read with py-spy, diagnosed."""
    diagnosis = diagnose_pids(pids)
    echo(_as_json({**diagnosis, "notes": []}) if as_json else render_hang(diagnosis, []))
