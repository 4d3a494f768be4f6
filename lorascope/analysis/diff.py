"""`lorascope diff A B` as plain data: what differs between two analyses.

Two run directories: the configuration first (LoRA, sharding, batch shape, world size,
versions, the launch command, then any other recorded config key that differs), then
what the runs did: per-rank peak memory and the memory plan's terms that moved, step
time by phase, collectives per step by op and bytes, and the findings new, gone or
changed in severity with the evidence of both runs. Two artifacts of one kind (allocator
snapshots, Kineto traces, flight-recorder dumps, logs): their figures that differ, and
the findings. Everything is read through :func:`lorascope.analysis.analyze` (the
:class:`Analysis` of each side); runs of different lengths or world sizes are compared
on the ranks and steps they share, and ``shared.notes`` says so.

The terminal (:mod:`lorascope.text.diff`), ``--json`` and the HTML page
(:mod:`lorascope.report.diff`) all show this data.
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
from collections.abc import Iterable, Iterator
from typing import Any

from lorascope.analysis import Analysis
from lorascope.analysis.artifacts import artifacts_data
from lorascope.detect.finding import CONFIDENCE_ORDER, SEVERITY_ORDER, Finding
from lorascope.detect.plan_deviation import batch_shape, plan_for_rank
from lorascope.errors import UsageError
from lorascope.rundir.loading.reader import RankData, RunData
from lorascope.units import rank_ranges

#: A peak "moved" when it changed by more than this share and this many bytes (a plan
#: term: by more than the share).
MOVED_SHARE = 0.01
MOVED_BYTES = 1 << 20
#: Differing keys of a flattened config or artifact listed at most (the JSON says how many more).
MAX_ROWS = 200
#: Ranks whose peak moved most, listed by the terminal and the page (the JSON has every rank).
MAX_MEMORY_ROWS = 8

#: The configuration keys an on-call engineer compares first, in this order: (label, path).
HEADLINE_KEYS: tuple[tuple[str, str], ...] = (
    ("world size", "world_size"),
    ("LoRA r", "lora.r"),
    ("LoRA alpha", "lora.lora_alpha"),
    ("LoRA dropout", "lora.lora_dropout"),
    ("LoRA targets", "lora.target_modules"),
    ("sharding", "sharding.engine"),
    ("ZeRO stage", "deepspeed.zero_optimization.stage"),
    ("micro-batch (measured)", "measured.micro_batch"),
    ("sequence length (measured)", "measured.seq"),
    ("micro-batch (DeepSpeed config)", "deepspeed.train_micro_batch_size_per_gpu"),
    ("gradient accumulation", "deepspeed.gradient_accumulation_steps"),
    ("activation checkpointing", "checkpointing"),
    ("model", "model.model_type"),
    ("hidden size", "model.hidden_size"),
    ("layers", "model.num_hidden_layers"),
    ("vocabulary", "model.vocab_size"),
    ("torch", "versions.torch"),
    ("deepspeed", "versions.deepspeed"),
    ("transformers", "versions.transformers"),
    ("peft", "versions.peft"),
    ("python", "versions.python"),
    ("lorascope", "versions.lorascope"),
    ("command", "command"),
)


def _flatten(value: Any, prefix: str, out: dict[str, Any], depth: int = 0) -> None:
    """Nested dicts as dotted keys; lists and scalars are values."""
    if isinstance(value, dict) and depth < 8:
        for k in sorted(value, key=str):
            _flatten(value[k], f"{prefix}.{k}" if prefix else str(k), out, depth + 1)
    else:
        out[prefix] = value


def _targets(names: Any) -> Any:
    """PEFT's target modules as the distinct module names (``q_proj``), whatever the
    layer: a job lists them per layer or by name, the comparison is of what is adapted."""
    if isinstance(names, list):
        return sorted({str(n).rsplit(".", 1)[-1] for n in names})
    return names


def _lora(configs: dict[str, Any]) -> dict[str, Any]:
    lora = configs.get("lora")
    if not isinstance(lora, dict):
        return {}
    if "r" not in lora:  # the probes' record: adapter name -> LoraConfig.to_dict()
        adapters = {k: v for k, v in lora.items() if isinstance(v, dict)}
        lora = adapters.get("default") or (next(iter(adapters.values())) if len(adapters) == 1 else lora)
    return {**lora, "target_modules": _targets(lora.get("target_modules"))}


def run_config(analysis: Analysis) -> dict[str, Any]:
    """A run's configuration as flat ``path -> value`` (the lowest rank's records)."""
    run, summary = analysis.bundle.run, analysis.summary
    assert run is not None and summary is not None
    manifest = summary["manifest"]
    first = next(iter(run.ranks.values()), None)
    configs = dict(manifest["configs"])
    flat: dict[str, Any] = {"world_size": manifest["world_size"]}
    sharding = manifest.get("sharding") or {}
    flat["sharding.engine"] = sharding.get("engine")
    ckpt = sharding.get("checkpointing")
    flat["checkpointing"] = (
        "none" if not ckpt else "reentrant" if True in ckpt.get("use_reentrant", []) else "non-reentrant"
    )
    _flatten(_lora(configs), "lora", flat)
    for name in sorted(configs):
        if name != "lora":
            _flatten(configs[name], name, flat)
    _flatten(manifest.get("versions") or {}, "versions", flat)
    shape = batch_shape(first) if first is not None else None
    flat["measured.micro_batch"], flat["measured.seq"] = shape if shape is not None else (None, None)
    launches = manifest["launches"]
    flat["command"] = " ".join(launches[0]["command"]) if launches else None
    return flat


def _config_rows(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    headline = dict(HEADLINE_KEYS)
    first = [
        {"label": label, "name": key, "a": a.get(key), "b": b.get(key)}
        for label, key in HEADLINE_KEYS
        if a.get(key) != b.get(key)
    ]
    shown = set(headline.values())
    rest = [
        {"label": key, "name": key, "a": a.get(key), "b": b.get(key)}
        for key in sorted(set(a) | set(b))
        if key not in shown and a.get(key) != b.get(key)
    ]
    same = sum(1 for key in set(a) | set(b) if a.get(key) == b.get(key))
    return {"headline": first, "other": rest[:MAX_ROWS], "other_more": max(0, len(rest) - MAX_ROWS), "same": same}


def _completed(rank: RankData) -> int:
    return max((int(s["step"]) for s in rank.steps), default=0)


def _shared(a: RunData, b: RunData) -> dict[str, Any]:
    ranks = sorted(set(a.ranks) & set(b.ranks))
    steps = {
        "a": min((_completed(r) for r in a.ranks.values()), default=0),
        "b": min((_completed(r) for r in b.ranks.values()), default=0),
    }
    shared_steps = min(steps["a"], steps["b"])
    notes: list[str] = []
    if set(a.ranks) != set(b.ranks):
        notes.append(
            f"A has {len(a.ranks)} rank(s), B {len(b.ranks)}: per-rank figures compare the {len(ranks)} "
            f"they share ({rank_ranges(ranks) or 'none'})"
        )
    if steps["a"] != steps["b"]:
        notes.append(
            f"A completed {steps['a']} step(s) on every rank, B {steps['b']}: step and collective figures "
            f"compare steps 1-{shared_steps}"
        )
    return {"ranks": ranks, "steps": shared_steps, "completed": steps, "notes": notes}


def _metric(a: dict[str, Any], b: dict[str, Any]) -> str:
    """The peak both runs have: the CUDA allocator's, else RSS."""
    both = [r["peak_memory"] for r in (*a["ranks"], *b["ranks"])]
    if both and all(p.get("cuda_max_allocated_bytes") is not None for p in both):
        return "cuda_max_allocated_bytes"
    return "rss_bytes"


