"""A rank-only entry into ZeRO-3's parameter state before the ranks' collectives first
disagree: the cause of a mismatch, hang or crash that no rank condition at the
collective itself explains.

``deepspeed.zero.GatheredParameters`` entered on some ranks only (a save under ``if rank
== 0:``) gathers and re-partitions their parameters; with persistent parameters it issues
no collective then, and the ranks' next forward all-gathers differ. The probes record
every entry (``zero_param`` records, ``lorascope.probes.zero_params``); here each rank's
entries before its own call at the divergence are counted per call site (on its own
clock: each rank's records are compared with its own call), and a site entered more
often on some ranks than on others is rank-only. The latest such entry before the
divergence is the one named, with the rank condition around it (its line's, or a
caller's, as the probes recorded them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lorascope.detect.common import short_site
from lorascope.detect.hang.conditions import rank_condition
from lorascope.detect.hang.divergence import Divergence, conditions_at
from lorascope.rundir.loading.reader import RankData, RunData
from lorascope.rundir.loading.records import ZeroParamRecord
from lorascope.units import ranks_named

#: The probe whose failure leaves a rank's entries unrecorded.
PROBE = "zero-params"

FIX = (
    "Enter GatheredParameters (and any ZeRO-3 parameter gather) on every rank, and act on rank 0 only inside "
    "it: `with deepspeed.zero.GatheredParameters(params): if rank == 0: save(...)`; entering it on one rank "
    "changes that rank's parameter state even when it issues no collective, and the next forward's "
    "all-gathers no longer match."
)


@dataclass(frozen=True)
class RankOnly:
    """A call site entered more often on ``ranks`` than on ``others`` before the divergence."""

    what: str
    site: str | None
    ranks: list[int]
    others: list[int]
    step: int
    #: The rank condition around it and the frame it encloses (the site, or a caller).
    condition: tuple[str, str] | None
    #: Every rank compared recorded its call at the divergence and had the probe on: the
    #: others' records show they did not enter it.
    sure: bool

    def phrase(self) -> str:
        """``rank 0 alone entered GatheredParameters at f.py:33 in save, under `if rank == 0:` (after step 2)``."""
        alone = " alone" if len(self.ranks) == 1 else ""
        text = f"{ranks_named(self.ranks)}{alone} entered deepspeed.zero.{self.what} at {self.site or '?'}"
        if self.condition is not None:
            cond, frame = self.condition
            text += f", under `{cond}`" if frame == self.site else f", called from {frame} under `{cond}`"
        return text + f" (after step {self.step})"

    def as_data(self) -> dict[str, Any]:
        return {
            "what": self.what,
            "site": self.site,
            "ranks": self.ranks,
            "others": self.others,
            "step": self.step,
            "condition": list(self.condition) if self.condition else None,
            "sure": self.sure,
        }


def _condition(rank: RankData, rec: ZeroParamRecord) -> tuple[str, str] | None:
    for frame in (rec.get("site"), rec.get("via")):
        if isinstance(frame, str):
            cond = rank_condition(rank, frame)
            if cond is not None:
                return cond, frame
    return None


def rank_only_entry(run: RunData, div: Divergence) -> RankOnly | None:
    """The rank-only entry into ZeRO-3's parameter state that explains ``div`` (see the
    module's docstring), or None."""
    members = sorted(div.calls)
    if not any(run.ranks[n].zero_params for n in members if n in run.ranks):
        return None
    entries: dict[int, dict[str, list[ZeroParamRecord]]] = {}
    for n in members:
        call = div.calls[n]
        until = call.start if call is not None else math.inf
        by_site: dict[str, list[ZeroParamRecord]] = {}
        for rec in run.ranks[n].zero_params:
            if rec.get("op") == "enter" and float(rec["t"]) <= until:
                by_site.setdefault(str(rec.get("site")), []).append(rec)
        entries[n] = by_site
    found: tuple[float, str, list[int]] | None = None
    for site in {s for by_site in entries.values() for s in by_site}:
        counts = {n: len(entries[n].get(site, [])) for n in members}
        fewest = min(counts.values())
        more = [n for n in members if counts[n] > fewest]
        if not more:
            continue
        last = max(float(entries[n][site][-1]["t"]) - _call_start(div, n) for n in more)  # nearest the divergence
        if found is None or last > found[0]:
            found = (last, site, more)
    if found is None:
        return None
    _, site, more = found
    rank = run.ranks[more[0]]
    rec = entries[more[0]][site][-1]
    others = [n for n in members if n not in more]
    sure = all(div.calls[n] is not None for n in members) and not any(
        e.get("probe") == PROBE for n in others for e in run.ranks[n].probe_errors
    )
    return RankOnly(
        what=str(rec.get("what") or "GatheredParameters"),
        site=rec.get("site") if isinstance(rec.get("site"), str) else None,
        ranks=more,
        others=others,
        step=int(rec.get("step") or 0),
        condition=_condition(rank, rec),
        sure=sure,
    )


def _call_start(div: Divergence, n: int) -> float:
    call = div.calls[n]
    return call.start if call is not None else 0.0


def explained_by(run: RunData, div: Divergence | None) -> RankOnly | None:
    """The rank-only entry into ZeRO-3's parameter state before the divergence, when no
    rank condition at the diverging calls themselves explains it."""
    if div is None or any(conditions_at(run, div).values()):
        return None
    return rank_only_entry(run, div)


#: Kinds of calls named in a divergence's summary, at most (1,024 ranks in a few).
MAX_SUMMARY_CALLS = 3


def calls_summary(div: Divergence) -> str:
    """The ranks' calls at a divergence, alike ones together: ``rank 0 all_gather_into_tensor
    at train.py:342 in f; rank 1 reduce_scatter_tensor at train.py:314 in g``."""
    alike: dict[str, list[int]] = {}
    for n, call in sorted(div.calls.items()):
        what = "never issued it" if call is None else f"{call.op} at {short_site(call.site)}"
        alike.setdefault(what, []).append(n)
    parts = [f"{ranks_named(ns)} {what}" for what, ns in list(alike.items())[:MAX_SUMMARY_CALLS]]
    if len(alike) > MAX_SUMMARY_CALLS:
        parts.append(f"{len(alike) - MAX_SUMMARY_CALLS} more kinds")
    return "; ".join(parts)
