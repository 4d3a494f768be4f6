"""Fuzz every artifact loader with mutated real inputs (hypothesis, bounded time).

Two kinds of mutation: of the file's bytes (flips, truncation, insertion, deletion,
duplication: mostly broken files, which must fail cleanly) and of its decoded content
(values replaced by junk of other types, keys deleted, then written back as pickle or
JSON: well-formed files with odd data, which must be analysed or refused cleanly). Each
example is loaded the way `lorascope analyze` does (the forced kind, then the detectors
and the summary renderer), and exactly two outcomes are accepted: a result, or a
BadInputError (what the CLI prints as one line). Anything else is a crash.
"""

from __future__ import annotations

import copy
import gzip
import json
import pickle
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lorascope.analysis.artifacts import artifacts_data
from lorascope.detect.registry import run_detectors
from lorascope.errors import BadInputError
from lorascope.ingest.load import load_bundle
from lorascope.text.artifacts import render_artifacts

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "fixtures"
ROCM_TRACE = ROOT.parent / "shared" / "real-traces" / "mi250-rocm.json.gz"

INPUTS: dict[str, tuple[str, bytes]] = {
    "snapshot": ("snapshot", (FIX / "snapshots" / "lora-oom" / "rank-0.pickle").read_bytes()),
    "flight-pickle": ("flight", (FIX / "flight-recorder" / "rank0-extra-allreduce" / "rank-0.pickle").read_bytes()),
    "flight-json": ("flight", (FIX / "flight-recorder" / "rank0-extra-allreduce" / "rank-1.json").read_bytes()),
    "log": ("log", (FIX / "snapshots" / "lora-oom" / "job.log").read_bytes()),
}
if ROCM_TRACE.is_file():
    INPUTS["kineto"] = ("kineto", gzip.decompress(ROCM_TRACE.read_bytes()))
    INPUTS["kineto-gz"] = ("kineto", ROCM_TRACE.read_bytes())

#: The detectors written against these artifacts (the others are fuzzed by their own tests).
OURS = ("oom", "allocator_fragmentation", "collective_mismatch", "straggler")
_EDIT = st.tuples(
    st.sampled_from(["flip", "cut", "insert", "delete", "repeat"]),
    st.floats(0, 1, exclude_max=True),
    st.binary(min_size=1, max_size=12),
)
_DIR = Path(tempfile.mkdtemp(prefix="lorascope-fuzz-"))


def _mutate(data: bytes, edits: list[tuple[str, float, bytes]]) -> bytes:
    buf = bytearray(data)
    for op, where, noise in edits:
        i = int(where * len(buf)) if buf else 0
        if op == "flip" and buf:
            for k, b in enumerate(noise):
                buf[(i + k * 7) % len(buf)] ^= b or 0xFF
        elif op == "cut":
            del buf[i:]
        elif op == "insert":
            buf[i:i] = noise
        elif op == "delete":
            del buf[i : i + len(noise) * 8]
        elif op == "repeat":
            buf[i:i] = buf[i : i + len(noise) * 16]
    return bytes(buf)


def _analyse(path: Path, kind: str) -> None:
    try:
        bundle = load_bundle(path, kind=kind, hta=False)
    except BadInputError:
        return
    run_detectors(bundle)  # a detector that raises becomes a warning, never a failed analysis ...
    crashed = [w for w in bundle.warnings if w.startswith(tuple(f"detector lorascope.detect.{d}." for d in OURS))]
    assert not crashed  # ... but the artifact detectors must not need that
    render_artifacts(artifacts_data(bundle))


@pytest.mark.parametrize("name", sorted(INPUTS))
@settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(edits=st.lists(_EDIT, min_size=1, max_size=4))
def test_mutated_real_inputs_load_or_fail_cleanly(name: str, edits: list[tuple[str, float, bytes]]) -> None:
    kind, data = INPUTS[name]
    path = _DIR / f"rank-0-{name}"
    path.write_bytes(_mutate(data, edits))
    _analyse(path, kind)


_JUNK = st.sampled_from([None, -1, 0, 2**70, "x", "", [], {}, [None], {"a": 1}, 1.5, True, ["x", 3], [[1], {}]])
_PICK = st.tuples(st.floats(0, 1, exclude_max=True), _JUNK, st.booleans())
STRUCTURED = {name: value for name, value in INPUTS.items() if name not in ("log", "kineto-gz")}


def _positions(obj: Any, limit: int = 20_000) -> list[tuple[Any, Any]]:
    """(container, key or index) of every value inside OBJ, breadth first."""
    out: list[tuple[Any, Any]] = []
    todo = [obj]
    while todo and len(out) < limit:
        node = todo.pop(0)
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            out.append((node, key))
            if isinstance(value, (dict, list)):
                todo.append(value)
    return out


def _decode(name: str, data: bytes) -> Any:
    return json.loads(data) if name in ("flight-json", "kineto") else pickle.loads(data)  # our own fixtures


def _encode(name: str, obj: Any) -> bytes:
    return json.dumps(obj).encode() if name in ("flight-json", "kineto") else pickle.dumps(obj, protocol=4)


@pytest.mark.parametrize("name", sorted(STRUCTURED))
@settings(
    max_examples=120,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(picks=st.lists(_PICK, min_size=1, max_size=6))
def test_odd_content_is_analysed_or_refused_cleanly(name: str, picks: list[tuple[float, Any, bool]]) -> None:
    kind, data = STRUCTURED[name]
    obj = _decode(name, data)
    for where, junk, delete in picks:
        positions = _positions(obj)
        if not positions:
            break
        container, key = positions[int(where * len(positions))]
        if delete and isinstance(container, dict):
            del container[key]
        else:
            container[key] = copy.deepcopy(junk)  # the strategy's objects are shared between examples
    path = _DIR / f"rank-0-odd-{name}"
    path.write_bytes(_encode(name, obj))
    _analyse(path, kind)
