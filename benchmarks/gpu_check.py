"""The GPU check behind ``bash benchmarks/gpu_check.sh``: lorascope's CUDA paths on a real
GPU, in one command, at most 9 minutes on one GPU; a table of what it verified.

Runs (all the probes/ job, probes/train_lora.py, through benchmarks/gpu_job.py):

- ``single``: 1 rank over NCCL (DDP, ``--engine torch``), a gather to rank 0 every step
  (the job's own collectives: DDP's bucketed all-reduce runs in C++, out of sight),
  the Kineto window on (steps 6-7): allocator history on, CUDA counters and NVML in the
  memory records, collectives with device times, CUDA kernels attributed to lora_A/lora_B.
- ``shared``: 2 ranks on the one GPU over gloo with CUDA tensors (NCCL refuses two ranks
  on one device), the gather fault (rank 0 keeps what it gathers), rank 1 stalled after
  step 8: the stall watchdog and ``lorascope hang`` each dump an allocator snapshot per
  rank; the snapshots are analysed (rank 0's own blocks at the gather) and NVML lists
  both processes on GPU 0.
- ``spike``: the logits-spike fault, 1 rank; its peak sets the cap of ``oom``: the same
  job under ``torch.cuda.set_per_process_memory_fraction``, which runs out of memory in
  the loss: the OOM observer's snapshot, analysed with the loss's frames on top.
- ``zero3`` (only with DeepSpeed importable, e.g. from the wheels in ``.whl/``): 1 rank
  under DeepSpeed ZeRO-3.
- ``overhead``: the healthy job bare, probed, and probed without allocator history,
  alternated; mean step times. Every probed run is analysed: no warning in any (the last
  is kept as the ``healthy`` fixture).
- ``realsize`` (alone with ``--quick``): a LoRA job of real size (benchmarks/gpu_realsize.py:
  Llama-3.2-1B's shape with random weights, bf16, r=16 on every linear layer, sequence
  2,048, non-reentrant checkpointing): bare vs probed with ``--memory-history`` auto,
  always and off, alternated (steady-state step times, the probes' self-measure beside);
  one probed run with a kernel window (steps 11-12): LoRA kernels' share of GPU time and
  launches, idle time between kernels, the tiny-kernel-tail finding or its absence; the fix
  it suggests (the adapted layers compiled) timed again; ``lorascope plan`` for the same
  configuration against the measured CUDA peaks.

Writes ``gpu-check.json`` and ``gpu-check.txt`` (figures) to ``$OUT`` if set, else
``runs/gpu-check/``; and small real GPU fixtures (the single, shared, oom and healthy run
directories) to ``fixtures/gpu/`` (and, with ``$OUT``, as ``$OUT/gpu-fixtures.tar.gz``:
the device tool brings back no folder that deep; unpack it in the repository root). Exit status: 0 when every check
passed or was skipped with a reason, 1 otherwise; 0 with "skipped" without CUDA.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "benchmarks" / "gpu_job.py"
REALSIZE = REPO / "benchmarks" / "gpu_realsize.py"
#: Steps of a real-size run (~0.2-0.5 s each on an H100): the first ``gpu_realsize.WARM``
#: are left out of the steady-state figure.
REALSIZE_STEPS = 30
#: Probed variants of the real-size run: ``--memory-history`` of each.
HISTORY_MODES = ("auto", "always", "off")
#: The script's own budget: the shell wrapper kills it at 9 minutes; these leave room.
BUDGET_S = 8 * 60 + 30
JOB_TIMEOUT_S = 150
#: Keep fixtures small: files above this are left out (and said so).
MAX_FIXTURE_FILE = 6 * 2**20


@dataclass
class Check:
    name: str
    #: True passed, False failed, None skipped / not applicable (``detail`` says why).
    ok: bool | None
    detail: str

    @property
    def mark(self) -> str:
        return {True: "PASS", False: "FAIL", None: "skip"}[self.ok]


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)

    def add(self, name: str, ok: bool | None, detail: str) -> None:
        self.checks.append(Check(name, ok, detail))
        print(f"gpu_check: {'PASS' if ok else 'FAIL' if ok is False else 'skip'} {name}: {detail}", flush=True)

    def guarded(self, name: str, fn: Any, *args: Any) -> Any:
        """Run one check; an exception is that check's failure, not the script's."""
        try:
            return fn(*args)
        except Exception as exc:
            self.add(name, False, f"{type(exc).__name__}: {exc}"[:300])
            return None

    @property
    def passed(self) -> bool:
        return all(c.ok is not False for c in self.checks)

    def table(self) -> str:
        width = max((len(c.name) for c in self.checks), default=10)
        lines = [f"{'check':<{width}}  result  detail", f"{'-' * width}  ------  ------"]
        lines += [f"{c.name:<{width}}  {c.mark:<6}  {c.detail}" for c in self.checks]
        return "\n".join(lines)


# -- the machine ----------------------------------------------------------------------


def cuda_unavailable() -> str | None:
    """None when a CUDA device is usable, else why not."""
    try:
        import torch
    except ImportError as exc:
        return f"torch is not importable ({exc})"
    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__})"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(nproc: int, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(free_port()),
        str(JOB),
        *args,
    ]


def probed(out: Path, cmd: list[str], *options: str) -> list[str]:
    return [sys.executable, "-m", "lorascope", "run", "--out", str(out), "--no-summary", *options, "--", *cmd]


def start(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """A job in its own process group, so that a timeout takes its ranks down with it."""
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=REPO,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float = JOB_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def run(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return finish(start(cmd, env))


def mean_step_s(stdout: str) -> float | None:
    """train_lora.py's last line: ``train_lora: done steps=N final_loss=X mean_step_s=S``."""
    m = re.search(r"train_lora: done .*mean_step_s=([0-9.]+)", stdout)
    return float(m.group(1)) if m else None


