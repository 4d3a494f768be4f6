"""Ranks whose collectives disagree with no rank condition around the calls: they took a
branch on their data, or on their own state, in different ways.

The classic is uneven data: each rank trains until its shard runs out, one shard is a
batch longer, and at the same sequence number one rank is in its next step's backward
while the others have left the training loop for the barrier after it. No ``if rank ==
0:`` encloses either call, so the rank-condition fix ("move the collective out of the
block") would send the reader looking for a block that is not there. What the records do
show is where in its steps each rank made its call (its phase edges): the verdict says
so, and whether the ranks had begun different numbers of steps.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from lorascope.detect.common import short_site
from lorascope.detect.hang.divergence import Divergence, found_at
from lorascope.detect.hang.flight_align import Disagreement
from lorascope.ingest.flight.reader import call_site
from lorascope.rundir.loading.reader import Collective, RankData, RunData
from lorascope.units import group_named, ranks_named

#: Kinds of calls named in a verdict, at most (1,024 ranks make a few kinds).
MAX_KINDS_NAMED = 3

EXPLANATION = (
    " Here no rank condition encloses the calls: a branch on the data or on a rank's own state (a data shard "
    "that runs out first, a skipped batch, a stop decided on one rank) sends the ranks down different paths "
    "just the same."
)
FIX = (
    "Make every rank make the same collective calls: give each rank the same number of batches "
    "(DistributedSampler pads its shards to one length, or drop_last=True; an iterable dataset must yield "
    "as many on every rank), decide early stops and skipped batches on every rank alike (all_reduce the "
    "flag first), and run evaluations and saves that call collectives on every rank. A rank check "
    "lorascope cannot read as one (a flag set from the rank elsewhere) is a rank condition: run the "
    "collective on every rank and act on its result on one."
)


@dataclass(frozen=True)
class StepPlace:
    """Where in its steps a rank made a call: ``done`` steps completed, and ``inside`` its
    next one (with the innermost phase open then, if any) or between steps."""

    done: int
    inside: bool
    phase: str | None = None

    @property
    def begun(self) -> int:
        """The steps the rank had begun."""
        return self.done + int(self.inside)

    def phrase(self, ranks: int = 1) -> str:
        """``in its step 6 (backward)``, ``after its step 5, outside any step`` (``their``
        for more than one of ``ranks``)."""
        its = "its" if ranks == 1 else "their"
        if self.inside:
            return f"in {its} step {self.done + 1}" + (f" ({self.phase})" if self.phase else "")
        return f"after {its} step {self.done}, outside any step" if self.done else f"before {its} first step"


def step_place(rank: RankData, call: Collective) -> StepPlace | None:
    """Where in its steps ``rank`` made ``call``, from its phase edges (an edge's ``step``:
    the steps completed then); None when they do not cover the call: none recorded, or the
    kept ones (a long run keeps one step in N) hold neither the step it was in nor the
    one before."""
    if not rank.phases:
        return None
    done = call.step
    before = [e for e in rank.phases if float(e["t"]) <= call.start and e["step"] >= done - 1]
    if not any(e["step"] == done for e in before) and not (done == 0 or any(e["step"] == done - 1 for e in before)):
        return None
    open_phases: list[str] = []
    inside = False
    for edge in before:
        if edge["step"] != done:
            continue
        inside = True
        if edge["edge"] == "begin":
            open_phases.append(edge["name"])
        elif edge["name"] in open_phases:
            open_phases.remove(edge["name"])
    return StepPlace(done, inside, open_phases[-1] if open_phases else None)


def unconditioned(run: RunData, div: Divergence) -> bool:
    """No rank condition encloses any rank's call at ``div`` (nor a caller's line the
    probes followed a library's call to)."""
    return not any(found_at(run, div).values())


