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


def _mesh_text(mesh: dict[str, Any] | None) -> str:
    if mesh is None:
        return "the world"
    names = f" ({', '.join(mesh['dim_names'])})" if mesh.get("dim_names") else ""
    return f"{mesh['shape']}{names} {mesh.get('device') or ''}".rstrip()


def _precision_text(mp: dict[str, Any] | None) -> str:
    if not mp:
        return "full precision"
    parts = [f"{mp[k]} {k.removesuffix('_dtype')}" for k in ("param_dtype", "reduce_dtype") if mp.get(k)]
    return "mixed precision " + " / ".join(parts)


def _listed(values: list[Any], show: Any) -> str:
    """FSDP2 settings are lists of the distinct values its units use."""
    return " | ".join(show(v) for v in values) if values else "-"


def sharding_text(sharding: dict[str, Any]) -> str:
    """One line: the sharding engine and its settings, and activation checkpointing."""
    engine, s = sharding["engine"], sharding["settings"]
    if engine == "FSDP2":
        text = (
            f"FSDP2 fully_shard, {s.get('units')} units, mesh {_listed(s.get('mesh', []), _mesh_text)}, "
            f"reshard after forward {_listed(s.get('reshard_after_forward', []), str)}, "
            f"{_listed(s.get('mixed_precision', []), _precision_text)}, "
            f"CPU offload {_listed(s.get('offload', []), lambda o: 'no' if o is None else 'yes')}"
        )
    elif engine == "FSDP1":
        text = (
            f"FSDP1 {s.get('sharding_strategy')}, {s.get('units')} units, mesh {_mesh_text(s.get('mesh'))}, "
            f"{_precision_text(s.get('mixed_precision'))}, CPU offload {'yes' if s.get('cpu_offload') else 'no'}, "
            f"use_orig_params {s.get('use_orig_params')}"
        )
    elif engine == "DeepSpeed":
        text = f"DeepSpeed ZeRO-{s.get('zero_stage')}"
    elif engine == "DDP":
        text = (
            f"DDP (replicated), find_unused_parameters {s.get('find_unused_parameters')}, "
            f"static_graph {s.get('static_graph')}, gradient_as_bucket_view {s.get('gradient_as_bucket_view')}"
        )
    else:
        text = "no sharding recorded"
    ckpt = sharding["checkpointing"]
    if ckpt:
        how = "reentrant" if True in ckpt.get("use_reentrant", []) else "non-reentrant"
        wrappers = f", {ckpt['wrappers']} torch checkpoint_wrapper(s)" if ckpt.get("wrappers") else ""
        text += f"; activation checkpointing {how}{wrappers}"
    return text


def render_text(data: dict[str, Any]) -> str:
    """A short human-readable table, one line per rank."""
    manifest = data["manifest"]
    versions = ", ".join(f"{k} {v}" for k, v in manifest["versions"].items() if v)
    lines = [
        f"run {data['run_dir']}: world size {manifest['world_size']}, hosts {', '.join(manifest['hosts'])}",
        f"  {versions}" if versions else "",
        f"  sharding: {sharding_text(manifest['sharding'])}" if manifest.get("sharding") else "",
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
        for unseen in r.get("unseen_collectives", []):
            lines.append(f"       not recorded: {unseen['why']}; {unseen['see']} has them")
        for err in r["probe_errors"]:
            lines.append(f"       probe switched off: {err}")
    lines.extend(f"warning: {w}" for w in data["warnings"])
    return "\n".join(line for line in lines if line)
