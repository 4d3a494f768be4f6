"""What several test modules share: launching the real job, writing small synthetic run
directories, hostile text for the report, the browser's command line.

Test modules (and benchmarks/) import from here, never from each other or from a conftest:
a conftest holds fixtures, which pytest finds by itself.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import pytest

from lorascope.detect.finding import Evidence, Finding
from lorascope.rundir.format.callfile import CallFile, calls_path, mem_file, mem_path, step_file, steps_path
from lorascope.rundir.format.layout import BEGIN, END, STEP_END
from lorascope.rundir.format.ops import P2P_OPS
from lorascope.rundir.format.writer import Stream, fatal_path, record_launch, stream_prefix
from lorascope.rundir.loading.ending import ending_of
from lorascope.rundir.loading.reader import load_run

REPO = Path(__file__).resolve().parents[1]
T = TypeVar("T")
FIXTURES = REPO / "fixtures"


def fixture_script(name: str) -> ModuleType:
    """A script under fixtures/ (``snapshots/build.py``, ``convert_v2.py``) loaded as a module."""
    spec = importlib.util.spec_from_file_location(Path(name).stem, FIXTURES / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- real GPU Kineto traces: ../shared/real-traces beside the repository (not in git) ---------

REAL_TRACES = REPO.parent / "shared" / "real-traces"
#: The files there (its README says what each is). Tests name them rather than glob, so that
#: a missing one skips saying which, instead of the test quietly covering fewer.
REAL_TRACE_NAMES = (
    "128rank-job.rank-0.json.gz",
    "128rank-job.rank-1.json.gz",
    "a100-nccl-collective-args.rank-0.json.gz",
    "mi250-rocm.json.gz",
)


def real_trace(name: str) -> Path:
    """The real trace NAME; the calling test skips, saying so, where it is absent."""
    path = REAL_TRACES / name
    if not path.is_file():
        pytest.skip(f"{name} is not in {REAL_TRACES} (the real GPU traces are kept beside the repository)")
    return path


# --- the step probe driven by hand -----------------------------------------------------------


def step_probe(session: Any, mem: Any, trace_dir: Path, kernels: Any = None) -> Any:
    """A StepProbe on ``session`` and memory probe ``mem`` with the other probes it needs
    (grads, logits, a kernel window writing under ``trace_dir`` unless ``kernels`` is
    given), for a test that calls its phase edges and step ends itself."""
    from lorascope.probes.grads import GradProbe
    from lorascope.probes.kernels import KernelWindow
    from lorascope.probes.logits import LogitsProbe
    from lorascope.probes.steps import StepProbe

    kernels = kernels if kernels is not None else KernelWindow(session, None, trace_dir)
    return StepProbe(session, mem, GradProbe(session), LogitsProbe(session, mem), kernels, lambda: None)


def stream_records(folder: Path) -> list[dict[str, Any]]:
    """Every record of the stream segments in ``folder``, in order."""
    return [json.loads(line) for path in sorted(folder.glob("*.jsonl")) for line in path.read_text().splitlines()]


def mem_records(folder: Path) -> list[dict[str, Any]]:
    """The ``mem`` records of the memory file in ``folder``, as the reader makes them (the
    stream's ``label`` and ``nvml`` records naming theirs)."""
    from lorascope.rundir.loading.mem import as_records, read_mem

    records = stream_records(folder)
    labels = {r["id"]: r["text"] for r in records if r["k"] == "label"}
    nvml = {r["i"]: r["nvml"] for r in records if r["k"] == "nvml"}
    [path] = folder.glob("*.mem")
    return as_records(read_mem(path, "rank", []), labels, nvml, "rank", [])


# --- allocator snapshots as the probes write them into a run directory ---------------------

#: Two ranks' snapshots at a LoRA OOM, in torch's pickle format (fixtures/snapshots/build.py).
OOM_SNAPSHOTS = FIXTURES / "snapshots" / "lora-oom"


def _stream(rank_dir: Path) -> Path:
    [stream] = rank_dir.glob("*.0000.jsonl")
    return stream


def add_snapshot(run: Path, rank: int, source: Path, reason: str) -> Path:
    """Put SOURCE into RUN as rank RANK's snapshot, as the probe does: the file next to
    the stream, its ``snapshot`` record before the rank's last record."""
    stream = _stream(run / "ranks" / f"rank-{rank}")
    proc = stream.name.removesuffix(".0000.jsonl")
    target = stream.with_name(f"{proc}.snapshot.{reason}.pickle")
    shutil.copyfile(source, target)
    lines = stream.read_text().splitlines(keepends=True)
    last_t = json.loads(lines[-1])["t"]
    record = {"file": target.name, "reason": reason, "bytes": target.stat().st_size, "k": "snapshot", "t": last_t}
    lines.insert(len(lines) - 1, json.dumps(record) + "\n")
    stream.write_text("".join(lines))
    return target


# --- the real 2-rank LoRA job (probes/train_lora.py) on CPU over gloo ----------------------

TRAIN = str(REPO / "probes" / "train_lora.py")
LORASCOPE = [sys.executable, "-m", "lorascope"]
#: The top-level keys of `lorascope hang --json`, of a run directory and of --pid alike.
HANG_JSON_KEYS = {"id", "kind", "verdict", "fix", "odd_ranks", "first_diverged", "groups", "ranks", "notes", "silent"}
JOB_TIMEOUT = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def torchrun(port: int, *args: str, nproc: int = 2, script: str = TRAIN, launcher: Sequence[str] = ()) -> list[str]:
    """SCRIPT ARGS under torchrun with NPROC ranks on PORT; LAUNCHER: torchrun's own extra options."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(port),
        *launcher,
        script,
        *args,
    ]


@dataclass
class Finished:
    out: Path
    proc: subprocess.CompletedProcess[str]

    def summary(self) -> dict:
        res = subprocess.run(
            [*LORASCOPE, "analyze", str(self.out), "--json"], capture_output=True, text=True, timeout=60
        )
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout)


#: What gloo prints when its threads abort a finished rank in the interpreter's teardown.
TEARDOWN_ABORT = "terminate called without an active exception"


class TeardownAbortWarning(UserWarning):
    """A job was run again: a rank aborted in its teardown after the job had finished."""


def finished_then_aborted(out: Path) -> bool:
    """One or more ranks recorded exit 0 and then died in the interpreter's teardown
    (failed-after-exit's high-confidence case); every other rank recorded exit 0 too, or
    the SIGTERM the launcher sends the rest once one died."""
    try:
        ranks = list(load_run(out).ranks.values())
    except Exception:
        return False
    ends = [ending_of(r) for r in ranks]
    if not any(e.teardown for e in ends):
        return False
    return all(
        e.teardown
        and r.end is not None
        and r.end["code"] == 0
        or (e.status, e.code) in (("exit", 0), ("signal", -signal.SIGTERM))
        for r, e in zip(ranks, ends, strict=True)
    )


def rerun_if_teardown_abort(out: Path, launch: Callable[[], T], failed: Callable[[T], bool]) -> T:
    """``launch()`` a job writing the run directory OUT; if it ``failed`` only because a
    rank aborted in its interpreter's teardown after finishing (gloo's threads:
    pytorch/pytorch#190489; a bare run does it too, now and then), launch it once more,
    with a warning, its first run directory kept beside as OUT-teardown-abort: the tests
    are about the job, not torch's exit."""
    result = launch()
    if failed(result) and finished_then_aborted(out):
        kept = out.with_name(out.name + "-teardown-abort")
        shutil.rmtree(kept, ignore_errors=True)
        out.rename(kept)
        warnings.warn(
            f"{kept}: a rank aborted in its teardown after the job finished; run again",
            TeardownAbortWarning,
            stacklevel=2,
        )
        result = launch()
    return result


def probed(out: Path, cmd: list[str], *extra: str, rerun_teardown_abort: bool = True) -> Finished:
    """CMD under `lorascope run --out OUT` (once more on a teardown abort, unless
    ``rerun_teardown_abort`` is off: :func:`rerun_if_teardown_abort`)."""

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*LORASCOPE, "run", "--out", str(out), *extra, "--", *cmd],
            capture_output=True,
            text=True,
            timeout=JOB_TIMEOUT,
            env=job_env(),
        )

    if not rerun_teardown_abort:
        return Finished(out, run())
    return Finished(out, rerun_if_teardown_abort(out, run, lambda proc: proc.returncode != 0))


