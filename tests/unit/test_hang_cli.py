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