def _moved(a: float | None, b: float | None, floor: int = MOVED_BYTES) -> bool:
    """Changed by more than MOVED_SHARE and ``floor`` bytes (a measured peak moves by noise;
    a plan's terms are computed: any change of theirs is one)."""
    if a is None or b is None:
        return a != b
    return abs(b - a) > max(floor, MOVED_SHARE * max(abs(a), 1))


def _memory(sa: dict[str, Any], sb: dict[str, Any], ranks: list[int]) -> dict[str, Any]:
    metric = _metric(sa, sb)
    pa = {r["rank"]: r["peak_memory"].get(metric) for r in sa["ranks"]}
    pb = {r["rank"]: r["peak_memory"].get(metric) for r in sb["ranks"]}
    rows: list[dict[str, Any]] = []
    for rank in ranks:
        va, vb = pa.get(rank), pb.get(rank)
        delta = vb - va if va is not None and vb is not None else None
        rows.append({"rank": rank, "a": va, "b": vb, "delta": delta, "moved": _moved(va, vb)})
    deltas = [r["delta"] for r in rows if r["delta"] is not None]
    top = sorted((r for r in rows if r["delta"] is not None), key=lambda r: -abs(r["delta"]))[:MAX_MEMORY_ROWS]
    return {
        "metric": metric.removesuffix("_bytes"),
        "ranks": rows,
        "largest": sorted(top, key=lambda r: r["rank"]),
        "median_delta": statistics.median(deltas) if deltas else None,
        "moved_ranks": [r["rank"] for r in rows if r["moved"]],
    }


