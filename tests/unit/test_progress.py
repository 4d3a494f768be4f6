"""Progress on long analyses: the analysis reports each step, and the terminal draws bars
only on a terminal (nothing when piped)."""

from __future__ import annotations

import io
from pathlib import Path

from lorascope.analysis import analyze
from lorascope.text.progress import terminal_progress

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_analysis_reports_each_step() -> None:
    seen: list[tuple[str, int, int]] = []
    analyze(FIXTURES / "healthy", progress=lambda what, done, total: seen.append((what, done, total)))
    steps = {what for what, _, _ in seen}
    assert {"reading rank streams", "running detectors"} <= steps
    assert ("reading rank streams", 2, 2) in seen
    detectors = [(d, t) for w, d, t in seen if w == "running detectors"]
    assert detectors[-1][0] == detectors[-1][1] and len(detectors) == detectors[-1][1]


def test_bars_on_a_terminal_only() -> None:
    tty = Terminal()
    with terminal_progress(True, stream=tty, delay=0) as progress:
        assert progress is not None
        progress("reading rank streams", 1, 2)
        progress("reading rank streams", 2, 2)
    assert "reading rank streams" in tty.getvalue()
    piped = io.StringIO()
    with terminal_progress(True, stream=piped, delay=0) as progress:
        assert progress is None  # not a terminal: nothing drawn
    with terminal_progress(False, stream=Terminal(), delay=0) as progress:
        assert progress is None  # --json
