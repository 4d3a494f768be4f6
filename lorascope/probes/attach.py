"""Attaching the always-on probes to one rank process (from the bootstrap that
``lorascope run`` injects, or from ``lorascope.attach()`` in a script). Never raises:
a probe that cannot start says why on stderr (and in the run directory when it can)
and the job goes on without it."""

from __future__ import annotations

import os
import socket
import sys
import traceback
from importlib import metadata
from pathlib import Path
from typing import Any

from lorascope import __version__
from lorascope.probes import importhook
from lorascope.probes.allocator import ENV_SWITCH as ENV_MEMORY_HISTORY
from lorascope.probes.allocator import AllocatorProbe, parse_switch
from lorascope.probes.bootstrap import ENV_ATTACHED_AS, ENV_ATTACHED_PID
from lorascope.probes.collectives import CollectiveProbe
from lorascope.probes.dumps import Dumper
from lorascope.probes.exits import ExitProbe, install_fatal_handler
from lorascope.probes.flight import DEFAULT_BUFFER as DEFAULT_FR_BUFFER
from lorascope.probes.flight import ENV_BUFFER as ENV_FR_BUFFER
from lorascope.probes.flight import dump_flight_recorder
from lorascope.probes.fsdp import FsdpProbe
from lorascope.probes.grads import GradProbe
from lorascope.probes.kernels import DEFAULT_WINDOW, KernelWindow, parse_window
from lorascope.probes.logits import LogitsProbe
from lorascope.probes.memory import MAX_SAMPLE_INTERVAL, MemoryProbe
from lorascope.probes.session import Session
from lorascope.probes.steps import StepProbe
from lorascope.probes.zero_params import ZeroParamProbe
from lorascope.rundir.format import safe_open
from lorascope.rundir.format.ranks import Identity, discover
from lorascope.rundir.format.schema import DUMP_REQUEST
from lorascope.rundir.format.writer import Stream, ensure_manifest, stream_prefix

ENV_RUN_DIR = "LORASCOPE_RUN_DIR"
ENV_SAMPLE_INTERVAL = "LORASCOPE_SAMPLE_INTERVAL"
ENV_TRACE_WINDOW = "LORASCOPE_TRACE_WINDOW"
ENV_STALL_SECONDS = "LORASCOPE_STALL_SECONDS"
DEFAULT_SAMPLE_INTERVAL = 0.5
_VERSIONED = ("torch", "deepspeed", "peft", "transformers")
#: faulthandler's open files (one per attached process), kept referenced for its life.
_fatal_files: list[object] = []

_session: Session | None = None
_dumper: Dumper | None = None
#: Where this process's probes write (its run directory), once attached.
run_dir_of_session: Path | None = None


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"lorascope": __version__, "python": sys.version.split()[0]}
    for dist in _VERSIONED:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _default_run_dir() -> Path:
    """$LORASCOPE_RUN_DIR, else one name every rank of the job agrees on (not the clock:
    ranks start in different seconds)."""
    if os.environ.get(ENV_RUN_DIR):
        return Path(os.environ[ENV_RUN_DIR])
    job = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT") or str(os.getpid())
    return Path("lorascope-runs") / f"attach-{job}"


def _env_float(name: str) -> float | None:
    try:
        return float(os.environ[name])
    except (KeyError, ValueError):
        return None


def _sample_interval(given: float | None) -> float:
    try:
        value = float(os.environ.get(ENV_SAMPLE_INTERVAL, DEFAULT_SAMPLE_INTERVAL) if given is None else given)
    except (TypeError, ValueError):
        return DEFAULT_SAMPLE_INTERVAL
    return value if 0 <= value <= MAX_SAMPLE_INTERVAL else DEFAULT_SAMPLE_INTERVAL


def _say_failed(run_dir: Path | None, why: str) -> None:
    line = f"lorascope: probes off in pid {os.getpid()} (rank {discover().rank}): {why}"
    print(line, file=sys.stderr)
    if run_dir is not None:
        try:
            fd = safe_open.create(run_dir / "probe-errors.log", append=True)
            with os.fdopen(fd, "a") as f:
                f.write(line + "\n")
        except OSError:
            pass


