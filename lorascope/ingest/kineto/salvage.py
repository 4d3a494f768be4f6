"""A Kineto trace cut short (the job killed while the profiler exported it, a copy that
stopped, a full disk): the events written before the cut, read one by one.

Kineto writes its top-level fields (``schemaVersion``, ``deviceProperties``,
``distributedInfo``, ...) first and ``traceEvents`` after them, one event object after
another; what follows the list (``traceName``, ``displayTimeUnit``, ...) is not needed.
So a cut trace keeps its head and every whole event before the cut: what the reader
needs, short of the steps the profiler had not written yet.
"""

from __future__ import annotations

import json
import re
from typing import Any

_KEY = b'"traceEvents"'
#: A cut goes through the last event (or what follows the list): more text than this
#: after the last whole event is a trace broken in its middle, which is not read.
MAX_AFTER_CUT = 1 << 20
_SPACE = re.compile(r"[ \t\n\r]*")


class Salvaged:
    """What a cut trace still holds: its JSON as far as it goes (head and whole events),
    and whether the event list itself was cut (else only what follows it was)."""

    __slots__ = ("data", "events_cut")

    def __init__(self, data: dict[str, Any], events_cut: bool) -> None:
        self.data, self.events_cut = data, events_cut


def salvage(text: bytes | bytearray) -> Salvaged | None:
    """The top-level fields before ``traceEvents`` and every whole event of it up to the
    cut; None when the text is no trace cut inside or after its event list: no whole
    event, a break followed by more than MAX_AFTER_CUT of text, bytes that are not UTF-8
    (then the caller's error stands)."""
    at = text.find(_KEY)
    if at < 0:
        return None
    head_text = bytes(text[:at]).rstrip()
    if head_text.endswith(b","):
        head_text = head_text[:-1]
    try:
        head = json.loads(head_text + b"}")
    except (ValueError, RecursionError):
        return None
    if not isinstance(head, dict):
        return None
    body = _decoded(bytes(text[at + len(_KEY) :]))
    if body is None:
        return None
    i = _skip(body, 0)
    if body[i : i + 1] != ":":
        return None
    i = _skip(body, i + 1)
    if body[i : i + 1] != "[":
        return None
    decoder = json.JSONDecoder()
    events: list[Any] = []
    closed = False
    i = _skip(body, i + 1)
    while i < len(body) and body[i] != "]":
        try:
            event, i = decoder.raw_decode(body, i)
        except ValueError:
            break  # the event the cut went through
        except RecursionError:
            return None  # nested deeper than the reader goes: that error stands
        events.append(event)
        i = _skip(body, i)
        if body[i : i + 1] == ",":
            i = _skip(body, i + 1)
        elif body[i : i + 1] != "]":
            break
    else:
        if i < len(body):  # the list closed: the cut is after it
            i += 1
            closed = True
    if not events or len(body) - i > MAX_AFTER_CUT:
        return None
    return Salvaged({**head, "traceEvents": events}, events_cut=not closed)


def _decoded(body: bytes) -> str | None:
    """UTF-8 text, but for a character the cut went through at its very end; None for
    bytes that are not UTF-8 before that (a broken file, not a cut one)."""
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(body) - 3:
            return None
        return body[: exc.start].decode("utf-8")


def _skip(text: str, i: int) -> int:
    match = _SPACE.match(text, i)
    return match.end() if match else i
