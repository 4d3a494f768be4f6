"""Format v3 of the run directory: names, record kinds and their required fields.

Every per-rank process writes a JSON Lines stream, a binary call file, a binary steps
file and a binary memory file. Every stream
record is an object with ``k`` (its kind) and ``t`` (wall-clock seconds since the epoch).
The fields each kind must carry are listed in :data:`RECORD_FIELDS`; extra fields are
allowed (readers ignore what they do not know), unknown kinds are skipped with a warning.
A change that breaks this bumps FORMAT_VERSION.

v3 (over v2): collective calls are no longer stream records but fixed-width records of
the call file (``HOST-PID.calls``; layout: :mod:`lorascope.rundir.format.layout`), each
naming its ``shape`` record (op, dtype, async, site, via) by id; a call's error is
a ``coll_err`` record. Steps and phase edges are fixed-width records of the steps file
(``HOST-PID.steps``), each naming its phase or source by a ``label`` record's id; memory
readings of the memory file (``HOST-PID.mem``), each naming where it was read the same way,
a sampler's NVML part an ``nvml`` record. A reader of v3 refuses v2 and v1 run directories.
"""

from __future__ import annotations

import signal
from typing import Any

FORMAT_NAME = "lorascope-run"
FORMAT_VERSION = 3

MANIFEST_FILE = "manifest.json"
RANKS_DIR = "ranks"
BOOTSTRAP_DIR = "bootstrap"
#: In BOOTSTRAP_DIR: one JSON line per Python process that loaded the bootstrap, and
#: what it decided to be (rank, lone, launcher, child).
PROCESSES_LOG = "processes.jsonl"
STREAM_SUFFIX = ".jsonl"
#: A rank process's call file, beside its stream: ``HOST-PID.calls`` (layout.py).
CALLS_SUFFIX = ".calls"
#: Its calls of the steps kept whole past the call file's ring (an eval or a save, a
#: failed call, a stall, a slow step), in the same layout: ``HOST-PID.kept-calls``.
KEPT_CALLS_SUFFIX = ".kept-calls"
#: Its steps' ends and phase edges, fixed-width records (layout.py): ``HOST-PID.steps``.
STEPS_SUFFIX = ".steps"
#: Its memory readings, fixed-width records (layout.py): ``HOST-PID.mem``.
MEM_SUFFIX = ".mem"
#: A rank process's faulthandler file, beside its stream: ``HOST-PID.fatal.txt``.
FATAL_SUFFIX = ".fatal.txt"
#: What `lorascope hang` sends a rank for an on-demand dump (a ``dump`` record): SIGURG,
#: whose default action is to ignore it (see lorascope.probes.dumps).
DUMP_SIGNAL = signal.SIGURG
#: In the run directory: `lorascope hang`'s dump request (one JSON line, ``{"id": ..., "t": ...}``),
#: which every rank's probe thread looks at once a second, on whatever host it runs.
DUMP_REQUEST = "dump-request.json"
#: The steps the probes take to settle: through them a CPU rank reads the C heap at every
#: phase edge (``probes/memory.py``). A ``cost`` record is written at the last one's end, and the reader measures a step's cost from there (the
#: first ``cost`` record at or past it that a later one follows), not from the first step.
WARM_UP_STEPS = 20

_INT = (int,)
_NUM = (int, float)
_STR = (str,)
_OPT_INT = (int, type(None))
_OPT_NUM = (int, float, type(None))
_OPT_STR = (str, type(None))

#: A call's shape: what a call shares with the same call at every step.
SHAPE_FIELDS: dict[str, tuple[type, ...]] = {
    "op": _STR,
    "dtype": _OPT_STR,
    "async": (bool,),
    "site": _OPT_STR,
    "via": _OPT_STR,
}

