"""job-slowdown: the whole job became slower from a step on, every rank alike: a
regression of the job (a slower input, another tenant, a throttled fabric), not a
straggler.

From the pace table (:mod:`lorascope.detect.pace`): the change point of the median step
time (:func:`lorascope.detect.shifts.change_point`, each side at least
:data:`~lorascope.detect.episodes.MIN_HOT` steps). Named when the median after is at
least :data:`MIN_RATIO` times the median before, the rise is at least
:data:`~lorascope.detect.pace.NOISE_FACTOR` times the step-to-step noise before it,
the work of at least :data:`MIN_RANK_SHARE` of the ranks rose by :data:`MIN_RATIO` too,
and the median rank's work rose by at least :data:`MIN_WORK_SHARE` of the step time's
rise (when one rank's work rose and the others mostly waited, it is ``slow-steps``'s).
**Severity** info: it names the step and the part of the step that grew, for every rank;
no rank to even out.
"""

from __future__ import annotations

import statistics

from lorascope.detect import shifts
from lorascope.detect.episodes import MIN_HOT
from lorascope.detect.finding import Evidence, Finding
from lorascope.detect.pace import NOISE_FACTOR, PART_LABELS, PaceTable, table
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.rundir.loading.reader import RunData

ID = "job-slowdown"
MIN_RATIO = 1.3
MIN_RANK_SHARE = 0.75
#: The median rank's own work must account for this share of the step time's rise: else
#: the ranks mostly waited for some of them (whose extra work also slowed their
#: neighbours on shared cores: 3 ranks on 2 cores, one +250 ms, the others' work +90 ms),
#: which is ``slow-steps``'s.
MIN_WORK_SHARE = 0.5

EXPLANATION = (
    "Every rank's own work grew at the same step: the job itself became slower there (its input, its "
    "machines' load, a clock or power limit, the fabric), not one rank holding the others back."
)
FIX = (
    "look at what changed at that step for the whole job: the data (longer samples, a new shard), the machines "
    "(other jobs, thermal or power throttling), an eval or checkpoint cadence that began there"
)


def _rose(values: list[float], at: int) -> float:
    before, after = statistics.median(values[:at]), statistics.median(values[at:])
    return after / before if before > 0 else float("inf")


def _parts(t: PaceTable, at: int) -> list[tuple[str, float, float]]:
    """Per part, the median over ranks (a sample past
    :data:`~lorascope.detect.pace.PART_SAMPLE`) of its median before and after, largest
    rise first."""
    rows = []
    ranks = t.sample()
    for name in t.part_names(ranks):
        before = statistics.median(statistics.median(t.parts_of(r)[name][:at]) for r in ranks)
        after = statistics.median(statistics.median(t.parts_of(r)[name][at:]) for r in ranks)
        rows.append((name, before, after))
    return sorted(rows, key=lambda p: p[1] - p[2])


def from_run(run: RunData) -> Finding | None:
    t = table(run)
    if t is None:
        return None
    cp = shifts.change_point(t.median_cycle, MIN_HOT)
    if cp is None or cp.ratio < MIN_RATIO or cp.after - cp.before < NOISE_FACTOR * cp.noise:
        return None
    rose = [r for r in t.ranks if _rose(t.work[r], cp.at) >= MIN_RATIO]
    if len(rose) < MIN_RANK_SHARE * len(t.ranks):
        return None
    grew = statistics.median(
        statistics.median(t.work[r][cp.at :]) - statistics.median(t.work[r][: cp.at]) for r in t.ranks
    )
    if grew < MIN_WORK_SHARE * (cp.after - cp.before):
        return None
    step = t.steps[cp.at]
    parts = _parts(t, cp.at)
    top = parts[0] if parts and parts[0][2] > parts[0][1] else None
    where = (
        f"; most in {PART_LABELS.get(top[0], 'the ' + top[0] + ' phase').split(' (')[0]} "
        f"({top[1] * 1000:.0f} -> {top[2] * 1000:.0f} ms, median rank)"
        if top
        else ""
    )
    return Finding(
        id=ID,
        title=(
            f"the whole job slowed from step {step} on: step time {cp.before:.3f} -> {cp.after:.3f} s "
            f"({cp.ratio - 1:+.0%}) on every rank, the work of {len(rose)} of {len(t.ranks)} ranks grew alike{where}: "
            f"a regression of the job, not a straggler"
        ),
        severity="info",
        confidence="high" if len(rose) == len(t.ranks) else "medium",
        confidence_reason=(
            f"median step time {cp.ratio:.2f}x from step {step} (threshold {MIN_RATIO:g}x), the rise "
            f"{(cp.after - cp.before) * 1000:.0f} ms against {cp.noise * 1000:.1f} ms of noise before it; "
            f"{len(rose)} of {len(t.ranks)} ranks' own work >= {MIN_RATIO:g}x"
        ),
        ranks=[],
        evidence=[
            Evidence(
                "step time",
                f"median over ranks {cp.before:.3f} s in steps {t.steps[0]}-{t.steps[cp.at - 1]}, "
                f"{cp.after:.3f} s in steps {step}-{t.steps[-1]}",
                "step records",
            ),
            *(
                Evidence(
                    PART_LABELS.get(name, name),
                    f"{b * 1000:.1f} -> {a * 1000:.1f} ms a step (median rank)",
                    "step and phase records",
                )
                for name, b, a in parts[:4]
            ),
        ],
        explanation=EXPLANATION,
        fix=FIX,
        details={"step": step, "before_s": cp.before, "after_s": cp.after, "ranks_rose": rose},
    )


def detect(bundle: EvidenceBundle) -> list[Finding]:
    found = from_run(bundle.run) if bundle.run is not None else None
    return [found] if found is not None else []