def attach(
    out: str | os.PathLike[str] | None = None,
    sample_interval: float | None = None,
    trace_window: str | None = None,
    *,
    launch_id: str | None = None,
    identity: Identity | None = None,
    attached: dict[str, Any] | None = None,
) -> bool:
    """Start the probes in this process once; later calls return whether they are on.

    Options left None come from ``LORASCOPE_*`` variables, then the defaults; the rank
    from :func:`lorascope.rundir.format.ranks.discover`. ``attached``: the process was running
    before (``lorascope attach``, :mod:`lorascope.probes.live`): what the start record
    says of it."""
    global _session, _dumper, run_dir_of_session
    if _session is not None and _session.pid == os.getpid():
        return _session.active
    run_dir: Path | None = None
    try:
        run_dir = Path(out) if out is not None else _default_run_dir()
        run_dir = run_dir.absolute()
        ensure_manifest(run_dir)
        identity = discover() if identity is None else identity
        _session, _dumper = _start(
            run_dir,
            _sample_interval(sample_interval),
            _trace_window(os.environ.get(ENV_TRACE_WINDOW) if trace_window is None else trace_window),
            identity,
            os.environ.get("LORASCOPE_LAUNCH_ID") if launch_id is None else launch_id,
            attached,
        )
        run_dir_of_session = run_dir
        # Children that inherit this identity (DataLoader workers) are not ranks themselves.
        os.environ[ENV_ATTACHED_PID] = str(os.getpid())
        os.environ[ENV_ATTACHED_AS] = identity.key
        return True
    except Exception as exc:
        _say_failed(run_dir, "".join(traceback.format_exception_only(type(exc), exc)).strip())
        return False


def _trace_window(text: str | None) -> tuple[int, int] | None:
    """A bad setting costs the default window, not every probe."""
    try:
        return parse_window(text)
    except ValueError as exc:
        print(f"lorascope: {exc}; tracing steps {DEFAULT_WINDOW[0] + 1}-{sum(DEFAULT_WINDOW)} instead", file=sys.stderr)
        return DEFAULT_WINDOW


