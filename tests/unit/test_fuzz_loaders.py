"""Fuzz every artifact loader with mutated real inputs (hypothesis, bounded time).

Two kinds of mutation: of the file's bytes (flips, truncation, insertion, deletion,
duplication: mostly broken files, which must fail cleanly) and of its decoded content
(values replaced by junk of other types, keys deleted, then written back as pickle or
JSON: well-formed files with odd data, which must be analysed or refused cleanly). Each
example goes the way `lorascope analyze --kind KIND` takes it (lorascope.analysis.analyze,
then the text and --json output), and exactly two outcomes are accepted:

- a refusal: a BadInputError whose message is one printable line naming the file (what the CLI
  prints as ``lorascope: error: ...``, exit 3);
- a result that makes sense: the one file loaded as its kind and nothing else, no detector
  crashed on it, every finding well-formed and about a rank the file holds, the JSON output
  serialisable and the text output non-empty.

Anything else (another exception, a second line, a result about nothing) fails the test.
The Kineto inputs are real GPU traces from ../shared/real-traces: those cases skip, saying
so, where it is absent.
"""

from __future__ import annotations

import copy
import functools
import gzip
import json
import pickle
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lorascope.analysis import analyze
from lorascope.detect.finding import CONFIDENCE_ORDER, SEVERITY_ORDER
from lorascope.errors import BadInputError
from lorascope.text.artifacts import render_artifacts
from lorascope.text.findings import render_findings
from tests.helpers import FIXTURES, real_trace

ROCM_TRACE = "mi250-rocm.json.gz"

#: name -> (kind, file it starts from); the Kineto one is read when its case runs.
SOURCES: dict[str, tuple[str, Path | str]] = {
    "snapshot": ("snapshot", FIXTURES / "snapshots" / "lora-oom" / "rank-0.pickle"),
    "flight-pickle": ("flight", FIXTURES / "flight-recorder" / "rank0-extra-allreduce" / "rank-0.pickle"),
    "flight-json": ("flight", FIXTURES / "flight-recorder" / "rank0-extra-allreduce" / "rank-1.json"),
    "log": ("log", FIXTURES / "snapshots" / "lora-oom" / "job.log"),
    "kineto": ("kineto", ROCM_TRACE),
    "kineto-gz": ("kineto", ROCM_TRACE),
}


@functools.cache
def _input(name: str) -> tuple[str, bytes]:
    """The kind and bytes of input NAME (a Kineto case skips where the real trace is absent)."""
    kind, source = SOURCES[name]
    if isinstance(source, str):
        data = real_trace(source).read_bytes()
        return kind, data if name.endswith("-gz") else gzip.decompress(data)
    return kind, source.read_bytes()


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
    """Analyse PATH as KIND the way the CLI does; fail unless it is refused cleanly or makes sense."""
    try:
        analysis = analyze(path, kind=kind, hta=False)
    except BadInputError as exc:
        message = str(exc)
        assert message.strip() and message.isprintable(), f"not one printable line: {message!r}"
        assert str(path) in message, f"the refusal does not name the file: {message!r}"
        return
    bundle = analysis.bundle
    loaded: dict[str, Any] = {
        "snapshot": bundle.snapshots,
        "flight": bundle.flight_records,
        "kineto": bundle.traces,
        "log": bundle.logs,
    }
    assert len(loaded[kind]) == 1, f"{kind}: {len(loaded[kind])} artifacts loaded from one file"
    assert not any(loaded[k] for k in loaded if k != kind) and bundle.run is None
    crashed = [w for w in bundle.warnings if w.startswith("detector ")]
    assert not crashed  # run_detectors turns a crash into a warning; on these files none may crash
    ranks = set(loaded[kind]) if kind != "log" else None
    for finding in analysis.findings:
        assert finding.title.strip() and finding.id and finding.evidence, finding
        assert finding.severity in SEVERITY_ORDER and finding.confidence in CONFIDENCE_ORDER, finding
        assert all(isinstance(r, int) and r >= 0 for r in finding.ranks), finding
        assert ranks is None or set(finding.ranks) <= ranks, (finding.ranks, ranks)
    data = analysis.to_data()
    json.dumps(data, default=str)  # --json
    assert render_artifacts(data["artifacts"]).strip()  # the text output says what was loaded
    render_findings(analysis.findings, analysis.to_data())


@pytest.mark.parametrize("name", sorted(SOURCES))
@settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(edits=st.lists(_EDIT, min_size=1, max_size=4))
def test_mutated_real_inputs_load_or_fail_cleanly(name: str, edits: list[tuple[str, float, bytes]]) -> None:
    kind, data = _input(name)
    path = _DIR / f"rank-0-{name}"
    path.write_bytes(_mutate(data, edits))
    _analyse(path, kind)


_JUNK = st.sampled_from([None, -1, 0, 2**70, "x", "", [], {}, [None], {"a": 1}, 1.5, True, ["x", 3], [[1], {}]])
_PICK = st.tuples(st.floats(0, 1, exclude_max=True), _JUNK, st.booleans())
STRUCTURED = sorted(name for name in SOURCES if name not in ("log", "kineto-gz"))


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


@pytest.mark.parametrize("name", STRUCTURED)
@settings(
    max_examples=120,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(picks=st.lists(_PICK, min_size=1, max_size=6))
def test_odd_content_is_analysed_or_refused_cleanly(name: str, picks: list[tuple[float, Any, bool]]) -> None:
    kind, data = _input(name)
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
