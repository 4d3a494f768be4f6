"""Steps and phases: from the DeepSpeed engine (forward / backward / step), from plain
torch loops as far as they can be seen (DDP forward, ``Tensor.backward``, the global
optimizer-step hooks), and the Hugging Face ``Trainer``'s evaluation and checkpoint
saves (its steps come from the engine or the optimizer below it). Each phase edge also takes a memory sample; each finished step
records its wall time and the loss when one was seen. Every record also holds the time the
job's threads were blocked on async collectives' handles since the step began
(``Session.waited_ns``, added to by the collectives probe's wait wrappers).

Steps and phase edges are fixed-width records of the process's steps file
(``HOST-PID.steps``, :func:`lorascope.rundir.format.callfile.step_file`), written in place
by the thread that makes them; a phase's name and a step's source are ``label`` records of
the stream, declared once.

Reading the loss must not synchronise the device: on CPU it is read at once; on CUDA
it is copied without blocking and read at the next step end, once its event is done.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib
import math
import sys
import time
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from lorascope.probes.grads import GradProbe
from lorascope.probes.kernels import KernelWindow
from lorascope.probes.logits import LogitsProbe
from lorascope.probes.memory import STRIDED_PHASES, MemoryProbe
from lorascope.probes.session import COST_EVERY, Session, plain
from lorascope.rundir.format.callfile import step_file, steps_path
from lorascope.rundir.format.layout import BEGIN, END, STEP_END
from lorascope.rundir.format.schema import WARM_UP_STEPS

#: A phase edge's ``kind`` in the steps file.
_EDGES = {"begin": BEGIN, "end": END}
#: A step over SLOW_STEP times the median of the SLOW_WINDOW steps before it (once there
#: are SLOW_AFTER) is slow: its calls are kept in full past the call file's ring.
SLOW_STEP = 1.5
SLOW_WINDOW = 64
SLOW_AFTER = 8


def ddp_settings(wrapper: Any) -> dict[str, Any]:
    """A ``DistributedDataParallel``'s settings that change memory or collectives.
    ``sink_clone``: its ``_DDPSink`` copies the outputs in the forward (torch does it under
    ``find_unused_parameters``, and in the first forward under ``static_graph``)."""
    return {
        "find_unused_parameters": bool(getattr(wrapper, "find_unused_parameters", False)),
        "static_graph": bool(getattr(wrapper, "static_graph", False)),
        "sink_clone": bool(getattr(wrapper, "_ddp_sink_clone", True)),
        "gradient_as_bucket_view": bool(getattr(wrapper, "gradient_as_bucket_view", False)),
        "broadcast_buffers": bool(getattr(wrapper, "broadcast_buffers", True)),
        "bucket_bytes_cap": getattr(wrapper, "bucket_bytes_cap", None),
    }


class StepRecords:
    """A rank process's steps file (beside its stream); the labels its records name are
    the session's (:meth:`Session.label`). A failed write turns the steps probe off, as any
    failing probe."""

    def __init__(self, session: Session) -> None:
        self.file = step_file(steps_path(session.stream.prefix), on_error=lambda exc: session.fail("steps", exc))
        self.label = session.label
        session.stream.write({"k": "steps_file", "file": self.file.path.name, "how": self.file.how})


class StepProbe:
    """Drives the probes that hang off the training loop: phases, steps, and the ones
    that need the model (gradient health, logits, the kernel-trace window)."""

    def __init__(
        self,
        session: Session,
        memory: MemoryProbe,
        grads: GradProbe,
        logits: LogitsProbe,
        kernels: KernelWindow,
        on_step_end: Callable[[], None],
    ) -> None:
        self.session = session
        self.memory = memory
        self.grads = grads
        self.logits = logits
        self.kernels = kernels
        self.model: Any = None
        self.records = StepRecords(session)
        self._on_step_end = on_step_end
        self._step_start: float | None = None
        #: ``session.waited_ns`` when the step began: a record's ``waited`` is what it added since.
        self._waited_from = 0
        #: The latest steps' durations: a step over SLOW_STEP times their median is slow.
        self._durations: collections.deque[float] = collections.deque(maxlen=SLOW_WINDOW)
        self._loss: Any = None
        self._pending_losses: list[tuple[int, Any, Any]] = []
        self._configs_done: set[str] = set()
        self._open_spans: set[str] = set()
        self._forward_hooks: list[Any] = []
        self.phase = session.guarded("steps", job_thread=True)(self._phase)
        self.step_done = session.guarded("steps")(self._step_done)  # timed inside
        self.see_loss = session.guarded("steps", job_thread=True)(self._see_loss)
        self.record_model = session.guarded("configs")(self._record_model)
        self.record_config = session.guarded("configs")(self._record_config)
        self.adopt_model = session.guarded("configs")(self._adopt_model)
        self.ddp_built = session.guarded("configs")(self._ddp_built)
        self.zero3_built = session.guarded("configs")(self._zero3_built)
        self.adopt_engine = session.guarded("configs")(self._adopt_engine)

    # -- records ------------------------------------------------------------------
    def _phase(self, name: str, edge: str) -> dict[str, Any] | None:
        """A phase edge and its memory reading (returned: None if the memory probe is off)."""
        session = self.session
        if self._step_start is None:
            self._step_start = time.time()
            self._waited_from = session.waited_ns
        records = self.records
        waited = (session.waited_ns - self._waited_from) / 1e9
        records.file.put(time.time(), 0.0, math.nan, waited, session.step, records.label(name), _EDGES[edge])
        if name not in STRIDED_PHASES:  # an eval, a save: its calls kept in full
            session.keep_steps.add(session.step)
        return self.memory.sample(f"{name}.{edge}")

    def _see_loss(self, loss: Any) -> None:
        if loss is None or not hasattr(loss, "numel") or loss.numel() != 1:
            return
        if getattr(loss, "is_cuda", False):
            torch = sys.modules["torch"]
            host = loss.detach().to("cpu", non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._loss = (host, event)
        else:
            self._loss = float(loss.detach().item())

    def _record_loss(self, step: int, value: float) -> None:
        """Strict JSON has no NaN: a non-finite loss is written as null plus its text."""
        if math.isfinite(value):
            self.session.record("loss", step=step, loss=value)
        else:
            self.session.record("loss", step=step, loss=None, text=repr(value))

    def _step_done(self, source: str, reading: dict[str, Any] | None = None) -> None:
        """The step ends: its record, and the memory at its end (``reading``: the one the
        optimizer's end edge took just before, when the step ends there)."""
        began = time.perf_counter_ns()
        now = time.time()
        session = self.session
        session.step += 1
        dur = now - self._step_start if self._step_start is not None else 0.0
        durations = self._durations
        if len(durations) >= SLOW_AFTER and dur > SLOW_STEP * sorted(durations)[len(durations) // 2]:
            session.keep_steps.add(session.step - 1)  # its calls kept in full
        durations.append(dur)
        loss = self._loss
        self._loss = None
        value = loss if isinstance(loss, float) and math.isfinite(loss) else None
        if isinstance(loss, tuple):
            self._pending_losses.append((session.step, *loss))
        records = self.records
        records.file.put(
            time.time(),
            round(dur, 6),
            math.nan if value is None else value,
            (session.waited_ns - self._waited_from) / 1e9,
            session.step,
            records.label(source),
            STEP_END,
        )
        if isinstance(loss, float) and value is None:
            self._record_loss(session.step, loss)
        self._resolve_losses()
        self.memory.sample("step", reading=reading)
        self._on_step_end()
        traced = time.perf_counter_ns()
        self.kernels.on_step_end()
        done = time.perf_counter_ns()
        session.trace_ns += done - traced
        session.cost_ns += done - began  # by hand: the cost record must hold this step's
        if session.step in (1, WARM_UP_STEPS) or session.step % COST_EVERY == 0:
            session.record_cost()
        self._step_start = time.time()
        self._waited_from = session.waited_ns

    def _resolve_losses(self) -> None:
        while self._pending_losses and self._pending_losses[0][2].query():
            step, host, _ = self._pending_losses.pop(0)
            self._record_loss(step, float(host.item()))
        del self._pending_losses[:-64]  # bounded, should the device never catch up

    def _record_config(self, name: str, value: Any) -> None:
        if name in self._configs_done or not value:
            return
        self._configs_done.add(name)
        self.session.record("config", name=name, value=plain(value))

    def _zero3_built(self, engine: Any) -> None:
        """Under ZeRO-3, once the engine is built: the bytes of trainable and frozen weights,
        and of those DeepSpeed left whole on every rank (not partitioned: no ``ds_id``, or
        ``ds_persist`` below stage3_param_persistence_threshold). One pass over the
        parameters' attributes, at the engine's construction; no tensor is read."""
        if engine.zero_optimization_stage() != 3:
            return
        sums = {"frozen_bytes": 0, "frozen_whole_bytes": 0, "frozen_whole_count": 0, "trainable_bytes": 0}
        sums["trainable_whole_bytes"] = 0
        for param in engine.module.parameters():
            numel = int(getattr(param, "ds_numel", 0) or param.numel())
            size = numel * param.element_size()
            whole = not hasattr(param, "ds_id") or bool(getattr(param, "ds_persist", False))
            kind = "trainable" if param.requires_grad else "frozen"
            sums[f"{kind}_bytes"] += size
            if whole:
                sums[f"{kind}_whole_bytes"] += size
                if kind == "frozen":
                    sums["frozen_whole_count"] += 1
        config = getattr(getattr(engine, "_config", None), "zero_config", None)
        threshold = getattr(config, "param_persistence_threshold", None)
        self._record_config("zero3_params", {**sums, "persistence_threshold": threshold})

    def _record_model(self, model: Any) -> None:
        """Remember the job's model; record its LoRA and model configs."""
        if model is None:
            return
        self.model = self.kernels.model = model
        self.logits.watch_model(model)
        peft_config = getattr(model, "peft_config", None)
        if isinstance(peft_config, dict):
            self._record_config(
                "lora", {name: c.to_dict() if hasattr(c, "to_dict") else c for name, c in peft_config.items()}
            )
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "to_dict"):
            self._record_config("model", config.to_dict())

    def _adopt_model(self, model: Any) -> None:
        """A model a sharding wrapper saw (FSDP's units, which do not say which is the
        whole model): taken when no model is known yet, or when it contains the one known
        (FSDP2's root after its layers)."""
        current = self.model
        if not hasattr(model, "modules"):
            return  # fully_shard of a list of modules
        if current is None or any(m is current for m in model.modules()):
            self.record_model(model)
            self._forward_phases_of(model)

    def _forward_phases_of(self, model: Any) -> None:
        """Forward (or eval) phases from hooks on the sharded model: FSDP has no wrapper
        whose forward marks them, as DDP and DeepSpeed do. Moved when a larger root is
        taken (FSDP2 shards the layers before the root)."""
        for handle in self._forward_hooks:
            handle.remove()
        probe = self

        def begin(*_: Any) -> None:
            probe.phase(probe.forward_phase_name(), "begin")

        def end(*_: Any) -> None:
            probe.phase(probe.forward_phase_name(), "end")

        # The forward begins before FSDP2's own pre-forward hook unshards the root (FSDP
        # prepends it: ours, prepended later, runs first) and ends after its post-forward
        # hook reshards, so the phase holds the unsharded root.
        self._forward_hooks = [
            model.register_forward_pre_hook(begin, prepend=True),
            model.register_forward_hook(end),
        ]

    # -- DeepSpeed ----------------------------------------------------------------
    def install_deepspeed(self, engine_module: ModuleType) -> None:
        engine_cls = engine_module.DeepSpeedEngine
        if getattr(engine_cls, "__lorascope__", False):
            return
        engine_cls.__lorascope__ = True
        probe = self
        orig_init, orig_forward = engine_cls.__init__, engine_cls.forward
        orig_backward, orig_step = engine_cls.backward, engine_cls.step
        orig_save = engine_cls.save_checkpoint

        @functools.wraps(orig_init)
        def __init__(engine: Any, *args: Any, **kwargs: Any) -> None:
            orig_init(engine, *args, **kwargs)
            probe.adopt_engine(engine)

        @functools.wraps(orig_backward)
        def backward(engine: Any, loss: Any, *args: Any, **kwargs: Any) -> Any:
            if probe.session.step_source != "deepspeed":  # built before `lorascope attach`
                probe.adopt_engine(engine)
            probe.see_loss(loss)
            probe.grads.before_backward(engine.module)
            probe.phase("backward", "begin")
            out = orig_backward(engine, loss, *args, **kwargs)
            probe.phase("backward", "end")
            probe.grads.after_backward(engine.module, engine.zero_optimization_stage())
            return out

        @functools.wraps(orig_save)
        def save_checkpoint(engine: Any, *args: Any, **kwargs: Any) -> Any:
            with probe.span("save"):
                return orig_save(engine, *args, **kwargs)

        @functools.wraps(orig_step)
        def step(engine: Any, *args: Any, **kwargs: Any) -> Any:
            if probe.session.step_source != "deepspeed":
                probe.adopt_engine(engine)
            before = getattr(engine, "global_steps", None)
            probe.phase("optimizer", "begin")
            out = orig_step(engine, *args, **kwargs)
            reading = probe.phase("optimizer", "end")
            if before is None or getattr(engine, "global_steps", None) != before:
                probe.step_done("deepspeed", reading)
            return out

        engine_cls.__init__, engine_cls.forward = __init__, self._forward_phases(orig_forward)
        engine_cls.backward, engine_cls.step = backward, step
        engine_cls.save_checkpoint = save_checkpoint

    def _adopt_engine(self, engine: Any) -> None:
        """A DeepSpeed engine drives the steps: its config and model recorded (at its
        construction, or at its first backward or step after ``lorascope attach``)."""
        self.session.step_source = "deepspeed"
        param_dict = getattr(getattr(engine, "_config", None), "_param_dict", None)
        self.record_config("deepspeed", param_dict)
        self.record_model(getattr(engine, "module", None))
        self.zero3_built(engine)

    def _forward_phases(self, orig_forward: Callable[..., Any]) -> Callable[..., Any]:
        """A module's forward inside a forward (or, under no_grad, eval) phase."""
        probe = self

        @functools.wraps(orig_forward)
        def forward(module: Any, *args: Any, **kwargs: Any) -> Any:
            name = probe.forward_phase_name()
            probe.phase(name, "begin")
            out = orig_forward(module, *args, **kwargs)
            probe.phase(name, "end")
            return out

        forward.__lorascope__ = True  # type: ignore[attr-defined]
        return forward

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        """A phase around a call; nested calls of the same phase (the Trainer's save
        calling DeepSpeed's) make one phase."""
        if name in self._open_spans:
            yield
            return
        self._open_spans.add(name)
        self.phase(name, "begin")
        try:
            yield
        finally:
            self._open_spans.discard(name)
            self.phase(name, "end")

    def forward_phase_name(self) -> str:
        """A forward under no_grad is an evaluation, not a training forward."""
        torch = sys.modules.get("torch")
        return "forward" if torch is None or torch.is_grad_enabled() else "eval"

    # -- plain torch --------------------------------------------------------------
    def _generic(self) -> bool:
        return self.session.step_source != "deepspeed"

    def install_torch(self, torch: ModuleType) -> None:
        """Tensor.backward and the global optimizer hooks; they stand down under DeepSpeed."""
        probe = self
        orig_backward = torch.Tensor.backward
        if getattr(orig_backward, "__lorascope__", False):
            return

        @functools.wraps(orig_backward)
        def backward(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if not probe._generic():
                return orig_backward(tensor, *args, **kwargs)
            probe.see_loss(tensor)
            probe.grads.before_backward(probe.model)
            probe.phase("backward", "begin")
            out = orig_backward(tensor, *args, **kwargs)
            probe.phase("backward", "end")
            return out

        backward.__lorascope__ = True  # type: ignore[attr-defined]
        torch.Tensor.backward = backward
        hooks = importlib.import_module("torch.optim.optimizer")
        hooks.register_optimizer_step_pre_hook(self._optimizer_begin)
        hooks.register_optimizer_step_post_hook(self._optimizer_end)

    def _optimizer_begin(self, *_: Any) -> None:
        """Global optimizer pre-hook (must return None)."""
        if self._generic():
            self.grads.after_backward(self.model)
            self.phase("optimizer", "begin")

    def _optimizer_end(self, *_: Any) -> None:
        """Global optimizer post-hook: a plain loop's step ends here."""
        if self._generic():
            self.step_done("torch", self.phase("optimizer", "end"))

    def install_ddp(self, ddp_module: ModuleType) -> None:
        ddp = ddp_module.DistributedDataParallel
        if getattr(ddp.forward, "__lorascope__", False):
            return
        ddp.forward = self._forward_phases(ddp.forward)
        self._after(ddp, "__init__", self.ddp_built)

    def _ddp_built(self, wrapper: Any, *_: Any) -> None:
        self._record_config("ddp", ddp_settings(wrapper))
        self._record_model(getattr(wrapper, "module", None))

    def _after(self, owner: Any, name: str, then: Callable[..., None]) -> None:
        """Wrap ``owner.name`` so that ``then(result-or-self, *args)`` runs after it."""
        original = getattr(owner, name, None)
        if original is None or getattr(original, "__lorascope__", False):
            return

        @functools.wraps(original)
        def wrapper(first: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(first, *args, **kwargs)
            then(out if name != "__init__" and out is not None else first, *args)
            return out

        wrapper.__lorascope__ = True  # type: ignore[attr-defined]
        setattr(owner, name, wrapper)

    def _around(self, owner: Any, name: str, phase: str) -> None:
        """Wrap ``owner.name`` in a phase."""
        original = getattr(owner, name, None)
        if original is None or getattr(original, "__lorascope__", False):
            return
        probe = self

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with probe.span(phase):
                return original(*args, **kwargs)

        wrapper.__lorascope__ = True  # type: ignore[attr-defined]
        setattr(owner, name, wrapper)

    def install_trainer(self, trainer_module: ModuleType) -> None:
        """Hugging Face Trainer (and subclasses such as TRL's SFTTrainer): its model and
        arguments at construction; ``evaluate`` / ``predict`` an eval phase and
        ``_save_checkpoint`` a save phase, from first to last line (the gathering of
        predictions and ``compute_metrics`` included). Under DDP the Trainer evaluates
        the unwrapped model, so no DDP forward marks the evaluation otherwise."""
        trainer = getattr(trainer_module, "Trainer", None)
        if trainer is None:
            return

        def constructed(instance: Any, *_: Any) -> None:
            self.record_model(getattr(instance, "model", None))
            args = getattr(instance, "args", None)
            if args is not None and hasattr(args, "to_dict"):
                self.record_config("trainer", args.to_dict())

        self._after(trainer, "__init__", constructed)
        self._around(trainer, "evaluate", "eval")
        self._around(trainer, "predict", "eval")
        self._around(trainer, "_save_checkpoint", "save")

    def install_state_dict(self, state_dict_module: ModuleType) -> None:
        """``torch.distributed.checkpoint.state_dict``: taking a model's (or optimizer's)
        state dict is a save phase (a full state dict gathers FSDP's shards: the memory
        rank 0 holds then shows in the save phase)."""
        for name in ("get_model_state_dict", "get_optimizer_state_dict", "get_state_dict"):
            self._around(state_dict_module, name, "save")

    def install_adapters(self, peft_integration: ModuleType) -> None:
        """transformers' ``model.add_adapter(LoraConfig(...))`` (no PeftModel involved)."""
        mixin = peft_integration.PeftAdapterMixin
        self._after(mixin, "add_adapter", lambda model, *_: self.record_model(model))

    def install_peft(self, peft: ModuleType) -> None:
        """Record the LoRA and model configs when the job builds its PEFT model."""
        original = getattr(peft, "get_peft_model", None)
        if original is None or getattr(original, "__lorascope__", False):
            return
        probe = self

        @functools.wraps(original)
        def get_peft_model(*args: Any, **kwargs: Any) -> Any:
            model = original(*args, **kwargs)
            probe.record_model(model)
            return model

        get_peft_model.__lorascope__ = True  # type: ignore[attr-defined]
        peft.get_peft_model = get_peft_model  # type: ignore[attr-defined]
        self._install_from_pretrained(peft.PeftModel)

    def _install_from_pretrained(self, peft_model: Any) -> None:
        """``PeftModel.from_pretrained`` (a classmethod; subclasses and AutoPeftModel use it)."""
        original = peft_model.__dict__.get("from_pretrained")
        func = getattr(original, "__func__", None)
        if func is None or getattr(func, "__lorascope__", False):
            return
        probe = self

        @functools.wraps(func)
        def from_pretrained(cls: Any, *args: Any, **kwargs: Any) -> Any:
            model = func(cls, *args, **kwargs)
            probe.record_model(model)
            return model

        from_pretrained.__lorascope__ = True  # type: ignore[attr-defined]
        peft_model.from_pretrained = classmethod(from_pretrained)
