"""Loaded artifacts as terminal text: one block per artifact kind, largest things first
(the data is :func:`lorascope.analysis.artifacts.artifacts_data`'s)."""

from __future__ import annotations

from typing import Any

from lorascope.ingest.flight.reader import call_chain, call_site
from lorascope.units import fmt_bytes, rank_ranges, ranks_named

#: Sites and kernels shown per block (all are in the JSON).
TOP = 6


def _ms(us: float | None) -> str:
    return "-" if us is None else f"{us / 1000:.1f} ms"


def _us(us: float | None) -> str:
    return "-" if us is None else f"{us:.1f} us"


def _categories(cats: dict[str, int]) -> str:
    return ", ".join(f"{c} {fmt_bytes(b)}" for c, b in cats.items() if b) or "-"


def _sites(groups: list[dict[str, Any]], indent: str) -> list[str]:
    lines = []
    for g in groups[:TOP]:
        callers = [s for s in g["stack"][1:3]]
        via = f"  < {' < '.join(callers)}" if callers else ""
        lines.append(
            f"{indent}{fmt_bytes(g['bytes']):>10}  {g['category']:<11} {g['site']} "
            f"({g['count']} block{'s' if g['count'] != 1 else ''}){via}"
        )
    return lines


def _point(p: dict[str, Any], indent: str) -> list[str]:
    lines = [f"{indent}by category: {_categories(p['by_category'])}"]
    if p["unattributed"]:
        lines.append(f"{indent}{fmt_bytes(p['unattributed'])} allocated before the trace started, stack unknown")
    return lines + _sites(p["by_site"], indent)