def _plan_terms(a: RunData, b: RunData) -> dict[str, Any]:
    """The memory plan of each run's lowest rank (its own configs and measured batch shape,
    as the plan-deviation detector builds it), the terms that moved."""
    plans = [plan_for_rank(next(iter(run.ranks.values()))) if run.ranks else None for run in (a, b)]
    pa, pb = plans
    if pa is None or pb is None:
        missing = " and ".join(side for side, p in zip("AB", plans, strict=True) if p is None)
        return {
            "available": False,
            "why": f"no plan for {missing}: its model or LoRA config or batch shape was not recorded",
            "terms": [],
        }
    ta, tb = {t.key: t for t in pa.terms}, {t.key: t for t in pb.terms}
    terms = []
    for key in [*ta, *(k for k in tb if k not in ta)]:
        va, vb = (ta[key].bytes if key in ta else None), (tb[key].bytes if key in tb else None)
        if _moved(va, vb, floor=0):
            term = ta.get(key) or tb[key]
            terms.append(
                {
                    "name": key,
                    "label": term.label,
                    "a": va,
                    "b": vb,
                    "delta": None if va is None or vb is None else vb - va,
                }
            )
    return {"available": True, "why": None, "terms": terms, "total": {"a": pa.total, "b": pb.total}}


def _phase_times(rank: RankData, last_step: int) -> dict[str, list[float]]:
    """Phase name -> the seconds of each of its spans in steps 2..last_step (step 1 warms up)."""
    open_: dict[str, float] = {}
    out: dict[str, list[float]] = {}
    for p in rank.phases:
        step = int(p["step"]) + 1  # the step the edge is in
        name = str(p["name"])
        if p["edge"] == "begin":
            open_[name] = float(p["t"])
        elif name in open_:
            began = open_.pop(name)
            if 2 <= step <= last_step:
                out.setdefault(name, []).append(float(p["t"]) - began)
    return out


def _median(values: Iterable[float]) -> float | None:
    values = list(values)
    return statistics.median(values) if values else None


def _side_steps(run: RunData, ranks: list[int], last_step: int) -> dict[str, Any]:
    durs = [float(s["dur"]) for n in ranks for s in run.ranks[n].steps if 2 <= int(s["step"]) <= last_step]
    phases: dict[str, list[float]] = {}
    for n in ranks:
        for name, spans in _phase_times(run.ranks[n], last_step).items():
            phases.setdefault(name, []).extend(spans)
    return {"step": _median(durs), "phases": {k: _median(v) for k, v in phases.items()}}


def _ratio(a: float | None, b: float | None) -> float | None:
    return b / a if a and b is not None else None