def _start(
    run_dir: Path,
    sample_interval: float,
    trace_window: tuple[int, int] | None,
    identity: Identity,
    launch_id: str | None,
    attached: dict[str, Any] | None = None,
) -> tuple[Session, Dumper]:
    rank = identity.rank
    host = socket.gethostname()
    pid = os.getpid()
    prefix = stream_prefix(run_dir, rank, host, pid)
    stream = Stream(prefix, on_error=lambda exc: _say_failed(run_dir, f"stream write failed: {exc}"))
    session = Session(
        stream,
        rank=rank,
        local_rank=identity.local_rank,
        world_size=identity.world_size,
        sample_interval=sample_interval,
    )
    probed_parent = os.environ.get(ENV_ATTACHED_PID)
    session.record(
        "start",
        rank=rank,
        world_size=session.world_size,
        local_rank=session.local_rank,
        pid=pid,
        ppid=os.getppid(),
        host=host,
        argv=list(sys.argv),
        versions=_versions(),
        device=_device_hint(session.local_rank),
        sample_interval=sample_interval,
        launch_id=launch_id,
        rank_source=identity.source,
        probed_parent=int(probed_parent) if probed_parent and probed_parent.isdigit() else None,
        attached=attached,
    )
    session.flush()  # the stream's first record, on disk whatever happens next
    memory = MemoryProbe(session)
    collectives = CollectiveProbe(session, prefix, torch_seq=attached is not None)
    kernels = KernelWindow(session, trace_window, prefix)
    logits = LogitsProbe(session, memory)
    allocator = AllocatorProbe(session, prefix, *parse_switch(os.environ.get(ENV_MEMORY_HISTORY)))
    memory.on_cuda = allocator.observe

    def flight(reason: str) -> None:
        dump_flight_recorder(session, prefix, reason)

    def evidence(reason: str) -> None:
        flight(reason)
        allocator.dump(reason)

    dumper = Dumper(
        session,
        (lambda: collectives.pending() or collectives.on_stack()) if attached is not None else collectives.pending,
        session.guarded("dumps")(memory.reading),
        evidence,
        pg_timeout=lambda: collectives.pg_timeout,
        stall_override=_env_float(ENV_STALL_SECONDS),
        repeat_flight=flight,
        progress_known=attached is None,
        request_path=run_dir / DUMP_REQUEST,
        made=collectives.made,
    )

    def on_step_end() -> None:
        collectives.resolve_device_times()
        dumper.progress()

    steps = StepProbe(session, memory, GradProbe(session), logits, kernels, on_step_end=on_step_end)

    def on_end() -> None:
        session.record_cost()  # before the sampler stops (its thread's CPU) and its last reading
        memory.stop()
        memory.sample("end")
        collectives.resolve_device_times()
        allocator.finish()
        kernels.close()

    ExitProbe(session, on_end, on_crash=flight, on_exception=allocator.after_exception).install()
    _fatal_files.append(session.guarded("fatal")(install_fatal_handler)(session, prefix))
    if attached is None:  # an attached job's groups exist: it is theirs to have asked
        os.environ.setdefault(ENV_FR_BUFFER, DEFAULT_FR_BUFFER)  # read when the process group starts
    # Each install is its own probe: one that fails to install leaves the others on.
    _hook(session, "torch.distributed.distributed_c10d", collectives.install, "collectives")
    _hook(session, "torch.distributed._functional_collectives", collectives.install_functional, "collectives-funcol")
    _hook(session, "torch.nn.parallel.distributed", collectives.install_ddp, "collectives-ddp")
    if attached is not None:  # the references DeepSpeed took before the attach
        _hook(session, "deepspeed.comm.comm", collectives.install_deepspeed_comm, "collectives-deepspeed")
    _hook(session, "torch", steps.install_torch, "steps-torch")
    _hook(session, "torch", logits.install, "logits")
    _hook(session, "torch", allocator.install, "allocator")
    _hook(session, "torch.nn.parallel.distributed", steps.install_ddp, "steps-ddp")
    _hook(session, "torch.distributed.checkpoint.state_dict", steps.install_state_dict, "steps-state-dict")
    fsdp = FsdpProbe(session, steps.adopt_model)
    _hook(session, "torch.distributed.fsdp._fully_shard._fully_shard", fsdp.install_fully_shard, "fsdp")
    _hook(session, "torch.distributed.fsdp.fully_sharded_data_parallel", fsdp.install_fsdp1, "fsdp1")
    _hook(session, "deepspeed.runtime.engine", steps.install_deepspeed, "steps-deepspeed")
    zero = ZeroParamProbe(session, collectives)
    _hook(session, "deepspeed.runtime.zero.partition_parameters", zero.install, "zero-params")
    _hook(session, "peft", steps.install_peft, "configs")
    _hook(session, "transformers.integrations.peft", steps.install_adapters, "configs-adapters")
    _hook(session, "transformers.trainer", steps.install_trainer, "steps-trainer")
    memory.sample("attach")
    if attached is not None:
        why = dumper.install_wakeup()
        if why is not None:
            session.record(
                "probe_error", probe="dumps", error=f"no on-demand dumps: {why} (the stall watchdog still runs)"
            )
    elif not dumper.install_signal():
        session.record(
            "probe_error",
            probe="dumps",
            error="attached after threads started: no dump signal (the request file of `lorascope hang` and the stall watchdog still work)",
        )
    memory.start_sampler()
    dumper.start_watchdog()
    stream.start_writer()  # after install_signal: its thread inherits the blocked dump signal
    return session, dumper


def detach() -> bool:
    """Turn the probes of this process off (``lorascope attach --detach``): an ``end``
    record with status "detached", the collective wrappers pass calls straight through,
    every other probe returns at once, the probes' threads end, the dump signal is the
    job's again. The wrappers stay in place (a job may hold references to them), so the
    probes cannot be attached again in this process. False when they were not on."""
    session, dumper = _session, _dumper
    if session is None or not session.active or session.pid != os.getpid():
        return False
    session.record_cost()
    session.record(
        "end",
        status="detached",
        code=None,
        why="the probes were detached (`lorascope attach --detach`); the process went on",
    )
    session.disabled.add("collectives")
    if dumper is not None:
        dumper.remove_wakeup()
    session.ended = True
    session.stream.close()
    return True


def _hook(session: Session, module: str, install: Any, probe: str) -> None:
    importhook.when_imported(module, session.guarded(f"{probe}-install")(install))


def _device_hint(local_rank: int) -> str:
    """Where the job's tensors will live, as far as can be told without importing torch."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible == "" or (visible is None and not Path("/dev/nvidia0").exists()):
        return "cpu"
    return f"cuda:{local_rank}"
