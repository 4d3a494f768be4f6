"""probes-off: a probe failed in a rank and switched itself off for the rest of the process
(its ``probe_error`` record); what it would have recorded from then on is missing, and
so is every verdict that reads it. Said, so that "no problem found" is not read as a
clean bill where lorascope stopped looking.
"""

from __future__ import annotations

from lorascope.detect.common import per_rank_evidence, stream_source
from lorascope.detect.finding import Finding
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.rundir.loading.reader import RankData
from lorascope.rundir.loading.records import ProbeError
from lorascope.units import ranks_named

ID = "probes-off"

#: What each probe records, and the detectors that read it (docs/run-format.md,
#: ``probe_error``). A probe no detector reads makes a note, not a warning.
FEEDS: dict[str, tuple[str, str]] = {
    "memory": ("memory readings", "rank0-asymmetry, logits-spike, plan-deviation, oom"),
    "logits": ("the logits' size and memory around them", "logits-spike, plan-deviation"),
    "steps": ("step times and losses", "straggler, reentrant-dead-grads"),
    "grads": ("which adapters get gradients", "reentrant-dead-grads"),
    "collectives": ("collective calls", "rank-conditional-hang, hung-ranks, collective-mismatch, straggler"),
    "dumps": ("on-demand stack dumps (the signal `lorascope hang` sends)", ""),
    "flight": ("the flight recorder's dumps", "rank-conditional-hang, hung-ranks"),
    "kernels": ("the kernel trace window", "tiny-kernel-tail"),
    "allocator": ("allocator snapshots at an OOM or a stall", "allocator-fragmentation, oom"),
    "configs": ("the model, LoRA, DeepSpeed and Trainer configs", "plan-deviation, sharding-not-applied"),
    "fatal": ("how a rank ended on a fatal signal", "collective-mismatch, failed-after-exit"),
    "nvml": ("device memory as NVML sees it", "rank0-asymmetry, logits-spike (severity)"),
    "fsdp": ("FSDP's settings", "plan-deviation"),
    "cost": ("what the probes cost the job", ""),
}


def _fed(probe: str) -> tuple[str, str]:
    """What a probe records and who reads it; a patch that failed to install
    (``NAME-install``, ``steps-deepspeed-install``) is its probe's."""
    name = probe.removesuffix("-install")
    found = FEEDS.get(name) or FEEDS.get(name.split("-")[0])
    return found or (f"what the {probe} probe records", "")


EXPLANATION = (
    "A probe that fails in a rank switches itself off and the job goes on untouched; from then on "
    "that rank records none of what the probe records, and the detectors that read it judge the "
    "rank by what came before, or not at all."
)
FIX = (
    "the error says why; if it is lorascope's, report it with the error text. Until then the "
    "verdicts named above cover the rank only up to the moment the probe stopped"
)


def _steps_before(rank: RankData, t: float) -> int:
    return sum(1 for s in rank.steps if float(s["t"]) <= t)


def detect(bundle: EvidenceBundle) -> list[Finding]:
    run = bundle.run
    if run is None:
        return []
    off: dict[str, dict[int, ProbeError]] = {}  # probe -> rank -> its first error
    for n, rank in run.ranks.items():
        for err in rank.probe_errors:
            off.setdefault(err["probe"], {}).setdefault(n, err)
    findings = []
    for probe, by_rank in sorted(off.items()):
        records, readers = _fed(probe)
        ranks = sorted(by_rank)
        who = ranks_named(ranks)
        first = str(by_rank[ranks[0]].get("error", "")).splitlines()[0][:200]
        rows = {
            n: [
                (
                    f" {probe}",
                    f"switched off after {_steps_before(run.ranks[n], float(e['t']))} step(s): "
                    f"{str(e.get('error', '')).splitlines()[0][:200]}",
                    stream_source(run, run.ranks[n], "probe_error record"),
                )
            ]
            for n, e in by_rank.items()
        }
        findings.append(
            Finding(
                id=ID,
                title=f"the {probe} probe switched off on {who} ({first}): {records} missing from then on"
                + (f", so {readers} saw only part of the run" if readers else ""),
                severity="warning" if readers else "info",
                confidence="high",
                confidence_reason="the probe recorded its own failure before it stopped",
                ranks=ranks,
                evidence=per_rank_evidence(rows),
                explanation=EXPLANATION,
                fix=FIX,
            )
        )
    return findings
