"""Findings as terminal text: the verdict first, then evidence and the fix."""

from __future__ import annotations

import textwrap

from lorascope.detect.finding import Finding
from lorascope.units import ranks_named


def _ranks(ranks: list[int]) -> str:
    return ranks_named(ranks) if ranks else "all ranks"


def render_findings(findings: list[Finding]) -> str:
    if not findings:
        return "no problem found by the detectors"
    out: list[str] = []
    for f in findings:
        out.append(f"{f.id}  {f.severity.upper()}  confidence {f.confidence}  {_ranks(f.ranks)}")
        out.append(f"  {f.title}")
        for ev in f.evidence:
            out.append(f"  - {ev.label}: {ev.value}  [{ev.source}]")
        out.append(textwrap.fill(f.explanation, 100, initial_indent="  why: ", subsequent_indent="       "))
        out.append(textwrap.fill(f.fix, 100, initial_indent="  fix: ", subsequent_indent="       "))
        out.append(f"  confidence: {f.confidence_reason}")
        out.append("")
    return "\n".join(out).rstrip()
