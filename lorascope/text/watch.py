"""`lorascope watch` on a terminal: one screen (80x24 over ssh is enough) drawn with rich
from :class:`lorascope.analysis.live.LiveRun`'s rows and checks.

Up to the rows the screen holds, one row a rank; past that ranks are grouped as
`analyze` condenses its table: ranks whose rows read alike (the same state, the same
pending op) are one row with the ranges of their figures, the groups that stand out
(errors, then warnings) first; what does not fit is counted on the last row.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from lorascope.analysis.live import Check
from lorascope.text import terminal_safe
from lorascope.units import fmt_bytes, rank_ranges

_STYLE = {"error": "bold red", "warning": "yellow", "ok": ""}
_ORDER = {"error": 0, "warning": 1, "ok": 2}
#: Lines besides the rank table: two of header, the table's own header, the findings' title.
_FIXED_LINES = 4
#: The widest ranks cell; a group's ranges past it are shown as a count.
RANKS_WIDTH = 16
#: Findings shown at most (the rest counted on the last one).
MAX_CHECKS = 5


def _span(values: list[Any], show: Any) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "-"
    lo, hi = min(known), max(known)
    return show(lo) if show(lo) == show(hi) else f"{show(lo)}-{show(hi)}"


def _secs(s: float) -> str:
    return f"{s:.2f}" if s < 10 else f"{s:.0f}"


def _mem(n: int) -> str:
    return fmt_bytes(n).replace(" ", "").replace("iB", "")


def _pending(rows: list[dict[str, Any]]) -> str:
    calls = [r["pending"] for r in rows if r["pending"] is not None]
    if not calls:
        return ""
    longest = max(calls, key=lambda p: p["for_s"])
    return f"{longest['op']} {longest['for_s']:.1f}s"


def _ranks_cell(ranks: list[int]) -> str:
    """The ranks of a row: their ranges, or how many when the ranges would not fit."""
    text = rank_ranges(ranks)
    return text if len(text) <= RANKS_WIDTH else f"{len(ranks):,} ranks"


@functools.lru_cache(maxsize=4096)
def _without_digits(state: str) -> str:
    """A row's state without its figures (``no step 30s`` -> ``no step s``): rows are
    grouped by it; the few states a run has are each stripped once."""
    return "".join(c for c in state if not c.isdigit())


def _group_key(row: dict[str, Any]) -> tuple[Any, ...]:
    state = _without_digits(row["state"])
    pending = row["pending"]["op"] if row["pending"] is not None else None
    return (_ORDER[row["level"]], state, pending)


def group_rows(rows: list[dict[str, Any]], room: int) -> list[tuple[list[dict[str, Any]], str]]:
    """Rows as (members, level): one a rank when they fit in ``room``, else grouped; the
    last group holds what does not fit (level "more")."""
    if len(rows) <= room:
        return [([r], r["level"]) for r in rows]
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(_group_key(r), []).append(r)
    ordered = sorted(groups.items(), key=lambda kv: (kv[0][0], -len(kv[1])))
    out = [(members, members[0]["level"]) for _, members in ordered]
    if len(out) > room:
        kept, rest = out[: room - 1], out[room - 1 :]
        out = [*kept, ([r for members, _ in rest for r in members], "more")]
    return out


def _table(rows: list[dict[str, Any]], room: int, width: int) -> Table:
    metric = "cuda" if any(r["metric"] == "cuda" for r in rows) else "rss"
    table = Table(box=None, padding=(0, 1), pad_edge=False, show_edge=False, expand=False, width=width)
    table.add_column("ranks", no_wrap=True, overflow="ellipsis", max_width=RANKS_WIDTH)
    table.add_column("step", no_wrap=True, justify="right")
    table.add_column("step s", no_wrap=True, justify="right")
    table.add_column("work×", no_wrap=True, justify="right")
    table.add_column(f"{metric} now", no_wrap=True, justify="right")
    table.add_column("peak", no_wrap=True, justify="right")
    table.add_column("pending / state", no_wrap=True, overflow="ellipsis", ratio=1)
    for members, level in group_rows(rows, room):
        ranks = [r["rank"] for r in members]
        state = members[0]["state"] if level != "more" else f"{len(members)} more ranks"
        pending = _pending(members)
        cells = (
            _ranks_cell(ranks),
            _span([r["step"] for r in members], str),
            _span([r["step_s"] for r in members], _secs),
            _span([r["work_x"] for r in members], lambda x: f"{x:.1f}"),
            _span([r["mem_now"] for r in members], _mem),
            _span([r["mem_peak"] for r in members], _mem).rsplit("-", 1)[-1],
            " · ".join(p for p in (pending, state) if p),
        )
        table.add_row(
            *(Text(terminal_safe(c)) for c in cells), style=_STYLE.get(level, "dim")
        )  # text from the run: never markup
    return table


def render_watch(view: dict[str, Any], width: int = 80, height: int = 24) -> RenderableType:
    """The screen for ``view``: ``run_dir``, ``rows``, ``checks``, ``world_size``,
    ``median_step``, ``bytes_read``, ``interval``, ``verdict`` (None while it runs)."""
    rows: list[dict[str, Any]] = view["rows"]
    checks: list[Check] = view["checks"]
    seen, size = len(rows), view["world_size"]
    world = f"{seen}/{size} ranks" if size is not None else f"{seen} ranks"
    if size is not None and seen != size:
        world += " seen"
    median = view["median_step"]
    head = Text.assemble(
        ("lorascope watch ", "bold"),
        terminal_safe(str(view["run_dir"])),
        f" · {time.strftime('%H:%M:%S', time.localtime(view['now']))}",
        overflow="ellipsis",
        no_wrap=True,
    )
    steps = [r["step"] for r in rows]
    line2 = Text(
        f"{world} · steps {_span(steps, str)} · median step {_secs(median) + ' s' if median else '-'}"
        f" · read {fmt_bytes(view['bytes_read'])}"
        + (" (from the streams' ends)" if any(r["partial"] for r in rows) else "")
        + ("" if view["verdict"] else " · Ctrl-C quits"),
        style=_STYLE["warning"] if size is not None and seen < size else "",
        overflow="ellipsis",
        no_wrap=True,
    )
    verdict = view["verdict"]
    shown_checks = checks[:MAX_CHECKS]
    tail_lines = (2 if verdict else 0) + 1 + max(1, len(shown_checks)) + (1 if len(checks) > MAX_CHECKS else 0)
    room = max(2, height - _FIXED_LINES - tail_lines)
    parts: list[RenderableType] = [head, line2, _table(rows, room, width)]
    finding_lines = [
        Text("findings so far" + ("" if verdict else " (the full detectors run when the run ends)"), style="bold")
    ]
    if not shown_checks:
        finding_lines.append(Text("  none", style="dim"))
    for c in shown_checks:
        who = (
            f"rank {rank_ranges(c.ranks)}" if len(c.ranks) == 1 else f"ranks {rank_ranges(c.ranks)}" if c.ranks else ""
        )
        finding_lines.append(
            Text(
                terminal_safe(f"  {c.severity} {c.id} {who}: {c.text}"),
                style=_STYLE[c.severity],
                overflow="ellipsis",
                no_wrap=True,
            )
        )
    if len(checks) > MAX_CHECKS:
        finding_lines.append(Text(f"  ... {len(checks) - MAX_CHECKS} more", style="dim"))
    parts.extend(finding_lines)
    if verdict:
        parts.append(
            Text(
                terminal_safe(f"verdict: {verdict['text']}"),
                style=_STYLE.get(verdict["level"], "bold"),
                overflow="fold",
            )
        )
        parts.append(
            Text(terminal_safe(f"the evidence: lorascope analyze {view['run_dir']}"), style="dim", no_wrap=True)
        )
    return Group(*parts)
