"""Activation memory: what autograd saves for backward, the per-layer backward working set
(with the recomputed layer under checkpointing), and the logits/loss spike.

The saved-tensor model follows transformers' Llama/Mistral/Qwen2 code and PEFT's LoRA
forward op by op; tests/unit/test_plan_activations.py checks it byte for byte against the
tensors autograd really saves for tiny models on CPU. Facts it relies on:

* A frozen ``nn.Linear`` saves nothing of its input (autograd saves an input only when
  a gradient that needs it will be computed); LoRA's ``lora_A`` does save it, ``lora_B``
  saves lora_A's r-wide output.
* PEFT casts the input to the adapter dtype and applies dropout per adapted module, so
  fp32 adapters or ``lora_dropout > 0`` give every adapted module its own copy (q, k and v
  no longer share one), plus the dropout mask (bool on CUDA).
* transformers' RMSNorm upcasts to fp32 and saves that copy (4 bytes x hidden) and the
  fp32 rsqrt; eager attention saves the fp32 softmax and its 16-bit cast (B x heads x T x T),
  SDPA/flash save q, k, v, the output and the fp32 logsumexp.
* Nothing upstream of the first trainable tensor needs a gradient: in layer 0 (and in layers
  below ``layers_to_transform``) fewer tensors are saved unless checkpointing (through PEFT's
  input-require-grads hook) or an embedding adapter makes the input require grad.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lorascope.plan.lora import Adapter, AdapterLayout, LoraSpec
from lorascope.plan.shape import ModelShape
from lorascope.plan.terms import Term
from lorascope.plan.training import TrainingSetup
from lorascope.units import count

#: CUDA's fused dropout saves a bool mask; CPU's dropout saves a mask in the input dtype.
CUDA_DROPOUT_MASK_BYTES = 1


@dataclass
class LayerSaved:
    """Bytes per token one decoder layer saves, by part."""

    parts: dict[str, int] = field(default_factory=dict)
    output_requires_grad: bool = False

    def add(self, part: str, n_bytes: int) -> None:
        if n_bytes:
            self.parts[part] = self.parts.get(part, 0) + n_bytes

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def _lora_inputs(
    adapters: list[Adapter],
    width: int,
    input_requires_grad: bool,
    already_saved: bool,
    lora: LoraSpec,
    setup: TrainingSetup,
    mask_bytes: int,
) -> tuple[int, int]:
    """(input copies, lora_A outputs) saved for the adapted modules sharing one input tensor."""
    if not adapters:
        return 0, 0
    s, a = setup.compute_bytes, setup.adapter_bytes
    if lora.dropout > 0:
        inputs = len(adapters) * width * (a + (mask_bytes if input_requires_grad else 0))
    elif a != s:
        inputs = len(adapters) * width * a
    else:
        inputs = 0 if already_saved else width * s
    return inputs, sum(ad.r * a for ad in adapters)


def _layer(
    shape: ModelShape,
    adapters: dict[str, Adapter],
    spec: LoraSpec,
    setup: TrainingSetup,
    input_requires_grad: bool,
    mask_bytes: int,
) -> LayerSaved:
    s = setup.compute_bytes
    h, inter, qw, kw, heads, t = (
        shape.hidden,
        shape.intermediate,
        shape.q_width,
        shape.kv_width,
        shape.heads,
        setup.seq,
    )
    out = LayerSaved()
    norm = 4 * h + 4

    def adapt(names: tuple[str, ...], width: int, rg: bool, already_saved: bool = False) -> None:
        inputs, a_out = _lora_inputs(
            [adapters[n] for n in names if n in adapters], width, rg, already_saved, spec, setup, mask_bytes
        )
        out.add("LoRA inputs", inputs)
        out.add("lora_A outputs", a_out)

    x_rg = input_requires_grad
    if x_rg:
        out.add("RMSNorm fp32 copies", norm)
    adapt(("q_proj", "k_proj", "v_proj"), h, x_rg)
    q_rg, k_rg, v_rg = (x_rg or n in adapters for n in ("q_proj", "k_proj", "v_proj"))
    attn_rg = q_rg or k_rg or v_rg
    attn_out_saved = False
    if setup.attention in ("sdpa", "flash"):
        if attn_rg:
            # q and k after RoPE, v (kv heads: GQA is native), the output, fp32 logsumexp.
            out.add("attention (q, k, v, out, logsumexp)", s * (2 * qw + 2 * kw) + 4 * heads)
            attn_out_saved = True
    else:
        # eager: k and v are repeated to all heads; scores are B x heads x T x T. q.k^T saves
        # q for k's gradient and k for q's; probs.v saves v (for the probs' gradient).
        out.add("attention q/k/v", s * qw * ((1 if k_rg else 0) + (1 if q_rg else 0) + (1 if q_rg or k_rg else 0)))
        if s == 4:
            scores = 4 * heads * t if attn_rg else 0
        else:
            scores = (4 * heads * t if q_rg or k_rg else 0) + (s * heads * t if v_rg else 0)
        out.add("attention scores (fp32 softmax + cast)", scores)
    adapt(("o_proj",), qw, attn_rg, already_saved=attn_out_saved)
    h1_rg = x_rg or attn_rg or "o_proj" in adapters
    if h1_rg:
        out.add("RMSNorm fp32 copies", norm)
    adapt(("gate_proj", "up_proj"), h, h1_rg)
    gate_rg = h1_rg or "gate_proj" in adapters
    up_rg = h1_rg or "up_proj" in adapters
    # SwiGLU: silu saves gate; act * up saves up (for act's grad) and act (for up's grad).
    out.add("MLP (gate, silu, up)", s * inter * ((1 if gate_rg else 0) * 2 + (1 if up_rg else 0)))
    act_rg = gate_rg or up_rg
    adapt(("down_proj",), inter, act_rg)
    out.output_requires_grad = h1_rg or act_rg or "down_proj" in adapters
    return out


@dataclass(frozen=True)
class ActivationEstimate:
    """Bytes on one GPU for one micro-batch."""

    saved: int  # held from the forward until the backward reaches them
    saved_parts: dict[str, int]
    recompute: int  # one layer's saved tensors, rebuilt in backward (checkpointing)
    backward_transient: int  # gradients alive while one layer runs backward
    logits: int  # logits + loss peak
    layer_bytes_per_token: int  # the largest layer's saved bytes per token, its input requiring grad


def saved_per_layer(
    shape: ModelShape,
    layout: AdapterLayout,
    lora: LoraSpec,
    setup: TrainingSetup,
    mask_bytes: int = CUDA_DROPOUT_MASK_BYTES,
) -> tuple[list[LayerSaved], bool]:
    """Each decoder layer's saved bytes per token, and whether the final norm's input needs grad."""
    embed_trained = layout.on("model.embed_tokens") is not None or any(
        m.name == "model.embed_tokens" for m in layout.saved_copies
    )
    rg = setup.checkpointing != "none" or embed_trained
    layers = []
    for i in range(shape.layers):
        layer = _layer(shape, layout.in_layer(i), lora, setup, rg, mask_bytes)
        layers.append(layer)
        rg = layer.output_requires_grad
    return layers, rg


def estimate(
    shape: ModelShape,
    layout: AdapterLayout,
    lora: LoraSpec,
    setup: TrainingSetup,
    mask_bytes: int = CUDA_DROPOUT_MASK_BYTES,
) -> ActivationEstimate:
    s, n_tok, h = setup.compute_bytes, setup.tokens, shape.hidden
    layers, final_rg = saved_per_layer(shape, layout, lora, setup, mask_bytes)
    parts: dict[str, int] = {}

    def add(part: str, n_bytes: int) -> None:
        if n_bytes:
            parts[part] = parts.get(part, 0) + n_bytes

    if setup.checkpointing == "none":
        for layer in layers:
            for part, per_token in layer.parts.items():
                add(part, per_token * n_tok)
        recompute = 0
    else:
        # Each checkpointed layer keeps only its input hidden state; backward recomputes one
        # layer at a time (its input now requires grad, so the full set is saved again).
        add("checkpointed layer inputs", shape.layers * s * h * n_tok)
        recompute = max(layer.total for layer in layers) * n_tok
    if final_rg:
        add("RMSNorm fp32 copies", (4 * h + 4) * n_tok)
    head = layout.on("lm_head")
    if head is not None:
        inputs, a_out = _lora_inputs([head], h, final_rg, False, lora, setup, mask_bytes)
        add("LoRA inputs", inputs * n_tok)
        add("lora_A outputs", a_out * n_tok)
    embed = layout.on("model.embed_tokens")
    if embed is not None:
        add("lora_A outputs", (8 + embed.r * setup.adapter_bytes) * n_tok)  # token ids + A rows
    # RoPE cos/sin (position ids are 1 x T, shared by the batch and by every layer).
    add("rotary cos/sin", 2 * setup.seq * shape.head_dim * s)
    full = max(_layer(shape, layout.in_layer(i), lora, setup, True, mask_bytes).total for i in range(shape.layers))
    return ActivationEstimate(
        saved=sum(parts.values()),
        saved_parts=parts,
        recompute=recompute,
        backward_transient=backward_transient(shape, setup),
        logits=logits_bytes(shape, setup),
        layer_bytes_per_token=full,
    )


def backward_transient(shape: ModelShape, setup: TrainingSetup) -> int:
    """Gradients alive at once inside one layer's backward (an estimate, see the docs):
    the residual-stream gradient in and out, plus the larger of the MLP's three
    intermediate-wide gradients and attention's (eager: two T-wide score gradients and the
    fp32 one between them; fused: dq, dk, dv and the fp32 dq accumulator)."""
    s, t = setup.compute_bytes, setup.seq
    mlp = 3 * s * shape.intermediate
    if setup.attention == "eager":
        attention = (2 * s + 4) * shape.heads * t + 3 * s * shape.q_width
    else:
        attention = s * (shape.q_width + 2 * shape.kv_width) + 4 * shape.q_width
    per_token = 2 * s * shape.hidden + max(mlp, attention)
    dequant = 0
    if setup.precision == "4bit":
        # bitsandbytes dequantizes the 4-bit weight to the compute dtype for each matmul.
        dequant = s * max(shape.hidden * shape.intermediate, shape.hidden * shape.q_width)
    return per_token * setup.tokens + dequant


def chunk_tokens(shape: ModelShape, setup: TrainingSetup) -> int:
    """Liger's fused linear cross-entropy chunk: next power of 2 of BT / ceil(V / h)."""
    chunks = math.ceil(shape.vocab / shape.hidden)
    return 1 << max(0, math.ceil(math.log2(max(1, math.ceil(setup.tokens / chunks)))))


