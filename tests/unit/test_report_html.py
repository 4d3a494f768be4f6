"""The rendered page: self-contained, deterministic, text stays text; the CLI around it."""

from __future__ import annotations

import base64
import hashlib
import re
from html.parser import HTMLParser
from pathlib import Path

from click.testing import CliRunner

from lorascope.cli import cli
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.ingest.load import load_bundle
from lorascope.report.data import build_report_data
from lorascope.report.gallery import render_all
from lorascope.report.render import render
from tests.helpers import RankSpec, write_run, xss_run

REPO = Path(__file__).resolve().parents[2]
HEALTHY = REPO / "fixtures" / "healthy"


class _Page(HTMLParser):
    """Collects tags, attributes and the text of each <script>."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.scripts: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._in_script = tag == "script"
        if self._in_script:
            self.scripts.append("")

    def handle_endtag(self, tag: str) -> None:
        self._in_script = False if tag == "script" else self._in_script

    def handle_data(self, data: str) -> None:
        if self._in_script:
            self.scripts[-1] += data


def parse(page: str) -> _Page:
    p = _Page()
    p.feed(page)
    return p


def healthy_page() -> str:
    return render(build_report_data(load_bundle(HEALTHY), []))


def test_no_external_reference_and_a_strict_policy() -> None:
    page = healthy_page()
    p = parse(page)
    for tag, attrs in p.tags:
        assert tag not in ("link", "iframe", "object", "embed", "base", "img"), tag
        assert "src" not in attrs, (tag, attrs)
        href = attrs.get("href")
        assert href is None or href.startswith("#"), (tag, href)
    assert len(p.scripts) == 3
    # no URL anywhere but inside the vendored library (its license header and XML namespaces)
    own = page.replace(p.scripts[1], "")
    assert not re.search(r"https?://", own)
    assert not re.search(r"""\b(fetch|XMLHttpRequest|WebSocket|EventSource|importScripts)\b""", p.scripts[2])
    csp = next(a["content"] for t, a in p.tags if t == "meta" and a.get("http-equiv") == "Content-Security-Policy")
    assert csp.startswith("default-src 'none'; ") and "unsafe-inline" not in csp.split("script-src")[1].split(";")[0]
    for script in p.scripts[1:]:
        digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
        assert f"'sha256-{digest}'" in csp


def test_render_is_deterministic() -> None:
    first, second = healthy_page(), healthy_page()
    assert first == second
    assert re.search(r"20\d\d-\d\d-\d\d \d\d:\d\d", first)  # the run's own start time, not "now"


def test_hostile_text_arrives_as_text(tmp_path: Path) -> None:
    run_dir, findings = xss_run(tmp_path)
    page = render(build_report_data(load_bundle(run_dir), findings))
    p = parse(page)
    assert [t for t, _ in p.tags].count("script") == 3 and "img" not in [t for t, _ in p.tags]
    assert "window.__pwned" not in "".join(p.scripts[1:])
    assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in page
    assert page.count("<script") == 3  # the JSON data escapes "<" as \u003c


def test_artifacts_without_a_run_directory(tmp_path: Path) -> None:
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "kernel", "name": "k", "ts": i * 10, "dur": 1 + i, "pid": 0, "tid": 7} for i in range(20)
        ]
    }
    bundle = EvidenceBundle(path=tmp_path / "traces", traces={0: trace}, warnings=["rank 1: no trace"])
    data = build_report_data(bundle, [])
    assert data["facts"] is None and data["verdict"]["level"] == "unknown"
    assert data["charts"]["kernels"]["available"] and data["charts"]["kernels"]["unit"] == "kernel"
    page = render(data)
    assert "No run directory: no run facts." in page and "rank 1: no trace" in page
    assert 'id="chart-kernels"' in page and 'id="chart-memory"' not in page


def test_report_command_and_analyze_html(tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "r.html"
    result = runner.invoke(cli, ["report", str(HEALTHY), "-o", str(out)])
    assert result.exit_code == 0, result.output
    second = tmp_path / "a.html"
    result = runner.invoke(cli, ["analyze", str(HEALTHY), "--html", str(second)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == second.read_bytes() and out.stat().st_size < 2_000_000


def test_report_errors_are_one_line(tmp_path: Path) -> None:
    from lorascope.errors import BadInputError

    runner = CliRunner()
    result = runner.invoke(cli, ["report", str(tmp_path / "nope"), "-o", str(tmp_path / "x.html")])
    assert isinstance(result.exception, BadInputError) and "no such file" in str(result.exception)
    result = runner.invoke(cli, ["report", str(HEALTHY), "-o", str(tmp_path / "no" / "dir" / "x.html")])
    assert isinstance(result.exception, BadInputError) and "cannot write the report" in str(result.exception)


def test_gallery_renders_every_fixture(tmp_path: Path) -> None:
    fixtures = tmp_path / "fixtures"
    write_run(fixtures / "a-case", [RankSpec()])
    write_run(fixtures / "b-case", [RankSpec(), RankSpec()])
    (fixtures / "not-a-run").mkdir()
    results = render_all(fixtures, tmp_path / "reports")
    assert [(t.name, why) for t, why in results] == [("a-case.html", ""), ("b-case.html", "")]
