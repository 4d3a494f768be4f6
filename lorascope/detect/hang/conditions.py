"""Which rank condition a call site sits in: read from the source context of the site
(the line and its enclosing ``if`` / ``while`` conditions, innermost first), recorded by
the probes or read by ingest for flight-recorder frames."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lorascope.rundir.format.sources import ELSE, rank_condition_in
from lorascope.rundir.loading.reader import Collective, RankData


def chain_condition(chain: list[str], sources: Mapping[str, Mapping[str, Any]]) -> tuple[str, str] | None:
    """The first rank condition along a call chain (call site first, then its callers up
    to the job's own code), in ``sources`` (ingest's, or a rank's recorded ``sites``): (the
    condition, the frame it encloses)."""
    for frame in chain:
        cond = rank_condition_in(sources.get(frame))
        if cond is not None:
            return cond, frame
    return None


def rank_condition(rank: RankData, site: str | None) -> str | None:
    """The rank condition around ``site`` as ``rank`` recorded it."""
    return rank_condition_in(rank.sites.get(site)) if site is not None else None


def call_condition(rank: RankData, call: Collective | None) -> tuple[str, str] | None:
    """The rank condition of a recorded call: around its call site, else around the
    caller the probes named (``via``: a library made the call, the user's code under the
    condition called the library). (the condition, the frame it encloses)."""
    if call is None:
        return None
    return chain_condition([f for f in (call.site, call.via) if f is not None], rank.sites)


def odd_by_condition(conditions: dict[int, str | None], include_else: bool) -> list[int]:
    """The ranks whose call sits directly inside a rank condition: they went their own
    way (the ranks in the ``else`` branch do the usual thing). With ``include_else``, the
    ranks in any rank condition when none is direct. None when every rank is odd."""
    odd = [n for n, cond in conditions.items() if cond and not cond.startswith(ELSE)]
    if not odd and include_else:
        odd = [n for n, cond in conditions.items() if cond]
    return [] if len(odd) == len(conditions) else sorted(odd)
