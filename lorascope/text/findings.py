"""Findings as terminal text: the verdict first, then evidence and the fix."""

from __future__ import annotations

import textwrap
from typing import Any

from lorascope.detect.finding import Finding
from lorascope.rundir.loading.ending import RUNNING, ended_badly_headline, no_steps_headline
from lorascope.units import ranks_named


def _ranks(ranks: list[int]) -> str:
    return ranks_named(ranks) if ranks else "all ranks"


def quiet(data: dict[str, Any]) -> str:
    """The headline when no detector found anything, as far as the input lets it say so:
    artifacts alone are not a run; a rank that ended badly is not a healthy run."""
    ranks = data.get("ranks") or []
    if not ranks:
        return (
            "no problem found in the loaded artifacts (no run directory: the detectors that read "
            "the ranks' own records, of hangs, memory over time and gradients, had nothing to read)"
        )
    if data.get("running"):
        return RUNNING
    bad = [r for r in ranks if (r["ended"]["status"], r["ended"]["code"]) != ("exit", 0)]
    if bad:
        return ended_badly_headline(
            [(r["rank"], r["ended"].get("t"), _how(r["ended"]), r["ended"].get("stopped")) for r in bad]
        )
    if not any(r.get("steps") for r in ranks):
        return no_steps_headline(len(ranks))
    every = f"all {len(ranks)} ranks" if len(ranks) > 1 else "its one rank"
    return f"no problem found by the detectors: {every} exited 0"


def _how(ended: dict[str, Any]) -> str:
    """A rank's ending as one line."""
    return (str(ended["detail"] or f"{ended['status']} {ended['code']}").splitlines() or ["?"])[0][:200]


def render_findings(findings: list[Finding], data: dict[str, Any]) -> str:
    """The findings, or (none) :func:`quiet`'s headline; ``data`` is the analysis's."""
    if not findings:
        return quiet(data)
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