def tail(proc: subprocess.CompletedProcess[str], n: int = 400) -> str:
    return (proc.stderr or proc.stdout or "").strip()[-n:].replace("\n", " | ")


# -- checks on a run directory (pure: unit-tested on CPU fixtures) ----------------------


def check_ranks_on(run: Any, device: int) -> tuple[bool, str]:
    """Every rank's CUDA counters are of this device (the ``start`` record's hint comes
    from the environment alone: a rank sharing GPU 0 still reads cuda:LOCAL_RANK there),
    and every rank ended normally."""
    used = {
        n: sorted({m["cuda"].get("device") for m in r.mem if isinstance(m.get("cuda"), dict)})
        for n, r in run.ranks.items()
    }
    ends = {n: (r.end or {}).get("status") for n, r in run.ranks.items()}
    ok = bool(used) and all(d == [device] for d in used.values()) and all(e == "exit" for e in ends.values())
    return ok, f"CUDA devices per rank {used}, ended {ends}"


def check_memory_history(run: Any) -> tuple[bool, str]:
    states = {n: r.memory_history for n, r in run.ranks.items()}
    ok = bool(states) and all(s and s.get("on") and s.get("oom_observer") for s in states.values())
    return ok, "; ".join(f"rank {n}: {_history(s)}" for n, s in states.items())


def _history(state: dict[str, Any] | None) -> str:
    if state is None:
        return "no memory_history record"
    if not state.get("on"):
        return f"off: {state.get('reason')}"
    return f"on, {state.get('max_entries')} entries, OOM observer {state.get('oom_observer')}"


def check_cuda_counters(run: Any) -> tuple[bool, str]:
    parts, ok = [], bool(run.ranks)
    for n, rank in run.ranks.items():
        cuda = [m["cuda"] for m in rank.mem if isinstance(m.get("cuda"), dict)]
        peak = max((c.get("max_alloc", 0) for c in cuda), default=0)
        sane = all(c.get("reserved", 0) >= c.get("alloc", 0) >= 0 for c in cuda)
        ok = ok and bool(cuda) and peak > 0 and sane
        parts.append(f"rank {n}: {len(cuda)}/{len(rank.mem)} samples with cuda, peak {peak / 2**20:.1f} MiB")
    return ok, "; ".join(parts)


def check_nvml(run: Any) -> tuple[bool, str]:
    """NVML samples with device-used bytes; whether the ranks' own PIDs are in NVML's list
    (inside a container NVML may report another PID namespace: said, not failed)."""
    parts, ok = [], bool(run.ranks)
    for n, rank in run.ranks.items():
        nvml = [m["nvml"] for m in rank.mem if isinstance(m.get("nvml"), dict)]
        used = max((v.get("used", 0) for v in nvml), default=0)
        pids = sorted({p for v in nvml for p in (v.get("pids") or [])})
        ok = ok and bool(nvml) and used > 0
        own = "own pid listed" if rank.pid in pids else f"own pid {rank.pid} not in NVML's {pids[:8]}"
        parts.append(f"rank {n}: {len(nvml)} samples, used {used / 2**30:.2f} GiB, {own}")
    return ok, "; ".join(parts)


def check_device_times(run: Any) -> tuple[bool, str]:
    """Every synchronous collective with a CUDA payload got a device time."""
    parts, ok = [], bool(run.ranks)
    for n, rank in run.ranks.items():
        timed = [c for c in rank.collectives if c.bytes and not c.is_async]
        dev = [c.device_ms for c in timed if c.device_ms is not None]
        host = [(c.end - c.start) * 1e3 for c in timed if c.end is not None]
        backends = sorted({str(g.get("backend")) for g in rank.groups.values()})
        ok = ok and bool(timed) and len(dev) == len(timed) and all(d >= 0 for d in dev)
        parts.append(
            f"rank {n} ({'/'.join(backends)}): {len(dev)}/{len(timed)} timed"
            + (
                f", device median {statistics.median(dev):.3f} ms vs host {statistics.median(host):.3f} ms"
                if dev and host
                else ""
            )
        )
    return ok, "; ".join(parts)


def check_kernel_window(bundle: Any) -> tuple[bool, str]:
    """The trace window holds CUDA kernels, some attributed to lora_A and lora_B."""
    from lorascope.detect.kernel_attribution import table_from_trace

    if not bundle.traces:
        return False, "no trace loaded from the run"
    rank, trace = sorted(bundle.traces.items())[0]
    table = table_from_trace(trace.raw, str(trace.path)) or {"rows": [], "unit": None}
    kernels = table["rows"] if table["unit"] == "kernel" else []
    count = {
        part: sum(len(r["durations_us"]) for r in kernels if r["module"] and part in r["module"])
        for part in ("lora_A", "lora_B")
    }
    total = sum(len(r["durations_us"]) for r in kernels)
    ok = trace.device == "cuda" and total > 0 and all(count.values())
    return ok, f"rank {rank}: {trace.device} trace, {total} kernels, lora_A {count['lora_A']}, lora_B {count['lora_B']}"


