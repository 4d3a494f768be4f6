"""straggler: one rank computes longer than the others, step after step, and they wait
for it at every collective.

Evidence, per step, from the run records: each rank's own work in the step (the step's
wall time minus the time it sat in synchronous collectives; outside DeepSpeed also minus
the backward phase: DDP's gradient all_reduce runs inside it and is not recorded). A
rank is named only when the effect persists and stands above the noise:

* at least :data:`MIN_STEPS` steps every rank completed (the first step, warm-up, is
  left out);
* it is the slowest rank in at least :data:`MIN_PERSISTENCE` of them;
* its median work is at least :data:`MIN_RATIO` times the others' median;
* its median excess is at least :data:`NOISE_FACTOR` times the step-to-step noise: the
  larger of the other ranks' (the median of their work's median absolute deviations) and
  its own excess's (:func:`lorascope.detect.shifts.step_noise`). On a shared machine a
  rank that lost a core for a few steps is noise, not a straggler; so is one that shares
  its core with another process off and on, slower in most steps by an amount that
  varies as much as it measures (of 2 ranks, the other one's noise alone is a quiet
  rank's).

Kernel traces from elsewhere (no run records) cover a few steps: the traces' comparison
(``kineto_ranks``) is shown with the artifacts, and a finding is made only when the
traces cover at least :data:`MIN_STEPS` steps. Numbers and the healthy-run false-alarm
table: docs/detectors.md.
"""

from __future__ import annotations

import statistics

from lorascope.detect import shifts
from lorascope.detect.common import per_rank_evidence, stream_source
from lorascope.detect.episodes import episodes, unit_of
from lorascope.detect.finding import Evidence, Finding
from lorascope.detect.pace import (
    MIN_RATIO,
    NOISE_FACTOR,
    PaceTable,
    others_medians,
    saving_text,
    step_work,
    table,
    what_if_summary,
)
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.rundir.loading.reader import RunData

ID = "straggler"
MIN_STEPS = 5
MIN_PERSISTENCE = 0.75

EXPLANATION = (
    "In synchronous data parallelism every step runs at the pace of the slowest rank. Its extra "
    "compute shows as extra time in the collectives on all the others."
)
FIX = (
    "look for what this rank does more (rank-0 logging, eval, checkpoint writing, a slower GPU or a "
    "throttled one, a different data shard with longer sequences, another process on its cores) and even it out"
)


def _mad(values: list[float]) -> float:
    median = statistics.median(values)
    return statistics.median(abs(v - median) for v in values)


def from_run(run: RunData) -> Finding | None:
    """The straggler finding of a run, made once a run (``run.derived["straggler"]``):
    ``slow-steps`` asks which rank it names too."""
    if "straggler" not in run.derived:
        run.derived["straggler"] = _from_run(run)
    found: Finding | None = run.derived["straggler"]
    return found