def _steps(a: RunData, b: RunData, shared: dict[str, Any]) -> dict[str, Any]:
    last = shared["steps"]
    sa, sb = (_side_steps(run, shared["ranks"], last) for run in (a, b))
    names = [n for n in ("forward", "backward", "optimizer", "eval", "save") if n in sa["phases"] or n in sb["phases"]]
    names += sorted((set(sa["phases"]) | set(sb["phases"])) - set(names))
    rows = [
        {
            "phase": n,
            "a": sa["phases"].get(n),
            "b": sb["phases"].get(n),
            "ratio": _ratio(sa["phases"].get(n), sb["phases"].get(n)),
        }
        for n in names
    ]
    return {
        "steps_compared": [2, last] if last >= 2 else None,
        "step": {"a": sa["step"], "b": sb["step"], "ratio": _ratio(sa["step"], sb["step"])},
        "phases": rows,
    }


def _whole_steps(rank: RankData, steps: range) -> set[int]:
    """The steps of ``steps`` whose every call the reader kept on this rank: a long run's
    calls are kept from its start and its end (:mod:`lorascope.rundir.loading.reduce`); a step in
    the gap, or cut by it, is not whole. A call made in step S counted S - 1 steps."""
    by_group: dict[str, list[tuple[int, int]]] = {}
    for c in rank.collectives:
        by_group.setdefault(c.group, []).append((c.seq, c.step + 1))
    whole = set(steps)
    for group, calls in by_group.items():
        tally = rank.tallies.get(group)
        if tally is None or tally.tail_first is None or tally.tail_first <= tally.head_last + 1:
            continue  # every call of the group kept (the newest ones follow the first ones)
        calls.sort()
        seqs = [seq for seq, _ in calls]
        in_step = list(itertools.accumulate((step for _, step in calls), max))
        for step in list(whole):
            before, after = bisect.bisect_left(in_step, step), bisect.bisect_right(in_step, step)
            lo = seqs[before - 1] + 1 if before else 1
            hi = seqs[after] - 1 if after < len(seqs) else tally.last_seq
            if not tally.holds(lo, hi):
                whole.discard(step)
    return whole


def _side_collectives(run: RunData, ranks: list[int], last_step: int) -> tuple[dict[str, list[float]], int, bool]:
    """Op -> [calls, bytes] over the calls made in steps 2..last_step of ``ranks`` that the
    reader kept whole, the rank-steps they cover, and whether some steps were not whole."""
    by_op: dict[str, list[float]] = {}
    covered, cut = 0, False
    for n in ranks:
        rank = run.ranks[n]
        whole = _whole_steps(rank, range(2, last_step + 1))
        covered += len(whole)
        cut = cut or len(whole) < max(0, last_step - 1)
        for c in rank.collectives:
            if c.step + 1 in whole:
                row = by_op.setdefault(c.op, [0, 0])
                row[0] += 1
                row[1] += c.bytes or 0
    return by_op, covered, cut


def _collectives(a: RunData, b: RunData, shared: dict[str, Any]) -> dict[str, Any]:
    last = shared["steps"]
    (ca, na, cut_a), (cb, nb, cut_b) = (_side_collectives(run, shared["ranks"], last) for run in (a, b))
    rows = []
    for op in sorted(set(ca) | set(cb)):
        xa, xb = ca.get(op, [0, 0]), cb.get(op, [0, 0])
        row: dict[str, Any] = {
            "op": op,
            "a_calls": xa[0] / na if na else None,
            "b_calls": xb[0] / nb if nb else None,
            "a_bytes": xa[1] / na if na else None,
            "b_bytes": xb[1] / nb if nb else None,
        }
        row["changed"] = any(not _close(row[f"a_{k}"], row[f"b_{k}"]) for k in ("calls", "bytes"))
        rows.append(row)
    return {
        "per_rank_step": rows,
        "steps_compared": [2, last] if last >= 2 else None,
        "decimated": cut_a or cut_b,
        "rank_steps": {"a": na, "b": nb},
    }


