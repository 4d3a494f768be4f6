"""hung-ranks: the job stopped making progress, and why (other than a rank-conditional
collective, which rank-conditional-hang names): a rank that died while the others wait,
a rank stuck in its own code outside any collective, a straggler, or a collective that
is itself stuck. The diagnosis is lorascope.detect.hang.diagnosis's, the same `lorascope hang`
prints live; here it runs on the dumps the stall watchdog left in the run directory.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from lorascope.detect.common import calls_source, per_rank_evidence, stream_source
from lorascope.detect.finding import Evidence, Finding
from lorascope.detect.hang.diagnosis import FIXES, NOT_HUNG, diagnose
from lorascope.detect.hang.flight_align import Disagreement, flight_alignment, flight_conditions, last_activity
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.ingest.flight.reader import call_site
from lorascope.rundir.loading.ending import ending_of, launchers_ended, moving_at_dumps, stalled_now, still_moving
from lorascope.rundir.loading.reader import RunData
from lorascope.rundir.loading.stalls import recovered_stalls
from lorascope.units import rank_ranges, ranks_named

ID = "hung-ranks"
EXPLANATION = (
    "A distributed job hangs when one rank stops taking part in the collectives the others "
    "wait in. Nothing is logged until the process-group watchdog (30 minutes by default) "
    "kills it with a message naming a sequence number and no rank or line."
)

DEATH_EXPLANATION = (
    "A rank died (an exception, a signal, or SIGKILL from the OOM killer, which leaves no "
    "record: its stream just stops). The others then wait for it in their next collective, "
    "or fail once its connections close: the first rank to die is the cause, and the errors "
    "of the others are consequences of it."
)


STALL_EXPLANATION = (
    "One rank that stops for a while (a slow read, a stuck data loader, a filesystem pause) "
    "holds every other rank at its next collective: the whole job waits, and nothing in its "
    "log or exit status says so. The stall watchdog dumped the ranks when no step had come for "
    "a third of the process-group timeout (at most 5 minutes; LORASCOPE_STALL_SECONDS)."
)


def liveness(run: RunData) -> dict[int, bool]:
    """Once every launcher has ended, a rank without an end record died without a word
    (unless `lorascope run` passed a stop on to the job: :func:`stopped_unrecorded`)."""
    if launchers_ended(run) and not passed_on_stop(run):
        return {n: False for n, r in run.ranks.items() if not ending_of(r).known}
    return {}


def passed_on_stop(run: RunData) -> bool:
    """`lorascope run` passed a signal on to the job (the manifest's ``signals``)."""
    return any(launch.get("signals") for launch in run.manifest["launches"])


def stopped_unrecorded(run: RunData) -> bool:
    """The job was stopped through `lorascope run` and no rank recorded how it ended: the
    records cannot tell a hang from a stop (no rank's stack or time of stop), and a rank
    with no end record is no rank that died by itself: no verdict (the summary's headline
    says the job was stopped)."""
    return passed_on_stop(run) and launchers_ended(run) and not any(ending_of(r).known for r in run.ranks.values())


def hang_finding(run: RunData, diagnosis: dict[str, Any]) -> Finding:
    """The diagnosis as a Finding (also what `lorascope hang` adds to its report)."""
    evidence = per_rank_evidence(
        {
            s["rank"]: [
                (
                    f" ({s['state']})",
                    s["where"] or s["state"],
                    f"flight-recorder dump of rank {s['rank']}"
                    if _from_flight(s)
                    else stream_source(run, run.ranks[s["rank"]], f"dump: {s['dumped']}")
                    if s["dumped"]
                    else calls_source(run, run.ranks[s["rank"]]),
                )
            ]
            for s in diagnosis["ranks"]
        }
    )
    stalls = [(r, s) for r in run.ranks.values() if (s := stalled_now(r)) is not None]
    if stalls:
        rank, s = stalls[0]
        evidence.append(
            Evidence(
                "stall watchdog",
                f"no step for {s['seconds']:.0f} s (limit {s['limit']:.0f} s) after step {s['step']}",
                stream_source(run, rank, "stall record"),
            )
        )
    dead = diagnosis["kind"] == "dead-rank"
    first = diagnosis["first_diverged"] or {}
    if dead and isinstance(first.get("died_at"), (int, float)):
        rank = run.ranks[first["rank"]]
        since = float(first["died_at"]) - float(rank.start["t"])
        evidence.insert(
            0,
            Evidence(
                f"rank {first['rank']} died",
                f"after {first['step']} steps, at {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(first['died_at']))} "
                f"({since:.1f} s after its start)",
                stream_source(
                    run, rank, "its last record" if not ending_of(rank).known else "exception/signal/end record"
                ),
            ),
        )
    dumped = any(s["dumped"] for s in diagnosis["ranks"])
    stopped = dumped and all(s["dumped"] in ("stopped", None) for s in diagnosis["ranks"])
    flight = [s["rank"] for s in diagnosis["ranks"] if _from_flight(s)]
    return Finding(
        id=ID,
        title=diagnosis["verdict"],
        severity="error",
        confidence="high" if dumped and diagnosis["kind"] != "unknown" else "medium",
        confidence_reason=(
            "read where each rank was when the job was stopped from outside (its exception's "
            "traceback or its signal's stacks, and the calls in flight then)"
            if stopped
            else "every rank's stack and pending collectives were dumped while it hung"
            if dumped
            else "from the ranks' streams only (no dump taken while it hung)"
        )
        + (
            f"; the collective {ranks_named(flight)} waited in is one the probes cannot see, read from "
            "the flight recorder"
            if flight
            else ""
        ),
        ranks=diagnosis["odd_ranks"] or [s["rank"] for s in diagnosis["ranks"]],
        evidence=evidence,
        explanation=DEATH_EXPLANATION if dead else EXPLANATION,
        fix=diagnosis["fix"],
        details={"hang": diagnosis},
    )


def _from_flight(state: dict[str, Any]) -> bool:
    """Whether the call a rank's diagnosis has it waiting in comes from its flight recorder."""
    return state["state"] == "in-collective" and bool(state["pending"]) and "source" in state["pending"][0]


def from_flight_recorder(bundle: EvidenceBundle) -> list[Finding]:
    """From flight-recorder dumps alone: some ranks wait in a collective that others never
    enqueued, with no rank condition on the way (rank-conditional-hang names that case)."""
    alignment = flight_alignment(bundle)
    first = alignment.first_disagreement if alignment is not None else None
    if first is None or first.kind != "missing" or any(flight_conditions(bundle, first).values()):
        return []
    waiting = sorted(r for r, e in first.entries.items() if not e.completed)
    if not waiting:
        return _behind(first)
    entry = first.entries[waiting[0]]
    site = call_site(entry.frames) or "?"
    missing = first.missing_ranks
    outside, never = _never_enqueued(first)
    at = f" at group {first.group} #{first.seq}"
    evidence = (
        per_rank_evidence(
            {
                r: [
                    (
                        at,
                        f"waits in {first.entries[r].op} at {call_site(first.entries[r].frames) or '?'}",
                        f"flight-recorder dump of rank {r}",
                    )
                ]
                for r in waiting
            }
        )
        + never
    )
    who, gone = rank_ranges(waiting), rank_ranges(missing)
    return [
        Finding(
            id=ID,
            title=f"rank{'s' if len(waiting) > 1 else ''} {who} wait{'' if len(waiting) > 1 else 's'} in "
            f"{entry.op} #{first.seq} on group {first.group} at {site}; rank{'s' if len(missing) > 1 else ''} "
            f"{gone} never enqueued it" + (" (outside any collective)" if outside else ""),
            severity="error",
            confidence="medium",
            confidence_reason="from flight-recorder dumps alone: they show where the waiting ranks are, not "
            f"what rank {missing[0]} does instead (its stack: `lorascope hang`, or py-spy dump); no rank "
            "condition on the waiting ranks' call chain",
            ranks=missing,
            evidence=evidence,
            explanation=EXPLANATION,
            fix=FIXES["stuck-outside" if outside else "unknown"],
            details={"group": first.group, "seq": first.seq, "source": "flight recorder"},
        )
    ]


def _never_enqueued(first: Disagreement) -> tuple[bool, list[Evidence]]:
    """Of the ranks that never enqueued the disagreement's call: whether every one is
    outside any collective (its last call completed, or none), and what each did last."""
    missing = first.missing_ranks
    outside = all(e is None or e.completed for e in (first.waiting_at.get(r) for r in missing))
    at = f" at group {first.group} #{first.seq}"
    evidence = per_rank_evidence(
        {
            r: [
                (
                    at,
                    "never enqueued it; " + last_activity(first.waiting_at.get(r)),
                    f"flight-recorder dump of rank {r}",
                )
            ]
            for r in missing
        }
    )
    return outside, evidence


def _behind(first: Disagreement) -> list[Finding]:
    """From flight-recorder dumps alone, a collective some ranks ran and marked completed
    and others never enqueued: the others fell behind. A warning, not a hang: gloo marks a
    call completed once it fails (as a peer's exit makes it), and a broadcast's root may
    finish before its peers join, but a job stopped while moving also leaves its ranks a
    call or two apart; the dumps alone cannot tell the two."""
    ran, missing = sorted(first.entries), first.missing_ranks
    entry = first.entries[ran[0]]
    outside, never = _never_enqueued(first)
    at = f" at group {first.group} #{first.seq}"
    evidence = (
        per_rank_evidence(
            {
                r: [
                    (at, f"ran {e.op} at {call_site(e.frames) or '?'} (completed)", f"flight-recorder dump of rank {r}")
                ]
                for r, e in first.entries.items()
            }
        )
        + never
    )
    gone = rank_ranges(missing)
    return [
        Finding(
            id=ID,
            title=f"rank{'s' if len(missing) > 1 else ''} {gone} never enqueued {entry.op} #{first.seq} on group "
            f"{first.group}, which {ranks_named(ran)} ran at {call_site(entry.frames) or '?'}: "
            f"{'they' if len(missing) > 1 else 'it'} fell behind"
            + (", outside any collective" if outside else "")
            + " (stuck, or a call behind when the dumps were taken: the dumps alone cannot tell)",
            severity="warning",
            confidence="low",
            confidence_reason="from flight-recorder dumps alone, and the call is marked completed where it ran (gloo "
            "does so once a call fails, and a broadcast's root may finish before its peers join): they cannot tell a "
            "stuck rank from one a call behind when the job was stopped; a run directory has the ranks' stacks",
            ranks=missing,
            evidence=evidence,
            explanation=EXPLANATION,
            fix=FIXES["stuck-outside" if outside else "unknown"],
            details={"group": first.group, "seq": first.seq, "source": "flight recorder"},
        )
    ]


def detect(bundle: EvidenceBundle) -> list[Finding]:
    run = bundle.run
    if run is None or len(run.ranks) < 2:
        return from_flight_recorder(bundle)
    return _hang(bundle, run) + _stall(bundle, run)


def _hang(bundle: EvidenceBundle, run: RunData) -> list[Finding]:
    """The hang the job ended in, or is in now."""
    # A dump taken while the rank moved (`lorascope hang` on a job that was slow, not hung)
    # is no evidence of a hang, during the run or after it.
    stalled = any(stalled_now(r) or not moving_at_dumps(r, run) for r in run.ranks.values())
    waiting = any(c.pending for r in run.ranks.values() for c in r.collectives)
    if not (stalled or waiting) or still_moving(run) or stopped_unrecorded(run):
        return []
    diagnosis = diagnose(run, liveness(run), bundle.flight_timeline)
    if diagnosis["kind"] in ("rank-conditional-hang", "unknown", *NOT_HUNG):
        return []  # rank-conditional-hang names the first; the others have nothing to say
    return [hang_finding(run, diagnosis)]


def _stall(bundle: EvidenceBundle, run: RunData) -> list[Finding]:
    """The longest stall the job came back from, as its stall dumps show it: a warning (the
    job went on, but every rank waited that long for one)."""
    stalls = recovered_stalls(run)
    if not stalls:
        return []
    stall = max(stalls, key=lambda s: s.paused_s)
    diagnosis = diagnose(run, None, bundle.flight_timeline, as_of=stall.t)
    if diagnosis["kind"] == "rank-conditional-hang":
        return []
    finding = hang_finding(run, diagnosis)
    more = f" (the longest of {len(stalls)} stalls)" if len(stalls) > 1 else ""
    dumped = next(r for r in run.ranks.values() if any(float(d["t"]) == stall.t for d in r.dumps))
    watchdog = Evidence(
        "stall watchdog",
        f"no step for {stall.paused_s:.0f} s across step {stall.step}; every rank it dumped made steps after it",
        stream_source(run, dumped, "stall dump"),
    )
    return [
        replace(
            finding,
            evidence=[*finding.evidence, watchdog],
            title=f"the job stalled for {stall.paused_s:.0f} s after step {stall.step}{more}, then went on; "
            f"when the stall watchdog dumped the ranks, {diagnosis['verdict']}",
            severity="warning",
            confidence="low" if diagnosis["kind"] == "unknown" else finding.confidence,
            confidence_reason="read from the stall watchdog's dumps (each rank's stack and calls in flight once no "
            "step had come for a while); the ranks made steps again after it",
            explanation=STALL_EXPLANATION,
            details={
                "stall": {"t": stall.t, "step": stall.step, "paused_s": round(stall.paused_s, 3)},
                "hang": diagnosis,
            },
        )
    ]
