"""plan-deviation: what a run's memory really did, term by term, against the plan made from
the run's own recorded configs (``lorascope.plan.plan_from_configs``).

The plan's inputs come from the run: the model, LoRA and DeepSpeed configs (or FSDP
settings) the probes recorded, the micro-batch and sequence length from the shape of the logits at the output
projection (B, T, V), the checkpointing the model's modules carried (``grad_setup``) and the
loss implementation from the dtype of the loss input. The readings compared with it:

* ``forward``: the highest reading of the first forward above its beginning: the
  activations saved for backward, the returned logits and, when the loss ran inside the
  forward, its saved log-probs; ZeRO-3's gathered module, or FSDP's unsharded units (the
  root's, kept for backward), may still be held.
* ``step_peak``: the highest reading of the first step above the same beginning: the
  activations plus the larger of the logits spike and one layer's backward. The readings
  are taken at phase edges and by the sampler, so the peak moment is usually between two
  of them: this reads at most the plan, and only a reading above it is a deviation.
* ``loss``: the memory ``cross_entropy`` itself added (the probes read it right before and
  after the call): its log-probs.
* ``peak`` (CUDA only): ``max_memory_allocated`` against the part of the plan torch's
  allocator holds.

The readings are the rank's memory figure (``memory_kind``): on CUDA the caching
allocator's counters; on CPU the C heap in use (glibc ``mallinfo2``), which counts live
tensors the same way; RSS only where the heap figure is missing, and RSS shows a term only
loosely: glibc keeps part of what is freed (a forward's RSS grows by up to twice what stays
live), and the first forward pays one-off costs (kernel code paged in, thread pools,
DeepSpeed's module trace). What exists before the first forward (weights, optimizer state,
DeepSpeed's buckets, the runtime's own ~150 MiB of heap or ~400 MiB of RSS) cannot be told
apart on CPU, so model states are not compared there. Only memory *above* the plan is a
deviation: below it is a peak between two readings or the allocator's reuse. Tolerances and severity rules:
docs/detectors.md.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lorascope.detect.common import mem_value, memory_kind, reentrancy, run_failed_here, stream_source
from lorascope.detect.finding import Evidence, Finding
from lorascope.errors import LorascopeError
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.plan import Plan, plan_from_configs
from lorascope.plan.activations import loss_forward
from lorascope.plan.training import TrainingSetup
from lorascope.rundir.loading.reader import RankData, RunData
from lorascope.units import fmt_bytes

ID = "plan-deviation"
MIB = 2**20


@dataclass(frozen=True)
class Tolerance:
    """A reading agrees with the plan when it is at least ``1 - below`` times what the plan
    says must be live then, and at most ``1 + above`` times the plan's figure plus ``abs``."""

    below: float
    above: float
    abs: int


#: The C heap in use on CPU (glibc mallinfo2: what malloc has handed out and not taken
#: back), which counts live tensors as CUDA's allocator does. The first step also pays
#: one-off allocations no term plans (kernel tables, thread pools, DeepSpeed's module
#: trace, FSDP's lazy initialisation): 1.1-3.5 MiB on the DeepSpeed test-bed job, but up to
#: 17.8 MiB at FSDP2's first step with bf16 mixed precision on the default shape (1.9 MiB
#: planned) and 21.9 MiB at its first forward on the wide one, with transformers 5.24: a
#: healthy run over the 16 MiB floor used before. The logits-heavy configuration reads
#: 2.8 MiB below the plan (ZeRO-3 releases the gathered output projection before the
#: forward ends).
HEAP_TOLERANCE = Tolerance(below=0.10, above=0.10, abs=32 * MIB)
#: RSS on CPU where the heap figure is missing (older runs, another libc). A forward's RSS
#: growth lies between what is live at its end and everything it allocated: glibc keeps
#: part of the freed temporaries (norm upcasts, RoPE and LoRA intermediates) mapped. On the
#: test-bed job the forward allocates ~3x what stays live (torch.profiler: 301.6 MiB
#: allocated, 102.0 MiB live = the plan) and RSS reads ~2x; the first forward also pays
#: 11-31 MiB of one-off costs. Below: pages freed during initialisation can be reused.
RSS_TOLERANCE = Tolerance(below=0.25, above=2.0, abs=32 * MIB)
#: cuBLAS's workspaces, which torch allocates through its caching allocator, one per thread
#: that runs a matmul: the training thread's at its first matmul (the first forward), the
#: autograd device thread's in the first backward. 32 MiB each on Hopper (measured on an
#: H200, torch 2.11: two 32 MiB blocks, in the forward's rotary matmul and, with no Python
#: stack, in the backward), ~8 MiB on older GPUs; the larger is assumed (the runs do not
#: record the GPU's generation).
CUBLAS_WORKSPACES = 2 * 32 * MIB
#: CUDA allocator counters count live tensors exactly; what no term covers is cuBLAS's
#: workspaces (above) and the rounding of every block. 64 MiB before the GPU check ran:
#: a healthy 1-rank job on the H200 read 66.8 MiB against a 2.5 MiB plan.
CUDA_TOLERANCE = Tolerance(below=0.10, above=0.10, abs=48 * MIB + CUBLAS_WORKSPACES)
#: The reading around cross_entropy sees one allocation (its log-probs) plus the first
#: call's one-off costs (0.5 MiB on the test bed), on either kind of memory.
LOSS_TOLERANCE = Tolerance(below=0.25, above=0.10, abs=8 * MIB)


