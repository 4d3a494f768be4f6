"""Analysis at scale: a run directory in the real format, RANKS x STEPS, read back by
`lorascope analyze` and `lorascope report`.

The streams are a real recording replicated: fixtures/rank-conditional-hang (the probes/
ZeRO-3 job, 2 ranks, one warm-up step, one steady step, then rank 0 enters an all_reduce
under ``if d.rank == 0:`` that rank 1 never joins). Every rank's stream is the recorded
prologue and warm-up, the steady step repeated (times, step numbers and sequence numbers
advanced), and the recorded end: rank 0's for rank 0, rank 1's for every other rank. So
the run ends in a rank-conditional hang. Planted on top:

* rank 0 holds 512 MiB more (RSS and tensor heap) from step STEPS/3 on (rank0-asymmetry);
* rank ``RANKS // 2 + 1`` computes twice as long every step, the others wait for it in
  their first synchronous collective (straggler).

The steady step's training-loop memory readings are written into the memory file as the
probes write them (on the steps read in full, and new peaks: ``probes/memory.py``), and so are the per-step
sums of the calls past half the call file's ring (``probes/callsteps.py``).

Prints per size: what was written, wall time and peak memory of `lorascope analyze
--json` and `lorascope report` (the command and its worker processes together: summed RSS,
and summed PSS, what the machine needs, the code the workers share counted once), the
bytes read per second and per core, and whether each planting was named (rank0-asymmetry
on rank 0, straggler on its rank, rank-conditional-hang).

    python benchmarks/rundir_scale.py [--ranks 64,256,1024] [--steps 10000] [--dir /tmp/rundir-scale] [--keep]
        [--workers N] [--cluster ADDRESS | --local-cluster N]

``--workers N`` passes `lorascope --workers N`: the memory of N workers can be measured on
fewer cores (slower, the same memory: each worker holds what its stream needs).

``--cluster ADDRESS`` reads the streams on that Dask cluster (`--cluster` of the commands;
its workers' CPU is not counted, they are not this machine's); ``--local-cluster N`` starts
one here with N single-threaded worker processes and counts their CPU (what the Dask
path costs against the local pool on the same cores).

Each run directory is written in format v3 (the calls in each rank's call file, its steps
and phase edges in its steps file, the rest in its stream) and deleted after it is measured (unless --keep); check `df` first.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from lorascope.probes.callsteps import LAG
from lorascope.probes.logits import MAX_CALLS
from lorascope.probes.memory import HEAP_DENSE_STEPS, HEAP_EVERY, STRIDED_PHASES
from lorascope.rundir.format.layout import (
    CALL,
    CALLS_VERSION,
    DEFAULT_HEAD,
    DEFAULT_RING,
    HEADER,
    MAGIC,
    MEM_MAGIC,
    MEM_VERSION,
    STAMP_MASK,
    STEP_END,
    STEP_KINDS,
    STEPS_HEAD,
    STEPS_MAGIC,
    STEPS_RING,
    STEPS_VERSION,
)
from lorascope.rundir.format.schema import CALLS_SUFFIX, FORMAT_VERSION, MEM_SUFFIX, STEPS_SUFFIX
from lorascope.rundir.loading.calls import CALL_DTYPE, MEM_DTYPE, STEP_DTYPE, read_calls
from lorascope.rundir.loading.mem import as_records as mem_records
from lorascope.rundir.loading.mem import read_mem
from lorascope.rundir.loading.steps import as_records, read_steps

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = REPO / "fixtures" / "rank-conditional-hang"
EXTRA = 512 * 2**20
SLOWER = 2.0
#: The run length issue 13 sets the goal at (1,024 ranks x 10,000 steps in under 2 minutes).
GOAL_STEPS = 10_000
#: Records that point to side files the copy does not have.
DROPPED = {"trace_window", "flight_dump", "snapshot", "fatal_handler"}


#: A call's shape (format v3's ``shape`` record): what a call shares with the same call at every step.
_SHAPE_KEYS = ("op", "dtype", "async", "site", "via")


def _records(rank: int) -> tuple[list[dict[str, Any]], dict[tuple[int, int], dict[str, Any]]]:
    """The template rank's stream records and its calls, in time order: each call as a
    ``coll`` dict (t, seq, gid, step, bytes and its shape's fields), and each ended call's
    end as a dict by (gid, seq) (t: the end, err)."""
    [path] = (TEMPLATE / "ranks" / f"rank-{rank}").glob("*.jsonl")
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    [calls_path] = path.parent.glob("*" + CALLS_SUFFIX)
    calls = read_calls(calls_path, f"rank {rank}", [])
    shapes = {r["id"]: r for r in recs if r["k"] == "shape"}
    errors = {r["index"]: r["err"] for r in recs if r["k"] == "coll_err"}
    labels = {r["id"]: r["text"] for r in recs if r["k"] == "label"}
    [steps_file] = path.parent.glob("*" + STEPS_SUFFIX)
    steps, phases = as_records(read_steps(steps_file, f"rank {rank}", []).records, labels, f"rank {rank}", [])
    [mem_file] = path.parent.glob("*" + MEM_SUFFIX)
    nvml = {r["i"]: r["nvml"] for r in recs if r["k"] == "nvml"}
    mem = mem_records(read_mem(mem_file, f"rank {rank}", []), labels, nvml, f"rank {rank}", [])
    kept = [r for r in recs if r["k"] not in ("shape", "calls_file", "coll_err", "steps_file", "mem_file", "nvml")]
    made_here = sorted([*steps, *phases, *mem], key=lambda r: r["t"])
    stream = list(heapq.merge(kept, made_here, key=lambda r: r["t"]))
    made, ends = [], {}
    rows = calls.records
    for i, index in enumerate(calls.index.tolist()):
        shape = shapes[int(rows["shape"][i])]
        nbytes = int(rows["bytes"][i])
        call = {
            "k": "coll", "t": float(rows["t"][i]), "seq": int(rows["seq"][i]), "gid": int(rows["gid"][i]),
            "step": int(rows["step"][i]), "bytes": None if nbytes < 0 else nbytes,
            **{key: shape[key] for key in _SHAPE_KEYS},
        }  # fmt: skip
        made.append(call)
        if rows["end"][i]:
            ends[(call["gid"], call["seq"])] = {"t": float(rows["end"][i]), "err": errors.get(index)}
    merged = list(heapq.merge(stream, made, key=lambda r: r["t"]))  # each one's own order kept
    return merged, ends


def _write_without_ring(
    path: Path, parts: list[np.ndarray], dtype: np.dtype[Any], magic: bytes, version: int, created: float
) -> int:
    """A slot file without a ring (a steps or memory file) holding ``parts``' rows in
    order, as the probes leave it; its bytes."""
    rows = np.concatenate(parts) if parts else np.zeros(0, dtype)
    rows["stamp"] = (np.arange(len(rows)) + 1) & STAMP_MASK
    with open(path, "wb") as f:
        f.write(HEADER.pack(magic, version, dtype.itemsize, STEPS_HEAD, STEPS_RING, len(rows), created, b""))
        f.write(rows.tobytes())
    return HEADER.size + len(rows) * dtype.itemsize


class _StepColumns:
    """A rank's steps and phase edges as the steps file's columns, appended a step at a time."""

    def __init__(self, labels: dict[str, int]) -> None:
        self.labels = labels
        self.parts: list[np.ndarray] = []

    def add(self, recs: list[dict[str, Any]], t: np.ndarray, steps_on: int, dur: float | None = None) -> None:
        """``recs`` (step and phase records) at times ``t``, their steps ``steps_on`` later;
        ``dur``: every step's duration (None: its own)."""
        rows = np.zeros(len(recs), STEP_DTYPE)
        rows["t"] = t
        rows["dur"] = [(r["dur"] if dur is None else dur) if r["k"] == "step" else 0.0 for r in recs]
        rows["loss"] = [np.nan if r.get("loss") is None else r["loss"] for r in recs]
        rows["step"] = [r["step"] + steps_on for r in recs]
        rows["label"] = [self.labels[r["src"] if r["k"] == "step" else r["name"]] for r in recs]
        rows["kind"] = [STEP_END if r["k"] == "step" else STEP_KINDS.index(r["edge"]) for r in recs]
        self.parts.append(rows)

    def write(self, path: Path, created: float) -> int:
        """The steps file as the probes leave it; its bytes."""
        return _write_without_ring(path, self.parts, STEP_DTYPE, STEPS_MAGIC, STEPS_VERSION, created)


class _MemColumns:
    """A rank's memory readings as the memory file's columns, appended a step at a time."""

    def __init__(self, labels: dict[str, int]) -> None:
        self.labels = labels
        self.parts: list[np.ndarray] = []

    def rows(self, recs: list[dict[str, Any]]) -> np.ndarray:
        """``recs`` (mem records) as memory-file rows."""
        rows = np.zeros(len(recs), MEM_DTYPE)
        rows["t"] = [r["t"] for r in recs]
        rows["rss"] = [-1 if r.get("rss") is None else r["rss"] for r in recs]
        rows["heap"] = [r.get("heap", -1) for r in recs]
        for key in ("alloc", "reserved", "max_alloc", "device"):
            rows[key] = [r["cuda"][key] if "cuda" in r else -1 for r in recs]
        rows["step"] = [r["step"] for r in recs]
        rows["src"] = [self.labels[r["src"]] for r in recs]
        return rows

    def write(self, path: Path, created: float) -> int:
        """The memory file as the probes leave it; its bytes."""
        return _write_without_ring(path, self.parts, MEM_DTYPE, MEM_MAGIC, MEM_VERSION, created)


class _CallColumns:
    """A rank's calls as the call file's columns, appended a step at a time."""

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []
        self.shapes: dict[tuple[Any, ...], int] = {}
        self.errors: list[tuple[int, int, int, float, str]] = []  # index, gid, seq, t, err
        self.n = 0

    def shape(self, rec: dict[str, Any]) -> int:
        key = tuple(rec.get(k) if k != "via" or isinstance(rec.get(k), str) else None for k in _SHAPE_KEYS)
        return self.shapes.setdefault(key, len(self.shapes))

    def add(
        self,
        t: np.ndarray,
        end: np.ndarray,
        seq: np.ndarray,
        nbytes: np.ndarray,
        step: np.ndarray,
        gid: np.ndarray,
        shape: np.ndarray,
    ) -> None:
        rows = np.zeros(len(t), CALL_DTYPE)
        rows["t"], rows["end"], rows["seq"], rows["bytes"] = t, end, seq, nbytes
        rows["step"], rows["gid"], rows["shape"] = step, gid, shape
        rows["stamp"] = (np.arange(self.n, self.n + len(t)) + 1) & STAMP_MASK
        self.parts.append(rows)
        self.n += len(t)

    def write(self, path: Path, created: float) -> int:
        """The call file as the probes leave it (the first DEFAULT_HEAD calls, the newest
        DEFAULT_RING in the ring's slots); its bytes written (the file is sparse)."""
        rows = np.concatenate(self.parts) if self.parts else np.zeros(0, CALL_DTYPE)
        head, ring, n = DEFAULT_HEAD, DEFAULT_RING, len(rows)
        with open(path, "wb") as f:
            f.write(HEADER.pack(MAGIC, CALLS_VERSION, CALL.size, head, ring, n, created, b""))
            f.write(rows[:head].tobytes())
            if n > head:
                newest = np.arange(max(head, n - ring), n)
                slots = head + (newest - head) % ring
                order = np.argsort(slots)
                f.seek(HEADER.size + int(slots[order[0]]) * CALL.size)
                f.write(rows[newest[order]].tobytes())  # the slots of the newest are one run, wrapped
            f.truncate(HEADER.size + (head + ring) * CALL.size)
        return HEADER.size + min(n, head + ring) * CALL.size

    def step_sums(self) -> list[dict[str, Any]]:
        """The ``calls_step`` records the probes write for this run (``probes/callsteps.py``):
        once half the ring is used, every call past the head, LAG calls behind the newest,
        of a step that is over, summed per step, group and op."""
        rows = np.concatenate(self.parts) if self.parts else np.zeros(0, CALL_DTYPE)
        head, n = DEFAULT_HEAD, len(rows)
        if n - head < DEFAULT_RING // 2:
            return []
        folded = rows[head : max(head, n - min(LAG, DEFAULT_RING // 4))]
        last_step = int(rows["step"][-1])
        folded = folded[folded["step"] < last_step]
        op_of = {sid: key[0] for key, sid in self.shapes.items()}
        ops = sorted(set(op_of.values()))
        op = np.array([ops.index(op_of[int(sid)]) for sid in range(len(op_of))])[folded["shape"]]
        ended = folded["end"] > 0
        ms = np.where(ended, (folded["end"] - folded["t"]) * 1e3, 0.0)
        keys = np.stack((folded["step"].astype(np.int64), folded["gid"].astype(np.int64), op))
        uniq, inverse = np.unique(keys, axis=1, return_inverse=True)
        inverse = inverse.reshape(-1)
        count = np.bincount(inverse, minlength=uniq.shape[1])
        nbytes = np.bincount(inverse, weights=np.maximum(folded["bytes"], 0), minlength=uniq.shape[1])
        total = np.bincount(inverse, weights=ms, minlength=uniq.shape[1])
        longest = np.zeros(uniq.shape[1])
        np.maximum.at(longest, inverse, ms)
        open_ = np.bincount(inverse, weights=~ended, minlength=uniq.shape[1])
        out: dict[int, list[list[Any]]] = {}
        for i, (step, gid, o) in enumerate(uniq.T.tolist()):
            out.setdefault(step, []).append(
                [
                    gid,
                    ops[o],
                    int(count[i]),
                    int(nbytes[i]),
                    round(float(total[i]), 3),
                    round(float(longest[i]), 3),
                    int(open_[i]),
                ]
            )
        return [{"k": "calls_step", "step": step, "groups": groups} for step, groups in sorted(out.items())]


def _line(rec: dict[str, Any]) -> str:
    return json.dumps(rec, separators=(",", ":")) + "\n"


def _template(rec: dict[str, Any]) -> str:
    """The record as a format string: {t}, {end}, {step}, {seq} where it holds them."""
    marked = dict(rec)
    for key in ("t", "end", "step", "seq"):
        if isinstance(marked.get(key), int | float) and not isinstance(marked.get(key), bool):
            marked[key] = f"@{key}@"
    text = _line(marked).replace("{", "{{").replace("}", "}}")
    for key in ("t", "end", "step", "seq"):
        text = text.replace(f'"@{key}@"', "{" + key + "!r}")
    return text


def _written_mem(rec: dict[str, Any], step: int, new_peak: bool) -> bool:
    """Whether the probes write a training-loop ``mem`` reading at ``step`` (its ``step``
    field): on the steps read in full (``probes/memory.py``: the first HEAP_DENSE_STEPS,
    every HEAP_EVERY-th and the end of the step before one), or when it is a new peak. The
    sampler thread's readings are all written."""
    src = str(rec.get("src", ""))
    if src.partition(".")[0] not in STRIDED_PHASES:
        return True
    at = step - (src == "step")
    return new_peak or at < HEAP_DENSE_STEPS or at % HEAP_EVERY == 0 or (at + 1) % HEAP_EVERY == 0


def write_rank(args: tuple[Path, int, int, int, int]) -> int:
    """Write rank ``rank``'s stream and call file; returns their bytes."""
    out, rank, world, steps, straggler = args
    recs, ends = _records(0 if rank == 0 else 1)
    first, second = [i for i, r in enumerate(recs) if r["k"] == "step"][:2]
    prologue, block, ending = recs[: first + 1], recs[first + 1 : second + 1], recs[second + 1 :]
    t1, t2 = recs[first]["t"], recs[second]["t"]
    span = t2 - t1
    period = SLOWER * span
    per_step: dict[int, int] = {}
    for r in block:
        if r["k"] == "coll":
            per_step[r["gid"]] = per_step.get(r["gid"], 0) + 1
    pid = 100_000 + rank
    plant = max(2, steps // 3)
    # where each steady-step record, and each call's end, falls in its step, for this rank
    waited = next(r["t"] - t1 for r in block if r["k"] == "coll" and not r["async"])

    def offset(off: float, is_call: bool) -> float:
        if rank == straggler:
            return off * SLOWER
        if off > waited or (off == waited and not is_call):
            return off + period - span
        return off

    calls = _CallColumns()
    block_calls = [r for r in block if r["k"] == "coll"]
    c_start = np.array([offset(r["t"] - t1, True) for r in block_calls])
    c_end = np.array(
        [
            offset(ends[(r["gid"], r["seq"])]["t"] - t1, False) if (r["gid"], r["seq"]) in ends else -1.0
            for r in block_calls
        ]
    )
    c_seq = np.array([r["seq"] for r in block_calls], dtype=np.int64)
    c_inc = np.array([per_step[r["gid"]] for r in block_calls], dtype=np.int64)
    c_bytes = np.array([-1 if r["bytes"] is None else r["bytes"] for r in block_calls], dtype=np.int64)
    c_step = np.array([r["step"] for r in block_calls], dtype=np.int64)
    c_gid = np.array([r["gid"] for r in block_calls], dtype=np.int64)
    c_shape = np.array([calls.shape(r) for r in block_calls], dtype=np.int64)
    labels = {r["text"]: r["id"] for r in recs if r["k"] == "label"}
    step_columns = _StepColumns(labels)
    block_steps = [r for r in block if r["k"] in ("step", "phase")]
    s_offsets = np.array([offset(r["t"] - t1, False) for r in block_steps])
    mem_columns = _MemColumns(labels)
    block_mem = [r for r in block if r["k"] == "mem"]
    m_rows = mem_columns.rows(block_mem)
    m_offsets = np.array([offset(r["t"] - t1, False) for r in block_mem])
    stream = [r for r in block if r["k"] not in ("coll", "step", "phase", "mem")]
    offsets = [offset(r["t"] - t1, False) for r in stream]
    templates = [_template(r) for r in stream]
    steady = list(zip(stream, templates, offsets, strict=True))
    # the probes look at the first MAX_CALLS calls' logits only, one call a step: the
    # recording's steady step holds the last of them, its repetitions none
    later = [(r, tmpl, off) for r, tmpl, off in steady if r["k"] != "logits"]
    assert all(r["step"] + 1 >= MAX_CALLS for r, _, _ in steady if r["k"] == "logits")
    prefix = out / "ranks" / f"rank-{rank}" / f"bench-{pid}"
    path = prefix.with_name(prefix.name + ".0000.jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    written = 0

    def call(r: dict[str, Any], shift: float, steps_on: int, seqs_on: int) -> None:
        end = ends.get((r["gid"], r["seq"]))
        calls.add(
            np.array([r["t"] + shift]),
            np.array([0.0 if end is None else end["t"] + shift]),
            np.array([r["seq"] + seqs_on * per_step.get(r["gid"], 0)]),
            np.array([-1 if r["bytes"] is None else r["bytes"]]),
            np.array([r["step"] + steps_on]),
            np.array([r["gid"]]),
            np.array([calls.shape(r)]),
        )
        if end is not None and end.get("err") is not None:
            seq = r["seq"] + seqs_on * per_step.get(r["gid"], 0)
            calls.errors.append((calls.n - 1, r["gid"], seq, end["t"] + shift, end["err"]))

    with open(path, "w") as f:

        def emit(rec: dict[str, Any]) -> None:
            nonlocal written
            text = _line(rec)
            written += len(text)
            f.write(text)

        for r in prologue:
            if r["k"] in DROPPED:
                continue
            if r["k"] == "coll":
                call(r, 0.0, 0, 0)
                continue
            if r["k"] in ("step", "phase"):
                step_columns.add([r], np.array([r["t"]]), 0)
                continue
            if r["k"] == "mem":
                mem_columns.parts.append(mem_columns.rows([r]))
                continue
            r = dict(r)
            if r["k"] == "start":
                r.update(rank=rank, world_size=world, local_rank=rank % 8, pid=pid)
                emit(r)
                emit(
                    {
                        "k": "calls_file",
                        "t": r["t"],
                        "file": prefix.name + CALLS_SUFFIX,
                        "how": "mmap",
                        "head": DEFAULT_HEAD,
                        "ring": DEFAULT_RING,
                    }
                )
                emit({"k": "steps_file", "t": r["t"], "file": prefix.name + STEPS_SUFFIX, "how": "mmap"})
                emit({"k": "mem_file", "t": r["t"], "file": prefix.name + MEM_SUFFIX, "how": "mmap"})
                continue
            if r["k"] == "group":
                r["ranks"] = list(range(world))
            elif r["k"] == "dist_init":
                r.update(rank=rank, world_size=world)
            emit(r)
        for j in range(steps - 1):
            base = t1 + j * period
            chunk = []
            for r, tmpl, off in steady if j == 0 else later:
                chunk.append(
                    tmpl.format(
                        t=base + off,
                        end=base + off + r.get("end", 0) - r["t"],
                        step=r.get("step", 0) + j,
                        seq=r.get("seq", 0),
                    )
                )
            written_mem = [
                i
                for i, r in enumerate(block_mem)
                if _written_mem(r, r["step"] + j, rank == 0 and r["step"] + j == plant)
            ]
            rows = m_rows[written_mem]
            rows["t"] = base + m_offsets[written_mem]
            rows["step"] += j
            if rank == 0:
                planted = (rows["step"] >= plant) & (rows["rss"] >= 0)
                rows["rss"][planted] += EXTRA
                planted = (rows["step"] >= plant) & (rows["heap"] >= 0)
                rows["heap"][planted] += EXTRA
            mem_columns.parts.append(rows)
            text = "".join(chunk)
            written += len(text)
            f.write(text)
            step_columns.add(block_steps, base + s_offsets, j, period)
            calls.add(
                base + c_start,
                np.where(c_end < 0, 0.0, base + c_end),
                c_seq + j * c_inc,
                c_bytes,
                c_step + j,
                c_gid,
                c_shape,
            )
        shift = (steps - 2) * period + (period - span)
        for r in ending:
            if r["k"] in DROPPED:
                continue
            if r["k"] == "coll":
                call(r, shift, steps - 2, steps - 2)
                continue
            if r["k"] in ("step", "phase"):
                step_columns.add([r], np.array([r["t"] + shift]), steps - 2)
                continue
            r = dict(r)
            r["t"] += shift
            if isinstance(r.get("step"), int):
                r["step"] += steps - 2
            if r["k"] == "mem":
                if rank == 0:
                    r.update({k: r[k] + EXTRA for k in ("rss", "heap") if isinstance(r.get(k), int)})
                mem_columns.parts.append(mem_columns.rows([r]))
                continue
            emit(r)
        t0 = recs[0]["t"]
        for key, n in calls.shapes.items():
            emit({"k": "shape", "t": t0, "id": n, **dict(zip(_SHAPE_KEYS, key, strict=True))})
        for index, gid, seq, t, err in calls.errors:
            emit({"k": "coll_err", "t": t, "index": index, "gid": gid, "seq": seq, "err": err})
        for rec in calls.step_sums():
            emit({**rec, "t": t0})
    written += step_columns.write(prefix.with_name(prefix.name + STEPS_SUFFIX), t0)
    written += mem_columns.write(prefix.with_name(prefix.name + MEM_SUFFIX), t0)
    return written + calls.write(prefix.with_name(prefix.name + CALLS_SUFFIX), t0)


def write_run(out: Path, ranks: int, steps: int) -> int:
    manifest = {**json.loads((TEMPLATE / "manifest.json").read_text()), "version": FORMAT_VERSION}
    out.mkdir(parents=True)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    jobs = [(out, r, ranks, steps, ranks // 2 + 1) for r in range(ranks)]
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        return sum(pool.map(write_rank, jobs, chunksize=4))


def _cpu(procs: Sequence[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            times = p.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


def _memory(tree: Sequence[psutil.Process], proportional: bool) -> int:
    """Summed RSS of ``tree``, or summed PSS (proportional: a page shared by n processes,
    as the workers share polars' and Python's code, counts 1/n in each)."""
    total = 0
    for p in tree:
        try:
            total += p.memory_full_info().pss if proportional else p.memory_info().rss
        except psutil.Error:
            pass
    return total


def measure(
    cmd: list[str], src: Path, workers: Sequence[psutil.Process] = ()
) -> tuple[float, float, float, tuple[int, int], str]:
    """Wall seconds, CPU seconds of the command and its worker processes, CPU seconds of
    the processes of a local Dask cluster (``workers``), peak summed RSS and peak summed
    PSS of the command's process tree (bytes: RSS sampled every 50 ms, PSS every 200 ms),
    stdout. On a shared machine the wall time moves with the load; the CPU time does not.
    The machine needs the PSS: summed RSS counts the code the workers share once a worker."""
    path = os.pathsep.join(p for p in (str(src), os.environ.get("PYTHONPATH", "")) if p)  # (a --target install)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    cluster_cpu = _cpu(workers)
    cwd = tempfile.gettempdir()  # `python -m` puts the working directory first on sys.path
    with tempfile.TemporaryFile() as stdout:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.DEVNULL, env=env, cwd=cwd)
        root = psutil.Process(proc.pid)
        rss = pss = 0
        for sample in itertools.count():
            if proc.poll() is not None:
                break
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            rss = max(rss, _memory(tree, False))
            if sample % 4 == 0:
                pss = max(pss, _memory(tree, True))
            time.sleep(0.05)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        stdout.seek(0)
        return wall, cpu, _cpu(workers) - cluster_cpu, (rss, pss), stdout.read().decode()


def named(findings: list[dict[str, Any]], straggler: int) -> dict[str, bool]:
    def has(fid: str, rank: int | None) -> bool:
        return any(f["id"] == fid and (rank is None or rank in f["ranks"]) for f in findings)

    return {
        "rank0-asymmetry": has("rank0-asymmetry", 0),
        "straggler": has("straggler", straggler),
        "rank-conditional-hang": has("rank-conditional-hang", None),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="64,256,1024", help="comma-separated rank counts")
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "rundir-scale")
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    parser.add_argument("--src", type=Path, default=REPO, help="the lorascope source tree to measure (PYTHONPATH)")
    parser.add_argument("--no-write", action="store_true", help="measure run directories --keep left")
    parser.add_argument("--no-report", action="store_true", help="measure `lorascope analyze` only")
    parser.add_argument("--workers", type=int, help="`lorascope --workers N`: N reading workers (default one per core)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--cluster", metavar="ADDRESS", help="read on this Dask cluster (its workers' CPU not counted)")
    where.add_argument("--local-cluster", type=int, metavar="N", help="start a Dask cluster of N worker processes here")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    print(f"{cores} cores, load {os.getloadavg()[0]:.1f}; template {TEMPLATE.relative_to(REPO)}; {args.steps} steps")
    workers: list[psutil.Process] = []
    extra: list[str] = []
    local = None
    if args.local_cluster:
        from distributed import LocalCluster

        local = LocalCluster(  # type: ignore[no-untyped-call]
            n_workers=args.local_cluster, threads_per_worker=1, processes=True, dashboard_address=None
        )
        args.cluster = local.scheduler_address
        workers = psutil.Process().children(recursive=True)
    if args.cluster:
        extra = ["--cluster", args.cluster]
        print(f"on the Dask cluster at {args.cluster}" + ("" if local else " (its workers' CPU is not counted)"))
    for ranks in (int(n) for n in args.ranks.split(",")):
        out = args.dir / f"{ranks}x{args.steps}"
        start = time.perf_counter()
        if not args.no_write:
            shutil.rmtree(out, ignore_errors=True)
            write_run(out, ranks, args.steps)
        wrote = time.perf_counter() - start
        size = sum(p.stat().st_size for p in (out / "ranks").rglob("*.jsonl")) + sum(
            min(p.stat().st_size, p.stat().st_blocks * 512)
            for suffix in (CALLS_SUFFIX, STEPS_SUFFIX)
            for p in (out / "ranks").rglob("*" + suffix)
        )
        lorascope = [sys.executable, "-m", "lorascope", *(["--workers", str(args.workers)] if args.workers else [])]
        a_wall, a_here, a_dask, a_peak, text = measure(
            [*lorascope, "analyze", "--json", str(out), *extra], args.src, workers
        )
        a_cpu = a_here + a_dask
        findings = json.loads(text)["findings"] if text.strip() else []
        html = out.parent / f"{out.name}.html"
        report = [*lorascope, "report", str(out), "-o", str(html), *extra]
        r_wall, r_here, r_dask, r_peak, _ = (
            (0.0, 0.0, 0.0, (0, 0), "") if args.no_report else measure(report, args.src, workers)
        )
        r_cpu = r_here + r_dask
        split = "(here {:.1f}, Dask workers {:.1f}) ".format

        def peak(rss_pss: tuple[int, int]) -> str:
            return "RSS {:.2f} GiB, PSS {:.2f} GiB".format(*(n / 2**30 for n in rss_pss))

        page = html.stat().st_size if html.exists() else 0
        html.unlink(missing_ok=True)
        mb = size / 1e6
        print(
            f"{ranks} ranks x {args.steps} steps: {mb:,.0f} MB of streams and call files (written in {wrote:.0f} s)\n"
            f"  analyze: {a_wall:.1f} s wall, {a_cpu:.1f} s CPU {split(a_here, a_dask) if local else ''}"
            f"peak {peak(a_peak)}; "
            f"{mb / a_wall:.1f} MB/s, {mb / a_cpu:.1f} MB per CPU-second\n"
            f"  report:  {r_wall:.1f} s wall, {r_cpu:.1f} s CPU {split(r_here, r_dask) if local else ''}"
            f"peak {peak(r_peak)}, page {page / 1e6:.1f} MB\n"
            f"  named: {named(findings, ranks // 2 + 1)}; findings: {[(f['id'], f['ranks'][:4]) for f in findings]}",
            flush=True,
        )
        if args.steps != GOAL_STEPS:
            # A stream's bytes grow with its steps, and the reading with the bytes (issue 13): a
            # run this machine's disk cannot hold, told from one it can, on the same machine
            # (its prologue, ~0.1 MB a rank, is ~1% of 1,000 steps: the projection errs high).
            times = GOAL_STEPS / args.steps
            print(
                f"  at {GOAL_STEPS:,} steps, linear in bytes read: ~{mb * times / 1e3:,.1f} GB; analyze ~{a_wall * times:.0f} s "
                f"wall ({a_cpu * times:.0f} CPU-s)"
                + ("" if args.no_report else f", report ~{r_wall * times:.0f} s wall"),
                flush=True,
            )
        if not args.keep:
            shutil.rmtree(out)
    if local is not None:
        local.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
