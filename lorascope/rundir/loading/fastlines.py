"""The probes' collective records read without ``json.loads`` (analysis side).

``coll_done``, ``coll`` and ``coll_end`` are nine lines in ten of a rank's stream and
most of its bytes. The probes format them by hand in fixed layouts
(:mod:`lorascope.probes.collectives`: a call names its shape by id, or past the shapes a
stream declares carries the fields); a line in exactly such a layout is matched by one
regular expression, which also checks every field's type and range as the format asks
(``validate_record``), at about half the cost of ``json.loads`` plus validation (~10 us
against 15-23 us a typical ``coll_done`` line on the loaded 2-core test machine). Anything
else (another key order, whitespace, escapes or non-ASCII in a string, an exponent, a
number of 19 digits or more, a torn line) is not matched and takes the general path,
which accepts or rejects it exactly as before: the fast path never decides a line is bad.
"""

from __future__ import annotations

import re
from typing import NamedTuple

# JSON's own grammar, narrowed: integers of at most 18 digits (inside the 64-bit range
# the format allows), decimals without an exponent (finite), strings of printable ASCII
# without escapes (their bytes are their text).
_INT = rb"(-?(?:0|[1-9][0-9]{0,17}))"
_NUM = rb"(-?(?:0|[1-9][0-9]{0,17})(?:\.[0-9]+)?)"
_STR = rb'"([\x20\x21\x23-\x5b\x5d-\x7e]*)"'
_OPT_STR = rb"(?:" + _STR + rb"|null)"

_CALL_BODY = (
    rb'\{"k":"(coll|coll_done)","t":' + _NUM + rb',"seq":' + _INT + rb',"gid":' + _INT + rb',"op":' + _STR
    + rb',"bytes":(?:' + _INT + rb"|null)"
    + rb',"dtype":' + _OPT_STR + rb',"async":(true|false),"site":' + _OPT_STR + rb',"step":' + _INT
    + rb'(?:,"via":' + _STR + rb")?"
    + rb'(?:,"end":' + _NUM + rb',"err":' + _OPT_STR + rb")?\}"
)  # fmt: skip
_SHAPED_BODY = (
    rb'\{"k":"(coll|coll_done)","t":' + _NUM + rb',"seq":' + _INT + rb',"gid":' + _INT + rb',"sh":' + _INT
    + rb',"step":' + _INT + rb'(?:,"via":' + _STR + rb")?"
    + rb'(?:,"end":' + _NUM + rb',"err":' + _OPT_STR + rb")?\}"
)  # fmt: skip
_END_BODY = rb'\{"k":"coll_end","t":' + _NUM + rb',"seq":' + _INT + rb',"gid":' + _INT + rb',"err":' + _OPT_STR + rb"\}"  # fmt: skip
_CALL = re.compile(_CALL_BODY + rb"\n")
_SHAPED = re.compile(_SHAPED_BODY + rb"\n")
_END = re.compile(_END_BODY + rb"\n")
#: The same layouts as patterns of a whole line without its newline, for polars'
#: regular expressions (:mod:`lorascope.rundir.loading.columnar`).
CALL_LINE = "^" + _CALL_BODY.decode() + "$"
SHAPED_LINE = "^" + _SHAPED_BODY.decode() + "$"
END_LINE = "^" + _END_BODY.decode() + "$"

#: A layout of FLAT_LAYOUTS: its fields' (key, value type) in the order the probes write them.
Layout = tuple[tuple[str, str], ...]
#: Records of other kinds that the probes write many times a step (``mem``, ``phase``,
#: ``step``: ~15 lines a step of the probes/ job), in the layouts the stream writer gives
#: them (the probe's fields in its order, then ``k`` and ``t``): kind -> its layouts, each
#: the (key, value type) pairs before ``k``. Value types: ``int``, ``opt_int`` (or null),
#: ``float`` (with a fraction: JSON reads ``1`` as an int), ``opt_float``, ``str`` (as
#: above). A line in exactly such a layout (:func:`flat_line`) is a record that
#: ``validate_record`` accepts: the columnar reader keeps it without checking it again.
#: CUDA ranks' ``mem`` records (a nested ``cuda`` object) and anything else take the
#: general path.
FLAT_LAYOUTS: dict[str, tuple[Layout, ...]] = {
    "mem": (
        (("src", "str"), ("step", "int"), ("rss", "opt_int"), ("heap", "int")),
        (("src", "str"), ("step", "int"), ("rss", "opt_int")),
    ),
    "phase": ((("name", "str"), ("edge", "str"), ("step", "int")),),
    "step": ((("step", "int"), ("dur", "float"), ("loss", "opt_float"), ("src", "str")),),
}
_FLOAT = rb"(-?(?:0|[1-9][0-9]{0,17})\.[0-9]+)"
_FLAT_VALUES = {
    "int": _INT,
    "opt_int": rb"(?:" + _INT + rb"|null)",
    "float": _FLOAT,
    "opt_float": rb"(?:" + _FLOAT + rb"|null)",
    "str": _STR,
}


def flat_line(kind: str, layout: Layout) -> str:
    """The pattern (for polars) of a whole line, without its newline, in one of
    FLAT_LAYOUTS' layouts of ``kind``."""
    fields = b",".join(b'"' + key.encode() + b'":' + _FLAT_VALUES[value] for key, value in layout)
    return "^" + (rb"\{" + fields + b',"k":"' + kind.encode() + b'","t":' + _FLOAT + rb"\}").decode() + "$"


class Call(NamedTuple):
    """A ``coll`` or ``coll_done`` record's fields (``end`` and ``err`` only for the latter)."""

    kind: str
    t: float
    seq: int
    gid: int
    op: str
    bytes: int | None
    dtype: str | None
    is_async: bool
    site: str | None
    step: int
    via: str | None
    end: float | None
    err: str | None


class End(NamedTuple):
    """A ``coll_end`` record's fields."""

    t: float
    seq: int
    gid: int
    err: str | None


#: A stream's declared call shapes: id -> (op, bytes, dtype, async, site).
Shapes = dict[int, tuple[str, int | None, str | None, bool, str | None]]


def parse_call(line: bytes, shapes: Shapes) -> Call | None:
    """A ``coll`` / ``coll_done`` line in one of the probes' layouts (its fields, or the id
    of a shape in ``shapes``), else None (read it as JSON)."""
    m = _SHAPED.fullmatch(line)
    if m is not None:
        kind, t, seq, gid, sh, step, via, end, err = m.groups()
        shape = shapes.get(int(sh))
        if shape is None:
            return None  # the general path says why
    else:
        m = _CALL.fullmatch(line)
        if m is None:
            return None
        kind, t, seq, gid, op, nbytes, dtype, is_async, site, step, via, end, err = m.groups()
        shape = (
            op.decode(),
            None if nbytes is None else int(nbytes),
            None if dtype is None else dtype.decode(),
            is_async == b"true",
            None if site is None else site.decode(),
        )
    done = kind == b"coll_done"
    if done and end is None:
        return None  # lacks its end: the general path says so
    return Call(
        "coll_done" if done else "coll",
        float(t),
        int(seq),
        int(gid),
        *shape,
        int(step),
        None if via is None else via.decode(),
        float(end) if done else None,
        None if err is None or not done else err.decode(),
    )


def parse_end(line: bytes) -> End | None:
    """A ``coll_end`` line in the probes' layout, else None (read it as JSON)."""
    m = _END.fullmatch(line)
    if m is None:
        return None
    t, seq, gid, err = m.groups()
    return End(float(t), int(seq), int(gid), None if err is None else err.decode())
