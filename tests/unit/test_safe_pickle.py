"""The safe unpickler: plain data only, the same values pickle builds, nothing ever run."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest

from lorascope.rundir.format import safe_pickle
from lorascope.rundir.format.safe_pickle import PickleFormatError, UnsafePickleError, load_pickle, loads_pickle

SHARED = {"filename": "train.py", "line": 3, "name": "main"}
PLAIN: list[Any] = [
    None,
    True,
    False,
    0,
    1,
    -1,
    255,
    256,
    65535,
    65536,
    2**31,
    -(2**31) - 1,
    2**64,
    -(2**1000),
    1.5,
    float("inf"),
    "",
    "x" * 300,
    "é\u1234\U0001f600",
    (),
    (1,),
    (1, 2),
    (1, 2, 3),
    (1, 2, 3, 4),
    [],
    [SHARED] * 3,
    {1: 2, "k": [1, 2]},
    list(range(3000)),
    {i: str(i) for i in range(2500)},
    [
        {
            "action": "alloc",
            "addr": 2**47,
            "size": 512,
            "stream": 0,
            "time_us": 2**50,
            "compile_context": "N/A",
            "user_metadata": "",
            "frames": [SHARED, SHARED],
        }
    ]
    * 4,
    {"nested": {"a": None, "b": True, "c": [SHARED]}, "y": [1]},
]


def _norm(x: Any) -> Any:
    """Lists of references come back as shared tuples: compare as lists."""
    if isinstance(x, (list, tuple)):
        return [_norm(i) for i in x]
    if isinstance(x, dict):
        return {k: _norm(v) for k, v in x.items()}
    return x


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_plain_data_reads_as_pickle_builds_it(protocol: int) -> None:
    for obj in PLAIN:
        assert _norm(loads_pickle(pickle.dumps(obj, protocol=protocol))) == _norm(obj)


def test_bytes_and_sets_from_protocols_that_write_them_as_data() -> None:
    for obj in (b"", b"y" * 300, bytearray(b"abc"), {1, 2}, frozenset({3})):
        assert loads_pickle(pickle.dumps(obj, protocol=5)) == obj


def test_repeated_reference_lists_are_one_shared_tuple() -> None:
    frames = [dict(SHARED), dict(SHARED, line=4)]
    data = pickle.dumps({"frames": frames, "a": [list(frames) for _ in range(3)]}, protocol=4)
    got = loads_pickle(data)
    assert got["a"][0] is got["a"][1] is got["a"][2]
    assert _norm(got["a"][0]) == frames


class _Payload:
    """Pickles as a call that would create a file, if anything ever ran it."""

    def __init__(self, marker: Path, how: str) -> None:
        self.marker, self.how = marker, how

    def __reduce__(self) -> tuple[Any, ...]:
        if self.how == "exec":
            return (exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",))
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
@pytest.mark.parametrize("how", ["exec", "system"])
def test_a_malicious_pickle_runs_nothing(tmp_path: Path, protocol: int, how: str) -> None:
    marker = tmp_path / "marker"
    data = pickle.dumps({"segments": [], "device_traces": [[{"frames": _Payload(marker, how)}]]}, protocol=protocol)
    path = tmp_path / "evil.pickle"
    path.write_bytes(data)
    with pytest.raises(
        UnsafePickleError, match=r"refused: the pickle asks to import (builtins|__builtin__|posix|os)\.(exec|system)"
    ):
        load_pickle(path)
    assert not marker.exists()
    pickle.loads(data)  # the control: pickle itself runs it
    assert marker.exists()


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "empty"),
        (pickle.dumps({"a": [1, 2, 3]}, protocol=4)[:-5], "truncated"),
        (bytes(range(256)), "not"),
        (b"\x80\x04K\x01K\x02.", "unbalanced"),
        (b"\x80\x09N.", "protocol"),
        (b"\x80\x04\x8c\xffabc", "truncated"),
        (b"\x80\x04j\x00\x00\x00\x10.", "truncated or corrupt"),
        (b"\x80\x04R.", "refused"),
    ],
)
def test_broken_pickles_raise_one_clear_error(data: bytes, message: str) -> None:
    with pytest.raises((PickleFormatError, UnsafePickleError), match=message):
        loads_pickle(data)


@pytest.mark.parametrize("protocol", [2, 4])  # 2: torch's flight-recorder dumps (BINPUT, BINUNICODE)
def test_values_across_chunk_boundaries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, protocol: int) -> None:
    monkeypatch.setattr(safe_pickle, "_CHUNK", 4096)
    monkeypatch.setattr(safe_pickle, "_LOW_WATER", 512)
    obj: dict[str, Any] = {
        "long": "z" * 10_000,
        "list": [[SHARED, SHARED] for _ in range(500)],
        "entries": [{"addr": i * 512, "size": i, "name": f"n{i % 7}"} for i in range(2000)],
    }
    if protocol >= 3:  # bytes as data (protocol 2 writes them as a call of _codecs.encode)
        obj["bytes"] = b"b" * 9000
    path = tmp_path / "big.pickle"
    path.write_bytes(pickle.dumps(obj, protocol=protocol))
    assert _norm(load_pickle(path)) == _norm(obj)


def test_memo_slots_out_of_order_read_as_pickle_builds_them() -> None:
    """BINPUT to a slot ahead of the memo, to an earlier one, and over a used one (picklers
    number slots in order; a forged pickle need not): what pickle.loads builds."""
    data = b"\x80\x02]q\x02(X\x01\x00\x00\x00aq\x00h\x00K\x07q\x02h\x02r\x05\x00\x00\x00h\x05e."
    assert pickle.loads(data) == ["a", "a", 7, 7, 7]
    assert loads_pickle(data) == ["a", "a", 7, 7, 7]


@pytest.mark.parametrize(
    "data",
    [
        b"\x80\x04\x8c\x05os\nx\r\x8c\x06system\x93.",  # STACK_GLOBAL: names from the stack
        b"cos\x1bx\nsys\ttem\n.",  # GLOBAL: names from the lines
    ],
)
def test_a_refusal_names_the_import_on_one_printable_line(data: bytes) -> None:
    with pytest.raises(UnsafePickleError) as raised:
        loads_pickle(data)
    message = str(raised.value)
    assert "asks to import os" in message and message.isprintable(), repr(message)


@pytest.mark.parametrize("put", [b"r" + (10**8).to_bytes(4, "little"), b"p100000000\n"])
def test_a_memo_slot_past_the_file_is_refused_before_the_memo_grows(put: bytes) -> None:
    """A 10-byte pickle that puts to slot 100,000,000 (pickle's own C unpickler allocates
    a 1.5 GB memo for it, which is why it is not used for untrusted dumps): refused."""
    with pytest.raises(PickleFormatError, match="memo index 100000000 out of range"):
        loads_pickle(b"\x80\x02N" + put + b".")
