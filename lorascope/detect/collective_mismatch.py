"""collective-mismatch: the ranks run the same collective with different sizes or dtypes.

Evidence: the flight-recorder dumps aligned by sequence number (``flight_align``): the
first entry where every rank runs the same op but with different input/output sizes or
dtypes, and the later entries do not line up shifted by one (which would mean a rank ran
an extra collective: that is rank-conditional-hang's case, as is a different op). Also
gloo's "Received data size doesn't match expected size" in the job's log (low confidence
on its own: an extra collective on one rank produces it too).
"""

from __future__ import annotations

from lorascope.detect.finding import Evidence, Finding
from lorascope.detect.hang.flight_align import Disagreement, flight_alignment
from lorascope.ingest.evidence import EvidenceBundle

ID = "collective-mismatch"
FIX = (
    "make every rank pass tensors of the same shape and dtype to this collective: cast before it (e.g. "
    ".float()), pad variable-length tensors to a common length, or gather sizes first (all_gather of the "
    "lengths, then all_gather_into_tensor of padded data, or all_gather_object)"
)


def _flight_finding(bundle: EvidenceBundle, d: Disagreement) -> Finding:
    evidence = []
    for rank, entry in sorted(d.entries.items()):
        path = bundle.flight_records[rank].path if rank in bundle.flight_records else "?"
        site = next(
            (f for f in entry.frames if "torch/distributed/" not in f), entry.frames[0] if entry.frames else "-"
        )
        evidence.append(
            Evidence(
                f"rank {rank} #{d.seq}",
                f"{entry.op} sizes {entry.input_sizes} dtypes {'/'.join(entry.input_dtypes) or '-'} at {site}",
                f"{path}: entries, collective_seq_id {d.seq}",
            )
        )
    return Finding(
        id=ID,
        title=f"ranks {', '.join(map(str, sorted(d.entries)))} ran {next(iter(d.entries.values())).op} "
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


def detect(bundle: EvidenceBundle) -> list[Finding]:
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
