"""failed-after-exit: the job failed after its ranks had finished. A rank recorded its exit
(the end record, at Python's exit handlers) and then died of a fatal signal in the
interpreter's teardown (its faulthandler file, written after the end record), or a
launcher exited non-zero while every rank recorded a clean exit. Without this a run whose
launcher says FAILED reads "no problem found": every record the ranks wrote is healthy.
"""

from __future__ import annotations

import os
import shlex
import signal
from pathlib import Path
from typing import Any

from lorascope.detect.common import per_rank_evidence, stream_source
from lorascope.detect.finding import Evidence, Finding
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.rundir.format.writer import fatal_path
from lorascope.rundir.loading.ending import Ending, ending_of
from lorascope.rundir.loading.reader import RankData, RunData
from lorascope.units import ranks_named

ID = "failed-after-exit"

EXPLANATION = (
    "A rank whose training has finished can still die on its way out: objects destroyed in the "
    "interpreter's teardown run their C++ destructors after Python's exit handlers, where the "
    "probes' end record is written. A gloo process group still alive then can abort the process "
    "(std::terminate, 'terminate called without an active exception': pytorch/pytorch#190489). "
    "The launcher reports the rank failed, and a scheduler may re-run a job that had completed."
)
FIX = (
    "the work the rank recorded before its exit is complete: check its outputs (checkpoints, "
    "logs) rather than re-run it for this exit status alone. The abort is torch's: "
    "destroy_process_group() at the end of every rank is the documented practice, but it does not "
    "prevent it while a library still holds the group (DeepSpeed keeps it in deepspeed.utils.groups "
    "and on every ZeRO-3 parameter)"
)
FIX_UNSEEN = (
    "read the launcher's output for the process that failed and its exit code; a rank that enables "
    "faulthandler itself (PYTHONFAULTHANDLER, -X faulthandler) writes its teardown crash there, "
    "not into the run directory"
)


def _failed_launches(run: RunData) -> list[dict[str, Any]]:
    """Launches that ended with a failure status of their own (not a signal lorascope
    forwarded to them: the user stopped those) and started the ranks analysed: another job
    run into the same directory says nothing of these ranks (a rank attached outside
    `lorascope run` names no launch: then every launch counts)."""
    ours = {rank.start.get("launch_id") for rank in run.ranks.values()}
    return [
        launch
        for launch in run.manifest["launches"]
        if launch["end"] is not None
        and launch["exit_status"] not in (None, 0)
        and not launch.get("signals")
        and (None in ours or launch["id"] in ours)
    ]


def _launch_evidence(launches: list[dict[str, Any]]) -> list[Evidence]:
    return [
        Evidence(
            "launcher",
            f"`{shlex.join(str(a) for a in launch['command'])[:200]}` exited {launch['exit_status']}",
            f"manifest.json (launch {launch['id']})",
        )
        for launch in launches
    ]


def _fatal_source(run: RunData, rank: RankData) -> str:
    """The rank's faulthandler file: its stream's name (``HOST-PID.NNNN.jsonl``) with the
    fatal suffix in place of the segment's."""
    if not rank.files:
        return f"ranks/rank-{rank.rank} (faulthandler)"
    prefix = Path(os.path.relpath(rank.files[0], run.path).rsplit(".", 2)[0])
    return f"{fatal_path(prefix).as_posix()} (faulthandler)"


def _fatal_summary(text: str) -> str:
    """faulthandler's first line and where the current thread was: its innermost Python
    frame, or none (C++ code: a destructor, a library's thread)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return "?"
    current = next((i for i, line in enumerate(lines) if line.startswith("Current thread")), None)
    frames = lines[current + 1 :] if current is not None else lines[1:]
    where = next((f for f in frames if f.startswith("File ") or f == "<no Python frame>"), None)
    if where == "<no Python frame>":
        where = "no Python frame (C++ code: a destructor or a library's thread)"
    return f"{lines[0]}; innermost: {where}"[:300] if where else lines[0][:300]


def _teardown_finding(run: RunData, ends: dict[int, Ending], failed: list[dict[str, Any]]) -> Finding:
    ranks = sorted(ends)
    codes = sorted({c for n in ranks if (c := ends[n].code) is not None})
    how = " or ".join(signal.Signals(-c).name for c in codes) or "a fatal signal"
    who = ranks_named(ranks)
    exited = f": the launcher exited {failed[0]['exit_status']}" if failed else ""
    rows: dict[int, list[tuple[str, Any, str]]] = {}
    for n in ranks:
        rank = run.ranks[n]
        assert rank.end is not None
        rows[n] = [
            (" exit", f"end record: {rank.end['status']} {rank.end['code']}", stream_source(run, rank, "end record")),
            (" afterwards", _fatal_summary(rank.fatal or ""), _fatal_source(run, rank)),
        ]
    evidence = per_rank_evidence(rows)
    return Finding(
        id=ID,
        title=f"{who} died of {how} in the interpreter's teardown, after recording a finished job{exited}",
        severity="error",
        confidence="high",
        confidence_reason="faulthandler wrote its report after the rank had recorded its exit",
        ranks=ranks,
        evidence=evidence + _launch_evidence(failed),
        explanation=EXPLANATION,
        fix=FIX,
    )


def detect(bundle: EvidenceBundle) -> list[Finding]:
    run = bundle.run
    if run is None or not run.ranks:
        return []
    ends = {n: ending_of(rank) for n, rank in run.ranks.items()}
    failed = _failed_launches(run)
    teardown = {n: e for n, e in ends.items() if e.teardown}
    if teardown:
        return [_teardown_finding(run, teardown, failed)]
    if not failed or not all(e.status == "exit" and e.code == 0 for e in ends.values()):
        return []  # no failure, or a rank's own ending explains it (and says so)
    statuses = ", ".join(sorted({str(launch["exit_status"]) for launch in failed}))
    return [
        Finding(
            id=ID,
            title=f"the launcher exited {statuses}, yet every rank recorded exit 0: the failure came after "
            "the ranks' last records",
            severity="error",
            confidence="low",
            confidence_reason="the run directory holds no record of the failure: it happened in a rank's "
            "teardown after its end record, in a process lorascope did not probe, or a rank raised "
            "SystemExit(n) itself (the probes see the code given to sys.exit, not a raised SystemExit's)",
            ranks=sorted(run.ranks),
            evidence=_launch_evidence(failed),
            explanation=EXPLANATION,
            fix=FIX_UNSEEN,
        )
    ]
