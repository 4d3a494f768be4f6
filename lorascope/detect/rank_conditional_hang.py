"""rank-conditional-hang: a collective that only some ranks run.

The ranks' collective records are aligned per process group by sequence number; the
first number at which they disagree (a different op or size) is the divergence. The odd rank is the one
whose call site sits inside a rank condition (``if rank == 0:``, ``is_main_process``),
read from the source context the probes recorded.
"""

from __future__ import annotations

from typing import Any

from lorascope.detect.common import calls_source, pending_state, per_rank_evidence, short_site, stream_source
from lorascope.detect.finding import Confidence, Evidence, Finding
from lorascope.detect.hang import branches, rank_only_calls
from lorascope.detect.hang.conditions import call_condition, odd_by_condition
from lorascope.detect.hang.diagnosis import FIXES, P2P_FIX
from lorascope.detect.hang.divergence import Divergence, first_divergence, found_at, odd_ranks, size_mismatch
from lorascope.detect.hang.flight_align import flight_alignment, flight_conditions, last_activity
from lorascope.detect.hang.rank_only_calls import RankOnlyCalls
from lorascope.detect.hang.zero_state import FIX as ZERO_FIX
from lorascope.detect.hang.zero_state import RankOnly, calls_summary, explained_by
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.ingest.flight.reader import call_site
from lorascope.rundir.format.ops import P2P_OPS
from lorascope.rundir.loading.ending import ending_of
from lorascope.rundir.loading.reader import Collective, RankData, RunData
from lorascope.units import fmt_bytes, group_named, ranks_named, short_error

ID = "rank-conditional-hang"


def _describe(call: Collective | None, rank: RankData, run: RunData) -> str:
    if call is None:
        return "never issued it"
    size = "" if call.bytes is None else f" ({fmt_bytes(call.bytes)}{', ' + call.dtype if call.dtype else ''})"
    state = (
        pending_state(call, rank, run)
        if call.pending
        else ("failed: " + short_error(call.err, 160) if call.err else "completed")
    )
    return f"{call.op} #{call.seq}{size} at {call.site or '?'} — {state}"


EXPLANATION = (
    "Collectives match up by order: every rank of a process group must call the same "
    "collectives in the same sequence. A collective inside a block only some ranks "
    "enter (evaluation, logging or saving on rank 0, a ZeRO-3 parameter gather on the "
    "main process) pairs with a different call on the others; they wait on each other "
    "until the watchdog kills the job (30 minutes by default), or, on gloo, fail with "
    "mismatched sizes."
)
FIX = FIXES["rank-conditional-hang"]


def _at_site(found: tuple[str, str] | None, site: str | None) -> bool:
    return found is None or found[1] == site


def _where(site: str | None, found: tuple[str, str] | None) -> str:
    """The call site, and the user's line above it when the condition sits there."""
    text = f"at {short_site(site)}"
    if found is None:
        return text
    cond, frame = found
    return text + (f" inside `{cond}`" if frame == site else f", called from {short_site(frame)} inside `{cond}`")


