"""``render(data) -> str``: the report data as one self-contained HTML page.

Everything the page needs is inlined: the styles, the vendored chart library (Apache
ECharts, see ``assets/vendor/echarts/README.md``), the chart code and the chart data (as
JSON in a non-executed ``<script type="application/json">``, written with ``|tojson``, which
escapes ``<``, ``>`` and ``&``). Text from the run (kernel names, call sites, exception
texts) reaches the page only through Jinja2's autoescaping or as JSON read with
``textContent`` and drawn on a canvas or set as text, never as markup. A Content Security
Policy allows no network access at all and only the page's own two scripts, by hash: even
markup that slipped through could neither load nor run anything.
"""

from __future__ import annotations

import base64
import functools
import hashlib
from importlib import resources
from typing import Any

from jinja2 import Environment, PackageLoader, StrictUndefined

from lorascope.analysis import strict_json
from lorascope.units import ranks_named

ECHARTS_VERSION = "6.0.0"
_ASSETS = resources.files("lorascope.report") / "assets"


@functools.cache
def _environment() -> Environment:
    env = Environment(
        loader=PackageLoader("lorascope.report", "templates"),
        autoescape=True,
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["ranks_named"] = ranks_named
    env.policies["json.dumps_function"] = strict_json.dumps
    env.policies["json.dumps_kwargs"] = {"sort_keys": True, "separators": (",", ":")}
    return env


@functools.cache
def _script(name: str) -> str:
    text = (_ASSETS / name).read_text(encoding="utf-8")
    if "</script" in text.lower():  # would end the inline <script> element early
        raise ValueError(f"asset {name} contains '</script' and cannot be inlined")
    return text


def _csp_hash(script: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode() + "'"


def render(data: dict[str, Any]) -> str:
    """The page for ``build_report_data``'s result; same data, same bytes."""
    scripts = [_script("vendor/echarts/echarts.custom.min.js"), _script("report.js")]
    csp = (
        "default-src 'none'; script-src "
        + " ".join(_csp_hash(s) for s in scripts)
        + "; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'"
    )
    return (
        _environment()
        .get_template("report.html.j2")
        .render(
            data=data,
            charts=data["charts"],
            css=(_ASSETS / "report.css").read_text(encoding="utf-8"),
            echarts_js=scripts[0],
            report_js=scripts[1],
            csp=csp,
            echarts_version=ECHARTS_VERSION,
        )
    )


def render_diff(data: dict[str, Any]) -> str:
    """The page of :func:`lorascope.report.diff.diff_page_data`'s result: the report's
    styles and value layout, no script (a Content Security Policy that allows none)."""
    csp = (
        "default-src 'none'; script-src 'none'; style-src 'unsafe-inline'; img-src data:; "
        "base-uri 'none'; form-action 'none'"
    )
    return (
        _environment()
        .get_template("diff.html.j2")
        .render(data=data, css=(_ASSETS / "report.css").read_text(encoding="utf-8"), csp=csp)
    )
