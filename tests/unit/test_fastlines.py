"""The fast path for collective records reads exactly what json.loads plus validation
would, and leaves every line it is not sure of to them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lorascope.errors import BadInputError
from lorascope.probes import collectives
from lorascope.probes.collectives import _Call, _Shapes
from lorascope.rundir.format.schema import SHAPE_FIELDS, validate_record
from lorascope.rundir.format.writer import Stream, record_launch, stream_prefix
from lorascope.rundir.loading.fastlines import Call, End, Shapes, parse_call, parse_end
from lorascope.rundir.loading.reader import load_run


def _line(call: _Call, ended: bool) -> bytes:
    """What the probes write for the call: ``coll_done`` when it had ended, else ``coll``;
    before it, the ``shape`` record of its shape the first time the stream has it."""
    if ended:
        call.end, call.err = call.t + 0.25, None
    text = call.encode(final=True)
    assert text
    return text.encode()


def _split(lines: bytes) -> tuple[Shapes, bytes]:
    """The shapes a stream has declared after these lines, and their last line (the call)."""
    *declared, last = lines.splitlines(keepends=True)
    shapes: Shapes = {}
    for line in declared:
        rec = _as_json(line)
        assert rec["k"] == "shape"
        shapes[rec["id"]] = (rec["op"], rec["bytes"], rec["dtype"], rec["async"], rec["site"])
    return shapes, last


def _as_json(line: bytes, shapes: Shapes | None = None) -> dict[str, Any]:
    """The record as JSON reads it, validated, with its shape's fields if it names one."""
    rec = json.loads(line)
    assert validate_record(rec)
    if "sh" in rec and shapes is not None:
        rec.update(zip(SHAPE_FIELDS, shapes[rec.pop("sh")], strict=True))
    return rec


_texts = st.text(min_size=0, max_size=40)
_ints = st.integers(min_value=-(2**63) + 1, max_value=2**63 - 1)


_calls = st.builds(
    _Call,
    t=st.floats(min_value=0, max_value=4e9),
    seq=_ints,
    gid=st.integers(min_value=0, max_value=2**40),
    op=_texts,
    nbytes=st.none() | _ints,
    dtype=st.none() | _texts,
    is_async=st.booleans(),
    site=st.none() | _texts,
    step=_ints,
    via=st.none() | _texts,
    shapes=st.builds(_Shapes),
)


def _plain(text: str | None) -> bool:
    """Whether the probes write the string as its own bytes (no escape, ASCII only)."""
    return text is None or (text.isascii() and text.isprintable() and '"' not in text and "\\" not in text)


@settings(max_examples=300, deadline=None)
@given(call=_calls, ended=st.booleans(), declared=st.booleans())
def test_probe_lines_parse_as_json_does(call: _Call, ended: bool, declared: bool) -> None:
    """Whatever the probes write, its shape declared (format v2) or its fields in the call
    record (past MAX_SHAPES), the fast path either declines or agrees with JSON."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(collectives, "MAX_SHAPES", collectives.MAX_SHAPES if declared else 0)
        shapes, line = _split(_line(call, ended))
    assert len(shapes) == declared and ('"sh":' in line.decode()) == declared
    rec = _as_json(line, shapes)
    fast = parse_call(line, shapes)
    if fast is None:  # escapes, non-ASCII, 19-digit numbers: json's to read
        numbers = [call.seq, call.step] + ([] if declared else [call.nbytes or 0])
        strings = (call.via,) if declared else (call.op, call.dtype, call.site, call.via)
        assert not all(_plain(s) for s in strings) or max(map(abs, numbers)) >= 10**18
        return
    assert fast.kind == rec["k"]
    assert (fast.t, fast.seq, fast.gid, fast.op, fast.bytes, fast.dtype) == (
        float(rec["t"]), rec["seq"], rec["gid"], rec["op"], rec["bytes"], rec["dtype"]
    )  # fmt: skip
    assert (fast.is_async, fast.site, fast.step, fast.via) == (rec["async"], rec["site"], rec["step"], rec.get("via"))
    if ended:
        assert (fast.end, fast.err) == (float(rec["end"]), rec["err"])
    else:
        assert (fast.end, fast.err) == (None, None)


def test_a_call_shape_is_declared_once_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fields a call repeats at every step are declared once, in a ``shape`` record
    before the first call of that shape, and named by id after; past MAX_SHAPES shapes
    each record carries them itself. A new segment begins with every declaration."""
    shapes = _Shapes()

    def lines(op: str, site: str, seq: int = 1) -> list[dict[str, Any]]:
        text = _line(_Call(5.0, seq, 0, op, 8, "float32", False, site, 2, 'v"ia', shapes), ended=True)
        return [_as_json(line) for line in text.splitlines()]

    monkeypatch.setattr(collectives, "MAX_SHAPES", 1)
    declared, first = lines("all_reduce", "/j/a.py:1 in f")
    assert declared == {"k": "shape", "t": 5.0, "id": 0, "op": "all_reduce", "bytes": 8, "dtype": "float32", "async": False, "site": "/j/a.py:1 in f"}  # fmt: skip
    assert first["sh"] == 0 and "op" not in first and "site" not in first
    assert lines("all_reduce", "/j/a.py:1 in f", seq=2) == [{**first, "seq": 2}]
    [beyond] = lines("broadcast", 'q"uote')
    assert (beyond["op"], beyond["site"], beyond["via"]) == ("broadcast", 'q"uote', 'v"ia') and "sh" not in beyond
    assert [_as_json(line) for line in shapes.head().encode().splitlines()] == [declared]


