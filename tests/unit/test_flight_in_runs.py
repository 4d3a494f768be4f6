"""The flight recorder read next to a run directory: the collectives the probes cannot see.

DDP's gradient all_reduces and buffer broadcasts come from its C++ Reducer, so a DDP job
hung by a rank stuck in its own code shows no call in flight on any rank, and the
diagnosis could not tell the waiting rank from the stuck one ("no rank shows why"). Run
by hand (benchmarks/stopped_hangs.py's S-ddp-stall-term: rank 1 sleeps in its data fetch,
the job stopped by SIGTERM 30 s later): rank 0 was inside DDP's forward, in a buffer
broadcast (#14) that rank 1 never enqueued. The two flight-recorder dumps here are that
run's (fixtures/flight-recorder/ddp-stall-stopped: gloo, torch 2.13); gloo marks #14
completed on rank 0 (the call failed once rank 1 exited), so the rank's stack, at the
job's line that made the call, is what says it was still in it.
"""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from lorascope.analysis import analyze
from lorascope.detect import hung_ranks
from lorascope.detect.hang.diagnosis import diagnose, flight_since
from lorascope.hang.flights import EarlyFlights
from lorascope.ingest.load import bundle_of_run, load_bundle, rank_flight_timeline
from lorascope.probes.flight import flight_tail
from lorascope.rundir.format.safe_pickle import load_pickle
from lorascope.rundir.format.writer import stream_prefix
from lorascope.rundir.loading.reader import RunData, load_run
from tests.helpers import T0, RankSpec, write_run

FR = Path(__file__).resolve().parents[2] / "fixtures" / "flight-recorder" / "ddp-stall-stopped"
RECORDED_AT = "/work/main/"
JOB = "/job/"
SITE = "/job/probes/train_lora.py:342 in compute_loss"


