"""The reports in a real headless browser: they load offline, draw every chart, and run
nothing that arrived in the data."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from lorascope.analysis import analyze
from lorascope.ingest.load import load_bundle
from lorascope.report.data import build_report_data
from lorascope.report.findings import CHART_FOR
from lorascope.report.gallery import scenarios
from lorascope.report.render import render
from lorascope.report.spread import PerStep
from lorascope.report.write import write_report
from tests.helpers import FIXTURES, XSS, RankSpec, write_run, xss_run

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = scenarios(REPO / "fixtures")
#: Charts every report of a run directory draws (others depend on the data).
ALWAYS = {
    "chart-memory",
    "chart-memory-heatmap",
    "chart-peak",
    "chart-step-time",
    "chart-step-median",
    "chart-step-heatmap",
}


class Loaded:
    """A page opened from a file, with everything it logged and requested."""

    def __init__(self, browser: Any, path: Path) -> None:
        self.page = browser.new_page(viewport={"width": 1280, "height": 900})
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page.on(
            "console",
            lambda m: self.errors.append(f"console.{m.type}: {m.text}") if m.type in ("error", "warning") else None,
        )
        self.page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.url = path.resolve().as_uri()
        started = time.perf_counter()
        self.page.goto(self.url)
        self.page.wait_for_selector("body[data-charts-drawn]", state="attached", timeout=30_000)
        self.load_s = time.perf_counter() - started

    def foreign_requests(self) -> list[str]:
        return [u for u in self.requests if u != self.url]


@pytest.mark.skipif(not SCENARIOS, reason="no fixture run directory")
@pytest.mark.parametrize("run_dir", SCENARIOS, ids=[p.name for p in SCENARIOS])
def test_gallery_report_in_browser(browser: Any, run_dir: Path, tmp_path: Path, artifacts: Path) -> None:
    analysis = analyze(run_dir)
    page_file = tmp_path / f"{run_dir.name}.html"
    write_report(analysis, page_file)
    loaded = Loaded(browser, page_file)
    page = loaded.page
    assert loaded.errors == []
    assert loaded.foreign_requests() == []
    assert page.locator("#verdict .headline").inner_text().strip()
    assert page.locator("#findings h2").inner_text().startswith("Findings")
    charts = page.evaluate("""() => Array.from(document.querySelectorAll('.chart')).map(el => {
        const c = el.querySelector('canvas');
        return {id: el.id, points: Number(el.getAttribute('data-points') || 0),
                w: c ? c.width : 0, h: c ? c.height : 0, drawn: !!echarts.getInstanceByDom(el)};
    })""")
    ids = {c["id"] for c in charts}
    assert ALWAYS <= ids, ids
    for chart in charts:
        assert chart["drawn"] and chart["points"] > 0 and chart["w"] > 0 and chart["h"] > 0, chart
    assert sorted(page.evaluate("window.lorascopeReport.charts")) == sorted(ids)
    if "chart-kernels" not in ids:
        assert page.locator("#kernels-empty").inner_text().strip()
    # each finding links to the chart of its kind (CHART_FOR, or the one its details name),
    # and that chart is on the page and drawn; a finding of a kind without a chart has no link
    found = build_report_data(analysis.bundle, analysis.findings, analysis.summary)["findings"]
    assert page.locator(".finding").count() == len(found)
    for n, finding in enumerate(found):
        if finding["id"] in CHART_FOR and "chart" not in analysis.findings[n].details:
            assert finding["chart"] == CHART_FOR[finding["id"]], finding["id"]
        links = page.locator(".finding").nth(n).locator("a.chart-link")
        if finding["chart"] is None:
            assert links.count() == 0, finding["id"]
            continue
        assert links.count() == 1, finding["id"]
        assert links.first.get_attribute("href") == f"#{finding['chart']}"
        assert finding["chart"] in ids, (finding["id"], finding["chart"], ids)  # drawn (checked above)
    if run_dir.name in CHART_FOR:  # a fixture named for a detector: its finding is here, linked
        assert any(f["id"] == run_dir.name and f["chart"] for f in found), [f["id"] for f in found]
    shot = artifacts / f"report-{run_dir.name}.png"
    page.screenshot(path=str(shot), full_page=True)
    print(f"\nscreenshot: {shot}  (loaded and drawn in {loaded.load_s:.2f} s)")
    page.close()


#: ECharts' component main types (a chart's option names them at its top level), and the
#: marks a series may carry; report.js's other top-level keys.
COMPONENTS = (
    "grid", "xAxis", "yAxis", "polar", "radiusAxis", "angleAxis", "radar", "dataZoom", "visualMap", "tooltip",
    "axisPointer", "toolbox", "brush", "geo", "parallel", "parallelAxis", "singleAxis", "timeline", "graphic",
    "calendar", "matrix", "dataset", "aria", "title", "legend", "thumbnail",
)  # fmt: skip
MARKS = ("markLine", "markArea", "markPoint")
NOT_COMPONENTS = ("series", "animation")


def _not_built(page: Any) -> list[str]:
    """What a drawn chart's option asks for that its ECharts instance did not build: a
    component, a series type or a mark the inlined ECharts leaves out (its production build
    drops them without a word); and a top-level key this test does not know."""
    missing: list[str] = page.evaluate(
        """([components, marks, others]) => {
        const missing = [];
        const options = window.lorascopeReport.options;
        for (const id of Object.keys(options)) {
            const opt = options[id];
            const model = echarts.getInstanceByDom(document.getElementById(id)).getModel();
            const built = (main) => model.queryComponents({mainType: main}).length;
            for (const main of components) {
                const asked = opt[main] == null ? 0 : [].concat(opt[main]).length;
                if (built(main) < asked) { missing.push(`${id}: ${main} (${asked} asked, ${built(main)} built)`); }
            }
            const series = [].concat(opt.series || []);
            const types = model.getSeries().map((s) => s.subType);
            series.forEach((s) => { if (!types.includes(s.type)) { missing.push(`${id}: a ${s.type} series`); } });
            for (const mark of marks) {
                if (series.some((s) => s[mark]) && !built(mark)) { missing.push(`${id}: ${mark}`); }
            }
            for (const key of Object.keys(opt)) {
                if (!components.includes(key) && !others.includes(key)) { missing.push(`${id}: option ${key}?`); }
            }
        }
        return missing;
    }""",
        [list(COMPONENTS), list(MARKS), list(NOT_COMPONENTS)],
    )
    return missing


def test_every_component_a_chart_names_is_in_the_echarts_build(browser: Any, tmp_path: Path) -> None:
    """The inlined ECharts is built with only what report.js draws
    (lorascope/report/assets/vendor/echarts/build/entry.js): every chart of the gallery's
    pages and of a page in bands mode (heatmaps, visualMap) has all it asked for."""
    pages = []
    for run_dir in SCENARIOS:
        pages.append(tmp_path / f"{run_dir.name}.html")
        write_report(analyze(run_dir), pages[-1])
    pages.append(_many_ranks_page(tmp_path))
    asked: set[str] = set()
    for page_file in pages:
        loaded = Loaded(browser, page_file)
        assert loaded.errors == []
        assert _not_built(loaded.page) == [], page_file.name
        asked |= set(
            loaded.page.evaluate("""() => Object.values(window.lorascopeReport.options).flatMap((o) =>
            [...Object.keys(o), ...[].concat(o.series || []).flatMap((s) => [s.type, ...Object.keys(s)])])""")
        )
        loaded.page.close()
    # what the build holds is in use: the pages ask for each series type, component and mark
    assert {"line", "bar", "scatter", "custom", "markLine", "markArea", "visualMap", "dataZoom"} <= asked
    assert {"grid", "tooltip", "toolbox", "legend"} <= asked


def test_hostile_text_never_runs(browser: Any, tmp_path: Path, artifacts: Path) -> None:
    run_dir, findings = xss_run(tmp_path / "run")
    from lorascope.report.render import render as render_page

    out = tmp_path / "xss.html"
    out.write_text(render_page(build_report_data(load_bundle(run_dir), findings)))
    loaded = Loaded(browser, out)
    page = loaded.page
    # open every collapsed section and show every collective tooltip, where hostile names appear
    page.evaluate("document.querySelectorAll('details').forEach(d => d.open = true)")
    tips = page.evaluate("""() => {
        const chart = echarts.getInstanceByDom(document.getElementById('chart-collectives'));
        const out = [];
        chart.getOption().series.forEach((s, i) => (s.data || []).forEach((_, j) => {
            chart.dispatchAction({type: 'showTip', seriesIndex: i, dataIndex: j});
            const tip = document.querySelector('#chart-collectives > div:last-child');
            out.push(tip ? tip.innerText : '');
        }));
        return out;
    }""")
    assert page.evaluate("window.__pwned") is None
    assert loaded.errors == [] and loaded.foreign_requests() == []
    assert any("<script>window.__pwned=1</script>" in t for t in tips), tips
    text = page.locator("body").inner_text()
    for where in ("#findings", "#charts", "#facts"):
        assert XSS in page.locator(where).inner_text(), where
    assert text.count(XSS) >= 8
    assert page.evaluate("document.querySelectorAll('img, iframe, object, embed').length") == 0
    assert page.evaluate("document.scripts.length") == 3
    shot = artifacts / "report-xss.png"
    page.screenshot(path=str(shot), full_page=True)
    print(f"\nscreenshot: {shot}")
    page.close()


def test_memory_chart_switches_between_the_recorded_figures(browser: Any, tmp_path: Path) -> None:
    """The chart opens on the figure the verdict used (heap in use on CPU) and redraws RSS on a click."""
    page_file = tmp_path / "mem.html"
    write_report(analyze(FIXTURES / "rank0-asymmetry"), page_file)
    loaded = Loaded(browser, page_file)
    page = loaded.page
    chart = page.locator("#chart-memory")
    assert chart.get_attribute("data-metric") == "heap in use"
    buttons = page.locator("#memory-metrics button")
    assert buttons.count() == 2 and "what the verdict used" in buttons.nth(0).inner_text()
    page.locator('#memory-metrics button[data-metric="RSS"]').click()
    assert chart.get_attribute("data-metric") == "RSS" and int(chart.get_attribute("data-points") or 0) > 0
    assert loaded.errors == []
    page.close()


def _heat_cell(page: Any, column: int, row: int, chart: str = "chart-step-heatmap") -> dict[str, float]:
    """Where a cell of a heatmap is: its centre in the page, in the chart's canvas pixels."""
    at: dict[str, float] = page.evaluate(
        """([c, r, id]) => {
        const el = document.getElementById(id);
        el.scrollIntoView({block: 'center'});
        const [x, y] = echarts.getInstanceByDom(el).convertToPixel({gridIndex: 0}, [c, r]);
        const box = el.getBoundingClientRect(), ratio = window.devicePixelRatio || 1;
        return {x: box.left + x, y: box.top + y, cx: x * ratio, cy: y * ratio};
    }""",
        [column, row, chart],
    )
    return at