def from_flight_recorder(bundle: EvidenceBundle) -> list[Finding]:
    """The same verdict from torch's flight-recorder dumps alone (no run directory): at the
    first sequence number where the ranks disagree, ranks that ran a different op, or that
    enqueued a call the others never did, from inside a rank condition (on their call
    site's line or a caller's up to the job's own code)."""
    alignment = flight_alignment(bundle)
    first = alignment.first_disagreement if alignment is not None else None
    if first is None or first.kind not in ("op", "missing"):
        return []  # sizes/dtypes: collective-mismatch
    found = flight_conditions(bundle, first)
    conditions = {r: f[0] if f else None for r, f in found.items()}
    odd = odd_by_condition(conditions, include_else=False)
    if first.kind == "missing" and not odd:
        return []  # no rank condition: hung-ranks says who waits where
    if not odd:
        odd = sorted(first.extra_on)
        if len(odd) == len(first.entries):
            odd = []
    sites = {r: call_site(e.frames) for r, e in first.entries.items()}
    rows: dict[int, list[tuple[str, Any, str]]] = {}
    for r, entry in sorted(first.entries.items()):
        sizes = f" {list(entry.input_sizes)}" if entry.input_sizes else ""
        dtypes = f" {'/'.join(entry.input_dtypes)}" if entry.input_dtypes else ""
        done = "completed" if entry.completed else "not completed"
        own = rows[r] = [
            (
                f" at group {first.group} #{first.seq}",
                f"{entry.op}{sizes}{dtypes} at {sites[r] or '?'} — {done}",
                f"flight-recorder dump of rank {r}",
            )
        ]
        context = bundle.sources.get(sites[r] or "")
        if context and context.get("line"):
            cond = found[r]
            inside = f"   inside `{cond[0]}`" if cond and cond[1] == sites[r] else ""
            own.append((" source", context["line"] + inside, sites[r] or "?"))
        cond = found[r]
        if cond is not None and cond[1] != sites[r]:
            line = (bundle.sources.get(cond[1]) or {}).get("line") or "?"
            own.append((" called it from", f"{line}   inside `{cond[0]}`", cond[1]))
    # the ranks that ran it, then those that never did, each grouped when alike (sizes exact)
    evidence = per_rank_evidence(rows, show="exact") + per_rank_evidence(
        {
            r: [
                (
                    f" at group {first.group} #{first.seq}",
                    "never enqueued it; " + last_activity(first.waiting_at.get(r)),
                    f"flight-recorder dump of rank {r}",
                )
            ]
            for r in first.missing_ranks
        }
    )
    who = f"rank {odd[0]}" if odd else "the ranks"
    odd_entry = first.entries.get(odd[0]) if odd else None
    title = f"{who} {'runs' if odd_entry else 'disagree on'} collective #{first.seq} on group {first.group}"
    if odd_entry is not None:
        title += f": {odd_entry.op} {_where(sites[odd[0]], found[odd[0]])}"
    if first.missing_ranks:
        title += f"; {ranks_named(first.missing_ranks)} never enqueued it"
    sure = any(conditions.values())
    # every call's source read, and no rank condition in it: a branch on the data
    branched = not sure and all(bundle.sources.get(site or "") for site in sites.values())
    return [
        Finding(
            id=ID,
            title=title,
            severity="error",
            confidence="high" if sure else "medium",
            confidence_reason=(
                "the odd rank's call site is inside a rank condition"
                + ("" if not odd or _at_site(found[odd[0]], sites.get(odd[0])) else ", in a caller's frame")
                if sure
                else "the flight-recorder dumps disagree on the op and no rank condition encloses the calls"
                if branched
                else "the flight-recorder dumps disagree on the op; the source was not readable "
                "here to find the rank condition"
            ),
            ranks=odd or sorted(first.entries),
            evidence=evidence,
            explanation=EXPLANATION + (branches.EXPLANATION if branched else ""),
            fix=branches.FIX if branched else FIX,
            details={"group": first.group, "seq": first.seq, "odd_ranks": odd, "source": "flight recorder"},
        )
    ]


def _one_sided(run: RunData) -> list[Finding]:
    """A send or receive some ranks wait in while every other rank waits in a collective:
    its peer never made the matching call (point-to-point calls pair one rank with another,
    so they are no part of a group's alignment)."""
    last = {n: next((c for c in reversed(r.collectives) if c.pending), None) for n, r in run.ranks.items()}
    if any(c is None for c in last.values()):
        return []
    odd = [n for n, c in last.items() if c is not None and c.op in P2P_OPS]
    if not odd or len(odd) == len(last):
        return []
    found = {n: call_condition(run.ranks[n], c) for n, c in last.items() if n in odd}
    rows = {n: [("", _describe(c, run.ranks[n], run), calls_source(run, run.ranks[n]))] for n, c in last.items()}
    call = last[odd[0]]
    assert call is not None
    sure = all(found.values())
    return [
        Finding(
            id=ID,
            title=f"rank-conditional point-to-point {call.op} ({ranks_named(odd)}): {call.op} #{call.seq} on "
            f"{group_named(call.group)} {_where(call.site, found[odd[0]])}, while "
            f"{_waiting(sorted(set(last) - set(odd)))}",
            severity="error",
            confidence="high" if sure else "medium",
            confidence_reason="its call sits inside a rank condition"
            if sure
            else "no rank condition was found around it: its peer went elsewhere",
            ranks=odd,
            evidence=per_rank_evidence(rows),
            explanation=EXPLANATION,
            fix=P2P_FIX,
            details={"odd_ranks": odd, "op": call.op, "group": call.group, "seq": call.seq},
        )
    ]


def _waiting(ranks: list[int]) -> str:
    return f"{ranks_named(ranks)} {'waits in a collective' if len(ranks) == 1 else 'wait in collectives'}"