def test_a_typical_call_and_its_end_take_the_fast_path() -> None:
    call = _Call(
        1795945043.314465,
        7,
        1,
        "all_gather_into_tensor",
        65536,
        "float32",
        True,
        "/j/train.py:12 in f",
        3,
        None,
        _Shapes(),
    )
    fast = parse_call(*reversed(_split(_line(call, ended=True))))
    assert fast == Call(
        "coll_done", 1795945043.314465, 7, 1, "all_gather_into_tensor", 65536, "float32", True,
        "/j/train.py:12 in f", 3, None, 1795945043.564465, None,
    )  # fmt: skip
    assert parse_end(b'{"k":"coll_end","t":1795945043.5,"seq":7,"gid":1,"err":"RuntimeError()"}\n') == End(
        1795945043.5, 7, 1, "RuntimeError()"
    )


@pytest.mark.parametrize(
    "line",
    [
        # another key order (records written before the probes formatted them by hand)
        b'{"seq":1,"gid":0,"op":"broadcast","bytes":8,"dtype":"uint8","async":false,"site":null,"step":0,"k":"coll","t":1.5}\n',
        # a bool where an int belongs, a string where a number belongs
        b'{"k":"coll","t":1.5,"seq":true,"gid":0,"op":"x","bytes":8,"dtype":null,"async":false,"site":null,"step":0}\n',
        b'{"k":"coll","t":"1.5","seq":1,"gid":0,"op":"x","bytes":8,"dtype":null,"async":false,"site":null,"step":0}\n',
        # a coll_done without its end
        b'{"k":"coll_done","t":1.5,"seq":1,"gid":0,"op":"x","bytes":8,"dtype":null,"async":false,"site":null,"step":0}\n',
        # whitespace, an exponent, a leading zero, a 19-digit integer, an escape
        b'{"k":"coll", "t":1.5,"seq":1,"gid":0,"op":"x","bytes":8,"dtype":null,"async":false,"site":null,"step":0}\n',
        b'{"k":"coll","t":1e3,"seq":1,"gid":0,"op":"x","bytes":8,"dtype":null,"async":false,"site":null,"step":0}\n',
        b'{"k":"coll","t":1.5,"seq":01,"gid":0,"op":"x","bytes":8,"dtype":null,"async":false,"site":null,"step":0}\n',
        b'{"k":"coll","t":1.5,"seq":1234567890123456789,"gid":0,"op":"x","bytes":8,"dtype":null,"async":false,"site":null,"step":0}\n',
        b'{"k":"coll","t":1.5,"seq":1,"gid":0,"op":"a\\"b","bytes":8,"dtype":null,"async":false,"site":null,"step":0}\n',
        # torn (no newline), and trailing bytes after the object
        b'{"k":"coll","t":1.5,"seq":1,"gid":0,"op":"x","bytes":8,"dtype":null,"async":false,"site":null,"step":0}',
        b'{"k":"coll","t":1.5,"seq":1,"gid":0,"op":"x","bytes":8,"dtype":null,"async":false,"site":null,"step":0}x\n',
        # via null (the probes leave it out)
        b'{"k":"coll","t":1.5,"seq":1,"gid":0,"op":"x","bytes":8,"dtype":null,"async":false,"site":null,"step":0,"via":null}\n',
    ],
)
def test_anything_else_is_left_to_json(line: bytes) -> None:
    assert parse_call(line, {}) is None


