"""Which processes of a run attached the probes, and when none did, the likely reason
(read from the streams' first records and the bootstrap's processes.jsonl)."""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

from lorascope.errors import BadInputError
from lorascope.rundir.format.safe_open import open_regular
from lorascope.rundir.format.schema import (
    BOOTSTRAP_DIR,
    PROCESSES_LOG,
    RANKS_DIR,
    STREAM_SUFFIX,
    SchemaError,
    validate_record,
)
from lorascope.rundir.format.writer import fatal_path, stream_prefix

#: What is read, at most: of a stream's first line (its start record), of processes.jsonl.
MAX_START_BYTES = 1 << 20
MAX_PROCESSES_BYTES = 4 << 20

#: Interpreter flags that make Python ignore PYTHONPATH (-I, -E) or skip site (-S).
_NO_BOOTSTRAP_FLAG = re.compile(r"^-[A-Za-z]*[IES][A-Za-z]*$")
_CONTAINERS = frozenset({"docker", "podman", "nerdctl", "apptainer", "singularity", "enroot", "kubectl", "ctr"})


def attached_processes(run_dir: Path, launch_id: str | None = None) -> list[dict[str, Any]]:
    """The valid ``start`` record of every process that attached (of one launch, if given)."""
    out = []
    for first in sorted((run_dir / RANKS_DIR).glob(f"rank-*/*.0000{STREAM_SUFFIX}")):
        try:
            with open_regular(first, inside=run_dir) as f:
                rec = json.loads(f.readline(MAX_START_BYTES))
            valid = isinstance(rec, dict) and rec.get("k") == "start" and validate_record(rec)
        except (OSError, ValueError, RecursionError, BadInputError, SchemaError):
            continue
        if valid:
            if launch_id is None or rec.get("launch_id") in (None, launch_id):
                out.append(rec)
    return out


def remove_empty_fatal_files(run_dir: Path, processes: list[dict[str, Any]], host: str) -> None:
    """Remove the empty faulthandler files of PROCESSES (their start records) that ran on
    HOST and are gone: a rank that died of no fatal signal leaves none behind. A process
    still alive (an orphan of a launcher killed first) keeps its file; so does any other
    host's (its ranks may still run)."""
    for rec in processes:
        if rec.get("host") != host or not isinstance(rec.get("pid"), int) or not isinstance(rec.get("rank"), int):
            continue
        try:
            os.kill(rec["pid"], 0)
            continue  # still alive (or another process has its pid now)
        except ProcessLookupError:
            pass
        except OSError:
            continue
        path = fatal_path(stream_prefix(run_dir, rec["rank"], host, rec["pid"]))
        try:
            if path.is_file() and not path.is_symlink() and path.stat().st_size == 0:
                path.unlink()
        except OSError:
            pass  # left as it is: the reader ignores an empty one


def bootstrap_processes(run_dir: Path, launch_id: str | None = None) -> list[dict[str, Any]]:
    """What each Python process that loaded a bootstrap of the run (or of one launch)
    decided to be."""
    lines: list[str] = []
    for log in sorted((run_dir / BOOTSTRAP_DIR).glob(f"{launch_id or '*'}/{PROCESSES_LOG}")):
        try:
            with open_regular(log, inside=run_dir) as f:
                lines.extend(f.read(MAX_PROCESSES_BYTES).decode(errors="replace").splitlines())
        except (OSError, BadInputError):
            continue
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def _flag_reason(command: list[str]) -> str | None:
    for i, arg in enumerate(command[1:], 1):
        if os.path.basename(command[i - 1]).startswith("python") and _NO_BOOTSTRAP_FLAG.match(arg):
            return f"the command runs `python {arg}`, which ignores PYTHONPATH or site, so the bootstrap never loads"
    return None


def _container_reason(command: list[str]) -> str | None:
    if command and os.path.basename(command[0]) in _CONTAINERS:
        return (
            f"the job runs in a container ({os.path.basename(command[0])}), which does not inherit this run's "
            "PYTHONPATH: mount the run directory and set PYTHONPATH to its bootstrap/ folder inside"
        )
    return None


def why_none_attached(
    run_dir: Path, commands: list[list[str]], launch_id: str | None = None, exit_status: int | None = None
) -> str:
    """One sentence: the likely reason no process attached the probes (``exit_status``:
    the launch command's, when it ended)."""
    for command in commands:
        reason = _flag_reason(command) or _container_reason(command)
        if reason:
            return reason
    seen = bootstrap_processes(run_dir, launch_id)
    if not seen:
        return (
            "no Python process loaded the bootstrap: the job is not Python, or the launcher or a "
            "container entrypoint resets PYTHONPATH, or Python runs with -I/-E"
        )
    roles = Counter(str(p.get("role")) for p in seen)
    if set(roles) == {"launcher"} and exit_status not in (None, 0):
        launchers = ", ".join(sorted({_shown(p.get("program")) for p in seen}))
        return (
            f"the launcher ({launchers}) exited with status {exit_status} before it started any process of the "
            "job: its own error is printed above (e.g. options it refuses)"
        )
    lone = [p for p in seen if p.get("role") == "lone"]
    parts = [f"{n} {role}" for role, n in sorted(roles.items())]
    count = "1 Python process" if len(seen) == 1 else f"{len(seen)} Python processes"
    why = f"{count} loaded the bootstrap ({', '.join(parts)}) and none attached"
    if lone:
        names = sorted({_shown(p.get("program")) for p in lone})
        why += f"; a process without rank variables ({', '.join(names)}) attaches when it imports torch, and none did"
    return why


def _shown(program: object) -> str:
    return "python -c" if program == "-c" else str(program)
