#!/usr/bin/env python3
"""Where the probes' time goes: the CPU time of each probe function, per call and per
step, measured inside the probed 2-rank ZeRO-3 CPU job (a script, not a test).

``probe_overhead.py`` measures what users see (step time bare vs probed), but on a small
shared machine its pairs swing by tens of percent. This script measures the probes from
the inside instead: it runs ``probes/train_lora.py`` under ``lorascope run`` once, with a
``sitecustomize`` that wraps the probes' functions below and adds up the CPU time of the
calling thread (``time.thread_time_ns``: not the time spent waiting for the GIL or the
other rank) on the main thread and on the others (writer, sampler; on CUDA payloads the
backend's completion callbacks) apart. Only the calls that start between the step records
of the last three quarters of the steps count (warm-up left out: call sites read, caches
filled; and on the other threads, the writer's and sampler's ticks during the job's start
and end, which earlier versions of this script counted as per-step costs). It prints the
main thread's CPU time per step (median, from one clock read at each ``step`` record),
then per function and thread: calls per step, median and mean microseconds per call,
milliseconds per step; then the probes' total per step (the outermost functions only:
nested ones are indented under them).

The wrappers themselves cost ~3 us a call (two thread-clock reads, each a system call of
~1.6 us on the test VM, and a monotonic one): the figures are upper bounds.
The wrapper code is compiled under a file name inside lorascope's package, so the probes
take it for their own frames and call sites are the job's, as without it.

    python benchmarks/probe_costs.py [--steps 60] [--json FILE] [--src OTHER_CHECKOUT] [--untimed]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "probes" / "train_lora.py"

#: (module, owner attribute or "", function, label, parent label or ""): what is timed.
#: Only functions the probes look up at each call can be wrapped (not those bound once
#: when a probe is built).
TIMED = [
    ("lorascope.probes.collectives", "CollectiveProbe", "_begin", "collective start", ""),
    ("lorascope.probes.collectives", "CollectiveProbe", "_site", "call site", "collective start"),
    ("lorascope.probes.collectives", "CollectiveProbe", "_via", "rank condition up the stack", "call site"),
    ("lorascope.rundir.format.writer", "Stream", "flush", "flush", "collective start"),
    ("lorascope.probes.collectives", "CollectiveProbe", "_end_when_done", "async: track its work", ""),
    ("lorascope.probes.collectives", "CollectiveProbe", "_poll", "async: poll completed works", ""),
    ("lorascope.probes.collectives", "CollectiveProbe", "_end", "collective end", ""),
    ("lorascope.probes.memory", "MemoryProbe", "reading", "memory reading (an edge's, the sampler's)", ""),
    (
        "lorascope.probes.memory",
        "",
        "heap_in_use",
        "C heap reading (mallinfo2)",
        "memory reading (an edge's, the sampler's)",
    ),
    ("lorascope.rundir.format.writer", "", "_encode", "format a record (not a call's)", "flush"),
    ("lorascope.probes.collectives", "_Call", "encode", "format a call's record (v2)", "flush"),
    ("lorascope.rundir.format.callfile", "CallFile", "begin", "write a call's record", "collective start"),
    ("lorascope.rundir.format.callfile", "CallFile", "end", "write a call's end", "collective end"),
    ("lorascope.probes.callsteps", "CallSteps", "look", "fold calls into step sums", ""),
]

HARNESS = textwrap.dedent("""
    import atexit, importlib, json, os, sys, threading, time
    if "RANK" in os.environ and "train_lora" in " ".join(sys.argv) and "torchrun" not in sys.argv[0]:
        import lorascope
        _acc = {{}}
        _main = threading.main_thread()
        _src = '''
    def make(orig, label, acc, main, clock, current, wall):
        def timed(*args, **kwargs):
            began = wall()
            t = clock()
            try:
                return orig(*args, **kwargs)
            finally:
                key = label if current() is main else label + "@bg"
                acc.setdefault(key, []).append((began, clock() - t))
        return timed
    '''
        _ns = {{}}
        exec(compile(_src, os.path.join(os.path.dirname(lorascope.__file__), "_probe_costs_harness.py"), "exec"), _ns)
        _steps = []

        def _threads_cpu():
            out = {{}}
            for th in threading.enumerate():
                if th.name.startswith("lorascope") and th.ident is not None:
                    try:
                        out[th.name] = time.clock_gettime_ns(time.pthread_getcpuclockid(th.ident))
                    except OSError:  # the thread has just ended
                        pass
            return out

        def _mark():
            if threading.current_thread() is _main:
                _steps.append((time.thread_time_ns(), time.monotonic_ns(), _threads_cpu()))

        # a step's end: its record put into the steps file (a step's kind is the last field),
        # or in a checkout before the steps file (--src) its stream record
        _SlotFile = getattr(importlib.import_module("lorascope.rundir.format.callfile"), "SlotFile", None)
        if _SlotFile is not None:
            _layout = importlib.import_module("lorascope.rundir.format.layout")
            _put = _SlotFile.put

            def _step_clock(self, *fields):
                if self.record is _layout.STEP and fields[-1] == _layout.STEP_END:
                    _mark()
                return _put(self, *fields)

            _SlotFile.put = _step_clock
        else:
            _Session = importlib.import_module("lorascope.probes.session").Session
            _record = _Session.record

            def _step_clock(self, kind, **fields):
                if kind == "step":
                    _mark()
                return _record(self, kind, **fields)

            _Session.record = _step_clock
        for _mod, _owner, _name, _label, _ in ({timed!r} if {wrap!r} else []):
            _m = importlib.import_module(_mod)
            _o = getattr(_m, _owner) if _owner else _m
            if not hasattr(_o, _name):  # an older checkout (--src) without it
                continue
            setattr(_o, _name, _ns["make"](getattr(_o, _name), _label, _acc, _main, time.thread_time_ns, threading.current_thread, time.monotonic_ns))

        def _report():
            with open(os.path.join({out!r}, "rank-%s.json" % os.environ.get("RANK", "x")), "w") as f:
                json.dump({{"timed": _acc, "steps": _steps}}, f)

        atexit.register(_report)
