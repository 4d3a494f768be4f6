"""The per-GPU budget for one set of inputs: every term, the peak, and the verdict."""

from __future__ import annotations

from dataclasses import dataclass

from lorascope.plan import activations, buffers, model_states
from lorascope.plan.lora import AdapterLayout, LoraSpec, resolve
from lorascope.plan.params import ParamCounts, ParamTensor, count_params, param_tensors
from lorascope.plan.shape import KNOWN_MODEL_TYPES, ModelShape
from lorascope.plan.terms import Term
from lorascope.plan.training import TrainingSetup
from lorascope.units import GIB, gib

DEFAULT_GPU_MEM = 80 * GIB
#: Above this share of the card the plan says "at the edge": fragmentation (reserved but
#: unallocated blocks) and the estimated transients decide, not the model.
EDGE_FRACTION = 0.90

FITS, EDGE, NO_FIT = "fits", "at the edge", "does not fit"


@dataclass(frozen=True)
class PlanInputs:
    shape: ModelShape
    lora: LoraSpec
    setup: TrainingSetup
    gpu_mem: int = DEFAULT_GPU_MEM
    #: Where the shape came from: "preset llama-3-8b", a path, "recorded run".
    source: str = ""


@dataclass(frozen=True)
class Budget:
    params: ParamCounts
    layout: AdapterLayout
    tensors: tuple[ParamTensor, ...]
    terms: tuple[Term, ...]

    @property
    def total(self) -> int:
        """Peak bytes per GPU: every counted term."""
        return sum(t.bytes for t in self.terms if t.counted)

    @property
    def allocated(self) -> int:
        """The part of the peak torch's caching allocator holds (max_memory_allocated)."""
        return sum(t.bytes for t in self.terms if t.counted and t.allocator)

    def term(self, key: str) -> Term:
        return next(t for t in self.terms if t.key == key)


def compute_budget(inputs: PlanInputs) -> Budget:
    shape, setup = inputs.shape, inputs.setup
    layout = resolve(inputs.lora, shape)
    tensors = param_tensors(shape, layout)
    terms = (
        model_states.weight_terms(tensors, setup)
        + model_states.optimizer_terms(tensors, setup)
        + [model_states.gathered_term(tensors, setup)]
        + activations.activation_terms(shape, layout, inputs.lora, setup)
        + buffers.buffer_terms(tensors, setup)
    )
    return Budget(count_params(shape, layout), layout, tuple(tensors), tuple(terms))


def verdict(total: int, gpu_mem: int) -> str:
    if total > gpu_mem:
        return NO_FIT
    return EDGE if total > EDGE_FRACTION * gpu_mem else FITS


def notes(inputs: PlanInputs, budget: Budget) -> list[str]:
    """What the numbers rest on that the user should know, for this particular plan."""
    shape, setup, lora = inputs.shape, inputs.setup, inputs.lora
    out = list(budget.layout.notes)
    if shape.model_type not in KNOWN_MODEL_TYPES:
        out.append(
            f"model_type {shape.model_type!r} is planned as a Llama-style decoder "
            "(q/k/v/o, gate/up/down, RMSNorm); fused or differently named layers change the counts"
        )
    if lora.dora:
        out.append(
            "DoRA: the magnitude vectors are counted; DoRA's extra activations (the weight norm "
            "computed each forward) are not"
        )
    if setup.checkpointing == "reentrant":
        out.append(
            "reentrant checkpointing: adapters get no gradient unless the layer inputs require grad "
            "(keep PEFT's enable_input_require_grads hook, or use non-reentrant)"
        )
    if setup.precision == "4bit":
        other = sum(t.numel for t in budget.tensors if not t.trainable and not t.quantizable)
        out.append(
            f"4-bit base: peft.prepare_model_for_kbit_training upcasts the non-quantized weights "
            f"(embeddings, norms, lm_head: {other:,} params) to fp32, +{gib(2 * other)} GiB "
            f"before any ZeRO partitioning; not included"
        )
        if setup.zero.stage == 3:
            out.append("4-bit base under ZeRO-3 needs bnb_4bit_quant_storage set to the compute dtype")
    if setup.fsdp is not None and setup.fsdp.version == 1:
        out.append(
            "FSDP1 with use_orig_params=True: each unit's flat parameter requires grad when one adapter in it "
            "does, so the frozen weights get gradients too (counted), and a frozen Linear whose input no adapter "
            "saves (targets other than all-linear, or lora_dropout > 0) saves it as well (not counted); FSDP2 "
            "has neither cost"
        )
    if setup.fsdp is not None and setup.fsdp.strategy == "HYBRID_SHARD" and setup.nodes == 1:
        out.append("HYBRID_SHARD on one node shards like FULL_SHARD: it replicates only across nodes")
    if setup.attention in ("sdpa", "flash"):
        out.append(
            f"{setup.attention} attention assumes no padding mask (packed or equal-length "
            "sequences); with one, SDPA falls back to repeating k/v to every head"
        )
    out.append(
        "allocator fragmentation is not a term: it decides in the 'at the edge' band "
        f"(over {EDGE_FRACTION:.0%} of the card); PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
        "reduces it"
    )
    return out
