"""Property: whatever a run directory holds, every command that reads one (analyze,
analyze --json, report, export) ends with 0 or 3 (bad input: one line) within a time and
memory bound, writes only the file it was asked for, and writes strict JSON.

Hypothesis mutates the records of a real 2-rank run (fixtures/healthy, cut down to a
few hundred records a rank so that an example takes a fraction of a second): a field
given another type, a huge or non-finite number, a long string, control characters,
lone surrogates; raw bytes that are not UTF-8; a stream cut short. The default run is
small and the same every time (40 examples, ~15 s on the 2-core test VM); set
LORASCOPE_PROPERTY_EXAMPLES to search longer, with new random examples each run:
``LORASCOPE_PROPERTY_EXAMPLES=2000 pytest tests/unit/test_property_rundir.py``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lorascope.cli import main
from tests.helpers import FIXTURES

EXAMPLES = int(os.environ.get("LORASCOPE_PROPERTY_EXAMPLES", "40"))
#: Seconds one command may take on a mutated run of this size (it takes ~0.1-1 s).
SECONDS = 30
#: Address space one example may add to the test process.
MEMORY = 3 << 30
#: Records kept of each collective and memory kind, per rank (the rest are left out).
KEPT = 60

SPECIAL_STRINGS = [
    "\x1b[2J\x1b[Hno findings; all ranks healthy",
    "\r\x07\x00\x7f\x9b",
    "\udcff\udcfe",
    "\ud800",
    "\u202eevil\u2066",
    "a." * 30_000,
    "x" * 200_000,
    "../../../etc/passwd",
    "/dev/zero",
    "",
]
SPECIAL_NUMBERS = [float("nan"), float("inf"), float("-inf"), 10**12, 2**63, -(2**63) - 1, 10**30, -1, 0, 1e308]
VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(SPECIAL_NUMBERS),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(SPECIAL_STRINGS),
    st.text(st.characters(codec=None, exclude_categories=()), max_size=40),
    st.lists(st.sampled_from(SPECIAL_NUMBERS + [1, 2, "a", None]), max_size=6),
    st.dictionaries(
        st.sampled_from(["rank", "name", "k", "t", "x"]), st.sampled_from([1, None, "\x1b", 1e308]), max_size=3
    ),
)
RAW = [b"\xff\xfe", b"\x00", b"\x1b[2J", b"\xed\xa0\x80", b"\n", b"{", b'"', b"NaN"]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """fixtures/healthy, its streams cut to every record but the first KEPT of each
    collective and memory kind, without its Kineto traces."""
    run = Path(shutil.copytree(FIXTURES / "healthy", tmp_path_factory.mktemp("base") / "run"))
    for stream in run.glob("ranks/*/*.jsonl"):
        kept, seen = [], {"coll": 0, "coll_end": 0, "mem": 0}
        for line in stream.read_text().splitlines(keepends=True):
            kind = json.loads(line)["k"]
            if kind == "trace_window":
                continue
            if kind in seen:
                seen[kind] += 1
                if seen[kind] > KEPT:
                    continue
            kept.append(line)
        stream.write_text("".join(kept))
    for trace in run.glob("ranks/*/*.gz"):
        trace.unlink()
    return run


class Overran(BaseException):
    """A command ran past SECONDS (a BaseException: the CLI's catch-all lets it through)."""


@contextlib.contextmanager
def bounded() -> Iterator[None]:
    """SECONDS of time and MEMORY more address space for what runs inside."""

    def overran(signum: int, frame: Any) -> None:
        raise Overran(f"over {SECONDS} s")

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        used = int(f.read().split()[0]) * resource.getpagesize()
    cap = used + MEMORY if hard == resource.RLIM_INFINITY else min(hard, used + MEMORY)
    previous = signal.signal(signal.SIGALRM, overran)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    signal.alarm(SECONDS)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _lorascope(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code: Any = 0
    with bounded(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(["--workers", "1", *args])
        except SystemExit as exc:
            code = exc.code
    return int(code or 0), out.getvalue(), err.getvalue()


def _strict(text: str) -> None:
    def refuse(name: str) -> None:
        raise ValueError(f"not JSON: {name}")

    json.loads(text, parse_constant=refuse)


def _files(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ROOT (not folders: reading one changes its access time only, but
    writing a file into one changes its own), with its size and time of change."""
    return {
        str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in root.rglob("*") if not p.is_dir()
    }


@st.composite
def mutations(draw: st.DrawFn) -> list[tuple[Any, ...]]:
    """1-3 edits: ("set", rank, record index, field, value, None or which hostile value of
    the field's own type to put instead), ("raw", rank, line, offset, bytes), ("cut",
    rank, fraction), ("manifest", field, value)."""
    out: list[tuple[Any, ...]] = []
    for _ in range(draw(st.integers(1, 3))):
        what = draw(st.sampled_from(["set", "set", "set", "raw", "cut", "manifest"]))
        rank = draw(st.integers(0, 1))
        if what == "set":
            field = draw(
                st.sampled_from(["*", "*", "*", "*", "k", "t", "rank", "name", "host", "shape", "loss", "dur"])
            )
            index = draw(st.one_of(st.just(0), st.integers(0, 10_000)))  # the start record, often
            like = draw(st.one_of(st.none(), st.integers(0, 100)))  # a hostile value of the field's own type
            out.append(("set", rank, index, field, draw(VALUES), like))
        elif what == "raw":
            out.append(
                ("raw", rank, draw(st.integers(0, 10_000)), draw(st.integers(0, 400)), draw(st.sampled_from(RAW)))
            )
        elif what == "cut":
            out.append(("cut", rank, draw(st.floats(0, 1))))
        else:
            field = draw(st.sampled_from(["command", "cwd", "host", "exit_status", "end", "id", "launches", "version"]))
            out.append(("manifest", field, draw(VALUES)))
    return out


def _like(old: Any, i: int) -> Any:
    """A hostile value of OLD's type (the I-th of its kind): a record that still passes
    the schema's type checks reaches the detectors and the report."""
    if isinstance(old, str):
        return SPECIAL_STRINGS[i % len(SPECIAL_STRINGS)]
    if isinstance(old, list):
        return [_like(v, i + n) for n, v in enumerate(old)] or [SPECIAL_STRINGS[i % len(SPECIAL_STRINGS)]]
    if isinstance(old, dict):
        return {k: _like(v, i) for k, v in old.items()}
    return SPECIAL_NUMBERS[i % len(SPECIAL_NUMBERS)]


def _apply(run: Path, edits: list[tuple[Any, ...]]) -> None:
    for edit in edits:
        if edit[0] == "manifest":
            manifest = json.loads((run / "manifest.json").read_text())
            if edit[1] in ("launches", "version"):
                manifest[edit[1]] = edit[2]
            elif (
                isinstance(manifest.get("launches"), list)
                and manifest["launches"]
                and isinstance(manifest["launches"][0], dict)
            ):
                manifest["launches"][0][edit[1]] = edit[2]
            (run / "manifest.json").write_text(json.dumps(manifest))
            continue
        [stream] = (run / "ranks" / f"rank-{edit[1]}").glob("*.jsonl")
        lines = stream.read_bytes().splitlines(keepends=True)
        if not lines:
            continue
        if edit[0] == "set":
            n = edit[2] % len(lines)
            try:
                rec = json.loads(lines[n])
            except ValueError:  # an earlier edit broke it
                continue
            if not isinstance(rec, dict) or not rec:
                continue
            field = edit[3] if edit[3] != "*" else sorted(rec)[edit[2] % len(rec)]
            rec[field] = edit[4] if edit[5] is None else _like(rec.get(field), edit[5])
            lines[n] = json.dumps(rec, separators=(",", ":")).encode() + b"\n"
        elif edit[0] == "raw":
            n = edit[2] % len(lines)
            at = edit[3] % max(1, len(lines[n]))
            lines[n] = lines[n][:at] + edit[4] + lines[n][at:]
        else:
            data = b"".join(lines)
            lines = [data[: int(len(data) * edit[2])]]
        stream.write_bytes(b"".join(lines))


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize="LORASCOPE_PROPERTY_EXAMPLES" not in os.environ,  # the default run: the same examples each time
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
@given(edits=mutations())
def test_every_command_survives_a_mutated_run(base: Path, edits: list[tuple[Any, ...]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        run = Path(shutil.copytree(base, root / "run"))
        _apply(run, edits)
        out = root / "out"
        out.mkdir()
        before = _files(root)
        commands = {
            "analyze": ("analyze", str(run), "--no-hta"),
            "json": ("analyze", str(run), "--no-hta", "--json"),
            "report": ("report", str(run), "-o", str(out / "report.html")),
            "export": ("export", str(run), "--perfetto", str(out / "timeline.json")),
        }
        for name, args in commands.items():
            began = time.monotonic()
            code, stdout, stderr = _lorascope(*args)
            assert code in (0, 3), (name, code, stderr[-1500:])
            assert time.monotonic() - began < SECONDS
            if code == 3:
                assert len(stderr.strip().splitlines()) == 1, (name, stderr[-1500:])
            for char in "\x1b\x07\r\x00":
                assert char not in stdout + stderr, (name, repr(char))
            if name == "json" and code == 0:
                _strict(stdout)
            if name == "export" and code == 0:
                _strict((out / "timeline.json").read_text())
            if name == "report" and code == 0:
                (out / "report.html").read_bytes().decode("utf-8")
        after = _files(root)
        asked = {"out/report.html", "out/timeline.json"}
        changed = {p for p in after.keys() | before.keys() if after.get(p) != before.get(p)}
        assert changed <= asked, sorted(changed - asked)