def bare(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    """CMD without lorascope; run once more (warned) if it failed with gloo's teardown abort."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=JOB_TIMEOUT, env=job_env())
    if proc.returncode != 0 and TEARDOWN_ABORT in proc.stderr:
        warnings.warn(f"{cmd[-3:]}: gloo aborted a rank in its teardown; run again", TeardownAbortWarning, stacklevel=2)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=JOB_TIMEOUT, env=job_env())
    return proc


def losses(stdout: str) -> list[str]:
    """The per-step losses rank 0 prints with --print-losses, as exact text."""
    return re.findall(r"^step \d+ loss (\S+)$", stdout, flags=re.M)


#: Signals a shell may have set to be ignored for this test run (``nohup`` ignores SIGHUP; a
#: background job of a non-interactive shell ignores SIGINT and SIGQUIT), and an ignored
#: disposition is inherited by the job: the job under test starts with the defaults.
INHERITED = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def default_signals() -> None:
    for signum in INHERITED:
        signal.signal(signum, signal.SIG_DFL)


# --- small synthetic run directories, written by the real writer -----------------------------

T0 = 1_800_000_000.0


@dataclass
class Call:
    """One collective on one rank: ``end=False`` leaves it pending (its record's end never
    written); ``ended_at`` ends it then (after the rank's other records), with ``err``."""

    op: str
    bytes: int = 4
    dtype: str | None = "float32"
    site: str = "train.py:10 in main"
    end: bool = True
    err: str | None = None
    ended_at: float | None = None
    #: Its process group (0: default_pg; another: one of ``RankSpec.groups``), numbered within it.
    gid: int = 0
    #: The caller inside a rank condition the probes named (a library made the call).
    via: str | None = None
    #: A phase the call is made in: its edges written around the call (the end once it ended).
    phase: str | None = None


@dataclass
class RankSpec:
    steps: int = 4
    calls: list[Call] = field(default_factory=lambda: [Call("all_reduce")] * 3)
    exception: tuple[str, str] | None = None
    ends: bool = True
    losses: list[float] | None = None
    phases: list[tuple[str, int]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    sites: dict[str, tuple[str, list[str]]] = field(default_factory=dict)
    #: What faulthandler wrote to the rank's fatal file (None: no file; "" an empty one).
    fatal: str | None = None
    #: Records written after the steps, as given (``t`` added).
    extra: list[dict[str, Any]] = field(default_factory=list)
    #: Records written after the steps and before the calls, as given (``t`` added).
    before_calls: list[dict[str, Any]] = field(default_factory=list)
    #: The call file's head and ring slots.
    call_slots: tuple[int, int] = (1 << 10, 1 << 12)
    #: The sequence number of the first call (a rank attached after the others' first calls).
    first_seq: int = 1
    #: Process groups besides default_pg: gid -> member ranks (named ``g<gid>``).
    groups: dict[int, list[int]] = field(default_factory=dict)


class Calls:
    """A rank process's calls written as the probes write them (format v3): each into its
    call file (:class:`CallFile`, beside the stream at ``prefix``), its shape a ``shape``
    record of ``stream`` the first time it is seen, its error a ``coll_err`` record. The
    call file's ``calls_file`` record is written when this is made."""

    def __init__(self, stream: Stream, prefix: Path, t: float, head: int = 1 << 10, ring: int = 1 << 12) -> None:
        self.stream = stream
        self.file = CallFile(calls_path(prefix), head=head, ring=ring)
        self.shapes: dict[tuple[Any, ...], int] = {}
        stream.write(
            {"k": "calls_file", "t": t, "file": self.file.path.name, "how": self.file.how, "head": head, "ring": ring}
        )

    def shape(self, t: float, **fields: Any) -> int:
        """The id of a call shape (op, dtype, async, site, via), declared at ``t`` if new."""
        shape = {"op": "all_reduce", "dtype": None, "async": False, "site": None, "via": None, **fields}
        key = tuple(shape.values())
        sid = self.shapes.get(key)
        if sid is None:
            sid = self.shapes[key] = len(self.shapes)
            self.stream.write({"k": "shape", "t": t, "id": sid, **shape})
        return sid

    def call(
        self,
        t: float,
        seq: int,
        *,
        gid: int = 0,
        step: int = 0,
        nbytes: int | None = None,
        end: float | None = None,
        err: str | None = None,
        **shape: Any,
    ) -> int:
        """One call begun at ``t`` (ended at ``end``; None: pending) of ``nbytes`` (None:
        unknown); its index."""
        size = -1 if nbytes is None else nbytes
        index = self.file.begin(t, seq, size, step, gid, self.shape(t, **shape))
        if end is not None:
            self.file.end(index, end)
        if err is not None:
            at = end if end is not None else t
            p2p = {"p2p": True} if shape.get("op") in P2P_OPS else {}  # numbered apart, as the probes mark it
            self.stream.write({"k": "coll_err", "t": at, "index": index, "gid": gid, "seq": seq, "err": err, **p2p})
        return index

    def close(self) -> None:
        self.file.close()


class Steps:
    """A rank process's steps, phase edges and memory readings written as the probes write
    them: each into its steps file or memory file (beside the stream at ``prefix``), its
    phase name, step source or reading's source a ``label`` record of ``stream`` the first
    time it is seen. The ``steps_file`` and ``mem_file`` records are written when this is
    made."""

    def __init__(self, stream: Stream, prefix: Path, t: float) -> None:
        self.stream = stream
        self.file = step_file(steps_path(prefix))
        self.mem = mem_file(mem_path(prefix))
        self.labels: dict[str, int] = {}
        stream.write({"k": "steps_file", "t": t, "file": self.file.path.name, "how": self.file.how})
        stream.write({"k": "mem_file", "t": t, "file": self.mem.path.name, "how": self.mem.how})

    def label(self, t: float, text: str) -> int:
        n = self.labels.get(text)
        if n is None:
            n = self.labels[text] = len(self.labels)
            self.stream.write({"k": "label", "t": t, "id": n, "text": text})
        return n

    def phase(self, t: float, name: str, edge: str, step: int, waited: float = 0.0) -> None:
        self.file.put(t, 0.0, math.nan, waited, step, self.label(t, name), BEGIN if edge == "begin" else END)

    def step(
        self, t: float, step: int, dur: float, loss: float | None = None, src: str = "torch", waited: float = 0.0
    ) -> None:
        """A step's end (``waited``: seconds blocked on async collectives' handles in it); a
        non-finite loss as the probes write it: none in the step's record, and a ``loss``
        record with its text."""
        finite = loss is not None and math.isfinite(loss)
        self.file.put(t, dur, loss if finite else math.nan, waited, step, self.label(t, src), STEP_END)
        if loss is not None and not finite:
            self.stream.write({"k": "loss", "t": t, "step": step, "loss": None, "text": repr(loss)})

    def reading(self, rec: dict[str, Any]) -> None:
        """A ``mem`` record, as the stream held them: into the memory file, its NVML part
        an ``nvml`` record."""
        t, cuda, rss, heap = rec["t"], rec.get("cuda"), rec.get("rss"), rec.get("heap")
        counters = (-1, -1, -1, -1) if cuda is None else (
            cuda["alloc"], cuda["reserved"], cuda["max_alloc"], cuda["device"]
        )  # fmt: skip
        index = self.mem.put(
            t, -1 if rss is None else rss, -1 if heap is None else heap, *counters[:3], rec["step"], counters[3],
            self.label(t, rec["src"]),
        )  # fmt: skip
        if "nvml" in rec:
            self.stream.write({"k": "nvml", "t": t, "i": index, "nvml": rec["nvml"]})

    def record(self, rec: dict[str, Any]) -> None:
        """A ``phase``, ``step`` or ``mem`` record, as the stream held them."""
        if rec["k"] == "mem":
            self.reading(rec)
        elif rec["k"] == "phase":
            self.phase(rec["t"], rec["name"], rec["edge"], rec["step"], rec.get("waited", 0.0))
        else:
            self.step(
                rec["t"], rec["step"], rec["dur"], rec.get("loss"), rec.get("src", "torch"), rec.get("waited", 0.0)
            )


#: A lone rank process's start record (host h, pid 42).
START = {"k": "start", "rank": 0, "world_size": 1, "local_rank": 0, "pid": 42, "host": "h", "argv": [],
         "versions": {}, "device": "cpu"}  # fmt: skip


def one_rank(run: Path) -> tuple[Stream, Steps]:
    """A one-rank run's launch and its process (:data:`START`): its stream, begun with its
    start record at t 1.0, and its steps and memory files."""
    record_launch(run, "h-1", ["job"])
    prefix = stream_prefix(run, 0, "h", 42)
    stream = Stream(prefix)
    stream.write({**START, "t": 1.0})
    return stream, Steps(stream, prefix, 1.0)


def write_run(
    root: Path,
    ranks: list[RankSpec],
    *,
    command: list[str] | None = None,
    argv: list[str] | None = None,
    configs: dict[str, dict[str, Any]] | None = None,
    exit_status: int = 0,
) -> Path:
    """A run directory with one stream per rank; times are fixed, so output is reproducible."""
    record_launch(root, "h-1", command or ["torchrun", "train.py"], start=T0, end=T0 + 100, exit_status=exit_status)
    for n, spec in enumerate(ranks):
        stream = Stream(stream_prefix(root, n, "h", 100 + n))
        t = T0 + 1 + n * 0.01
        steps_file: list[Steps] = []  # once made

        def write(kind: str, stream: Stream = stream, files: list[Steps] = steps_file, **fields: Any) -> None:
            nonlocal t
            t += 0.1
            if kind in ("phase", "step", "mem") and files:
                files[0].record({"k": kind, "t": t, **fields})  # the steps or memory file, as the probes write them
            else:
                stream.write({"k": kind, "t": t, **fields})

        write(
            "start",
            rank=n,
            world_size=len(ranks),
            local_rank=n,
            pid=100 + n,
            host="h",
            argv=argv or ["train.py"],
            versions={"torch": "2.13.0"},
            device="cpu",
        )
        if spec.fatal is not None:
            fatal = fatal_path(stream_prefix(root, n, "h", 100 + n))
            fatal.parent.mkdir(parents=True, exist_ok=True)
            fatal.write_text(spec.fatal)
            write("fatal_handler", file=fatal.name)
        for name, value in (configs or {}).items():
            write("config", name=name, value=value)
        write("group", gid=0, name="default_pg", ranks=list(range(len(ranks))), backend="gloo")
        for gid, members in spec.groups.items():
            write("group", gid=gid, name=f"g{gid}", ranks=members, backend="gloo")
        steps_file.append(Steps(stream, stream_prefix(root, n, "h", 100 + n), t))
        for site, (line, conditions) in spec.sites.items():
            write("site", site=site, line=line, conditions=conditions)
        for step in range(spec.steps):
            write("mem", src="forward.begin", step=step, rss=(100 + 10 * step + (50 if n == 0 else 0)) << 20)
            for name, at in spec.phases:
                if at == step:
                    write("phase", name=name, edge="begin", step=step)
                    write("phase", name=name, edge="end", step=step)
            loss = spec.losses[step] if spec.losses else 2.0 - 0.1 * step
            write("step", step=step + 1, dur=0.5 + 0.01 * n, loss=loss, src="torch")
        for rec in spec.before_calls:
            write(**{k: v for k, v in rec.items() if k != "k"}, kind=rec["k"])
        calls = Calls(stream, stream_prefix(root, n, "h", 100 + n), t, *spec.call_slots)
        seqs = dict.fromkeys([0, *spec.groups], spec.first_seq)  # each group numbers its own calls
        p2p_seqs = dict.fromkeys([0, *spec.groups], 1)  # and its point-to-point calls apart, as the probes do
        for call in spec.calls:
            numbers = p2p_seqs if call.op in P2P_OPS else seqs
            seq = numbers[call.gid]
            numbers[call.gid] += 1
            if call.phase is not None:
                write("phase", name=call.phase, edge="begin", step=spec.steps)
            t += 0.1
            began = t
            if call.end:
                t += 0.1
            ended = t if call.end else call.ended_at
            if call.phase is not None and call.end:
                write("phase", name=call.phase, edge="end", step=spec.steps)
            calls.call(
                began,
                seq,
                gid=call.gid,
                step=spec.steps,
                end=ended,
                err=call.err if ended is not None else None,
                op=call.op,
                nbytes=call.bytes,
                dtype=call.dtype,
                site=call.site,
                via=call.via,
            )
        calls.close()
        for message in spec.warnings:
            write("warning", category="UserWarning", message=message, filename="train.py", lineno=3)
        for rec in spec.extra:
            write(**{k: v for k, v in rec.items() if k != "k"}, kind=rec["k"])
        if spec.exception:
            write(
                "exception",
                type=spec.exception[0],
                message=spec.exception[1],
                traceback=f"Traceback (most recent call last):\n{spec.exception[0]}: {spec.exception[1]}\n",
            )
            write("end", status="exception", code=1)
        elif spec.ends:
            write("mem", src="end", step=spec.steps, rss=(200 + (50 if n == 0 else 0)) << 20)
            write("end", status="exit", code=0)
        steps_file[0].file.close()
        steps_file[0].mem.close()
        stream.close()
    return root


# --- hostile text: a run and a finding that carry it everywhere the report shows text ----------

XSS = '<script>window.__pwned=1</script><img src=x onerror="window.__pwned=2">'


def xss_run(root: Path) -> tuple[Path, list[Finding]]:
    ranks = [
        RankSpec(
            calls=[Call("all_reduce"), Call(XSS, site=f"train.py:9 in {XSS}", end=False)],
            exception=("RuntimeError", f"failed: {XSS}"),
            warnings=[XSS],
        ),
        RankSpec(calls=[Call("all_reduce"), Call("barrier", site=f"{XSS}.py:1 in f", end=False)], ends=False),
    ]
    kernels = {
        "unit": "kernel",
        "threshold_us": 5.0,
        "ranks": {
            "0": {
                "source": XSS,
                "rows": [{"name": f"void {XSS}<float>", "module": "lora_B", "durations_us": [1.0, 2.0, 50.0]}],
            }
        },
    }
    finding = Finding(
        id="tiny-kernel-tail",
        title=f"tiny kernels {XSS}",
        severity="warning",
        confidence="low",
        confidence_reason=XSS,
        ranks=[0],
        evidence=[Evidence(XSS, {"frame": XSS}, XSS)],
        explanation=XSS,
        fix=XSS,
        details={"kernels": kernels, "frames": [XSS, {"at": XSS}]},
    )
    return write_run(root, ranks, command=["torchrun", XSS]), [finding]


# --- a headless Chromium (Debian's, driven by playwright; its own download never used) --------

#: The flags a closed network needs: without the background-networking ones Chromium keeps
#: trying to reach Google's services (requests a test would count).
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]


def chromium_path() -> str | None:
    return os.environ.get("LORASCOPE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


# --- run directories someone else may have written: copied fixtures, edited -----------------

#: The checkout whose lorascope this test process imported (its subprocesses use the same).
IMPORTED_ROOT = str(Path(__import__("lorascope").__file__).resolve().parents[1])


def copied_run(tmp_path: Path, scenario: str = "healthy", name: str = "run") -> Path:
    """A copy of fixtures/SCENARIO to edit."""
    return Path(shutil.copytree(FIXTURES / scenario, tmp_path / name))


def edit_records(run: Path, rank: int, edit: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]) -> Path:
    """Rewrite rank RANK's first segment as EDIT returns its records (NaN and infinities
    written as Python's json writes them, as the probes do)."""
    stream = _stream(run / "ranks" / f"rank-{rank}")
    records = [json.loads(line) for line in stream.read_text().splitlines()]
    stream.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in edit(records)))
    return stream


