"""sharding-not-applied: the job asked for a sharding and ran with another, or with none.

Evidence: what the Hugging Face Trainer (and TRL's SFTTrainer, a subclass) was asked for,
its ``config`` record ``trainer`` (``fsdp`` and ``fsdp_config.fsdp_version``, or
``deepspeed`` with its ZeRO stage), against what wrapped the model: the ``fsdp`` record of
the FSDP probe (its version), DeepSpeed's engine config (its stage), or DDP's settings.
On CPU, accelerate turns FSDP on for GPU setups only and runs plain DDP instead, without
a word. Under ZeRO-3, the ``zero3_params`` record the probes take when the engine is
built: the bytes of frozen weights DeepSpeed left whole on every rank (parameters under
``stage3_param_persistence_threshold``, or outside the module it was given).
Thresholds: docs/detectors.md.
"""

from __future__ import annotations

from typing import Any

from lorascope.detect.common import stream_source
from lorascope.detect.finding import Evidence, Finding
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.rundir.loading.reader import RankData, RunData
from lorascope.units import fmt_bytes

ID = "sharding-not-applied"
#: Frozen weights ZeRO-3 left whole on every rank: a finding from this many bytes ...
MIN_WHOLE_BYTES = 64 * 2**20
#: ... and this share of the frozen weights.
MIN_WHOLE_SHARE = 0.25

EXPLANATION = (
    "The job asked for a sharding (FSDP, or a DeepSpeed ZeRO stage) and the model was wrapped "
    "otherwise: every rank holds what the sharding was meant to split between them, and the "
    "memory plan made for the sharding no longer holds. Nothing fails: the framework chose "
    "another wrapper (accelerate runs DDP for FSDP on CPU) or the setting did not reach it."
)
ZERO3_EXPLANATION = (
    "Under ZeRO-3 each rank should hold 1/N of the weights; DeepSpeed keeps a parameter whole "
    "on every rank when it is smaller than stage3_param_persistence_threshold, or when it is not "
    "a parameter of the module DeepSpeed was given. For LoRA the frozen base weights are most of "
    "the memory: left whole, every rank holds the full model."
)


def _requested(trainer: dict[str, Any]) -> tuple[str, str] | None:
    """What the Trainer's arguments ask for: (engine, text), e.g. ("FSDP2", "fsdp='full_shard
    auto_wrap', fsdp_config.fsdp_version 2"); None when they ask for no sharding."""
    fsdp = trainer.get("fsdp")
    if fsdp:
        options = repr(" ".join(fsdp)) if isinstance(fsdp, list) else repr(fsdp)
        found = trainer.get("fsdp_config")
        config: dict[str, Any] = found if isinstance(found, dict) else {}
        key = "fsdp_version" if "fsdp_version" in config else "version"  # transformers 5 keeps "version"
        version = int(config.get(key) or 1)
        return f"FSDP{version}", f"fsdp={options}, fsdp_config {key} {version}"
    deepspeed = trainer.get("deepspeed")
    if deepspeed:
        stage = _stage(deepspeed) if isinstance(deepspeed, dict) else None
        if stage is None:
            return "DeepSpeed", f"deepspeed={deepspeed!r}" if isinstance(deepspeed, str) else "deepspeed=<config>"
        return f"ZeRO-{stage}", f"deepspeed config with zero_optimization.stage {stage}"
    return None


def _stage(config: dict[str, Any]) -> int | None:
    zero = config.get("zero_optimization")
    stage = zero.get("stage") if isinstance(zero, dict) else None
    return stage if isinstance(stage, int) else None


def _running(rank: RankData) -> tuple[str, str] | None:
    """What wrapped the model: (engine, the record it comes from); None when nothing did."""
    fsdp = rank.configs.get("fsdp")
    if isinstance(fsdp, dict):
        return f"FSDP{fsdp.get('version', 1)}", "fsdp config record (the FSDP probe)"
    deepspeed = rank.configs.get("deepspeed")
    if isinstance(deepspeed, dict):
        stage = _stage(deepspeed)
        return ("DeepSpeed" if stage is None else f"ZeRO-{stage}"), "deepspeed config record (the engine's)"
    if rank.configs.get("ddp"):
        return "DDP", "ddp config record (DistributedDataParallel's settings)"
    return None


