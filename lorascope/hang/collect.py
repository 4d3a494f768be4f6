"""Taking evidence from live ranks once they were asked (:mod:`lorascope.hang.ask`): a
bounded wait for their dumps, each rank read as it answers, and py-spy for local ranks
that do not answer (stuck in C code holding the GIL, dumps turned off, or a job not
started under `lorascope run`); the ranks that do not answer are named with their host,
their last record's age and, on this host, their process state."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Hashable, Mapping
from pathlib import Path
from typing import Any

from lorascope.detect.hang.diagnosis import pending_calls
from lorascope.errors import BadInputError
from lorascope.hang.alike import READ_ALIKE, answer_key, answer_record, stand_in
from lorascope.hang.ask import Asked, Grown, Process
from lorascope.hang.procstate import STOPPED, describe_state, process_state
from lorascope.rundir.format.safe_open import open_regular
from lorascope.rundir.format.schema import STREAM_SUFFIX
from lorascope.rundir.loading.cluster import Cluster
from lorascope.rundir.loading.reader import (
    RECENT_RECORDS,
    Job,
    RankData,
    RunData,
    list_run,
    load_run,
    no_cycle_collection,
)
from lorascope.rundir.loading.records import DumpRecord, StartRecord
from lorascope.units import rank_ranges

POLL_S = 0.2
PY_SPY_TIMEOUT_S = 20.0
#: What is read of a stream file's growth since the dump signal, at most (a dump record
#: holds every thread's stack: tens of KB; the sampler adds a record every 0.5 s).
MAX_TAIL_BYTES = 64 << 20
#: Seconds a dump's flight-recorder dump is waited for, at most, once the dump is in (a
#: process without torch.distributed writes none).
FLIGHT_GRACE_S = 2.0


def wait_for_dumps(
    run_dir: Path,
    ends: dict[Process, Grown],
    asked: Asked,
    wait_s: float,
    cluster: Cluster | None = None,
    each: Callable[[RankData], None] | None = None,
    starts: Mapping[Process, StartRecord] | None = None,
) -> tuple[RunData, list[int]]:
    """Wait until every process of ``ends`` (:func:`stream_ends`) wrote a dump that
    answers ``asked``, or ``wait_s`` passes, and read the run's recent past (the newest
    RECENT_RECORDS records of each slot file: a hang's evidence is at the end of a run,
    and a long run's files hold millions); returns it and the ranks
    whose process was asked and did not answer. The wait reads only what the processes
    wrote since the request: reading a large run again on every poll took longer than the
    wait itself, and a rank read in the first instant, before its dump was flushed, was
    then reported silent. Each process is read once it answered (its dump, then its
    flight-recorder dump), while the others are still waited for (``each`` is called with
    it); with ``starts`` (each process's start record), ranks whose answers agree are read
    a few at a time (:mod:`lorascope.hang.alike`). On ``cluster``, the run is read once, by
    its workers, after the wait (``each`` is not called)."""
    deadline = time.time() + wait_s
    if cluster is not None:
        _until_answered(dict(ends), asked, deadline)
        run = load_run(run_dir, cluster=cluster, newest=RECENT_RECORDS)
    else:
        with no_cycle_collection():  # each collection would walk every rank read so far
            run = _read_each(run_dir, ends, asked, deadline, each or (lambda _: None), starts or {})
    silent = [
        n
        for n, rank in run.ranks.items()
        if (rank.host, rank.pid) in ends and not any(asked.answered_by(d, (rank.host, rank.pid)) for d in rank.dumps)
    ]
    return run, silent


def _read_each(
    run_dir: Path,
    ends: dict[Process, Grown],
    asked: Asked,
    deadline: float,
    each: Callable[[RankData], None],
    starts: Mapping[Process, StartRecord],
) -> RunData:
    """The run, each process read as soon as it answered (the processes not asked first,
    those that did not answer at the deadline last), or told by an alike rank's records."""
    listing = list_run(run_dir, newest=RECENT_RECORDS)
    read: dict[str, tuple[Job, tuple[RankData, list[str]]]] = {}  # by rank folder/process
    alike: dict[Hashable, list[str]] = {}  # an answer's key -> the processes read whole with it
    told: dict[str, tuple[Job, Hashable, StartRecord, DumpRecord]] = {}

    def take(rank_dir: Path, process: str, grown: Grown | None = None, key: Process | None = None) -> None:
        job = listing.job(rank_dir, process)
        if job is None:
            return
        name = f"{rank_dir.name}/{process}"
        told_as = _told_as(job, grown, starts.get(key) if key is not None else None)
        if told_as is not None:
            if len(alike.get(told_as[0], ())) >= READ_ALIKE:
                told[name] = job, *told_as
                return
            alike.setdefault(told_as[0], []).append(name)
        read[name] = job, listing.read(job)
        each(read[name][1][0])

    asked_for = {f"{g.prefix.parent.name}/{g.prefix.name}" for g in ends.values()}
    for job in listing.jobs():
        folder, process = job[1][0][1].parent, _process_of(job[1][0][1])
        if f"{folder.name}/{process}" not in asked_for:
            take(folder, process)
    waiting = dict(ends)
    dumped: dict[Process, float] = {}  # answered: when its dump was seen
    while waiting and time.time() < deadline:
        now = time.time()
        ready = []
        for key, grown in waiting.items():
            kinds = _answers(grown, asked, key)
            if "dump" in kinds and key not in dumped:
                dumped[key] = now
            # its flight-recorder dump follows its dump: a moment more for it (a process
            # without torch.distributed writes none), as long as the wait lasts
            if "dump" in kinds and ("flight_dump" in kinds or now >= dumped[key] + FLIGHT_GRACE_S):
                ready.append(key)
        for key in ready:
            grown = waiting.pop(key)
            take(grown.prefix.parent, grown.prefix.name, grown, key)
        if waiting and not ready:
            time.sleep(POLL_S)
    for key, grown in waiting.items():  # no answer (read whole), or no flight-recorder dump yet
        take(grown.prefix.parent, grown.prefix.name, grown, key)
    for name, (job, found, start, answer) in told.items():
        read[name] = job, (stand_in(read[alike[found][0]][1][0], job.rank, start, answer), [])
    jobs, results = [], []
    for job in listing.jobs():  # in the listing's order, as load_run reads them
        done = read.get(f"{job[1][0][1].parent.name}/{_process_of(job[1][0][1])}")
        if done is not None:
            jobs.append(done[0])
            results.append(done[1])
    return listing.assemble(jobs, results)


def _told_as(
    job: Job, grown: Grown | None, start: StartRecord | None
) -> tuple[Hashable, StartRecord, DumpRecord] | None:
    """What an alike rank's records may tell a process by: its answer's key, its start
    record, its answer; None when it is read whole (no answer, one without ``made``, a
    start record of another rank)."""
    if grown is None or grown.answer is None or start is None or start.get("rank") != job.rank:
        return None
    answer = answer_record(grown.answer)
    found = answer_key(answer) if answer is not None else None
    return None if found is None or answer is None else (found, start, answer)


def _process_of(segment: Path) -> str:
    """The process (``HOST-PID``) a stream segment file belongs to."""
    return segment.name[: -len(STREAM_SUFFIX)].rpartition(".")[0]


def _until_answered(files: dict[Process, Grown], asked: Asked, until: float) -> None:
    """Poll until every process's files hold a dump answering ``asked`` and a flight-recorder
    dump after it (for that, FLIGHT_GRACE_S at most once the dumps are in), or ``until``."""
    waiting = files
    while waiting and time.time() < until:
        waiting = {key: grown for key, grown in waiting.items() if "dump" not in _answers(grown, asked, key)}
        if waiting:
            time.sleep(POLL_S)
    flights = {key: grown for key, grown in files.items() if key not in waiting}
    until = min(until, time.time() + FLIGHT_GRACE_S)
    while flights and time.time() < until:
        flights = {key: grown for key, grown in flights.items() if "flight_dump" not in _answers(grown, asked, key)}
        if flights:
            time.sleep(POLL_S)


def _answers(files: Grown, asked: Asked, process: Process) -> set[str]:
    """What one process's files gained past their ends (at most MAX_TAIL_BYTES of each),
    a segment begun since included: "dump" for a dump answering ``asked``, "flight_dump"
    for a flight-recorder dump's record."""
    found = files.found
    for path in files.segments():
        try:
            # opened, not only stat'ed: on NFS an open revalidates the size a stat may cache
            with open_regular(path, inside=path.parent) as f:
                size = os.fstat(f.fileno()).st_size
                if files.looked.get(path) == size:  # nothing new since it was last read
                    continue
                files.looked[path] = size
                f.seek(files.ends.get(path, 0))
                tail = f.read(MAX_TAIL_BYTES)
        except (OSError, BadInputError):
            continue
        for line in tail.split(b"\n"):
            for kind in ("dump", "flight_dump"):
                if f'"k":"{kind}"'.encode() in line or f'"k": "{kind}"'.encode() in line:
                    try:
                        record = json.loads(line)
                        if kind != "dump" or asked.answered_by(record, process):
                            found.add(kind)
                            if kind == "dump" and isinstance(record, dict):
                                files.answer = record
                    except (ValueError, KeyError, TypeError, RecursionError, AttributeError):
                        continue
    return found


def py_spy_dump(pid: int) -> str:
    """Every thread's stack of ``pid``, read from outside (ptrace) with ``py-spy dump
    --json``, native frames included where py-spy can unwind them (a rank blocked inside
    NCCL shows where), written as the probes write a thread dump; raises BadInputError when
    py-spy is missing or cannot read the process (one line: py-spy's own message and the
    process's state)."""
    exe = shutil.which("py-spy")
    if exe is None:
        raise BadInputError("py-spy is not installed (pip install py-spy): cannot read a silent rank's stacks")
    res = _py_spy(exe, pid, "--native")
    if res.returncode != 0:  # no native unwinding for this process or platform
        res = _py_spy(exe, pid)
    if res.returncode != 0:
        state = describe_state(process_state(pid)) or f"process {process_state(pid)}"
        raise BadInputError(f"py-spy could not read pid {pid}: {py_spy_message(res.stderr)} ({state})")
    try:
        threads = json.loads(res.stdout)
    except ValueError:
        raise BadInputError(f"py-spy dump --pid {pid} --json printed no JSON") from None
    if not isinstance(threads, list):
        raise BadInputError(f"py-spy dump --pid {pid} --json: not a list of threads")
    return stacks_text([t for t in threads if isinstance(t, dict)])


def py_spy_message(stderr: str) -> str:
    """py-spy's own message from its stderr (``Error: Failed to get stack traces``), not
    the last line of the Rust backtrace that may follow it (``9: main``)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for line in lines:
        if line.startswith("Error:"):
            return line.removeprefix("Error:").strip()[:300]
    plain = [line for line in lines if not line[:1].isdigit() and not line.startswith(("Stack backtrace", "at "))]
    return (plain or ["no message"])[0][:300]


def _py_spy(exe: str, pid: int, *extra: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            [exe, "dump", "--pid", str(pid), "--json", *extra], capture_output=True, text=True, timeout=PY_SPY_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        raise BadInputError(f"py-spy dump --pid {pid} took over {PY_SPY_TIMEOUT_S:.0f} s") from None


def stacks_text(threads: list[dict[str, Any]]) -> str:
    """py-spy's JSON threads (frames innermost first) as the probes' thread dump: a
    ``Thread NAME:`` line, then each frame outermost first as a traceback line; native
    frames (a shared object's function) as ``[native] FUNC (LIB)`` lines."""
    parts = []
    for thread in threads:
        name = thread.get("thread_name")
        if not name and thread.get("os_thread_id") is not None and thread.get("os_thread_id") == thread.get("pid"):
            name = "MainThread"  # with --native py-spy may not name threads; the main one's id is the pid's
        lines = [f"Thread {name or thread.get('thread_id')}:"]
        for frame in reversed([f for f in thread.get("frames") or [] if isinstance(f, dict)]):
            if frame.get("module"):
                lines.append(f"  [native] {frame.get('name')} ({frame.get('short_filename')})")
            else:
                lines.append(f'  File "{frame.get("filename")}", line {frame.get("line")}, in {frame.get("name")}')
        parts.append("\n".join(lines))
    return "\n".join(parts) + "\n"


def read_silent_ranks(
    run: RunData, silent: list[int], asked: Asked, wait_s: float
) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """The ranks that did not answer: each with its host, local rank and last record's
    age; on this host, its process's state and its stacks read from outside with py-spy
    (added to the run as ``dump`` records), unless the state says py-spy cannot (stopped,
    a zombie, gone). Returns an entry per rank and the process states of this host's."""
    entries: list[dict[str, Any]] = []
    states: dict[int, str] = {}
    now = time.time()
    for n in silent:
        rank = run.ranks[n]
        local = (rank.host, rank.pid) in asked.signalled
        entry: dict[str, Any] = {
            "rank": n,
            "host": rank.host,
            "local_rank": rank.start.get("local_rank"),
            "last_record_age_s": round(now - rank.last_time, 1) if rank.last_time else None,
            "process": None,
            "py_spy": None,
        }
        entries.append(entry)
        if not local:
            continue
        state = states[n] = process_state(rank.pid)
        entry["process"] = describe_state(state) or state
        if state in STOPPED or state in ("zombie", "dead", "gone"):
            continue
        try:
            stacks = py_spy_dump(rank.pid)
        except BadInputError as exc:
            entry["py_spy"] = str(exc)
            continue
        entry["py_spy"] = "stacks read"
        rank.dumps.append(
            {
                "k": "dump",
                "t": time.time(),
                "reason": "py-spy",
                "step": 0,
                "stacks": stacks,
                "pending": pending_calls(rank),
            }
        )
    return entries, states


def silent_notes(entries: list[dict[str, Any]], wait_s: float) -> list[str]:
    """A line per rank that did not answer, or per alike kind (same state, same py-spy
    outcome) from MIN_ALIKE_RANKS ranks on, bounded: 1,024 silent ranks are a few lines."""
    kinds: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for e in entries:
        kinds.setdefault((e["process"] is None, e["process"], e["py_spy"]), []).append(e)
    notes = []
    for (remote, process, spy), alike in kinds.items():
        what = _silence(remote, process, spy)
        if len(alike) < MIN_ALIKE:
            for e in alike:
                notes.append(f"rank {e['rank']} ({_place(e)}) did not answer in {wait_s:g} s: {_age(e)}{what}")
        else:
            hosts = sorted({str(e["host"]) for e in alike})
            on = f"on {len(hosts):,} hosts" if len(hosts) > 3 else "on " + ", ".join(hosts)
            ages = [e["last_record_age_s"] for e in alike if e["last_record_age_s"] is not None]
            age = f"last records {min(ages):,.1f}-{max(ages):,.1f} s old" if ages else "no records"
            notes.append(
                f"ranks {rank_ranges(e['rank'] for e in alike)} ({len(alike):,} ranks {on}) "
                f"did not answer in {wait_s:g} s: {age}{what}"
            )
    return notes


#: From this many ranks on, ranks that did not answer alike are one note.
MIN_ALIKE = 3


def _place(e: dict[str, Any]) -> str:
    local = e.get("local_rank")
    return f"host {e['host']}" + (f", local rank {local}" if isinstance(local, int) else "")


def _age(e: dict[str, Any]) -> str:
    age = e["last_record_age_s"]
    return "no records" if age is None else f"last record {age:,.1f} s old"


def _silence(remote: bool, process: str | None, spy: str | None) -> str:
    if remote:
        return " (another host: its probe thread never wrote a dump; the process may be gone, or stuck holding the GIL)"
    out = f"; its process is {process}"
    if spy == "stacks read":
        return out + "; stacks read with py-spy"
    return out + (f"; {spy}" if spy else "")
