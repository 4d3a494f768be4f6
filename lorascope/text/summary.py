"""The per-rank summary as a terminal table (the data is
:func:`lorascope.analysis.summary.build_summary`'s).

Past MAX_TABLE_RANKS ranks the table is condensed: 1,024 rows (and a hang's 1,023
pending lines) would push the findings, printed above it, off the screen. Ranks whose
rows read alike (the same steps, the same last sequence number per group, the same
pending calls, and the same ending but for its numbers: ports, pids, times) are one line
with the ranges of their figures; a row is printed for the first rank of each such group,
for every rank that stands alone, and for the ranks at the extremes (slowest median step,
largest peak). ``--all-ranks`` prints every row; ``--json`` has every field.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lorascope.analysis.cost import cost_text
from lorascope.detect.common import MIN_ALIKE_RANKS, but_for_numbers, reentrancy
from lorascope.units import MAX_TABLE_RANKS, count, group_named, rank_ranges, short_error


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f} MiB"


def _ended_text(ended: dict[str, Any]) -> str:
    if ended["status"] == "exit":
        return f"exit {ended['code']}"
    detail = ended["detail"] or ""
    first_line = detail.splitlines()[0] if detail else ""
    return f"{ended['status']}: {short_error(first_line, 100)}" if first_line else ended["status"]


def _mesh_text(mesh: dict[str, Any] | None) -> str:
    if mesh is None:
        return "the world"
    names = f" ({', '.join(mesh['dim_names'])})" if mesh.get("dim_names") else ""
    return f"{mesh['shape']}{names} {mesh.get('device') or ''}".rstrip()


def _precision_text(mp: dict[str, Any] | None) -> str:
    if not mp:
        return "no MixedPrecisionPolicy"
    parts = [f"{mp[k]} {k.removesuffix('_dtype')}" for k in ("param_dtype", "reduce_dtype") if mp.get(k)]
    return "mixed precision " + " / ".join(parts)


def _reshard_text(value: Any) -> str:
    """FSDP2's ``reshard_after_forward``: None is torch's default (True, but False for the root)."""
    return "default (reshards; the root keeps its parameters)" if value is None else str(value)


def _unit_text(unit: dict[str, Any]) -> str:
    """One kind of FSDP2 unit: "2 LlamaDecoderLayer: reshard after forward True, mixed
    precision bfloat16 param, parameters float32"."""
    name = f"{unit.get('count', 1)} {unit.get('module', '?')}" + (" (root)" if unit.get("root") else "")
    dtypes = ", ".join(unit.get("param_dtypes") or []) or "none"
    return (
        f"{name}: reshard after forward {_reshard_text(unit.get('reshard_after_forward'))}, "
        f"{_precision_text(unit.get('mixed_precision'))}, parameters {dtypes}"
    )


def _autocast_text(settings: dict[str, Any]) -> str:
    """The Trainer's bf16/fp16 without a MixedPrecisionPolicy on any unit: autocast."""
    half = settings.get("trainer_precision")
    units = settings.get("by_unit") or []
    if not half or any(u.get("mixed_precision") for u in units):
        return ""
    return f"; the Trainer's {half} is autocast: computed in {half}, the parameters stay as stored"


def _listed(values: list[Any], show: Any) -> str:
    """FSDP2 settings are lists of the distinct values its units use."""
    return " | ".join(show(v) for v in values) if values else "-"