def logits_bytes(shape: ModelShape, setup: TrainingSetup) -> int:
    """Peak of the loss: B*T*V logits and what cross-entropy keeps and produces."""
    n_tok, vocab, s = setup.tokens, shape.vocab, setup.compute_bytes
    if setup.loss == "fp32-upcast":
        # transformers' ForCausalLMLoss: logits.float(), then log_softmax saves its fp32 output;
        # backward holds that, its incoming gradient and the gradient to the logits (4 B each).
        return 12 * n_tok * vocab
    if setup.loss == "native":
        return 3 * s * n_tok * vocab
    return chunk_tokens(shape, setup) * vocab * s + n_tok * shape.hidden * s


@dataclass(frozen=True)
class LossForward:
    """What the loss holds during and after the forward (bytes on one GPU), the part of the
    logits term a memory reading taken at the end of the forward can see."""

    #: The logits the model returns (s B*T*V; none for a chunked loss, which never builds them).
    logits: int
    #: What the loss saves for backward: the log-probs (fp32-upcast: 4 B*T*V, native: s B*T*V),
    #: or a chunked loss's hidden-state gradient, written in the forward (s B*T*h).
    saved: int
    #: Freed when the loss returns: fp32-upcast's fp32 copy of 16-bit logits, a chunk's logits.
    transient: int


