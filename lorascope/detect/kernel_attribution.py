"""Kernels (ops on CPU) attributed to LoRA or base modules, as a kernel table (the shape
:mod:`lorascope.report.kernels` documents), from Kineto Chrome-trace JSON: what the
tiny-kernel-tail detector judges and the report draws. Attribution to LoRA follows the probes' annotations
(``lorascope.module::<qualified name>`` ranges, see ``lorascope/probes/kernels.py``):

- a forward op gets the innermost module range around it (``...q_proj.lora_A.default``
  -> ``lora_A``; other ``lora_*`` parts -> ``lora``; any other module -> ``base``);
- a backward op has no module range around it, but its autograd node
  (``autograd::engine::evaluate_function: XBackward0``) carries the ``Sequence number`` of
  the forward op that created it: it and everything under it get that op's module;
- a GPU kernel gets the module of the CPU launch with the same ``correlation``.

On a CPU-only trace the "kernels" are the leaf CPU ops (ops with no op under them), so
nested ops are not counted twice.
"""

from __future__ import annotations

from typing import Any

MODULE_PREFIX = "lorascope.module::"
#: torch's step ranges (with a profiler schedule) and the probes' own.
STEP_RANGES = ("ProfilerStep#", "lorascope.step#")
BACKWARD_PREFIX = "autograd::engine::evaluate_function"
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver", "hip_runtime", "hip_driver"})


def module_class(qualified: str) -> str:
    parts = qualified.split(".")
    if "lora_A" in parts:
        return "lora_A"
    if "lora_B" in parts:
        return "lora_B"
    if any(p.startswith("lora_") for p in parts):
        return "lora"
    return "base"


def _correlation(event: dict[str, Any]) -> int | str | None:
    args = event.get("args")
    value = args.get("correlation") if isinstance(args, dict) else None
    return value if isinstance(value, (int, str)) else None


def _sequence(event: dict[str, Any]) -> int | None:
    args = event.get("args")
    seq = args.get("Sequence number") if isinstance(args, dict) else None
    return seq if isinstance(seq, int) and not isinstance(seq, bool) else None


def _attribute(events: list[dict[str, Any]]) -> tuple[list[tuple[dict[str, Any], str | None]], dict[Any, str | None]]:
    """Leaf CPU ops with their module, and the module of every GPU launch by correlation."""
    spans = sorted(
        (
            e
            for e in events
            if e.get("ph") == "X" and isinstance(e.get("ts"), (int, float)) and isinstance(e.get("dur"), (int, float))
        ),
        key=lambda e: (e["ts"], -e["dur"]),
    )
    stacks: dict[tuple[str, str], list[list[Any]]] = {}
    seq_module: dict[int, str | None] = {}
    leaves: list[list[Any]] = []
    launches: dict[Any, str | None] = {}
    for e in spans:
        stack = stacks.setdefault((repr(e.get("pid")), repr(e.get("tid"))), [])  # any JSON value
        while stack and stack[-1][0] <= e["ts"]:
            stack.pop()
        ctx = stack[-1][1] if stack else None
        cat, name = e.get("cat"), str(e.get("name", ""))
        if cat == "user_annotation" and name.startswith(MODULE_PREFIX):
            ctx = module_class(name[len(MODULE_PREFIX) :])
        elif cat == "cpu_op":
            seq = _sequence(e)
            if name.startswith(BACKWARD_PREFIX) and seq is not None:
                ctx = seq_module.get(seq, ctx)
            elif seq is not None and ctx is not None:
                seq_module.setdefault(seq, ctx)
            if stack and stack[-1][2] is not None:
                stack[-1][2][2] = False  # the enclosing op has an op under it: not a leaf
            node = [e, ctx, True]
            leaves.append(node)
            stack.append([e["ts"] + e["dur"], ctx, node])
            continue
        elif isinstance(cat, str) and cat in LAUNCH_CATEGORIES:  # any JSON value
            correlation = _correlation(e)
            if correlation is not None:
                launches[correlation] = ctx
        stack.append([e["ts"] + e["dur"], ctx, None])
    return [(n[0], n[1]) for n in leaves if n[2]], launches


def table_from_trace(trace: dict[str, Any], source: str | None = None) -> dict[str, Any] | None:
    """One rank's entry of a kernel table, or None when the trace holds no op or kernel."""
    events = trace.get("traceEvents")
    if not isinstance(events, list):
        return None
    events = [e for e in events if isinstance(e, dict)]
    leaf_ops, launches = _attribute(events)
    kernels = [
        e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X" and isinstance(e.get("dur"), (int, float))
    ]
    rows: dict[tuple[str, str | None], list[float]] = {}
    if kernels:
        unit = "kernel"
        for k in kernels:
            module = launches.get(_correlation(k))
            rows.setdefault((str(k.get("name")), module), []).append(round(float(k["dur"]), 3))
    else:
        unit = "op"
        for e, module in leaf_ops:
            rows.setdefault((str(e.get("name")), module), []).append(round(float(e["dur"]), 3))
    if not rows:
        return None
    steps = sum(1 for e in events if str(e.get("name", "")).startswith(STEP_RANGES))
    return {
        "unit": unit,
        "source": source,
        "steps": steps or None,
        "rows": [
            {"name": n, "module": m, "durations_us": d}
            for (n, m), d in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1] or ""))
        ],
    }


def table_from_traces(traces: dict[int, Any], threshold_us: float) -> dict[str, Any] | None:
    """A kernel table over every rank's trace (KinetoTrace objects or raw JSON dicts)."""
    ranks: dict[str, Any] = {}
    for rank, trace in sorted(traces.items()):
        raw = trace if isinstance(trace, dict) else getattr(trace, "raw", None)
        source = None if isinstance(trace, dict) else str(getattr(trace, "path", "")) or None
        entry = table_from_trace(raw, source) if isinstance(raw, dict) else None
        if entry is not None:
            ranks[str(rank)] = entry
    if not ranks:
        return None
    units = {e.pop("unit") for e in ranks.values()}
    return {"unit": "kernel" if "kernel" in units else "op", "threshold_us": threshold_us, "ranks": ranks}


#: Tiny: a GPU kernel shorter than a kernel launch (~5 us on current GPUs and drivers) ...
TINY_GPU_US = 5.0
#: ... or a CPU op shorter than the ~10 us of Python and dispatcher overhead around it.
TINY_CPU_US = 10.0


def tiny_threshold_us(traces: dict[int, Any]) -> float:
    """What counts as tiny in these traces: GPU kernels if any trace has them, else CPU ops."""
    gpu = any(getattr(t, "unit", "op") == "kernel" for t in traces.values())
    return TINY_GPU_US if gpu else TINY_CPU_US
