"""`lorascope diff` on a terminal: one page, configuration first (the data is
:func:`lorascope.analysis.diff.build_diff`'s)."""

from __future__ import annotations

from typing import Any

from lorascope.units import fmt_bytes, rank_ranges

#: Longest value shown in a configuration row (a command line is cut with "...").
VALUE_WIDTH = 60
#: Evidence rows shown per finding and side.
EVIDENCE_ROWS = 4


def _value(v: Any, width: int = VALUE_WIDTH) -> str:
    if v == "":
        return '""'
    if isinstance(v, list):
        text = ", ".join(str(x) for x in v) if v else "[]"
    elif v is None:
        text = "-"
    else:
        text = str(v)
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def differing_words(a: str, b: str) -> tuple[str, str]:
    """Two command lines cut to the words where they differ (the common words before and
    after as "..."): ``... --lora-r 8`` and ``... --lora-r 64``."""
    wa, wb = a.split(), b.split()
    head = 0
    while head < min(len(wa), len(wb)) and wa[head] == wb[head]:
        head += 1
    tail = 0
    while tail < min(len(wa), len(wb)) - head and wa[-1 - tail] == wb[-1 - tail]:
        tail += 1
    cut = [" ".join((["..."] if head else []) + w[head : len(w) - tail] + (["..."] if tail else [])) for w in (wa, wb)]
    return cut[0], cut[1]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def _ratio(r: float | None) -> str:
    return "" if r is None else f"x{r:.2f}"


def _signed_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    return ("+" if n >= 0 else "-") + fmt_bytes(abs(n))


def _per_step(n: float | None) -> str:
    return "-" if n is None else f"{n:.1f}".removesuffix(".0")


def _header(data: dict[str, Any]) -> list[str]:
    a, b = data["a"], data["b"]
    lines = [f"lorascope diff: A {a['path']}", f"            -> B {b['path']}"]
    shared = data.get("shared")
    if shared is not None:
        ranks = shared["ranks"]
        lines.append(
            f"compared on {len(ranks)} rank(s) ({rank_ranges(ranks) or 'none'}) and steps 1-{shared['steps']}"
            if shared["steps"]
            else f"compared on {len(ranks)} rank(s) ({rank_ranges(ranks) or 'none'}); no step both completed"
        )
        lines.extend(f"note: {n}" for n in shared["notes"])
    for side in ("a", "b"):
        if data[side].get("running"):
            lines.append(f"note: {side.upper()} is still running: its figures are those so far")
        lines.extend(f"warning ({side.upper()}): {w}" for w in data[side]["warnings"][:3])
    return lines


def _config(config: dict[str, Any]) -> list[str]:
    rows = config["headline"] + config["other"]
    lines = [f"Configuration ({len(rows) + config['other_more']} differ, {config['same']} the same)"]
    if not rows:
        lines.append("  the same")
    for r in rows:
        a, b = _value(r["a"]), _value(r["b"])
        if r["name"] == "command" and isinstance(r["a"], str) and isinstance(r["b"], str):
            a, b = (_value(x) for x in differing_words(r["a"], r["b"]))
        if len(a) + len(b) <= 44:
            lines.append(f"  {r['label'][:30]:<30} {a} -> {b}")
        else:
            lines.extend([f"  {r['label']}", f"    A {a}", f"    B {b}"])
    if config["other_more"]:
        lines.append(f"  ... and {config['other_more']} more (--json)")
    return lines


def _memory(memory: dict[str, Any]) -> list[str]:
    lines = [f"Peak memory per rank ({memory['metric']})"]
    moved = memory["moved_ranks"]
    lines.append(
        f"  median change {_signed_bytes(memory['median_delta'])}; "
        + (
            f"moved (>1% and >1 MiB) on {len(moved)} rank(s): {rank_ranges(moved)}"
            if moved
            else "no rank moved (>1% and >1 MiB)"
        )
    )
    for r in memory["largest"]:
        share = f", {r['delta'] / r['a'] * 100:+.1f}%" if r["a"] and r["delta"] is not None else ""
        lines.append(
            f"  rank {r['rank']:<5} {fmt_bytes(r['a'])} -> {fmt_bytes(r['b'])} ({_signed_bytes(r['delta'])}{share})"
        )
    return lines


def _plan(plan: dict[str, Any]) -> list[str]:
    if not plan["available"]:
        return [f"Memory plan: {plan['why']}"]
    total = plan["total"]
    lines = [f"Memory plan (lowest rank's configs): total {fmt_bytes(total['a'])} -> {fmt_bytes(total['b'])}"]
    if not plan["terms"]:
        lines.append("  no term moved")
    for t in plan["terms"]:
        lines.append(f"  {t['label'][:34]:<34} {fmt_bytes(t['a'])} -> {fmt_bytes(t['b'])}")
    return lines