""")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--port", type=int, default=29680)
    p.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    p.add_argument("--src", type=Path, help="the ranks import lorascope from this checkout (a before)")
    p.add_argument(
        "--untimed",
        action="store_true",
        help="wrap no function: only the main thread's and the probes' threads' CPU per step (no harness cost)",
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="lorascope-costs-") as tmp:
        work = Path(tmp)
        (work / "site").mkdir()
        (work / "out").mkdir()
        harness = HARNESS.format(timed=TIMED, out=str(work / "out"), wrap=not args.untimed)
        (work / "site" / "sitecustomize.py").write_text(harness)
        pythonpath = [str(work / "site"), *([str(args.src.resolve())] if args.src else [])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath)}
        cmd = [
            sys.executable, "-m", "lorascope", "run", "--no-summary", "--trace-window", "off", "--out",
            str(work / "run"), "--", str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2",
            "--master_port", str(args.port), str(JOB), "--steps", str(args.steps),
        ]  # fmt: skip
        # not the repository: `python -m` puts the working directory first on sys.path, and
        # the launcher must be --src's lorascope as the ranks are
        proc = subprocess.run(cmd, cwd=tempfile.gettempdir(), env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        step_s = [float(x.split("=")[1]) for x in proc.stdout.split() if x.startswith("mean_step_s=")]
        figures = {}
        for path in sorted((work / "out").glob("rank-*.json")):
            got = json.loads(path.read_text())
            marks = got["steps"][len(got["steps"]) // 4 :]
            main_cpu = statistics.median(b[0] - a[0] for a, b in zip(marks, marks[1:], strict=False)) / 1e6
            window = (marks[0][1], marks[-1][1], len(marks) - 1)
            figures[path.stem] = {
                "main_thread_cpu_ms_per_step": main_cpu,
                "threads_cpu_ms_per_step": _threads_figures(marks),
                "rows": _figures(got["timed"], window),
            }
    for rank, got in figures.items():
        rows = got["rows"]
        print(
            f"{rank}: main thread {got['main_thread_cpu_ms_per_step']:.1f} ms CPU a step (median)"
            + (f"; mean step {step_s[0] * 1e3:.0f} ms wall (rank 0)" if step_s else "")
        )
        print(
            f"  {'function':44s} {'thread':6s} {'calls/step':>10s} {'median us':>10s} {'mean us':>8s} {'ms/step':>8s}"
        )
        total = 0.0
        for row in rows:
            indent = "  " * row["depth"]
            print(
                f"  {indent + row['label']:44s} {row['thread']:6s} {row['per_step']:10.1f} {row['median_us']:10.1f}"
                f" {row['mean_us']:8.1f} {row['ms_per_step']:8.2f}"
            )
            if row["depth"] == 0:
                total += row["ms_per_step"]
        if rows:
            print(
                f"  probes' CPU per step (outermost functions): {total:.2f} ms, main thread"
                f" {sum(r['ms_per_step'] for r in rows if r['depth'] == 0 and r['thread'] == 'main'):.2f} ms"
            )
        for name, ms in got["threads_cpu_ms_per_step"].items():
            print(f"  thread {name}: {ms:.3f} ms CPU a step (mean over the steps, its own clock)")
    if args.json:
        args.json.write_text(json.dumps({"step_s": step_s, "ranks": figures}, indent=1))
    return 0


def _threads_figures(marks: list[list[Any]]) -> dict[str, float]:
    """Each probe thread's CPU per step over the marks: its own CPU clock read at the first
    and the last mark (no wrapper inside it, so no harness cost unless functions are timed)."""
    first, last = marks[0][2], marks[-1][2]
    steps = len(marks) - 1
    return {name: (last[name] - ns) / steps / 1e6 for name, ns in first.items() if name in last and steps > 0}


def _figures(acc: dict[str, list[list[int]]], window: tuple[int, int, int]) -> list[dict[str, Any]]:
    """Per timed function and thread, the calls that started inside ``window`` (first and
    last step record's monotonic clock, steps between)."""
    parents = {label: parent for *_, label, parent in TIMED}
    first, last, steps = window
    rows = []
    for key, calls in acc.items():
        label, _, bg = key.partition("@")
        kept = [took for began, took in calls if first <= began < last]
        if not kept or steps < 1:
            continue
        per_step = len(kept) / steps
        mean = sum(kept) / len(kept) / 1e3
        # nested under the parents timed on the same thread (the writer thread's flush
        # formats records too, but starts no collective)
        depth, parent = 0, parents.get(label, "")
        while parent and (parent + ("@" + bg if bg else "")) in acc:
            depth, parent = depth + 1, parents.get(parent, "")
        rows.append(
            {
                "label": label,
                "thread": "other" if bg else "main",
                "depth": depth,
                "per_step": per_step,
                "median_us": statistics.median(kept) / 1e3,
                "mean_us": mean,
                "ms_per_step": mean * per_step / 1e3,
            }
        )
    order = [label for *_, label, _ in TIMED]
    rows.sort(key=lambda r: (r["thread"] != "main", order.index(str(r["label"]))))
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