@dataclass(frozen=True)
class Comparison:
    """One measured reading against the plan's figure for it."""

    key: str
    label: str
    #: The plan's figure for what the reading shows (the upper end when a part may be gone).
    planned: int
    #: What the plan says must be live when the reading is taken.
    planned_low: int
    measured: int
    tolerance: Tolerance
    #: How the plan's figure is made up, term by term.
    formula: str
    #: Where the reading comes from.
    source: str

    @property
    def upper(self) -> int:
        return round(self.planned * (1 + self.tolerance.above)) + self.tolerance.abs

    @property
    def lower(self) -> int:
        return round(self.planned_low * (1 - self.tolerance.below))

    @property
    def excess(self) -> int:
        """Bytes beyond the upper end of the tolerance (positive: a deviation)."""
        return self.measured - self.upper

    @property
    def agrees(self) -> bool:
        return self.lower <= self.measured <= self.upper

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "label": self.label,
            "planned": self.planned,
            "planned_low": self.planned_low,
            "measured": self.measured,
            "lower": self.lower,
            "upper": self.upper,
            "excess": self.excess,
            "tolerance": dataclasses.asdict(self.tolerance),
            "formula": self.formula,
            "source": self.source,
        }


@dataclass(frozen=True)
class RankCheck:
    """A rank's plan and its readings against it."""

    rank: int
    plan: Plan
    memory: str  # lorascope.detect.common.memory_kind: "CUDA allocated", "heap in use" or "RSS"
    comparisons: tuple[Comparison, ...]

    def comparison(self, key: str) -> Comparison | None:
        return next((c for c in self.comparisons if c.key == key), None)

    @property
    def deviations(self) -> list[Comparison]:
        return sorted((c for c in self.comparisons if c.excess > 0), key=lambda c: -c.excess)


@dataclass(frozen=True)
class _FirstStep:
    """The readings of the first step, in the rank's memory kind."""

    kind: str
    base: int  # at the first forward.begin
    step: int  # its step counter
    forward: list[int]  # every reading from there to the forward.end after it
    whole: list[int]  # every reading from there to the end of the step
    loss_inside: bool  # cross_entropy ran before that forward.end
    #: The readings that open and close the forward: "forward.begin"/"forward.end", or in a
    #: loop without forward phases "step"/"backward.begin".
    opens: str = "forward.begin"
    closes: str = "forward.end"


def _loss_readings(rank: RankData, kind: str) -> list[tuple[float, int, int]]:
    """(time, reading before, reading after) of each cross_entropy call the probes saw."""
    out = []
    for rec in rank.logits:
        before, after = rec.get("mem_before"), rec.get("mem_after")
        if rec["where"] != "loss_input" or not isinstance(before, dict) or not isinstance(after, dict):
            continue
        value_before, value_after = mem_value(before, kind), mem_value(after, kind)
        if value_before is not None and value_after is not None:
            out.append((float(rec["t"]), int(value_before), int(value_after)))
    return out


def _forward_edges(rank: RankData) -> tuple[str, str]:
    """The readings around a forward. A plain loop with no forward phase the probes can see
    (FSDP, a bare model) runs its forward, and its loss, between the end of one step and
    the next backward: the first step has no reading before it, so the second step's."""
    if any(m["src"] == "forward.begin" for m in rank.mem):
        return "forward.begin", "forward.end"
    return "step", "backward.begin"