def branch_said(run: RunData, div: Divergence) -> str:
    """The verdict on ``div`` when no rank condition encloses its calls: each kind of call
    (op, site, where in the steps) with its ranks, and what differing steps mean: a step
    before the divergence in which the ranks ran different numbers of forwards, where they
    went out of step; else steps begun in different numbers, or a branch within a step."""
    kinds: dict[tuple[str, str, StepPlace | None], list[int]] = {}
    for n, call in sorted(div.calls.items()):
        if call is None:
            kinds.setdefault(("", "", None), []).append(n)
        else:
            kinds.setdefault((call.op, short_site(call.site), step_place(run.ranks[n], call)), []).append(n)
    said = []
    for (op, site, place), ranks in list(kinds.items())[:MAX_KINDS_NAMED]:
        if not op:
            said.append(f"{ranks_named(ranks)} never issued it")
        else:
            said.append(
                f"{ranks_named(ranks)} {'calls' if len(ranks) == 1 else 'call'} {op} at {site}"
                + (f", {place.phrase(len(ranks))}" if place else "")
            )
    if len(kinds) > MAX_KINDS_NAMED:
        said.append(f"{len(kinds) - MAX_KINDS_NAMED} more kinds of call")
    head = (
        f"the ranks' calls first disagree at collective #{div.seq} on {group_named(div.group)}, with no rank "
        f"condition around them: {'; '.join(said)}"
    )
    apart = out_of_step(run, sorted(div.calls))
    if apart is not None and apart[0] < min(c.step for c in div.calls.values() if c is not None):
        step, counts = apart
        by_count: dict[int, list[int]] = {}
        for n, count in sorted(counts.items()):
            by_count.setdefault(count, []).append(n)
        ran = ", ".join(
            f"{ranks_named(ranks)} ran {count} forward{'s' if count != 1 else ''}"
            for count, ranks in sorted(by_count.items(), reverse=True)
        )
        return head + (
            f": the ranks went out of step in step {step + 1} ({ran} in it): a forward without its backward and "
            "optimizer step on some ranks (a batch skipped), after which their calls paired across steps until here"
        )
    if len({place.begun for (_, _, place) in kinds if place is not None}) > 1:
        return head + (
            ": the ranks had begun different numbers of steps; some left the training loop first (a data shard that "
            "ran out, an early stop), or made a call between steps that the others did not"
        )
    return head + ": a branch on the data or on the rank's own state took them different ways"


def phases_begun(rank: RankData, name: str) -> Counter[int]:
    """How many ``name`` phases (a forward, an evaluation's forward) ``rank`` began in each
    step of its kept phase edges (by an edge's ``step``: the steps completed then)."""
    return Counter(e["step"] for e in rank.phases if e["name"] == name and e["edge"] == "begin")


def out_of_step(run: RunData, ranks: list[int]) -> tuple[int, dict[int, int]] | None:
    """The first step (its index: the steps completed before it) that every one of
    ``ranks`` recorded the edges of, and in which they began different numbers of
    forwards (a batch skipped on some: its forward ran, its backward and optimizer step
    did not, and the next batch's forward fell in the same step), with each rank's count;
    None when they agree wherever all of them have edges (the steps each keeps)."""
    counts: dict[int, Counter[int]] = {}
    for n in ranks:
        rank = run.ranks.get(n)
        if rank is None or not rank.phases:
            return None
        counts[n] = phases_begun(rank, "forward")
    shared = set.intersection(*(set(c) for c in counts.values())) if counts else set()
    for step in sorted(shared):
        if len({c[step] for c in counts.values()}) > 1:
            return step, {n: c[step] for n, c in counts.items()}
    return None


def flight_said(first: Disagreement, group: str) -> str:
    """:func:`branch_said` for a divergence only the flight-recorder dumps show (calls the
    probes do not see: DDP's), with no rank condition found along the calls' chains: each
    kind of call (op, site) with its ranks, and whether it completed."""
    kinds: dict[tuple[str, str, bool], list[int]] = {}
    for r, entry in sorted(first.entries.items()):
        kinds.setdefault((entry.op, short_site(call_site(entry.frames)), entry.completed), []).append(r)
    said = [
        f"{ranks_named(ranks)} {'calls' if len(ranks) == 1 else 'call'} {op} at {site}" + ("" if done else ", waiting")
        for (op, site, done), ranks in list(kinds.items())[:MAX_KINDS_NAMED]
    ]
    said += [f"{ranks_named(first.missing_ranks)} never issued it"] if first.missing_ranks else []
    return (
        f"the ranks' calls first disagree at collective #{first.seq} on {group} in the flight recorder (calls the "
        f"probes do not see), with no rank condition found around them: {'; '.join(said)}: a branch on the data "
        "or on the rank's own state took them different ways (a data shard that ran out first, an early stop)"
    )
