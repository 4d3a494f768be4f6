"""How a rank ended is written even when a second signal comes while it is written.

Ctrl-C on `lorascope run` over torchrun (run by hand): lorascope passes SIGINT on to the
ranks and torchrun passes its own on, ms apart. The second KeyboardInterrupt came while the
exception hook read source lines for every thread's stack; it escaped the hook, the
exception record was lost, and the rank read "exit 0" at its exit."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from lorascope.probes import exits
from lorascope.probes.exits import ExitProbe
from lorascope.probes.session import Session
from lorascope.rundir.format.writer import Stream, ensure_manifest, stream_prefix


def _records(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for path in sorted(run.rglob("*.jsonl")) for line in path.read_text().splitlines()]


def test_a_second_sigint_while_the_exception_is_written_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ensure_manifest(tmp_path)
    session = Session(Stream(stream_prefix(tmp_path, 0, "h", 1)), 0, 0, 1, 0.0)
    probe = ExitProbe(session, on_end=lambda: None, on_crash=lambda how: None)
    printed: list[type] = []
    monkeypatch.setattr(sys, "excepthook", lambda exc_type, exc, tb: printed.append(exc_type))
    monkeypatch.setattr(exits, "thread_stacks", lambda: signal.raise_signal(signal.SIGINT) or "stacks")
    probe._install_excepthook()
    # Python's own handler, whatever this test run inherited (a background job ignores SIGINT)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            sys.excepthook(*sys.exc_info())  # as the interpreter calls it: the second SIGINT comes inside
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # set back once written
        assert printed == [KeyboardInterrupt]  # the job's own hook (python's: the traceback) still ran
        records = _records(tmp_path)
        kinds = [(r["k"], r.get("type") or r.get("status")) for r in records if r["k"] in ("exception", "end")]
        assert kinds == [("exception", "KeyboardInterrupt"), ("end", "exception")]
        with pytest.raises(KeyboardInterrupt):  # and Ctrl-C works as before afterwards
            signal.raise_signal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, inherited)


def _probe(tmp_path: Path) -> ExitProbe:
    ensure_manifest(tmp_path)
    session = Session(Stream(stream_prefix(tmp_path, 0, "h", 1)), 0, 0, 1, 0.0)
    return ExitProbe(session, on_end=lambda: None, on_crash=lambda how: None)


def _endings(tmp_path: Path) -> list[tuple[str, Any]]:
    return [(r["k"], r.get("type") or r.get("status")) for r in _records(tmp_path) if r["k"] in ("exception", "end")]


def test_an_uncaught_exception_the_hook_never_wrote_is_written_at_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second Ctrl-C already pending when the first KeyboardInterrupt reaches the hook
    fires at the hook's first line, before it can hold signals off: nothing was written and
    the exit handler wrote "exit 0" (the e2e stuck-outside test, one run in four beside a
    CPU hog). The interpreter sets sys.last_value before it calls the hook."""
    probe = _probe(tmp_path)
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt as exc:
        monkeypatch.setattr(sys, "last_value", exc, raising=False)
    probe._at_exit()
    assert _endings(tmp_path) == [("exception", "KeyboardInterrupt"), ("end", "exception")]
    [exc_record] = [r for r in _records(tmp_path) if r["k"] == "exception"]
    assert "test_exit_signals.py" in exc_record["traceback"]


def test_exit_without_an_uncaught_exception_is_exit_0(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(sys, "last_value", raising=False)
    _probe(tmp_path)._at_exit()
    assert _endings(tmp_path) == [("end", "exit")]
    # a SystemExit is the exit code's matter, not an exception
    monkeypatch.setattr(sys, "last_value", SystemExit(0), raising=False)
    other = tmp_path / "other"
    _probe(other)._at_exit()
    assert _endings(other) == [("end", "exit")]


def test_a_hook_stopped_after_the_record_still_ends_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    probe = _probe(tmp_path)
    monkeypatch.setattr(sys, "excepthook", lambda exc_type, exc, tb: None)
    probe._install_excepthook()

    def interrupted() -> None:
        raise KeyboardInterrupt  # a signal before the end record (held off in real life: a bug's stand-in)

    monkeypatch.setattr(probe, "_write_end", lambda status, code, why=None: interrupted())
    exc = RuntimeError("boom")
    with pytest.raises(KeyboardInterrupt):
        sys.excepthook(RuntimeError, exc, None)
    monkeypatch.undo()
    monkeypatch.setattr(sys, "last_value", exc, raising=False)
    probe._at_exit()
    assert _endings(tmp_path) == [("exception", "RuntimeError"), ("end", "exception")]
