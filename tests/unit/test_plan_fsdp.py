"""`lorascope plan --fsdp`: FSDP1's sharding strategies and FSDP2's fully_shard, term by term
against hand-computed bytes on the probes' tiny Llama, and the orderings between strategies
that a wrong term would break (docs/memory-model.md, "FSDP")."""

from __future__ import annotations

import json

import pytest

from lorascope.cli import main
from lorascope.errors import UsageError
from lorascope.plan import Plan, PlanInputs, build_plan, preset_shape
from lorascope.plan.lora import LoraSpec
from lorascope.plan.training import FsdpSetup, TrainingSetup, ZeroSetup

# tiny-llama: hidden 64, intermediate 128, 2 layers, 4 heads of 16, 2 kv heads, vocab 512.
LAYER = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64  # q, o + k, v + MLP + 2 norms
LORA_LAYER = 8 * ((64 + 64) * 2 + (64 + 32) * 2 + 3 * (64 + 128))  # r=8 on all seven linears
ROOT = 512 * 64 + 64 + 64 * 512  # embeddings, final norm, lm_head (untied)
LORA = LoraSpec(r=8, targets="all-linear")


def plan(fsdp: FsdpSetup | None, shape: str = "tiny-llama", precision: str = "fp32", **setup: object) -> Plan:
    options: dict[str, object] = {"gpus_per_node": 2, "seq": 64, "micro_batch": 2, **setup}
    lora = LORA if shape == "tiny-llama" else LoraSpec(r=16, targets="all-linear")
    return build_plan(PlanInputs(preset_shape(shape), lora, TrainingSetup(precision=precision, fsdp=fsdp, **options)))  # type: ignore[arg-type]


def terms(p: Plan) -> dict[str, int]:
    return {t.key: t.bytes for t in p.terms}


def test_layer_arithmetic() -> None:
    assert (LAYER, LORA_LAYER, ROOT) == (36_992, 8_192, 65_600)
    p = plan(FsdpSetup())
    assert p.params.base == 2 * LAYER + ROOT and p.params.trainable == 2 * LORA_LAYER


def test_fsdp2_full_shard_by_hand() -> None:
    t = terms(plan(FsdpSetup(version=2)))
    assert t["base_weights"] == (2 * LAYER + ROOT) * 4 // 2
    assert t["adapter_weights"] == 2 * LORA_LAYER * 4 // 2
    # FSDP2 is per parameter: the frozen base gets no gradient.
    assert t["adapter_gradients"] == 2 * LORA_LAYER * 4 // 2
    assert t["optimizer_states"] == 2 * LORA_LAYER * 8 // 2
    assert t["master_weights"] == 0
    # The root stays unsharded into backward; two layer units in flight (computing + prefetched).
    assert t["fsdp_unsharded"] == ROOT * 4 + 2 * (LAYER + LORA_LAYER) * 4
    # The largest unit's adapter gradients + their reduce-scatter copy + the 1/2 output, and
    # one layer unit's flat all-gather output.
    assert t["fsdp_buffers"] == LORA_LAYER * (4 + 4) + LORA_LAYER * 4 // 2 + (LAYER + LORA_LAYER) * 4
    assert "zero3_gathered" not in t and "deepspeed_buffers" not in t


def test_fsdp1_full_shard_by_hand() -> None:
    t = terms(plan(FsdpSetup(version=1)))
    # use_orig_params=True: a layer unit's flat parameter requires grad as a whole, so its
    # frozen weights get gradients too; the root (no adapter) gets none.
    assert t["adapter_gradients"] == 2 * (LAYER + LORA_LAYER) * 4 // 2
    assert t["fsdp_buffers"] == (LAYER + LORA_LAYER) * 4 + (LAYER + LORA_LAYER) * 4 // 2
    assert t["fsdp_unsharded"] == ROOT * 4 + 2 * (LAYER + LORA_LAYER) * 4


