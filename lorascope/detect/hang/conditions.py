"""Which rank condition a call site sits in: read from the source context of the site
(the line and its enclosing ``if`` / ``while`` conditions, innermost first), recorded by
the probes or read by ingest for flight-recorder frames."""

from __future__ import annotations

import re
from typing import Any

from lorascope.rundir.reader import RankData

RANK_CONDITION = re.compile(
    r"\b(rank|local_rank|global_rank|is_main_process|is_local_main_process|"
    r"is_world_process_zero|main_process|get_rank\(\))\b"
)
#: How the source reader marks the ``else`` branch of a condition.
ELSE = "else of:"


def condition_in(context: dict[str, Any] | None) -> str | None:
    """The innermost enclosing condition in ``context`` that tests the rank, if any."""
    for cond in (context or {}).get("conditions", []):
        if RANK_CONDITION.search(cond):
            return str(cond)
    return None


def chain_condition(chain: list[str], sources: dict[str, dict[str, Any]]) -> tuple[str, str] | None:
    """The first rank condition along a call chain (call site first, then its callers up
    to the job's own code): (the condition, the frame it encloses)."""
    for frame in chain:
        cond = condition_in(sources.get(frame))
        if cond is not None:
            return cond, frame
    return None


def rank_condition(rank: RankData, site: str | None) -> str | None:
    """The rank condition around ``site`` as ``rank`` recorded it."""
    return condition_in(rank.sites.get(site)) if site is not None else None


def odd_by_condition(conditions: dict[int, str | None], include_else: bool) -> list[int]:
    """The ranks whose call sits directly inside a rank condition: they went their own
    way (the ranks in the ``else`` branch do the usual thing). With ``include_else``, the
    ranks in any rank condition when none is direct. None when every rank is odd."""
    odd = [n for n, cond in conditions.items() if cond and not cond.startswith(ELSE)]
    if not odd and include_else:
        odd = [n for n, cond in conditions.items() if cond]
    return [] if len(odd) == len(conditions) else sorted(odd)
