"""reentrant-dead-grads: reentrant activation checkpointing with a frozen embedding, so
nothing entering a checkpointed block requires grad and the adapters get no gradient
(or backward fails with a misleading error).

Evidence, each weighed: the checkpointing settings the model reported (use_reentrant),
whether an input-require-grads hook was registered, the adapters' gradients after the
first backward (lora_B's gradient is the tell: lora_A's is zero at step 1 in any healthy
run, because lora_B starts at zero), torch's warning "None of the inputs have
requires_grad=True", and the errors backward raises in this state.
"""

from __future__ import annotations

from lorascope.detect.common import stream_source
from lorascope.detect.finding import Confidence, Evidence, Finding
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.rundir.loading.reader import RunData
from lorascope.units import ranks_named

ID = "reentrant-dead-grads"
WARNING_TEXT = "None of the inputs have requires_grad=True"
#: What backward raises when the loss does not require grad (DeepSpeed ZeRO; plain torch).
ERROR_TEXTS = ("loss must be a scalar tensor", "element 0 of tensors does not require grad")


def dead_adapters(run: RunData) -> tuple[list[str], int]:
    """lora_B tensors whose gradient is missing or zero on every rank (ZeRO-3 ranks hold a
    partition each: a gradient is zero only when every partition is), and how many lora_B
    tensors were checked."""
    combined: dict[str, set[str]] = {}
    for rank in run.ranks.values():
        if rank.grads is None:
            continue
        for name, status in zip(rank.grads["names"], rank.grads["status"], strict=False):
            if ".lora_B." in name:
                combined.setdefault(name, set()).add(status)
    dead = [name for name, statuses in combined.items() if "o" not in statuses]
    return dead, len(combined)


def detect(bundle: EvidenceBundle) -> list[Finding]:
    run = bundle.run
    if run is None or not run.ranks:
        return []
    evidence: list[Evidence] = []
    ranks: set[int] = set()
    reentrant = hookless = False
    for rank in run.ranks.values():
        setup = rank.grad_setup
        if setup is not None and setup["checkpointing"].get("enabled"):
            if True in setup["checkpointing"].get("use_reentrant", []):
                reentrant = True
                hookless = hookless or setup["input_require_grads_hooks"] == 0
    first = next(iter(run.ranks.values()))
    if reentrant:
        evidence.append(
            Evidence(
                "activation checkpointing",
                "use_reentrant=True" + (", no input-require-grads hook on the embeddings" if hookless else ""),
                stream_source(run, first, "grad_setup record"),
            )
        )
    warned = [r.rank for r in run.ranks.values() if any(WARNING_TEXT in w["message"] for w in r.warnings)]
    if warned:
        ranks.update(warned)
        evidence.append(
            Evidence(
                "torch warned",
                f'"{WARNING_TEXT}. Gradients will be None" on {ranks_named(warned)}',
                stream_source(run, run.ranks[warned[0]], "warning records"),
            )
        )
    failed = [r for r in run.ranks.values() if r.exception and any(t in r.exception["message"] for t in ERROR_TEXTS)]
    if failed and (exc := failed[0].exception) is not None:
        ranks.update(r.rank for r in failed)
        evidence.append(
            Evidence(
                "backward failed",
                f"{exc['type']}: {exc['message'].splitlines()[0][:200]} (ranks {[r.rank for r in failed]})",
                stream_source(run, failed[0], "exception record"),
            )
        )
    dead, checked = dead_adapters(run)
    if dead:
        ranks.update(r.rank for r in run.ranks.values() if r.grads is not None)
        evidence.append(
            Evidence(
                "adapters without gradient after the first backward",
                f"{len(dead)} of {checked} lora_B tensors (e.g. {dead[0]})",
                stream_source(run, first, "grads record"),
            )
        )
    symptoms = bool(warned) + bool(failed) + bool(dead)
    if not symptoms or not (reentrant or dead):
        return []
    confidence: Confidence = "high" if reentrant and symptoms >= 1 and (hookless or symptoms >= 2) else "medium"
    reasons = []
    if reentrant:
        reasons.append("reentrant checkpointing recorded" + (" without the input hook" if hookless else ""))
    reasons.append(
        f"{symptoms} independent symptom(s): "
        + ", ".join(
            s for s, on in (("the warning", warned), ("the backward error", failed), ("dead lora_B grads", dead)) if on
        )
    )
    if dead and checked and len(dead) < checked:
        title = f"{len(dead)} of {checked} LoRA adapters get no gradient"
    elif failed:
        title = "backward fails because no checkpointed input requires grad (reentrant checkpointing)"
    else:
        title = "the LoRA adapters get no gradient: reentrant checkpointing cuts them off"
    return [
        Finding(
            id=ID,
            title=title,
            severity="error",
            confidence=confidence,
            confidence_reason="; ".join(reasons),
            ranks=sorted(ranks) or sorted(run.ranks),
            evidence=evidence,
            explanation=(
                "Reentrant activation checkpointing (torch.utils.checkpoint with use_reentrant=True) "
                "only builds a backward graph through a checkpointed block if one of its tensor "
                "inputs requires grad. With LoRA the embedding is frozen, so the hidden states "
                "entering the first block do not, and every adapter inside checkpointed blocks is "
                "silently skipped: no gradient, a flat loss, or, when nothing else requires grad, "
                "a backward error that does not mention checkpointing at all."
            ),
            fix=(
                "Use non-reentrant checkpointing: model.gradient_checkpointing_enable("
                "gradient_checkpointing_kwargs={'use_reentrant': False}); or keep reentrant and call "
                "model.enable_input_require_grads() before wrapping the model (PEFT's "
                "prepare_model_for_kbit_training does it)."
            ),
            details={"dead_lora_B": dead, "lora_B_checked": checked},
        )
    ]
