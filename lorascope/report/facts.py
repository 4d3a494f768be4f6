"""Run facts: how the job was launched, what it ran on, its configs, how each rank ended.

Ranks that ended the same way are shown once (a 1,024-rank job whose ranks all lost their
peer: one traceback, not 1,024), grouped by their ending's text with every number left
out (ports, addresses, thread ids and line numbers differ from rank to rank).

Lists are scrubbed (:func:`scrub`) before they are joined into text, so that an option
and its secret value in two argv elements are still recognised.
"""

from __future__ import annotations

import json
import shlex
import time
from collections import Counter
from typing import Any

from lorascope.analysis.cost import cost_text
from lorascope.detect.common import but_for_numbers
from lorascope.report.scrub import scrub
from lorascope.rundir.loading.reader import RankData, RunData
from lorascope.units import MAX_TABLE_RANKS, rank_ranges

MAX_WARNINGS_PER_RANK = 20
#: What a rank's ending shows (:func:`_rank_facts`); a rank with none of them has nothing to show.
ENDING_KEYS = ("exception", "signal", "stacks", "fatal", "warnings", "probe_errors")
CONFIG_ORDER = ("deepspeed", "lora", "model")


def utc(t: float | None) -> str | None:
    """An epoch time as UTC text (from the run's data, never the time of rendering)."""
    return None if t is None else time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def _warnings(rank: RankData) -> list[dict[str, Any]]:
    seen = Counter((w["category"], w["message"], w["filename"], w["lineno"]) for w in rank.warnings)
    return [
        {"category": c, "message": m, "where": f"{f}:{n}", "count": k}
        for (c, m, f, n), k in list(seen.items())[:MAX_WARNINGS_PER_RANK]
    ]


def _rank_facts(rank: RankData, summary: dict[str, Any], end: dict[str, Any]) -> dict[str, Any]:
    exc = rank.exception
    return {
        "rank": rank.rank,
        "host": rank.host,
        "pid": rank.pid,
        "device": rank.start.get("device"),
        "argv": shlex.join(str(a) for a in scrub(rank.start.get("argv", []))),
        "steps": summary["steps"],
        "step_median_ms": None
        if summary["step_time_median_s"] is None
        else round(summary["step_time_median_s"] * 1000, 1),
        "collectives": summary["collectives"]["count"],
        "ended": summary["ended"],
        "end_label": end["label"],
        "bad": end["bad"],
        "exception": None
        if exc is None
        else {"type": exc["type"], "message": exc["message"], "traceback": exc["traceback"]},
        "signal": None if rank.signal is None else {"name": rank.signal["name"]},
        "stacks": exc.get("stacks") if exc is not None else rank.signal.get("stacks") if rank.signal else None,
        "fatal": rank.fatal or None,
        "warnings": _warnings(rank),
        "probe_errors": summary["probe_errors"],
        "files": summary["files"],
    }


def endings(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ranks' endings (exception, signal, stacks, faulthandler's text, warnings, probe errors), each shown
    once for the ranks whose ending reads the same but for its numbers, in rank order of
    their first rank: ``ranks`` (its members), ``label``, ``same`` ("text": identical,
    "shape": identical but for numbers, the first rank's shown; None: one rank) and the
    first rank's fields."""
    groups: dict[str, list[tuple[int, dict[str, Any]]]] = {}  # (rank, its ending's fields)
    for r in ranks:
        shown = {k: r[k] for k in ENDING_KEYS}
        if any(shown.values()):
            key = but_for_numbers(json.dumps(shown, sort_keys=True, default=str))
            groups.setdefault(key, []).append((r["rank"], shown))
    out = []
    for members in groups.values():
        (first, fields), numbers = members[0], [n for n, _ in members]
        same = None
        label = f"rank {first}"
        if len(members) > 1:
            same = "text" if all(shown == fields for _, shown in members) else "shape"
            label = f"ranks {rank_ranges(numbers)} ({len(members):,} ranks, " + (
                "the same ending)" if same == "text" else f"the same ending but for its numbers; rank {first}'s shown)"
            )
        out.append({"ranks": numbers, "label": label, "same": same, "rank": first, **fields})
    return out


def _folded(ranks: list[dict[str, Any]]) -> str | None:
    """The summary line of the per-rank table folded past MAX_TABLE_RANKS rows (laid out
    only when opened: a 1,024-row table cost the page ~0.3-0.5 s of its main thread before
    it drew), None when it is shown open."""
    if len(ranks) <= MAX_TABLE_RANKS:
        return None
    bad = [r["rank"] for r in ranks if r["bad"]]
    return f"a row per rank ({len(ranks):,} ranks" + (f"; ended badly: {rank_ranges(bad)})" if bad else ")")


def run_facts(run: RunData, summary: dict[str, Any], ends: dict[int, dict[str, Any]]) -> dict[str, Any]:
    manifest = summary["manifest"]
    configs = manifest["configs"]
    names = [n for n in CONFIG_ORDER if n in configs] + sorted(set(configs) - set(CONFIG_ORDER))
    start, end = manifest["start"], manifest["end"]
    ranks = [_rank_facts(run.ranks[r["rank"]], r, ends[r["rank"]]) for r in summary["ranks"]]
    return {
        "world_size": manifest["world_size"],
        "running": summary["running"],
        "hosts": manifest["hosts"],
        "start_utc": utc(start),
        "duration_s": None if start is None or end is None else round(end - start, 1),
        "versions": manifest["versions"],
        "probe_cost": cost_text(summary["probe_cost"]) if summary.get("probe_cost") else None,
        "launches": [
            {
                "command": shlex.join(str(a) for a in scrub(launch["command"])),
                "cwd": launch["cwd"],
                "host": launch["host"],
                "exit_status": launch["exit_status"],
                "start_utc": utc(launch["start"]),
                "duration_s": None if launch["end"] is None else round(launch["end"] - launch["start"], 1),
            }
            for launch in manifest["launches"]
        ],
        "configs": [
            {"name": n, "text": json.dumps(scrub(configs[n]), indent=2, sort_keys=True, default=str)} for n in names
        ],
        "ranks": ranks,
        "ranks_folded": _folded(ranks),
        "endings": endings(ranks),
    }
