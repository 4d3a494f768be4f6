"""`lorascope hang` on a run directory: the verdict first, the HTML report best effort
(on the training-environment install, without jinja2, the verdict still prints)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

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
    from lorascope.cli.hang import _render

    groups = [{"where": "died: RuntimeError: rank 0's own failure in train.py:88", "ranks": [0]}]
    groups += [
        {
            "where": f"died: RuntimeError: Connection closed by peer [10.0.{n // 256}.{n % 256}]:{29500 + n}",
            "ranks": [n],
        }
        for n in range(1, 1024)
    ]
    diagnosis = {"groups": groups, "verdict": "rank 0 died; the others wait for it", "fix": "see rank 0"}
    lines = _render(diagnosis, ["a note"]).splitlines()
    assert lines == [
        "rank 0     is died: RuntimeError: rank 0's own failure in train.py:88",
        "ranks 1-1023 are died: RuntimeError: Connection closed by peer [10.0.0.1]:29501"
        " (1,023 ranks alike but for their numbers; rank 1's shown)",
        "verdict: rank 0 died; the others wait for it",
        "fix: see rank 0",
        "note: a note",
    ]
    # two ranks alike keep a line each, as they always did
    two = _render({**diagnosis, "groups": groups[1:3]}, []).splitlines()
    assert two[:2] == [
        "rank 1     is died: RuntimeError: Connection closed by peer [10.0.0.1]:29501",
        "rank 2     is died: RuntimeError: Connection closed by peer [10.0.0.2]:29502",
    ]


def test_ranks_not_signalled_for_one_reason_are_one_note() -> None:
    """1,024 "process gone" lines would push the verdict off the screen."""
    from lorascope.cli.hang import _target_notes
    from lorascope.hang.targets import Target

    gone = [Target(n, 100 + n, "a", alive=False, ours=False, why="process gone") for n in range(1024)]
    elsewhere = [
        Target(n, 9000 + n, "b", alive=True, ours=False, why="on host b: run `lorascope hang` there")
        for n in (1024, 1025)
    ]
    mine = [Target(1026, 77, "a", alive=True, ours=True, why="verified")]
    assert _target_notes([*gone, *elsewhere, *mine]) == [
        "ranks 0-1023 (1,024 ranks): process gone",
        "rank 1024 (pid 10024): on host b: run `lorascope hang` there",
        "rank 1025 (pid 10025): on host b: run `lorascope hang` there",
    ]
