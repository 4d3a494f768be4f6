"""The plan: the budget for the inputs, its verdict against the card, the changes that
would lower it, and the notes it rests on. ``Plan.to_dict()`` is what ``--json`` prints."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lorascope.plan.budget import EDGE_FRACTION, PlanInputs, compute_budget, notes, verdict
from lorascope.plan.changes import Change, suggest
from lorascope.plan.params import ParamCounts
from lorascope.plan.terms import Term


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    params: ParamCounts
    #: How many modules got LoRA adapters.
    adapted_modules: int
    terms: tuple[Term, ...]
    total: int
    allocated: int
    verdict: str
    changes: tuple[Change, ...]
    notes: tuple[str, ...]

    def term(self, key: str) -> Term:
        return next(t for t in self.terms if t.key == key)

    def to_dict(self) -> dict[str, Any]:
        i = self.inputs
        s, z, lora = i.setup, i.setup.zero, i.lora
        return {
            "model": {
                "name": i.shape.name,
                "source": i.source,
                "model_type": i.shape.model_type,
                "hidden": i.shape.hidden,
                "intermediate": i.shape.intermediate,
                "layers": i.shape.layers,
                "heads": i.shape.heads,
                "kv_heads": i.shape.kv_heads,
                "head_dim": i.shape.head_dim,
                "vocab": i.shape.vocab,
                "tied_embeddings": i.shape.tied_embeddings,
            },
            "lora": {
                "r": lora.r,
                "alpha": lora.alpha,
                "targets": lora.targets_text,
                "dropout": lora.dropout,
                "rslora": lora.rslora,
                "dora": lora.dora,
                "adapted_modules": self.adapted_modules,
            },
            "setup": {
                "precision": s.precision,
                "fp32_adapters": s.fp32_adapters,
                "zero_stage": z.stage,
                "offload_optimizer": z.offload_optimizer,
                "offload_params": z.offload_params,
                "gpus_per_node": s.gpus_per_node,
                "nodes": s.nodes,
                "world_size": s.world,
                "seq": s.seq,
                "micro_batch": s.micro_batch,
                "checkpointing": s.checkpointing,
                "attention": s.attention,
                "loss": s.loss,
                "reduce_bucket_size": z.reduce_bucket_size,
                "prefetch_bucket_size": z.prefetch_bucket_size,
                "param_persistence_threshold": z.param_persistence_threshold,
                "fsdp": None
                if s.fsdp is None
                else {
                    "version": s.fsdp.version,
                    "strategy": s.fsdp.strategy,
                    "reshard_after_forward": s.fsdp.reshard_after_forward,
                    "mixed_precision": s.fsdp.mixed_precision,
                    "reduce_dtype": "fp32" if s.fsdp.reduce_fp32 else "param_dtype",
                    "offload_params": s.fsdp.offload_params,
                    "shard_world": s.shard_world,
                    "label": s.fsdp.label,
                },
            },
            "params": self.params.to_dict(),
            "terms": [t.to_dict() for t in self.terms],
            "total_bytes": self.total,
            "allocated_bytes": self.allocated,
            "gpu_mem_bytes": i.gpu_mem,
            "edge_fraction": EDGE_FRACTION,
            "verdict": self.verdict,
            "changes": [c.to_dict() for c in self.changes],
            "notes": list(self.notes),
        }


def build_plan(inputs: PlanInputs) -> Plan:
    budget = compute_budget(inputs)
    total = budget.total
    return Plan(
        inputs,
        budget.params,
        len(budget.layout.adapters),
        budget.terms,
        total,
        budget.allocated,
        verdict(total, inputs.gpu_mem),
        tuple(suggest(inputs, total)),
        tuple(notes(inputs, budget)),
    )