#: kind -> {field: accepted types}. ``bool`` is rejected where an int is required.
RECORD_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "start": {
        "rank": _INT,
        "world_size": _INT,
        "local_rank": _INT,
        "pid": _INT,
        "host": _STR,
        "argv": (list,),
        "versions": (dict,),
        "device": _STR,
    },
    "segment": {"index": _INT},
    "dist_init": {"rank": _INT, "world_size": _INT},
    "config": {"name": _STR, "value": (dict,)},
    "loss": {"step": _INT, "loss": _OPT_NUM},
    "group": {"gid": _INT, "name": _STR, "ranks": (list, type(None)), "backend": _OPT_STR},
    #: A call shape, declared before the first call record that names it by ``id``
    #: (again at the head of each later segment: a segment may be rotated away).
    "shape": {"id": _INT, **SHAPE_FIELDS},
    #: The call file this process writes its calls to, and how (``mmap``, or ``pwrite
    #: (why)`` where a shared mapping could not be had); its head and ring sizes.
    "calls_file": {"file": _STR, "how": _STR, "head": _INT, "ring": _INT},
    "steps_file": {"file": _STR, "how": _STR},
    "label": {"id": _INT, "text": _STR},
    "mem_file": {"file": _STR, "how": _STR},
    #: NVML's part of the memory file's reading of index ``i`` (the sampler's, on CUDA).
    "nvml": {"i": _INT, "nvml": (dict,)},
    #: A step's calls the call file's ring overwrites, summed per group and op:
    #: ``groups`` holds ``[gid, op, calls, bytes, ms in them, longest ms, not ended]``.
    "calls_step": {"step": _INT, "groups": (list,)},
    #: The call at ``index`` of the call file (of group ``gid``, number ``seq``: how its
    #: copy in the kept-calls file is found once the ring overwrote it) failed: what it raised.
    "coll_err": {"index": _INT, "gid": _INT, "seq": _INT, "err": _STR},
    "site": {"site": _STR, "line": _OPT_STR, "conditions": (list,)},
    "coll_unseen": {"path": _STR, "why": _STR},
    "fatal_handler": {"file": _STR},
    "coll_dev": {"seq": _INT, "gid": _INT, "ms": _NUM},
    "warning": {"category": _STR, "message": _STR, "filename": _STR, "lineno": _INT},
    "exception": {"type": _STR, "message": _STR, "traceback": _STR},
    "signal": {"signum": _INT, "name": _STR},
    "grad_setup": {"step": _INT, "checkpointing": (dict,), "input_require_grads_hooks": _INT},
    "grads": {"step": _INT, "names": (list,), "status": _STR, "scope": _STR},
    "logits": {"where": _STR, "step": _INT, "shape": (list,), "dtype": _STR, "bytes": _INT},
    "trace_window": {"edge": _STR, "step": _INT},
    "flight_dump": {"file": _STR, "reason": _STR, "bytes": _INT},
    "memory_history": {"on": (bool,), "reason": _OPT_STR},
    "history": {"on": (bool,), "why": _OPT_STR, "step": _INT, "src": _STR},
    "snapshot": {"file": _STR, "reason": _STR, "bytes": _INT},
    "dump": {"reason": _STR, "step": _INT, "stacks": _STR, "pending": (list,)},
    "stall": {"seconds": _NUM, "limit": _NUM, "step": _INT},
    #: An entry into (op "enter") or exit from ZeRO-3's parameter state from the job's
    #: code (``what``: "GatheredParameters"), with ``site``/``via`` as a collective's.
    "zero_param": {"what": _STR, "op": _STR, "step": _INT},
    "probe_error": {"probe": _STR, "error": _STR},
    #: What the probes cost the job so far (cumulative): time in probe code on the job's
    #: threads, its parts (collective calls, new call sites described, the C heap readings, the kernel trace window), the CPU time of the
    #: probes' own threads.
    "cost": {
        "step": _INT,
        "job_ms": _NUM,
        "calls_ms": _NUM,
        "calls": _INT,
        "sites_ms": _NUM,
        "sites": _INT,
        "heap_ms": _NUM,
        "heap_reads": _INT,
        "trace_ms": _NUM,
        "threads_cpu_ms": (dict,),
    },
    "dropped": {"records": _INT},
    "end": {"status": _STR, "code": _OPT_INT},
}

