"""The dump request in the run directory: every rank's probe thread answers it within a
second or so, wherever it runs (no signal needed: another host, another PID namespace, a
process attached late); the stall watchdog's limit follows the job's own step time."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from lorascope.hang.request import write_request
from lorascope.probes.dumps import Dumper, stall_seconds
from lorascope.probes.session import Session
from lorascope.rundir.format.schema import DUMP_REQUEST
from lorascope.rundir.format.writer import Stream, ensure_manifest, stream_prefix


def _dumps(run: Path) -> list[dict[str, Any]]:
    out = []
    for path in run.glob("ranks/*/*.jsonl"):
        out += [r for line in path.read_text().splitlines() if line and (r := json.loads(line))["k"] == "dump"]
    return out


def _until(check: Any, timeout: float) -> float:
    began = time.time()
    while time.time() - began < timeout:
        if check():
            return time.time() - began
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout} s")


def test_a_request_in_the_run_directory_is_answered_by_the_probe_thread(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ensure_manifest(run)
    old, _ = write_request(run)  # a request from before this rank attached: not answered
    session = Session(Stream(stream_prefix(run, 0, "h", 1)), 0, 0, 1, 0.0)
    flights: list[str] = []
    dumper = Dumper(session, list, dict, flights.append, lambda: None, None, request_path=run / DUMP_REQUEST)
    dumper.start_watchdog()
    session.stream.start_writer()
    try:
        time.sleep(1.5)
        assert _dumps(run) == []
        request, why = write_request(run)
        assert why is None and request != old
        took = _until(lambda: len(_dumps(run)) == 1, timeout=10)
        assert took < 5  # one look a second (a loaded machine: a generous bound)
        [dump] = _dumps(run)
        assert (dump["reason"], dump["request"]) == ("request", request)
        assert flights and flights[0].startswith("request-")
        # `lorascope hang` signals the ranks on its host after writing the request: the
        # signal that comes with an answered request takes no second dump ...
        dumper.dump("signal")
        assert len(_dumps(run)) == 1
        # ... and one with a request not yet seen answers it
        second, _ = write_request(run)
        dumper.dump("signal")
        assert [(d["reason"], d.get("request")) for d in _dumps(run)][1] == ("signal", second)
        time.sleep(1.5)
        assert len(_dumps(run)) == 2  # the watchdog does not answer it again
    finally:
        session.stream.close()


def test_a_request_file_that_cannot_be_written_is_one_note(tmp_path: Path) -> None:
    request, why = write_request(tmp_path / "absent")
    assert request is None and why is not None and "only this host's ranks were asked" in why


def test_the_stall_limit_follows_the_median_step() -> None:
    """max(60 s, 10 x the median step), never later than a third of the process-group
    timeout (5 s to 5 minutes); LORASCOPE_STALL_SECONDS overrides."""
    assert stall_seconds(None, None, None) == 300.0  # no step yet: the timeout's rule
    assert stall_seconds(None, None, 0.5) == 60.0
    assert stall_seconds(None, None, 12.0) == 120.0
    assert stall_seconds(None, None, 100.0) == 300.0  # a third of the default 30 minutes
    assert stall_seconds(15.0, None, 0.5) == 5.0  # the timeout comes first
    assert stall_seconds(None, 7.0, 0.5) == 7.0


def test_the_watchdog_takes_the_median_of_the_latest_steps(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ensure_manifest(run)
    session = Session(Stream(stream_prefix(run, 0, "h", 1)), 0, 0, 1, 0.0)
    dumper = Dumper(session, list, dict, lambda r: None, lambda: None, None)
    dumper.last_progress -= 100.0  # start-up: left out
    for _ in range(5):
        dumper.progress()
    assert dumper.median_step() is not None and dumper.median_step() < 1.0  # type: ignore[operator]
    session.stream.close()
