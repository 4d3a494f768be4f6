"""What `lorascope analyze` shows about loaded artifacts, as plain JSON-able data
(``--json`` prints it under "artifacts"; :mod:`lorascope.text.artifacts` lays it out
for a terminal)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from lorascope.detect.finding import Finding
from lorascope.detect.hang.flight_align import flight_alignment
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.ingest.kineto.reader import KinetoTrace


def _plain(value: Any) -> Any:
    """Dataclasses, paths, tuples and non-string keys made JSON-friendly."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def _trace_data(trace: KinetoTrace) -> dict[str, Any]:
    data = {f.name: _plain(getattr(trace, f.name)) for f in fields(trace) if f.name != "raw"}
    data["collectives"] = data["collectives"][:50]
    data["collectives_total"] = len(trace.collectives)
    return data


def artifacts_data(bundle: EvidenceBundle, findings: Sequence[Finding] = ()) -> dict[str, Any]:
    """Everything loaded besides the run directory, as plain data (empty parts left out).
    ``findings``: the analysis's, so that the traces' comparison names no straggler the
    detectors did not (:func:`_one_verdict`)."""
    out: dict[str, Any] = {}
    if bundle.snapshots:
        out["snapshots"] = {str(r): _plain(s) for r, s in sorted(bundle.snapshots.items())}
    if bundle.snapshot_comparison is not None:
        cmp = _plain(bundle.snapshot_comparison)
        cmp["rank_only"] = [{**_plain(a), "only_here": a.only_here} for a in bundle.snapshot_comparison.rank_only]
        out["snapshot_comparison"] = cmp
    if bundle.traces:
        out["traces"] = {str(r): _trace_data(t) for r, t in sorted(bundle.traces.items())}
    if bundle.trace_comparison is not None:
        out["trace_comparison"] = _one_verdict(_plain(bundle.trace_comparison), bundle, findings)
    if bundle.flight_records:
        out["flight_records"] = {
            str(r): {**_plain(d), "entries": len(d.entries)} for r, d in sorted(bundle.flight_records.items())
        }
    alignment = flight_alignment(bundle)
    if alignment is not None:
        align = _plain(alignment)
        for g, group in zip(align["groups"], alignment.groups, strict=True):
            g["disagreements"] = [{**_plain(d), "describe": d.describe()} for d in group.disagreements]
            g["progress"] = {str(r): {**_plain(p), "pending": p.pending} for r, p in group.progress.items()}
        out["flight_alignment"] = align
    if bundle.logs:
        out["logs"] = [_plain(log) for log in bundle.logs]
    return out


def _one_verdict(cmp: dict[str, Any], bundle: EvidenceBundle, findings: Sequence[Finding]) -> dict[str, Any]:
    """With a run directory, the straggler is the straggler detector's, read from every
    step's records; the traces cover a window of a few steps. A rank the traces alone
    single out is then told as what it is, not named a straggler (a healthy run read "no
    problem found", then "straggler: rank 1 computes 2.33x ...")."""
    if bundle.run is None or cmp["straggler"] is None:
        return cmp
    named = {r for f in findings if f.id == "straggler" for r in f.ranks}
    if cmp["straggler"] in named:
        return cmp
    steps = min((t["steps"] for t in cmp["ranks"]), default=0)
    return {
        **cmp,
        "straggler": None,
        "reason": f"no straggler over the run's steps (the straggler detector reads every step's records); in "
        f"the {steps} traced step(s) alone, {cmp['reason']}",
    }
