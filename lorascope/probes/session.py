"""The probe session of one rank process: its stream, its step counter, and the rule
that a failing probe records why and switches itself off instead of raising."""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

from lorascope.rundir.format.writer import Declared, Line, Stream, json_str

F = TypeVar("F", bound=Callable[..., Any])

#: Steps between two ``cost`` records.
COST_EVERY = 100
#: Labels (phase names, step sources, where memory was read) a process declares, at most;
#: a record naming any other is not written (a ``probe_error`` says so once).
MAX_LABELS = 1 << 12


def plain(value: Any, depth: int = 0) -> Any:
    """A JSON-friendly copy of a config value (sets become sorted lists, the rest repr)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if depth > 8:
        return repr(value)
    if isinstance(value, dict):
        return {str(k): plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v, depth + 1) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((plain(v, depth + 1) for v in value), key=repr)
    return repr(value)


class Session:
    """State shared by the probes of one rank process."""

    def __init__(self, stream: Stream, rank: int, local_rank: int, world_size: int, sample_interval: float) -> None:
        self.stream = stream
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = world_size
        self.sample_interval = sample_interval
        self.pid = os.getpid()
        self.step = 0
        #: "deepspeed" once a DeepSpeed engine drives the steps; generic torch hooks then stand down.
        self.step_source: str | None = None
        self.disabled: set[str] = set()
        self.ended = False
        #: The ``label`` records' ids the steps and memory files' records name.
        self._labels: Declared[str] = Declared(stream, MAX_LABELS)
        #: What the probes cost the job's own threads, wall ns: ``cost_ns`` in probe code
        #: outside the collective wrappers (phase edges, step ends, the loss) and
        #: ``calls_ns`` in the collective calls (kept apart, so a call adds to one counter;
        #: the cost record sums the two), how many calls, and of their time the first
        #: call at each site, which reads its source
        #: (a one-off, how many); of ``cost_ns``, the C heap readings' (how many) and the
        #: kernel trace window's (starting, stopping, exporting the trace: a few steps'
        #: one-off cost). Added to without a lock: two job threads adding at once lose a
        #: measurement, never a record.
        self.cost_ns = 0
        self.calls_ns = 0
        self.calls = 0
        self.sites_ns = 0
        self.sites = 0
        self.heap_ns = 0
        self.heap_reads = 0
        self.trace_ns = 0
        #: Wall ns the job's threads were blocked on async collectives' handles (``Work.wait``,
        #: ``wait_tensor``) outside a recorded call, since the probes started: each step and
        #: phase-edge record holds what it added since the step began (``waited``).
        self.waited_ns = 0
        #: Steps whose calls are kept in full when the call file's ring overwrites them
        #: (``probes/callsteps.py``): an eval or a save, a failed call, a stall, a slow step.
        self.keep_steps: set[int] = set()
        self.record_cost = self.guarded("cost")(self._record_cost)

    @property
    def active(self) -> bool:
        """The stream writes (it turns itself off in a forked child, and on a failed write)."""
        return self.stream.alive

    def record(self, kind: str, **fields: Any) -> None:
        """Queue a record; the stream's writer formats and writes it (``flush`` for now)."""
        if self.stream.alive:
            fields["k"] = kind
            fields["t"] = time.time()
            self.stream.append(fields)
            if self.ended:  # after the end record (a call ending at interpreter teardown)
                self.stream.flush()

    def label(self, text: str) -> int:
        """The id of a label (a phase's name, a step's source, where memory was read),
        declared now as a ``label`` record of the stream if new (on disk before the first
        record that names it, and again at the head of every later segment)."""
        known = self._labels.ids.get(text)
        if known is not None:
            return known
        n = self._labels.declare(
            text, lambda n: f'{{"k":"label","t":{time.time()!r},"id":{n},"text":{json_str(text)}}}\n'
        )
        if n < 0:
            raise ValueError(f"more than {MAX_LABELS} labels (phase names, step sources, memory readings' sources)")
        return n

    def record_entry(self, entry: Line) -> None:
        """Queue a record the writer formats from its template (a phase edge, a reading)."""
        if self.stream.alive:
            self.stream.append(entry)
            if self.ended:  # the writer may be gone: written now
                self.stream.flush()

    def flush(self) -> None:
        """What is queued so far onto disk, now (an exception, a signal, a dump, the end)."""
        self.stream.flush()

    def _record_cost(self) -> None:
        """A ``cost`` record (at the end of the first step and of step ``WARM_UP_STEPS``,
        every ``COST_EVERY`` steps, at the end): so far, the time in probe code on the job's
        threads and its parts (above), and the CPU time of each of the probes' own threads
        (by its clock; Linux).
        Cumulative, so the difference of two is what the steps between cost."""
        threads: dict[str, float] = {}
        ours = {t.name: t.ident for t in threading.enumerate() if t.name.startswith("lorascope-") and t.ident}
        for name, ident in ours.items() if hasattr(time, "pthread_getcpuclockid") else []:
            try:
                threads[name] = round(time.clock_gettime(time.pthread_getcpuclockid(ident)) * 1e3, 3)
            except OSError:  # it has just ended
                pass
        self.record(
            "cost",
            step=self.step,
            job_ms=round((self.cost_ns + self.calls_ns) / 1e6, 3),
            calls_ms=round(self.calls_ns / 1e6, 3),
            calls=self.calls,
            sites_ms=round(self.sites_ns / 1e6, 3),
            sites=self.sites,
            heap_ms=round(self.heap_ns / 1e6, 3),
            heap_reads=self.heap_reads,
            trace_ms=round(self.trace_ns / 1e6, 3),
            threads_cpu_ms=threads,
        )

    def fail(self, probe: str, exc: BaseException) -> None:
        """Switch a probe off for the rest of the job, and say why in the stream."""
        if probe in self.disabled:
            return
        self.disabled.add(probe)
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        self.record("probe_error", probe=probe, error=text)
        print(f"lorascope: probe {probe!r} switched off on rank {self.rank}: {text}", file=sys.stderr)

    def guarded(self, probe: str, job_thread: bool = False) -> Callable[[F], F]:
        """Decorate probe code: any exception turns the probe off; it never reaches the job.
        ``job_thread``: code the job's own threads run (a phase edge, a step's end), whose
        time counts in ``cost_ns`` (none of it calls another such function)."""

        def deco(fn: F) -> F:
            @functools.wraps(fn)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                if probe in self.disabled or not self.active:
                    return None
                try:
                    return fn(*args, **kwargs)
                except Exception as exc:
                    self.fail(probe, exc)
                    return None

            if not job_thread:
                return wrapper  # type: ignore[return-value]
            clock = time.perf_counter_ns

            @functools.wraps(fn)
            def timed(*args: Any, **kwargs: Any) -> Any:
                began = clock()
                try:
                    return wrapper(*args, **kwargs)
                finally:
                    self.cost_ns += clock() - began

            return timed  # type: ignore[return-value]

        return deco