@pytest.mark.parametrize(
    "line",
    [
        # a shape no record has declared (yet), a shape id that is a bool or a string
        b'{"k":"coll_done","t":1.5,"seq":1,"gid":0,"sh":1,"step":0,"end":2.5,"err":null}\n',
        b'{"k":"coll_done","t":1.5,"seq":1,"gid":0,"sh":true,"step":0,"end":2.5,"err":null}\n',
        b'{"k":"coll_done","t":1.5,"seq":1,"gid":0,"sh":"0","step":0,"end":2.5,"err":null}\n',
        # a coll_done without its end; the fields and the id both
        b'{"k":"coll_done","t":1.5,"seq":1,"gid":0,"sh":0,"step":0}\n',
        b'{"k":"coll","t":1.5,"seq":1,"gid":0,"sh":0,"op":"x","step":0}\n',
    ],
)
def test_a_call_naming_its_shape_outside_the_layout_is_left_to_json(line: bytes) -> None:
    shapes: Shapes = {0: ("all_reduce", 8, "float32", False, None)}
    assert parse_call(line, shapes) is None
    assert parse_call(b'{"k":"coll","t":1.5,"seq":1,"gid":0,"sh":0,"step":0}\n', shapes) is not None


def test_end_lines_outside_the_layout_are_left_to_json() -> None:
    assert parse_end(b'{"k":"coll_end","t":1.5,"seq":1,"gid":0}\n') is None
    assert parse_end(b'{"k":"coll_end","t":1.5,"seq":1,"gid":0,"err":null,"x":1}\n') is None
    assert parse_end(b'{"k":"coll_end","t":1.5,"seq":-01,"gid":0,"err":null}\n') is None


#: Call times after the start record's (now), so that the last one is the rank's last time.
T0 = 2_000_000_000.0


def _run(tmp_path: Path, lines: list[bytes]) -> Path:
    run = tmp_path / "run"
    run.mkdir(parents=True)
    record_launch(run, "h-1", ["python", "train.py"])
    stream = Stream(stream_prefix(run, 0, "h", 1))
    stream.write({"k": "start", "rank": 0, "world_size": 1, "local_rank": 0, "pid": 1, "host": "h", "argv": [], "versions": {}, "device": "cpu"})  # fmt: skip
    stream.write({"k": "group", "gid": 0, "name": "default_pg", "ranks": [0], "backend": "gloo"})
    stream.close()
    [path] = (run / "ranks" / "rank-0").glob("*.jsonl")
    with open(path, "ab") as f:
        f.write(b"".join(lines))
    return run


def test_a_run_reads_the_same_by_either_path(tmp_path: Path) -> None:
    """The same calls in the probes' layout and in another key order load alike."""
    shapes = _Shapes()
    calls = [
        _line(
            _Call(T0 + i, i + 1, 0, "all_reduce", 4, "float32", i % 2 == 0, "/j/t.py:3 in f", i, None, shapes), i != 3
        )
        for i in range(6)
    ]
    assert [c.count(b"\n") for c in calls] == [2, 2, 1, 1, 1, 1]  # two shapes (async or not), each declared once
    shuffled = [
        json.dumps(dict(reversed(json.loads(line).items())), separators=(",", ":")).encode() + b"\n"
        for c in calls
        for line in c.splitlines()
    ]
    declared = {i: ("all_reduce", 4, "float32", i == 0, "/j/t.py:3 in f") for i in (0, 1)}
    assert all(parse_call(c.splitlines(keepends=True)[-1], declared) is not None for c in calls)
    assert all(parse_call(c, declared) is None for c in shuffled)
    end = b'{"k":"coll_end","t":%.1f,"seq":4,"gid":0,"err":null}\n' % (T0 + 4.5)
    fast = load_run(_run(tmp_path / "a", [*calls, end])).ranks[0]
    slow = load_run(
        _run(tmp_path / "b", [*shuffled, b'{"err":null,"gid":0,"seq":4,"t":%.1f,"k":"coll_end"}\n' % (T0 + 4.5)])
    ).ranks[0]
    assert [(c.seq, c.op, c.start, c.end, c.is_async, c.site, c.err) for c in fast.collectives] == [
        (c.seq, c.op, c.start, c.end, c.is_async, c.site, c.err) for c in slow.collectives
    ]
    assert [c.end for c in fast.collectives][3] == T0 + 4.5
    assert fast.last_time == slow.last_time == T0 + 5.25


def test_a_call_before_the_start_record_is_still_an_error(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    record_launch(run, "h-1", ["python", "train.py"])
    path = stream_prefix(run, 0, "h", 1).with_name("h-1.0000.jsonl")
    path.parent.mkdir(parents=True)
    path.write_bytes(_line(_Call(1.0, 1, 0, "x", 1, None, False, None, 0, None, _Shapes()), True))
    with pytest.raises(BadInputError, match="does not begin with a 'start' record"):
        load_run(run)