def _steps(steps: dict[str, Any]) -> list[str]:
    window = steps["steps_compared"]
    if window is None:
        return ["Step time: fewer than 2 steps both completed (step 1 warms up)"]
    s = steps["step"]
    lines = [f"Step time (median over ranks and steps {window[0]}-{window[1]})"]
    lines.append(f"  {'step':<12} {_ms(s['a']):>8} -> {_ms(s['b']):<8} {_ratio(s['ratio'])}")
    for p in steps["phases"]:
        lines.append(f"  {p['phase']:<12} {_ms(p['a']):>8} -> {_ms(p['b']):<8} {_ratio(p['ratio'])}")
    return lines


def _collectives(coll: dict[str, Any]) -> list[str]:
    window = coll["steps_compared"]
    if window is None:
        return ["Collectives: fewer than 2 steps both completed"]
    rows = coll["per_rank_step"]
    changed = [r for r in rows if r["changed"]]
    lines = [
        f"Collectives per rank and step (steps {window[0]}-{window[1]}): {len(changed)} of {len(rows)} op(s) changed"
    ]
    if coll["decimated"]:
        n = coll["rank_steps"]
        lines.append(f"  (a long run: over the rank-steps whose calls the reader kept, A {n['a']:,}, B {n['b']:,})")
    for r in changed or rows[:3]:
        lines.append(
            f"  {r['op'][:26]:<26} calls {_per_step(r['a_calls'])} -> {_per_step(r['b_calls'])}, "
            f"{fmt_bytes(r['a_bytes'])} -> {fmt_bytes(r['b_bytes'])}"
        )
    return lines


def _evidence(side: str, finding: dict[str, Any]) -> list[str]:
    rows = finding["evidence"][:EVIDENCE_ROWS]
    more = len(finding["evidence"]) - len(rows)
    out = [f"      {side} {e['label']}: {_value(e['value'], 50)}" for e in rows]
    return out + ([f"      {side} ... {more} more row(s)"] if more > 0 else [])


def _title(f: dict[str, Any]) -> str:
    ranks = f" ({'rank' if len(f['ranks']) == 1 else 'ranks'} {rank_ranges(f['ranks'])})" if f["ranks"] else ""
    return f"[{f['severity']}] {f['id']}: {_value(f['title'], 60)}{ranks}"


def findings_lines(findings: dict[str, Any]) -> list[str]:
    counts = {k: len(findings[k]) for k in ("new", "gone", "changed", "same")}
    lines = [
        f"Findings: {counts['new']} new, {counts['gone']} gone, {counts['changed']} changed, {counts['same']} the same"
    ]
    for f in findings["new"]:
        lines.append(f"  new in B {_title(f)}")
        lines.extend(_evidence("B", f))
    for f in findings["gone"]:
        lines.append(f"  gone in B {_title(f)}")
        lines.extend(_evidence("A", f))
    for c in findings["changed"]:
        how = "worse" if c["worse"] else "better" if c["worse"] is False else "other ranks"
        lines.append(
            f"  {how} in B {c['id']}: {c['a']['severity']}/{c['a']['confidence']} -> {c['b']['severity']}/{c['b']['confidence']}"
        )
        lines.extend(_evidence("A", c["a"]) + _evidence("B", c["b"]))
    if findings["same"]:
        lines.append("  the same in both: " + ", ".join(f"{s['id']} ({s['severity']})" for s in findings["same"]))
    return lines


def _artifacts(art: dict[str, Any]) -> list[str]:
    lines = [f"Figures ({len(art['rows']) + art['more']} differ, {art['same']} the same)"]
    for r in art["rows"][:40]:
        name = r["name"] if len(r["name"]) <= 50 else "..." + r["name"][-47:]
        lines.append(f"  {name}: {_value(r['a'], 30)} -> {_value(r['b'], 30)}")
    more = len(art["rows"]) - 40 + art["more"]
    if more > 0:
        lines.append(f"  ... and {more} more (--json)")
    return lines


def render_diff(data: dict[str, Any]) -> str:
    sections = [_header(data)]
    if data["kind"] == "run":
        sections += [
            _config(data["config"]),
            _memory(data["memory"]),
            _plan(data["plan"]),
            _steps(data["steps"]),
            _collectives(data["collectives"]),
        ]
    else:
        sections.append(_artifacts(data["artifacts"]))
    sections.append(findings_lines(data["findings"]))
    return "\n\n".join("\n".join(s) for s in sections)
