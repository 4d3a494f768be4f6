"""`lorascope hang` on a run directory: the verdict first, the HTML report best effort
(on the training-environment install, without jinja2, the verdict still prints)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from lorascope.cli.hang_verdict import _target_notes
from lorascope.detect import rank_conditional_hang
from lorascope.detect.hang.diagnosis import _verdict, fatal_main_frame
from lorascope.hang.targets import Target
from lorascope.ingest.load import load_bundle
from lorascope.rundir.loading.reader import RECENT_RECORDS
from lorascope.text.hang import render_hang
from tests.helpers import Call, RankSpec, write_run

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
#: Runs the CLI with jinja2 made unimportable, as on `pip install lorascope` alone.
NO_JINJA = "import sys; sys.modules['jinja2'] = None; from lorascope.cli import main; main(sys.argv[1:])"


def _hang(run: Path, *args: str, no_jinja: bool = False) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-c", NO_JINJA] if no_jinja else [sys.executable, "-m", "lorascope"]
    return subprocess.run([*cmd, "hang", str(run), "--wait", "0", *args], capture_output=True, text=True, timeout=120)


def test_verdict_prints_without_jinja2(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "hung-ranks", run)
    res = _hang(run, no_jinja=True)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    verdict = next(i for i, line in enumerate(lines) if line.startswith("verdict: "))
    note = next(i for i, line in enumerate(lines) if line.startswith("note: no HTML report"))
    assert "rank 1" in lines[verdict] and verdict < note
    assert "jinja2" in lines[note]
    assert not list(run.glob("hang-*.html"))


def test_report_written_after_the_verdict(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "hung-ranks", run)
    out = tmp_path / "hang.html"
    res = _hang(run, "--html", str(out))
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[-1] == f"note: report: {out}"
    assert out.stat().st_size > 100_000 and "hung-ranks" in out.read_text()


def test_a_thousand_ranks_alike_but_for_their_numbers_are_one_line() -> None:
    """Every rank's error names its own peer and port: one line for them, not 1,023."""

    groups = [{"where": "died: RuntimeError: rank 0's own failure in train.py:88", "ranks": [0]}]
    groups += [
        {
            "where": f"died: RuntimeError: Connection closed by peer [10.0.{n // 256}.{n % 256}]:{29500 + n}",
            "ranks": [n],
        }
        for n in range(1, 1024)
    ]
    diagnosis = {"groups": groups, "verdict": "rank 0 died; the others wait for it", "fix": "see rank 0"}
    lines = render_hang(diagnosis, ["a note"]).splitlines()
    assert lines == [
        "rank 0     died: RuntimeError: rank 0's own failure in train.py:88",
        "1,023 ranks died: RuntimeError: Connection closed by peer [10.0.0.1]:29501"
        " (alike but for their numbers; rank 1's shown)",
        "verdict: rank 0 died; the others wait for it",
        "fix: see rank 0",
        "note: a note",
    ]
    # two ranks alike keep a line each, as they always did
    two = render_hang({**diagnosis, "groups": groups[1:3]}, []).splitlines()
    assert two[:2] == [
        "rank 1     died: RuntimeError: Connection closed by peer [10.0.0.1]:29501",
        "rank 2     died: RuntimeError: Connection closed by peer [10.0.0.2]:29502",
    ]


def test_ranks_not_signalled_for_one_reason_are_one_note() -> None:
    """1,024 "process gone" lines would push the verdict off the screen; another host's
    ranks are asked through the run directory (named only if they do not answer)."""

    gone = [Target(n, 100 + n, "a", alive=False, ours=False, why="process gone") for n in range(1024)]
    elsewhere = [
        Target(n, 9000 + n, "b", alive=True, ours=False, why="on host b: asked through the run directory")
        for n in (1024, 1025)
    ]
    mine = [Target(1026, 77, "a", alive=True, ours=True, why="verified")]
    assert _target_notes([*gone, *elsewhere, *mine]) == [
        "ranks 0-1023 (1,024 ranks): process gone",
    ]


#: What faulthandler wrote for a ZeRO-3 rank that gloo aborted in a rank-0-only gather
#: (probes/train_lora.py --fault rank-conditional-gather; paths shortened).
ABORTED_IN_GATHER = """Fatal Python error: Aborted

Thread 0x00007fabce01c6c0 (most recent call first):
  File "/env/lib/python3.11/site-packages/lorascope/rundir/format/writer.py", line 241 in _run
  File "/usr/lib/python3.11/threading.py", line 982 in run
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Thread 0x00007fabd0a91b80 (most recent call first):
  File "/env/lib/python3.11/site-packages/lorascope/probes/collectives.py", line 664 in wait
  File "/env/lib/python3.11/site-packages/deepspeed/runtime/zero/partition_parameters.py", line 2474 in __enter__
  File "/job/train.py", line 397 in save_adapters_on_rank0
  File "/job/train.py", line 364 in before_step
  File "/job/train.py", line 480 in <module>

Extension modules: psutil._psutil_linux, torch._C (total: 2)
"""