def _first_step(rank: RankData) -> _FirstStep | None:
    kind, mem = memory_kind(rank), rank.mem
    opens, closes = _forward_edges(rank)
    start = next((i for i, m in enumerate(mem) if m["src"] == opens and mem_value(m, kind) is not None), None)
    if start is None:
        return None
    end = next((i for i in range(start + 1, len(mem)) if mem[i]["src"] == closes), None)
    if end is None or mem_value(mem[end], kind) is None:
        return None
    last = next((i for i in range(end, len(mem)) if mem[i]["src"] == "step"), len(mem) - 1)
    t0, t_fwd, t_step = (float(mem[i]["t"]) for i in (start, end, last))

    def values(stop: int, t_stop: float) -> list[int]:
        out = [int(v) for m in mem[start : stop + 1] if (v := mem_value(m, kind)) is not None]
        return out + [
            v for t, before, after in _loss_readings(rank, kind) if t0 <= t <= t_stop for v in (before, after)
        ]

    loss_inside = any(t0 <= t <= t_fwd for t, _, _ in _loss_readings(rank, kind))
    return _FirstStep(
        kind,
        int(mem_value(mem[start], kind) or 0),
        int(mem[start]["step"]),
        values(end, t_fwd),
        values(last, t_step),
        loss_inside,
        opens,
        closes,
    )


def batch_shape(rank: RankData) -> tuple[int, int] | None:
    """(micro-batch, sequence length): from the logits at the output projection, or from the
    loss input's token count and the DeepSpeed config's micro-batch."""
    for rec in rank.logits:
        if rec["where"] == "lm_head_output" and len(rec["shape"]) == 3:
            return int(rec["shape"][0]), int(rec["shape"][1])
    micro = (rank.configs.get("deepspeed") or {}).get("train_micro_batch_size_per_gpu")
    for rec in rank.logits:
        tokens = rec.get("tokens")
        if isinstance(micro, int) and micro > 0 and isinstance(tokens, int) and tokens % micro == 0:
            return micro, tokens // micro
    return None


def _checkpointing(rank: RankData) -> str:
    """The plan's checkpointing: reentrant or not saves the same activations, so a setting
    the probe could not read plans as non-reentrant (:func:`_checkpointing_text` says so)."""
    settings = (rank.grad_setup or {}).get("checkpointing") or {}
    if not settings.get("enabled"):
        return "none"
    return "reentrant" if reentrancy(settings.get("use_reentrant") or []) == "reentrant" else "non-reentrant"


def _checkpointing_text(rank: RankData, setup: TrainingSetup) -> str:
    """The checkpointing a plan assumed, as recorded: never a known kind for an unknown."""
    settings = (rank.grad_setup or {}).get("checkpointing") or {}
    if setup.checkpointing == "none" or not settings.get("enabled"):
        return setup.checkpointing
    return reentrancy(settings.get("use_reentrant") or [])


def _loss(rank: RankData) -> str:
    """A 16-bit loss input means cross-entropy ran in the model's dtype; an fp32 one (or an
    fp32 model) is transformers' upcast."""
    for rec in rank.logits:
        if rec["where"] == "loss_input":
            return "native" if rec["dtype"] in ("bfloat16", "float16") else "fp32-upcast"
    return "fp32-upcast"


#: Plans by the text of their inputs (records read from JSON: equal text, equal inputs).
#: The ranks of a run share their configs, and a plan takes ~5-10 ms to build: 1,024 ranks
#: planned one by one took seconds. Plans are frozen, so ranks can share one.
_PLANS: dict[str, Plan | None] = {}
MAX_PLANS = 64


def plan_for_rank(rank: RankData, **overrides: Any) -> Plan | None:
    """The plan for this rank's recorded configs; None when they are missing or unplannable.
    ``overrides`` replace the settings read from the run (checkpointing, attention, loss)."""
    model, lora = rank.configs.get("model"), rank.configs.get("lora")
    shape = batch_shape(rank)
    if not model or not lora or shape is None:
        return None
    micro, seq = shape
    options = {"checkpointing": _checkpointing(rank), "loss": _loss(rank), **overrides}
    if rank.configs.get("fsdp"):
        options["fsdp"] = rank.configs["fsdp"]
    deepspeed, world_size = rank.configs.get("deepspeed"), int(rank.start["world_size"])
    key = json.dumps([model, lora, deepspeed, world_size, seq, micro, options], sort_keys=True, default=repr)
    if key not in _PLANS:
        if len(_PLANS) >= MAX_PLANS:
            _PLANS.clear()
        try:
            _PLANS[key] = plan_from_configs(model, lora, deepspeed, world_size, seq, micro, **options)
        except LorascopeError:
            _PLANS[key] = None
    return _PLANS[key]


