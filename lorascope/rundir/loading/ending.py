"""How a rank ended, as far as its stream tells: the one reading of a rank's exception,
signal and end records that the summary, the hang diagnosis and the report share; for a
run whose ranks have not ended, whether it still moves (a run read mid-job, a dump taken
while a rank made steps: not a hang); and, for a job stopped from outside (Ctrl-C,
SIGTERM), where each rank was when it was, read as a dump taken then."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lorascope.rundir.loading.reader import Collective, RankData, RunData
from lorascope.rundir.loading.records import StallRecord
from lorascope.units import ranks_named, strip_source_locations

#: faulthandler's first line ("Fatal Python error: Aborted") -> the signal.
FATAL_SIGNALS = {
    "Aborted": signal.SIGABRT,
    "Segmentation fault": signal.SIGSEGV,
    "Bus error": signal.SIGBUS,
    "Floating-point exception": signal.SIGFPE,
    "Illegal instruction": signal.SIGILL,
}


_FATAL_NUMBERS = {int(s) for s in FATAL_SIGNALS.values()}

#: How a job is stopped from outside, each with who sends it: a rank that ended by one of
#: these (and ``KeyboardInterrupt``, Python's SIGINT) did not fail by itself.
STOPPED = {
    "KeyboardInterrupt": "Ctrl-C, or SIGINT from a launcher passing it on",
    signal.SIGINT.name: "Ctrl-C, or a launcher passing it on",
    signal.SIGTERM.name: "kill, a launcher, or a scheduler's time limit or preemption",
    signal.SIGHUP.name: "the terminal or session closed",
}


@dataclass(frozen=True)
class Ending:
    #: "exception", "signal", the end record's status ("exit", ...), or "unknown" when
    #: the stream has no word on it (killed by SIGKILL or the OOM killer, or still running).
    status: str
    code: int | None
    detail: str | None
    #: When the rank recorded it (None: no record).
    t: float | None
    #: A fatal signal in the interpreter's teardown, after the rank recorded its exit
    #: (``t`` is that end record's: the job had finished).
    teardown: bool = False

    @property
    def fatal(self) -> bool:
        """Killed by a fatal signal the process raised itself (an abort, a segfault), not
        one sent to it (a launcher's SIGTERM once another rank died)."""
        return self.status == "signal" and self.code is not None and -self.code in _FATAL_NUMBERS

    @property
    def known(self) -> bool:
        """The rank recorded how it ended (an exception, a signal or an end record)."""
        return self.status != "unknown"

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, "code": self.code, "detail": self.detail}


def ending_of(rank: RankData) -> Ending:
    if rank.exception is not None:
        exc = rank.exception
        # torch's and gloo's C++ source locations left out ("[/__w/pytorch/.../pair.cc:537] "):
        # every one-line reading of the ending would show them before the message.
        message = "\n".join(strip_source_locations(line) for line in str(exc["message"]).splitlines()).strip()
        detail = f"{exc['type']}: {message}" if message else str(exc["type"])  # KeyboardInterrupt has none
        return Ending("exception", 1, detail, float(exc["t"]))
    if rank.signal is not None:
        sig = rank.signal
        return Ending("signal", -sig["signum"], sig["name"], float(sig["t"]))
    if rank.fatal is not None:
        first = rank.fatal.splitlines()[0]
        signum = FATAL_SIGNALS.get(first.removeprefix("Fatal Python error: ").strip())
        code = None if signum is None else -signum
        if rank.end is not None:  # faulthandler wrote after the end record: in the teardown
            after = f"{rank.end['status']} {rank.end['code']}"
            detail = f"{first} (faulthandler) in the interpreter's teardown, after {after}\n{rank.fatal}"
            return Ending("signal", code, detail, float(rank.end["t"]), teardown=True)
        return Ending("signal", code, f"{first} (faulthandler)\n{rank.fatal}", None)
    if rank.end is not None:
        why = rank.end.get("why")
        return Ending(rank.end["status"], rank.end["code"], why if isinstance(why, str) else None, float(rank.end["t"]))
    return Ending("unknown", None, NO_END_RECORD, None)


#: A rank's ending when its stream has no word on it (``Ending.detail``), before the
#: manifest is read (:func:`unrecorded_ending` says more once it is).
NO_END_RECORD = "no end record: killed (e.g. SIGKILL, OOM killer) or still running"


