"""Collectives some ranks made alone (under a rank condition, or in an evaluation the others
did not run or ran shorter) before the ranks' calls first disagree: they paired silently
with the others' calls of the same op, and from there the ranks' calls were out of step
until the ops parted.

The classic is an evaluation on rank 0 only under ZeRO-3: ``if rank == 0: evaluate()``
runs a forward, the forward gathers parameters, and rank 0's gathers pair with the other
ranks' gathers of their next training forward. No rank condition encloses either call
where the ops finally differ (rank 0 gathers in its training forward, the others
reduce-scatter in their backward); the rank-only calls before it carry one (the probes
record the caller whose line sits inside it: a call's ``via``). Each member's calls of
the group are compared sequence number by sequence number, back from the divergence: a
number at which some ranks' calls sit directly inside a rank condition and the others'
inside none is a rank-only call; so is one some ranks made in an evaluation (their ``eval``
phase: a forward under ``no_grad``) while the others were training. The run of them
nearest the divergence is named. When every rank evaluated then and some ran more forwards
in it (generation until each rank's own sequences end, evaluation shards of different
lengths), the verdict gives each rank's forwards: the fix is to run as many on every rank,
not to run the evaluation on every rank (they all did). A rank still in such an evaluation
meets the others' next call at the divergence itself: that call is the rank-only one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lorascope.detect.common import short_site
from lorascope.detect.hang.branches import phases_begun
from lorascope.detect.hang.conditions import call_condition
from lorascope.detect.hang.divergence import Divergence, conditions_at
from lorascope.detect.hang.zero_state import explained_by
from lorascope.rundir.format.ops import P2P_OPS
from lorascope.rundir.format.sources import ELSE
from lorascope.rundir.loading.reader import Collective, RankData, RunData
from lorascope.units import group_named, ranks_named

FIX = (
    "Run the code those calls came from on every rank, or keep collectives out of it: an evaluation, a "
    "generation or a save that runs a forward under ZeRO-3 (or FSDP) gathers parameters, and each gather is "
    "a collective every rank must make. Evaluate on every rank (each on its shard of the data) and act on "
    "the result on one: `metrics = evaluate(model); if rank == 0: log(metrics)`."
)

#: The fix when every rank evaluated and some ran more forwards in it.
LONGER_FIX = (
    "Make every rank run as many forwards: a loop that stops on each rank's own data (generation until its "
    "sequences end, an evaluation over shards of different lengths) must go on until every rank is done. "
    "Under ZeRO-3 or FSDP pass `synced_gpus=True` to `generate`, give every rank an evaluation shard of one "
    "length, or all_reduce an 'all done' flag each iteration and stop together."
)

EXPLANATION = (
    " Here no rank condition encloses the calls where the ops part: before them, some ranks made collectives "
    "the others did not, under a rank condition (an evaluation forward on rank 0 under ZeRO-3 gathers "
    "parameters) or in a loop that ran longer on them (generation until each rank's own sequences end), and "
    "those paired with the others' calls of the same op, so the ranks' calls went on out of step, silently "
    "while the ops matched."
)


@dataclass(frozen=True)
class RankOnlyCalls:
    """Collectives #``first``..#``last`` of ``group`` that ``ranks`` made inside a rank
    condition (``condition``), or in an evaluation (``evaluating``), while ``others`` made
    theirs inside none."""

    group: str
    first: int
    last: int
    ranks: list[int]
    others: list[int]
    #: The odd ranks' first call, and the others' call it paired with (the first other rank's).
    call: Collective
    paired: Collective
    #: The rank condition and the frame it encloses (the call site, or the caller the probes
    #: named); None when none was read and the calls were told apart by the evaluation alone.
    condition: tuple[str, str] | None
    #: The odd ranks made them in an evaluation (their ``eval`` phase), the others did not.
    evaluating: bool
    #: When every rank evaluated in that step and the odd ranks ran more forwards in it:
    #: the forwards each rank ran in its evaluation then.
    evals: dict[int, int] | None = None

    @property
    def fix(self) -> str:
        return LONGER_FIX if self.evals else FIX

    def phrase(self) -> str:
        """``rank 0 alone made all_gather_into_tensor #325 on default_pg at train.py:347 in
        loss, called from eval.py:33 in main under `if rank == 0:` (after its step 4)``."""
        alone = " alone" if len(self.ranks) == 1 else ""
        count = self.last - self.first + 1
        what = (
            f"{self.call.op} #{self.first}"
            if count == 1
            else f"{count} collectives (#{self.first}-#{self.last}), the first {self.call.op},"
        )
        where = f"at {short_site(self.call.site)}"
        if self.condition is not None:
            cond, frame = self.condition
            where = (
                f"at {short_site(frame)} under `{cond}`"
                if frame == self.call.site
                else f"{where}, called from {short_site(frame)} under `{cond}`"
            )
        if self.evals:
            counts: dict[int, list[int]] = {}
            for n, count in sorted(self.evals.items()):
                counts.setdefault(count, []).append(n)
            ran = ", ".join(f"{ranks_named(ns)} ran {count}" for count, ns in sorted(counts.items(), reverse=True))
            its = "its" if len(self.ranks) == 1 else "their"
            return (
                f"{ranks_named(self.ranks)} ran more forwards in {its} evaluation after step {self.call.step} than "
                f"the others ({ran}): {its} extra {what} on {group_named(self.group)} {where}"
            )
        during = " in an evaluation the others did not run" if self.evaluating else ""
        unread = "; no rank condition was read around it" if self.condition is None else ""
        return (
            f"{ranks_named(self.ranks)}{alone} made {what} on {group_named(self.group)} {where}{during} "
            f"(after its step {self.call.step}{unread})"
        )

    def said(self, div: Divergence, summary: str) -> str:
        """The verdict: the rank-only calls, what they paired with, and where the ops parted
        (there, when the first rank-only call is the divergence itself)."""
        if self.first == div.seq:
            return (
                f"{self.phrase()}: it met {ranks_named(self.others)}'s {self.paired.op} at "
                f"{short_site(self.paired.site)}, where the ranks' calls first disagree ({summary})"
            )
        return (
            f"{self.phrase()}: it paired with {ranks_named(self.others)}'s {self.paired.op} at "
            f"{short_site(self.paired.site)}, and from there the ranks' calls were out of step until collective "
            f"#{div.seq} on {group_named(div.group)}, where they first disagree ({summary})"
        )

    def as_data(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "first": self.first,
            "last": self.last,
            "ranks": self.ranks,
            "others": self.others,
            "op": self.call.op,
            "site": self.call.site,
            "paired_with": {"op": self.paired.op, "site": self.paired.site},
            "condition": list(self.condition) if self.condition is not None else None,
            "evaluating": self.evaluating,
            "evals": {str(n): c for n, c in self.evals.items()} if self.evals else None,
        }


#: A rank's rank conditions by call site and caller (a rank's thousands of calls come from a few lines).
_Memo = dict[tuple[str | None, str | None], tuple[str, str] | None]


class _Rank:
    """One member's calls of the group up to the divergence, with what tells a rank-only
    one: the rank condition around it (memoised by site and caller), and whether it was
    made in an evaluation (the rank's ``eval`` phases, as spans of time)."""

    def __init__(self, rank: RankData, group: str, last: int) -> None:
        self.rank = rank
        self.calls = {
            c.seq: c for c in rank.collectives if c.group == group and c.seq <= last and c.op not in P2P_OPS
        }  # as the group's alignment has them (divergence.by_group): no point-to-point call
        self._memo: _Memo = {}
        self._evals: list[tuple[float, float]] = []
        began: float | None = None
        for edge in rank.phases:
            if edge["name"] != "eval":
                continue
            if edge["edge"] == "begin":
                began = float(edge["t"])
            elif began is not None:
                self._evals.append((began, float(edge["t"])))
                began = None
        if began is not None:
            self._evals.append((began, math.inf))

    def condition(self, call: Collective) -> tuple[str, str] | None:
        """The rank condition around ``call`` (:func:`call_condition`)."""
        key = (call.site, call.via)
        if key not in self._memo:
            self._memo[key] = call_condition(self.rank, call)
        return self._memo[key]

    def direct(self, call: Collective) -> bool:
        """Whether ``call`` sits directly inside a rank condition (not in its ``else``)."""
        found = self.condition(call)
        return found is not None and not found[0].startswith(ELSE)

    def evaluating(self, call: Collective) -> bool:
        """Whether ``call`` began in one of the rank's evaluations."""
        return any(t0 <= call.start <= t1 for t0, t1 in self._evals)

    def marked(self) -> set[int]:
        """The numbers of the calls that may be rank-only: inside a rank condition, or in an evaluation."""
        return {s for s, c in self.calls.items() if self.direct(c) or self.evaluating(c)}


def _odd_at(ranks: dict[int, _Rank], seq: int) -> tuple[list[int], tuple[str, str] | None, bool] | None:
    """At ``seq``: the ranks whose call sits directly inside a rank condition while every
    other's sits inside none (an ``if``/``else`` pair, both sides conditioned, is no
    rank-only call), else the ranks whose call was made in an evaluation while the others'
    was not; with the condition and whether they were evaluating. None when no rank's
    call is rank-only, or a member's records do not hold the call (nothing can be said of
    the pairing then)."""
    calls = {n: r.calls.get(seq) for n, r in ranks.items()}
    held = {n: c for n, c in calls.items() if c is not None}
    if len(held) < len(calls):
        return None
    odd = [n for n, c in held.items() if ranks[n].direct(c)]
    if odd and all(ranks[n].condition(c) is None for n, c in held.items() if n not in odd):
        return odd, ranks[odd[0]].condition(held[odd[0]]), ranks[odd[0]].evaluating(held[odd[0]])
    odd = [n for n, c in held.items() if ranks[n].evaluating(c)]
    if odd and len(odd) < len(held):
        return odd, None, True
    return None


def before(run: RunData, div: Divergence) -> RankOnlyCalls | None:
    """The run of rank-only calls nearest before ``div`` in its group, else one at ``div``
    itself (see the module's docstring); None when there is none."""
    members = sorted(div.calls)
    if len(members) < 2 or any(n not in run.ranks for n in members):
        return None
    ranks = {n: _Rank(run.ranks[n], div.group, div.seq) for n in members}
    marked = set().union(*(r.marked() for r in ranks.values()))
    # the calls before the divergence first, nearest first; then the diverging call itself
    # (a rank still in an evaluation that ran longer on it meets the others' next call there)
    for last in [*sorted(marked - {div.seq}, reverse=True), *([div.seq] if div.seq in marked else [])]:
        hit = _odd_at(ranks, last)
        if hit is None:
            continue
        odd, condition, evaluating = hit
        first = last
        while (earlier := _odd_at(ranks, first - 1)) is not None and earlier[0] == odd:
            first -= 1
        others = [n for n in members if n not in odd]
        call = ranks[odd[0]].calls[first]
        evals = _eval_forwards(run, members, call.step) if condition is None else None
        return RankOnlyCalls(
            group=div.group,
            first=first,
            last=last,
            ranks=odd,
            others=others,
            call=call,
            paired=ranks[others[0]].calls[first],
            condition=condition,
            evaluating=evaluating,
            evals=evals if evals and all(evals[n] for n in others) and len(set(evals.values())) > 1 else None,
        )
    return None


def _eval_forwards(run: RunData, members: list[int], step: int) -> dict[int, int]:
    """The forwards each rank ran in its evaluations after ``step`` steps (its ``eval``
    phases then: a forward under ``no_grad`` is one)."""
    return {n: phases_begun(run.ranks[n], "eval")[step] for n in members}


def explains(run: RunData, div: Divergence | None) -> RankOnlyCalls | None:
    """The rank-only calls before ``div`` (:func:`before`) when nothing nearer explains it:
    no rank condition at the diverging calls themselves, no rank-only entry into ZeRO-3's
    parameter state. Computed once a divergence (`hang`'s verdict and two detectors ask)."""
    if div is None or any(conditions_at(run, div).values()) or explained_by(run, div) is not None:
        return None
    key = f"rank_only_calls {div.group}#{div.seq}"
    if key not in run.derived:
        run.derived[key] = before(run, div)
    found: RankOnlyCalls | None = run.derived[key]
    return found
