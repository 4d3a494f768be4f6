"""A bounded kernel-trace window: ``torch.profiler`` for ``steps`` steps starting after
step ``start``, exported as Kineto Chrome-trace JSON (gzipped) into the rank's directory.

The profiler runs on a ``torch.profiler.schedule`` stepped at every step end
(``prof.step()``), as HolisticTraceAnalysis's per-iteration analyses expect: each traced
step is a ``ProfilerStep#N`` range with N the job's own step number. It starts one step
early, for the schedule's warm-up step (Kineto skews the first recorded step without one).

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
        self._exported: Path | None = None
        self.model: Any = None
        self.on_step_end = session.guarded("kernels")(self._on_step_end)

    def _on_step_end(self) -> None:
        if self.window is None:
            return
        start, count = self.window
        step = self.session.step
        if self._profiler is None and self._exported is None and step == start - 1:
            self._start()  # the warm-up step is step START; START+1 .. START+STEPS are recorded
        elif self._profiler is not None:
            self._profiler.step()  # ProfilerStep#<step + 1> begins; the last one saves the trace
            if step >= start + count:
                self._stop()

    def _start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile, schedule

        start, count = self.window or DEFAULT_WINDOW
        activities = [ProfilerActivity.CPU]
        cuda: Any = torch.cuda
        if cuda.is_available() and cuda.is_initialized():
            activities.append(ProfilerActivity.CUDA)
        if self.model is not None:
            self._names = {id(m): name for name, m in self.model.named_modules() if name}
            modules = torch.nn.modules.module
            self._hooks = [
                modules.register_module_forward_pre_hook(self._enter),
                modules.register_module_forward_hook(self._exit),
            ]
        self._profiler = profile(
            activities=activities,
            record_shapes=True,
            schedule=schedule(skip_first=start, wait=0, warmup=1, active=count, repeat=1),
            on_trace_ready=self.session.guarded("kernels")(self._export),
        )
        self._profiler.step_num = start  # ProfilerStep#N numbered as the job's steps
        self._profiler.start()
        self.session.record("trace_window", edge="begin", step=self.session.step + 1)

    def _enter(self, module: Any, _inputs: Any) -> None:
        name = self._names.get(id(module))
        if name is not None:
            from torch.autograd.profiler import record_function

            rf: Any = record_function(MODULE_PREFIX + name)
            rf.__enter__()
            self._ranges.setdefault(id(module), []).append(rf)

    def _exit(self, module: Any, _inputs: Any, _output: Any) -> None:
        stack = self._ranges.get(id(module))
        if stack:
            stack.pop().__exit__(None, None, None)

    def _export(self, profiler: Any) -> None:
        """The schedule's last recorded step ended: write the trace (gzipped)."""
        raw = self._out_prefix.with_name(self._out_prefix.name + ".trace.json")
        profiler.export_chrome_trace(str(raw))
        final = raw.with_name(raw.name + ".gz")
        with open(raw, "rb") as src, gzip.open(final, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst)
        os.unlink(raw)
        self._exported = final

    def _stop(self) -> None:
        profiler, self._profiler = self._profiler, None
        for handle in self._hooks:
            handle.remove()
        self._hooks, self._ranges = [], {}
        profiler.stop()
        if self._exported is None:
            return  # stopped before a step was recorded (the job ended in the warm-up step)
        start = (self.window or DEFAULT_WINDOW)[0]
        self.session.record(
            "trace_window",
            edge="end",
            step=self.session.step,
            file=self._exported.name,
            steps=[start + 1, self.session.step],
        )

    def close(self) -> None:
        """At exit with the window still open: stop it and write what was traced."""
        if self._profiler is not None and "torch" in sys.modules:
            self.session.guarded("kernels")(self._stop)()
