"""Writing a report file: the one path `lorascope report`, `analyze --html`, `hang` and
the gallery take."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lorascope.analysis import Analysis
from lorascope.errors import BadInputError, UsageError
from lorascope.report.data import build_report_data
from lorascope.report.diff import diff_page_data


def write_report(analysis: Analysis, out: Path) -> int:
    """Render the report of ``analysis`` into ``out``; returns the page's size in bytes."""
    try:
        from lorascope.report.render import render
    except ImportError as exc:
        raise UsageError(f"the HTML report needs jinja2 ({exc}): pip install 'lorascope[analysis]'") from None
    page = render(build_report_data(analysis.bundle, analysis.findings, analysis.summary)).encode("utf-8")
    return _write(page, out)


def write_diff_report(diff: dict[str, Any], out: Path) -> int:
    """Render ``lorascope diff``'s data (:func:`lorascope.analysis.diff.build_diff`) as a
    page into ``out``; returns its size in bytes."""
    try:
        from lorascope.report.render import render_diff
    except ImportError as exc:
        raise UsageError(f"the HTML report needs jinja2 ({exc}): pip install 'lorascope[analysis]'") from None
    return _write(render_diff(diff_page_data(diff)).encode("utf-8"), out)


def _write(page: bytes, out: Path) -> int:
    try:
        out.write_bytes(page)
    except OSError as exc:
        raise BadInputError(f"cannot write the report {out}: {exc.strerror}") from None
    return len(page)
