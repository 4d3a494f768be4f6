"""collective-mismatch: the ranks run the same collective with different sizes or dtypes.

Evidence: the flight-recorder dumps aligned by sequence number (``flight_align``): the
first entry where every rank runs the same op but with different input/output sizes or
dtypes, and the later entries do not line up shifted by one (which would mean a rank ran
an extra collective: that is rank-conditional-hang's case, as is a different op). Also
gloo's "Received data size doesn't match expected size" in the job's log (low confidence
on its own: an extra collective on one rank produces it too).
"""

from __future__ import annotations

from typing import Any

from lorascope.detect.common import calls_source, pending_state, per_rank_evidence, short_site, stream_source
from lorascope.detect.finding import Evidence, Finding
from lorascope.detect.hang import rank_only_calls
from lorascope.detect.hang.divergence import first_divergence, size_mismatch
from lorascope.detect.hang.flight_align import Disagreement, flight_alignment
from lorascope.detect.hang.zero_state import explained_by
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.ingest.flight.reader import call_site
from lorascope.rundir.loading.ending import ending_of
from lorascope.units import fmt_bytes, rank_ranges, short_error

ID = "collective-mismatch"
FIX = (
    "make every rank pass tensors of the same shape and dtype to this collective: cast before it (e.g. "
    ".float()), pad variable-length tensors to a common length, or gather sizes first (all_gather of the "
    "lengths, then all_gather_into_tensor of padded data, or all_gather_object)"
)


def _flight_finding(bundle: EvidenceBundle, d: Disagreement) -> Finding:
    rows: dict[int, list[tuple[str, Any, str]]] = {}
    for rank, entry in sorted(d.entries.items()):
        path = bundle.flight_records[rank].path if rank in bundle.flight_records else "?"
        site = call_site(entry.frames) or "-"
        rows[rank] = [
            (
                f" #{d.seq}",
                f"{entry.op} sizes {entry.input_sizes} dtypes {'/'.join(entry.input_dtypes) or '-'} at {site}",
                f"{path}: entries, collective_seq_id {d.seq}",
            )
        ]
    evidence = per_rank_evidence(rows, show="exact")  # the sizes are the evidence: grouped only when equal
    return Finding(
        id=ID,
        title=f"ranks {rank_ranges(d.entries)} ran {next(iter(d.entries.values())).op} "
        f"#{d.seq} (group {d.group}) with different {d.kind.replace('+', ' and ')}",
        severity="error",
        confidence="high",
        confidence_reason="the flight recorders of the ranks record the same collective with different "
        f"{d.kind.replace('+', ' and ')}, and no rank ran an extra collective before it",
        ranks=sorted(d.entries),
        evidence=evidence,
        explanation="A collective must get the same number of elements of the same type on every rank. Gloo "
        "aborts when the byte counts differ, NCCL may hang or silently reduce garbage; when the "
        "bytes happen to match (as 8 float32 and 4 float64 do) nothing fails and the result is wrong.",
        fix=FIX,
        details={"group": d.group, "seq": d.seq, "kind": d.kind},
    )


def _run_finding(bundle: EvidenceBundle) -> Finding | None:
    """From run records: every rank made the same call from the same line with different
    sizes (see :func:`size_mismatch`), and how the job ended after it."""
    run = bundle.run
    div = first_divergence(run) if run is not None and len(run.ranks) >= 2 else None
    if run is None or div is None or not size_mismatch(run, div):
        return None
    if explained_by(run, div) is not None or rank_only_calls.explains(run, div) is not None:
        return (
            None  # a rank-only entry into ZeRO-3's state, or rank-only calls, before it: rank-conditional-hang names it
        )
    calls = {n: c for n, c in sorted(div.calls.items()) if c is not None}
    first = next(iter(calls.values()))
    by_size: dict[str, list[int]] = {}
    for n, c in calls.items():
        by_size.setdefault(fmt_bytes(c.bytes), []).append(n)
    sizes = ", ".join(f"{size} on rank{'s' if len(ns) > 1 else ''} {rank_ranges(ns)}" for size, ns in by_size.items())
    evidence = per_rank_evidence(
        {
            n: [
                (
                    f" at {div.group} #{div.seq}",
                    f"{c.op} {fmt_bytes(c.bytes)} {c.dtype or ''} at {c.site or '?'}"
                    + (
                        f" — failed: {short_error(c.err, 160)}"
                        if c.err
                        else f" — {pending_state(c, run.ranks[n], run)}"
                        if c.pending
                        else ""
                    ),
                    calls_source(run, run.ranks[n]),
                )
            ]
            for n, c in calls.items()
        },
        show="exact",
    )
    # A rank that raised a fatal signal (gloo's abort) is the cause; the others' errors (the
    # peer closed the connection) follow from it, and a signal sent from outside (the
    # launcher's SIGTERM to the ranks left once one died) follows from both.
    died = sorted(
        ((n, e) for n in calls if (e := ending_of(run.ranks[n])).status in ("signal", "exception") and not e.teardown),
        key=lambda d: (not d[1].fatal, d[1].status != "exception", d[0]),
    )
    crashed = ""
    if died:
        n, end = died[0]
        detail = short_error((end.detail or end.status).splitlines()[0], 200)
        crashed = f"; it crashed the job (rank {n}: {detail})"
        evidence.append(Evidence("how it ended", f"rank {n}: {detail}", stream_source(run, run.ranks[n], "end")))
    return Finding(
        id=ID,
        title=f"ranks {rank_ranges(calls)} ran {first.op} #{div.seq} ({div.group}) at "
        f"{short_site(first.site)} with different sizes ({sizes}){crashed}",
        severity="error",
        confidence="high",
        confidence_reason="every rank recorded the same collective from the same line with a different size, "
        "inside no rank condition",
        ranks=sorted(calls),
        evidence=evidence,
        explanation="A collective must get the same number of elements of the same type on every rank. Gloo "
        "aborts when the byte counts differ, NCCL may hang or silently reduce garbage.",
        fix=FIX,
        details={"group": div.group, "seq": div.seq, "kind": "size", "source": "run records"},
    )


def detect(bundle: EvidenceBundle) -> list[Finding]:
    found = _run_finding(bundle)
    if found is not None:
        return [found]
    findings: list[Finding] = []
    alignment = flight_alignment(bundle)
    if alignment is not None:
        for group in alignment.groups:
            first = group.first_disagreement
            if first is not None and first.kind not in ("op", "missing") and not first.extra_on:
                findings.append(_flight_finding(bundle, first))
    if findings:
        return findings
    for log in bundle.logs:
        lines = log.of_kind("gloo-size-mismatch")
        if lines:
            findings.append(
                Finding(
                    id=ID,
                    title="gloo received a different amount of data than the collective expected",
                    severity="error",
                    confidence="low",
                    confidence_reason="gloo's error alone: a size mismatch, or one rank running an extra collective "
                    "(see rank-conditional-hang), give the same message",
                    ranks=sorted({x.rank for x in lines if x.rank is not None}),
                    evidence=[Evidence("gloo error", x.text[:200], f"{log.path}:{x.line}") for x in lines[:3]],
                    explanation="Gloo checks the byte count of every message: the ranks disagreed on the size of a "
                    "collective, or on which collective comes next.",
                    fix=FIX + "; if one rank runs a collective the others do not, run it on every rank",
                )
            )
    return findings
