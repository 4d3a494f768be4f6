"""The probe session of one rank process: its stream, its step counter, and the rule
that a failing probe records why and switches itself off instead of raising."""

from __future__ import annotations

import functools
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

from lorascope.rundir.writer import LazyRecord, Stream

F = TypeVar("F", bound=Callable[..., Any])


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
                self.stream.flush(final=True)

    def record_entry(self, entry: LazyRecord) -> None:
        """Queue a record that the writer formats (see CollectiveProbe)."""
        if self.stream.alive:
            self.stream.append(entry)
            if self.ended:  # the writer may be gone: written now
                self.stream.flush(final=True)

    def flush(self, final: bool = True) -> None:
        """What is recorded so far onto disk, now: everything when ``final`` (an
        exception, a signal, a dump, the end); before a blocking call, all but the async
        calls started in the last few ms that may still end and become one record."""
        self.stream.flush(final)

    def fail(self, probe: str, exc: BaseException) -> None:
        """Switch a probe off for the rest of the job, and say why in the stream."""
        if probe in self.disabled:
            return
        self.disabled.add(probe)
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        self.record("probe_error", probe=probe, error=text)
        print(f"lorascope: probe {probe!r} switched off on rank {self.rank}: {text}", file=sys.stderr)

    def guarded(self, probe: str) -> Callable[[F], F]:
        """Decorate probe code: any exception turns the probe off; it never reaches the job."""

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

            return wrapper  # type: ignore[return-value]

        return deco
