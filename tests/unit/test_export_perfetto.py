"""`lorascope export RUN --perfetto`: the run as Chrome trace-event JSON, read back and
checked against the run's own records (fixtures/: real 2-rank runs)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from lorascope.analysis import analyze
from lorascope.export.perfetto import Window, step_window, timeline

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


def export(run: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lorascope", "export", str(run), "--perfetto", str(out), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def events(path: Path) -> list[dict[str, Any]]:
    raw = path.read_bytes()
    doc = json.loads(gzip.decompress(raw) if path.name.endswith(".gz") else raw)
    assert set(doc) >= {"traceEvents", "displayTimeUnit"}
    return list(doc["traceEvents"])


def test_every_rank_is_a_process_with_its_records(tmp_path: Path) -> None:
    out = tmp_path / "t.json.gz"
    res = export(FIXTURES / "healthy", out)
    assert res.returncode == 0, res.stderr
    evs = events(out)
    for e in evs:  # the trace-event format: a phase, a process, a time except for metadata
        assert isinstance(e["ph"], str) and isinstance(e["pid"], int)
        assert e["ph"] == "M" or isinstance(e["ts"], (int, float))
    names = {e["pid"]: e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(names) == [0, 1] and names[0].startswith("rank 0 (")
    run = analyze(FIXTURES / "healthy").bundle.run
    assert run is not None
    for n, rank in run.ranks.items():
        slices = [e for e in evs if e["pid"] == n and e["ph"] == "X" and e.get("cat") == "collective"]
        assert len(slices) == len(rank.collectives)
        assert sum(1 for e in evs if e["pid"] == n and e["ph"] == "X" and e["name"].startswith("step ")) == len(
            rank.steps
        )
        assert sum(1 for e in evs if e["pid"] == n and e["ph"] == "C") == len(rank.mem)
    flows = Counter(e["ph"] for e in evs if e["ph"] in "stf")
    assert flows["s"] == flows["f"] == len(run.ranks[0].collectives)  # each call joins both ranks
    assert any(e["pid"] == 0 and isinstance(e.get("tid"), int) and e["tid"] >= 1000 for e in evs), "kernel window"


def test_the_planted_hang_shows_on_the_right_ranks(tmp_path: Path) -> None:
    out = tmp_path / "hang.json"
    assert export(FIXTURES / "rank-conditional-hang", out).returncode == 0
    evs = events(out)
    analysis = analyze(FIXTURES / "rank-conditional-hang")
    seq = analysis.findings[0].details["seq"]
    at = {
        e["pid"]: e["name"] for e in evs if e.get("cat") == "collective" and e["ph"] == "X" and f" #{seq} " in e["name"]
    }
    assert at == {0: f"all_reduce #{seq} default_pg", 1: f"barrier #{seq} default_pg"}
    instants = [e for e in evs if e["ph"] == "i"]
    assert instants and instants[0]["name"].startswith("rank-conditional-hang: ")
    start = min(e["ts"] for e in evs if e.get("cat") == "collective" and e["ph"] == "X" and f" #{seq} " in e["name"])
    assert instants[0]["ts"] == start  # at its moment: the diverging call


def test_a_step_range_and_a_cap_bound_the_export(tmp_path: Path) -> None:
    analysis = analyze(FIXTURES / "healthy")
    run = analysis.bundle.run
    assert run is not None
    whole = timeline(analysis)["traceEvents"]
    window = step_window(run, 3, 4)
    part = timeline(analysis, window)["traceEvents"]
    steps = {e["name"] for e in part if e["ph"] == "X" and e["name"].startswith("step ") and e["pid"] == 0}
    assert steps == {"step 3", "step 4"} and len(part) < len(whole)
    assert all(window.holds(e["ts"] / 1e6, (e["ts"] + e.get("dur", 0)) / 1e6) for e in part if e["ph"] == "X")
    capped = timeline(analysis, Window(), max_events=100)
    assert len(capped["traceEvents"]) == 101 and "left out past the cap of 100" in capped["metadata"]["truncated"]


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    res = export(FIXTURES / "snapshots" / "lora-oom", tmp_path / "x.json")
    assert res.returncode == 3 and res.stderr.count("\n") == 1 and "not a lorascope run directory" in res.stderr
    res = export(FIXTURES / "healthy", tmp_path / "x.json", "--steps", "a:b")
    assert res.returncode == 2 and "--steps" in res.stderr


def test_snapshot_export_is_the_standard_pickle(tmp_path: Path) -> None:
    """A run directory's allocator snapshot comes out byte for byte as torch wrote it (what
    memory_viz opens), after the safe reader read it; a rank without one is one line."""
    import shutil

    from tests.helpers import add_snapshot

    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "rank0-asymmetry", run)
    source = FIXTURES / "snapshots" / "lora-oom" / "rank-1.pickle"
    add_snapshot(run, 1, source, "oom")
    out = tmp_path / "rank1.pickle"
    res = subprocess.run(
        [sys.executable, "-m", "lorascope", "export", str(run), "--snapshot", "1", "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert out.read_bytes() == source.read_bytes()
    res = subprocess.run(
        [sys.executable, "-m", "lorascope", "export", str(run), "--snapshot", "0", "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 3 and "no allocator snapshot of rank 0 (ranks with one: 1)" in res.stderr


def test_a_reduced_run_exports_every_call_and_step_of_the_window(tmp_path: Path, monkeypatch: Any) -> None:
    """A long run is loaded reduced (each group's first and newest calls, every stride-th
    step): the export reads the window again, so no call or step in it is missing. The
    healthy fixture (537 calls a rank, 6 steps) read with bounds small enough to reduce it."""
    from click.testing import CliRunner

    from lorascope.cli import cli
    from lorascope.rundir.loading import callreduce, reduce

    whole = analyze(FIXTURES / "healthy").bundle.run
    assert whole is not None
    for module in (reduce, callreduce):
        monkeypatch.setattr(module, "HEAD_CALLS", 40)
        monkeypatch.setattr(module, "TAIL_CALLS", 60)
    monkeypatch.setattr(reduce, "STEP_BUDGET", 4)
    monkeypatch.setattr(reduce, "MIN_STEPS_KEPT", 2)
    run = analyze(FIXTURES / "healthy").bundle.run
    assert run is not None
    for n, rank in run.ranks.items():  # the bounds took effect
        assert len(rank.collectives) < rank.collectives_total == len(whole.ranks[n].collectives)
        assert rank.stride > 1 and len(rank.steps) < len(whole.ranks[n].steps)

    def exported(*args: str) -> list[dict[str, Any]]:
        out = tmp_path / "t.json"
        result = CliRunner().invoke(cli, ["export", str(FIXTURES / "healthy"), "--perfetto", str(out), *args])
        assert result.exit_code == 0, result.output
        return events(out)

    evs = exported()
    for n, rank in whole.ranks.items():
        calls = [e for e in evs if e["pid"] == n and e["ph"] == "X" and e.get("cat") == "collective"]
        assert sorted((e["args"]["group"], e["args"]["seq"]) for e in calls) == sorted(
            (c.group, c.seq) for c in rank.collectives
        )
        steps = [e["name"] for e in evs if e["pid"] == n and e["ph"] == "X" and e["name"].startswith("step ")]
        assert steps == [f"step {s['step']}" for s in rank.steps]
        assert sum(1 for e in evs if e["pid"] == n and e["ph"] == "C") == len(rank.mem)

    window = step_window(whole, 3, 4)
    part = exported("--steps", "3:4")
    for n, rank in whole.ranks.items():
        inside = {
            (c.group, c.seq) for c in rank.collectives if window.holds(c.start, c.end if c.end is not None else c.start)
        }
        got = {
            (e["args"]["group"], e["args"]["seq"])
            for e in part
            if e["pid"] == n and e["ph"] == "X" and e.get("cat") == "collective"
        }
        assert got == inside and len(inside) > 40  # more than the reduced run kept from the middle


def test_a_span_keeps_what_overlaps_it_up_to_its_bound(tmp_path: Path) -> None:
    from lorascope.rundir.format.callfile import CallFile
    from lorascope.rundir.loading.callreduce import calls_between
    from lorascope.rundir.loading.calls import read_calls
    from lorascope.rundir.loading.reader import Collective

    f = CallFile(tmp_path / "h-1.calls", head=16, ring=16)
    calls = [(1.0, 2.0), (5.0, None), (8.0, 12.0), (15.0, 16.0), (21.0, 22.0), (19.0, 19.5)]
    for seq, (start, end) in enumerate(calls, 1):
        index = f.begin(start, seq, 4, 0, 0, 0)
        if end is not None:
            f.end(index, end)
    f.close()
    shapes = {0: ("all_reduce", "float32", False, None, None)}
    kept, left_out = calls_between(read_calls(f.path, "rank 0", []), shapes, str, {}, (10.0, 20.0), 2, Collective)
    # 1 ended before, 5 began after; 3 began before and ended inside, 4 and 6 inside (6 over
    # the bound of two: counted, not kept); 2 in flight through the span, kept past the bound
    assert [c.seq for c in kept] == [2, 3, 4] and left_out == 1
    assert kept[0].pending and kept[1].end == 12.0