def _loop_copy(rank: RankData, setup: TrainingSetup) -> int:
    """Bytes of a loss input the loop made itself: fewer rows than the B*T logits (the loop
    shifted them: a copy, alive while cross_entropy runs); 0 when it passes the logits."""
    for rec in rank.logits:
        tokens = rec.get("tokens")
        if rec["where"] == "loss_input" and isinstance(tokens, int) and tokens < setup.tokens:
            return int(rec["bytes"])
    return 0


def _ddp_clones_outputs(rank: RankData) -> bool:
    """Whether DistributedDataParallel copied the model's outputs in the first forward:
    its ``_DDPSink`` clones every output under ``find_unused_parameters`` (the Hugging
    Face Trainer's default for a model without gradient checkpointing), and in the first
    forward under ``static_graph``; the original and the copy (the logits twice) are alive
    together before the forward returns."""
    ddp = rank.configs.get("ddp")
    if not isinstance(ddp, dict) or not ddp.get("sink_clone", True):
        return False
    return bool(ddp.get("find_unused_parameters") or ddp.get("static_graph"))


def _gathered(plan: Plan) -> int:
    """The parameters held whole to compute: ZeRO-3's module or FSDP's unsharded units."""
    return sum(t.bytes for t in plan.terms if t.key in ("zero3_gathered", "fsdp_unsharded"))


def _gathered_label(setup: TrainingSetup) -> str:
    return "FSDP unsharded" if setup.fsdp is not None else "ZeRO-3 gathered"


