"""`lorascope hang` on real hung 2-rank jobs (gloo, CPU), while they hang; the stall
watchdog; and that no pid outside the run is ever signalled."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from lorascope.detect.hang.diagnosis import diagnose
from lorascope.detect.hang.divergence import first_divergence
from lorascope.probes.collectives import ENV_CALL_SLOTS
from lorascope.rundir.loading.ending import DUMP_MIN_S, DUMP_STEPS, progress_window
from lorascope.rundir.loading.reader import RECENT_RECORDS, RankData, RunData, load_run
from tests.helpers import HANG_JSON_KEYS, LORASCOPE, REPO, TRAIN, default_signals, free_port, job_env, torchrun

pytestmark = pytest.mark.e2e


@contextmanager
def hung_job(
    out: Path, *args: str, monitor: bool = True, script: str = TRAIN, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[str]]:
    """A probed 2-rank job with a planted hang (``env``: more of its environment); ended
    (its whole process group) on exit."""
    extra = [] if monitor else ["--monitor-interval", "600"]  # torchrun would reap a dead rank's peers
    cmd = [*LORASCOPE, "run", "--out", str(out), "--", *torchrun(free_port(), *args, launcher=extra, script=script)]
    proc = subprocess.Popen(
        cmd,
        env={**job_env(), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_signals,
    )
    try:
        yield proc
    finally:
        end_job(proc)


def end_job(proc: subprocess.Popen[str]) -> None:
    """torchrun starts its workers in sessions of their own: end the whole tree."""
    try:
        tree = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.communicate(timeout=60)


def wait_until(out: Path, check: Callable[[RunData], bool], timeout: float = 240) -> RunData:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            run = load_run(out)
            if len(run.ranks) == 2 and check(run):
                return run
        except Exception:
            pass
        time.sleep(0.5)
    raise AssertionError("the job did not reach the expected state")


def past_a_moving_jobs_pause(run: RunData) -> None:
    """Sleep until the hang is older than the window in which a dump reads as a job still
    moving (`moving_at`: a few of the fastest steps after the last step's end)."""
    last = max(float(r.steps[-1]["t"]) for r in run.ranks.values())
    fastest = min(float(s["dur"]) for r in run.ranks.values() for s in r.steps)
    time.sleep(max(0.0, last + max(DUMP_MIN_S, DUMP_STEPS * fastest) + 2 - time.time()))


def pending_in_job(rank: RankData, func: str) -> bool:
    return any(c.pending and c.site and f"in {func}" in c.site for c in rank.collectives)


def hang(out: Path, *extra: str) -> dict:
    res = subprocess.run([*LORASCOPE, "hang", str(out), "--json", *extra], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert set(data) == HANG_JSON_KEYS  # as `hang --pid --json` (tests/unit/test_hang_pyspy.py)
    return data


def test_rank_conditional_collective(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with hung_job(out, "--steps", "20", "--fault", "rank-conditional-hang", "--fault-step", "3"):
        run = wait_until(
            out,
            lambda r: (
                pending_in_job(r.ranks[0], "rank_conditional_collective")
                and pending_in_job(r.ranks[1], "rank_conditional_collective")
            ),
        )
        line = next(c.site for c in run.ranks[0].collectives if c.pending)
        data = hang(out)
    assert data["kind"] == data["id"] == "rank-conditional-hang" and data["odd_ranks"] == [0]
    assert data["first_diverged"]["rank"] == 0
    assert line in data["first_diverged"]["where"] and "if d.rank == 0:" in data["first_diverged"]["where"]
    report = next(n for n in data["notes"] if n.startswith("report: "))[len("report: ") :]
    assert Path(report).stat().st_size > 10_000


def test_collectives_of_two_groups_in_crossed_orders(tmp_path: Path) -> None:
    """Rank 0 waits in the second group's all_reduce, rank 1 in the default group's
    barrier: neither issued the other's call, no group's own calls disagree. Read before
    as "every rank waits in the same collective: the collective itself is stuck"."""
    out = tmp_path / "run"
    with hung_job(out, "--steps", "20", "--fault", "crossed-groups-hang", "--fault-step", "3"):
        run = wait_until(
            out,
            lambda r: (
                pending_in_job(r.ranks[0], "crossed_group_collectives")
                and pending_in_job(r.ranks[1], "crossed_group_collectives")
            ),
        )
        # no group's calls disagree, so a dump within a step or two of the last step's end
        # reads as a job moving (`moving_at`): ask once the hang is older than that
        past_a_moving_jobs_pause(run)
        data = hang(out, "--no-html")
    assert (data["kind"], data["id"], data["odd_ranks"]) == ("crossed-collectives", "hung-ranks", [0, 1])
    verdict = data["verdict"]
    assert verdict.startswith("the ranks wait for one another in collectives of different groups: "), verdict
    assert "rank 0 waits in all_reduce #1 on group " in verdict and "for rank 1" in verdict, verdict  # torch's "2"
    assert "rank 1 waits in barrier #" in verdict and "for rank 0" in verdict, verdict
    assert "if d.rank == 0:" in verdict, verdict


def test_rank_conditional_collective_past_the_call_rings_newest(tmp_path: Path) -> None:
    """The same hang after more calls than `hang` reads of a rank (RECENT_RECORDS): the
    call files' small rings went round (the probes summed the steps past them, a
    ``calls_step`` record a step), and the verdict from each rank's newest calls is the
    whole read's."""
    out = tmp_path / "run"
    slots = {ENV_CALL_SLOTS: f"64,{RECENT_RECORDS + 512}"}
    with hung_job(out, "--steps", "80", "--fault", "rank-conditional-hang", "--fault-step", "60", env=slots):
        run = wait_until(
            out,
            lambda r: (
                pending_in_job(r.ranks[0], "rank_conditional_collective")
                and pending_in_job(r.ranks[1], "rank_conditional_collective")
            ),
        )
        data = hang(out)
    assert max(t.last_seq for t in run.ranks[0].tallies.values()) > 64 + RECENT_RECORDS + 512  # round the ring
    assert any('"k":"calls_step"' in Path(f).read_text() for f in run.ranks[0].files)
    assert data["kind"] == "rank-conditional-hang" and data["odd_ranks"] == [0]
    assert "if d.rank == 0:" in data["first_diverged"]["where"]
    whole = diagnose(run)
    assert (whole["kind"], whole["odd_ranks"]) == (data["kind"], data["odd_ranks"])


def test_rank_stuck_outside_collectives(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with hung_job(out, "--steps", "20", "--fault", "rank1-stall", "--fault-step", "5") as proc:
        run = wait_until(out, lambda r: len(r.ranks[1].steps) >= 4 and any(c.pending for c in r.ranks[0].collectives))
        time.sleep(1)
        data = hang(out, "--no-html")
        assert data["kind"] == "stuck-outside" and data["id"] == "hung-ranks" and data["odd_ranks"] == [1]
        assert "train_lora.py" in data["first_diverged"]["where"] and "in fetch" in data["first_diverged"]["where"]
        # the same job seen from outside, as if it had not been started under lorascope
        pids = [str(r.pid) for r in run.ranks.values()]
        res = subprocess.run(
            [*LORASCOPE, "hang", "--json", *sum((["--pid", p] for p in pids), [])],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 0, res.stderr
        outside = json.loads(res.stdout)
        # and stopped by hand, as on-call engineers do: Ctrl-C on `lorascope run`, which
        # passes it on to the ranks, as torchrun does too (the second SIGINT lost rank 1's
        # ending: "exit 0"); read afterwards, the stop is where the ranks were
        # ... once the stall is longer than a healthy job may go without a step (the rule's
        # window from the steps so far: the warm-up step is long on a loaded machine)
        rank = load_run(out).ranks[1]
        window = max(progress_window(rank), 2 * max(float(s["dur"]) for s in rank.steps))
        time.sleep(max(0.0, float(rank.steps[-1]["t"]) + window + 2 - time.time()))
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=120)
    assert outside["kind"] == "stuck-outside" and outside["odd_ranks"] == ["rank 1"]
    where = outside["groups"][[g["ranks"] for g in outside["groups"]].index(["rank 1"])]["where"]
    assert "train_lora.py" in where and "fetch" in where  # py-spy names it Faults.fetch
    stopped = load_run(out)
    assert stopped.ranks[1].exception is not None and stopped.ranks[1].exception["type"] == "KeyboardInterrupt"
    res = subprocess.run([*LORASCOPE, "analyze", str(out), "--json"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    [finding] = [f for f in json.loads(res.stdout)["findings"] if f["id"] == "hung-ranks"]
    assert (
        finding["ranks"] == [1] and "stuck outside any collective" in finding["title"] and "fetch" in finding["title"]
    )


@pytest.mark.slow
def test_ddp_rank_stuck_outside_named_from_the_flight_recorder(tmp_path: Path) -> None:
    """Under DDP the waiting rank's all_reduces and buffer broadcasts come from the C++
    Reducer, unseen by the probes: only its flight-recorder dump says it waits for rank 1."""
    out = tmp_path / "run"
    args = ("--engine", "torch", "--steps", "20", "--fault", "rank1-stall", "--fault-step", "5")
    with hung_job(out, *args, "--pg-timeout", "900") as proc:
        wait_until(out, lambda r: len(r.ranks[1].steps) >= 4)
        time.sleep(3)
        assert not any(c.pending for r in load_run(out).ranks.values() for c in r.collectives)
        data = hang(out, "--no-html")
        assert (data["kind"], data["odd_ranks"]) == ("stuck-outside", [1]), data["verdict"]
        waiting = data["ranks"][0]
        assert waiting["state"] == "in-collective" and "flight recorder: rank 1 never enqueued it" in waiting["where"]
        # stopped as a scheduler would, once the stall is longer than a moving job's pause
        rank = load_run(out).ranks[1]
        window = max(progress_window(rank), 2 * max(float(s["dur"]) for s in rank.steps))
        time.sleep(max(0.0, float(rank.steps[-1]["t"]) + window + 2 - time.time()))
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    res = subprocess.run([*LORASCOPE, "analyze", str(out), "--json"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    [finding] = [f for f in json.loads(res.stdout)["findings"] if f["id"] == "hung-ranks"]
    assert finding["ranks"] == [1] and "fetch" in finding["title"]


def test_killed_rank(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with hung_job(out, "--steps", "400", monitor=False):
        run = wait_until(out, lambda r: len(r.ranks[1].steps) >= 2)
        os.kill(run.ranks[1].pid, signal.SIGKILL)
        # On gloo the survivor does not hang: its collective fails as the peer's socket
        # closes. The launcher (monitoring every 10 minutes here) keeps the job "up".
        wait_until(
            out,
            lambda r: (
                r.ranks[0].exception is not None
                or (any(c.pending for c in r.ranks[0].collectives) and time.time() - r.ranks[0].last_time > 1)
            ),
        )
        data = hang(out, "--no-html")
    # both ranks ended (rank 0's collective failed as rank 1's socket closed): the job is
    # over, said so, not "the others wait for it"; rank 1's death (no record: only /proc
    # tells its process is gone) comes first
    assert data["kind"] == "over" and data["odd_ranks"] == [1], data["verdict"]
    assert data["verdict"].startswith("the job is over (no process of it is alive): rank 1 died first, after step ")
    assert "SIGKILL" in data["first_diverged"]["where"] and "wait for it" not in data["verdict"]
    assert any("rank 1" in n and "process gone" in n for n in data["notes"])


def test_stall_watchdog_dumps_before_the_timeout_and_analyze_agrees(tmp_path: Path) -> None:
    """pg timeout 15 s: the watchdog dumps at 5 s; the job then dies of the timeout and
    `lorascope analyze` of the dead run gives the live verdict."""
    out = tmp_path / "run"
    with hung_job(out, "--steps", "20", "--fault", "rank1-stall", "--fault-step", "3", "--pg-timeout", "15") as proc:
        proc.wait(timeout=240)
    run = load_run(out)
    rank0 = run.ranks[0]
    assert rank0.stall is not None and rank0.dumps and rank0.dumps[0]["reason"] == "stall"
    assert rank0.exception is not None and "Timed out" in rank0.exception["message"]
    assert float(rank0.dumps[0]["t"]) < float(rank0.exception["t"])
    assert any(
        Path(f).name.startswith(Path(rank0.files[0]).name.split(".")[0])
        for f in (d["path"] for d in rank0.flight_dumps)
    )
    res = subprocess.run([*LORASCOPE, "analyze", str(out), "--json"], capture_output=True, text=True, timeout=120)
    top = json.loads(res.stdout)["findings"][0]
    assert top["id"] == "hung-ranks" and top["ranks"] == [1]
    assert top["details"]["hang"]["kind"] == "stuck-outside"
    assert "in fetch" in top["title"]


#: The planting of probes/zero3_save.py: rank 0 alone enters GatheredParameters to save.
ZERO3_SAVE = REPO / "probes" / "zero3_save.py"


def test_a_rank_only_gather_into_zero3_state_explains_the_desync(tmp_path: Path) -> None:
    """Rank 0 alone enters GatheredParameters at a save, inside `if d.rank == 0:`; its
    adapters are persistent, so it issues no collective there, but its next forward
    all-gathers them and the ranks' collectives disagree (rank 1 is already in backward's
    reduce-scatter). No rank condition encloses the diverging calls: the verdict said
    "rank-conditional collective: ?"; now it names the rank-only entry, its line and its
    condition, in `hang` and in `analyze` (high confidence: both ranks' records show it)."""
    out = tmp_path / "run"
    source = ZERO3_SAVE.read_text().splitlines()
    line = next(i for i, text in enumerate(source, 1) if "GatheredParameters(adapters)" in text)
    site = f"{ZERO3_SAVE}:{line} in save_adapters"
    with hung_job(out, "--steps", "6", "--fault-step", "3", "--pg-timeout", "300", script=str(ZERO3_SAVE)):
        wait_until(out, lambda r: first_divergence(r) is not None)  # both ranks wait at #284
        time.sleep(1)
        data = hang(out, "--no-html")
    assert data["kind"] == data["id"] == "rank-conditional-hang" and data["odd_ranks"] == [0]
    rank_only = data["first_diverged"]["rank_only"]
    assert (rank_only["site"], rank_only["ranks"], rank_only["others"]) == (site, [0], [1])
    assert rank_only["condition"] == ["if d.rank == 0:", site] and rank_only["sure"]
    assert data["verdict"].startswith(f"rank 0 alone entered deepspeed.zero.GatheredParameters at {site}")
    assert "under `if d.rank == 0:`" in data["verdict"] and "GatheredParameters" in data["fix"]
    res = subprocess.run([*LORASCOPE, "analyze", str(out), "--json"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    top = json.loads(res.stdout)["findings"][0]
    assert (top["id"], top["ranks"], top["confidence"]) == ("rank-conditional-hang", [0], "high")
    assert top["title"].startswith(f"rank 0 alone entered deepspeed.zero.GatheredParameters at {site}")
    assert top["details"]["rank_only"]["condition"] == ["if d.rank == 0:", site]


def test_the_rank_only_gather_named_after_the_job_died(tmp_path: Path) -> None:
    """The same planting left to run its course: the ranks' collectives disagree, the
    job dies (gloo's timeout or its abort on the size mismatch), and `analyze` names the
    rank-only GatheredParameters from both ranks' records. The call each rank died in is
    in its records whatever killed it: it was written before the call began."""
    out = tmp_path / "run"
    source = ZERO3_SAVE.read_text().splitlines()
    line = next(i for i, text in enumerate(source, 1) if "GatheredParameters(adapters)" in text)
    site = f"{ZERO3_SAVE}:{line} in save_adapters"
    cmd = torchrun(free_port(), "--steps", "6", "--fault-step", "3", "--pg-timeout", "10", script=str(ZERO3_SAVE))
    subprocess.run(
        [*LORASCOPE, "run", "--out", str(out), "--", *cmd], capture_output=True, text=True, timeout=300, env=job_env()
    )
    run = load_run(out)
    assert len(run.ranks) == 2 and all(r.end is None or r.end["status"] != "exit" for r in run.ranks.values())
    for rank in run.ranks.values():  # the call each rank was in when it died is there, unfinished
        last = max(rank.collectives, key=lambda c: c.start)
        assert last.end is None or last.err is not None, f"rank {rank.rank}: its last call ended cleanly"
    res = subprocess.run([*LORASCOPE, "analyze", str(out), "--json"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    top = json.loads(res.stdout)["findings"][0]
    assert (top["id"], top["ranks"]) == ("rank-conditional-hang", [0])
    assert top["title"].startswith(f"rank 0 alone entered deepspeed.zero.GatheredParameters at {site}")


#: probes/uneven_shards.py: each rank trains until its data shard runs out; rank 0's is a batch longer.
UNEVEN = REPO / "probes" / "uneven_shards.py"


def _uneven_shards(tmp_path: Path, *args: str) -> dict:
    """`hang` on the uneven-shards job once rank 1 waits in the barrier after its loop
    and the hang is older than a moving job's pause."""
    out = tmp_path / "run"
    job = ("--num-samples", "41", "--micro-batch", "4", "--pg-timeout", "600", *args)
    with hung_job(out, *job, script=str(UNEVEN)):
        run = wait_until(out, lambda r: pending_in_job(r.ranks[1], "main") and len(r.ranks[0].steps) >= 5)
        past_a_moving_jobs_pause(run)
        return hang(out, "--no-html")


def test_uneven_shards_are_told_as_a_branch_on_the_data(tmp_path: Path) -> None:
    """ZeRO-3: rank 0 is in its step 6's backward (reduce_scatter), rank 1 in the barrier
    after its 5 steps; no rank condition encloses either call. Read "rank-conditional
    collective: ?" with the fix to move the collective out of an `if rank == 0:`."""
    data = _uneven_shards(tmp_path)
    assert (data["kind"], data["odd_ranks"]) == ("rank-conditional-hang", []), data["verdict"]
    verdict = data["verdict"]
    assert "with no rank condition around them" in verdict, verdict
    assert "rank 0 calls reduce_scatter_tensor at train_lora.py:" in verdict and "in its step 6 (backward)" in verdict
    assert "rank 1 calls barrier at uneven_shards.py:" in verdict and "after its step 5, outside any step" in verdict
    assert "begun different numbers of steps" in verdict and "same number of batches" in data["fix"]


@pytest.mark.slow
def test_uneven_shards_under_ddp_are_told_from_the_flight_recorder(tmp_path: Path) -> None:
    """DDP: rank 0 waits in DDP's buffer broadcast (the C++ side: the flight recorder
    only), rank 1 in the barrier. Read "rank 0 is stuck outside any collective, in its own
    code at compute_loss"."""
    data = _uneven_shards(tmp_path, "--engine", "torch")
    assert (data["kind"], data["odd_ranks"]) == ("rank-conditional-hang", []), data["verdict"]
    assert (
        "in the flight recorder" in data["verdict"] and "rank 1 calls barrier at uneven_shards.py:" in data["verdict"]
    )
    assert data["ranks"][0]["state"] == "in-collective" and "flight recorder" in data["ranks"][0]["where"]
    assert "same number of batches" in data["fix"]


#: probes/eval_rank0.py: a validation forward on rank 0 alone every --eval-every steps.
EVAL_RANK0 = REPO / "probes" / "eval_rank0.py"


def test_an_evaluation_on_rank_0_under_zero3_is_named(tmp_path: Path) -> None:
    """ZeRO-3 with partitioned parameters: rank 0's validation forward after step 4 gathers
    parameters, its gather pairs with rank 1's next training gather, and at the next
    collective rank 0 gathers in its forward while rank 1 reduce-scatters in its backward.
    Read "a branch on the data", with the uneven-data fix."""
    out = tmp_path / "run"
    job = ("--hidden", "512", "--intermediate", "1024", "--eval-every", "4", "--steps", "12", "--pg-timeout", "600")
    with hung_job(out, *job, script=str(EVAL_RANK0)):
        run = wait_until(
            out,
            lambda r: pending_in_job(r.ranks[0], "compute_loss") and pending_in_job(r.ranks[1], "backward_and_step"),
        )
        past_a_moving_jobs_pause(run)
        data = hang(out, "--no-html")
    assert (data["kind"], data["odd_ranks"]) == ("rank-conditional-hang", [0]), data["verdict"]
    verdict = data["verdict"]
    assert verdict.startswith("rank 0 alone made all_gather_into_tensor #"), verdict
    assert (
        "called from eval_rank0.py:" in verdict and "under `if step % args.eval_every == 0 and d.rank == 0:`" in verdict
    )
    assert "it paired with rank 1's all_gather_into_tensor" in verdict and "(after its step 4)" in verdict
    assert data["fix"].startswith("Run the code those calls came from on every rank")