def check_snapshots(run: Any, bundle: Any, reasons: tuple[str, ...]) -> tuple[bool, str]:
    """Each rank wrote snapshots for these reasons; each rank's was analysed with frames."""
    parts, ok = [], bool(run.ranks)
    for n, rank in run.ranks.items():
        got = [s["reason"].split("-")[0] for s in rank.snapshots]
        snap = bundle.snapshots.get(n)
        device = snap.main if snap is not None else None
        sites = [g.site for g in device.state.by_site[:2]] if device is not None else []
        ok = ok and all(r in got for r in reasons) and device is not None and device.state.allocated > 0
        sizes = ", ".join(f"{s['reason']} {s['bytes'] / 2**20:.1f} MiB in {s.get('ms')} ms" for s in rank.snapshots)
        parts.append(f"rank {n}: [{sizes}]; top sites {sites}")
    return ok, "; ".join(parts)


#: Where the planted spike's memory is allocated: the script's loss, the model's lm_head
#: call (transformers' CausalLM forward), torch's cross_entropy.
LOSS_FRAMES = re.compile(r"train_lora\.py:\d+ in compute_loss|modeling_llama\.py:\d+ in forward|in cross_entropy")


def check_oom(run: Any, bundle: Any, findings: list[Any]) -> tuple[bool, str]:
    """The rank died of an OOM, the observer's snapshot was written, and the oom finding
    from it has the loss's frames among its top sites (the planted spike)."""
    rank = run.ranks.get(0)
    if rank is None:
        return False, "rank 0 wrote no stream"
    exc = (rank.exception or {}).get("type")
    snaps = [s for s in rank.snapshots if s["reason"] == "oom"]
    oom = next((f for f in findings if f.id == "oom"), None)
    if oom is None:
        return False, f"exception {exc}, oom snapshots {snaps}, but no oom finding"
    cats = oom.details.get("by_category") or {}
    top = max(cats, key=cats.get) if cats else None
    sites = oom.details.get("sites", [])[:3]
    from_snapshot = str(run.path) in oom.evidence[0].source
    loss_on_top = any(LOSS_FRAMES.search(site) for site in sites)
    ok = exc == "OutOfMemoryError" and len(snaps) == 1 and from_snapshot and loss_on_top
    via = snaps[0].get("via") if snaps else None
    return ok, f"exception {exc}; snapshot via {via}; top category {top} of {cats}; top sites {sites}"


def check_counters() -> tuple[bool, str]:
    """The probes' one-read allocator counters equal torch.cuda's three calls, and what each
    costs (the probes read them at every phase edge)."""
    import torch

    from lorascope.probes.memory import _allocator_counters

    held = torch.empty(3 << 20, device="cuda")
    ours = _allocator_counters(torch, 0)
    theirs = {
        "alloc": torch.cuda.memory_allocated(0),
        "reserved": torch.cuda.memory_reserved(0),
        "max_alloc": torch.cuda.max_memory_allocated(0),
    }
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        _allocator_counters(torch, 0)
    t1 = time.perf_counter()
    for _ in range(n):
        torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0), torch.cuda.max_memory_allocated(0)
    t2 = time.perf_counter()
    del held
    return ours == theirs, f"{ours} vs {theirs}; {(t1 - t0) / n * 1e6:.1f} us a reading vs {(t2 - t1) / n * 1e6:.1f} us"


def check_quiet(findings: list[Any], ids: tuple[str, ...] | None) -> tuple[bool, str]:
    """No finding at warning or error (of these detectors; of any when ``ids`` is None)."""
    loud = [f for f in findings if f.severity in ("warning", "error") and (ids is None or f.id in ids)]
    return not loud, "; ".join(f"{f.id} {f.severity}: {f.title}"[:160] for f in loud) or "none"


def check_gpu0_guests(run: Any) -> tuple[bool | None, str]:
    """NVML on rank 0's GPU lists the other ranks' processes (they share GPU 0 here).
    Not applicable when NVML reports PIDs of another namespace (a container)."""
    rank0 = run.ranks.get(0)
    if rank0 is None:
        return False, "rank 0 wrote no stream"
    pids = {p for m in rank0.mem if isinstance(m.get("nvml"), dict) for p in (m["nvml"].get("pids") or [])}
    if not pids:
        return False, "rank 0's NVML samples list no process"
    if rank0.pid not in pids:
        return None, f"NVML lists {sorted(pids)[:8]}, not rank 0's own pid {rank0.pid}: another PID namespace"
    others = {n: r.pid in pids for n, r in run.ranks.items() if n != 0}
    return bool(others) and all(others.values()), f"other ranks listed on rank 0's GPU: {others}"


