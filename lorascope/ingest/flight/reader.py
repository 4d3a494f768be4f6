"""Flight-recorder dumps: torch's record of each rank's last collectives, per process group.

Written by torch on a watchdog timeout (NCCL, ``TORCH_NCCL_TRACE_BUFFER_SIZE``) or on
request (``torch._C._distributed_c10d._dump_fr_trace()``, gloo included), as a pickle of
plain data, or JSON (``_dump_fr_trace_json``). Read here without torch.

Facts the reader relies on (torch 2.13, see DESIGN.md): on gloo every entry's ``state``
reads "scheduled" even when done, so completion comes from ``pg_status``
(``last_completed_collective``) and ``retired``; ``pg_config`` may be keyed by ""
while the entries name their group ``('0', 'default_pg')``; ``last_started_collective``
is -1 when the backend does not track starts. The dump does not say which rank wrote
it: the rank comes from the file name (torch names dumps ``<prefix><rank>``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorascope.errors import BadInputError
from lorascope.ingest.frames import LORASCOPE_FILE, TORCH_FILE, frame_label, is_python_frame
from lorascope.rundir.format.safe_open import loads_json, open_regular, read_capped
from lorascope.rundir.format.safe_pickle import load_pickle

#: Frames kept per entry (innermost first, Python frames only).
MAX_FRAMES = 12


#: Rooted calls whose tensors on one side exist on the root only.
_ROOT_ONLY_SIDE = {"gather": "output", "scatter": "input"}


@dataclass
class FlightEntry:
    """One collective (or p2p op) as one rank's flight recorder saw it."""

    record_id: int | None
    #: Process-group name (``process_group[0]``, else the ``pg_id``) and description.
    group: str
    group_desc: str
    #: ``collective_seq_id``: the n-th collective of this group on this rank (p2p ops
    #: carry the last collective's number; see ``p2p_seq``).
    seq: int | None
    p2p_seq: int | None
    is_p2p: bool
    #: The op without the backend prefix ("all_reduce", "barrier", "send 0->1", ...).
    op: str
    backend: str | None
    input_sizes: list[Any]
    output_sizes: list[Any]
    input_dtypes: list[str]
    output_dtypes: list[str]
    #: As recorded ("scheduled", "started", "completed"); gloo never moves it on.
    state: str
    retired: bool
    #: Whether the rank finished it: state "completed", or at/below the group's
    #: ``last_completed_collective``.
    completed: bool
    #: Python frames, innermost first ("file.py:line in func").
    frames: list[str]
    time_created_ns: int | None
    timeout_ms: int | None
    duration_ms: float | None

    def signature(self) -> tuple[Any, ...]:
        """What every rank must agree on for the same collective: (op, sizes, dtypes) of
        the sides every rank holds. A gather's outputs and a scatter's inputs are the
        root's only (the recorder lists none on the other ranks): left out (on the GPU
        check's run every gather read as a size mismatch)."""
        root_only = _ROOT_ONLY_SIDE.get(self.op)
        ins = (_plain(self.input_sizes), tuple(self.input_dtypes)) if root_only != "input" else ((), ())
        outs = (_plain(self.output_sizes), tuple(self.output_dtypes)) if root_only != "output" else ((), ())
        return self.op, (ins[0], outs[0]), (ins[1], outs[1])


@dataclass
class GroupStatus:
    """A group's progress on one rank (None where the dump does not say)."""

    last_enqueued: int | None
    last_started: int | None
    last_completed: int | None


@dataclass
class FlightDump:
    """One rank's flight-recorder dump."""

    path: Path
    rank: int | None
    version: str | None
    #: group name -> ranks of that group (from ``pg_config``; None when unknown).
    group_ranks: dict[str, list[int] | None]
    group_desc: dict[str, str]
    status: dict[str, GroupStatus]
    entries: list[FlightEntry]
    backends: list[str]
    warnings: list[str] = field(default_factory=list)


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    return value


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def load_flight_data(path: Path, inside: Path | None = None) -> Any:
    """The raw dump: pickle (safely) or JSON, gzipped or not (JSON read up to the JSON
    size limit). INSIDE: a folder it must not leave (``safe_open.open_regular``)."""
    with open_regular(path, inside) as f:
        head = f.read(2)
    if head[:1] == b"\x80":
        return load_pickle(path, inside=inside)
    data = read_capped(path, "json_bytes", "the dump (decompressed)", inside)
    if data[:1] == b"\x80":
        raise BadInputError(f"{path}: a gzipped pickle; unzip it first")
    return loads_json(data, path, "the dump (neither a pickle nor JSON)")