def unrecorded_ending(run: RunData) -> str:
    """What a rank's missing end record means, as far as the manifest tells: the job still
    running, stopped by a signal `lorascope run` passed on (the rank then ended before it
    could say how: its launcher's SIGKILL after a grace period), or killed without a word."""
    if not launchers_ended(run):
        return NO_END_RECORD
    passed = [s for launch in run.manifest["launches"] for s in launch.get("signals") or []]
    if passed:
        return (
            f"no end record: the job was stopped from outside ({', '.join(dict.fromkeys(passed))} passed on by "
            "`lorascope run`) and the rank ended before its probes wrote how (e.g. its launcher's SIGKILL "
            "after the signal)"
        )
    return "no end record: killed without a word (SIGKILL: the OOM killer, or a launcher's)"


def terminated_by_lorascope(rank: RankData, run: RunData) -> str | None:
    """For a rank that ended by SIGTERM which `lorascope run` sent it, as a process its
    launcher left behind when the launcher itself ended (the manifest's ``leftovers``): what
    happened, as one clause; else None."""
    end = ending_of(rank)
    if end.status != "signal" or end.code != -signal.SIGTERM:
        return None
    for launch in run.manifest["launches"]:
        left = launch.get("leftovers")
        if isinstance(left, dict) and rank.pid in (left.get("pids") or []):
            return f"sent by `lorascope run` to the processes {launcher_ending(launch)} left behind"
    return None


def launcher_ending(launch: dict[str, Any]) -> str:
    """How a launch's command ended, as the subject of a clause: "the launcher (torchrun),
    killed by SIGKILL (exit status 137),"."""
    command = [str(c) for c in launch.get("command") or ["?"]]
    name = command[0].rsplit("/", 1)[-1]
    if name.startswith("python") and len(command) > 2 and command[1] == "-m":
        name = command[2]
    elif name.startswith("python") and len(command) > 1:
        name = command[1].rsplit("/", 1)[-1]
    name = "torchrun" if name == "torch.distributed.run" else name
    status = launch.get("exit_status")
    how = f"exit status {status}"
    if isinstance(status, int) and 128 < status < 128 + signal.NSIG:
        with contextlib.suppress(ValueError):
            how = f"killed by {signal.Signals(status - 128).name} ({how})"
    return f"the launcher ({name}), {how},"


def stopped_by(how: str) -> str | None:
    """Who stops a job the way a rank's ending (as one line) says, if it was stopped from
    outside (``STOPPED``), else None."""
    return STOPPED.get(how.strip())


def ended_badly_headline(bad: list[tuple[int, float | None, str, dict[str, Any] | None]]) -> str:
    """The headline of a run no detector named a cause for but some ranks ended badly,
    from each such rank's (rank, when it ended or None, its ending as one line, its
    ``stopped`` reading or None: :func:`stopped_reading`): the first to end leads (the
    others often fail because it did: a peer's connection closed), with the ranks that
    ended like it, and the others apart (the terminal's and the report's, alike). A run
    every such rank of which was stopped from outside (Ctrl-C, SIGTERM) is said to be that:
    found nothing if every rank was making steps when it was, else stopped while stuck."""
    ordered = sorted(bad, key=lambda b: (b[1] is None, b[1] or 0.0, b[0]))
    first = ordered[0][2]
    alike = [b[0] for b in ordered if b[2] == first]
    rest = [b[0] for b in ordered if b[2] != first]
    if _all_stopped(ordered):
        kinds: dict[tuple[str, str | None], list[int]] = {}
        for b in ordered:
            kinds.setdefault((b[2], (b[3] or {}).get("by")), []).append(b[0])
        got = "; ".join(
            f"{ranks_named(ranks)} got {how} ({by or stopped_by(how)})" for (how, by), ranks in kinds.items()
        )
        idle = _idle(ordered)
        if not idle:
            return f"no problem found before the job was stopped from outside: {got}"
        longest = max(idle, key=lambda i: i[1] if i[1] is not None else float("inf"))
        since = "made no step" if longest[1] is None else f"made no step for {longest[1]:.0f} s"
        return (
            f"no detector named a cause, but the job was stuck when it was stopped from outside: {got}; "
            f"rank {longest[0]} had {since} before it was"
        )
    if not rest:
        verb = "ended" if len(alike) == 1 else "all ended"
        return f"no detector named a cause, but {ranks_named(alike)} {verb} badly: {first}"
    return (
        f"no detector named a cause, but {ranks_named(alike)} ended badly first: {first} "
        f"({ranks_named(rest)} ended otherwise after {'it' if len(alike) == 1 else 'them'})"
    )


