"""Text rendering of a plan, from the same dict ``--json`` prints."""

from __future__ import annotations

from typing import Any

from lorascope.units import fmt_bytes


def _header(plan: dict[str, Any]) -> list[str]:
    model, lora, setup, params = plan["model"], plan["lora"], plan["setup"], plan["params"]
    source = f" ({model['source']})" if model["source"] else ""
    share = params["trainable"] / params["total"] if params["total"] else 0.0
    extras = [x for x, on in (("rsLoRA", lora["rslora"]), ("DoRA", lora["dora"])) if on]
    if lora["dropout"]:
        extras.append(f"dropout {lora['dropout']:g}")
    offload = [x for x, on in (("optimizer", setup["offload_optimizer"]), ("params", setup["offload_params"])) if on]
    fsdp = setup.get("fsdp")
    if fsdp:
        sharding = fsdp["label"] + (" + mixed precision" if fsdp["mixed_precision"] else "")
        sharding += " + CPU offload" if fsdp["offload_params"] else ""
    else:
        sharding = f"ZeRO-{setup['zero_stage']}{' + CPU offload of ' + ' and '.join(offload) if offload else ''}"
    return [
        f"{model['name']}{source}: {params['base']:,} parameters",
        f"LoRA r={lora['r']} alpha={lora['alpha']:g} on {lora['targets']}"
        + (f" ({', '.join(extras)})" if extras else "")
        + f": {lora['adapted_modules']} modules, {params['trainable']:,} trainable ({share:.2%})",
        f"{setup['precision']}{' + fp32 adapters' if setup['fp32_adapters'] else ''}, "
        f"{sharding} over {setup['world_size']} GPU(s) ({setup['nodes']} node(s) x {setup['gpus_per_node']}), "
        f"micro-batch {setup['micro_batch']} x seq {setup['seq']}, checkpointing {setup['checkpointing']}, "
        f"{setup['attention']} attention, {setup['loss']} loss",
    ]


def render_text(plan: dict[str, Any]) -> str:
    card = plan["gpu_mem_bytes"]
    width = max(len(t["label"]) for t in plan["terms"]) + 2
    lines = _header(plan) + ["", f"  {'per GPU':<{width}}{'':>12}  how"]
    for term in plan["terms"]:
        figure = fmt_bytes(term["bytes"], 2) if term["counted"] else f"({fmt_bytes(term['bytes'], 2)})"
        how = term["detail"] if term["counted"] else "not at the peak: the larger of it and the logits counts"
        lines.append(f"  {term['label']:<{width}}{figure:>12}  {how}")
    total = plan["total_bytes"]
    lines.append("  " + "-" * (width + 14))
    lines.append(
        f"  {'peak':<{width}}{fmt_bytes(total, 2):>12}  of {fmt_bytes(card, 2)} ({total / card:.0%}); "
        f"torch allocator part {fmt_bytes(plan['allocated_bytes'], 2)}"
    )
    headroom = card - total
    room = f"{fmt_bytes(headroom, 2)} headroom" if headroom >= 0 else f"{fmt_bytes(-headroom, 2)} over"
    lines += ["", f"verdict: {plan['verdict']} ({room})"]
    if plan["changes"]:
        lines += ["", "changes that lower the peak (new total per GPU):"]
        for n, change in enumerate(plan["changes"], 1):
            lines.append(f"  {n}. {change['label']}: {fmt_bytes(change['total_bytes'], 2)}, {change['verdict']}")
            lines.append(f"     {change['how']}")
    if plan["notes"]:
        lines += ["", "notes:"] + [f"  - {note}" for note in plan["notes"]]
    return "\n".join(lines)