def loss_forward(shape: ModelShape, setup: TrainingSetup) -> LossForward:
    n_tok, vocab, s = setup.tokens, shape.vocab, setup.compute_bytes
    if setup.loss == "fp32-upcast":
        return LossForward(s * n_tok * vocab, 4 * n_tok * vocab, (4 * n_tok * vocab) if s < 4 else 0)
    if setup.loss == "native":
        return LossForward(s * n_tok * vocab, s * n_tok * vocab, 0)
    return LossForward(0, s * n_tok * shape.hidden, s * chunk_tokens(shape, setup) * vocab)


def activation_terms(shape: ModelShape, layout: AdapterLayout, lora: LoraSpec, setup: TrainingSetup) -> list[Term]:
    est = estimate(shape, layout, lora, setup)
    n_tok = setup.tokens
    tok = f"B*T = {setup.micro_batch} x {setup.seq} = {count(n_tok)} tokens"
    if setup.checkpointing == "none":
        saved_formula = "sum over layers of per-layer saved bytes/token x B*T"
        saved_detail = (
            f"{count(est.layer_bytes_per_token)} B/token per layer x {shape.layers} layers, "
            f"{tok} ({setup.attention} attention)"
        )
    else:
        saved_formula = "L x s h x B*T (checkpointed layer inputs) + final norm"
        saved_detail = (
            f"{shape.layers} x {setup.compute_bytes} x {shape.hidden} x {count(n_tok)} ({setup.checkpointing})"
        )
    backward = est.recompute + est.backward_transient
    logits_label = {
        "fp32-upcast": "12 B*T*V (fp32 log-probs, their gradient, the logits' gradient)",
        "native": "3 s B*T*V (log-probs, their gradient, the logits' gradient)",
        "chunked": f"s chunk*V + s B*T*h (chunk = {chunk_tokens(shape, setup)} tokens)",
    }[setup.loss]
    logits_on_top = est.logits >= backward
    return [
        Term(
            "activations",
            "activations (saved for backward)",
            est.saved,
            saved_formula,
            saved_detail,
            parts=dict(est.saved_parts),
        ),
        Term(
            "layer_backward",
            "layer backward (recompute + grads)" if est.recompute else "layer backward (grads)",
            backward,
            "recomputed layer (checkpointing) + gradient transients of one layer",
            (f"recompute {count(est.recompute)} B + " if est.recompute else "")
            + f"transients {count(est.backward_transient)} B",
            counted=not logits_on_top,
        ),
        Term(
            "logits",
            f"logits + loss ({setup.loss})",
            est.logits,
            logits_label,
            f"{count(n_tok)} tokens x vocab {count(shape.vocab)}",
            counted=logits_on_top,
        ),
    ]
