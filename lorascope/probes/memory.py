"""Memory timeline: process RSS everywhere, and the bytes the C heap has handed out and
not taken back (glibc ``mallinfo2``: in-use arena bytes plus live mmapped blocks) — on
CPU the analogue of CUDA's ``memory_allocated``: RSS keeps memory glibc cached after a
free, so it cannot tell memory held from memory released. On CUDA the caching allocator's counters for
the rank's device and, from the background sampler only, NVML's device-used figure and
the PIDs NVML lists on that GPU (other ranks' contexts on GPU 0 show up there).

A reading is a fixed-width record of the process's memory file (``HOST-PID.mem``,
:func:`lorascope.rundir.format.callfile.mem_file`), written in place by the thread that
read it; where it was read is a ``label`` record of the stream, and NVML's part an
``nvml`` record naming the reading's index.

No reading synchronises the device. The rank's CUDA device is learnt from the main
thread (the current device is per thread) and only once CUDA is initialised by the job:
the probe never creates a CUDA context itself.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

from lorascope.probes.session import Session
from lorascope.rundir.format.callfile import mem_file, mem_path
from lorascope.rundir.format.schema import WARM_UP_STEPS

#: Phase edges a CPU rank's training thread reads without the C heap (RSS, and on CUDA
#: the allocator's counters, as everywhere). A heap reading is a mallinfo2 walk of every
#: free chunk, ~50-150 us on the CPU test job: six a step were the largest part of the
#: probes' cost on the training thread (docs/performance.md). The backward's end and the optimizer's
#: begin sit next to each other in a loop, between two edges still read (the backward's
#: begin, after the loss, and the optimizer's end, the step's end): what they would add is
#: where in that stretch memory moved (rank0-asymmetry then names "the backward phase or
#: the optimizer phase"). Every other edge is read (a step's baseline before the forward,
#: the forward's activations, the logits' copies after the loss, eval and save phases),
#: and the sampler thread (every 0.5 s by default) reads the heap whatever phase the rank
#: is in.
RSS_ONLY_EDGES = frozenset({"backward.end", "optimizer.begin"})

#: The training loop's phases, whose edges repeat every step; any other phase (eval,
#: save, a user's span) and the background sampler read the C heap whenever they read.
STRIDED_PHASES = frozenset({"forward", "backward", "optimizer", "step"})
#: A CPU rank's training thread reads the heap at the edges above through its first
#: HEAP_DENSE_STEPS steps, then at those of every HEAP_EVERY-th step only (and RSS at
#: every edge): a reading walks every free chunk (150-380 us on the CPU test job), and
#: four a step were a fifth of what the probes cost it (cost records). The first steps are
#: where plan-deviation and the logits-spike detector read, and rank0-asymmetry needs a
#: gap held at every edge of a step, which a gap held from one step on is at every read
#: step; where it first reached its size is then known to within HEAP_EVERY steps, and
#: growth between two read steps is in none of the named phases (``divergence_point``).
#: The end of the step before a read one is read too, and every edge of the step after
#: a phase outside the loop (an eval, a save: ``heap_due``).
#:
#: The same steps bound what is written: on the steps between (RSS, and on CUDA the
#: allocator's counters, still read at every edge), a reading is written only when it
#: passes the highest of its counters so far (a new peak): ~60 bytes a step where every
#: edge's was ~600 on the CPU test job. The sampler thread's readings are all written.
HEAP_DENSE_STEPS = WARM_UP_STEPS
HEAP_EVERY = 10
#: The longest interval between background samples (seconds): a larger one (or a NaN,
#: an infinity) is refused by `lorascope run` and taken as the default by `attach`.
MAX_SAMPLE_INTERVAL = 3600.0
#: The edges that end a step (a ``step`` record takes the optimizer's end reading).
_STEP_ENDS = frozenset({"optimizer.end", "step"})
#: A reading's CUDA fields when it has none (layout.MEM_FIELDS: alloc, reserved, max_alloc, device).
_NO_CUDA = (-1, -1, -1, -1)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _mallinfo2() -> Any:
    """glibc's mallinfo2 (2.33+; sums every arena), or None elsewhere."""
    try:
        func = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    func.restype = _MallInfo2
    return func


_MALLINFO2 = _mallinfo2()


def heap_in_use() -> int | None:
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)


