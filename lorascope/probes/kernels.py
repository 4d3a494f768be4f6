"""A bounded kernel-trace window: ``torch.profiler`` for ``steps`` steps starting after
step ``start``, exported as Kineto Chrome-trace JSON (gzipped) into the rank's directory.

Never always-on (DESIGN.md: tracing every step triples RSS and writes ~110 MB per rank
per 40 steps). While the window is open, every module of the model runs inside a
``record_function`` range named ``lorascope.module::<qualified name>``, so that kernels
(on CPU: ops) can be attributed to ``lora_A`` / ``lora_B`` / base layers by containment.
The export takes a few seconds, once, at the step that closes the window.
"""

from __future__ import annotations

import gzip
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from lorascope.probes.session import Session

MODULE_PREFIX = "lorascope.module::"
#: One range per traced step (torch's own ProfilerStep# needs a schedule).
STEP_PREFIX = "lorascope.step#"
DEFAULT_WINDOW = (5, 2)


def parse_window(text: str | None) -> tuple[int, int] | None:
    """``"START:STEPS"`` (trace steps START+1 .. START+STEPS), ``"off"`` or None for the default."""
    if text is None or text == "":
        return DEFAULT_WINDOW
    if text.strip().lower() in ("off", "0", "none"):
        return None
    start, _, count = text.partition(":")
    window = (int(start), int(count or DEFAULT_WINDOW[1]))
    if window[0] < 0 or window[1] < 1:
        raise ValueError(f"bad trace window {text!r}: START >= 0 and STEPS >= 1")
    return window


class KernelWindow:
    def __init__(self, session: Session, window: tuple[int, int] | None, out_prefix: Path) -> None:
        self.session = session
        self.window = window
        self._out_prefix = out_prefix
        self._profiler: Any = None
        self._hooks: list[Any] = []
        self._ranges: dict[int, list[Any]] = {}
        self._names: dict[int, str] = {}
        self._step_range: Any = None
        self.model: Any = None
        self.on_step_end = session.guarded("kernels")(self._on_step_end)

    def _on_step_end(self) -> None:
        if self.window is None:
            return
        start, count = self.window
        step = self.session.step
        if self._profiler is None and step == start:
            self._start()
        elif self._profiler is not None:
            self._close_step_range()
            if step >= start + count:
                self._stop()
            else:
                self._open_step_range()

    def _open_step_range(self) -> None:
        from torch.autograd.profiler import record_function

        self._step_range = record_function(f"{STEP_PREFIX}{self.session.step + 1}")
        self._step_range.__enter__()

    def _close_step_range(self) -> None:
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None

    def _start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            activities.append(ProfilerActivity.CUDA)
        if self.model is not None:
            self._names = {id(m): name for name, m in self.model.named_modules() if name}
            modules = torch.nn.modules.module
            self._hooks = [
                modules.register_module_forward_pre_hook(self._enter),
                modules.register_module_forward_hook(self._exit),
            ]
        self._profiler = profile(activities=activities, record_shapes=True)
        self._profiler.start()
        self._open_step_range()
        self.session.record("trace_window", edge="begin", step=self.session.step)

    def _enter(self, module: Any, _inputs: Any) -> None:
        name = self._names.get(id(module))
        if name is not None:
            from torch.autograd.profiler import record_function

            rf = record_function(MODULE_PREFIX + name)
            rf.__enter__()
            self._ranges.setdefault(id(module), []).append(rf)

    def _exit(self, module: Any, _inputs: Any, _output: Any) -> None:
        stack = self._ranges.get(id(module))
        if stack:
            stack.pop().__exit__(None, None, None)

    def _stop(self) -> None:
        self._close_step_range()
        profiler, self._profiler = self._profiler, None
        for handle in self._hooks:
            handle.remove()
        self._hooks, self._ranges = [], {}
        profiler.stop()
        raw = self._out_prefix.with_name(self._out_prefix.name + ".trace.json")
        profiler.export_chrome_trace(str(raw))
        final = raw.with_name(raw.name + ".gz")
        with open(raw, "rb") as src, gzip.open(final, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst)
        os.unlink(raw)
        self.session.record(
            "trace_window",
            edge="end",
            step=self.session.step,
            file=final.name,
            steps=[self.window[0] + 1, self.session.step],
        )

    def close(self) -> None:
        """At exit with the window still open: stop it and write what was traced."""
        if self._profiler is not None and "torch" in sys.modules:
            self.session.guarded("kernels")(self._stop)()