def read_flight_dump(path: Path, rank: int | None = None, inside: Path | None = None) -> FlightDump:
    """Load one dump file. BadInputError when it is not a flight-recorder dump."""
    return parse_flight_dump(load_flight_data(path, inside), path, rank)


def parse_flight_dump(data: Any, path: Path, rank: int | None = None) -> FlightDump:
    if not isinstance(data, Mapping) or not isinstance(data.get("entries"), (list, tuple)):
        found = sorted(map(str, data))[:6] if isinstance(data, Mapping) else type(data).__name__
        raise BadInputError(f"{path}: not a flight-recorder dump (no 'entries' list; found {found})")
    warnings: list[str] = []
    group_ranks, group_desc = _groups(data.get("pg_config"), warnings)
    status = _status(data.get("pg_status"))
    raw_entries = [e for e in data["entries"] if isinstance(e, Mapping)]
    if len(raw_entries) != len(data["entries"]):
        warnings.append(f"{len(data['entries']) - len(raw_entries)} entries are not objects: skipped")
    labels: dict[int, str | None] = {}  # torch's pickle shares each frame among the entries that hold it
    entries = [_entry(e, labels) for e in raw_entries]
    _reconcile_group_names(entries, group_ranks, group_desc, status)
    for e in entries:
        st = status.get(e.group)
        done = st.last_completed if st is not None else None
        if not e.completed and done is not None and e.seq is not None and not e.is_p2p and e.seq <= done:
            e.completed = True
    version = data.get("version")
    return FlightDump(
        path=path,
        rank=rank,
        version=str(version) if version is not None else None,
        group_ranks=group_ranks,
        group_desc=group_desc,
        status=status,
        entries=entries,
        backends=sorted({e.backend for e in entries if e.backend}),
        warnings=warnings,
    )


def _ranks(value: Any) -> list[int] | None:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if isinstance(value, (list, tuple)) and all(_int(v) is not None for v in value):
        return [int(v) for v in value]
    return None


def _groups(config: Any, warnings: list[str]) -> tuple[dict[str, list[int] | None], dict[str, str]]:
    ranks: dict[str, list[int] | None] = {}
    desc: dict[str, str] = {}
    if isinstance(config, Mapping):
        for key, value in config.items():
            if not isinstance(value, Mapping):
                continue
            name = str(value.get("name") or key)
            ranks[name] = _ranks(value.get("ranks"))
            desc[name] = str(value.get("desc") or "")
    elif config is not None:
        warnings.append(f"'pg_config' is a {type(config).__name__}: group ranks unknown")
    return ranks, desc


def _status(raw: Any) -> dict[str, GroupStatus]:
    out: dict[str, GroupStatus] = {}
    if not isinstance(raw, Mapping):
        return out
    for key, value in raw.items():
        if isinstance(value, Mapping):
            out[str(key)] = GroupStatus(
                *(_seq(value.get(f"last_{what}_collective")) for what in ("enqueued", "started", "completed"))
            )
    return out


def _seq(value: Any) -> int | None:
    """A sequence number; torch writes -1 for "never" / "not tracked" (as text in JSON dumps)."""
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    v = _int(value)
    return None if v is None or v < 0 else v


def _reconcile_group_names(
    entries: list[FlightEntry], ranks: dict[str, list[int] | None], desc: dict[str, str], status: dict[str, GroupStatus]
) -> None:
    """Gloo dumps key ``pg_config`` (and sometimes ``pg_status``) differently from the
    entries' group names: when there is one group on each side, they are the same group."""
    names = {e.group for e in entries}
    if len(names) == 1:
        (name,) = names
        if name not in ranks and len(ranks) == 1:
            (other,) = ranks
            ranks[name] = ranks.pop(other)
            desc[name] = desc.pop(other) or next((e.group_desc for e in entries), "")
        if name not in status and len(status) == 1:
            (other,) = status
            status[name] = status.pop(other)
    for e in entries:
        desc.setdefault(e.group, e.group_desc)


def _frames(raw: Any, labels: dict[int, str | None]) -> list[str]:
    """The first MAX_FRAMES Python frames' labels (the frames past them are not looked at:
    a DeepSpeed call's entry holds ~30); ``labels``: each frame object's label (None: not
    a Python frame), as found so far."""
    out: list[str] = []
    if isinstance(raw, (list, tuple)):
        for f in raw:
            key = id(f)
            if key in labels:
                label = labels[key]
            else:
                label = labels[key] = frame_label(f) if isinstance(f, Mapping) and is_python_frame(f) else None
            if label is not None:
                out.append(label)
                if len(out) == MAX_FRAMES:
                    break
    return out


