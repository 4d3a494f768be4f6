"""The terminal table at many ranks: condensed past MAX_TABLE_RANKS so that the findings
above it stay on the screen, without hiding a rank that stands out."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from lorascope.analysis.summary import build_summary
from lorascope.rundir.loading.reader import load_run
from lorascope.text.findings import quiet, render_findings
from lorascope.text.summary import MAX_TABLE_RANKS, render_text

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


@pytest.fixture(scope="module")
def recorded() -> dict[str, Any]:
    return build_summary(load_run(FIXTURES / "rank-conditional-hang"))


def _world(recorded: dict[str, Any], n: int) -> dict[str, Any]:
    """``n`` ranks made from rank 1 of a recorded run: each with its own pid, step time,
    peak and a pending barrier whose sequence number differs (what a hang looks like)."""
    data = copy.deepcopy(recorded)
    template = data["ranks"][1]
    ranks = []
    for i in range(n):
        r = copy.deepcopy(template)
        r["rank"], r["pid"] = i, 10_000 + i
        r["step_time_median_s"] = 0.100 + i / 10_000
        r["peak_memory"]["rss_bytes"] = (400 + i % 7) * 2**20
        r["ended"] = {"status": "killed", "code": None, "detail": f"SIGKILL from pid {20_000 + i}"}
        r["collectives"]["pending"] = [
            {"op": "barrier", "seq": 7_580, "group": "default_pg", "bytes": 0, "site": "/j/train.py:88 in main"}
        ]
        ranks.append(r)
    data["ranks"] = ranks
    data["warnings"] = [f"rank {i}: stream ends mid-record at byte {1000 + i}" for i in range(n)]
    return data


def _rows(text: str) -> list[int]:
    """The ranks that have a row of their own."""
    return [int(line.split()[0]) for line in text.splitlines() if line[:4].strip().isdigit()]


def test_up_to_the_limit_every_rank_has_its_row(recorded: dict[str, Any]) -> None:
    data = _world(recorded, MAX_TABLE_RANKS)
    text = render_text(data)
    assert _rows(text) == list(range(MAX_TABLE_RANKS)) and text == render_text(data, all_ranks=True)
    assert text.count("pending: barrier") == MAX_TABLE_RANKS
    assert sum(line.startswith("warning: ") for line in text.splitlines()) == MAX_TABLE_RANKS


def test_many_alike_ranks_are_one_line_and_those_that_stand_out_keep_their_rows(recorded: dict[str, Any]) -> None:
    n = 1024
    data = _world(recorded, n)
    data["ranks"][0]["ended"] = {"status": "exception", "code": 1, "detail": "RuntimeError: rank 0's own failure"}
    data["ranks"][0]["collectives"]["pending"] = []
    data["ranks"][517]["step_time_median_s"] = 0.9  # a straggler
    data["ranks"][600]["peak_memory"]["rss_bytes"] = 9 * 2**30  # the largest peak
    data["ranks"][700]["steps"] -= 1  # stopped a step early: alone
    data["ranks"][701]["probe_errors"] = ["collectives: RuntimeError('x')"]
    data["ranks"][800]["collectives"]["pending"][0]["seq"] = 7_579  # one call behind
    text = render_text(data)
    lines = text.splitlines()
    assert _rows(text) == [0, 1, 517, 600, 700, 701, 800] and "barrier #7579" in text
    assert len(lines) < 24
    group = next(line for line in lines if line.startswith("  ranks "))
    assert group.startswith(
        "  ranks 2-516, 518-599, 601-699, 702-799, 801-1023 (1,017 ranks): as rank 1 but for their numbers"
    )
    assert "step(med) 100-202 ms" in group and "peak RSS 400-406 MiB" in group
    # the pending call of the group is shown under its first rank's row, once per row shown
    assert text.count("pending: barrier") == 6 and "probe switched off: collectives" in text
    assert (
        lines[-2] == "(1,024 ranks: 7 rows shown, the others alike; --all-ranks prints every row, --json every field)"
    )
    assert (
        lines[-1] == "warning: rank 0: stream ends mid-record at byte 1000 (and 1,023 more alike but for their numbers)"
    )
    everything = render_text(data, all_ranks=True)
    assert _rows(everything) == list(range(n)) and everything.count("warning: ") == n


def test_a_split_world_keeps_a_row_per_side(recorded: dict[str, Any]) -> None:
    """Half the ranks wait in one call, half in another: two groups, a row for each."""
    data = _world(recorded, 64)
    for r in data["ranks"][32:]:
        r["collectives"]["pending"][0]["op"] = "all_gather_into_tensor"
    text = render_text(data)
    # a row for each side's first rank, the slowest (63) and the first at the largest peak (6)
    assert _rows(text) == [0, 6, 32, 63] and "pending: all_gather_into_tensor" in text
    assert [line.split(" (")[0] for line in text.splitlines() if line.startswith("  ranks ")] == [
        "  ranks 1-5, 7-31",
        "  ranks 33-62",
    ]


def test_a_run_of_pending_calls_from_one_site_is_one_line(recorded: dict[str, Any]) -> None:
    """A rank-0-only ZeRO-3 gather of every adapter: 28 gathers pending at one site were 28
    lines under the rank's row. Consecutive calls of one op, group and site are one line;
    a call that breaks the run (another site, a gap in the numbers) starts its own."""
    data = _world(recorded, 2)
    site = "/job/train.py:397 in save"
    gathers = [
        {"op": "all_gather_into_tensor", "seq": 193 + i, "group": "default_pg", "bytes": 512 << (i % 3), "site": site}
        for i in range(28)
    ]
    later = {"op": "barrier", "seq": 222, "group": "default_pg", "bytes": 0, "site": "/job/train.py:9 in main"}
    data["ranks"][0]["collectives"]["pending"] = [*gathers, later]
    lines = [line.strip() for line in render_text(data).splitlines() if "pending:" in line]
    assert lines[:2] == [
        f"pending: all_gather_into_tensor #193-#220 on default_pg (28 calls, 512-2048 B) at {site}",
        "pending: barrier #222 on default_pg (0 B) at /job/train.py:9 in main",
    ]
    assert lines[2] == "pending: barrier #7580 on default_pg (0 B) at /j/train.py:88 in main"  # rank 1's, as before


def test_no_finding_says_what_was_looked_at() -> None:
    """ "no problem found by the detectors" was printed for a kernel trace alone (which the
    hang, memory and gradient detectors cannot read) and for a run a rank of which died
    with no detector naming why; the report said both. Now the terminal does too."""
    assert quiet({"ranks": []}).startswith("no problem found in the loaded artifacts (no run directory: ")
    fine = {"rank": 0, "steps": 40, "ended": {"status": "exit", "code": 0, "detail": None}}
    aborted = {
        "rank": 1,
        "ended": {"status": "signal", "code": -6, "detail": "Fatal Python error: Aborted\nThread 0x1"},
    }
    assert (
        quiet({"ranks": [fine, aborted]})
        == "no detector named a cause, but rank 1 ended badly: Fatal Python error: Aborted"
    )
    assert quiet({"ranks": [fine, {**fine, "rank": 1}]}) == "no problem found by the detectors: all 2 ranks exited 0"
    assert render_findings([], {"ranks": [fine]}) == "no problem found by the detectors: its one rank exited 0"


def test_no_finding_in_a_run_without_a_step_is_not_a_clean_bill() -> None:
    """Ranks that exited 0 without one step the probes saw (a loop that never calls an
    optimizer's step(), an evaluation script): the step-keyed detectors had nothing to
    read, and "no problem found by the detectors" said the opposite."""
    idle = {"rank": 0, "steps": 0, "ended": {"status": "exit", "code": 0, "detail": None}}
    both = quiet({"ranks": [idle, {**idle, "rank": 1}]})
    assert both.startswith("no detector named a cause, but no training step was seen (all 2 ranks exited 0 without")
    assert "no problem found" not in both
    # a rank with steps: the run was watched, and the headline is as before
    assert quiet({"ranks": [idle, {**idle, "rank": 1, "steps": 3}]}) == (
        "no problem found by the detectors: all 2 ranks exited 0"
    )