def _compare(run: RunData | None, rank: RankData, plan: Plan, first: _FirstStep) -> RankCheck:
    tol = {"CUDA allocated": CUDA_TOLERANCE, "heap in use": HEAP_TOLERANCE}.get(first.kind, RSS_TOLERANCE)
    src = stream_source(run, rank, "mem records") if run is not None else f"ranks/rank-{rank.rank} (mem records)"
    setup = plan.inputs.setup
    loss = loss_forward(plan.inputs.shape, setup)
    act, gathered = plan.term("activations").bytes, _gathered(plan)
    inside = first.loss_inside
    out: list[Comparison] = []

    low = act + loss.logits + (loss.saved if inside else 0)
    # While cross_entropy runs, its input is alive: the plan's transient when it is the
    # upcast copy; a loop that shifts the logits itself passes a copy of its own.
    transient = max(loss.transient, _loop_copy(rank, setup)) if inside else 0
    clone = loss.logits if _ddp_clones_outputs(rank) else 0
    planned = low + transient + clone + gathered
    out.append(
        Comparison(
            "forward",
            "peak of the first forward",
            planned,
            low,
            max(first.forward) - first.base,
            tol,
            f"activations {fmt_bytes(act)} ({_checkpointing_text(rank, setup)} checkpointing) + logits {fmt_bytes(loss.logits)}"
            + (f" + loss saved {fmt_bytes(loss.saved)}" if inside else " (the loss ran after the forward)")
            + (f" + loss input alive in the call {fmt_bytes(transient)}" if transient else "")
            + (f" + DDP's copy of the outputs {fmt_bytes(clone)}" if clone else "")
            + (f" + {_gathered_label(setup)} {fmt_bytes(gathered)}" if gathered else ""),
            f"{src}: highest reading from the first {first.opens} (step {first.step}) to the {first.closes} after it",
        )
    )

    spike = max(plan.term("logits").bytes, plan.term("layer_backward").bytes)
    # Allocated for the first time in the step: the gradients (ZeRO-3 zero-fills its flat
    # partition at initialisation) and, without ZeRO (which initialises the optimizer states
    # up front), the optimizer's lazily created moments and master copy.
    written = plan.term("adapter_gradients").bytes if setup.zero.stage < 3 else 0
    if setup.fsdp is not None:
        # FSDP creates the sharded gradients at the first reduce-scatter, torch's optimizer
        # its moments at the first step; one unit's reduce-scatter buffers come and go.
        written += plan.term("optimizer_states").bytes + plan.term("fsdp_buffers").bytes
    elif setup.zero.stage == 0:
        written += plan.term("optimizer_states").bytes + plan.term("master_weights").bytes
    elif setup.zero.stage < 3:
        # ZeRO-1/2 allocate their reduce bucket at the first gradient reduction, inside the
        # first backward (measured on the test job, ZeRO-2 bf16: the heap read 962 MiB above
        # the forward's beginning for one sampler reading; 5e8 elements x 2 B = 954 MiB).
        written += plan.term("deepspeed_buffers").bytes
    out.append(
        Comparison(
            "step_peak",
            "peak of the first step",
            act + spike + gathered + written,
            low,
            max(first.whole) - first.base,
            tol,
            f"activations {fmt_bytes(act)} + max(logits + loss, layer backward) {fmt_bytes(spike)}"
            + (f" + {_gathered_label(setup)} {fmt_bytes(gathered)}" if gathered else "")
            + f" + first written in the step {fmt_bytes(written)}",
            f"{src}: highest reading of the step after the first {first.opens} (step {first.step}) above it (readings at phase "
            "edges and every sampler interval: a peak between two readings is not seen)",
        )
    )

    deltas = [after - before for _, before, after in _loss_readings(rank, first.kind)]
    if deltas and setup.loss != "chunked":
        # A loop that shifts the logits itself passes B*(T-1) rows, not B*T.
        out.append(
            Comparison(
                "loss",
                "memory added inside cross_entropy",
                loss.saved,
                loss.saved * (setup.seq - 1) // setup.seq,
                max(deltas),
                LOSS_TOLERANCE,
                f"log-probs {'4' if setup.loss == 'fp32-upcast' else setup.compute_bytes} B x B*T*V ({setup.loss})",
                f"{src.replace('mem records', 'logits records')}: after - before, first {len(deltas)} call(s)",
            )
        )

    if first.kind == "CUDA allocated":
        peaks = [
            m["cuda"]["max_alloc"]
            for m in rank.mem
            if isinstance(m.get("cuda"), dict) and m["cuda"].get("max_alloc") is not None
        ]
        if peaks:
            out.append(
                Comparison(
                    "peak",
                    "max_memory_allocated",
                    plan.allocated,
                    0,
                    max(peaks),
                    tol,
                    "the plan's counted terms held by torch's allocator",
                    f"{src}: largest cuda.max_alloc",
                )
            )
    return RankCheck(rank.rank, plan, first.kind, tuple(out))


def check_rank(rank: RankData, run: RunData | None = None, **overrides: Any) -> RankCheck | None:
    """The rank's readings against its plan; None when the run lacks what either needs
    (recorded configs, a logits shape, a first forward's readings)."""
    first = _first_step(rank)
    plan = plan_for_rank(rank, **overrides) if first is not None else None
    if plan is None or first is None:
        return None
    return _compare(run, rank, plan, first)


@dataclass(frozen=True)
class _Alternative:
    """A setting the run may not have had as recorded: re-planned with ``value``, and when
    the readings agree with that plan, ``short``/``text`` explain the deviation."""

    option: str
    value: str
    applies: Callable[[TrainingSetup], bool]
    short: str
    text: str


_ALTERNATIVES = (
    _Alternative(
        "checkpointing",
        "none",
        lambda setup: setup.checkpointing != "none",
        "checkpointing is not in effect",
        "gradient checkpointing is recorded as {checkpointing} but not in effect: the forward "
        "kept what a job without it keeps",
    ),
    _Alternative(
        "attention",
        "eager",
        lambda setup: setup.attention != "eager",
        "the attention is eager",
        "the attention is eager, not {attention}: it saves the B·heads·T·T score matrices",
    ),
)


@dataclass(frozen=True)
class _Explanation:
    alternative: _Alternative
    text: str
    replanned: RankCheck


def _explain(run: RunData, rank: RankData, check: RankCheck) -> _Explanation | None:
    """The first alternative setting whose plan every deviating reading agrees with."""
    setup = check.plan.inputs.setup
    keys = {c.key for c in check.deviations}
    for alt in _ALTERNATIVES:
        if not alt.applies(setup):
            continue
        replanned = check_rank(rank, run, **{alt.option: alt.value})
        if replanned is not None and all((c := replanned.comparison(k)) is not None and c.agrees for k in keys):
            text = alt.text.format(checkpointing=_checkpointing_text(rank, setup), attention=setup.attention)
            return _Explanation(alt, text, replanned)
    return None


