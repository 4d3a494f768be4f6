"""`lorascope hang --pid PID...`: a job not started under `lorascope run`. Only what can
be read from outside: each process's rank (from its environment) and its stacks (py-spy),
grouped by where the main thread is and whether it is inside a collective, and the rank
condition its call sits in (the job's source, read on this host, as the probes read it)."""

from __future__ import annotations

import os
from typing import Any

import psutil

from lorascope.detect.hang.conditions import odd_by_condition
from lorascope.detect.hang.diagnosis import FIXES, main_thread_frame, main_thread_frames, own_main_frames, verdict_id
from lorascope.errors import BadInputError
from lorascope.hang.collect import py_spy_dump
from lorascope.hang.procstate import STOPPED, describe_state, process_state
from lorascope.rundir.format.ops import PAYLOAD_ARG
from lorascope.rundir.format.ranks import LONE, discover
from lorascope.rundir.format.sources import MAX_VIA_FRAMES, describe, job_source, rank_condition_in


def _rank_of(pid: int) -> str:
    try:
        env = psutil.Process(pid).environ()
    except psutil.NoSuchProcess:
        raise BadInputError(f"pid {pid}: no such process") from None
    except (psutil.AccessDenied, psutil.ZombieProcess):
        return f"pid {pid}"
    identity = discover(env)
    return f"rank {identity.rank}" if identity.source != LONE else f"pid {pid}"


def _collective(stacks: str) -> str | None:
    """The collective the main thread is in, from the function names on its stack."""
    for match in reversed(main_thread_frames(stacks)):  # innermost first
        if match["func"] in PAYLOAD_ARG:
            return match["func"]
    return None


def _roots(pid: int) -> tuple[str, ...]:
    """Where the process's own source files are: its working directory, its PYTHONPATH
    entries and its script's folder (a frame elsewhere is not read: it may name any file)."""
    try:
        proc = psutil.Process(pid)
        cwd = proc.cwd()
        env = proc.environ()
        cmdline = proc.cmdline()
    except (psutil.Error, OSError):
        return ()
    roots = [cwd, *env.get("PYTHONPATH", "").split(os.pathsep)]
    script = next((a for a in cmdline[1:] if not a.startswith("-")), "")
    if script.endswith(".py"):
        roots.append(os.path.dirname(os.path.join(cwd, script)))
    return tuple(r for r in roots if os.path.isabs(r))


def _condition(stacks: str, roots: tuple[str, ...]) -> tuple[str, str] | None:
    """The rank condition the main thread is in, read from the job's source on this host
    (under ROOTS): around its innermost own frame, else around the nearest caller of the
    job's own code whose line has one (as the probes' ``via``). (the condition, the frame
    it encloses)."""
    for m in own_main_frames(stacks)[:MAX_VIA_FRAMES]:
        lines = job_source(m["file"], roots)
        cond = rank_condition_in(describe(m["file"], int(m["line"]), lines)) if lines is not None else None
        if cond is not None:
            return cond, f"{m['file']}:{m['line']} in {m['func']}"
    return None


def _state_of(pid: int) -> dict[str, Any]:
    """One process as py-spy sees it; a process py-spy cannot read (stopped, a zombie,
    py-spy's own failure) is one plain line, the others are still diagnosed."""
    who = _rank_of(pid)
    state = process_state(pid)
    entry: dict[str, Any] = {"who": who, "pid": pid, "collective": None, "stacks": None, "condition": None}
    entry["process"] = state
    if state in STOPPED or state in ("zombie", "dead", "gone"):
        return {**entry, "where": describe_state(state) or state}
    try:
        stacks = py_spy_dump(pid)
    except BadInputError as exc:
        return {**entry, "where": f"unread: {exc}"}
    frame = main_thread_frame(stacks)
    op = _collective(stacks)
    where = f"in {op} at {frame or '?'}" if op else f"in its own code at {frame or '?'} (no collective)"
    cond = _condition(stacks, _roots(pid)) if op else None
    return {**entry, "collective": op, "where": where, "stacks": stacks, "condition": cond}


def diagnose_pids(pids: list[int]) -> dict[str, Any]:
    states = [_state_of(pid) for pid in pids]
    groups: dict[str, list[str]] = {}
    for s in states:
        groups.setdefault(s["where"], []).append(s["who"])
    halted = [s for s in states if s["process"] in STOPPED]
    read = [s for s in states if s["stacks"] is not None]
    if not read and not halted:
        raise BadInputError("py-spy could read none of the processes: " + "; ".join(s["where"] for s in states))
    inside = [s for s in read if s["collective"]]
    outside = [s for s in read if not s["collective"]]
    if halted:
        kind, odd = "stopped-process", [s["who"] for s in halted]
        one = len(odd) == 1
        verdict = (
            f"{', '.join(odd)} {'is' if one else 'are'} {halted[0]['where']}; "
            f"the others wait for {'it' if one else 'them'}"
        )
    elif inside and outside:
        kind, odd = "stuck-outside", [s["who"] for s in outside]
        verb = "is" if len(odd) == 1 else "are"
        verdict = f"{', '.join(odd)} {verb} stuck outside any collective ({outside[0]['where']}); the others wait"
    elif len({s["where"] for s in inside}) > 1:
        kind = "rank-conditional-hang"
        conditions = {i: s["condition"][0] if s["condition"] else None for i, s in enumerate(states)}
        odd_states = [states[i] for i in odd_by_condition(conditions, include_else=False)]
        odd = [s["who"] for s in odd_states]
        if odd_states:
            verb = "is" if len(odd) == 1 else "are"
            cond, at = odd_states[0]["condition"]
            verdict = (
                f"{', '.join(odd)} {verb} {odd_states[0]['where']}, inside `{cond}`"
                f"{'' if at in odd_states[0]['where'] else ' at ' + at}; the others wait elsewhere: "
                "a collective not all ranks run"
            )
        else:
            verdict = "the processes wait in different collectives or call sites: a collective not all ranks run"
    elif inside:
        kind, odd = "collective-stuck", []
        verdict = "every process waits in the same collective: the collective itself is stuck"
    else:
        kind, odd = "unknown", []
        verdict = "no process is in a collective"
    return {
        "id": verdict_id(kind),
        "kind": kind,
        "verdict": verdict,
        "fix": FIXES[kind],
        "odd_ranks": odd,
        "first_diverged": None,  # no records of the calls made: only where each process is now
        "groups": [{"where": w, "ranks": rs} for w, rs in groups.items()],
        "ranks": states,
        "silent": [],  # no dump is asked of a process outside a run: py-spy reads each
    }