def _heat_pixel(page: Any, column: int, row: int, chart: str = "chart-step-heatmap") -> list[int] | None:
    """The RGB painted at the centre of a cell of a heatmap (None: nothing)."""
    at = _heat_cell(page, column, row, chart)
    rgba: list[int] = page.evaluate(
        """([x, y, id]) => {
        const canvas = document.querySelector('#' + id + ' canvas');
        return Array.from(canvas.getContext('2d').getImageData(Math.round(x), Math.round(y), 1, 1).data);
    }""",
        [at["cx"], at["cy"], chart],
    )
    return rgba[:3] if rgba[3] else None


def _hover_heat(page: Any, column: int, row: int) -> str:
    """The tip shown with the mouse over a cell of the step-time heatmap."""
    at = _heat_cell(page, column, row)
    page.mouse.move(at["x"], at["y"])
    tip = page.locator("#chart-step-heatmap .heatmap-tip")
    tip.wait_for(state="visible", timeout=5_000)
    return str(tip.inner_text())


MANY_RANKS = 40


def _red(rgb: list[int] | None) -> bool:
    """Near the heatmap's full red (#d62728)."""
    return rgb is not None and rgb[0] > 0xC8 and rgb[1] < 0x50 and rgb[2] < 0x50


def _many_ranks_page(tmp_path: Path) -> Path:
    """A page of 40 ranks x 1,200 steps (bands mode): rank 17 a straggler, rank 0 holding more."""
    ranks = MANY_RANKS
    bundle = load_bundle(write_run(tmp_path / "run", [RankSpec(steps=3) for _ in range(ranks)]))
    steps = range(1, 1201)
    per = PerStep(
        step_time={r: [(s, 0.2 + 0.001 * (s % 7) + (0.1 if r == 17 else 0.0)) for s in steps] for r in range(ranks)},
        loss={r: [(s, 2.0 - s / 1000) for s in steps] for r in range(ranks)},
        wait={r: [(s, 0.01 if r == 17 else 0.11) for s in steps] for r in range(ranks)},
        memory={"RSS": {r: [(s, 3000.0 + (800.0 if r == 0 else 0.0) + s % 5) for s in steps] for r in range(ranks)}},
    )
    page_file = tmp_path / "many.html"
    page_file.write_text(render(build_report_data(bundle, [], per_step=per)))
    return page_file


