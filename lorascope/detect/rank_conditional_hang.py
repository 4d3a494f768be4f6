"""rank-conditional-hang: a collective that only some ranks run.

The ranks' collective records are aligned per process group by sequence number; the
first number at which they disagree (a different op or size) is the divergence. The odd rank is the one
whose call site sits inside a rank condition (``if rank == 0:``, ``is_main_process``),
read from the source context the probes recorded.
"""

from __future__ import annotations

from typing import Any

from lorascope.detect.common import stream_source
from lorascope.detect.finding import Confidence, Evidence, Finding
from lorascope.detect.hang.conditions import condition_in, odd_by_condition
from lorascope.detect.hang.divergence import conditions_at, first_divergence, odd_ranks
from lorascope.detect.hang.flight_align import flight_alignment
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.ingest.flight.reader import call_site
from lorascope.rundir.reader import Collective
from lorascope.units import fmt_bytes

ID = "rank-conditional-hang"


def _describe(call: Collective | None) -> str:
    if call is None:
        return "never issued it"
    size = "" if call.bytes is None else f" ({fmt_bytes(call.bytes)}{', ' + call.dtype if call.dtype else ''})"
    state = "still waiting in it" if call.pending else ("failed: " + call.err[:120] if call.err else "completed")
    return f"{call.op} #{call.seq}{size} at {call.site or '?'} — {state}"


def _short_site(site: str | None) -> str:
    if not site:
        return "?"
    path, _, rest = site.partition(":")
    return f"{path.rsplit('/', 1)[-1]}:{rest}"


EXPLANATION = (
    "Collectives match up by order: every rank of a process group must call the same "
    "collectives in the same sequence. A collective inside a block only some ranks "
    "enter (evaluation, logging or saving on rank 0, a ZeRO-3 parameter gather on the "
    "main process) pairs with a different call on the others; they wait on each other "
    "until the watchdog kills the job (30 minutes by default), or, on gloo, fail with "
    "mismatched sizes."
)
FIX = (
    "Run the collective on every rank and act on the result on rank 0 only: move the "
    "all_reduce / gather / GatheredParameters out of the `if rank == 0:` block (compute on "
    "all ranks, then `if rank == 0: log(...)`)."
)


def from_flight_recorder(bundle: EvidenceBundle) -> list[Finding]:
    """The same verdict from torch's flight-recorder dumps alone (no run directory): the
    first sequence number whose op differs between ranks."""
    alignment = flight_alignment(bundle)
    first = alignment.first_disagreement if alignment is not None else None
    if first is None or first.kind != "op":
        return []  # sizes/dtypes: collective-mismatch; missing ranks: a hang of another kind
    sites = {r: call_site(e.frames) for r, e in first.entries.items()}
    conditions = {r: condition_in(bundle.sources.get(s or "")) for r, s in sites.items()}
    odd = odd_by_condition(conditions, include_else=False) or sorted(first.extra_on)
    if len(odd) == len(first.entries):
        odd = []
    evidence = []
    for r, entry in sorted(first.entries.items()):
        sizes = f" {list(entry.input_sizes)}" if entry.input_sizes else ""
        done = "completed" if entry.completed else "not completed"
        evidence.append(
            Evidence(
                f"rank {r} at group {first.group} #{first.seq}",
                f"{entry.op}{sizes} {'/'.join(entry.input_dtypes)} at {sites[r] or '?'} — {done}",
                f"flight-recorder dump of rank {r}",
            )
        )
        context = bundle.sources.get(sites[r] or "")
        if context and context.get("line"):
            evidence.append(
                Evidence(
                    f"rank {r} source",
                    context["line"] + (f"   inside `{conditions[r]}`" if conditions[r] else ""),
                    sites[r] or "?",
                )
            )
    who = f"rank {odd[0]}" if odd else "the ranks"
    odd_entry = first.entries.get(odd[0]) if odd else None
    return [
        Finding(
            id=ID,
            title=f"{who} {'runs' if odd_entry else 'disagree on'} collective #{first.seq} on group {first.group}"
            + (
                f": {odd_entry.op} at {_short_site(sites[odd[0]])}"
                + (f" inside `{conditions[odd[0]]}`" if conditions[odd[0]] else "")
                if odd_entry
                else ""
            ),
            severity="error",
            confidence="high" if any(conditions.values()) else "medium",
            confidence_reason=(
                "the odd rank's call site is inside a rank condition"
                if any(conditions.values())
                else "the flight-recorder dumps disagree on the op; the source was not readable "
                "here to find the rank condition"
            ),
            ranks=odd or sorted(first.entries),
            evidence=evidence,
            explanation=EXPLANATION,
            fix=FIX,
            details={"group": first.group, "seq": first.seq, "odd_ranks": odd, "source": "flight recorder"},
        )
    ]


def detect(bundle: EvidenceBundle) -> list[Finding]:
    run = bundle.run
    div = first_divergence(run) if run is not None and len(run.ranks) >= 2 else None
    if run is None or div is None:
        return from_flight_recorder(bundle)
    conditions = conditions_at(run, div)
    odd = odd_ranks(run, div)
    evidence: list[Evidence] = []
    for n, call in sorted(div.calls.items()):
        rank = run.ranks[n]
        evidence.append(
            Evidence(f"rank {n} at {div.group} #{div.seq}", _describe(call), stream_source(run, rank, "coll records"))
        )
        if call is not None and call.site:
            context = rank.sites.get(call.site, {})
            if context.get("line"):
                cond = conditions[n]
                evidence.append(
                    Evidence(
                        f"rank {n} source", f"{context['line']}" + (f"   inside `{cond}`" if cond else ""), call.site
                    )
                )
    crashed = [r for r in run.ranks.values() if r.exception]
    if crashed and (exc := crashed[0].exception) is not None:
        evidence.append(
            Evidence(
                "how it ended",
                f"rank {crashed[0].rank}: {exc['type']}: {exc['message'].splitlines()[0][:200]}",
                stream_source(run, crashed[0], "exception record"),
            )
        )
    others = sorted(set(div.calls) - set(odd))
    who = f"ranks {', '.join(map(str, odd))} vs {', '.join(map(str, others))}" if odd else "the ranks"
    first_odd = div.calls.get(odd[0]) if odd else None
    headline = f"{who} disagree from collective #{div.seq} on {div.group}" + (
        f": rank {odd[0]} runs {first_odd.op} at {_short_site(first_odd.site)}"
        f"{' inside `' + str(conditions[odd[0]]) + '`' if conditions.get(odd[0]) else ''}"
        if first_odd
        else ""
    )
    confidence: Confidence = "high" if any(conditions.values()) else "medium"
    reason = (
        "the odd rank's call site is inside a rank condition"
        if confidence == "high"
        else "sequences disagree but no rank condition was found at the call sites"
    )
    details: dict[str, Any] = {
        "group": div.group,
        "seq": div.seq,
        "odd_ranks": odd,
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
            explanation=EXPLANATION,
            fix=FIX,
            details=details,
        )
    ]