class _Rss:
    """This process's resident set size. On Linux, /proc/self/statm read through a file
    descriptor kept open (~3 us, where psutil's memory_info takes ~27 us: it is read at
    every phase edge); psutil elsewhere."""

    def __init__(self) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        try:
            self._fd: int | None = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            self._fd = None
            self._proc = psutil.Process()

    def __call__(self) -> int:
        if self._fd is None:
            return int(self._proc.memory_info().rss)
        return int(os.pread(self._fd, 128, 0).split()[1]) * self._page


def _allocator_counters(torch: Any, dev: int) -> dict[str, int]:
    """The caching allocator's allocated, reserved and peak-allocated bytes, from one read of
    its statistics. ``torch.cuda.memory_allocated`` and its kin each build the whole
    flattened ``memory_stats`` dict (~100 keys); three of them at every phase edge were most
    of the probes' 4 ms a step on the GPU check's 16 ms steps. The nested form is torch's
    own ``memory_stats_as_nested_dict``; the public one is the fallback."""
    nested = getattr(torch._C, "_cuda_memoryStats", None)
    if nested is not None:
        try:
            stats = nested(dev)
            allocated = stats["allocated_bytes"]["all"]
            return {
                "alloc": int(allocated["current"]),
                "reserved": int(stats["reserved_bytes"]["all"]["current"]),
                "max_alloc": int(allocated["peak"]),
            }
        except (KeyError, TypeError):
            pass
    flat = torch.cuda.memory_stats(dev)
    return {
        "alloc": int(flat.get("allocated_bytes.all.current", 0)),
        "reserved": int(flat.get("reserved_bytes.all.current", 0)),
        "max_alloc": int(flat.get("allocated_bytes.all.peak", 0)),
    }