def stopped_while_moving(bad: list[tuple[int, float | None, str, dict[str, Any] | None]]) -> bool:
    """Whether every rank that ended badly (as :func:`ended_badly_headline` takes them) was
    stopped from outside while the job was moving: nothing is wrong with the run (the
    report's verdict is then not a warning)."""
    return _all_stopped(bad) and not _idle(bad)


def _all_stopped(bad: list[tuple[int, float | None, str, dict[str, Any] | None]]) -> bool:
    return all(stopped_by(b[2]) and b[3] is not None for b in bad)


def _idle(bad: list[tuple[int, float | None, str, dict[str, Any] | None]]) -> list[tuple[int, Any]]:
    """The ranks that were not moving when the job was stopped, with their time since a step."""
    return [(b[0], b[3]["since_step_s"]) for b in bad if b[3] is not None and not b[3]["moving"]]


def no_steps_headline(ranks: int) -> str:
    """The headline of a run no detector named a cause for, whose ranks all exited 0 without
    one step the probes saw: not a clean bill (the terminal's and the report's, alike)."""
    every = f"all {ranks} ranks" if ranks > 1 else "its one rank"
    return (
        f"no detector named a cause, but no training step was seen ({every} exited 0 without one): "
        "memory over steps, stragglers and gradient health had nothing to read (the probes see "
        "the steps of DeepSpeed's engine, the Hugging Face Trainer and torch optimizers' step())"
    )


#: A run read while it runs and makes steps is not hung (``still_moving``): its newest
#: record is under LIVE_SECONDS old (the probes' sampler writes every 0.5 s), and every
#: rank's last step is within MOVING_STEPS of its median steps (at least MOVING_MIN_S) of
#: that record.
LIVE_SECONDS = 30.0
MOVING_STEPS = 10
MOVING_MIN_S = 5.0
#: The headline of such a run with no finding (the terminal's and the report's).
RUNNING = (
    "no problem found so far: the job is still running and every rank makes steps "
    "(analyse it again once it ends; `lorascope hang` if it stops)"
)
#: A dump within this many of the rank's fastest steps (at least DUMP_MIN_S) of its last
#: step's end caught it moving (``moving_at``).
DUMP_STEPS = 2
DUMP_MIN_S = 0.5
#: A call that ended with an error this little before the job was stopped from outside was
#: in flight at the stop: the stop ended it (its end is taken before the rank's exception).
STOP_CALL_S = 1.0
#: Phases a rank may spend long in without a step, as a healthy job does (an evaluation,
#: a checkpoint save).
LONG_PHASES = ("eval", "save")


def launchers_ended(run: RunData) -> bool:
    """Every launch the run directory records has ended: a rank with no word on how it
    ended then died without one (SIGKILL: the OOM killer, or a launcher's after its grace
    period), it is not still running."""
    launches = run.manifest["launches"]
    return bool(launches) and all(launch["end"] is not None for launch in launches)


def still_moving(run: RunData, now: float | None = None) -> bool:
    """The run is running and every rank makes steps: a launcher has not ended, no rank
    recorded its ending or a stall it made no step after, its dumps (if any) came as it
    moved (:func:`moving_at_dumps`), and its records are fresh (above). Its
    pending calls are then the calls in flight when it was read, not a hang: read live, a
    healthy job read "rank 0 is a straggler still moving; the others wait for it" (an
    error) whenever rank 1 was inside a collective at that moment. A job that stops
    making steps gets a stall record from the probes' watchdog (at most 300 s). Decided
    once per loaded run (``run.derived``), so that every reader of it agrees."""
    if now is None:
        if "still_moving" not in run.derived:
            run.derived["still_moving"] = still_moving(run, time.time())
        return bool(run.derived["still_moving"])
    if not run.manifest["launches"] or launchers_ended(run):
        return False
    ranks = list(run.ranks.values())
    if any(stalled_now(r) or ending_of(r).known or not r.steps or not moving_at_dumps(r, run) for r in ranks):
        return False
    newest = max(r.last_time for r in ranks)
    if now - newest > LIVE_SECONDS:
        return False
    return all(newest - float(r.steps[-1]["t"]) <= progress_window(r) for r in ranks)