def test_shard_grad_op_keeps_every_unit_unsharded() -> None:
    for version in (1, 2):
        t = terms(plan(FsdpSetup(version=version, strategy="SHARD_GRAD_OP")))
        assert t["fsdp_unsharded"] == (ROOT + 2 * (LAYER + LORA_LAYER)) * 4


def test_units_in_flight() -> None:
    # 16 layers: two in flight under FULL_SHARD, all sixteen under SHARD_GRAD_OP.
    full = plan(FsdpSetup(), shape="llama-3.2-1b", precision="bf16")
    sgo = plan(FsdpSetup(strategy="SHARD_GRAD_OP"), shape="llama-3.2-1b", precision="bf16")
    root = 128_256 * 2048 * 2 + 2048 * 2  # tied lm_head: embeddings and final norm
    layer = (full.term("fsdp_unsharded").bytes - root) / 2
    assert sgo.term("fsdp_unsharded").bytes == pytest.approx(root + 16 * layer)
    # A 2-layer model: FULL_SHARD's "two layers in flight" is every layer, as SHARD_GRAD_OP.
    assert (
        terms(plan(FsdpSetup()))["fsdp_unsharded"] == terms(plan(FsdpSetup(strategy="SHARD_GRAD_OP")))["fsdp_unsharded"]
    )


def test_strategy_orderings_on_8b() -> None:
    """Two nodes of four: the orderings a wrong sharding world or unsharded count breaks."""
    big = {"gpus_per_node": 4, "nodes": 2, "seq": 4096, "micro_batch": 1, "checkpointing": "non-reentrant"}
    by = {
        s: plan(FsdpSetup(version=1, strategy=s), "llama-3-8b", "bf16", **big)
        for s in ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")
    }
    base = {s: p.term("base_weights").bytes for s, p in by.items()}
    # Sharded over 8, over 8, over the node's 4, not at all.
    assert base["FULL_SHARD"] == base["SHARD_GRAD_OP"] < base["HYBRID_SHARD"] < base["NO_SHARD"]
    assert base["HYBRID_SHARD"] == pytest.approx(2 * base["FULL_SHARD"], rel=1e-6)
    assert base["NO_SHARD"] == pytest.approx(8 * base["FULL_SHARD"], rel=1e-6)
    held = {s: p.term("fsdp_unsharded").bytes for s, p in by.items()}
    assert held["NO_SHARD"] == 0 < held["FULL_SHARD"] == held["HYBRID_SHARD"] < held["SHARD_GRAD_OP"]
    total = {s: p.total for s, p in by.items()}
    assert total["FULL_SHARD"] < total["HYBRID_SHARD"] < total["NO_SHARD"]
    assert total["FULL_SHARD"] < total["SHARD_GRAD_OP"]
    # FSDP2 (no gradients for frozen weights) below FSDP1 by FSDP1's whole-unit gradient shards.
    fsdp2 = plan(FsdpSetup(version=2), "llama-3-8b", "bf16", **big)
    assert fsdp2.term("adapter_gradients").bytes * 100 < by["FULL_SHARD"].term("adapter_gradients").bytes
    # HYBRID on one node is FULL_SHARD.
    one_node = {**big, "gpus_per_node": 8, "nodes": 1}
    hybrid = plan(FsdpSetup(version=1, strategy="HYBRID_SHARD"), "llama-3-8b", "bf16", **one_node)
    full = plan(FsdpSetup(version=1), "llama-3-8b", "bf16", **one_node)
    assert hybrid.total == full.total and any("HYBRID_SHARD on one node" in n for n in hybrid.notes)