def test_many_ranks_draw_bands_outliers_and_heatmaps(browser: Any, tmp_path: Path) -> None:
    """Above the lines cutoff: bands with the straggler drawn and named, heatmaps painted cell
    by cell whose hover names the rank and the steps (zoomed too) and whose legend range hides
    cells, the collective chart bounded; nothing logged, nothing fetched."""
    ranks = MANY_RANKS
    loaded = Loaded(browser, _many_ranks_page(tmp_path))
    page = loaded.page
    assert loaded.errors == [] and loaded.foreign_requests() == []
    drawn = set(page.evaluate("window.lorascopeReport.charts"))
    new = {"chart-step-heatmap", "chart-memory-heatmap", "chart-collective-wait"}
    assert ALWAYS | new | {"chart-loss"} <= drawn, drawn
    for chart, outlier in (("chart-step-time", "17"), ("chart-memory", "0"), ("chart-collective-wait", "17")):
        el = page.locator(f"#{chart}")
        assert el.get_attribute("data-mode") == "bands" and el.get_attribute("data-outliers") == outlier, chart
    legend = page.evaluate(
        "echarts.getInstanceByDom(document.getElementById('chart-step-time')).getOption().legend[0].data"
    )
    assert "rank 17 (outlier, z" in " ".join(n if isinstance(n, str) else n["name"] for n in legend), legend
    # hover a step of the bands: the spread, the rank at each extreme, the outlier's value
    band_tip = page.evaluate("""() => {
        const el = document.getElementById('chart-step-time');
        const chart = echarts.getInstanceByDom(el);
        const median = chart.getOption().series.findIndex(s => s.name === 'median rank');
        chart.dispatchAction({type: 'showTip', seriesIndex: median, dataIndex: 0});
        return el.querySelector('div:last-child').innerText;
    }""")
    assert "steps 1–3 · 40 ranks" in band_tip and "max: 0.30" in band_tip and "(rank 17)" in band_tip, band_tip
    assert "rank 17 (outlier, z" in band_tip, band_tip
    # the cells are painted on the grid: the straggler's row (+49% of the median) near the
    # full red, a rank at the median in the neutral grey
    columns = page.evaluate(
        "JSON.parse(document.getElementById('report-data').textContent).spread.step_time.heatmap.columns"
    )
    assert _red(_heat_pixel(page, 0, 17)), _heat_pixel(page, 0, 17)
    assert min(_heat_pixel(page, 0, 16) or [0]) > 0xD0, _heat_pixel(page, 0, 16)
    # hover a cell with the mouse: the tip names the rank, the step range and the value
    tip = _hover_heat(page, 0, 17)
    assert "rank 17" in tip and f"steps 1–{columns[0][1]}" in tip and "step time: 0.30" in tip, tip
    # zoomed to later steps, the first column shown is painted and named as that range
    page.evaluate("""() => echarts.getInstanceByDom(document.getElementById('chart-step-heatmap'))
        .dispatchAction({type: 'dataZoom', startValue: 5, endValue: 9})""")
    tip = _hover_heat(page, 5, 16)
    assert "rank 16" in tip and f"steps {columns[5][0]}–{columns[5][1]}" in tip, tip
    assert min(_heat_pixel(page, 5, 16) or [0]) > 0xD0 and _red(_heat_pixel(page, 5, 17))
    # the legend's range leaves the straggler out: its cells are no longer painted
    page.evaluate("""() => echarts.getInstanceByDom(document.getElementById('chart-step-heatmap'))
        .dispatchAction({type: 'selectDataRange', selected: [0, 0.25]})""")
    assert _heat_pixel(page, 5, 17) is None and min(_heat_pixel(page, 5, 16) or [0]) > 0xD0
    page.mouse.move(2, 2)
    assert page.locator("#chart-step-heatmap .heatmap-tip").is_hidden()
    assert int(page.locator("#chart-step-heatmap").get_attribute("data-points") or 0) == ranks * len(columns)
    page.close()


