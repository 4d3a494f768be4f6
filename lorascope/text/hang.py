"""`lorascope hang`'s terminal output: the groups of ranks by where they are, the odd ones
first (each rank with its host and local rank), the largest last as one line ("1,021
ranks wait in all_gather #4,812 at train.py:88"), then the verdict, the fix and the
notes. Bounded whatever the rank count: it fits a 24-line screen at 1,024 ranks; `--json`
keeps every rank."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from lorascope.detect.common import MIN_ALIKE_RANKS, but_for_numbers
from lorascope.units import ranks_named

#: Group lines shown at most (the largest group is always one of them).
MAX_GROUP_LINES = 8
#: Note lines shown at most.
MAX_NOTE_LINES = 6
#: Ranks of an odd group named with their host and local rank, at most.
MAX_PLACED = 4
#: A rank list longer than this is cut (its count says how many).
MAX_RANKS_TEXT = 60

#: A rank's place: (host, local rank or None).
Place = tuple[str, int | None]


def _alike(groups: list[dict[str, Any]]) -> list[tuple[str, list[Any], bool]]:
    """The diagnosis's groups (ranks by where they are), those whose places read alike but
    for their numbers (a peer's address and port in each rank's error) as one from
    MIN_ALIKE_RANKS ranks on: (the first place, the ranks, whether merged)."""
    merged: dict[str, list[dict[str, Any]]] = {}
    for group in groups:
        merged.setdefault(but_for_numbers(str(group["where"])), []).append(group)
    out: list[tuple[str, list[Any], bool]] = []
    for same in merged.values():
        ranks = [r for g in same for r in g["ranks"]]
        if len(same) > 1 and len(ranks) >= MIN_ALIKE_RANKS:
            out.append((same[0]["where"], ranks, True))
        else:
            out += [(g["where"], g["ranks"], False) for g in same]
    return out


def _commas(text: str) -> str:
    """Sequence numbers with thousands separators: ``#4812`` -> ``#4,812``."""
    return re.sub(r"#(\d{4,})\b", lambda m: f"#{int(m[1]):,}", text)


def _who(ranks: list[Any], places: Mapping[int, Place]) -> str:
    if not all(isinstance(r, int) for r in ranks):  # --pid mode: "rank N" / "pid N" labels
        return ", ".join(map(str, ranks))
    named = ranks_named(ranks)
    if len(named) > MAX_RANKS_TEXT:
        named = f"{len(ranks):,} ranks ({named[: MAX_RANKS_TEXT - 20].rsplit(',', 1)[0]}, ...)"
    known = [places[r] for r in sorted(ranks) if r in places]
    if not known:
        return named
    if len(ranks) <= MAX_PLACED:
        at = ", ".join(f"{h}" + (f" local {lr}" if lr is not None else "") for h, lr in known)
        return f"{named} ({at})"
    hosts = sorted({h for h, _ in known})
    return f"{named} (on {', '.join(hosts) if len(hosts) <= 3 else f'{len(hosts):,} hosts'})"


def _phrase(where: str, n: int) -> str:
    """The verb before a place: "died: ...", "is in its own code at ...", "is stopped
    (...)", or the collective a rank waits in."""
    if where.startswith(("died", "exited")):
        return where
    if where.startswith("in "):
        return ("is " if n == 1 else "are ") + (
            where.replace("in its own code", "in their own code", 1) if n > 1 else where
        )
    if where.startswith("stopped"):
        return ("is " if n == 1 else "are ") + where
    return ("is in " if n == 1 else "are in " if n <= MAX_PLACED else "wait in ") + where


def render_hang(diagnosis: Mapping[str, Any], notes: list[str], places: Mapping[int, Place] | None = None) -> str:
    """The terminal output of a diagnosis (:func:`lorascope.detect.hang.diagnosis.diagnose`
    or ``hang --pid``'s), ``places`` each rank's host and local rank where known."""
    places = places or {}
    groups = sorted(_alike(list(diagnosis["groups"])), key=lambda g: (len(g[1]), str(g[1][0])))
    largest = groups[-1] if len(groups) > 1 and len(groups[-1][1]) > len(groups[-2][1]) > 0 else None
    odd = groups[:-1] if largest else groups
    if len(groups) > MAX_GROUP_LINES:
        shown, hidden = odd[: MAX_GROUP_LINES - 2], odd[MAX_GROUP_LINES - 2 :]
    else:
        shown, hidden = odd, []
    lines = []
    for where, ranks, merged in shown:
        if merged:
            first = f"rank {ranks[0]}" if isinstance(ranks[0], int) else str(ranks[0])
            where = f"{where} ({len(ranks):,} ranks alike but for their numbers; {first}'s shown)"
        lines.append(f"{_who(ranks, places):<10} {_commas(_phrase(where, len(ranks)))}")
    if hidden:
        count = sum(len(r) for _, r, _ in hidden)
        lines.append(f"... {len(hidden):,} more groups ({count:,} ranks) elsewhere: `--json` lists every rank")
    if largest is not None:
        where, ranks, merged = largest
        if merged:
            first = f"rank {ranks[0]}" if isinstance(ranks[0], int) else str(ranks[0])
            where = f"{where} (alike but for their numbers; {first}'s shown)"
        who = f"{len(ranks):,} ranks" if len(ranks) > MAX_PLACED else f"{_who(ranks, places):<10}"
        lines.append(f"{who} {_commas(_phrase(where, len(ranks)))}")
    lines.append(f"verdict: {diagnosis['verdict']}")
    lines.append(f"fix: {diagnosis['fix']}")
    shown_notes = notes if len(notes) <= MAX_NOTE_LINES else notes[: MAX_NOTE_LINES - 1]
    lines.extend(f"note: {n}" for n in shown_notes)
    if len(shown_notes) < len(notes):
        lines.append(f"note: ... and {len(notes) - len(shown_notes):,} more notes (`--json` has them all)")
    return "\n".join(lines)
