"""The records a rank's reading hands the detectors and the report, typed: what
:class:`~lorascope.rundir.loading.reader.RankData` holds of the step-keyed kinds. Made
from the steps file's and the memory file's columns (:mod:`lorascope.rundir.loading.steps`,
:mod:`lorascope.rundir.loading.mem`)."""

from __future__ import annotations

from typing import Any, TypedDict


class _NonFinite(TypedDict, total=False):
    #: The text of a loss that was not a finite number (``loss`` is None then).
    loss_text: str


class StepRecord(_NonFinite):
    """A step's end: its number (from 1), wall seconds since the previous end, its loss."""

    k: str
    t: float
    step: int
    dur: float
    #: None where none was read; a non-finite one is None with its text in ``loss_text``.
    loss: float | None
    #: What the step's end was seen in (``deepspeed``, ``torch`` ...).
    src: str


class PhaseEdge(TypedDict):
    """A phase (``forward``, ``backward``, ``optimizer``, ``eval`` ...) begins or ends."""

    k: str
    t: float
    name: str
    #: "begin" or "end".
    edge: str
    #: Steps this rank had completed.
    step: int


class CudaFigures(TypedDict):
    """The CUDA caching allocator's counters at a reading (bytes)."""

    device: int
    alloc: int
    reserved: int
    max_alloc: int


class _Parts(TypedDict, total=False):
    #: The C heap in use (a CPU rank's allocations), where it was read.
    heap: int
    cuda: CudaFigures
    #: NVML's view of the device (a sampler's reading, now and then).
    nvml: dict[str, Any]


class MemReading(_Parts):
    """A memory reading: where it was taken (a phase edge, ``sampler``), the rank's RSS (None
    where it was not read) and the parts it has."""

    k: str
    t: float
    src: str
    step: int
    rss: int | None


# -- the stream's records RankData keeps (docs/run-format.md gives every field) ----------------


class _StartParts(TypedDict, total=False):
    ppid: int
    sample_interval: float
    launch_id: str | None
    rank_source: str
    probed_parent: int | None
    #: In a process ``lorascope attach`` attached while it ran: when and how.
    attached: dict[str, Any]
    #: Added by the reader: [rank, world_size] as discovered, when torch's differed.
    probed_as: list[int]


class StartRecord(_StartParts):
    """A rank process's first record: who it is and where."""

    k: str
    t: float
    rank: int
    world_size: int
    local_rank: int
    pid: int
    host: str
    argv: list[str]
    #: Package -> version (None: not installed).
    versions: dict[str, str | None]
    device: str


class _EndParts(TypedDict, total=False):
    #: What the probes know of an exit they did not see called.
    why: str
    #: Added by the reader when a fatal handler's text says how the rank died.
    fatal: bool


class EndRecord(_EndParts):
    """How the rank ended: ``status`` exit, exception, signal or detached."""

    k: str
    t: float
    status: str
    code: int | None


class _WithStacks(TypedDict, total=False):
    #: Every thread's stack when it was recorded.
    stacks: str


class ExceptionRecord(_WithStacks):
    """The uncaught exception that ended the rank."""

    k: str
    t: float
    type: str
    message: str
    traceback: str


class SignalRecord(_WithStacks):
    """A terminating signal the rank received."""

    k: str
    t: float
    signum: int
    name: str


class StallRecord(TypedDict):
    """The stall watchdog saw no step for ``limit`` seconds."""

    k: str
    t: float
    seconds: float
    limit: float
    step: int


class _DumpParts(TypedDict, total=False):
    #: A reading taken with the dump, or None.
    mem: dict[str, Any] | None
    #: Seconds since the rank's last step (None: none yet in an attached process).
    since_progress: float | None
    #: The id of the request it answers.
    request: str
    #: The collectives made so far on each process group, by its name.
    made: dict[str, int]


class DumpRecord(_DumpParts):
    """Every thread's stack and the calls in flight, on request or at a stall."""

    k: str
    t: float
    reason: str
    step: int
    stacks: str
    #: ``{group, seq, op, bytes, site, since}`` of each call in flight.
    pending: list[dict[str, Any]]


class _ZeroParamParts(TypedDict, total=False):
    site: str | None
    via: str | None
    params: int
    persistent: int
    modifier_rank: int | None


