"""The memory model behind ``lorascope plan``: the per-GPU budget of a LoRA fine-tuning job
under DeepSpeed ZeRO, term by term (docs/memory-model.md), before it is launched.

Pure computation on config-level data: nothing here imports torch, transformers or PEFT.
"""

from lorascope.plan.budget import DEFAULT_GPU_MEM, PlanInputs
from lorascope.plan.builder import Plan, build_plan
from lorascope.plan.from_configs import plan_from_configs
from lorascope.plan.lora import LoraSpec
from lorascope.plan.presets import PRESETS, preset_shape
from lorascope.plan.render import render_text
from lorascope.plan.shape import ModelShape, shape_from_config
from lorascope.plan.training import TrainingSetup, ZeroSetup

__all__ = [
    "DEFAULT_GPU_MEM",
    "PRESETS",
    "LoraSpec",
    "ModelShape",
    "Plan",
    "PlanInputs",
    "TrainingSetup",
    "ZeroSetup",
    "build_plan",
    "plan_from_configs",
    "preset_shape",
    "render_text",
    "shape_from_config",
]