def _fmt_comparison(c: Comparison) -> str:
    ratio = f" ({c.measured / c.planned:.1f}x)" if c.planned else ""
    return (
        f"measured {fmt_bytes(c.measured)}, planned {fmt_bytes(c.planned)}{ratio}, allowed up to "
        f"{fmt_bytes(c.upper)}; plan = {c.formula}"
    )


def detect(bundle: EvidenceBundle) -> list[Finding]:
    run = bundle.run
    if run is None:
        return []
    checks = {n: c for n, r in run.ranks.items() if (c := check_rank(r, run)) is not None}
    deviating = {n: c for n, c in checks.items() if c.deviations}
    if not deviating:
        return []
    rank_no = max(deviating, key=lambda n: deviating[n].deviations[0].excess)
    check = deviating[rank_no]
    worst, setup = check.deviations[0], check.plan.inputs.setup
    explained = _explain(run, run.ranks[rank_no], check)
    exact = check.memory != "RSS"  # allocator counters: live bytes, not pages

    evidence = [
        Evidence(f"rank {rank_no}: {c.label} ({check.memory})", _fmt_comparison(c), c.source) for c in check.deviations
    ]
    evidence += [
        Evidence(
            f"rank {n}: {c.deviations[0].label} ({c.memory})", _fmt_comparison(c.deviations[0]), c.deviations[0].source
        )
        for n, c in sorted(deviating.items())
        if n != rank_no
    ]
    evidence.append(
        Evidence(
            "plan inputs",
            f"B={setup.micro_batch}, T={setup.seq}, V={check.plan.inputs.shape.vocab}, "
            f"{setup.precision}, {setup.fsdp.label if setup.fsdp else f'ZeRO-{setup.zero.stage}'} over "
            f"{setup.world}, checkpointing "
            f"{_checkpointing_text(run.ranks[rank_no], setup)}, {setup.attention} attention, loss {setup.loss}",
            "config records (model, lora, deepspeed or fsdp), logits shape and dtype, grad_setup",
        )
    )
    reason = (
        f"{check.memory} readings; {worst.label} is {fmt_bytes(worst.excess)} beyond the tolerance "
        f"(+{worst.tolerance.above:.0%} + {fmt_bytes(worst.tolerance.abs)} over the plan)"
    )
    title = f"{worst.label} is {fmt_bytes(worst.measured)}, the plan {fmt_bytes(worst.planned)}"
    explanation = (
        "The plan for this job, made from the configs it recorded, accounts for every tensor "
        "the step needs; the readings are above it by more than allocator effects explain, so "
        "the job does something the plan does not assume: checkpointing not applied (it needs "
        "model.train() and layers that honour it), another attention implementation, outputs "
        "or hidden states the loop keeps alive, an extra copy of the logits."
    )
    if explained is not None:
        again = explained.replanned.comparison(worst.key)
        evidence.append(
            Evidence(
                f"re-planned with {explained.alternative.option} {explained.alternative.value}",
                f"{worst.label}: planned {fmt_bytes(again.planned if again else None)}, measured "
                f"{fmt_bytes(worst.measured)}: within tolerance",
                "lorascope.plan.plan_from_configs",
            )
        )
        reason += "; the plan with one setting changed agrees with every deviating reading"
        title += f": {explained.alternative.short}"
        explanation = explained.text[0].upper() + explained.text[1:] + ". " + explanation
    return [
        Finding(
            id=ID,
            title=title,
            severity="error" if any(run_failed_here(run.ranks[n]) for n in deviating) else "warning",
            confidence="high" if exact or explained is not None else "medium",
            confidence_reason=reason,
            ranks=sorted(deviating),
            evidence=evidence,
            explanation=explanation,
            fix=(
                "Run `lorascope plan` with the job's settings and compare term by term (`--json`); check "
                "that gradient checkpointing is enabled on the model DeepSpeed wraps and in effect (the "
                "model in train mode), and that the loop keeps only the loss of each step."
            ),
            details={
                "memory": check.memory,
                "plan": dataclasses.asdict(setup) | {"vocab": check.plan.inputs.shape.vocab},
                "explanation": explained.text if explained is not None else None,
                "ranks": {str(n): [c.to_dict() for c in checks[n].comparisons] for n in sorted(checks)},
            },
        )
    ]