def _from_run(run: RunData) -> Finding | None:
    if len(run.ranks) < 2:
        return None
    sw = step_work(run)
    common = sorted(set.intersection(*(set(w) for w in sw.work.values())))
    if len(common) < MIN_STEPS:
        return None
    ranks = sorted(sw.work)
    others = others_medians(sw.work, ranks, common)

    def median_ratio(r: int) -> float:
        return statistics.median(sw.work[r][s] / max(others[r][i], 1e-9) for i, s in enumerate(common))

    cand = max(ranks, key=median_ratio)
    ratio = median_ratio(cand)
    slowest = sum(1 for s in common if max(ranks, key=lambda r: sw.work[r][s]) == cand)
    persistence = slowest / len(common)
    excesses = [sw.work[cand][s] - others[cand][i] for i, s in enumerate(common)]
    excess = statistics.median(excesses)
    others_noise = statistics.median(_mad([sw.work[o][s] for s in common]) for o in ranks if o != cand)
    own_noise = shifts.step_noise(excesses)
    noise = max(others_noise, own_noise)
    if ratio < MIN_RATIO or persistence < MIN_PERSISTENCE or excess < NOISE_FACTOR * noise:
        return None
    t = table(run)
    if t is not None and _became_slow(t, cand):
        return None
    evidence = per_rank_evidence(
        {
            r: [
                (
                    " work per step",
                    f"median {statistics.median(sw.work[r][s] for s in common) * 1000:.1f} ms over {len(common)} steps "
                    f"(noise {_mad([sw.work[r][s] for s in common]) * 1000:.1f} ms MAD; "
                    f"waiting taken out: {sw.wait_from[r]})",
                    stream_source(run, run.ranks[r], "step, coll and phase records"),
                )
            ]
            for r in ranks
        },
        apart=frozenset({cand}),
        show="ranges",
    )
    saving = what_if_summary(t, [cand], range(len(t.steps))) if t is not None else None
    if saving is not None:
        evidence.append(Evidence("what if", saving_text(saving), "per-step work replayed (lorascope/detect/pace.py)"))
    evidence.append(
        Evidence(
            "persistence",
            f"rank {cand} was the slowest in {slowest} of {len(common)} steps",
            "per-step work compared across ranks",
        )
    )
    return Finding(
        id=ID,
        title=f"rank {cand} is the straggler: it works {ratio:.2f}x the others' median per step, in {slowest} of "
        f"{len(common)} steps; the others wait for it at the collectives",
        severity="warning",
        confidence="high" if persistence >= 0.9 and excess >= 2 * NOISE_FACTOR * noise else "medium",
        confidence_reason=(
            f"slowest in {persistence:.0%} of {len(common)} steps (threshold {MIN_PERSISTENCE:.0%}); median excess "
            f"{excess * 1000:.1f} ms, {excess / noise if noise else float('inf'):.1f}x the step-to-step noise "
            f"({noise * 1000:.1f} ms: the larger of the other ranks' {others_noise * 1000:.1f} ms and its excess's "
            f"own {own_noise * 1000:.1f} ms; threshold {NOISE_FACTOR:g}x)"
        ),
        ranks=[cand],
        evidence=evidence,
        explanation=EXPLANATION,
        fix=FIX,
        details={
            "ranks": ranks,
            "ratio": ratio,
            "persistence": persistence,
            "excess_s": excess,
            "noise_s": noise,
            "others_noise_s": others_noise,
            "own_noise_s": own_noise,
            "steps": len(common),
            "what_if": saving,
        },
    )


def _became_slow(t: PaceTable, rank: int) -> bool:
    """Whether the rank became slow during the run: its excess over the others changed
    (an episode of :mod:`lorascope.detect.episodes` against its own other steps) and
    outside that episode it worked under :data:`MIN_RATIO` times the others' median.
    ``slow-steps`` names it then, with since when; slowest in 15 of 19 steps, a rank
    slow from step 10 of 20 passes the persistence by chance."""
    n = len(t.steps)
    others = others_medians({r: dict(enumerate(t.work[r])) for r in t.ranks}, t.ranks, list(range(n)))[rank]
    for e in episodes(t, unit_of(t, [rank], others)):
        outside = e.outside(n)
        if e.baseline and statistics.median(t.work[rank][i] / max(others[i], 1e-9) for i in outside) < MIN_RATIO:
            return True
    return False


def from_traces(bundle: EvidenceBundle) -> Finding | None:
    """Traces alone: the comparison's straggler, when the traces cover enough steps to
    be more than a moment of noise."""
    cmp = bundle.trace_comparison
    if cmp is None or cmp.straggler is None or min(t.steps for t in cmp.ranks) < MIN_STEPS:
        return None
    per_step = {t.rank: t.compute_us / t.steps for t in cmp.ranks}
    others = statistics.median(v for r, v in per_step.items() if r != cmp.straggler)
    if not others or per_step[cmp.straggler] / others < MIN_RATIO:
        return None
    partial = cmp.world_size is not None and cmp.world_size > len(cmp.ranks)
    evidence = [
        Evidence(
            f"rank {t.rank}",
            f"compute {t.compute_us / 1000:.1f} ms, communication {t.comm_us / 1000:.1f} ms over {t.steps} steps",
            str(bundle.traces[t.rank].path),
        )
        for t in cmp.ranks
    ]
    return Finding(
        id=ID,
        title=f"rank {cmp.straggler} is the straggler: the other ranks wait for it at the collectives",
        severity="warning",
        confidence="low" if partial else "medium",
        confidence_reason=cmp.reason
        + "; summed over the traced steps (no per-step records to check persistence)"
        + ("; only some ranks' traces were given" if partial else ""),
        ranks=[cmp.straggler],
        evidence=evidence,
        explanation=EXPLANATION,
        fix=FIX,
        details={"ranks": [t.rank for t in cmp.ranks]},
    )


def detect(bundle: EvidenceBundle) -> list[Finding]:
    finding = from_run(bundle.run) if bundle.run is not None else from_traces(bundle)
    return [finding] if finding is not None else []