def _close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a == b
    return math.isclose(a, b, rel_tol=0.01, abs_tol=1e-9)


def _finding_row(f: Finding) -> dict[str, Any]:
    return {
        "id": f.id,
        "title": f.title,
        "severity": f.severity,
        "confidence": f.confidence,
        "ranks": f.ranks,
        "evidence": [{"label": e.label, "value": e.value, "source": e.source} for e in f.evidence],
    }


def _by_id(findings: list[Finding]) -> dict[str, list[Finding]]:
    out: dict[str, list[Finding]] = {}
    for f in findings:
        out.setdefault(f.id, []).append(f)
    return out


def _pairs(a: list[Finding], b: list[Finding]) -> Iterator[tuple[Finding | None, Finding | None]]:
    """A detector's findings of both sides paired: the same ranks first, then in order."""
    rest_b = list(b)
    unpaired = []
    for f in a:
        match = next((g for g in rest_b if g.ranks == f.ranks), None)
        if match is not None:
            rest_b.remove(match)
            yield f, match
        else:
            unpaired.append(f)
    for i, f in enumerate(unpaired):
        yield f, rest_b[i] if i < len(rest_b) else None
    for g in rest_b[len(unpaired) :]:
        yield None, g


def findings_diff(a: list[Finding], b: list[Finding]) -> dict[str, Any]:
    """Findings new in B, gone from A, changed in severity or confidence, and unchanged."""
    ia, ib = _by_id(a), _by_id(b)
    new, gone, changed, same = [], [], [], []
    for fid in [*ia, *(k for k in ib if k not in ia)]:
        for fa, fb in _pairs(ia.get(fid, []), ib.get(fid, [])):
            if fa is None and fb is not None:
                new.append(_finding_row(fb))
            elif fb is None and fa is not None:
                gone.append(_finding_row(fa))
            elif fa is not None and fb is not None:
                if (fa.severity, fa.confidence, fa.ranks) != (fb.severity, fb.confidence, fb.ranks):
                    changed.append({"id": fid, "a": _finding_row(fa), "b": _finding_row(fb), "worse": _worse(fa, fb)})
                else:
                    same.append({"id": fid, "title": fb.title, "severity": fb.severity})
    return {"new": new, "gone": gone, "changed": changed, "same": same}


def _worse(a: Finding, b: Finding) -> bool | None:
    """True when B's is more severe (or as severe and surer), False when less, None when even."""
    ka = (SEVERITY_ORDER[a.severity], CONFIDENCE_ORDER[a.confidence])
    kb = (SEVERITY_ORDER[b.severity], CONFIDENCE_ORDER[b.confidence])
    return None if ka == kb else kb > ka


def _kinds(analysis: Analysis) -> list[str]:
    """What the analysis read: a run directory, or the kinds of its artifacts."""
    bundle = analysis.bundle
    if bundle.run is not None:
        return ["run"]
    kinds = [
        name
        for name, present in (
            ("snapshot", bundle.snapshots),
            ("trace", bundle.traces),
            ("flight", bundle.flight_records),
            ("log", bundle.logs),
        )
        if present
    ]
    return kinds or ["nothing"]


KIND_NAMES = {
    "run": "a run directory",
    "snapshot": "allocator snapshot(s)",
    "trace": "Kineto trace(s)",
    "flight": "flight-recorder dump(s)",
    "log": "job log(s)",
    "nothing": "nothing lorascope reads",
}


def _side(analysis: Analysis, kind: str) -> dict[str, Any]:
    side: dict[str, Any] = {"path": str(analysis.bundle.path), "kind": kind, "warnings": list(analysis.bundle.warnings)}
    summary = analysis.summary
    if summary is not None:
        side["world_size"] = summary["manifest"]["world_size"]
        side["ranks"] = len(summary["ranks"])
        side["running"] = summary["running"]
        side["top"] = _finding_row(analysis.findings[0]) if analysis.findings else None
    return side


