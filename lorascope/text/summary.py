"""The per-rank summary as a terminal table (the data is
:func:`lorascope.analysis.summary.build_summary`'s)."""

from __future__ import annotations

from typing import Any


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