def detect(bundle: EvidenceBundle) -> list[Finding]:
    run = bundle.run
    div = first_divergence(run) if run is not None and len(run.ranks) >= 2 else None
    if run is not None and div is None and len(run.ranks) >= 2:
        return _one_sided(run) or from_flight_recorder(bundle)
    if run is None or div is None:
        return from_flight_recorder(bundle)
    rank_only = explained_by(run, div)
    apart = rank_only_calls.explains(run, div)
    if size_mismatch(run, div) and rank_only is None and apart is None:
        return []  # collective-mismatch names it
    found = found_at(run, div)
    conditions = {n: f[0] if f else None for n, f in found.items()}
    odd = rank_only.ranks if rank_only is not None else apart.ranks if apart is not None else odd_ranks(run, div)
    rows: dict[int, list[tuple[str, Any, str]]] = {}
    for n, call in sorted(div.calls.items()):
        rank = run.ranks[n]
        own = rows[n] = [(f" at {div.group} #{div.seq}", _describe(call, rank, run), calls_source(run, rank))]
        if call is not None and call.site:
            context = rank.sites.get(call.site, {})
            if context.get("line"):
                cond = conditions[n] if _at_site(found[n], call.site) else None
                own.append((" source", f"{context['line']}" + (f"   inside `{cond}`" if cond else ""), call.site))
            via = found[n]
            if via is not None and via[1] != call.site:
                line = rank.sites.get(via[1], {}).get("line") or "?"
                own.append((" called it from", f"{line}   inside `{via[0]}`", via[1]))
    if rank_only is not None:
        _rank_only_rows(run, rank_only, rows)
    if apart is not None:
        _apart_rows(run, apart, rows)
    branched = rank_only is None and apart is None and not any(conditions.values())
    if branched:
        _step_rows(run, div, rows)
    evidence = per_rank_evidence(rows)
    crashed = [r for r in run.ranks.values() if r.exception]
    if crashed:
        detail = ending_of(crashed[0]).detail or "an exception"
        evidence.append(
            Evidence(
                "how it ended",
                f"rank {crashed[0].rank}: {short_error(detail.splitlines()[0], 200)}",
                stream_source(run, crashed[0], "exception record"),
            )
        )
    others = sorted(set(div.calls) - set(odd))
    who = f"{ranks_named(odd)} vs {ranks_named(others)}" if odd else "the ranks"
    first_odd = div.calls.get(odd[0]) if odd else None
    headline = (
        branches.branch_said(run, div)
        if branched
        else f"{who} disagree from collective #{div.seq} on {group_named(div.group)}"
        + (f": rank {odd[0]} runs {first_odd.op} {_where(first_odd.site, found.get(odd[0]))}" if first_odd else "")
    )
    confidence: Confidence = "high" if any(conditions.values()) else "medium"
    reason = (
        "the odd rank's call site is inside a rank condition"
        if confidence == "high"
        else "sequences disagree but no rank condition was found at the call sites"
    )
    if rank_only is not None:
        headline = (
            f"{rank_only.phrase()}, before collective #{div.seq} on {group_named(div.group)}, where the ranks' calls first "
            f"disagree ({calls_summary(div)})"
        )
        confidence = "high" if rank_only.sure else "medium"
        reason = (
            f"every rank recorded its call at the divergence, and only {ranks_named(rank_only.ranks)} recorded "
            "entering ZeRO-3's parameter state there before it"
            if rank_only.sure
            else f"{ranks_named(rank_only.ranks)} recorded the entry; the others' records do not cover the divergence"
        )
    if apart is not None:
        headline, confidence = apart.said(div, calls_summary(div)), "high" if apart.condition else "medium"
        told = (
            "inside a rank condition, the others inside none"
            if apart.condition
            else "in an evaluation that ran longer on it, the others in training after theirs (the ranks' eval phases)"
            if apart.evals
            else "in an evaluation, the others in training; no rank condition was read around it (a flag set from "
            "the rank elsewhere is one lorascope cannot read)"
        )
        reason = f"every rank recorded collective #{apart.first} on {group_named(apart.group)}: {ranks_named(apart.ranks)} made it {told}"
    details: dict[str, Any] = {
        "group": div.group,
        "seq": div.seq,
        "odd_ranks": odd,
        **({"rank_only": rank_only.as_data()} if rank_only is not None else {}),
        **({"rank_only_calls": apart.as_data()} if apart is not None else {}),
        "calls": {
            str(n): None
            if c is None
            else {"op": c.op, "bytes": c.bytes, "dtype": c.dtype, "site": c.site, "pending": c.pending, "err": c.err}
            for n, c in div.calls.items()
        },
    }
    return [
        Finding(
            id=ID,
            title=headline,
            severity="error",
            confidence=confidence,
            confidence_reason=reason,
            ranks=sorted(odd) or sorted(div.calls),
            evidence=evidence,
            explanation=EXPLANATION
            + (
                ZERO_EXPLANATION
                if rank_only is not None
                else rank_only_calls.EXPLANATION
                if apart is not None
                else branches.EXPLANATION
                if branched
                else ""
            ),
            fix=ZERO_FIX
            if rank_only is not None
            else apart.fix
            if apart is not None
            else branches.FIX
            if branched
            else P2P_FIX
            if first_odd is not None and first_odd.op in P2P_OPS
            else FIX,
            details=details,
        )
    ]