def sharding_text(sharding: dict[str, Any]) -> str:
    """One line: the sharding engine and its settings, and activation checkpointing."""
    engine, s = sharding["engine"], sharding["settings"]
    if engine == "FSDP2" and s.get("by_unit"):
        text = (
            f"FSDP2 fully_shard, {s.get('units')} units, mesh {_listed(s.get('mesh', []), _mesh_text)}, "
            f"CPU offload {_listed(s.get('offload', []), lambda o: 'no' if o is None else 'yes')}; "
            + "; ".join(_unit_text(u) for u in s["by_unit"])
            + _autocast_text(s)
        )
    elif engine == "FSDP2":  # recorded before units were told apart
        text = (
            f"FSDP2 fully_shard, {s.get('units')} units, mesh {_listed(s.get('mesh', []), _mesh_text)}, "
            f"reshard after forward (per unit, in the order sharded) {_listed(s.get('reshard_after_forward', []), str)}, "
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
        how = reentrancy(ckpt.get("use_reentrant", []))
        wrappers = f", {ckpt['wrappers']} torch checkpoint_wrapper(s)" if ckpt.get("wrappers") else ""
        text += f"; activation checkpointing {how}{wrappers}"
    return text


def _peak(r: dict[str, Any]) -> int | None:
    """The rank's peak: the CUDA allocator's where it has one, else RSS's (:func:`peak_label`)."""
    peak = r["peak_memory"]
    value = peak["cuda_max_allocated_bytes"] if peak["cuda_max_allocated_bytes"] is not None else peak["rss_bytes"]
    return None if value is None else int(value)


def peak_label(ranks: list[dict[str, Any]]) -> str:
    """What the table's peak column holds (10 characters at most): the CUDA allocator's
    peak ("CUDA alloc"), the process's resident memory ("peak RSS"), or both, by rank."""
    cuda = {r["peak_memory"]["cuda_max_allocated_bytes"] is not None for r in ranks}
    return "CUDA alloc" if cuda == {True} else "peak RSS" if cuda <= {False} else "peak*"


#: Under the table when ranks differ in what their peak is.
PEAK_MIXED = "peak*: CUDA max allocated on the ranks that had CUDA, resident memory (RSS) on the others"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def _probe_notes(r: dict[str, Any]) -> list[str]:
    """The lines under a rank's row about its probes: unseen collectives, probe errors."""
    lines = [f"       not recorded: {u['why']}; {u['see']} has them" for u in r.get("unseen_collectives", [])]
    return lines + [f"       probe switched off: {err}" for err in r["probe_errors"]]


def _continues(last: dict[str, Any], p: dict[str, Any]) -> bool:
    """Whether pending call ``p`` is the next of ``last``'s run: the same op, group and site,
    and the next sequence number."""
    same = (last["op"], last["group"], last["site"]) == (p["op"], p["group"], p["site"])
    return same and isinstance(last["seq"], int) and p["seq"] == last["seq"] + 1


def _pending_lines(pending: list[dict[str, Any]]) -> list[str]:
    """A rank's pending calls, one line per run of calls with consecutive sequence numbers
    and the same op, group and site (a ZeRO-3 gather of a whole model's parameters under a
    rank condition is dozens of them: ``#193-#220 ... (28 calls, 512-2048 B)``)."""
    runs: list[list[dict[str, Any]]] = []
    for p in pending:
        if runs and _continues(runs[-1][-1], p):
            runs[-1].append(p)
        else:
            runs.append([p])
    lines = []
    for run in runs:
        first, last = run[0], run[-1]
        if len(run) == 1:
            seqs, sizes = f"#{first['seq']}", f"{first['bytes']} B"
        else:
            known = sorted(p["bytes"] for p in run if isinstance(p["bytes"], int))
            size = f"{known[0]} B" if known and known[0] == known[-1] else f"{known[0]}-{known[-1]} B" if known else ""
            seqs, sizes = f"#{first['seq']}-#{last['seq']}", f"{len(run)} calls" + (f", {size}" if size else "")
        lines.append(
            f"       pending: {first['op']} {seqs} on {group_named(first['group'])} ({sizes}) at {first['site']}"
        )
    return lines


def _notes(r: dict[str, Any]) -> list[str]:
    """The lines under a rank's row: its pending calls, then its probes' notes."""
    return _pending_lines(r["collectives"]["pending"]) + _probe_notes(r)


def _row(r: dict[str, Any]) -> list[str]:
    last = " ".join(f"{g}#{s}" for g, s in r["collectives"]["last_seq"].items()) or "-"
    return [
        f"{r['rank']:>4} {r['pid']:>8} {r['steps']:>5} {_ms(r['step_time_median_s']):>10} {_mib(_peak(r)):>10} "
        f"{r['collectives']['count']:>6}  {last:<22} {_ended_text(r['ended'])}",
        *_notes(r),
    ]


def _alike_key(r: dict[str, Any]) -> tuple[object, ...]:
    """What ranks share to be one line of a condensed table: their steps, where each group's
    collectives stopped and the calls they wait in (to the sequence number: a rank one call
    behind is a hang's story), and how they ended but for its numbers (ports, pids, times)."""
    collectives = r["collectives"]
    return (
        r["steps"],
        tuple(collectives["last_seq"].items()),
        tuple((p["group"], p["seq"], p["op"], p["bytes"], p["site"]) for p in collectives["pending"]),
        but_for_numbers(_ended_text(r["ended"])),
        tuple(but_for_numbers(line) for line in _probe_notes(r)),
    )


def _spread(values: list[Any], show: Callable[[Any], str]) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "-"
    low, high = show(min(known)), show(max(known))
    if low == high:
        return low
    (low_n, _, unit), (high_n, _, high_unit) = low.partition(" "), high.partition(" ")
    return f"{low_n}-{high_n} {unit}" if unit and unit == high_unit else f"{low}-{high}"


def _condensed(ranks: list[dict[str, Any]]) -> list[str]:
    """A row per group of ranks alike but for their numbers (its first rank's), per rank
    alone, and per extreme rank; a line per group for the ranks without a row."""
    groups: dict[tuple[object, ...], list[dict[str, Any]]] = {}
    for r in ranks:
        groups.setdefault(_alike_key(r), []).append(r)
    shown = {members[0]["rank"] for members in groups.values()}
    shown |= {r["rank"] for members in groups.values() if len(members) < MIN_ALIKE_RANKS for r in members}
    timed = [r for r in ranks if r["step_time_median_s"] is not None]
    if timed:
        shown.add(max(timed, key=lambda r: r["step_time_median_s"])["rank"])
    sized = [(peak, r["rank"]) for r in ranks if (peak := _peak(r)) is not None]
    if sized:
        shown.add(max(sized, key=lambda s: s[0])[1])  # the first rank at the largest
    lines = [line for r in ranks if r["rank"] in shown for line in _row(r)]
    for members in groups.values():
        rest = [r for r in members if r["rank"] not in shown]
        if not rest:
            continue
        lines.append(
            f"  ranks {rank_ranges(r['rank'] for r in rest)} ({len(rest):,} ranks): as rank {members[0]['rank']} "
            f"but for their numbers; step(med) {_spread([r['step_time_median_s'] for r in rest], _ms)}, "
            f"{peak_label(ranks)} {_spread([_peak(r) for r in rest], _mib)}, "
            f"colls {_spread([r['collectives']['count'] for r in rest], count)}"
        )
    lines.append(
        f"({len(ranks):,} ranks: {len(shown):,} rows shown, the others alike; "
        "--all-ranks prints every row, --json every field)"
    )
    return lines


def _warning_lines(warnings: list[str]) -> list[str]:
    """Warnings alike but for their numbers (one per rank of a 1,024-rank run) as one line
    from MIN_ALIKE_RANKS on: the first, and how many more."""
    alike: dict[str, list[str]] = {}
    for w in warnings:
        alike.setdefault(but_for_numbers(w), []).append(w)
    lines = []
    for same in alike.values():
        if len(same) < MIN_ALIKE_RANKS:
            lines += [f"warning: {w}" for w in same]
        else:
            lines.append(f"warning: {same[0]} (and {len(same) - 1:,} more alike but for their numbers)")
    return lines


def render_text(data: dict[str, Any], all_ranks: bool = False, verbose: bool = False) -> str:
    """A short human-readable table, one line per rank (condensed past MAX_TABLE_RANKS
    ranks unless ``all_ranks``); ``verbose`` adds what the probes cost (the report's run
    facts have it too)."""
    manifest = data["manifest"]
    versions = ", ".join(f"{k} {v}" for k, v in manifest["versions"].items() if v)
    lines = [
        f"run {data['run_dir']}: world size {manifest['world_size']}, hosts {', '.join(manifest['hosts'])}",
        f"  {versions}" if versions else "",
        f"  sharding: {sharding_text(manifest['sharding'])}" if manifest.get("sharding") else "",
        f"  probes' cost: {cost_text(data['probe_cost'])}" if verbose and data.get("probe_cost") else "",
        f"{'rank':>4} {'pid':>8} {'steps':>5} {'step(med)':>10} {peak_label(data['ranks']):>10} "
        f"{'colls':>6}  last seq per group      ended",
    ]
    ranks = data["ranks"]
    if all_ranks or len(ranks) <= MAX_TABLE_RANKS:
        lines += [line for r in ranks for line in _row(r)]
        lines += [f"warning: {w}" for w in data["warnings"]]
    else:
        lines += _condensed(ranks)
        lines += _warning_lines(data["warnings"])
    if peak_label(ranks) == "peak*":
        lines.append(PEAK_MIXED)
    return "\n".join(line for line in lines if line)
