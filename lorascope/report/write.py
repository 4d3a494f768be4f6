"""Writing a report file: the one path `lorascope report`, `analyze --html`, `hang` and
the gallery take."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lorascope.analysis import Analysis
from lorascope.errors import BadInputError, UsageError
from lorascope.report.data import build_report_data
from lorascope.report.diff import diff_page_data
from lorascope.rundir.format.safe_open import replace_file


def write_report(analysis: Analysis, out: Path, fresh: bool = False) -> int:
    """Render the report of ``analysis`` into ``out``; returns the page's size in bytes.
    FRESH: ``out`` is a name lorascope chose in a folder others may write (the run
    directory): the page goes into a new file renamed over it, so a symlink or a FIFO
    planted there is replaced, never written through."""
    try:
        from lorascope.report.render import render
    except ImportError as exc:
        raise UsageError(f"the HTML report needs jinja2 ({exc}): pip install 'lorascope[analysis]'") from None
    # backslashreplace: a lone surrogate (a byte that was not UTF-8, in an argv, a host
    # name, a path) is shown as \udcff, not a UnicodeEncodeError
    page = render(build_report_data(analysis.bundle, analysis.findings, analysis.summary)).encode(
        "utf-8", "backslashreplace"
    )
    return _write(page, out, fresh)


def write_diff_report(diff: dict[str, Any], out: Path) -> int:
    """Render ``lorascope diff``'s data (:func:`lorascope.analysis.diff.build_diff`) as a
    page into ``out``; returns its size in bytes."""
    try:
        from lorascope.report.render import render_diff
    except ImportError as exc:
        raise UsageError(f"the HTML report needs jinja2 ({exc}): pip install 'lorascope[analysis]'") from None
    return _write(render_diff(diff_page_data(diff)).encode("utf-8", "backslashreplace"), out)


def _write(page: bytes, out: Path, fresh: bool = False) -> int:
    try:
        if fresh:
            replace_file(out, page)
        else:
            out.write_bytes(page)
    except OSError as exc:
        raise BadInputError(f"cannot write the report {out}: {exc.strerror}") from None
    return len(page)
