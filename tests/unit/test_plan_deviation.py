"""plan-deviation on synthetic ranks: the plan is made from the recorded configs, the readings
are written around it, and the finding fires only beyond the tolerance of the memory kind."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from lorascope.detect import logits_spike, plan_deviation, rank0_asymmetry
from lorascope.detect.plan_deviation import (
    CUDA_TOLERANCE,
    HEAP_TOLERANCE,
    LOSS_TOLERANCE,
    RSS_TOLERANCE,
    Comparison,
    RankCheck,
    check_rank,
    detect,
    plan_for_rank,
)
from lorascope.detect.registry import DETECTORS
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.plan.activations import loss_forward
from lorascope.plan.shape import shape_from_config
from lorascope.plan.training import TrainingSetup
from lorascope.rundir.loading.reader import RankData, RunData

MIB = 2**20
B, T, V = 8, 256, 512
#: The probes' test-bed model at --hidden 128 --intermediate 512 --layers 4 (what config.to_dict() gives).
MODEL = {
    "model_type": "llama",
    "vocab_size": V,
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": T,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "dtype": None,
}
LORA = {
    "default": {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": 8,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "target_modules": "all-linear",
        "bias": "none",
    }
}
DEEPSPEED = {
    "train_micro_batch_size_per_gpu": B,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 3},
    "bf16": {"enabled": False},
}
BASE = 2 * 2**30
LOGITS = 4 * B * T * V


def rank(
    n: int = 0,
    *,
    forward: int,
    kind: str = "heap",
    backward: int = 0,
    loss: int = LOGITS,
    checkpointing: bool | None = None,
    loss_dtype: str = "float32",
    loss_after_forward: bool = False,
    cuda_peak: int = 0,
    exception: str | None = None,
    configs: dict[str, Any] | None = None,
    logits: bool = True,
    head: bool = True,
) -> RankData:
    """A rank whose first forward adds ``forward`` bytes of ``kind`` ("heap", "rss" or "cuda"),
    whose backward reads ``backward`` bytes above that once, and whose cross_entropy call adds
    ``loss`` bytes."""

    def reading(value: int) -> dict[str, Any]:
        if kind == "heap":
            return {"rss": 450 * MIB, "heap": value}
        if kind == "rss":
            return {"rss": value}
        return {"rss": 450 * MIB, "cuda": {"device": 0, "alloc": value, "reserved": value, "max_alloc": cuda_peak}}

    def sample(src: str, t: float, value: int, step: int = 0) -> dict[str, Any]:
        return {"k": "mem", "t": t, "src": src, "step": step, **reading(value)}

    top = BASE + forward
    mem = [
        sample("attach", 1.0, 20 * MIB),
        sample("forward.begin", 10.0, BASE),
        sample("forward.end", 11.0, top),
        sample("backward.begin", 11.1, top),
        sample("sampler", 11.5, top + backward),
        sample("backward.end", 12.0, BASE),
        sample("step", 12.5, BASE, 1),
        sample("forward.begin", 13.0, BASE, 1),
        sample("sampler", 13.5, BASE + 100 * forward, 1),
    ]
    t_loss = 11.05 if loss_after_forward else 10.9
    records = []
    if head:
        records.append(
            {
                "k": "logits",
                "t": 10.8,
                "where": "lm_head_output",
                "step": 0,
                "shape": [B, T, V],
                "dtype": loss_dtype,
                "bytes": LOGITS,
                "vocab": V,
                "tokens": B * T,
            }
        )
    records.append(
        {
            "k": "logits",
            "t": t_loss,
            "where": "loss_input",
            "step": 0,
            "shape": [B * T, V],
            "dtype": loss_dtype,
            "bytes": LOGITS,
            "vocab": V,
            "tokens": B * T,
            "mem_before": reading(top - loss),
            "mem_after": reading(top),
        }
    )
    grad_setup = None
    if checkpointing is not None:
        grad_setup = {
            "k": "grad_setup",
            "t": 10.95,
            "step": 0,
            "training": True,
            "input_require_grads_hooks": 1,
            "checkpointing": {"enabled": checkpointing, "use_reentrant": [False] if checkpointing else []},
        }
    end = {"k": "end", "t": 14.0, "status": "exception" if exception else "exit", "code": 1 if exception else 0}
    return RankData(
        rank=n,
        start={"k": "start", "t": 0.0, "rank": n, "world_size": 2, "pid": 100 + n, "host": "h"},
        files=[],
        configs={"model": MODEL, "lora": LORA, "deepspeed": DEEPSPEED} if configs is None else configs,
        mem=mem,
        logits=records if logits else [],
        grad_setup=grad_setup,
        exception={"type": "OutOfMemoryError", "message": exception} if exception else None,
        end=end,
    )


def bundle(*ranks: RankData) -> EvidenceBundle:
    run = RunData(path=Path("/run"), manifest={}, ranks={r.rank: r for r in ranks}, warnings=[])
    return EvidenceBundle(path=run.path, run=run)


def checked(data: RankData) -> RankCheck:
    check = check_rank(data)
    assert check is not None
    return check


def compared(data: RankData, key: str = "forward") -> Comparison:
    comparison = checked(data).comparison(key)
    assert comparison is not None
    return comparison


def planned(key: str = "forward", **kwargs: Any) -> int:
    return compared(rank(forward=0, **kwargs), key).planned


def planned_setup(data: RankData) -> TrainingSetup:
    plan = plan_for_rank(data)
    assert plan is not None
    return plan.inputs.setup


def test_registered_after_the_first_detectors() -> None:
    order = DETECTORS.index(plan_deviation.detect)
    assert order > DETECTORS.index(logits_spike.detect) and order > DETECTORS.index(rank0_asymmetry.detect)


def test_plan_inputs_come_from_the_run() -> None:
    s = planned_setup(rank(forward=0, checkpointing=True))
    assert (s.micro_batch, s.seq, s.world, s.zero.stage, s.precision) == (B, T, 2, 3, "fp32")
    assert (s.checkpointing, s.loss, s.attention) == ("non-reentrant", "fp32-upcast", "sdpa")
    # Without the output projection's shape: tokens from the loss input, B from DeepSpeed's config.
    s = planned_setup(rank(forward=0, head=False))
    assert (s.micro_batch, s.seq) == (B, T)
    assert planned_setup(rank(forward=0, loss_dtype="bfloat16")).loss == "native"


@pytest.mark.parametrize("missing", ["model", "lora"])
def test_nothing_to_plan_without_configs(missing: str) -> None:
    configs = {"model": MODEL, "lora": LORA, "deepspeed": DEEPSPEED}
    del configs[missing]
    assert check_rank(rank(forward=10**9, configs=configs)) is None
    assert detect(bundle(rank(forward=10**9, configs=configs))) == []


def test_nothing_to_plan_without_logits_shape() -> None:
    assert check_rank(rank(forward=10**9, logits=False)) is None


def test_forward_plan_is_activations_logits_and_log_probs() -> None:
    plan = checked(rank(forward=0)).plan
    fwd = compared(rank(forward=0))
    act, gathered = plan.term("activations").bytes, plan.term("zero3_gathered").bytes
    assert fwd.planned_low == act + LOGITS + LOGITS  # fp32: logits returned + log-probs saved
    assert fwd.planned == fwd.planned_low + gathered  # fp32 logits: no upcast copy
    # Counted with saved_tensors_hooks in this model's forward (parameters left out): 98.02 MiB,
    # the plan's activations and log-probs plus the 16 KiB of labels nll_loss keeps.
    assert (act + LOGITS) / MIB == 98.0


def test_step_peak_plan_is_activations_and_the_spike() -> None:
    plan = checked(rank(forward=0)).plan
    peak = compared(rank(forward=0), "step_peak")
    spike = max(plan.term("logits").bytes, plan.term("layer_backward").bytes)
    # ZeRO-3 allocated its gradient partition at initialisation: nothing more is written.
    assert peak.planned == plan.term("activations").bytes + spike + plan.term("zero3_gathered").bytes
    assert peak.planned_low == compared(rank(forward=0)).planned_low
    # Only the first step counts: the next one's readings (here 100x) are another matter.
    assert compared(rank(forward=MIB), "step_peak").measured == MIB


def test_loss_after_the_forward_leaves_only_the_logits() -> None:
    inside, after = planned(), planned(loss_after_forward=True)
    assert inside - after == LOGITS


def test_healthy_heap_readings_agree() -> None:
    fwd = planned()
    check = checked(rank(forward=fwd + 4 * MIB, backward=4 * MIB))
    assert check.memory == "heap in use"
    assert {c.key for c in check.comparisons} == {"forward", "step_peak", "loss"}
    assert all(c.agrees for c in check.comparisons), check.comparisons
    assert compared(rank(forward=fwd)).tolerance == HEAP_TOLERANCE
    assert detect(bundle(rank(0, forward=fwd + 4 * MIB), rank(1, forward=fwd))) == []


def test_rss_allows_what_glibc_keeps() -> None:
    # RSS reads up to ~2.1x the live tensors (glibc keeps the freed temporaries).
    fwd = planned()
    check = checked(rank(forward=round(2.1 * fwd), kind="rss"))
    assert check.memory == "RSS" and all(c.agrees for c in check.comparisons), check.comparisons
    assert detect(bundle(rank(forward=round(2.1 * fwd), kind="rss"))) == []
    # The same reading in heap-in-use bytes is a deviation, and a sure one.
    f = detect(bundle(rank(forward=round(2.1 * fwd))))
    assert (f[0].severity, f[0].confidence) == ("warning", "high")
    f = detect(bundle(rank(forward=10 * fwd, kind="rss")))
    assert (f[0].severity, f[0].confidence, f[0].details["explanation"]) == ("warning", "medium", None)


@pytest.mark.parametrize("kind, tolerance", [("heap", HEAP_TOLERANCE), ("rss", RSS_TOLERANCE)])
def test_tolerance_edges(kind: str, tolerance: Any) -> None:
    fwd = planned()
    upper = round(fwd * (1 + tolerance.above)) + tolerance.abs
    assert compared(rank(forward=upper, kind=kind)).excess == 0
    assert detect(bundle(rank(forward=upper, kind=kind))) == []
    assert detect(bundle(rank(forward=upper + 1, kind=kind)))[0].id == "plan-deviation"
    low = compared(rank(forward=0, kind=kind))
    assert not low.agrees and low.lower == round(low.planned_low * (1 - tolerance.below))
    assert detect(bundle(rank(forward=0, kind=kind))) == []  # below the plan is no deviation


def test_activations_far_above_a_checkpointed_plan() -> None:
    """Checkpointing recorded on, and the forward kept what a job without it keeps."""
    without = planned()
    with_ckpt = planned(checkpointing=True)
    assert with_ckpt < without / 5
    f = detect(
        bundle(
            rank(0, forward=without + 3 * MIB, checkpointing=True),
            rank(1, forward=without + 4 * MIB, checkpointing=True),
        )
    )
    assert len(f) == 1
    finding = f[0]
    assert finding.ranks == [0, 1]
    assert finding.title.endswith("checkpointing is not in effect")
    assert (finding.severity, finding.confidence) == ("warning", "high")
    assert "recorded as non-reentrant" in finding.details["explanation"]
    assert finding.evidence[0].label.startswith("rank 1: peak of the first")
    assert any(e.label == "re-planned with checkpointing none" for e in finding.evidence)
    forward = finding.details["ranks"]["1"][0]
    assert forward["key"] == "forward" and forward["planned"] == with_ckpt and forward["excess"] > 0


def test_oom_makes_it_an_error() -> None:
    f = detect(bundle(rank(forward=10 * planned(), exception="CUDA out of memory. Tried to allocate 2 GiB")))
    assert f[0].severity == "error"


def test_backward_above_the_plan() -> None:
    fwd, peak = planned(), planned("step_peak")
    f = detect(bundle(rank(forward=fwd, backward=peak)))
    assert f[0].evidence[0].label.startswith("rank 0: peak of the first step")


def test_loss_reading() -> None:
    loss = compared(rank(forward=planned()), "loss")
    assert loss.planned == LOGITS and loss.measured == LOGITS and loss.agrees
    assert loss.tolerance == LOSS_TOLERANCE
    # Copies of the logits made inside cross_entropy are a deviation.
    f = detect(bundle(rank(forward=planned(), loss=4 * LOGITS)))
    assert f and f[0].evidence[0].label.startswith("rank 0: memory added inside cross_entropy")


def test_cuda_counters() -> None:
    fwd = planned()
    peak = checked(rank(forward=0, kind="cuda")).plan.allocated
    readings = round(1.05 * fwd)
    check = checked(rank(forward=readings, kind="cuda", cuda_peak=peak))
    assert check.memory == "CUDA allocated" and all(c.agrees for c in check.comparisons)
    assert {c.key for c in check.comparisons} == {"forward", "step_peak", "loss", "peak"}
    assert compared(rank(forward=readings, kind="cuda", cuda_peak=peak)).tolerance == CUDA_TOLERANCE
    assert detect(bundle(rank(forward=readings, kind="cuda", cuda_peak=peak))) == []
    # within the tolerance: cuBLAS's two workspaces (2 x 32 MiB on an H200) on top of the plan
    assert detect(bundle(rank(forward=fwd + 64 * 2**20, kind="cuda", cuda_peak=peak + 64 * 2**20))) == []
    over = round(1.1 * fwd) + CUDA_TOLERANCE.abs + 16 * 2**20
    f = detect(bundle(rank(forward=over, kind="cuda", cuda_peak=peak)))
    assert (f[0].severity, f[0].confidence) == ("warning", "high")
    # max_memory_allocated 2 GiB above the plan: a warning while the rank did not run out of
    # memory (issue 11: severity by consequence; it was an error from 1 GiB on) ...
    f = detect(bundle(rank(forward=readings, kind="cuda", cuda_peak=peak + 2**31)))
    assert f[0].severity == "warning" and f[0].evidence[0].label.startswith("rank 0: max_memory_allocated")
    # ... and an error when it did.
    oom = "CUDA out of memory. Tried to allocate 2.00 GiB"
    f = detect(bundle(rank(forward=readings, kind="cuda", cuda_peak=peak + 2**31, exception=oom)))
    assert f[0].severity == "error"


def test_loss_forward_formulas() -> None:
    shape = shape_from_config(MODEL)
    n = B * T * V
    up = loss_forward(shape, TrainingSetup(precision="bf16", seq=T, micro_batch=B))
    assert (up.logits, up.saved, up.transient) == (2 * n, 4 * n, 4 * n)
    native = loss_forward(shape, TrainingSetup(precision="bf16", seq=T, micro_batch=B, loss="native"))
    assert (native.logits, native.saved, native.transient) == (2 * n, 2 * n, 0)
    fp32 = loss_forward(shape, TrainingSetup(precision="fp32", seq=T, micro_batch=B))
    assert (fp32.logits, fp32.saved, fp32.transient) == (4 * n, 4 * n, 0)
    chunked = loss_forward(shape, TrainingSetup(precision="bf16", seq=T, micro_batch=B, loss="chunked"))
    assert chunked.logits == 0 and chunked.saved == 2 * B * T * 128


#: FSDP2 settings as the probes record them (lorascope/probes/fsdp.py; no DeepSpeed config):
#: per setting, the distinct values of the units (the root defaults to no resharding).
FSDP2 = {
    "version": 2,
    "api": "fully_shard",
    "units": 3,
    "mesh": [{"shape": [2], "dim_names": None, "device": "cpu"}],
    "reshard_after_forward": [True, False],
    "mixed_precision": [None],
    "offload": [None],
}


def test_fsdp_runs_are_planned_from_their_settings() -> None:
    configs = {"model": MODEL, "lora": LORA, "fsdp": FSDP2}
    data = rank(forward=0, configs=configs)
    s = planned_setup(data)
    assert s.fsdp is not None and (s.fsdp.version, s.fsdp.strategy, s.zero.stage) == (2, "FULL_SHARD", 0)
    # No DeepSpeed config: B and T from the output projection's logits.
    assert (s.micro_batch, s.seq, s.precision) == (B, T, "fp32")
    plan = checked(data).plan
    unsharded = plan.term("fsdp_unsharded").bytes
    fwd, peak = compared(data), compared(data, "step_peak")
    assert fwd.planned == fwd.planned_low + unsharded and "FSDP unsharded" in fwd.formula
    # The sharded gradients (first reduce-scatter), AdamW's moments (first step) and one unit's
    # reduce-scatter buffers are written in the first step.
    written = sum(plan.term(k).bytes for k in ("adapter_gradients", "optimizer_states", "fsdp_buffers"))
    spike = max(plan.term("logits").bytes, plan.term("layer_backward").bytes)
    assert peak.planned == plan.term("activations").bytes + spike + unsharded + written
    # Readings at the plan agree; an FSDP1 SHARD_GRAD_OP plan holds more unsharded.
    assert (
        detect(bundle(rank(0, forward=fwd.planned, configs=configs), rank(1, forward=fwd.planned, configs=configs)))
        == []
    )
    sgo = {**configs, "fsdp": {"version": 1, "sharding_strategy": "ShardingStrategy.SHARD_GRAD_OP"}}
    assert checked(rank(forward=0, configs=sgo)).plan.term("fsdp_unsharded").bytes > unsharded


def test_fsdp_run_far_above_its_plan() -> None:
    configs = {"model": MODEL, "lora": LORA, "fsdp": FSDP2}
    fwd = compared(rank(forward=0, configs=configs)).planned
    findings = detect(bundle(rank(0, forward=3 * fwd, configs=configs), rank(1, forward=fwd, configs=configs)))
    assert [f.id for f in findings] == ["plan-deviation"] and findings[0].ranks == [0]
    inputs = next(e for e in findings[0].evidence if e.label == "plan inputs")
    assert "FSDP2 fully_shard, reshard_after_forward=True over 2" in inputs.value


def test_fsdp_settings_parser() -> None:
    from lorascope.errors import BadInputError
    from lorascope.plan.from_configs import fsdp_from_settings

    mp = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    setup, precision = fsdp_from_settings({"version": 2, "reshard_after_forward": [False], "mixed_precision": [mp]})
    assert (setup.strategy, setup.mixed_precision, setup.reduce_fp32, precision) == (
        "SHARD_GRAD_OP",
        True,
        True,
        "bf16",
    )
    fsdp1 = {"version": 1, "sharding_strategy": "HYBRID_SHARD", "cpu_offload": True, "mixed_precision": None}
    setup, precision = fsdp_from_settings(fsdp1)
    assert (setup.version, setup.strategy, setup.offload_params, precision) == (1, "HYBRID_SHARD", True, None)
    setup, _ = fsdp_from_settings({**FSDP2, "mesh": [{"shape": [2, 4]}], "offload": [{"policy": "CPUOffloadPolicy"}]})
    assert setup.strategy == "HYBRID_SHARD" and setup.offload_params
    for bad in ({"version": 3}, {"version": 1, "sharding_strategy": "ZERO3"}, {"version": 2, "mixed_precision": 5}):
        with pytest.raises(BadInputError):
            fsdp_from_settings(bad)
    # Mixed precision plans the compute in bf16 over fp32 shards.
    data = rank(forward=0, configs={"model": MODEL, "lora": LORA, "fsdp": {**FSDP2, "mixed_precision": [mp]}})
    s = planned_setup(data)
    assert s.precision == "bf16" and s.fsdp is not None and s.fsdp.mixed_precision


def test_a_loop_without_forward_phases_is_read_from_the_second_step() -> None:
    """FSDP (or a bare model) shows no forward phase: the forward is what happens between the
    end of a step and the next backward.begin; the first step has no reading before it."""
    fsdp = {"model": MODEL, "lora": LORA, "fsdp": FSDP2}
    fwd = compared(rank(forward=0, configs=fsdp)).planned_low
    data = rank(forward=0, configs=fsdp)

    def reading(src: str, t: float, value: int, step: int) -> dict[str, Any]:
        return {"k": "mem", "t": t, "src": src, "step": step, "rss": 450 * MIB, "heap": value}

    mem = [
        reading("attach", 1.0, 20 * MIB, 0),
        reading("backward.begin", 11.1, BASE + 5 * fwd, 0),  # step 1: no reading before its forward
        reading("step", 12.5, BASE, 1),
        reading("sampler", 12.8, BASE + fwd // 2, 1),
        reading("backward.begin", 13.1, BASE + fwd + MIB, 1),
        reading("backward.end", 13.5, BASE + MIB, 1),
        reading("step", 14.0, BASE, 2),
    ]
    logits = [dict(rec, t=rec["t"] + 2.1) for rec in data.logits]  # the loss of step 2
    check = checked(dataclasses.replace(data, mem=mem, logits=logits))
    forward = check.comparison("forward")
    assert forward is not None and forward.measured == fwd + MIB and forward.agrees
    assert "first step (step 1) to the backward.begin" in forward.source
    assert detect(bundle(dataclasses.replace(data, mem=mem, logits=logits))) == []


def test_a_loss_input_the_loop_shifted_itself_is_alive_in_the_call() -> None:
    """logits[:, :-1] made contiguous by the loop: B*(T-1) rows, a copy held while
    cross_entropy runs (the FSDP logits planting's loop reads 190.7 MiB there)."""
    data = rank(forward=0)
    shifted = [
        dict(rec, tokens=B * (T - 1), bytes=4 * B * (T - 1) * V) if rec["where"] == "loss_input" else rec
        for rec in data.logits
    ]
    plain, copied = compared(data), compared(dataclasses.replace(data, logits=shifted))
    assert copied.planned - plain.planned == 4 * B * (T - 1) * V
    assert copied.planned_low == plain.planned_low and "loss input alive in the call" in copied.formula


@pytest.mark.parametrize(
    "ddp, copies",
    [
        ({"find_unused_parameters": True, "static_graph": False, "sink_clone": True}, True),
        ({"find_unused_parameters": False, "static_graph": True, "sink_clone": True}, True),  # first forward
        ({"find_unused_parameters": False, "static_graph": False, "sink_clone": True}, False),
        ({"find_unused_parameters": True, "static_graph": False, "sink_clone": False}, False),
    ],
)
def test_ddp_copies_the_outputs_in_the_forward(ddp: dict[str, Any], copies: bool) -> None:
    """DDP's _DDPSink clones the outputs under find_unused_parameters (the HF Trainer's
    default without checkpointing): the Trainer DDP job's first forward read 142.4 MiB with
    62.5 MiB of logits, twice what a plan without the copy allowed."""
    configs = {"model": MODEL, "lora": LORA, "ddp": ddp}
    plain = compared(rank(forward=0, configs={"model": MODEL, "lora": LORA}, loss_after_forward=True))
    data = rank(forward=0, configs=configs, loss_after_forward=True)
    fwd = compared(data)
    assert fwd.planned - plain.planned == (LOGITS if copies else 0)
    assert fwd.planned_low == plain.planned_low
    assert ("DDP's copy of the outputs" in fwd.formula) is copies
    assert fwd.upper - plain.upper == pytest.approx(1.1 * LOGITS if copies else 0, abs=1)


def test_ranks_with_the_same_inputs_share_one_plan() -> None:
    # A 1,024-rank run plans once, not 1,024 times; any input that differs plans anew.
    a, b = rank(0, forward=0), rank(1, forward=MIB)
    assert plan_for_rank(a) is plan_for_rank(b)
    wider = rank(1, forward=0)
    wider.start = {**wider.start, "world_size": 4}
    checkpointed = rank(1, forward=0, checkpointing=True)
    other_model = rank(
        1, forward=0, configs={"model": {**MODEL, "num_hidden_layers": 2}, "lora": LORA, "deepspeed": DEEPSPEED}
    )
    plans = [plan_for_rank(r) for r in (a, wider, checkpointed, other_model)] + [plan_for_rank(a, attention="eager")]
    assert len({id(p) for p in plans}) == len(plans)
    assert [p.inputs.setup.nodes * p.inputs.setup.gpus_per_node for p in plans if p] == [2, 4, 2, 2, 2]
    assert plans[2] is not None and plans[2].inputs.setup.checkpointing == "non-reentrant"
    assert plans[3] is not None and plans[3].inputs.shape.layers == 2
    assert plans[4] is not None and plans[4].inputs.setup.attention == "eager"