def capped_cli(
    *args: str, seconds: float = 60, cap: int = 4 << 30, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`lorascope ARGS` in a subprocess under an address-space cap of CAP bytes; fails the
    test past SECONDS or on a traceback. Output decoded as UTF-8, bad bytes replaced."""
    import resource

    def cap_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    proc = subprocess.run(
        [*LORASCOPE, *args],
        capture_output=True,
        encoding="utf-8",
        errors="replace",
        env={**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": IMPORTED_ROOT, **(env or {})},
        timeout=seconds,
        preexec_fn=cap_memory,
        cwd=cwd,
    )
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-2000:]
    return proc


@functools.lru_cache(maxsize=1)
def why_no_ptrace() -> str | None:
    """Why gdb cannot attach to a process here (no gdb; ptrace not permitted: a container
    without CAP_SYS_PTRACE, Yama), or None: the attach tests skip, saying so."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return "gdb is not installed: `lorascope attach` below Python 3.14 needs it"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        res = subprocess.run(
            [gdb, "-nx", "-batch", "--readnever", "-p", str(child.pid), "-ex", "info inferiors"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        child.kill()
        child.wait()
    if "ptrace:" in res.stdout + res.stderr or res.returncode != 0:
        return f"gdb cannot attach to a process here: {(res.stdout + res.stderr).strip().splitlines()[-1:]}"
    return None
