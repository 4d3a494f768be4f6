"""The Finding: what a detector concludes, with the evidence and the fix."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Severity = Literal["info", "warning", "error"]
Confidence = Literal["low", "medium", "high"]

SEVERITY_ORDER: dict[str, int] = {"info": 0, "warning": 1, "error": 2}
CONFIDENCE_ORDER: dict[str, int] = {"low": 0, "medium": 1, "high": 2}


@dataclass(frozen=True)
class Evidence:
    """One fact behind a finding: a label, its value, and where it comes from
    (a path inside the run directory or artifact, with a line or key where there is one)."""

    label: str
    value: Any
    source: str


@dataclass
class Finding:
    id: str
    title: str
    severity: Severity
    confidence: Confidence
    confidence_reason: str
    ranks: list[int]
    evidence: list[Evidence]
    explanation: str
    fix: str
    #: Free-form data for reports and charts (e.g. the aligned collective table).
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