def _relocated(value: Any) -> Any:
    """The dump's paths under /job/ (wherever this checkout is, its path may hold a
    directory the diagnosis takes for a library's)."""
    if isinstance(value, str):
        return value.replace(RECORDED_AT, JOB)
    if isinstance(value, list):
        return [_relocated(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_relocated(v) for v in value)
    if isinstance(value, dict):
        return {_relocated(k): _relocated(v) for k, v in value.items()}
    return value


def _stacks(*frames: tuple[str, int, str]) -> str:
    lines = "".join(
        f'  File "{JOB}probes/train_lora.py", line {line}, in {func}\n    {code}\n' for line, func, code in frames
    )
    return (
        "Thread lorascope-writer:\n"
        '  File "/usr/lib/python3.11/threading.py", line 1002, in _bootstrap\n    self._bootstrap_inner()\n\n'
        "Thread MainThread:\n" + lines + '  File "/site-packages/torch/nn/parallel/distributed.py", line 1886, in '
        "forward\n    inputs, kwargs = self._pre_forward(*inputs, **kwargs)\n"
    )


IN_FORWARD = _stacks((480, "<module>", "main()"), (433, "train", "loss = compute_loss()"), (342, "compute_loss", "x"))
IN_FETCH = _stacks(
    (480, "<module>", "main()"), (432, "train", "input_ids = fetch()"), (368, "fetch", "time.sleep(600)")
)
IN_SAVE = _stacks((480, "<module>", "main()"), (440, "train", "save(model)"), (390, "save", "torch.save(sd, path)"))


def _ddp_run(
    root: Path,
    stacks: tuple[str, str],
    stop: float,
    *,
    flight: bool = True,
    flight_at: float | None = None,
    earlier: int = 0,
    tail: int | None = None,
) -> Path:
    """Two DDP ranks with no recorded collective (the Reducer's are not seen), both
    stopped by SIGTERM at ``stop``, each with the stacks its signal wrote and, with
    ``flight``, the recorded flight-recorder dump next to its stream, written at
    ``flight_at`` (default: with the stop); ``earlier``: as many flight-recorder dumps
    recorded before, 30 s before the stop on (a stall watchdog's), each a file that is
    not a pickle; ``tail``: each dump written with its tail as the probes write it, that
    many completed collectives before the last one kept."""
    ranks = []
    for n in (0, 1):
        name = f"h-{100 + n}.flight.signal.pickle"
        extra: list[dict[str, Any]] = [
            {"k": "signal", "t": stop + 0.01 * n, "signum": 15, "name": "SIGTERM", "stacks": stacks[n]},
            {"k": "end", "t": stop + 0.01 * n + 0.001, "status": "signal", "code": -15},
        ]
        if flight:
            at = stop if flight_at is None else flight_at
            extra.insert(
                0 if at < stop else 1,
                {"k": "flight_dump", "t": at, "file": name, "reason": "signal", "bytes": 1}
                | ({} if tail is None else {"tail": name.replace(".pickle", ".tail.pickle")}),
            )
        extra[:0] = [
            {
                "k": "flight_dump",
                "t": stop - 30 + i,
                "file": f"h-{100 + n}.flight.stall-{i}.pickle",
                "reason": "stall",
                "bytes": 12,
            }
            for i in range(earlier)
        ]
        ranks.append(RankSpec(calls=[], ends=False, extra=extra))
    run_dir = write_run(root, ranks, command=["torchrun", "train.py"], exit_status=1)
    for n in (0, 1):
        prefix = stream_prefix(run_dir, n, "h", 100 + n)
        data = _relocated(load_pickle(FR / f"rank-{n}.pickle"))
        (prefix.parent / f"h-{100 + n}.flight.signal.pickle").write_bytes(pickle.dumps(data))
        if tail is not None:
            cut = pickle.dumps(flight_tail(data, tail), protocol=2)
            (prefix.parent / f"h-{100 + n}.flight.signal.tail.pickle").write_bytes(cut)
        for i in range(earlier):
            (prefix.parent / f"h-{100 + n}.flight.stall-{i}.pickle").write_bytes(b"not a pickle")
    return run_dir


def _timeline(run: RunData) -> dict[int, list[tuple[float, Any]]]:
    return {n: rank_flight_timeline(r, []) for n, r in run.ranks.items()}


STOP = T0 + 40.0  # ~37 s after the last step


def test_a_stopped_ddp_hang_names_the_stuck_rank_from_the_flight_recorder(tmp_path: Path) -> None:
    run_dir = _ddp_run(tmp_path / "run", (IN_FORWARD, IN_FETCH), STOP)
    run = load_run(run_dir)
    assert diagnose(run)["kind"] == "unknown"  # the probes' records alone: no rank shows why
    diagnosis = diagnose(run, flight=_timeline(run))
    assert (diagnosis["kind"], diagnosis["odd_ranks"]) == ("stuck-outside", [1])
    assert "/job/probes/train_lora.py:368 in fetch" in diagnosis["verdict"]
    waiting = diagnosis["ranks"][0]
    assert waiting["state"] == "in-collective"
    assert waiting["where"] == f"broadcast #14 on default_pg at {SITE} (flight recorder: rank 1 never enqueued it)"
    assert waiting["pending"][0]["source"].startswith("flight recorder")

    [finding] = hung_ranks.detect(load_bundle(run_dir))
    assert finding.ranks == [1] and finding.severity == "error" and finding.confidence == "high"
    assert "rank 0 waited in is one the probes cannot see" in finding.confidence_reason
    assert any(e.source == "flight-recorder dump of rank 0" for e in finding.evidence)


def test_without_the_dumps_it_still_says_no_rank_shows_why(tmp_path: Path) -> None:
    run_dir = _ddp_run(tmp_path / "run", (IN_FORWARD, IN_FETCH), STOP, flight=False)
    for dump in run_dir.glob("ranks/*/*.pickle"):
        dump.unlink()
    assert hung_ranks.detect(load_bundle(run_dir)) == []


def test_a_flight_dump_from_another_moment_is_not_read(tmp_path: Path) -> None:
    """A flight-recorder dump written long before the stop (with a `lorascope hang` dump
    taken while the job still moved, say) tells of that moment: the stop is read without it."""
    run_dir = _ddp_run(tmp_path / "run", (IN_FORWARD, IN_FETCH), STOP, flight_at=STOP - 20.0)
    assert diagnose(run := load_run(run_dir), flight=_timeline(run))["kind"] == "unknown"
    assert hung_ranks.detect(load_bundle(run_dir)) == []


def test_a_completed_call_counts_only_where_the_ranks_stack_is_at_it(tmp_path: Path) -> None:
    """Rank 0's #14 is marked completed: with its stack elsewhere (a save of its own) it
    may have gone on past it, so neither rank is taken for the waiting one."""
    run_dir = _ddp_run(tmp_path / "run", (IN_SAVE, IN_FETCH), STOP)
    diagnosis = diagnose(run := load_run(run_dir), flight=_timeline(run))
    assert diagnosis["kind"] == "unknown" and diagnosis["ranks"][0]["state"] == "outside-collectives"
    assert hung_ranks.detect(load_bundle(run_dir)) == []


def test_a_job_stopped_while_moving_stays_quiet_with_ranks_a_call_apart(tmp_path: Path) -> None:
    """Stopped a moment after the last steps, the same dumps (rank 0 a broadcast ahead, as
    ranks of a moving job often are) are no hang."""
    run_dir = _ddp_run(tmp_path / "run", (IN_FORWARD, IN_FETCH), T0 + 4.0)
    assert diagnose(run := load_run(run_dir), flight=_timeline(run))["kind"] == "stopped"
    assert hung_ranks.detect(load_bundle(run_dir)) == []


def test_the_dumps_alone_warn_that_a_rank_fell_behind(tmp_path: Path) -> None:
    """Without the run directory no stack says whether rank 0 was still in #14: a warning
    with low confidence, never "no problem found" while the ranks disagree."""
    out = tmp_path / "dumps"
    out.mkdir()
    for dump in FR.glob("rank-*.pickle"):
        shutil.copy(dump, out / dump.name)
    [finding] = analyze(out).findings
    assert (finding.id, finding.severity, finding.confidence, finding.ranks) == ("hung-ranks", "warning", "low", [1])
    assert finding.title.startswith("rank 1 never enqueued broadcast #14 on group 0, which rank 0 ran at")
    assert finding.title.endswith(
        "it fell behind, outside any collective (stuck, or a call behind when the dumps were taken: the dumps "
        "alone cannot tell)"
    )


def test_lorascope_hang_reads_the_dumps_too(tmp_path: Path) -> None:
    """`lorascope hang` on the run (its processes gone): the same verdict as `analyze`."""
    run_dir = _ddp_run(tmp_path / "run", (IN_FORWARD, IN_FETCH), STOP)
    cmd = [sys.executable, "-m", "lorascope", "hang", str(run_dir), "--wait", "0", "--no-html"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert (
        f"rank 0     is in broadcast #14 on default_pg at {SITE} (flight recorder: rank 1 never enqueued it)" in lines
    )
    [verdict] = [line for line in lines if line.startswith("verdict: ")]
    assert verdict.startswith("verdict: the job is over (no process of it is alive)")  # as analyze says it:
    assert "hung-ranks: rank 1 is stuck outside any collective" in verdict, lines


def test_hang_reads_only_the_flight_dumps_its_diagnosis_can_go_by(tmp_path: Path) -> None:
    """Each stall (up to 20 a process) and each earlier `lorascope hang` leaves a
    flight-recorder dump per rank, a safe unpickling each: `hang` reads only those written
    with each rank's latest dump (the only ones its diagnosis goes by), to the same
    verdict. The earlier ones here do not read: reading them would warn."""
    run_dir = _ddp_run(tmp_path / "run", (IN_FORWARD, IN_FETCH), STOP, earlier=3)
    every: list[str] = []
    run = load_run(run_dir)
    full = {n: rank_flight_timeline(r, every) for n, r in run.ranks.items()}
    assert len(every) == 6 and all("stall-" in w for w in every)
    run = load_run(run_dir)
    read: list[str] = []
    chosen = {
        n: rank_flight_timeline(r, read, since)
        for n, r in run.ranks.items()
        if (since := flight_since(r, run)) is not None
    }
    assert read == [] and {n: len(t) for n, t in chosen.items()} == {0: 1, 1: 1}
    diagnosis = diagnose(run, flight=chosen)
    assert diagnosis == diagnose(load_run(run_dir), flight=full)
    assert (diagnosis["kind"], diagnosis["odd_ranks"]) == ("stuck-outside", [1])

    cmd = [sys.executable, "-m", "lorascope", "hang", str(run_dir), "--wait", "0", "--no-html"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert f"rank 0     is in broadcast #14 on default_pg at {SITE} (flight recorder: rank 1 never enqueued it)" in (
        res.stdout.splitlines()
    )
    assert "stall-" not in res.stdout, res.stdout
    # a live hang's page goes by the dumps its verdict read, not every one again
    page = bundle_of_run(run, run_dir, chosen)
    assert {n: page.flight_records[n] for n in (0, 1)} == {n: chosen[n][0][1] for n in (0, 1)}
    assert not [w for w in page.warnings if "stall-" in w]
    assert len([w for w in bundle_of_run(run, run_dir).warnings if "stall-" in w]) == 6


def test_hang_aligns_the_ranks_by_the_dumps_tails_and_reads_them_whole_where_they_share_none(tmp_path: Path) -> None:
    """A dump of torch's size takes ~90 ms to read safely: `hang` reads the tails the
    probes write beside (each group's collectives from a few before its last completed
    one), to the verdict the whole dumps give. Rank 0 completed #14, rank 1 #13 (gloo
    marks a failed call completed): tails from one before share #13, and are what is
    read; tails from the last completed (#14 and #13) share nothing, and the whole dumps
    are read instead."""
    lines = {}
    for tail in (None, 1, 0):
        run_dir = _ddp_run(tmp_path / f"run-{tail}", (IN_FORWARD, IN_FETCH), STOP, tail=tail)
        cmd = [sys.executable, "-m", "lorascope", "hang", str(run_dir), "--wait", "0", "--no-html", "--json"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        lines[tail] = json.loads(res.stdout)
        run = load_run(run_dir)
        with EarlyFlights() as flights:
            read = {n: flights.timeline(r, [], flight_since(r, run) or 0.0) for n, r in run.ranks.items()}
            kept = flights.covering(read)
        whole = {n: [(t, d.path.name, len(d.entries)) for t, d in dumps] for n, dumps in kept.items()}
        if tail == 1:
            assert {n: [e.seq for e in d.entries] for n, [(_, d)] in kept.items()} == {0: [13, 14], 1: [12, 13]}
        else:
            assert {n: [(name, count)] for n, [(_, name, count)] in whole.items()} == {
                0: [("h-100.flight.signal.pickle", 14)],
                1: [("h-101.flight.signal.pickle", 13)],
            }
    assert lines[1] == lines[None] and lines[0] == lines[None]
    assert lines[None]["odd_ranks"] == [1]
