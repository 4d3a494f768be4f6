"""The per-rank summary `lorascope analyze` prints, as plain data (the JSON output is this;
:mod:`lorascope.text.summary` lays it out as a table)."""

from __future__ import annotations

from typing import Any

from lorascope.analysis.cost import rank_cost, run_cost
from lorascope.detect.hang.diagnosis import pending_calls
from lorascope.rundir.format.schema import FORMAT_VERSION
from lorascope.rundir.loading.ending import ending_of, still_moving, stopped_reading, unrecorded_ending
from lorascope.rundir.loading.reader import RankData, RunData


def _peak_memory(rank: RankData) -> dict[str, int | None]:
    rss = [r for m in rank.mem if (r := m.get("rss")) is not None]
    heap = [m["heap"] for m in rank.mem if m.get("heap") is not None]
    cuda = [m["cuda"] for m in rank.mem if isinstance(m.get("cuda"), dict)]
    nvml = [m["nvml"]["used"] for m in rank.mem if isinstance(m.get("nvml"), dict)]
    return {
        "rss_bytes": max(rss) if rss else None,
        "heap_bytes": max(heap) if heap else None,
        "cuda_max_allocated_bytes": max((c.get("max_alloc", 0) for c in cuda), default=None),
        "cuda_reserved_bytes": max((c.get("reserved", 0) for c in cuda), default=None),
        "nvml_used_bytes": max(nvml) if nvml else None,
    }


def _sharding(rank: RankData | None) -> dict[str, Any] | None:
    """How the job shards (FSDP2, FSDP1, DeepSpeed ZeRO) or replicates (DDP) its model and checkpoints its
    activations, from the first rank's configs and its first backward's settings; None
    when it recorded neither."""
    if rank is None:
        return None
    setup = rank.grad_setup
    checkpointing = setup["checkpointing"] if setup is not None and setup["checkpointing"].get("enabled") else None
    fsdp, deepspeed, ddp = rank.configs.get("fsdp"), rank.configs.get("deepspeed"), rank.configs.get("ddp")
    engine: str | None = None
    settings: dict[str, Any] = {}
    if fsdp:
        engine, settings = f"FSDP{fsdp.get('version', '')}", fsdp
        trainer = rank.configs.get("trainer") or {}
        half = "bf16" if trainer.get("bf16") else "fp16" if trainer.get("fp16") else None
        if half is not None:
            settings = {**fsdp, "trainer_precision": half}
    elif deepspeed:
        zero = deepspeed.get("zero_optimization")
        engine, settings = "DeepSpeed", {"zero_stage": zero.get("stage", 0) if isinstance(zero, dict) else 0}
    elif ddp:
        engine, settings = "DDP", ddp
    if engine is None and checkpointing is None:
        return None
    return {"engine": engine, "settings": settings, "checkpointing": checkpointing}


def _unseen(rank: RankData) -> list[dict[str, Any]]:
    """Collective paths the rank used that the probes could not see, and where they are."""
    return [
        {"path": u["path"], "why": u["why"], "see": "the flight-recorder dump (taken when a rank fails or hangs)"}
        for u in rank.unseen_collectives
    ]


def _collectives(rank: RankData) -> dict[str, Any]:
    last = {group: tally.last_seq for group, tally in rank.tallies.items()}
    pending = pending_calls(rank)
    return {"count": rank.collectives_total, "last_seq": last, "pending": pending}


def _ended(rank: RankData, run: RunData) -> dict[str, Any]:
    """How the rank ended, and when (``t``: its ending's record, else its last record's
    time: a rank killed without a word, or aborted with only faulthandler's file)."""
    end = ending_of(rank)
    out = {**end.as_dict(), "t": end.t if end.t is not None else rank.last_time}
    if not end.known:
        out["detail"] = unrecorded_ending(run)
    stopped = stopped_reading(rank, run)
    if stopped is not None:
        out["stopped"] = stopped
    return out


def _rank_summary(rank: RankData, run: RunData) -> dict[str, Any]:
    totals = rank.totals
    return {
        "rank": rank.rank,
        "pid": rank.pid,
        "host": rank.host,
        "device": rank.start["device"],
        "steps": totals["steps"],
        "step_time_median_s": totals["step_time_median_s"],
        "last_loss": totals["last_loss"],
        "peak_memory": _peak_memory(rank),
        "memory_samples": totals["mem"],
        "collectives": _collectives(rank),
        "warnings": totals["warnings"],
        "probe_errors": [f"{e['probe']}: {e['error']}" for e in rank.probe_errors],
        "ended": _ended(rank, run),
        "unseen_collectives": _unseen(rank),
        "probe_cost": rank_cost(rank),
        "files": rank.files,
    }


def build_summary(run: RunData) -> dict[str, Any]:
    """Everything `analyze` reports, as plain data (the JSON output is this)."""
    ranks = list(run.ranks.values())
    first = ranks[0] if ranks else None
    rank_summaries = [_rank_summary(r, run) for r in ranks]
    launches = run.manifest["launches"]
    starts = [launch["start"] for launch in launches] + [float(r.start["t"]) for r in ranks]
    ends = [launch["end"] for launch in launches if launch["end"] is not None] + [r.last_time for r in ranks]
    return {
        "run_dir": str(run.path),
        #: Read while it runs and makes steps (``rundir.ending.still_moving``).
        "running": still_moving(run),
        "format_version": FORMAT_VERSION,
        "manifest": {
            "launches": launches,
            "world_size": run.world_size,
            "hosts": sorted({r.host for r in ranks} | {launch["host"] for launch in launches}),
            "start": min(starts) if starts else None,
            "end": max(ends) if ends else None,
            "versions": first.start["versions"] if first else {},
            "configs": first.configs if first else {},
            "sharding": _sharding(first),
        },
        "ranks": rank_summaries,
        "probe_cost": run_cost(rank_summaries),
        "warnings": run.warnings,
    }