class MemoryProbe:
    def __init__(self, session: Session) -> None:
        self.session = session
        self.file = mem_file(mem_path(session.stream.prefix), on_error=lambda exc: session.fail("memory", exc))
        session.stream.write({"k": "mem_file", "file": self.file.path.name, "how": self.file.how})
        self._rss = _Rss()
        self._device: int | None = None
        self._nvml_handle: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: The step whose edges are read because a phase outside the loop ran just before
        #: it (``heap_due``).
        self._after_phase: int | None = None
        #: The highest of each counter read so far (``_new_peak``).
        self._peaks: dict[str, int] = {}
        #: Told of every CUDA reading at a phase edge (the allocator probe's history policy).
        self.on_cuda: Callable[[str, dict[str, int]], None] | None = None
        self.sample = session.guarded("memory")(self._sample)
        self._nvml = session.guarded("nvml")(self._read_nvml)

    def _cuda(self, from_main_thread: bool) -> dict[str, int] | None:
        torch = sys.modules.get("torch")
        if torch is None or getattr(torch.__spec__, "_initializing", False) or not torch.cuda.is_initialized():
            return None
        if from_main_thread:
            self._device = torch.cuda.current_device()
        if self._device is None:
            return None
        return {"device": self._device, **_allocator_counters(torch, self._device)}

    def _read_nvml(self) -> dict[str, Any] | None:
        if self._device is None:
            return None
        if self._nvml_handle is None:
            import pynvml  # nvidia-ml-py, the `gpu` extra
            import torch

            pynvml.nvmlInit()
            index = torch.cuda._get_nvml_device_index(self._device)
            self._nvml_handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        import pynvml

        info = pynvml.nvmlDeviceGetMemoryInfo(self._nvml_handle)
        out: dict[str, Any] = {"used": int(info.used), "total": int(info.total)}
        try:  # not every driver or container lists processes: used/total still count
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(self._nvml_handle)
        except pynvml.NVMLError as exc:
            out["pids"], out["pids_error"] = None, str(exc)
            return out
        out["pids"] = sorted(int(p.pid) for p in procs)
        # usedGpuMemory is None where the driver cannot tell (e.g. without permission)
        out["pid_used"] = {str(p.pid): p.usedGpuMemory for p in procs}
        return out

    def reading(self, from_main_thread: bool = True, heap: bool = True) -> dict[str, Any]:
        """RSS, and the C heap in use (unless ``heap`` is false); on CUDA the allocator's
        counters, NVML from the sampler thread, and the heap only from the sampler: the
        memory detectors read a CUDA rank by its allocator, and mallinfo2 walks every free
        chunk of every arena (~50-200 us a reading on the CPU test job)."""
        fields: dict[str, Any] = {"rss": self._rss()}
        cuda = self._cuda(from_main_thread)
        if heap and (cuda is None or not from_main_thread):
            began = time.perf_counter_ns()
            value = heap_in_use()
            if value is not None:
                fields["heap"] = value
                if from_main_thread:  # the job's time (``Session.cost_ns``)
                    self.session.heap_ns += time.perf_counter_ns() - began
                    self.session.heap_reads += 1
        if cuda is not None:
            fields["cuda"] = cuda
            if not from_main_thread:
                nvml = self._nvml()
                if nvml is not None:
                    fields["nvml"] = nvml
        return fields

    def heap_due(self, src: str) -> bool:
        """Whether a training-thread reading at edge ``src`` reads the C heap (above)."""
        return src not in RSS_ONLY_EDGES and self._dense(src)

    def _dense(self, src: str) -> bool:
        """Whether edge ``src`` is on a step read in full (the heap, but at RSS_ONLY_EDGES,
        and every reading written). A ``step`` record's step number is the step it ends
        plus one; an edge's, the steps done before it (an eval run after 25 steps carries
        25, as the next step's edges do)."""
        if src.partition(".")[0] not in STRIDED_PHASES:
            # and the step after it: what the loop's code keeps of an eval or a save
            # (rank 0's gathered outputs) shows between this phase's end and that step
            self._after_phase = self.session.step
            return True
        step = self.session.step - (src == "step")
        if step < HEAP_DENSE_STEPS or step % HEAP_EVERY == 0 or step == self._after_phase:
            return True
        # the end of the step before one read: what the loop's own code does between the
        # two steps (rank 0's evaluation, logging, gathers) is then read too
        return src in _STEP_ENDS and (step + 1) % HEAP_EVERY == 0

    def _sample(self, src: str, from_main_thread: bool = True, reading: dict[str, Any] | None = None) -> dict[str, Any]:
        """A ``mem`` record of a new reading, or of ``reading`` (one taken a moment ago,
        with none of the job's code run since: each costs a mallinfo2 walk); returns it."""
        dense = not from_main_thread or self._dense(src)
        if reading is None:
            reading = self.reading(from_main_thread, heap=dense and src not in RSS_ONLY_EDGES)
        if from_main_thread and self.on_cuda is not None and "cuda" in reading:
            self.on_cuda(src, reading["cuda"])
        if not self._new_peak(reading) and not dense:
            return reading  # a step read in part, below every peak so far: not written
        session = self.session
        rss, heap, cuda = reading.get("rss"), reading.get("heap"), reading.get("cuda")
        counters = _NO_CUDA if cuda is None else (cuda["alloc"], cuda["reserved"], cuda["max_alloc"], cuda["device"])
        index = self.file.put(
            time.time(),
            -1 if rss is None else rss,
            -1 if heap is None else heap,
            *counters[:3],
            session.step,
            counters[3],
            session.label(src),
        )
        nvml = reading.get("nvml")
        if nvml is not None and index >= 0:
            session.record("nvml", i=index, nvml=nvml)
        return reading

    def _new_peak(self, reading: dict[str, Any]) -> bool:
        """Whether a reading passes the highest RSS, heap or CUDA allocated / reserved
        bytes read so far (the highest kept up to date)."""
        peaks, new = self._peaks, False
        cuda = reading.get("cuda") or {}
        for key, value in (
            ("rss", reading.get("rss")),
            ("heap", reading.get("heap")),
            ("alloc", cuda.get("alloc")),
            ("reserved", cuda.get("reserved")),
        ):
            if value is not None and value > peaks.get(key, -1):
                peaks[key], new = value, True
        return new

    def start_sampler(self) -> None:
        """A daemon thread sampling every ``session.sample_interval`` seconds (0: none)."""
        if self.session.sample_interval <= 0:
            return
        self._thread = threading.Thread(target=self._run, name="lorascope-memory", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.session.sample_interval):
            if not self.session.active or "memory" in self.session.disabled:
                return
            self.sample("sampler", from_main_thread=False)

    def stop(self) -> None:
        self._stop.set()