def check_finding(findings: list[Any], finding_id: str, *needles: str) -> tuple[bool, str]:
    found = next((f for f in findings if f.id == finding_id), None)
    if found is None:
        return False, f"no {finding_id} finding (got {[f.id for f in findings]})"
    text = " ".join([found.title] + [f"{e.label} {e.value}" for e in found.evidence])
    missing = [n for n in needles if n not in text]
    return not missing, found.title + (f"; missing {missing}" if missing else "")


def oom_cap_mib(rank: Any) -> int | None:
    """A cap between what the first step holds when it starts and the step's peak (so the
    loss, not the model, runs out): from the probes' CUDA counters of the spike run."""
    cuda = [m for m in rank.mem if isinstance(m.get("cuda"), dict)]
    start = next((m["cuda"]["alloc"] for m in cuda if m["src"] == "forward.begin"), None)
    peak = max((m["cuda"].get("max_alloc", 0) for m in cuda), default=0)
    if start is None or peak <= start:
        return None
    return int((start + 0.6 * (peak - start)) / 2**20)


def peak_rss(run_dir: Path) -> int:
    """Rank 0's largest RSS sample in a run directory."""
    from lorascope.rundir.loading.reader import load_run

    return max((m["rss"] or 0) for m in load_run(run_dir).ranks[0].mem)


def in_job_cost(run_dir: Path) -> float | None:
    """What the probes cost the run, as it measured itself: the share of a step its ranks
    spent in probe code (`analyze`'s "probes' cost"; None without cost records)."""
    from lorascope.analysis.summary import build_summary
    from lorascope.rundir.loading.reader import load_run

    cost = build_summary(load_run(run_dir))["probe_cost"]
    return None if cost is None else cost["share_of_step"]


def overhead(times: dict[str, list[float]]) -> dict[str, Any]:
    """Mean step seconds per variant and each probed variant against bare."""
    means = {k: statistics.mean(v) for k, v in times.items() if v}
    bare = means.get("bare")
    return {
        "mean_step_s": {k: round(v, 5) for k, v in means.items()},
        "runs": {k: len(v) for k, v in times.items()},
        "vs_bare": {k: round(v / bare - 1, 4) for k, v in means.items() if bare and k != "bare"},
    }


def realsize_overhead(runs: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Steady-state and mean step seconds per variant of the real-size run (means over its
    runs) and each probed variant against bare."""
    steady = {k: statistics.mean(r["steady_step_s"] for r in v) for k, v in runs.items() if v}
    mean = {k: statistics.mean(r["mean_step_s"] for r in v) for k, v in runs.items() if v}
    bare_steady, bare_mean = steady.get("bare"), mean.get("bare")
    return {
        "steady_step_s": {k: round(v, 5) for k, v in steady.items()},
        "mean_step_s": {k: round(v, 5) for k, v in mean.items()},
        "runs": {k: len(v) for k, v in runs.items()},
        "steady_vs_bare": {k: round(v / bare_steady - 1, 4) for k, v in steady.items() if bare_steady and k != "bare"},
        "mean_vs_bare": {k: round(v / bare_mean - 1, 4) for k, v in mean.items() if bare_mean and k != "bare"},
    }


def kernel_figures(raw: dict[str, Any], tiny_us: float) -> dict[str, Any]:
    """A kernel window's figures: kernels and their GPU time, the share of both in LoRA
    modules' kernels (lora_A, lora_B), kernels under ``tiny_us``, and the GPU's idle time
    between the window's first kernel and its last (the union of kernels' spans, all
    streams, against that stretch)."""
    from lorascope.detect.kernel_attribution import table_from_trace

    table = table_from_trace(raw) or {"rows": [], "unit": None}
    rows = table["rows"] if table["unit"] == "kernel" else []
    durations = [d for r in rows for d in r["durations_us"]]
    lora = [
        d
        for r in rows
        if r["module"] and ("lora_A" in r["module"] or "lora_B" in r["module"])
        for d in r["durations_us"]
    ]
    spans = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        for e in raw.get("traceEvents", [])
        if isinstance(e, dict)
        and e.get("cat") == "kernel"
        and e.get("ph") == "X"
        and isinstance(e.get("ts"), (int, float))
        and isinstance(e.get("dur"), (int, float))
    )
    busy, end = 0.0, None
    for lo, hi in spans:
        if end is None or lo > end:
            busy += hi - lo
            end = hi
        elif hi > end:
            busy += hi - end
            end = hi
    stretch = (max(hi for _, hi in spans) - spans[0][0]) if spans else 0.0
    total = math.fsum(durations)
    return {
        "kernels": len(durations),
        "gpu_us": round(total, 1),
        "lora_launch_share": round(len(lora) / len(durations), 4) if durations else None,
        "lora_time_share": round(math.fsum(lora) / total, 4) if total else None,
        "tiny_launch_share": round(sum(d < tiny_us for d in durations) / len(durations), 4) if durations else None,
        "idle_share": round(1 - busy / stretch, 4) if stretch else None,
    }


def plan_error(plan: dict[str, Any], measured: dict[str, float]) -> dict[str, Any]:
    """``lorascope plan --json`` against a run's CUDA peaks: the plan's allocator total
    against the peak allocated, its total against the peak reserved, each error as a share
    of the measured peak; and the plan's terms, for the table."""
    alloc, reserved = measured["peak_alloc"], measured["peak_reserved"]
    return {
        "planned_allocated": plan["allocated_bytes"],
        "planned_total": plan["total_bytes"],
        "peak_alloc": alloc,
        "peak_reserved": reserved,
        "alloc_error": round(plan["allocated_bytes"] / alloc - 1, 4) if alloc else None,
        "reserved_error": round(plan["total_bytes"] / reserved - 1, 4) if reserved else None,
        "terms": {t["key"]: t["bytes"] for t in plan["terms"] if t.get("counted")},
    }