#: Held timers: what a background tab does to them (Chrome runs a hidden tab's timers late,
#: at most once a minute), and what a screenshot or a print taken at load never waits for.
HOLD_TIMERS = """
window.__held = 0;
window.setTimeout = function () { window.__held++; return 0; };
window.setInterval = function () { window.__held++; return 0; };
window.requestAnimationFrame = function () { window.__held++; return 0; };
"""

#: Per chart on the page: drawn (an ECharts instance with data points) and how many of a
#: sample of its canvas's pixels are painted (not blank, not white).
CHART_PIXELS = """() => Array.from(document.querySelectorAll('.chart')).map(el => {
    const c = el.querySelector('canvas');
    let painted = 0;
    if (c && c.width && c.height) {
        const px = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        for (let i = 0; i < px.length; i += 4 * 97) {
            if (px[i + 3] && (px[i] < 245 || px[i + 1] < 245 || px[i + 2] < 245)) { painted++; }
        }
    }
    return {id: el.id, drawn: !!echarts.getInstanceByDom(el), points: Number(el.getAttribute('data-points') || 0),
            painted: painted};
})"""


@pytest.mark.skipif(not SCENARIOS, reason="no fixture run directory")
@pytest.mark.parametrize("name", ["healthy", "rank-conditional-hang"])
def test_every_chart_is_drawn_by_load_with_timers_held(
    browser: Any, name: str, tmp_path: Path, artifacts: Path
) -> None:
    """A page opened as a person opens it (1400 px wide) shows every chart at its load event,
    with no timer, animation frame or scroll run: a background tab, a screenshot or a print
    taken then shows them all (charts drawn one per timer left "Peak memory per rank" and
    the ones below it blank)."""
    page_file = tmp_path / f"{name}.html"
    write_report(analyze(FIXTURES / name), page_file)
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.add_init_script(HOLD_TIMERS)
    page.goto(page_file.resolve().as_uri(), wait_until="load")
    charts = page.evaluate(CHART_PIXELS)
    assert errors == []
    assert ALWAYS <= {c["id"] for c in charts}
    blank = [c for c in charts if not (c["drawn"] and c["points"] > 0 and c["painted"] > 20)]
    assert blank == [], blank
    assert page.get_attribute("body", "data-charts-drawn") == str(len(charts))
    shot = artifacts / f"report-at-load-{name}.png"
    page.screenshot(path=str(shot), full_page=True)
    print(f"\nscreenshot: {shot}")
    page.close()