#: Ways a rank can end, as the ``end`` record's ``status`` says.
END_STATUSES = ("exit", "exception", "signal", "detached")

LAUNCH_FIELDS: dict[str, tuple[type, ...]] = {
    "id": _STR,
    "host": _STR,
    "pid": _INT,
    "command": (list,),
    "cwd": _STR,
    "start": _NUM,
    "end": _OPT_NUM,
    "exit_status": _OPT_INT,
}


#: Integers in records are 64-bit (times, sizes, counts); a larger one is corrupt.
MAX_INT = (1 << 63) - 1
#: Ranks in one job, at most (a start record's world_size sizes allocations).
MAX_WORLD_SIZE = 1 << 20


_ABSENT = object()


class SchemaError(ValueError):
    """A record or manifest that does not follow the format."""


def _check_fields(obj: dict[str, Any], fields: dict[str, tuple[type, ...]], what: str) -> None:
    for name, types in fields.items():
        value = obj.get(name, _ABSENT)
        kind = type(value)
        if kind in types and (kind is not int or -MAX_INT <= value <= MAX_INT):
            continue  # the common case, decided by the exact type (the checks below say why not)
        if name not in obj:
            raise SchemaError(f"{what} lacks the field {name!r}")
        value = obj[name]
        if isinstance(value, bool) and bool not in types:
            raise SchemaError(f"{what} field {name!r} is a bool, expected {_names(types)}")
        if not isinstance(value, types):
            raise SchemaError(f"{what} field {name!r} is {type(value).__name__}, expected {_names(types)}")
        if isinstance(value, int) and not -MAX_INT <= value <= MAX_INT:
            raise SchemaError(f"{what} field {name!r} is out of range ({str(value)[:20]}...)")


def _names(types: tuple[type, ...]) -> str:
    return " or ".join("null" if t is type(None) else t.__name__ for t in types)


def validate_record(rec: Any) -> bool:
    """Check one stream record. Returns False for a well-formed record of an unknown kind."""
    if not isinstance(rec, dict):
        raise SchemaError(f"a record is a JSON {type(rec).__name__}, expected an object")
    kind = rec.get("k")
    if not isinstance(kind, str):
        raise SchemaError("a record lacks its kind 'k'")
    t = rec.get("t")
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        raise SchemaError(f"a {kind!r} record lacks its time 't'")
    if not -MAX_INT <= t <= MAX_INT or t != t:
        raise SchemaError(f"a {kind!r} record has a time 't' out of range ({str(t)[:20]})")
    fields = RECORD_FIELDS.get(kind)
    if fields is None:
        return False
    _check_fields(rec, fields, f"a {kind!r} record")
    if kind == "start" and not (1 <= rec["world_size"] <= MAX_WORLD_SIZE and 0 <= rec["rank"] < MAX_WORLD_SIZE):
        raise SchemaError(
            f"a 'start' record says rank {rec['rank']} of world size {rec['world_size']} "
            f"(at most {MAX_WORLD_SIZE:,} ranks)"
        )
    if kind == "end" and rec["status"] not in END_STATUSES:
        raise SchemaError(f"an 'end' record has status {rec['status']!r}, expected one of {END_STATUSES}")
    return True


def validate_manifest(manifest: Any) -> None:
    """Check manifest.json; a newer format version is its own error (FormatVersionError)."""
    if not isinstance(manifest, dict):
        raise SchemaError("manifest.json is not a JSON object")
    if manifest.get("format") != FORMAT_NAME:
        raise SchemaError(f"manifest.json is not a lorascope run manifest (format={manifest.get('format')!r})")
    version = manifest.get("version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise SchemaError("manifest.json has no integer 'version'")
    launches = manifest.get("launches")
    if not isinstance(launches, list):
        raise SchemaError("manifest.json has no 'launches' list")
    for i, launch in enumerate(launches):
        if not isinstance(launch, dict):
            raise SchemaError(f"manifest.json launch #{i} is not an object")
        _check_fields(launch, LAUNCH_FIELDS, f"manifest.json launch #{i}")