def test_a_rank_killed_by_an_abort_is_one_line_naming_its_main_threads_frame(tmp_path: Path) -> None:
    """`lorascope hang` printed faulthandler's whole dump (every thread, the extension
    modules) as the dead rank's place, before the verdict; its pending call read "still
    waiting in it". Now one line, with the job's frame on its main thread, and the call
    the rank ended inside."""
    assert fatal_main_frame(ABORTED_IN_GATHER) == "/job/train.py:397 in save_adapters_on_rank0"
    assert fatal_main_frame("Fatal Python error: Aborted\n\n<no Python frame>\n") is None
    as_module = ABORTED_IN_GATHER.replace(
        '  File "/job/train.py", line 480 in <module>',
        '  File "/job/train.py", line 480 in main\n  File "<frozen runpy>", line 88 in _run_code\n'
        '  File "<frozen runpy>", line 198 in _run_module_as_main',
    )
    assert fatal_main_frame(as_module) == "/job/train.py:397 in save_adapters_on_rank0"  # python -m job
    gather = Call("all_gather_into_tensor", bytes=1024, site="/job/train.py:397 in save_adapters_on_rank0", end=False)
    ranks = [
        RankSpec(calls=[Call("all_reduce"), gather], ends=False, fatal=ABORTED_IN_GATHER),
        RankSpec(calls=[Call("all_reduce"), Call("all_reduce", end=False)], ends=False),
    ]
    run = write_run(tmp_path / "run", ranks, exit_status=1)
    res = _hang(run, "--no-html")
    assert res.returncode == 0, res.stderr
    [dead] = [line for line in res.stdout.splitlines() if line.startswith("rank 0 ")]
    assert dead == (
        "rank 0     died: killed by Fatal Python error: Aborted (faulthandler), "
        "main thread at /job/train.py:397 in save_adapters_on_rank0"
    )
    assert "Extension modules" not in res.stdout and "Thread 0x" not in res.stdout
    bundle = load_bundle(run)
    rows = [str(e.value) for f in rank_conditional_hang.detect(bundle) for e in f.evidence]
    assert any("never returned: the rank ended inside it (Fatal Python error: Aborted" in r for r in rows), rows
    # rank 1 has no word on its end: the launcher has ended, so it died without one (it
    # read "still waiting in it" after the job was over)
    assert any(r.endswith("never returned: the rank's process ended inside it without a word (SIGKILL)") for r in rows)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["launches"][0]["end"] = None  # the launcher still runs: rank 1 may still wait
    (run / "manifest.json").write_text(json.dumps(manifest))
    rows = [str(e.value) for f in rank_conditional_hang.detect(load_bundle(run)) for e in f.evidence]
    assert any(r.endswith("still waiting in it") for r in rows), rows


def test_each_ranks_place_reads_as_a_sentence() -> None:
    """A rank waiting in a collective "is in" it (it read "rank 0 is reduce_scatter_tensor
    #386 ..."); one in its own code "is in its own code"; a dead one "died"; the verdict
    names one rank or several with the verb that goes with them."""
    groups = [
        {"where": "reduce_scatter_tensor #386 on default_pg at t.py:314 in step", "ranks": [0, 3]},
        {"where": "in its own code at t.py:368 in fetch (no collective in flight)", "ranks": [1]},
        {"where": "died: killed by SIGTERM", "ranks": [2]},
    ]
    lines = render_hang({"groups": groups, "verdict": "v", "fix": "f"}, []).splitlines()
    assert lines[:3] == [  # the odd ones first, the largest group last
        "rank 1     is in its own code at t.py:368 in fetch (no collective in flight)",
        "rank 2     died: killed by SIGTERM",
        "ranks 0, 3 are in reduce_scatter_tensor #386 on default_pg at t.py:314 in step",
    ]
    place = {"where": "in its own code at t.py:368 in fetch"}
    assert _verdict("stuck-outside", [1], place).startswith("rank 1 is stuck outside any collective, in its own")
    assert _verdict("stuck-outside", [1, 2], place).startswith("ranks 1, 2 are stuck outside any collective")
    assert _verdict("straggler", [5], None) == "rank 5 is a straggler still moving; the others wait for it"
    # a dead rank's place starts "died: " (it read "rank 1 died; the others wait for it (died: its process ...)")
    gone = {"where": "died: its process is gone without a word (SIGKILL or the OOM killer)"}
    assert _verdict("dead-rank", [1], gone) == (
        "rank 1 died first: its process is gone without a word (SIGKILL or the OOM killer); "
        "the others wait for it or failed after it"
    )


