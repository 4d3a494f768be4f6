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
from lorascope.probes.collectives import _Call
from lorascope.rundir.fastlines import Call, End, parse_call, parse_end
from lorascope.rundir.reader import load_run
from lorascope.rundir.schema import validate_record
from lorascope.rundir.writer import Stream, record_launch, stream_prefix


def _line(call: _Call, ended: bool) -> bytes:
    """What the probes write for the call: ``coll_done`` when it had ended, else ``coll``."""
    if ended:
        call.end, call.err = call.t + 0.25, None
    text = call.encode(final=True)
    assert text
    return text.encode()


def _as_json(line: bytes) -> dict[str, Any]:
    rec = json.loads(line)
    assert validate_record(rec)
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
)


def _plain(text: str | None) -> bool:
    """Whether the probes write the string as its own bytes (no escape, ASCII only)."""
    return text is None or (text.isascii() and text.isprintable() and '"' not in text and "\\" not in text)


@settings(max_examples=300, deadline=None)
@given(call=_calls, ended=st.booleans())
def test_probe_lines_parse_as_json_does(call: _Call, ended: bool) -> None:
    """Whatever the probes write, the fast path either declines or agrees with JSON."""
    line = _line(call, ended)
    rec = _as_json(line)
    fast = parse_call(line)
    if fast is None:  # escapes, non-ASCII, 19-digit numbers: json's to read
        numbers = [call.seq, call.step, call.nbytes or 0]
        assert (
            not all(_plain(s) for s in (call.op, call.dtype, call.site, call.via)) or max(map(abs, numbers)) >= 10**18
        )
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


def test_a_call_shape_is_formatted_once_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fields a call repeats at every step are formatted once; past MAX_SHAPES shapes
    each record formats them itself, to the same bytes."""
    from lorascope.probes import collectives

    def line(op: str, site: str) -> dict[str, Any]:
        return _as_json(_line(_Call(5.0, 1, 0, op, 8, "float32", False, site, 2, 'v"ia'), ended=True))

    monkeypatch.setattr(collectives, "_SHAPES", {})
    monkeypatch.setattr(collectives, "MAX_SHAPES", 1)
    first = line("all_reduce", "/j/a.py:1 in f")
    assert line("all_reduce", "/j/a.py:1 in f") == first and len(collectives._SHAPES) == 1
    beyond = line("broadcast", 'q"uote')
    assert (beyond["op"], beyond["site"], beyond["via"]) == ("broadcast", 'q"uote', 'v"ia')
    assert len(collectives._SHAPES) == 1


def test_a_typical_call_and_its_end_take_the_fast_path() -> None:
    call = _Call(
        1795945043.314465, 7, 1, "all_gather_into_tensor", 65536, "float32", True, "/j/train.py:12 in f", 3, None
    )
    fast = parse_call(_line(call, ended=True))
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
    assert parse_call(line) is None


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
    calls = [
        _line(_Call(T0 + i, i + 1, 0, "all_reduce", 4, "float32", i % 2 == 0, "/j/t.py:3 in f", i, None), i != 3)
        for i in range(6)
    ]
    shuffled = [
        json.dumps(dict(reversed(json.loads(c).items())), separators=(",", ":")).encode() + b"\n" for c in calls
    ]
    assert all(parse_call(c) is not None for c in calls) and all(parse_call(c) is None for c in shuffled)
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
    path.write_bytes(_line(_Call(1.0, 1, 0, "x", 1, None, False, None, 0, None), True))
    with pytest.raises(BadInputError, match="does not begin with a 'start' record"):
        load_run(run)