def plan_command(config: Path, gpu_mem: int) -> list[str]:
    """``lorascope plan`` for the real-size run's configuration (gpu_realsize.py: PEFT keeps
    the adapters in fp32 over the bf16 base; plain AdamW, one GPU)."""
    return [
        sys.executable,
        "-m",
        "lorascope",
        "plan",
        "--model",
        str(config),
        "--lora-r",
        "16",
        "--lora-alpha",
        "32",
        "--lora-targets",
        "all-linear",
        "--precision",
        "bf16",
        "--fp32-adapters",
        "--seq",
        "2048",
        "--micro-batch",
        "1",
        "--checkpointing",
        "non-reentrant",
        "--gpus",
        "1",
        "--gpu-mem",
        f"{gpu_mem // 2**20}MiB",
        "--json",
    ]


# -- the runs ---------------------------------------------------------------------------


class GpuCheck:
    def __init__(self, work: Path, out: Path, fixtures: list[Path], started: float) -> None:
        self.work, self.out, self.fixtures, self.started = work, out, fixtures, started
        self.report = Report()

    def left_s(self) -> float:
        return BUDGET_S - (time.time() - self.started)

    def analyse(self, path: Path) -> tuple[Any, Any, list[Any]]:
        from lorascope.detect.registry import run_detectors
        from lorascope.ingest.load import load_bundle

        bundle = load_bundle(path)
        return bundle.run, bundle, run_detectors(bundle)

    def add(self, name: str, result: tuple[bool | None, str] | None) -> None:
        if result is not None:
            self.report.add(name, *result)

    def single(self) -> None:
        out = self.work / "single"
        cmd = torchrun(1, "--", "--engine", "torch", "--fault", "rank0-asymmetry-gather", "--steps", "30")
        proc = run(probed(out, cmd, "--trace-window", "5:2"))
        self.report.add(
            "single: 1 rank, NCCL, probed",
            proc.returncode == 0,
            f"exit {proc.returncode} {tail(proc) if proc.returncode else ''}".strip(),
        )
        analysed = self.report.guarded("single: analysed", self.analyse, out)
        if analysed is None:
            return
        rundata, bundle, _ = analysed
        g = self.report.guarded
        self.add("single: ranks on cuda:0", g("single: ranks on cuda:0", check_ranks_on, rundata, 0))
        self.add("allocator history on, OOM observer", g("allocator history", check_memory_history, rundata))
        self.add("CUDA counters in memory records", g("CUDA counters", check_cuda_counters, rundata))
        self.add("NVML samples in memory records", g("NVML samples", check_nvml, rundata))
        self.add("NCCL collectives with device times", g("NCCL device times", check_device_times, rundata))
        self.add("Kineto window: CUDA kernels in lora_A/lora_B", g("Kineto window", check_kernel_window, bundle))
        self.keep("single", out)

    def shared(self) -> None:
        out = self.work / "shared"
        cmd = torchrun(
            2,
            "--share-gpu",
            "--stall",
            "1:8:12",
            "--",
            "--engine",
            "torch",
            "--fault",
            "rank0-asymmetry-gather",
            "--gather-numel",
            str(1 << 20),
            "--steps",
            "14",
        )
        job = start(probed(out, cmd, "--trace-window", "off"), {"LORASCOPE_STALL_SECONDS": "3"})
        try:
            hang = self._hang_during_stall(out, job)
        finally:
            proc = finish(job)
        self.report.add(
            "shared: 2 ranks on one GPU, gloo, CUDA tensors",
            proc.returncode == 0,
            f"exit {proc.returncode} {tail(proc) if proc.returncode else ''}".strip(),
        )
        self.report.add("lorascope hang during the stall", hang[0], hang[1])
        analysed = self.report.guarded("shared: analysed", self.analyse, out)
        if analysed is None:
            return
        rundata, bundle, findings = analysed
        g = self.report.guarded
        self.add("shared: ranks on cuda:0", g("shared: ranks on cuda:0", check_ranks_on, rundata, 0))
        self.add("gloo CUDA collectives with device times", g("gloo device times", check_device_times, rundata))
        self.add(
            "snapshots at stall and hang, analysed",
            g("snapshots", check_snapshots, rundata, bundle, ("stall", "signal")),
        )
        self.add("NVML samples, both ranks", g("NVML shared", check_nvml, rundata))
        self.add("NVML: rank 1's process on rank 0's GPU", g("NVML guests", check_gpu0_guests, rundata))
        self.add(
            "rank0-asymmetry from CUDA memory + snapshots",
            g("rank0-asymmetry", check_finding, findings, "rank0-asymmetry", "on rank 0 only", "gather_to_rank0"),
        )
        self.add(
            "the stall named: rank 1, outside collectives",
            g("stall named", check_finding, findings, "hung-ranks", "rank 1 is stuck outside any collective"),
        )
        self.add("no false collective-mismatch", g("no mismatch", check_quiet, findings, ("collective-mismatch",)))
        self.keep("shared", out)

    def _hang_during_stall(self, out: Path, job: subprocess.Popen[str]) -> tuple[bool, str]:
        """Wait for both ranks' stall records, then ask `lorascope hang` (the dump signal)."""
        from lorascope.errors import LorascopeError
        from lorascope.rundir.loading.reader import load_run

        deadline = time.time() + 90
        while time.time() < deadline and job.poll() is None:
            try:
                stalled = [r.stall is not None for r in load_run(out).ranks.values()]
            except LorascopeError:
                stalled = []
            if len(stalled) == 2 and all(stalled):
                res = run([sys.executable, "-m", "lorascope", "hang", str(out), "--json", "--wait", "8", "--no-html"])
                try:
                    verdict = json.loads(res.stdout).get("verdict", "")
                except ValueError:
                    verdict = tail(res)
                named = "rank 1 is stuck" in str(verdict)
                return res.returncode == 0 and named, f"exit {res.returncode}: {str(verdict)[:200]}"
            time.sleep(0.3)
        return False, "the ranks never recorded the stall"

    def spike_and_oom(self) -> None:
        spike = self.work / "spike"
        args = ["--engine", "torch", "--fault", "logits-spike", "--steps", "4"]
        proc = run(probed(spike, torchrun(1, "--", *args), "--trace-window", "off"))
        self.report.add(
            "spike: logits-spike job",
            proc.returncode == 0,
            f"exit {proc.returncode} {tail(proc) if proc.returncode else ''}".strip(),
        )
        analysed = self.report.guarded("spike: analysed", self.analyse, spike)
        if analysed is None:
            return
        rundata, _, findings = analysed
        self.add(
            "logits-spike named on GPU", self.report.guarded("logits-spike", check_finding, findings, "logits-spike")
        )
        cap = oom_cap_mib(rundata.ranks[0]) if 0 in rundata.ranks else None
        if cap is None:
            self.report.add("planted OOM", False, "the spike run gave no CUDA peak to set the cap from")
            return
        self.report.figures["oom_cap_mib"] = cap
        out = self.work / "oom"
        proc = run(probed(out, torchrun(1, "--memory-cap-mib", str(cap), "--", *args), "--trace-window", "off"))
        self.report.add(f"oom: job capped at {cap} MiB fails", proc.returncode != 0, f"exit {proc.returncode}")
        analysed = self.report.guarded("oom: analysed", self.analyse, out)
        if analysed is None:
            return
        rundata, bundle, findings = analysed
        self.add(
            "OOM snapshot analysed, loss frames on top",
            self.report.guarded("OOM snapshot", check_oom, rundata, bundle, findings),
        )
        self.keep("oom", out)

    def zero3(self) -> None:
        try:
            import deepspeed  # noqa: F401
        except Exception as exc:
            self.report.add(
                "DeepSpeed ZeRO-3, 1 rank",
                None,
                f"DeepSpeed not importable ({type(exc).__name__}); prepare .whl/ (see gpu_check.sh)",
            )
            return
        out = self.work / "zero3"
        proc = run(probed(out, torchrun(1, "--", "--zero", "3", "--steps", "6"), "--trace-window", "off"))
        ok = proc.returncode == 0
        detail = f"exit {proc.returncode} {tail(proc) if not ok else ''}".strip()
        if ok:
            from lorascope.rundir.loading.reader import load_run

            rank = load_run(out).ranks[0]
            srcs = {s["src"] for s in rank.steps}
            timed = sum(c.device_ms is not None for c in rank.collectives)
            ok = srcs == {"deepspeed"} and len(rank.steps) == 6
            detail = (
                f"steps {len(rank.steps)} from {srcs}; {len(rank.collectives)} collectives, {timed} with device times"
            )
        self.report.add("DeepSpeed ZeRO-3, 1 rank", ok, detail)

    def overhead(self) -> None:
        """Bare vs probed vs probed without allocator history, alternated."""
        args = ["--", "--engine", "torch", "--steps", "60"]
        variants = {
            "bare": lambda: torchrun(1, *args),
            "probed": lambda: probed(self.work / "ovh-probed", torchrun(1, *args), "--trace-window", "off"),
            "probed_no_history": lambda: probed(
                self.work / "ovh-nohist", torchrun(1, *args), "--trace-window", "off", "--memory-history", "off"
            ),
        }
        dirs = {"probed": self.work / "ovh-probed", "probed_no_history": self.work / "ovh-nohist"}
        times: dict[str, list[float]] = {k: [] for k in variants}
        rss: dict[str, list[int]] = {k: [] for k in dirs}
        in_job: dict[str, list[float]] = {k: [] for k in dirs}
        quiet: list[tuple[bool, str]] = []  # every probed healthy run, analysed: a false-alarm rate
        for _ in range(3):
            if self.left_s() < 75:
                break
            for name, make in variants.items():
                for stale in dirs.values():
                    shutil.rmtree(stale, ignore_errors=True)
                proc = run(make())
                step = mean_step_s(proc.stdout)
                if proc.returncode == 0 and step is not None:
                    times[name].append(step)
                if name in dirs and proc.returncode == 0:
                    rss[name].append(peak_rss(dirs[name]))
                    if (share := in_job_cost(dirs[name])) is not None:
                        in_job[name].append(share)
                    analysed = self.report.guarded(f"{name}: analysed", self.analyse, dirs[name])
                    if analysed is not None:
                        quiet.append(check_quiet(analysed[2], None))
        if quiet:
            loud = [detail for ok, detail in quiet if not ok]
            self.report.add(
                "healthy runs: no warning",
                not loud,
                f"{len(quiet) - len(loud)} of {len(quiet)} probed healthy runs quiet"
                + (f"; {loud[0]}" if loud else ""),
            )
        healthy = self.work / "ovh-nohist"  # the last run (each run clears both probed directories)
        if (healthy / "manifest.json").is_file():
            self.keep("healthy", healthy)
        figures = overhead(times)
        # host memory the allocator history costs: the probed ranks' peak RSS, with and without
        figures["peak_rss_mib"] = {k: round(statistics.mean(v) / 2**20, 1) for k, v in rss.items() if v}
        # the probed runs' own measure: the share of a step in probe code on the job's threads
        figures["in_job_share"] = {k: round(statistics.median(v), 5) for k, v in in_job.items() if v}
        self.report.figures["overhead"] = figures
        ok = all(bool(v) for v in times.values())
        vs = ", ".join(f"{k} {v:+.1%}" for k, v in figures["vs_bare"].items())
        own = ", ".join(f"{k} {v:.2%}" for k, v in figures["in_job_share"].items())
        self.report.add(
            "probes' overhead on GPU (mean step)",
            ok,
            f"{figures['mean_step_s']} over {figures['runs']} runs; vs bare: {vs}; in the job: {own or '-'}; "
            f"peak RSS MiB {figures['peak_rss_mib']}",
        )

    def realsize(self) -> None:
        """The real-size LoRA run: the probes' cost by ``--memory-history`` mode, the kernel
        window and its fix, the plan against the measured peaks."""
        from gpu_realsize import parse_done

        config = self.work / "realsize-config.json"

        def job(*extra: str) -> list[str]:
            return [sys.executable, str(REALSIZE), "--steps", str(REALSIZE_STEPS), "--config-out", str(config), *extra]

        runs: dict[str, list[dict[str, float]]] = {k: [] for k in ("bare", *HISTORY_MODES)}
        in_job: dict[str, list[float]] = {k: [] for k in HISTORY_MODES}
        failed: list[str] = []
        for _ in range(3):
            if self.left_s() < 200:
                break
            for name in runs:
                out = self.work / f"rs-{name}"
                shutil.rmtree(out, ignore_errors=True)
                cmd = job() if name == "bare" else probed(out, job(), "--trace-window", "off", "--memory-history", name)
                proc = run(cmd)
                done = parse_done(proc.stdout)
                if proc.returncode != 0 or done is None:
                    failed.append(f"{name}: exit {proc.returncode} {tail(proc)}")
                    continue
                runs[name].append(done)
                if name in in_job and (share := in_job_cost(out)) is not None:
                    in_job[name].append(share)
        figures = realsize_overhead(runs)
        figures["in_job_share"] = {k: round(statistics.median(v), 5) for k, v in in_job.items() if v}
        self.report.figures["realsize"] = figures
        self.report.add(
            "real size: bare vs probed by --memory-history",
            not failed and all(runs.values()),
            f"steady s/step {figures['steady_step_s']} over {figures['runs']} runs; vs bare {figures['steady_vs_bare']}; "
            f"in the job {figures['in_job_share']}" + (f"; {failed[0]}" if failed else ""),
        )
        auto = figures["steady_vs_bare"].get("auto")
        self.report.add("real size: probed auto <= 1% over bare", None if auto is None else auto <= 0.01, f"{auto}")
        self._realsize_kernels(job)
        bare = runs["bare"][-1] if runs["bare"] else None
        if bare is not None and config.is_file():
            self.report.guarded("real size: plan", self._realsize_plan, config, bare)

    def _realsize_kernels(self, job: Any) -> None:
        """A kernel window of the real-size run (steps 11-12), analysed; then the fix the
        tiny-kernel tail suggests (the adapted layers compiled), bare, timed."""
        from gpu_realsize import parse_done

        from lorascope.detect.kernel_attribution import tiny_threshold_us

        if self.left_s() < 120:
            self.report.add("real size: kernel window", None, f"not run: {self.left_s():.0f} s left")
            return
        out = self.work / "rs-trace"
        proc = run(probed(out, job(), "--trace-window", "10:2"))
        analysed = self.report.guarded("real size: analysed", self.analyse, out) if proc.returncode == 0 else None
        if analysed is None:
            self.report.add("real size: kernel window", False, f"exit {proc.returncode} {tail(proc)}")
            return
        _, bundle, findings = analysed
        trace = sorted(bundle.traces.items())[0][1] if bundle.traces else None
        figures = kernel_figures(trace.raw, tiny_threshold_us(bundle.traces)) if trace is not None else {}
        tail_finding = next((f for f in findings if f.id == "tiny-kernel-tail"), None)
        figures["finding"] = None if tail_finding is None else f"{tail_finding.severity}: {tail_finding.title}"
        self.report.figures["realsize_kernels"] = figures
        self.report.add("real size: kernel window", bool(figures.get("kernels")), json.dumps(figures))
        if self.left_s() < 90:
            return
        fixed = run(job("--compile"))
        done = parse_done(fixed.stdout)
        bare = (self.report.figures.get("realsize") or {}).get("steady_step_s", {}).get("bare")
        self.report.figures["realsize_compiled"] = done
        gain = round(1 - done["steady_step_s"] / bare, 4) if done and bare else None
        self.report.add(
            "real size: adapted layers compiled (the fix)",
            done is not None,
            f"steady s/step {done and done['steady_step_s']} vs bare {bare}: {gain} saved" if done else tail(fixed),
        )

    def _realsize_plan(self, config: Path, measured: dict[str, float]) -> None:
        import torch

        proc = run(plan_command(config, int(torch.cuda.get_device_properties(0).total_memory)))
        error = plan_error(json.loads(proc.stdout), measured)
        self.report.figures["realsize_plan"] = error
        worst = max(abs(e) for e in (error["alloc_error"], error["reserved_error"]) if e is not None)
        self.report.add(
            "real size: plan vs measured CUDA peak (<= 3%)",
            worst <= 0.03,
            f"allocated {error['planned_allocated']} planned vs {error['peak_alloc']} ({error['alloc_error']:+.1%}); "
            f"reserved {error['planned_total']} vs {error['peak_reserved']} ({error['reserved_error']:+.1%})",
        )

    def keep(self, name: str, run_dir: Path) -> None:
        """Copy a run directory as a fixture (bootstrap left out, big files left out)."""
        for root in self.fixtures:
            dest = root / name
            shutil.rmtree(dest, ignore_errors=True)
            skipped = []
            for src in sorted(run_dir.rglob("*")):
                rel = src.relative_to(run_dir)
                if not src.is_file() or rel.parts[0] == "bootstrap" or src.name.endswith(".lock"):
                    continue
                if src.stat().st_size > MAX_FIXTURE_FILE:
                    skipped.append(f"{rel} ({src.stat().st_size / 2**20:.1f} MiB)")
                    continue
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / rel)
            if skipped:
                (dest / "LEFT_OUT.txt").write_text("\n".join(skipped) + "\n")
        self.report.figures.setdefault("fixtures", {})[name] = sum(
            f.stat().st_size for f in (self.fixtures[0] / name).rglob("*") if f.is_file()
        )