def test_a_job_that_finished_while_hang_waited_is_not_hung_in_the_verdict_or_the_page(tmp_path: Path) -> None:
    """The healthy DDP job ended between `lorascope hang`'s signal and its read: it said "no
    rank shows why the job is stuck", and its page (as for any job found not hung: moving,
    stopped while moving) led with that as an error."""
    run = write_run(tmp_path / "run", [RankSpec(), RankSpec()])
    out = tmp_path / "hang.html"
    res = _hang(run, "--html", str(out))
    assert res.returncode == 0, res.stderr
    assert "verdict: not hung: every rank exited with code 0 (the job had finished when it was read)" in res.stdout
    page = out.read_text()  # what `analyze` says of the run (the helper's rank 0 holds 50 MiB more: a warning)
    assert 'class="verdict level-warning"' in page and "no rank shows why" not in page


def test_a_job_whose_processes_are_all_gone_is_over_in_analyzes_words(tmp_path: Path) -> None:
    """FSDP1 on CPU failed identically on both ranks at start-up: `hang` said "rank 0 died
    first ...; the others wait for it" while `analyze` said "ranks 0, 1 all ended badly".
    With no process left, `hang` says the job is over and gives analyze's account."""
    error = ("ValueError", "Cannot flatten integer dtype tensors")
    run = write_run(tmp_path / "run", [RankSpec(steps=0, exception=error), RankSpec(steps=0, exception=error)])
    res = _hang(run, "--no-html")
    assert res.returncode == 0, res.stderr
    analyzed = subprocess.run(
        [sys.executable, "-m", "lorascope", "analyze", str(run)], capture_output=True, text=True, timeout=120
    )
    headline = analyzed.stdout.splitlines()[0]
    assert (
        headline
        == "no detector named a cause, but ranks 0, 1 all ended badly: ValueError: Cannot flatten integer dtype tensors"
    )
    verdict = next(line for line in res.stdout.splitlines() if line.startswith("verdict: "))
    assert verdict.startswith("verdict: the job is over (no process of it is alive)") and verdict.endswith(headline)
    assert "died first" not in res.stdout and "wait for it" not in res.stdout
    data = json.loads(_hang(run, "--no-html", "--json").stdout)
    assert data["kind"] == "over" and data["first_diverged"] is None


def test_a_long_job_over_is_told_from_all_it_left_not_its_recent_past(tmp_path: Path) -> None:
    """`hang` reads a rank's newest calls only; a job over is told, and its page made, in
    analyze's words, of the whole run: here a size mismatch long before the newest calls."""
    calls = [Call("all_reduce")] * (3 * RECENT_RECORDS)
    odd = [*calls[:4], Call("all_reduce", bytes=8), *calls[5:]]
    error = ("RuntimeError", "Connection closed by peer")
    specs = [RankSpec(calls=calls), RankSpec(calls=odd), RankSpec(calls=calls, exception=error)]
    for spec in specs:
        spec.call_slots = (1 << 10, 1 << 13)
    run = write_run(tmp_path / "run", specs)
    analyzed = subprocess.run(
        [sys.executable, "-m", "lorascope", "analyze", str(run)], capture_output=True, text=True, timeout=120
    )
    assert analyzed.stdout.startswith("collective-mismatch"), analyzed.stdout
    out = tmp_path / "hang.html"
    res = _hang(run, "--html", str(out))
    assert res.returncode == 0, res.stderr
    verdict = next(line for line in res.stdout.splitlines() if line.startswith("verdict: "))
    assert verdict.startswith("verdict: the job is over") and "collective-mismatch" in verdict, verdict
    assert "collective-mismatch" in out.read_text()


def test_a_job_over_that_cannot_be_read_whole_is_told_from_its_recent_past(tmp_path: Path) -> None:
    """A steps file past `--max-stream-size`: `analyze` refuses the run, `hang` (which read
    its end only) still says the job is over, in the past, and why not in analyze's words."""
    error = ("RuntimeError", "Connection closed by peer")
    run = write_run(tmp_path / "run", [RankSpec(exception=error), RankSpec(exception=error)])
    [steps] = (run / "ranks" / "rank-0").glob("*.steps")
    with open(steps, "ab") as f:
        f.truncate(600 << 20)  # sparse
    res = _hang(run, "--no-html")
    assert res.returncode == 0, res.stderr
    verdict = next(line for line in res.stdout.splitlines() if line.startswith("verdict: "))
    assert verdict.startswith("verdict: the job is over (no process of it is alive): "), verdict
    assert "`lorascope analyze` reads it" not in verdict
    assert "could not be read whole" in res.stdout and "512 MiB limit" in res.stdout