#: Fields that name an entry of a list of records (an artifact's devices, allocation sites,
#: kernels): the entry is compared with the other side's entry of the same name.
_NAMING_FIELDS = ("device", "site", "name", "rank", "op", "group", "category")
#: The value of an entry itself: present on one side only, it is one row (its fields are not listed).
ENTRY = "(present)"
#: Entries of a list of records compared at most (the list's length is always compared).
MAX_ENTRIES = 50


def _entry_name(i: int, entry: Any) -> str:
    if isinstance(entry, dict):
        for f in _NAMING_FIELDS:
            if isinstance(entry.get(f), (str, int)):
                return f"[{entry[f]}]"
    return f"[{i}]"


def _scalars(value: Any, prefix: str, out: dict[str, Any], depth: int = 0) -> None:
    """Numbers and strings of nested data as dotted keys; a list as its length, and a list
    of records entry by entry, each named by its naming field (artifacts' figures are
    what is compared, not their order)."""
    if depth >= 8:
        return
    if isinstance(value, dict):
        for k in sorted(value, key=str):
            _scalars(value[k], f"{prefix}.{k}" if prefix else str(k), out, depth + 1)
    elif isinstance(value, list):
        out[f"{prefix} (count)"] = len(value)
        if value and all(isinstance(v, dict) for v in value):
            for i, entry in enumerate(value[:MAX_ENTRIES]):
                name = prefix + _entry_name(i, entry)
                out[name] = ENTRY
                _scalars(entry, name, out, depth + 1)
    elif value is None or isinstance(value, (int, float, str, bool)):
        out[prefix] = value


def _artifact_rows(a: Analysis, b: Analysis) -> dict[str, Any]:
    fa: dict[str, Any] = {}
    fb: dict[str, Any] = {}
    _scalars(artifacts_data(a.bundle), "", fa)
    _scalars(artifacts_data(b.bundle), "", fb)
    paths = {"path", "file", "files", "source"}
    one_side = {k for k in set(fa) ^ set(fb) if (fa.get(k) or fb.get(k)) == ENTRY}

    def inside_one_side(key: str) -> bool:
        return any(key.startswith(entry) and key != entry for entry in one_side)

    keys = [
        k
        for k in sorted(set(fa) | set(fb))
        if fa.get(k) != fb.get(k) and k.rsplit(".", 1)[-1] not in paths and not inside_one_side(k)
    ]
    rows = [{"name": k, "a": fa.get(k), "b": fb.get(k)} for k in keys]
    return {"rows": rows[:MAX_ROWS], "more": max(0, len(rows) - MAX_ROWS), "same": len(set(fa) | set(fb)) - len(keys)}


def build_diff(a: Analysis, b: Analysis) -> dict[str, Any]:
    """The diff of two analyses as plain data (``lorascope diff --json`` prints it)."""
    ka, kb = _kinds(a), _kinds(b)
    both = [k for k in ka if k in kb and k != "nothing"]
    if not both:
        raise UsageError(
            f"diff compares two of one kind: A ({a.bundle.path}) holds "
            f"{' and '.join(KIND_NAMES[k] for k in ka)}, B ({b.bundle.path}) {' and '.join(KIND_NAMES[k] for k in kb)}"
        )
    kind = "+".join(both)
    data: dict[str, Any] = {
        "kind": kind,
        "a": _side(a, kind),
        "b": _side(b, kind),
        "findings": findings_diff(a.findings, b.findings),
    }
    if kind != "run":
        data["artifacts"] = _artifact_rows(a, b)
        return data
    ra, rb = a.bundle.run, b.bundle.run
    assert ra is not None and rb is not None and a.summary is not None and b.summary is not None
    shared = _shared(ra, rb)
    data["shared"] = shared
    data["config"] = _config_rows(run_config(a), run_config(b))
    data["memory"] = _memory(a.summary, b.summary, shared["ranks"])
    data["plan"] = _plan_terms(ra, rb)
    data["steps"] = _steps(ra, rb, shared)
    data["collectives"] = _collectives(ra, rb, shared)
    return data