def test_mixed_precision_and_offload() -> None:
    bf16 = terms(plan(FsdpSetup(), precision="bf16"))
    mp = terms(plan(FsdpSetup(mixed_precision=True, reduce_fp32=True), precision="bf16"))
    # fp32 shards (and fp32 gradients, fp32 moments), bf16 unsharded copies.
    for key in ("base_weights", "adapter_weights", "adapter_gradients", "optimizer_states"):
        assert mp[key] == 2 * bf16[key], key
    assert mp["fsdp_unsharded"] == bf16["fsdp_unsharded"]
    # The gradients are reduced in fp32: the reduce-scatter copy and output double.
    assert mp["fsdp_buffers"] == bf16["fsdp_buffers"] + LORA_LAYER * 2 + LORA_LAYER * 2 // 2
    off = terms(plan(FsdpSetup(mixed_precision=True, offload_params=True), precision="bf16"))
    for key in ("base_weights", "adapter_weights", "adapter_gradients", "optimizer_states"):
        assert off[key] == 0, key
    assert off["fsdp_unsharded"] == mp["fsdp_unsharded"]
    # NO_SHARD with mixed precision keeps a 16-bit copy of the whole model.
    no_shard = terms(plan(FsdpSetup(version=1, strategy="NO_SHARD", mixed_precision=True), precision="bf16"))
    assert no_shard["fsdp_unsharded"] == (2 * (LAYER + LORA_LAYER) + ROOT) * 2


def test_activations_and_loss_are_the_engine_independent_terms() -> None:
    fsdp, ddp = terms(plan(FsdpSetup())), terms(plan(None))
    for key in ("activations", "logits", "layer_backward", "framework", "nccl"):
        assert fsdp[key] == ddp[key], key


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda: FsdpSetup(version=2, strategy="NO_SHARD"), "FSDP2 has no NO_SHARD"),
        (lambda: FsdpSetup(strategy="ZERO3"), "sharding strategy"),
        (lambda: FsdpSetup(reduce_fp32=True), "needs FSDP mixed precision"),
        (lambda: TrainingSetup(fsdp=FsdpSetup(), zero=ZeroSetup(stage=3)), "choose one"),
        (lambda: TrainingSetup(precision="fp32", fsdp=FsdpSetup(mixed_precision=True)), "16 bits"),
    ],
)
def test_invalid_setups(setup: object, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        setup()  # type: ignore[operator]


def cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        main(["plan", "--preset", "tiny-llama", "--lora-r", "8", "--lora-targets", "all-linear", *args])
    out, err = capsys.readouterr()
    return int(exited.value.code or 0), out, err


def test_cli_fsdp(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--gpus", "2", "--seq", "64", "--micro-batch", "2", "--precision", "fp32"]
    code, out, _ = cli([*args, "--fsdp", "fully_shard", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["setup"]["fsdp"]["version"] == 2 and data["setup"]["fsdp"]["reshard_after_forward"] is True
    assert {t["key"]: t["bytes"] for t in data["terms"]} == terms(plan(FsdpSetup()))
    code, out, _ = cli([*args, "--fsdp", "fully_shard", "--no-reshard-after-forward", "--json"], capsys)
    assert json.loads(out)["setup"]["fsdp"]["strategy"] == "SHARD_GRAD_OP"
    code, out, _ = cli([*args, "--fsdp", "shard_grad_op"], capsys)
    assert code == 0 and "FSDP1 SHARD_GRAD_OP" in out and "FSDP unsharded parameters" in out
    code, out, _ = cli(["--fsdp", "FULL_SHARD", "--gpus", "2", "--fsdp-mixed-precision", "param+reduce"], capsys)
    assert code == 0 and "fp32 shards" in out and "mixed precision" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--fsdp", "full_shard", "--zero", "3"], "without DeepSpeed"),
        (["--fsdp", "full_shard", "--reshard-after-forward"], "FSDP2's"),
        (["--no-reshard-after-forward"], "need --fsdp"),
        (["--fsdp", "fully_shard", "--fsdp-mixed-precision", "param", "--precision", "fp32"], "16 bits"),
    ],
)
def test_cli_fsdp_errors(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(args, capsys)
    assert code == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1