def _applied(asked: str, running: str) -> bool:
    return asked == running or (asked == "DeepSpeed" and running.startswith(("ZeRO-", "DeepSpeed")))


FIXES = {
    "FSDP": (
        "Check which wrapper the job gets before a long run: accelerate turns FSDP on for GPU setups only "
        "(on CPU, use_cpu=True, it runs DDP); under `accelerate launch`, set distributed_type: FSDP and the "
        "fsdp_version in the accelerate config rather than only in the Trainer's arguments; for FSDP2, "
        "fsdp_config={'fsdp_version': 2} needs accelerate >= 1.6."
    ),
    "ZeRO": (
        "Make the DeepSpeed config the one the engine reads: TrainingArguments(deepspeed=...) or the "
        "accelerate config's deepspeed_config_file, not both; zero_optimization.stage in that file."
    ),
}


def _mismatch(run: RunData, rank: RankData) -> Finding | None:
    trainer = rank.configs.get("trainer")
    asked = _requested(trainer) if isinstance(trainer, dict) else None
    running = _running(rank)
    if asked is None or (running is None and not rank.steps):
        return None  # no sharding asked for; or the job never got to wrap a model
    got, source = running if running is not None else ("no wrapper", "no fsdp, deepspeed or ddp record")
    if _applied(asked[0], got):
        return None
    replicated = got in ("DDP", "no wrapper")
    return Finding(
        id=ID,
        title=f"{asked[0]} was asked for, but the job ran {got}"
        + (": every rank held the whole model" if replicated else ""),
        severity="warning",
        confidence="high",
        confidence_reason="the Trainer's arguments and the wrapper that saw the model are both recorded",
        ranks=sorted(run.ranks),
        evidence=[
            Evidence("asked for", asked[1], stream_source(run, rank, "trainer config record")),
            Evidence("ran", got, stream_source(run, rank, source)),
        ],
        explanation=EXPLANATION,
        fix=FIXES["FSDP" if asked[0].startswith("FSDP") else "ZeRO"],
        details={"asked": asked[0], "ran": got},
    )


def _frozen_whole(run: RunData, rank: RankData) -> Finding | None:
    params = rank.configs.get("zero3_params")
    if not isinstance(params, dict):
        return None
    frozen, whole = int(params.get("frozen_bytes") or 0), int(params.get("frozen_whole_bytes") or 0)
    if whole < MIN_WHOLE_BYTES or whole < MIN_WHOLE_SHARE * frozen:
        return None
    threshold = params.get("persistence_threshold")
    return Finding(
        id=ID,
        title=f"ZeRO-3 left {fmt_bytes(whole)} of frozen weights whole on every rank "
        f"({whole / frozen:.0%} of them): not sharded",
        severity="warning",
        confidence="high",
        confidence_reason="read from each parameter when DeepSpeed's engine was built (whole: no ds_id, or ds_persist)",
        ranks=sorted(run.ranks),
        evidence=[
            Evidence(
                "frozen weights left whole",
                f"{fmt_bytes(whole)} of {fmt_bytes(frozen)} ({params.get('frozen_whole_count')} parameters)",
                stream_source(run, rank, "zero3_params config record"),
            ),
            Evidence(
                "stage3_param_persistence_threshold",
                f"{threshold} elements" if threshold is not None else "not recorded",
                stream_source(run, rank, "deepspeed config record"),
            ),
        ],
        explanation=ZERO3_EXPLANATION,
        fix=(
            "Lower zero_optimization.stage3_param_persistence_threshold (parameters under it stay whole), and "
            "pass the whole model, frozen base included, to deepspeed.initialize (the Trainer does); load it "
            "under zero.Init (HfDeepSpeedConfig before from_pretrained) so it is partitioned as it loads."
        ),
        details={"frozen_bytes": frozen, "frozen_whole_bytes": whole},
    )


def detect(bundle: EvidenceBundle) -> list[Finding]:
    run = bundle.run
    if run is None or not run.ranks:
        return []
    rank = run.ranks[min(run.ranks)]
    return [f for f in (_mismatch(run, rank), _frozen_whole(run, rank)) if f is not None]
