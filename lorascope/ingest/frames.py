"""Stack frames as allocator snapshots and flight-recorder dumps record them.

A frame is a mapping with ``filename``, ``line`` and ``name``, innermost first. Real
stacks start with C++ unwind frames (``torch::unwind::unwind()``, filename ``??``) and
torch's own Python frames; the useful "user frame" is the first Python frame outside
torch and lorascope's probes (transformers, peft, deepspeed and the training script all
count as user code: that is where a LoRA job decides what to allocate).

The memory category of an allocation is read from the whole stack, innermost first: the
first frame that says what is going on wins (an allocation in ``optimizer.step`` is
optimizer state even though the step was called from the training loop).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: The categories an allocation can fall into. "unknown": no frames (allocated before
#: history recording started, or recorded without stacks).
CATEGORIES = ("weights", "optimizer", "gradients", "activations", "logits", "other", "unknown")

#: torch's own files: the package where it is installed (after site- or dist-packages, or
#: a frame already shortened to ``torch/...``) or in a source checkout (``.../torch/nn/``).
#: Not any directory named torch: the GPU check's machine keeps its virtual environment in
#: /opt/torch/.venv, and every frame under it, transformers' and the job's, read as torch's.
TORCH_FILE = (
    r"(?:^|[/\\](?:site|dist)-packages[/\\])torch[/\\]"
    r"|[/\\]torch[/\\](?:nn|distributed|autograd|utils|optim|cuda|amp|fx|_\w+)(?:[/\\]|\.py(?![\w.]))"
)


def _modules(package: str) -> str:
    here = Path(__file__).resolve().parents[1] / package
    return "|".join(sorted(re.escape(p.stem) for p in here.glob("*.py")))


#: lorascope's probe and run-directory modules (their wrappers sit between the job's code
#: and torch in every stack of a probed job: the model's forward, every collective, DDP's
#: set-up), by name: the repository's probes/ jobs (train_lora.py ...) live in a directory
#: of that name too.
LORASCOPE_FILE = rf"(?:^|[/\\])lorascope[/\\](?:probes[/\\](?:{_modules('probes')})|rundir[/\\](?:{_modules('rundir')}))\.py(?![\w.])"
_NOT_USER_FILE = re.compile(f"{TORCH_FILE}|{LORASCOPE_FILE}")
_SITE_PACKAGES = re.compile(r"^.*?[/\\](?:site|dist)-packages[/\\]")

#: (category, pattern on "filename:name"), tried in this order on every frame.
_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        "logits",
        re.compile(
            r"cross_entropy|log_softmax|nll_loss|ForCausalLMLoss|loss_utils\.py|"
            r"[/\\]loss[/\\]|lm_head|logits|chunked_loss|fused_linear_cross",
            re.I,
        ),
    ),
    (
        "optimizer",
        re.compile(
            r"[/\\]optim[/\\]|optimizer|[/\\]zero[/\\]stage.*:(step|_optimizer_step|"
            r"_create_fp32|initialize_optimizer)|adam",
            re.I,
        ),
    ),
    (
        "gradients",
        re.compile(
            r"[/\\]autograd[/\\]|_tensor\.py:backward|:backward$|_engine_run_backward|"
            r"reduce_gradients|allreduce_gradients|reduce_ready_partitions",
            re.I,
        ),
    ),
    (
        "weights",
        re.compile(
            r":(_apply|to|cuda|load_state_dict|_load_from_state_dict|from_pretrained|"
            r"_load_pretrained_model|load_checkpoint|reset_parameters|get_peft_model|"
            r"_move_model_to_device|_convert_zero_checkpoint|partition_param|"
            r"_post_init_method|init_weights|_init_weights)$|partition_parameters\.py",
            re.I,
        ),
    ),
    (
        "activations",
        re.compile(
            r":(forward|_call_impl|_wrapped_call_impl|checkpoint|_checkpoint_"
            r"without_reentrant|recompute_fn)$",
            re.I,
        ),
    ),
)


#: C++ frames that show an allocation happens in the autograd engine (its device threads
#: carry no Python stack at all).
_BACKWARD_CPP = re.compile(r"Backward\d*::apply|AccumulateGrad|autograd::Engine::evaluate_function")


def is_python_frame(frame: Mapping[str, Any]) -> bool:
    filename = str(frame.get("filename", ""))
    return filename.endswith(".py") or (filename.startswith("<") and "frozen" not in filename)


def is_user_frame(frame: Mapping[str, Any]) -> bool:
    """A Python frame outside torch's own package and lorascope's probes."""
    return is_python_frame(frame) and not _NOT_USER_FILE.search(str(frame.get("filename", "")))


@functools.lru_cache(maxsize=1 << 12)
def short_path(filename: str) -> str:
    """A path without the interpreter's site-packages prefix (``transformers/models/...``);
    remembered: a flight-recorder dump names the same few files in every frame of its
    thousands (a regular expression a frame was most of its reading)."""
    return _SITE_PACKAGES.sub("", filename)


def frame_label(frame: Mapping[str, Any]) -> str:
    return f"{short_path(str(frame.get('filename', '?')))}:{frame.get('line', '?')} in {frame.get('name', '?')}"


def user_frames(frames: Sequence[Any] | None, limit: int = 8) -> list[str]:
    """Labels of the first ``limit`` user frames, innermost first."""
    out: list[str] = []
    for f in frames or ():
        if isinstance(f, Mapping) and is_user_frame(f):
            out.append(frame_label(f))
            if len(out) >= limit:
                break
    return out


def site_of(frames: Sequence[Any] | None) -> str:
    """Where an allocation comes from: its first user frame, or why there is none."""
    if not frames:
        return "<no stack recorded>"
    first_python = None
    for f in frames:
        if not isinstance(f, Mapping):
            continue
        if is_user_frame(f):
            return frame_label(f)
        if first_python is None and is_python_frame(f):
            first_python = f
    if first_python is not None:
        return frame_label(first_python)  # only torch frames: the innermost one says most
    for f in frames:
        if isinstance(f, Mapping) and _BACKWARD_CPP.search(str(f.get("name", ""))):
            return f"<backward, C++: {str(f.get('name'))[:120]}>"
    return "<C++ frames only>"


def category_of(frames: Sequence[Any] | None) -> str:
    """weights / optimizer / gradients / activations / logits / other / unknown (see module doc)."""
    if not frames:
        return "unknown"
    for f in frames:
        if not isinstance(f, Mapping):
            continue
        if not is_python_frame(f):
            if _BACKWARD_CPP.search(str(f.get("name", ""))):
                return "gradients"
            continue
        key = f"{f.get('filename', '')}:{f.get('name', '')}"
        for category, pattern in _RULES:
            if pattern.search(key):
                return category
    return "other"