def _interrupted(*_: object) -> None:
    """SIGTERM from the wrapper's time limit: still print what was verified so far."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="lorascope's GPU check (see benchmarks/gpu_check.sh)")
    p.add_argument(
        "--only", nargs="*", choices=("single", "shared", "oom", "zero3", "overhead", "realsize"), help="run only these"
    )
    p.add_argument("--quick", action="store_true", help="the real-size part alone (--only realsize)")
    args = p.parse_args(argv)
    if args.quick:
        args.only = ["realsize"]
    why = cuda_unavailable()
    if why is not None:
        print(f"gpu_check: skipped: {why}; nothing checked", flush=True)
        return 0
    import torch

    started = time.time()
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "runs" / "gpu-check"
    out.mkdir(parents=True, exist_ok=True)
    fixtures = [REPO / "fixtures" / "gpu"]
    work = Path(tempfile.mkdtemp(prefix="lorascope-gpu-check-"))
    check = GpuCheck(work, out, fixtures, started)
    check.report.figures["device"] = torch.cuda.get_device_name(0)
    check.report.figures["torch"] = torch.__version__
    check.report.figures["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    check.report.figures["cublas_workspace_config"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    steps = {
        "single": check.single,
        "shared": check.shared,
        "oom": check.spike_and_oom,
        "zero3": check.zero3,
        "overhead": check.overhead,
        "realsize": check.realsize,
    }
    check.add("allocator counters: one read", check.report.guarded("allocator counters", check_counters))
    signal.signal(signal.SIGTERM, _interrupted)
    try:
        for name, step in steps.items():
            if args.only and name not in args.only:
                continue
            if check.left_s() < 45:
                check.report.add(name, False, f"not run: {check.left_s():.0f} s of the budget left")
                continue
            check.report.guarded(name, step)
    except KeyboardInterrupt:
        check.report.add("budget", False, "stopped by the time limit")
    check.report.figures["seconds"] = round(time.time() - started, 1)
    table = check.report.table()
    print(
        "\n"
        + table
        + f"\n\n{check.report.figures['device']}, torch {check.report.figures['torch']}, {check.report.figures['seconds']} s"
    )
    (out / "gpu-check.txt").write_text(table + "\n")
    (out / "gpu-check.json").write_text(
        json.dumps({"checks": [asdict(c) for c in check.report.checks], "figures": check.report.figures}, indent=2)
        + "\n"
    )
    if os.environ.get("OUT") and fixtures[0].is_dir():
        with tarfile.open(out / "gpu-fixtures.tar.gz", "w:gz") as tar:
            tar.add(fixtures[0], arcname="fixtures/gpu")
    print(f"gpu_check: figures in {out}; fixtures in {fixtures[0]}; runs in {work}")
    return 0 if check.report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
