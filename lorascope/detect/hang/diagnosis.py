"""Why a job is hung, from what its ranks recorded: where each rank is, the last
completed and the pending collective per process group, the first rank that diverged
and the kind of hang, with the fix. Pure: works on loaded data (live dumps from
`lorascope hang`, or the stall watchdog's dumps in a dead run's directory)."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping
from typing import Any

from lorascope.detect.hang import branches, rank_only_calls
from lorascope.detect.hang.conditions import call_condition, chain_condition, odd_by_condition, rank_condition
from lorascope.detect.hang.divergence import Divergence, first_divergence, minority, odd_ranks, size_mismatch
from lorascope.detect.hang.flight_align import Ahead, Disagreement, FlightAlignment, ahead_of_peers, align, waiting_in
from lorascope.detect.hang.waits import Wait, complete, crossed, fewest, waits
from lorascope.detect.hang.zero_state import FIX as ZERO_FIX
from lorascope.detect.hang.zero_state import calls_summary, explained_by
from lorascope.ingest.flight.reader import FlightDump, call_chain, call_site, is_job_code
from lorascope.ingest.frames import LORASCOPE_FILE, TORCH_FILE
from lorascope.rundir.format.ops import P2P_OPS
from lorascope.rundir.loading.ending import (
    call_entry,
    dumps_of,
    ending_of,
    moving_at,
    moving_when_stopped,
    stepped_after,
    stopped_at,
)
from lorascope.rundir.loading.reader import RankData, RunData
from lorascope.units import group_named, ranks_named, short_error

#: Stack frames in these places are not where the job "is".
_LIBRARY = re.compile(
    f"^<frozen |{TORCH_FILE}|{LORASCOPE_FILE}"
    r"|/(deepspeed|threading\.py|concurrent|multiprocessing|site-packages|dist-packages|lib/python3\.\d+)/"
)
#: A frame in a thread dump (traceback's "line N, in f") or faulthandler's ("line N in f").
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+),? in (?P<func>\S+)')
#: A rank whose last record is this much older than the newest rank's is not moving.
MOVING_WITHIN_S = 2.0
#: A dump's flight-recorder dump is written right after it (this long at most), and is
#: taken as going with a dump recorded this little after it (a rank's threads write their
#: records in their own order).
FLIGHT_LATE_S = 10.0
FLIGHT_EARLY_S = 0.5
#: The reason of a rank's records read as a dump (no dump taken at that moment).
RECORDS_THEN = "records then"
#: Every flight-recorder dump of each rank, with the time of its record, oldest first
#: (``EvidenceBundle.flight_timeline``; `lorascope hang` reads it the same way).
FlightTimeline = Mapping[int, list[tuple[float, FlightDump]]]

FIXES = {
    "rank-conditional-hang": (
        "Run the collective on every rank and act on the result on rank 0 only: move the "
        "all_reduce / gather / GatheredParameters out of the `if rank == 0:` block (compute on "
        "all ranks, then `if rank == 0: log(...)`)."
    ),
    "dead-rank": (
        "A rank is gone and the others wait for it: find why it died (its exception or "
        "signal below; no record at all means SIGKILL, usually the OOM killer: check dmesg)."
    ),
    "stuck-outside": (
        "The odd rank is not in any collective: it is stuck in its own code (data "
        "loading, I/O, a deadlock). Look at its stack; give the data loader a timeout "
        "and workers; check the filesystem."
    ),
    "straggler": (
        "One rank is still moving but slower: look for uneven data (sequence lengths), "
        "thermal or CPU contention, or a slow node."
    ),
    "collective-stuck": (
        "Every rank of the collective's group is in it and it does not complete: the transport is stuck "
        "(network, NCCL). Set NCCL_DEBUG=INFO, check the interconnect, and "
        "TORCH_NCCL_ASYNC_ERROR_HANDLING."
    ),
    "p2p-deadlock": (
        "Each rank waits in a blocking send (or recv) to a peer that waits in another call: pair each send "
        "with a recv of the same rank on its peer, in the same order on both sides; order an exchange so "
        "that one side receives first (even ranks send then receive, odd ranks receive then send), or post "
        "both sides without blocking and wait on them together: `for req in dist.batch_isend_irecv([P2POp("
        "dist.isend, t, peer), P2POp(dist.irecv, out, peer)]): req.wait()`. Small messages can slip through a "
        "transport's buffers, so the same code may pass with smaller tensors."
    ),
    "p2p-stuck": (
        "Each send waits in its peer's receive and the transfer does not complete: check that both name the "
        "same tag (a receive takes only a send of its tag) and a tensor of the same size; else the transport "
        "is stuck (NCCL_DEBUG=INFO, the interconnect)."
    ),
    "crossed-collectives": (
        "The ranks issue collectives of different process groups in different orders, and each waits for "
        "ranks that wait in another (a deadlock): issue them in one order on every rank (look for rank- or "
        "stage-dependent code around these calls)."
    ),
    "stopped-process": (
        "A rank's process is stopped (state T: SIGSTOP, Ctrl-Z, a debugger) and the others wait for it: "
        "resume it (kill -CONT PID) or end the job, and find out who stopped it."
    ),
    "unknown": "No rank shows a reason; take py-spy dumps of every rank and compare.",
    "moving": (
        "Nothing is stuck yet: every rank had finished a step shortly before its dump. If the "
        "job stops making steps, run `lorascope hang` again; if it is slow, `lorascope analyze` "
        "names a straggler."
    ),
    "finished": "Nothing is stuck: the job finished. If it hung before, its run directory shows where (`lorascope analyze`).",
    "stopped": (
        "Nothing was stuck when the job was stopped (Ctrl-C, SIGTERM): the ranks were making steps, "
        "or waiting for one that was (a save, an evaluation). If it was slow, `lorascope analyze` "
        "names a straggler."
    ),
}

#: The fix of a send or receive that only some ranks make.
P2P_FIX = (
    "A point-to-point send or receive on some ranks only waits for its peer forever: post the matching recv "
    "(or send) on the peer, under the matching condition, or make it a collective every rank runs."
)


#: The kinds of a diagnosis that finds no hang.
NOT_HUNG = ("moving", "stopped", "finished")


def verdict_id(kind: str) -> str:
    """The finding id a diagnosis of this kind is reported under, in every output (analyze,
    hang, the report, JSON): rank-conditional-hang, or hung-ranks for every other kind."""
    return "rank-conditional-hang" if kind == "rank-conditional-hang" else "hung-ranks"


def main_thread_frames(stacks: str) -> list[re.Match[str]]:
    """The main thread's Python frames, outermost first, from a thread dump as the probes
    write it (``Thread NAME:`` and traceback lines; ``lorascope.hang.collect`` writes
    py-spy's dumps the same way)."""
    block = stacks.split("Thread MainThread:", 1)
    text = block[1].split("\nThread ", 1)[0] if len(block) > 1 else stacks
    return list(_FRAME.finditer(text))


def own_main_frames(stacks: str) -> list[re.Match[str]]:
    """The main thread's frames that belong to the job (not a library), innermost first."""
    return [m for m in reversed(main_thread_frames(stacks)) if not _LIBRARY.search(m["file"])]


def main_thread_frame(stacks: str) -> str | None:
    """The innermost frame of the main thread that belongs to the job (not a library)."""
    frames = own_main_frames(stacks)
    return f"{frames[0]['file']}:{frames[0]['line']} in {frames[0]['func']}" if frames else None


def fatal_main_frame(fatal: str) -> str | None:
    """The innermost frame of the job's own code on the main thread of a faulthandler dump:
    the thread whose stack (most recent call first) ends at ``<module>`` (a script) or in
    runpy (``python -m``). None when no block does (faulthandler cuts a stack at 100
    frames) or the main thread holds no frame of the job's own."""
    for block in re.split(r"\n(?=(?:Current thread|Thread) 0x)", fatal):
        frames = list(_FRAME.finditer(block))
        if frames and (frames[-1]["func"] == "<module>" or frames[-1]["file"] == "<frozen runpy>"):
            own = [m for m in frames if not _LIBRARY.search(m["file"])]
            return f"{own[0]['file']}:{own[0]['line']} in {own[0]['func']}" if own else None
    return None


def _ended(rank: RankData, alive: bool | None, cutoff: float | None) -> str | None:
    """How the rank ended, if it did before ``cutoff`` (the moment the hang was dumped:
    the timeouts that kill every rank afterwards are consequences, not the cause), and not
    by a stop from outside (read as a dump taken then: ``dumps_of``)."""
    end = ending_of(rank)
    if end.t is not None and cutoff is not None and end.t > cutoff:
        return None
    if stopped_at(rank) is not None:
        return None
    if end.status == "detached":
        return "exited (detached: not observed since `lorascope attach --detach`)"
    if end.status == "exception":
        return f"died: {short_error((end.detail or 'an exception').splitlines()[0], 160)}"
    if end.teardown:  # its job had finished: it exited, and died on the way out
        return f"exited ({(end.detail or '').splitlines()[0][:160]})"
    if end.status == "signal":  # a fatal one's detail goes on with faulthandler's whole dump
        at = fatal_main_frame(rank.fatal) if rank.fatal else None
        how = (end.detail or "a signal").splitlines()[0][:160]
        return f"died: killed by {how}" + (f", main thread at {at}" if at else "")
    if end.known:
        return f"exited ({end.status} {end.code})"
    if alive is False:
        return "died: its process is gone without a word (SIGKILL or the OOM killer)"
    return None


def _death_time(rank: RankData) -> float:
    end = ending_of(rank)
    return end.t if end.t is not None else rank.last_time


def pending_calls(rank: RankData) -> list[dict[str, Any]]:
    """The collectives the rank's records show it waiting in (started, never ended)."""
    return [call_entry(c) for c in rank.collectives if c.pending]


def flight_pending(ahead: Ahead | None, frame: str | None) -> dict[str, Any] | None:
    """The collective a rank with no recorded call in flight waits in, from the flight
    recorder (a call the probes cannot see: DDP's C++ Reducer, its buffer broadcasts): its
    last, which a peer never enqueued, if it has not completed or the rank's stack is at
    the job's line that made it (gloo marks a call completed once it fails, as the peer's
    exit makes it). None otherwise."""
    if ahead is None:
        return None
    entry = ahead.entry
    chain = call_chain(entry.frames)
    line = chain[-1] if chain and is_job_code(chain[-1]) else None
    if entry.completed and (frame is None or frame != line):
        return None
    return {
        "group": ahead.group,
        "seq": entry.seq,
        "op": entry.op,
        "bytes": None,
        "site": chain[0] if chain else None,
        "source": f"flight recorder: {ahead.peers()}",
    }


def _rank_state(
    rank: RankData,
    run: RunData,
    alive: bool | None,
    newest: float,
    cutoff: float | None,
    ahead: Ahead | None,
    as_of: float | None,
    stopped: str | None = None,
    flight_waits: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    dumps = _dumps(rank, run, as_of)
    dump = dumps[-1] if dumps else None
    pending = dump["pending"] if dump else pending_calls(rank)
    last_done = {group: tally.last_done for group, tally in rank.tallies.items() if tally.last_done}
    ended = _ended(rank, alive, cutoff)
    frame = main_thread_frame(dump["stacks"]) if dump else None
    moving = newest - rank.last_time <= MOVING_WITHIN_S and not dump
    if ended is None and not pending and not moving:
        found = flight_pending(ahead, frame)
        pending = [found] if found is not None else pending
    if ended is not None:
        state = "dead" if ended.startswith("died") else "exited"
    elif stopped is not None:
        state, ended = "stopped", stopped
    elif pending:
        state = "in-collective"
    elif moving:
        state = "moving"
    else:
        state = "outside-collectives"
    where = ended
    if state == "in-collective":
        p = pending[0]
        site = p.get("site")
        cond = rank_condition(rank, site if isinstance(site, str) else None)
        called = (
            f"{p['op']} #{p['seq']} on {group_named(p['group'])}" if isinstance(p.get("seq"), int) else str(p["op"])
        )
        where = f"{called} at {p.get('site') or '?'}" + (f", under `{cond}`" if cond else "")
        if p.get("source"):
            where += f" ({p['source']})"
        elif (counted := (flight_waits or {}).get(str(p.get("group")))) is not None and counted != p.get("seq"):
            where += f" (#{counted} in the flight recorder, which counts the calls the probes do not see)"
    elif state in ("outside-collectives", "moving"):
        where = f"in its own code at {frame or '?'} (no collective in flight)"
    died = {"died_at": _death_time(rank)} if state == "dead" else {}
    return {
        "rank": rank.rank,
        "pid": rank.pid,
        "host": rank.host,
        **died,
        "state": state,
        "where": where,
        "step": rank.steps[-1]["step"] if rank.steps else 0,  # the last it ended (a recent read holds the last only)
        "pending": pending,
        "last_completed": last_done,
        "stack_frame": frame,
        "dumped": dump["reason"] if dump else None,
        **({"told_by": rank.told_by} if rank.told_by is not None else {}),
    }


def _dumps(rank: RankData, run: RunData, as_of: float | None) -> list[Mapping[str, Any]]:
    """The rank's dumps (:func:`dumps_of`); with ``as_of``, those taken by then (within
    MOVING_WITHIN_S), else its records read as a dump taken then (the calls in flight; no
    stack)."""
    if as_of is None:
        return dumps_of(rank, run)
    taken: list[Mapping[str, Any]] = [d for d in rank.dumps if float(d["t"]) <= as_of + MOVING_WITHIN_S]
    if taken:
        return taken
    pending = [call_entry(c) for c in rank.collectives if c.start <= as_of and (c.end is None or c.end >= as_of)]
    return [{"t": as_of, "reason": RECORDS_THEN, "pending": pending, "stacks": "", "since_progress": None}]


def flight_at(timeline: list[tuple[float, FlightDump]], dump: Mapping[str, Any]) -> FlightDump | None:
    """The flight-recorder dump a rank wrote with ``dump`` (a dump, or its stop from
    outside: any written after the stop), if any."""
    at = float(dump["t"])
    until = math.inf if dump["reason"] == "stopped" else at + FLIGHT_LATE_S
    return next((d for t, d in timeline if at - FLIGHT_EARLY_S <= t <= until), None)


def flight_since(rank: RankData, run: RunData) -> float | None:
    """The earliest record time of a flight-recorder dump the diagnosis of a live hang
    may go by for this rank (:func:`flight_at`'s window around its latest dump), or None
    when it goes by none: `lorascope hang` reads only those (each dump a safe unpickling;
    the stall watchdog writes up to 20 a process, and every earlier `hang` one more)."""
    dumps = _dumps(rank, run, None)
    if not dumps or dumps[-1]["reason"] == RECORDS_THEN:
        return None
    return float(dumps[-1]["t"]) - FLIGHT_EARLY_S


def _flight_aligned(run: RunData, as_of: float | None, flight: FlightTimeline | None) -> FlightAlignment | None:
    """The flight-recorder dumps the ranks wrote with the dumps the diagnosis reads,
    aligned (an earlier one, from a dump taken while the job moved, would tell of another
    moment); None with fewer than two."""
    if not flight:
        return None
    chosen: dict[int, FlightDump] = {}
    for n, rank in run.ranks.items():
        dumps = _dumps(rank, run, as_of)
        if dumps and dumps[-1]["reason"] != RECORDS_THEN:
            found = flight_at(flight.get(n, []), dumps[-1])
            if found is not None:
                chosen[n] = found
    return align(chosen) if len(chosen) > 1 else None


def _flight_divergence(run: RunData, aligned: FlightAlignment | None) -> Disagreement | None:
    """Where the flight-recorder dumps show the ranks issued different ops at one sequence
    number of a group, when the run's records show no divergence (calls the probes cannot
    see: DDP's C++ Reducer, its buffer broadcasts)."""
    first = aligned.first_disagreement if aligned is not None else None
    if first is None or first.kind != "op" or first.p2p or first_divergence(run) is not None:
        return None
    return first


def diagnose(
    run: RunData,
    alive: dict[int, bool] | None = None,
    flight: FlightTimeline | None = None,
    as_of: float | None = None,
    stopped: Mapping[int, str] | None = None,
) -> dict[str, Any]:
    """The diagnosis of a hang: per-rank states, the groups of ranks by where they are,
    the kind, the first rank that diverged, the verdict line and the fix. ``flight``: the
    ranks' flight-recorder dumps, for the calls the probes cannot see. ``as_of``: the diagnosis of a stall the job came back from, as its dumps
    at that moment show it (what followed, the job's ending included, left out).
    ``stopped``: the ranks whose process `lorascope hang` found stopped (state T), in
    words: they cannot answer, and the others wait for them."""
    alive = alive or {}
    stopped = stopped or {}
    newest = max((r.last_time for r in run.ranks.values()), default=0.0)
    dumped = [float(d["t"]) for r in run.ranks.values() for d in _dumps(r, run, as_of)]
    cutoff = min(dumped) + MOVING_WITHIN_S if dumped else None
    aligned = _flight_aligned(run, as_of, flight)
    ahead = ahead_of_peers(aligned) if aligned is not None else {}
    waits = waiting_in(aligned) if aligned is not None else {}
    states = [
        _rank_state(r, run, alive.get(n), newest, cutoff, ahead.get(n), as_of, stopped.get(n), waits.get(n))
        for n, r in run.ranks.items()
    ]
    groups: dict[str, list[int]] = {}
    for s in states:
        groups.setdefault(s["where"] or s["state"], []).append(s["rank"])
    last_dumps = {n: dumps[-1] for n, r in run.ranks.items() if (dumps := _dumps(r, run, as_of))}
    odd: list[int]
    flight_div = _flight_divergence(run, aligned)
    kind = _not_hung(run, last_dumps) if as_of is None and flight_div is None else None
    flight_fix = None
    if kind is not None:
        odd, div, said = [], None, None
    elif flight_div is not None:  # the root cause, as a divergence of the run's records is
        kind, div = "rank-conditional-hang", None
        odd, said, flight_fix = _flight_said(run, flight_div, aligned)
    else:
        kind, odd, div, said = _classify(run, states)
    rank_only = explained_by(run, div)
    apart = rank_only_calls.explains(run, div)
    if rank_only is not None:
        odd = rank_only.ranks
    elif apart is not None:
        odd = apart.ranks
    first = next((s for s in states if s["rank"] in odd), None)
    if rank_only is not None and div is not None and first is not None:
        first = {**first, "where": rank_only.phrase(), "rank_only": rank_only.as_data()}
    elif apart is not None and first is not None:
        first = {**first, "where": apart.phrase(), "rank_only_calls": apart.as_data()}
    elif div is not None and odd:  # where the odd rank went its own way, not where it is now
        call = div.calls[odd[0]]
        found = call_condition(run.ranks[odd[0]], call)
        under = ""
        if found is not None:
            under = (
                f", under `{found[0]}`" if call and found[1] == call.site else f", from {found[1]} under `{found[0]}`"
            )
        first = (
            {
                **first,
                "where": f"{call.op} #{call.seq} on {group_named(div.group)} at {call.site or '?'}" + under,
            }
            if call and first
            else first
        )
    verdict = said or _verdict(kind, odd, first, _hosts_of(run, odd))
    fix = flight_fix or FIXES[kind]
    if rank_only is not None and div is not None:
        verdict = (
            f"{rank_only.phrase()}, before collective #{div.seq} on {group_named(div.group)}, where the ranks' calls first "
            f"disagree ({calls_summary(div)}): a rank-only call into ZeRO-3's parameter state"
        )
        fix = ZERO_FIX
    elif apart is not None and div is not None:
        verdict, fix = apart.said(div, calls_summary(div)), apart.fix
    elif div is not None and branches.unconditioned(run, div) and not size_mismatch(run, div):
        verdict, fix = branches.branch_said(run, div), branches.FIX
    elif kind == "rank-conditional-hang" and odd and (op := _p2p_op(div, odd[0], first)) is not None:
        verdict = f"rank-conditional point-to-point {op} ({ranks_named(odd)}{_hosts_of(run, odd)}): " + (
            first["where"] if first else "?"
        )
        fix = P2P_FIX
    return {
        "id": verdict_id(kind),
        "kind": kind,
        "verdict": verdict,
        "fix": fix,
        "odd_ranks": odd,
        "first_diverged": first,
        "ranks": states,
        "groups": [{"where": w, "ranks": rs} for w, rs in groups.items()],
    }


def _flight_said(run: RunData, first: Disagreement, aligned: FlightAlignment | None) -> tuple[list[int], str, str]:
    """The odd ranks, verdict and fix of a divergence only the flight-recorder dumps show:
    the ranks inside a rank condition along their call chains (as the probes recorded the
    job's lines), else a branch on the data (:mod:`branches`)."""
    group = next((g.desc or g.group for g in aligned.groups if g.group == first.group), first.group) if aligned else ""
    found = {
        r: chain_condition(call_chain(e.frames), run.ranks[r].sites) if r in run.ranks else None
        for r, e in first.entries.items()
    }
    odd = odd_by_condition({r: f[0] if f else None for r, f in found.items()}, include_else=True)
    if not odd:
        odd = minority({r: e.op for r, e in first.entries.items()})
        return odd, branches.flight_said(first, group_named(group)), branches.FIX
    entry, cond = first.entries[odd[0]], found[odd[0]]
    site = call_site(entry.frames) or "?"
    under = "" if cond is None else f", under `{cond[0]}`" if cond[1] == site else f", from {cond[1]} under `{cond[0]}`"
    said = (
        f"rank-conditional collective ({ranks_named(odd)}): {entry.op} #{first.seq} on {group_named(group)} at {site}"
        f"{under} (flight recorder)"
    )
    return odd, said, FIXES["rank-conditional-hang"]


def _not_hung(run: RunData, last_dumps: Mapping[int, Mapping[str, Any]]) -> str | None:
    """The kind of a diagnosis that finds no hang, else None: "finished" when every rank
    exited with code 0 (the job ended while `lorascope hang` waited); "moving" when every
    rank's latest dump caught it moving, or it made a step after it (and it had not
    ended); "stopped" when the job was stopped from outside (every rank's latest dump is
    its stop) with every rank moving, or waiting in a collective for ranks that were (a
    save or an evaluation on rank 0 while the others wait: no one said the job hung)."""
    if run.ranks and all(_finished(r) for r in run.ranks.values()):
        return "finished"
    if first_divergence(run) is not None:
        return None
    if len(last_dumps) == len(run.ranks) and all(d["reason"] == "stopped" for d in last_dumps.values()):
        return "stopped" if all(moving_when_stopped(run).values()) else None

    def moved(n: int, rank: RankData) -> bool:
        dump = last_dumps.get(n)
        if dump is not None:
            return moving_at(dump, rank)
        return bool(rank.dumps) and stepped_after(rank, float(rank.dumps[-1]["t"]))  # read past

    moving = all(moved(n, r) and not ending_of(r).known for n, r in run.ranks.items())
    return "moving" if moving else None


def _finished(rank: RankData) -> bool:
    """Whether the rank exited with code 0 (and nothing failed in its teardown after)."""
    end = ending_of(rank)
    return end.status == "exit" and end.code == 0 and not end.teardown


def _classify(run: RunData, states: list[dict[str, Any]]) -> tuple[str, list[int], Divergence | None, str | None]:
    """The kind, the odd ranks, where the ranks' calls first disagree and, where it says
    more than the kind's own, the verdict."""
    by_state: dict[str, list[int]] = {}
    for s in states:
        by_state.setdefault(s["state"], []).append(s["rank"])
    div = first_divergence(run)
    if div is not None:  # the root cause: what follows (timeouts, deaths) are consequences
        return "rank-conditional-hang", odd_ranks(run, div), div, None
    if by_state.get("dead"):
        # The first to die is the cause; the others' errors (a peer closed the connection)
        # follow from it.
        first = min(by_state["dead"], key=lambda n: _death_time(run.ranks[n]))
        return "dead-rank", [first], None, None
    if by_state.get("stopped"):
        return "stopped-process", by_state["stopped"], None, None
    waiting = by_state.get("in-collective", [])
    if waiting and by_state.get("outside-collectives"):
        return "stuck-outside", by_state["outside-collectives"], None, None
    if waiting and by_state.get("moving"):
        return "straggler", by_state["moving"], None, None
    if waiting and len(waiting) == len(states):
        p2p = [s["rank"] for s in states if s["pending"][0].get("op") in P2P_OPS]
        if p2p and len(p2p) < len(states):  # a send or receive whose peer is in a collective
            return "rank-conditional-hang", p2p, None, None
        odd = _odd_from_stacks(run, states)
        return ("rank-conditional-hang", odd, None, None) if odd else _in_collectives(run, states)
    return "unknown", [], None, None


def _in_collectives(run: RunData, states: list[dict[str, Any]]) -> tuple[str, list[int], None, str | None]:
    """Every rank waits in a collective and no group's calls disagree: one collective, or
    several every member of whose group is in (stuck themselves; the ranks in them are
    the odd ones), or ranks waiting for one another across groups; else unknown."""
    ops = {str(s["pending"][0].get("op")) for s in states}
    blocking_p2p = ops <= P2P_OPS - {"batch_isend_irecv"}  # a batch posts its sends and receives together
    if len(ops) == 1 and blocking_p2p:
        op = ops.pop()
        return (
            "p2p-deadlock",
            [],
            None,
            (
                f"every rank waits in a blocking {op} to a peer that waits in its own {op} (a point-to-point deadlock: "
                f"no rank {'receives' if 'send' in op else 'sends'} first): {_places_said(states)}"
            ),
        )
    if blocking_p2p and (paired := _p2p_pairs(states)) is not None:
        return paired
    first = {tuple(s["pending"][0].get(k) for k in ("group", "seq", "op", "site")) for s in states}
    found = waits(run, states)
    if len(first) == 1 or (found is not None and len(found) == 1):
        return "collective-stuck", [], None, None
    if found is None:
        return "unknown", [], None, UNTOLD_WAITS
    stuck = complete(found)
    if stuck:
        odd = sorted(r for w in stuck for r in w.ranks)
        return "collective-stuck", odd, None, _stuck_said(run, stuck, len(odd) < len(states))
    if crossed(found):
        odd = fewest(found)
        return "crossed-collectives", odd, None, _crossed_said(found)
    return "unknown", [], None, None


#: Collectives named in a verdict, at most.
MAX_WAITS_NAMED = 3
#: The verdict on ranks in different collectives whose groups or numbers are not known.
UNTOLD_WAITS = (
    "every rank waits in a collective, not all in the same one, and whom each waits for cannot be told "
    "(a call begun before `lorascope attach`, or a group whose ranks were not recorded)"
)


def _p2p_pairs(states: list[dict[str, Any]]) -> tuple[str, list[int], None, str] | None:
    """Every rank waits in a send or a receive, some in each: whom each waits for, from the
    peers their dumps name (None where a send names none; a receive that names none takes
    from any rank). Ranks each in the other's matching call are a pair whose transfer does
    not complete (their tags, or the transport); a rank whose peer waits in anything else
    is in a point-to-point deadlock, and is named with its peer."""
    calls = {s["rank"]: s["pending"][0] for s in states}
    peers = {
        n: p if isinstance(p := c.get("peer"), int) and not isinstance(p, bool) else None for n, c in calls.items()
    }
    sends = {n for n, c in calls.items() if "send" in str(c.get("op"))}
    if any(peers[n] is None for n in sends):  # a receive may name none: from any source
        return None

    def verb(n: int) -> str:
        if n in sends:
            return f"sends to rank {peers[n]}"
        return f"receives from rank {peers[n]}" if peers[n] is not None else "receives from any rank"

    def matched(n: int) -> bool:
        if n not in sends and peers[n] is None:
            return any(peers[m] == n for m in sends)
        peer = peers[n]
        return peer in calls and (peer in sends) != (n in sends) and peers[peer] in (n, None)

    apart = [n for n in sorted(calls) if not matched(n)]
    if not apart:
        pairs = [f"rank {n} {verb(n)}" for n in sorted(calls) if n in sends]
        more = len(pairs) - MAX_WAITS_NAMED
        said = "; ".join(pairs[:MAX_WAITS_NAMED]) + (f"; {more} more pairs" if more > 0 else "")
        return (
            "p2p-stuck",
            [],
            None,
            f"every rank waits in a send or receive whose peer waits in the matching one ({said}), and the transfer "
            "does not complete: the transport is stuck, or the pair's tags or sizes differ",
        )

    def peer_in(n: int) -> str:
        peer = peers[n]
        if peer is None:
            return "no rank sends to it"
        if peer not in calls:
            return f"rank {peer} is not among the ranks that answered"
        return f"rank {peer} {verb(peer)}"

    named = [f"rank {n} {verb(n)} while {peer_in(n)}" for n in apart[:MAX_WAITS_NAMED]]
    rest = f"; and {len(apart) - MAX_WAITS_NAMED} more ranks" if len(apart) > MAX_WAITS_NAMED else ""
    return (
        "p2p-deadlock",
        apart if len(apart) < len(calls) else [],
        None,
        f"every rank waits in a blocking send or receive, and these ranks' peers wait in other calls (a "
        f"point-to-point deadlock): {'; '.join(named)}{rest}",
    )


def _named(found: list[Wait], absent: bool = False) -> str:
    """The first MAX_WAITS_NAMED of ``found`` in words ("ranks 0-3 wait in X"; ``absent``:
    "... for rank 4", its members that never issued it)."""
    said = "; ".join(
        f"{ranks_named(w.ranks)} wait{'s' if len(w.ranks) == 1 else ''} in {w.where}"
        + (f" for {ranks_named(w.absent)}" if absent else "")
        for w in found[:MAX_WAITS_NAMED]
    )
    more = len(found) - MAX_WAITS_NAMED
    return said + (f"; and {more} more" if more > 0 else "")


def _stuck_said(run: RunData, stuck: list[Wait], others: bool) -> str:
    """The verdict on collectives that hold every member of their group and do not complete."""
    after = "; the others wait for them" if others else ""
    if len(stuck) == 1:
        w = stuck[0]
        one = len(w.ranks) == 1
        return (
            f"{ranks_named(w.ranks)}{_hosts_of(run, list(w.ranks))} wait{'s' if one else ''} in {w.where}, "
            f"with every rank of group {w.group} in it: the collective itself is stuck{after}"
        )
    return (
        f"{len(stuck)} collectives hold every rank of their group and do not complete: "
        + _named(stuck)
        + f": the collectives themselves are stuck{after}"
    )


def _crossed_said(found: list[Wait]) -> str:
    """The verdict on ranks that wait for one another in collectives of different groups."""
    return (
        "the ranks wait for one another in collectives of different groups: "
        + _named(found, absent=True)
        + ": the groups' collectives are issued in different orders on different ranks (a deadlock)"
    )


def _odd_from_stacks(run: RunData, states: list[dict[str, Any]]) -> list[int]:
    """Ranks that all wait in collectives the records never saw begin (begun before
    `lorascope attach`: read from their stacks, no sequence number to align), at
    different ops or call sites: those whose call sits inside a rank condition."""
    first = {s["rank"]: s["pending"][0] for s in states}
    if all(isinstance(p.get("seq"), int) for p in first.values()):
        return []
    if len({(p.get("op"), p.get("site")) for p in first.values()}) < 2:
        return []
    site = {n: p.get("site") for n, p in first.items()}
    return odd_by_condition(
        {n: rank_condition(run.ranks[n], s if isinstance(s, str) else None) for n, s in site.items()},
        include_else=False,
    )


#: Hosts named in a verdict, at most.
MAX_HOSTS_NAMED = 3


def _hosts_of(run: RunData, odd: list[int]) -> str:
    """Where the odd ranks run, for a verdict on a job that spans hosts: `` on host b``
    (`` on hosts a, b``, `` on 12 hosts``); nothing on one host."""
    if len({r.host for r in run.ranks.values()}) < 2:
        return ""
    hosts = sorted({run.ranks[n].host for n in odd if n in run.ranks})
    if not hosts:
        return ""
    if len(hosts) == 1:
        return f" on host {hosts[0]}"
    return f" on hosts {', '.join(hosts)}" if len(hosts) <= MAX_HOSTS_NAMED else f" on {len(hosts):,} hosts"


def _p2p_op(div: Divergence | None, rank: int, state: Mapping[str, Any] | None) -> str | None:
    """The send or receive ``rank`` made where the ranks part (its call at the divergence,
    else the call it waits in), or None when that is no point-to-point call."""
    call = div.calls.get(rank) if div is not None else None
    if call is not None:
        return call.op if call.op in P2P_OPS else None
    pending = state.get("pending") if state else None
    op = pending[0].get("op") if pending else None
    return op if div is None and op in P2P_OPS else None


def _places_said(states: list[dict[str, Any]]) -> str:
    """Where the ranks are, alike ones together (a few kinds of place, 1,024 ranks or 2)."""
    alike: dict[str, list[int]] = {}
    for st in states:
        alike.setdefault(str(st["where"]), []).append(st["rank"])
    parts = [f"{ranks_named(ns)} in {where}" for where, ns in list(alike.items())[:3]]
    return "; ".join(parts) + (f"; {len(alike) - 3} more places" if len(alike) > 3 else "")


def _verdict(kind: str, odd: list[int], first: dict[str, Any] | None, hosts: str = "") -> str:
    who = (ranks_named(odd) + hosts) if odd else "no rank"
    where = first["where"] if first else "?"
    one = len(odd) == 1
    return {
        "rank-conditional-hang": f"rank-conditional collective{f' ({who})' if odd else ''}: {where}",
        "dead-rank": f"{who} died first{_when_died(first)}: {where.removeprefix('died: ')}; the others wait for it "
        "or failed after it",
        "stuck-outside": f"{who} {'is' if one else 'are'} stuck outside any collective, {where}; the others wait",
        "stopped-process": f"{who} {'is' if one else 'are'} {where}; the others wait for {'it' if one else 'them'}",
        "straggler": f"{who} {'is a straggler' if one else 'are stragglers'} still moving; the others wait for {'it' if one else 'them'}",
        "collective-stuck": "every rank waits in the same collective: the collective itself is stuck",
        "crossed-collectives": "the ranks wait for one another in collectives of different groups (a deadlock)",
        "unknown": "no rank shows why the job is stuck",
        "moving": "not hung: every rank had finished a step within seconds before its dump (the job is moving)",
        "finished": "not hung: every rank exited with code 0 (the job had finished when it was read)",
        "stopped": "not hung when it was stopped from outside: the ranks were making steps, or waiting for one that was",
    }[kind]


def _when_died(first: dict[str, Any] | None) -> str:
    """ ", after step 7, at 09:41:02 UTC" for a dead rank's state (its steps and
    ``died_at``), else ""."""
    if not first or not isinstance(first.get("died_at"), (int, float)):
        return ""
    at = time.strftime("%H:%M:%S UTC", time.gmtime(float(first["died_at"])))
    step = first.get("step")
    if not isinstance(step, int):
        return f", at {at}"
    return f", after step {step}, at {at}" if step else f", before its first step, at {at}"