ZERO_EXPLANATION = (
    " Here no rank condition encloses the diverging calls: before them, some ranks alone entered ZeRO-3's "
    "parameter state (GatheredParameters gathers and re-partitions parameters on the ranks that enter it, "
    "even when it issues no collective then), so their next all-gathers differ from the others'."
)


def _rank_only_rows(run: RunData, rank_only: RankOnly, rows: dict[int, list[tuple[str, Any, str]]]) -> None:
    """The rank-only entry's evidence, on the ranks that made it: where, its source line
    and the rank condition around it."""
    for n in rank_only.ranks:
        rank = run.ranks[n]
        own = rows.setdefault(n, [])
        own.append(
            (
                " rank-only call before it",
                f"entered deepspeed.zero.{rank_only.what} after step {rank_only.step}",
                stream_source(run, rank, "zero_param records"),
            )
        )
        line = rank.sites.get(rank_only.site or "", {}).get("line")
        if line:
            cond = rank_only.condition
            inside = f"   inside `{cond[0]}`" if cond and cond[1] == rank_only.site else ""
            own.append((" its source", f"{line}{inside}", rank_only.site or "?"))
        if rank_only.condition is not None and rank_only.condition[1] != rank_only.site:
            frame = rank_only.condition[1]
            line = rank.sites.get(frame, {}).get("line") or "?"
            own.append((" called it from", f"{line}   inside `{rank_only.condition[0]}`", frame))


def _apart_rows(run: RunData, apart: RankOnlyCalls, rows: dict[int, list[tuple[str, Any, str]]]) -> None:
    """The rank-only calls' evidence: on the ranks that made them, the first one and the
    line under the rank condition; on the others, the call it paired with."""
    count = apart.last - apart.first + 1
    span = f"#{apart.first}" if count == 1 else f"#{apart.first}-#{apart.last} ({count} calls)"
    for n in apart.ranks:
        rank = run.ranks[n]
        own = rows.setdefault(n, [])
        own.append(
            (
                " rank-only call before it",
                f"{apart.call.op} {span} at {short_site(apart.call.site)} (after step {apart.call.step})",
                calls_source(run, rank),
            )
        )
        if apart.condition is not None:
            cond, frame = apart.condition
            line = rank.sites.get(frame, {}).get("line") or "?"
            own.append(
                (" its source" if frame == apart.call.site else " called it from", f"{line}   inside `{cond}`", frame)
            )
        place = branches.step_place(rank, apart.call) if apart.evaluating else None
        if place is not None:
            own.append((" made it", place.phrase(), stream_source(run, rank, "step and phase records")))
    for n in apart.others:
        rows.setdefault(n, []).append(
            (
                " paired it with",
                f"{apart.paired.op} #{apart.first} at {short_site(apart.paired.site)}, inside no rank condition",
                calls_source(run, run.ranks[n]),
            )
        )


def _step_rows(run: RunData, div: Divergence, rows: dict[int, list[tuple[str, Any, str]]]) -> None:
    """Where in its steps each rank made its call at the divergence (its phase edges)."""
    for n, call in div.calls.items():
        place = branches.step_place(run.ranks[n], call) if call is not None else None
        if place is not None:
            rows.setdefault(n, []).append(
                (" made it", place.phrase(), stream_source(run, run.ranks[n], "step and phase records"))
            )