def progress_window(rank: RankData) -> float:
    """How long a rank that makes steps may go without one: MOVING_STEPS of its median
    steps, at least MOVING_MIN_S."""
    return max(MOVING_MIN_S, MOVING_STEPS * float(rank.totals.get("step_time_median_s") or 0.0))


def moving_at_dumps(rank: RankData, run: RunData) -> bool:
    """Every dump the rank took (its stop from outside as one: :func:`dumps_of`) caught it
    moving (:func:`moving_at`)."""
    return all(moving_at(d, rank) for d in dumps_of(rank, run))


def call_entry(call: Collective) -> dict[str, Any]:
    """A call in flight as a dump lists it (the probes' ``pending``)."""
    return {"group": call.group, "seq": call.seq, "op": call.op, "bytes": call.bytes, "site": call.site}


def stopped_at(rank: RankData) -> float | None:
    """When the rank ended by a stop from outside (Ctrl-C, SIGTERM: :func:`stopped_by`),
    else None."""
    end = ending_of(rank)
    if end.t is None or end.status not in ("exception", "signal") or end.teardown:
        return None
    return end.t if stopped_by((end.detail or "").split("\n", 1)[0]) else None


def stop_time(run: RunData) -> float | None:
    """When the job was stopped from outside: the first rank's stop (a rank blocked in a
    collective raises its KeyboardInterrupt only once the call returns, seconds later),
    else None; also None when a rank had failed by itself before it (torchrun SIGTERMs
    the other ranks once one fails: a consequence, not a stop). Computed once per run."""
    if "stop_time" not in run.derived:
        stops = [t for r in run.ranks.values() if (t := stopped_at(r)) is not None]
        first = min(stops, default=None)
        failed = [
            end.t
            for r in run.ranks.values()
            if (end := ending_of(r)).t is not None and stopped_at(r) is None and (end.status, end.code) != ("exit", 0)
        ]
        run.derived["stop_time"] = None if first is None or min(failed, default=first + 1) <= first else first
    found = run.derived["stop_time"]
    return None if found is None else float(found)


def stop_dump(rank: RankData, run: RunData) -> dict[str, Any] | None:
    """A rank stopped from outside as a dump taken when the job was (:func:`stop_time`),
    read by the hang diagnosis like `lorascope hang`'s: the calls in flight then, the stack
    its exception's traceback or its signal record holds, and how long since its last step.
    A job that hangs is often stopped by hand before anyone runs `lorascope hang`; without
    this the stop read as how the ranks died ("rank 0 died first: KeyboardInterrupt").
    None for a rank not stopped from outside. Made once per loaded run (the diagnosis,
    hung-ranks and the summary each ask for every rank's, several times)."""
    if "stop_dumps" not in run.derived:
        run.derived["stop_dumps"] = {n: _stop_dump(r, run) for n, r in run.ranks.items()}
    found: dict[int, dict[str, Any] | None] = run.derived["stop_dumps"]
    return found.get(rank.rank)


def _stop_dump(rank: RankData, run: RunData) -> dict[str, Any] | None:
    at = stop_time(run)
    if at is None or stopped_at(rank) is None:
        return None
    if rank.exception is not None:
        stacks: str | None = rank.exception["traceback"]
    else:
        stacks = rank.signal.get("stacks") if rank.signal is not None else None
    return {
        "t": at,
        "reason": "stopped",
        "since_progress": at - float(rank.steps[-1]["t"]) if rank.steps else None,
        "pending": [call_entry(c) for c in rank.collectives if c.start <= at and _in_flight_at_stop(c, at)],
        "stacks": stacks if isinstance(stacks, str) else "",
    }


def _in_flight_at_stop(call: Collective, at: float) -> bool:
    end = call.end
    return end is None or end >= at or (call.err is not None and end >= at - STOP_CALL_S)


def stopped_reading(rank: RankData, run: RunData) -> dict[str, Any] | None:
    """For a rank stopped from outside: how long after its last step's end the job was
    stopped (``since_step_s``, None without steps), and whether the rank was moving then
    (``moving``: :func:`moving_when_stopped`); else None. In each rank's ``ended``
    (analyze --json, the report)."""
    stop = stop_dump(rank, run)
    if stop is None:
        return None
    out: dict[str, Any] = {
        "since_step_s": stop["since_progress"],
        "moving": moving_when_stopped(run).get(rank.rank, False),
    }
    by = terminated_by_lorascope(rank, run)
    if by is not None:
        out["by"] = by
    return out