class ZeroParamRecord(_ZeroParamParts):
    """The job's code entered (``op`` enter) or left ZeRO-3's parameter state."""

    k: str
    t: float
    what: str
    op: str
    step: int


class WarningRecord(TypedDict):
    """A Python warning shown in the rank."""

    k: str
    t: float
    category: str
    message: str
    filename: str
    lineno: int


class ProbeError(TypedDict):
    """A probe failed and switched itself off."""

    k: str
    t: float
    probe: str
    error: str


class UnseenPath(TypedDict, total=False):
    """A collective path the probes cannot wrap (``coll_unseen``)."""

    k: str
    t: float
    path: str
    why: str
    step: int


class GroupRecord(TypedDict):
    """A process group, as this process numbers it (``gid``)."""

    k: str
    t: float
    gid: int
    name: str
    ranks: list[int] | None
    backend: str | None


class SiteRecord(TypedDict, total=False):
    """A call site's source context: its line and the rank conditions around it."""

    k: str
    t: float
    site: str
    line: str | None
    conditions: list[str]


class DistInit(TypedDict, total=False):
    """torch.distributed's rank and world size, once the process group started."""

    k: str
    t: float
    rank: int
    world_size: int
    backend: str


class GradSetup(TypedDict, total=False):
    """Activation checkpointing and input-gradient hooks, before the first backward."""

    k: str
    t: float
    step: int
    #: ``enabled``, ``use_reentrant`` (the values seen), ``wrappers``.
    checkpointing: dict[str, Any]
    input_require_grads_hooks: int
    training: bool


class Grads(TypedDict):
    """The trainable tensors' gradients after the first backward, one character each."""

    k: str
    t: float
    step: int
    names: list[str]
    #: ``n`` no gradient, ``z`` all zero, ``o`` present.
    status: str
    #: ``local-partition`` (each rank sees its shard) or ``full``.
    scope: str


class _LogitsParts(TypedDict, total=False):
    vocab: int | None
    tokens: int | None
    requires_grad: bool
    #: Readings just before and after the tensor was made (the loss's first calls).
    mem_before: dict[str, Any] | None
    mem_after: dict[str, Any] | None


class LogitsRecord(_LogitsParts):
    """A logits tensor seen at ``where`` (the LM head's output, the loss's input)."""

    k: str
    t: float
    where: str
    step: int
    shape: list[int]
    dtype: str
    bytes: int


class _Attachment(TypedDict):
    """A file written beside the stream, ``path`` (absolute) added by the reader."""

    k: str
    t: float
    file: str
    reason: str
    bytes: int
    path: str


class FlightDumpRecord(_Attachment, total=False):
    """torch's flight-recorder dump, written with a dump or at the rank's ending."""

    #: Its tail (the last collectives of each group, ``probes.flight.flight_tail``), when
    #: the probes wrote one and it is there (absolute, added by the reader).
    tail_path: str


class SnapshotRecord(_Attachment, total=False):
    """An allocator snapshot (``reason`` oom, signal-T, request-T or stall-T)."""

    ms: float
    step: int
    trace_entries: int
    #: Why allocator history was being recorded then (None: it was not).
    history: str | None
    #: For ``oom``: ``observer`` or ``exception``.
    via: str
    device: int
    requested: int
    device_free: int


class _MemoryHistoryParts(TypedDict, total=False):
    mode: str
    max_entries: int | None
    oom_observer: bool
    #: The bytes the rank may use on its device.
    limit: int | None


class MemoryHistory(_MemoryHistoryParts):
    """Whether the process probes the CUDA allocator's history, and why not."""

    k: str
    t: float
    on: bool
    reason: str | None


class _HistoryParts(TypedDict, total=False):
    reserved: int | None


class HistoryRecord(_HistoryParts):
    """Allocator history started or stopped under ``--memory-history auto``."""

    k: str
    t: float
    on: bool
    why: str | None
    step: int
    src: str


class CostRecord(TypedDict):
    """What the probes cost the job so far (running totals)."""

    k: str
    t: float
    step: int
    job_ms: float
    calls_ms: float
    calls: int
    sites_ms: float
    sites: int
    heap_ms: float
    heap_reads: int
    trace_ms: float
    #: The probes' own threads -> CPU ms.
    threads_cpu_ms: dict[str, float]