def _strings(raw: Any) -> list[str]:
    return [str(x) for x in raw] if isinstance(raw, (list, tuple)) else []


def _sizes(raw: Any) -> list[Any]:
    return list(raw) if isinstance(raw, (list, tuple)) else []


def _entry(e: Mapping[str, Any], labels: dict[int, str | None]) -> FlightEntry:
    pg = e.get("process_group")
    if isinstance(pg, (list, tuple)) and pg:
        group, group_desc = str(pg[0]), str(pg[1]) if len(pg) > 1 else ""
    else:
        group, group_desc = str(e.get("pg_id", "?")), ""
    name = str(e.get("profiling_name") or "?")
    backend, _, op = name.partition(":") if ":" in name else (None, "", name)
    state = str(e.get("state") or "?")
    duration = e.get("duration_ms")
    return FlightEntry(
        record_id=_int(e.get("record_id")),
        group=group,
        group_desc=group_desc,
        seq=_int(e.get("collective_seq_id")),
        p2p_seq=_int(e.get("p2p_seq_id")),
        is_p2p=bool(e.get("is_p2p")),
        op=op,
        backend=backend,
        input_sizes=_sizes(e.get("input_sizes")),
        output_sizes=_sizes(e.get("output_sizes")),
        input_dtypes=_strings(e.get("input_dtypes")),
        output_dtypes=_strings(e.get("output_dtypes")),
        state=state,
        retired=bool(e.get("retired")),
        completed=state == "completed",
        frames=_frames(e.get("frames"), labels),
        time_created_ns=_int(e.get("time_created_ns")),
        timeout_ms=_int(e.get("timeout_ms")),
        duration_ms=float(duration) if isinstance(duration, (int, float)) and not isinstance(duration, bool) else None,
    )


#: Frames that are not where the job made a call: torch's own (torch.distributed, and the
#: module-call and hook machinery an FSDP or DDP collective passes through on its way from
#: the model's line), lorascope's probe wrapper (the dumps of a probed job carry it), and
#: the wrappers a call passes through: typing_extensions' ``@deprecated`` (torch marks
#: ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` with it, the two calls of every
#: ZeRO step) and the standard library's (an absolute path under ``lib/python3.X/``; a
#: site-packages frame has lost that prefix, see frames.short_path).
_NOT_A_CALL_SITE = re.compile(
    f"{TORCH_FILE}|{LORASCOPE_FILE}"
    r"|^typing_extensions\.py:|^(/|[A-Za-z]:[/\\]).*[/\\]lib[/\\]python3[.\d]*[/\\]"
)
#: A frame of the job's own code: an absolute path (frames under site-packages lose that
#: prefix, see frames.short_path) outside the interpreter's standard library.
_JOB_CODE = re.compile(r"^(/|[A-Za-z]:[/\\])(?!.*[/\\]lib[/\\]python3[.\d]*[/\\])")
#: Frames followed from the call site outward to the job's own code, at most.
MAX_CHAIN = 64


def call_site(frames: list[str]) -> str | None:
    """The first frame outside torch, lorascope's probes and the wrappers above: where the
    call was made (a library's frame, when a library made it: DeepSpeed's for ZeRO)."""
    return frames[first_user_index(frames)] if frames else None


def first_user_index(frames: list[str]) -> int:
    """Index of the call site (see :func:`call_site`); 0 when every frame is torch's."""
    for i, f in enumerate(frames):
        if not _NOT_A_CALL_SITE.search(f):
            return i
    return 0


def is_job_code(frame: str) -> bool:
    """Whether a frame label is in the job's own code (not a library, not the stdlib)."""
    return bool(_JOB_CODE.match(frame)) and not _NOT_A_CALL_SITE.search(frame)


def call_chain(frames: list[str]) -> list[str]:
    """The frames from the call site outward to the first one in the job's own code
    (inclusive): where a library call was led to, e.g. a save helper called under
    ``if rank == 0:`` in the user's loop."""
    if not frames:
        return []
    chain = []
    for f in frames[first_user_index(frames) :][:MAX_CHAIN]:
        if _NOT_A_CALL_SITE.search(f):
            continue
        chain.append(f)
        if is_job_code(f):
            break
    return chain