def moving_when_stopped(run: RunData) -> dict[int, bool]:
    """Per rank stopped from outside, whether it was moving when the job was stopped: by
    its last step (:func:`moving_at`), or waiting in a collective for a rank that was (a
    save or an evaluation on rank 0 while the others wait: no one said the job hung).
    Computed once per loaded run."""
    if "moving_when_stopped" not in run.derived:
        stops = {n: d for n, r in run.ranks.items() if (d := stop_dump(r, run)) is not None}
        own = {n: moving_at(d, run.ranks[n]) for n, d in stops.items()}
        some = any(own.values())
        run.derived["moving_when_stopped"] = {n: own[n] or (some and bool(d["pending"])) for n, d in stops.items()}
    found: dict[int, bool] = run.derived["moving_when_stopped"]
    return found


def dumps_of(rank: RankData, run: RunData) -> list[Mapping[str, Any]]:
    """The rank's dumps, its stop from outside last as one (:func:`stop_dump`), less those
    that caught it stuck and that it made steps after: they tell of a stall it came back
    from (``rundir.stalls`` reads those), not of where the rank is. A dump that caught it
    moving (:func:`moving_at`) stays: it is what says so. Made once per rank of a loaded
    run (the diagnosis asks for each rank's several times; each a pass over its steps)."""
    made: dict[int, list[Mapping[str, Any]]] = run.derived.setdefault("dumps_of", {})
    if rank.rank not in made:
        dumps: list[Mapping[str, Any]] = [
            d for d in rank.dumps if moving_at(d, rank) or not stepped_after(rank, float(d["t"]))
        ]
        stop = stop_dump(rank, run)
        made[rank.rank] = dumps if stop is None else [*dumps, stop]
    return made[rank.rank]


def stepped_after(rank: RankData, at: float) -> bool:
    """Whether the rank made a step after ``at`` (its last kept step is its last)."""
    return bool(rank.steps) and float(rank.steps[-1]["t"]) > at


def stalled_now(rank: RankData) -> StallRecord | None:
    """The rank's latest stall record, if it made no step after it (else the stall was one
    it came back from: ``rundir.stalls``)."""
    stall = rank.stall
    return stall if stall is not None and not stepped_after(rank, float(stall["t"])) else None


def moving_at(dump: Mapping[str, Any], rank: RankData) -> bool:
    """A dump (`lorascope hang`'s, on demand) came within DUMP_STEPS of the rank's fastest
    steps (at least DUMP_MIN_S) of a step's end (its ``since_progress``): the rank was
    moving, not hung, whatever it was doing at that instant. A stall dump never is (it
    fires past 5 s without a step); a dump without the figure counts as not moving.
    Tighter than :func:`progress_window`, and from the fastest step, not the median (the
    first steps' warm-up): a hang caught a second after it began must still read as
    one."""
    durations = [float(d) for s in rank.steps if isinstance(d := s.get("dur"), (int, float)) and d > 0]
    since = dump.get("since_progress")
    if dump.get("reason") == "stopped":
        return _moved_before_stop(dump, rank, since, durations)
    window = max(DUMP_MIN_S, DUMP_STEPS * min(durations, default=0.0))
    return dump.get("reason") != "stall" and isinstance(since, (int, float)) and float(since) <= window


def _moved_before_stop(dump: Mapping[str, Any], rank: RankData, since: Any, durations: list[float]) -> bool:
    """Whether a rank stopped from outside was moving: looser than a dump's reading, as no
    one said the job hung when it was stopped (a job stopped mid-save must not read as
    hung): within :func:`progress_window` or twice its longest step of its last step, in
    an evaluation or a save, or before its first step (nothing to compare with)."""
    if not isinstance(since, (int, float)):
        return True
    if float(since) <= max(progress_window(rank), 2 * max(durations, default=0.0)):
        return True
    return in_long_phase(rank, float(dump["t"]))


def in_long_phase(rank: RankData, at: float) -> bool:
    """Whether the rank was inside an evaluation or a save (LONG_PHASES) at ``at``."""
    for p in reversed(rank.phases):
        if float(p["t"]) <= at and p.get("name") in LONG_PHASES:
            return bool(p.get("edge") == "begin")
    return False
