"""The per-rank summary `lorascope analyze` prints: a data builder and a text renderer."""

from __future__ import annotations

import statistics
from typing import Any

from lorascope.rundir.reader import RankData, RunData
from lorascope.rundir.schema import FORMAT_VERSION


def _peak_memory(rank: RankData) -> dict[str, int | None]:
    rss = [m["rss"] for m in rank.mem if m.get("rss") is not None]
    heap = [m["heap"] for m in rank.mem if m.get("heap") is not None]
    cuda = [m["cuda"] for m in rank.mem if isinstance(m.get("cuda"), dict)]
    nvml = [m["nvml"]["used"] for m in rank.mem if isinstance(m.get("nvml"), dict)]
    return {
        "rss_bytes": max(rss) if rss else None,
        "heap_bytes": max(heap) if heap else None,
        "cuda_max_allocated_bytes": max((c.get("max_alloc", 0) for c in cuda), default=None),
        "cuda_reserved_bytes": max((c.get("reserved", 0) for c in cuda), default=None),
        "nvml_used_bytes": max(nvml) if nvml else None,
    }


def _ended(rank: RankData) -> dict[str, Any]:
    """How the rank ended, as far as its stream tells."""
    if rank.exception is not None:
        return {
            "status": "exception",
            "code": 1,
            "detail": f"{rank.exception['type']}: {rank.exception['message']}".strip(),
        }
    if rank.signal is not None:
        return {"status": "signal", "code": -rank.signal["signum"], "detail": rank.signal["name"]}
    if rank.end is not None:
        return {"status": rank.end["status"], "code": rank.end["code"], "detail": None}
    return {
        "status": "unknown",
        "code": None,
        "detail": "no end record: killed (e.g. SIGKILL, OOM killer) or still running",
    }


def _collectives(rank: RankData) -> dict[str, Any]:
    last: dict[str, int] = {}
    for coll in rank.collectives:
        last[coll.group] = max(last.get(coll.group, 0), coll.seq)
    pending = [
        {"group": c.group, "seq": c.seq, "op": c.op, "bytes": c.bytes, "site": c.site}
        for c in rank.collectives
        if c.pending
    ]
    return {"count": len(rank.collectives), "last_seq": last, "pending": pending}


def _rank_summary(rank: RankData) -> dict[str, Any]:
    durations = [s["dur"] for s in rank.steps if s["dur"] > 0]
    losses = [s["loss"] for s in rank.steps if s["loss"] is not None]
    return {
        "rank": rank.rank,
        "pid": rank.pid,
        "host": rank.host,
        "device": rank.start["device"],
        "steps": len(rank.steps),
        "step_time_median_s": statistics.median(durations) if durations else None,
        "last_loss": losses[-1] if losses else None,
        "peak_memory": _peak_memory(rank),
        "memory_samples": len(rank.mem),
        "collectives": _collectives(rank),
        "warnings": len(rank.warnings),
        "probe_errors": [f"{e['probe']}: {e['error']}" for e in rank.probe_errors],
        "ended": _ended(rank),
        "files": rank.files,
    }


def build_summary(run: RunData) -> dict[str, Any]:
    """Everything `analyze` reports, as plain data (the JSON output is this)."""
    ranks = list(run.ranks.values())
    first = ranks[0] if ranks else None
    launches = run.manifest["launches"]
    starts = [launch["start"] for launch in launches] + [float(r.start["t"]) for r in ranks]
    ends = [launch["end"] for launch in launches if launch["end"] is not None] + [r.last_time for r in ranks]
    return {
        "run_dir": str(run.path),
        "format_version": FORMAT_VERSION,
        "manifest": {
            "launches": launches,
            "world_size": run.world_size,
            "hosts": sorted({r.host for r in ranks} | {launch["host"] for launch in launches}),
            "start": min(starts) if starts else None,
            "end": max(ends) if ends else None,
            "versions": first.start["versions"] if first else {},
            "configs": first.configs if first else {},
        },
        "ranks": [_rank_summary(r) for r in ranks],
        "warnings": run.warnings,
    }


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f} MiB"


def _ended_text(ended: dict[str, Any]) -> str:
    if ended["status"] == "exit":
        return f"exit {ended['code']}"
    detail = ended["detail"] or ""
    first_line = detail.splitlines()[0] if detail else ""
    return f"{ended['status']}: {first_line[:100]}" if first_line else ended["status"]


def render_text(data: dict[str, Any]) -> str:
    """A short human-readable table, one line per rank."""
    manifest = data["manifest"]
    versions = ", ".join(f"{k} {v}" for k, v in manifest["versions"].items() if v)
    lines = [
        f"run {data['run_dir']}: world size {manifest['world_size']}, hosts {', '.join(manifest['hosts'])}",
        f"  {versions}" if versions else "",
        f"{'rank':>4} {'pid':>8} {'steps':>5} {'step(med)':>10} {'peak mem':>10} "
        f"{'colls':>6}  last seq per group      ended",
    ]
    for r in data["ranks"]:
        peak = r["peak_memory"]
        mem = peak["cuda_max_allocated_bytes"] if peak["cuda_max_allocated_bytes"] is not None else peak["rss_bytes"]
        med = "-" if r["step_time_median_s"] is None else f"{r['step_time_median_s'] * 1000:.0f} ms"
        last = " ".join(f"{g}#{s}" for g, s in r["collectives"]["last_seq"].items()) or "-"
        lines.append(
            f"{r['rank']:>4} {r['pid']:>8} {r['steps']:>5} {med:>10} {_mib(mem):>10} "
            f"{r['collectives']['count']:>6}  {last:<22} {_ended_text(r['ended'])}"
        )
        for pending in r["collectives"]["pending"]:
            lines.append(
                f"       pending: {pending['op']} #{pending['seq']} on {pending['group']} "
                f"({pending['bytes']} B) at {pending['site']}"
            )
        for err in r["probe_errors"]:
            lines.append(f"       probe switched off: {err}")
    lines.extend(f"warning: {w}" for w in data["warnings"])
    return "\n".join(line for line in lines if line)