def _render_snapshots(data: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for rank, snap in data.get("snapshots", {}).items():
        lines.append(f"allocator snapshot, rank {rank}: {snap['path']}")
        settings = snap["settings"]
        exp = settings["expandable_segments"]
        lines.append(
            f"  allocator settings: expandable_segments {'on' if exp else 'off' if exp is False else 'unknown'}"
            + (f", PYTORCH_CUDA_ALLOC_CONF={settings['alloc_conf']!r}" if settings["alloc_conf"] else "")
            + ("" if settings["present"] else " (no allocator_settings in this file)")
        )
        for dev in snap["devices"]:
            st = dev["state"]
            lines.append(
                f"  device {dev['device']} at the snapshot: reserved {fmt_bytes(st['reserved'])}, allocated "
                f"{fmt_bytes(st['allocated'])}, cached free {fmt_bytes(st['inactive'])} in {st['segments']} segments "
                f"(largest free block {fmt_bytes(st['largest_free_block'])}, fragmentation "
                f"{st['fragmentation']:.0%})"
            )
            if dev["trace_entries"]:
                mid = (
                    f", starts mid-run ({fmt_bytes(dev['allocated_before_trace'])} allocated before its first entry)"
                    if dev["trace_starts_mid_run"]
                    else ""
                )
                lines.append(f"  trace: {dev['trace_entries']} entries{mid}")
            peak = dev["peak"]
            if peak is not None:
                where = f" at entry #{peak['index']}" if peak["index"] is not None else " at the trace start"
                inside = f", inside {' > '.join(peak['annotations'])}" if peak["annotations"] else ""
                lines.append(
                    f"  peak: {fmt_bytes(peak['allocated'])} allocated (reserved {fmt_bytes(peak['reserved'])}){where}{inside}"
                )
                lines.extend(_point(peak, "    "))
            else:
                lines.append("  live allocations at the snapshot (no trace to replay):")
                lines.append(f"    by category: {_categories(st['by_category'])}")
                lines.extend(_sites(st["by_site"], "    "))
            if dev["logits_blocks"]:
                blocks = "; ".join(
                    f"{fmt_bytes(b['bytes'])} at {b['site']}" + (f" ({b['note']})" if b["note"] else "")
                    for b in dev["logits_blocks"][:4]
                )
                lines.append(f"    logits-sized blocks at the peak: {blocks}")
            for oom in dev["ooms"]:
                live = oom["live"]
                lines.append(
                    f"  OOM at entry #{oom['index']}: tried to allocate {fmt_bytes(oom['requested'])}, the device "
                    f"had {fmt_bytes(oom['device_free'])} free; {fmt_bytes(live['allocated'])} allocated, reserved "
                    f"{fmt_bytes(live['reserved'])}"
                )
                lines.extend(_point(live, "    "))
        lines.extend(f"  warning: {w}" for w in snap["warnings"])
    cmp = data.get("snapshot_comparison")
    if cmp:
        per_rank = ", ".join(f"rank {r} {fmt_bytes(a)}" for r, a in cmp["allocated"].items())
        lines.append(f"ranks compared at their peaks: {per_rank}")
        for a in cmp["rank_only"][:TOP]:
            where = a["site"] + (f" < {' < '.join(a['stack'][1:3])}" if len(a["stack"]) > 1 else "")
            others = "no other rank" if a["only_here"] else f"others at most {fmt_bytes(a['others_max'])}"
            lines.append(f"  rank {a['rank']} holds {fmt_bytes(a['bytes'])} of {a['category']} at {where} ({others})")
        if not cmp["rank_only"]:
            lines.append("  no rank holds anything the others do not")
    return lines


def _render_traces(data: dict[str, Any], verbose: bool = False) -> list[str]:
    lines: list[str] = []
    for rank, t in data.get("traces", {}).items():
        world = f", world size {t['world_size']}" if t["world_size"] else ""
        lines.append(
            f"kernel trace, rank {rank} ({t['device']}{', ' + t['backend'] if t['backend'] else ''}{world}): "
            f"{t['path']}"
        )
        d = t["durations"]
        what = "GPU kernels" if t["unit"] == "kernel" else "leaf CPU ops (no GPU kernels in this trace)"
        count = len(t["steps"])
        steps = f"{count} step{'s' if count != 1 else ''} in " if count else ""
        lanes = t["lanes"]
        summed = f" (summed over {lanes} {'devices' if t['unit'] == 'kernel' else 'threads'})" if lanes > 1 else ""
        lines.append(
            f"  {steps}{_ms(t['span_us'])}: {d['count']} {what}, busy {_ms(t['busy_us'])}, idle "
            f"{_ms(t['idle_us'])} in {t['idle_gaps']} gaps{summed}; compute {_ms(t['compute_us'])}, "
            f"communication {_ms(t['comm_us'])}"
        )
        under = "; ".join(
            f"under {float(th):g} us: {n} ({share:.1%} of the time)" for th, (n, share) in d["under"].items()
        )
        lines.append(f"  durations: median {_us(d['p50_us'])}, p90 {_us(d['p90_us'])}, max {_us(d['max_us'])}; {under}")
        for k in t["top"][: TOP // 2]:
            lines.append(
                f"    {_ms(k['total_us']):>10}  {k['count']:>6}x  median {_us(k['median_us']):>10}  {k['name'][:90]}"
            )
        if t["collective_ops"]:
            ops = ", ".join(f"{op} x{n} ({_ms(us)})" for op, (n, us) in t["collective_ops"].items())
            lines.append(f"  collectives: {ops}")
        hta = t["hta"]
        if hta:
            lines.append(
                f"  HTA: GPU idle {_ms(hta['idle_us'])}, compute {_ms(hta['compute_us'])}, non-compute "
                f"{_ms(hta['non_compute_us'])}; {hta['short_kernels']} of {hta['launches_matched']} "
                f"matched launches are short by HTA's rule (GPU time < launch time)"
            )
        elif t["hta_note"] and verbose:
            lines.append(f"  HTA: {t['hta_note']}")
        lines.extend(f"  warning: {w}" for w in t["warnings"])
    cmp = data.get("trace_comparison")
    if cmp:
        per_rank = "; ".join(
            f"rank {r['rank']} compute {_ms(r['compute_us'])}, comm {_ms(r['comm_us'])}" for r in cmp["ranks"]
        )
        lines.append(f"traces compared: {per_rank}")
        lines.append(f"  {'straggler: ' if cmp['straggler'] is not None else ''}{cmp['reason']}")
    return lines


def _entry(e: dict[str, Any]) -> str:
    sizes = f" {e['input_sizes']}" if e["input_sizes"] else ""
    dtypes = f" {'/'.join(e['input_dtypes'])}" if e["input_dtypes"] else ""
    return f"{e['op']}{sizes}{dtypes}"


def _called_from(chain: list[str]) -> str:
    """A flight-recorder entry's :func:`call_chain` (its stack from the call site out: the
    innermost frames are torch's own wrappers), as the site and the outermost frames the
    dump holds, toward or in the job's code (torch records a limited depth)."""
    shown = chain if len(chain) <= 5 else [*chain[:2], "...", *chain[-3:]]
    return " < ".join(shown)


def _render_flight(data: dict[str, Any]) -> list[str]:
    dumps = data.get("flight_records", {})
    if not dumps:
        return []
    backends = sorted({b for d in dumps.values() for b in d["backends"]})
    versions = sorted({d["version"] for d in dumps.values() if d["version"]})
    lines = [
        f"flight-recorder dumps: {ranks_named(int(r) for r in dumps)} ({'/'.join(backends) or 'backend unknown'}, "
        f"format {'/'.join(versions) or '?'})"
    ]
    for g in (data.get("flight_alignment") or {}).get("groups", []):
        window = f", #{g['window'][0]}..#{g['window'][1]} held by every rank" if g["window"] else ""
        lines.append(
            f"  group {g['group']}{' (' + g['desc'] + ')' if g['desc'] else ''}, ranks "
            f"{rank_ranges(g['expected_ranks']) if g['expected_ranks'] is not None else 'unknown'}{window}"
        )
        if g["missing_dumps"]:
            lines.append(f"    no dump from {ranks_named(g['missing_dumps'])}")
        for r, p in g["progress"].items():
            last = p["last_entry"]
            pending = (
                f" ({_entry(last)}{' at ' + str(call_site(last['frames'])) if last['frames'] else ''})"
                if p["pending"] and last
                else ""
            )
            lines.append(
                f"    rank {r}: last enqueued #{p['last_enqueued']}{pending}, started "
                f"{'#' + str(p['last_started']) if p['last_started'] is not None else '-'}, completed "
                f"#{p['last_completed']}"
            )
        for d in g["disagreements"][:3]:
            lines.append(f"    disagreement: {d['describe']}")
            if d["extra_on"]:
                lines.append(f"      {ranks_named(d['extra_on'])} ran one collective more than the other ranks here")
        first = g["disagreements"][0] if g["disagreements"] else None
        if first:
            for r, e in list(first["entries"].items()) + list(first["waiting_at"].items()):
                chain = call_chain(e["frames"])
                if len(chain) > 1:  # one frame: the site the line above names
                    lines.append(f"      rank {r} called from: {_called_from(chain)}")
        elif g["compared"]:
            lines.append(f"    the ranks agree on all {g['compared']} collectives they hold")
    for r, d in dumps.items():
        lines.extend(f"  warning (rank {r}): {w}" for w in d["warnings"])
    return lines


def _render_logs(data: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for log in data.get("logs", []):
        ranks = f", ranks {', '.join(map(str, log['ranks']))}" if log["ranks"] else ""
        lines.append(f"log {log['path']}: {log['lines']} lines{ranks}")

        def at(x: dict[str, Any]) -> str:
            return f"  line {x['line']}" + (f" (rank {x['rank']})" if x["rank"] is not None else "") + ": "

        for w in log["watchdog_timeouts"][:TOP]:
            numel = f", {w['numel_in']} elements" if w["numel_in"] is not None else ""
            lines.append(
                f"{at(w)}NCCL watchdog timeout on {w['op']} #{w['seq']}{numel}, after "
                f"{w['ran_ms']} ms (timeout {w['timeout_ms']} ms)"
            )
        for p in log["nccl_progress"][:TOP]:
            lines.append(f"{at(p)}last enqueued work #{p['last_enqueued']}, last completed #{p['last_completed']}")
        for o in log["ooms"][:TOP]:
            others = ", ".join(f"pid {pid} {fmt_bytes(b)}" for pid, b in o["other_processes"].items())
            lines.append(
                f"{at(o)}CUDA OOM: tried to allocate {fmt_bytes(o['requested'])}, free {fmt_bytes(o['free'])}, "
                f"allocated by PyTorch {fmt_bytes(o['allocated_by_pytorch'])}, reserved but unallocated "
                f"{fmt_bytes(o['reserved_unallocated'])}"
                + (f"; other processes on the GPU: {others}" if others else "")
            )
        for c in log["cache_flushes"][:TOP]:
            lines.append(f"{at(c)}DeepSpeed: {c['flushes']} allocator cache flushes since the last step")
        counts = log["counts"]
        for x in log["lines_of_note"][: TOP * 2]:
            lines.append(f"{at(x)}{x['kind']}: {x['text'][:160]}")
        if counts:
            lines.append("  counts: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
        else:
            lines.append("  no line lorascope knows (timeouts, OOMs, gradient warnings, cache flushes)")
    return lines


def render_artifacts(data: dict[str, Any], verbose: bool = False) -> str:
    """The loaded artifacts as text; ``verbose`` adds notes on what was not analysed (HTA
    on a CPU-only trace)."""
    lines = _render_snapshots(data) + _render_traces(data, verbose) + _render_flight(data) + _render_logs(data)
    return "\n".join(lines)