def test_a_healthy_64_rank_run_paints_no_alarm(browser: Any, tmp_path: Path, artifacts: Path) -> None:
    """64 ranks x 1,000 steps, healthy: memory 2,060-2,110 MiB (a 2% band), step times
    spread ~10% over the ranks. The heatmaps paint every cell neutral grey (a min-to-max
    scale saturated them red) and "Memory per step" draws MiB from 0 (its axis zoomed to
    2,060-2,110 made the band a cliff)."""
    ranks, steps = 64, range(1, 1001)
    bundle = load_bundle(write_run(tmp_path / "run", [RankSpec(steps=3) for _ in range(ranks)]))
    per = PerStep(
        step_time={r: [(s, 0.19 + 0.02 * (r % 5) / 4 + 0.001 * (s % 3)) for s in steps] for r in range(ranks)},
        loss={r: [(s, 2.0 - s / 1000) for s in steps] for r in range(ranks)},
        wait={r: [(s, 0.1) for s in steps] for r in range(ranks)},
        memory={"RSS": {r: [(s, 2060.0 + 50.0 * ((r * 13 + s) % 17) / 16) for s in steps] for r in range(ranks)}},
    )
    page_file = tmp_path / "healthy64.html"
    page_file.write_text(render(build_report_data(bundle, [], per_step=per)))
    loaded = Loaded(browser, page_file)
    page = loaded.page
    assert loaded.errors == []
    heat = page.evaluate("JSON.parse(document.getElementById('report-data').textContent).spread")
    for chart, hm in (
        ("chart-memory-heatmap", heat["memory"]["RSS"]["heatmap"]),
        ("chart-step-heatmap", heat["step_time"]["heatmap"]),
    ):
        n = len(hm["columns"])
        for row in (0, 13, 31, 63):
            for column in (0, n // 2, n - 1):
                assert _heat_pixel(page, column, row, chart) == [0xEE, 0xEE, 0xEE], (chart, row, column)
    low = page.evaluate("""() => echarts.getInstanceByDom(document.getElementById('chart-memory'))
        .getModel().getComponent('yAxis').axis.scale.getExtent()[0]""")
    assert low == 0, low
    shot = artifacts / "report-healthy-64-ranks.png"
    page.screenshot(path=str(shot), full_page=True)
    print(f"\nscreenshot: {shot}")
    page.close()


def test_the_memory_chart_opens_on_the_steps(browser: Any, tmp_path: Path) -> None:
    """The healthy fixture spends most of its run starting up (~19 of its ~22 s): the
    memory chart opens on the steps (its x axis from just before the first), the slider
    still reaching the start."""
    analysis = analyze(FIXTURES / "healthy")
    page_file = tmp_path / "healthy.html"
    write_report(analysis, page_file)
    view = build_report_data(analysis.bundle, analysis.findings, analysis.summary)["charts"]["memory"]["view"]
    loaded = Loaded(browser, page_file)
    extent = loaded.page.evaluate("""() => echarts.getInstanceByDom(document.getElementById('chart-memory'))
        .getModel().getComponent('xAxis').axis.scale.getExtent()""")
    assert view is not None and abs(extent[0] - view[0]) < 1.0 and extent[1] >= view[1] - 0.5, (extent, view)
    assert extent[0] > view[1] / 2, extent  # the start-up is left out of the view
    loaded.page.close()
