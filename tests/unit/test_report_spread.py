"""The many-rank chart data (lorascope.report.spread), checked on hand-made series: bands,
outliers, heatmaps, and sizes that do not grow with steps."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from lorascope.detect.registry import run_detectors
from lorascope.ingest.load import load_bundle
from lorascope.report import spread
from lorascope.report.data import build_report_data
from lorascope.report.render import render
from lorascope.report.spread import PerStep
from tests.helpers import Call, RankSpec, write_run


def test_bands_are_the_percentiles_over_ranks_at_each_step() -> None:
    # 5 ranks, 3 steps: at each step the values are a known set
    series = {r: [(1, 1.0 + r), (2, 10.0 - r), (3, 5.0)] for r in range(5)}
    cols = spread.columns(series)
    assert cols is not None and (cols.first, cols.last, cols.width) == (1, 3, 1)
    b = spread.bands(spread.reduce_all(series, cols), cols, "mean", 4)
    assert b["step"] == b["to"] == [1, 2, 3] and b["ranks"] == [5, 5, 5]
    assert b["min"] == [1.0, 6.0, 5.0] and b["max"] == [5.0, 10.0, 5.0]
    assert b["min_rank"] == [0, 4, 0] and b["max_rank"] == [4, 0, 0]
    assert b["median"] == [3.0, 8.0, 5.0]
    # numpy's default (linear) percentiles of 1..5: p10 = 1.4, p90 = 4.6
    assert b["p10"] == [1.4, 6.4, 5.0] and b["p90"] == [4.6, 9.6, 5.0]


def test_a_column_keeps_the_extremes_and_the_ranks_typical_value() -> None:
    # 4 ranks x 10 steps in 2 columns of 5 steps; rank 2 has one spike in the second column
    series = {r: [(s, 1.0 + 0.1 * r) for s in range(1, 11)] for r in range(4)}
    series[2][7] = (8, 9.0)
    cols = spread.columns(series, max_columns=2)
    assert cols is not None and cols.count == 2 and cols.span(1) == (6, 10)
    reduced = spread.reduce_all(series, cols)
    b = spread.bands(reduced, cols, "mean", 4)
    assert b["step"] == [1, 6] and b["to"] == [5, 10]
    assert b["max"] == [1.3, 9.0] and b["max_rank"] == [3, 2]  # the spike survives the bucketing
    # the median is over the ranks' means in the column: rank 2's mean there is (4 * 1.2 + 9) / 5
    means = sorted([1.0, 1.1, (4 * 1.2 + 9.0) / 5, 1.3])
    assert b["median"][1] == round(statistics.median(means), 4)
    # "max": a rank's value in a column is its highest
    assert spread.bands(reduced, cols, "max", 4)["median"][1] == round(statistics.median([1.0, 1.1, 9.0, 1.3]), 4)


def test_non_finite_values_and_missing_ranks() -> None:
    series = {0: [(1, math.nan), (2, 2.0)], 1: [(2, 4.0), (3, math.inf)], 2: []}
    cols = spread.columns(series)
    assert cols is not None
    b = spread.bands(spread.reduce_all(series, cols), cols, "mean", 4)
    assert b["step"] == [2] and b["ranks"] == [2] and (b["min"], b["max"]) == ([2.0], [4.0])
    assert spread.columns({0: [], 1: []}) is None and spread.spread({0: []}, "mean", 4) is None


def test_outliers_robust_z_both_ways_and_bounded() -> None:
    figures = {r: 1.0 + 0.01 * (r % 7) for r in range(100)}
    figures[17] = 1.3  # slow
    figures[42] = 0.5  # fast (e.g. a rank that skips work)
    found = spread.outliers(figures)
    assert [o["rank"] for o in found] == [42, 17]  # the furthest first
    assert found[0]["z"] < -3.5 < 3.5 < found[1]["z"]
    # ranks that read the same: the MAD floor (1% of the median) keeps tiny differences quiet
    same = {r: 1000.0 for r in range(64)}
    same[5] = 1000.5
    assert spread.outliers(same) == []
    same[0] = 1200.0
    assert [o["rank"] for o in spread.outliers(same)] == [0]
    many = {r: (10.0 if r < 20 else 1.0 + 0.001 * r) for r in range(200)}
    assert len(spread.outliers(many)) == spread.MAX_OUTLIERS
    assert spread.outliers({0: 1.0, 1: 5.0}) == []  # no typical rank among two


def test_spread_names_the_outlier_and_the_finding_ranks() -> None:
    series = {r: [(s, 0.25 * (1.3 if r == 17 else 1.0) + 0.001 * (s % 5)) for s in range(1, 101)] for r in range(32)}
    sp = spread.spread(series, "mean", 4, also=[3, 17])
    assert sp is not None and not sp["lines"] and sp["ranks"] is None
    assert [o["rank"] for o in sp["outliers"]] == [17] and sp["outliers"][0]["step"] == list(range(1, 101))
    assert sp["outliers"][0]["typical"] == round(0.25 * 1.3 + 0.002, 4)
    assert [n["rank"] for n in sp["named"]] == [3]  # 17 is drawn once, as the outlier
    small = spread.spread({r: series[r] for r in range(4)}, "mean", 4, rank_lines=True)
    assert small is not None and small["lines"] and [line["rank"] for line in small["ranks"]] == [0, 1, 2, 3]


def test_heatmap_rows_merge_ranks_and_name_the_highest() -> None:
    series = {r: [(s, float(r == 5 and s == 3) * 7.0 + 1.0) for s in range(1, 5)] for r in range(10)}
    cols = spread.columns(series)
    assert cols is not None
    hm = spread.heatmap(spread.reduce_all(series, cols), cols, "mean", 2, max_columns=2, max_rows=4)
    assert hm["rows"] == [[0, 2], [3, 5], [6, 8], [9, 9]] and hm["columns"] == [[1, 2], [3, 4]]
    assert len(hm["values"]) == 8 and hm["values"][3] == 4.5  # rank 5, steps 3-4: mean of 8 and 1
    assert hm["who"] is not None and hm["who"][3] == 5
    # the colour scale is centred on the median cell (1.0 here), full at +-50% of it
    assert (hm["median"], hm["min"], hm["max"]) == (1.0, 0.5, 1.5) and hm["neutral"] == spread.HEAT_NEUTRAL
    one = spread.heatmap(spread.reduce_all(series, cols), cols, "max", 2)
    assert one["who"] is None and len(one["rows"]) == 10 and one["values"][5 * 4 + 2] == 8.0
    # ranks within 1% of each other are not drawn as far apart: both inside the neutral band
    close = {r: [(s, 130.7 + 1.6 * (r == 0)) for s in range(1, 5)] for r in range(2)}
    near = spread.heatmap(spread.reduce_all(close, cols), cols, "max", 2)
    assert all(abs(v / near["median"] - 1) <= near["neutral"] for v in near["values"] if v is not None)


def _deviations(hm: dict[str, object]) -> list[float]:
    median = hm["median"]
    assert isinstance(median, float) and median > 0
    return [v / median - 1 for v in hm["values"] if isinstance(v, float)]  # type: ignore[attr-defined]


def test_a_healthy_spread_is_neutral_and_a_straggler_is_not() -> None:
    """The colour scale is the deviation from the median cell with a neutral band: a healthy
    run's ~10% spread of memory (1.85-2.06 GiB; 64 ranks x 1,000 steps) lies inside it,
    where a min-to-max scale painted its top cells full red; a straggler 50% slower lies at
    the full red end, its peers in the band."""
    gib = 1024.0
    memory = {
        r: [(s, gib * (1.85 + 0.21 * (r % 11) / 10 - 0.001 * (s % 5))) for s in range(1, 1001)] for r in range(64)
    }
    cols = spread.columns(memory)
    assert cols is not None
    hm = spread.heatmap(spread.reduce_all(memory, cols), cols, "max", 1)
    devs = _deviations(hm)
    assert max(devs) - min(devs) > 0.09  # the spread is there ...
    assert max(abs(d) for d in devs) <= hm["neutral"]  # ... and all of it neutral
    times = {r: [(s, 0.2 * (1.5 if r == 17 else 1.0) * (1 + 0.02 * (s % 3))) for s in range(1, 101)] for r in range(64)}
    cols = spread.columns(times)
    assert cols is not None
    hm = spread.heatmap(spread.reduce_all(times, cols), cols, "mean", 4)
    n = len(hm["columns"])
    row = [v for v in hm["values"][17 * n : 18 * n] if v is not None]
    assert hm["max"] is not None and min(row) >= hm["max"] * 0.97  # at the full end (within rounding)
    others = [v for k, v in enumerate(hm["values"]) if v is not None and k // n != 17]
    assert all(abs(v / hm["median"] - 1) <= hm["neutral"] for v in others)


def test_sizes_are_bounded_at_1024_ranks_by_10000_steps() -> None:
    steps = 10_000
    # 8 shapes of series shared between ranks (one list each: memory stays small), and
    # the two ranks that stand out
    shapes = [[(s, 0.25 + 0.01 * math.sin(s / 40 + k)) for s in range(1, steps + 1)] for k in range(8)]
    times = {r: shapes[r % 8] for r in range(1024)}
    times[17] = [(s, v + 0.08) for s, v in shapes[1]]
    flat = [(s, 3000.0 + s % 11) for s in range(1, steps + 1)]
    mem = dict.fromkeys(range(1024), flat)
    mem[0] = [(s, v + 900) for s, v in flat]
    per = PerStep(step_time=times, loss={}, wait={}, memory={"RSS": mem})
    charts = spread.charts(per, {"chart-memory": [0, 5]})
    st = charts["step_time"]
    assert not charts["lines"] and st["ranks_total"] == 1024
    assert st["columns"] <= spread.MAX_COLUMNS and st["width"] == 25
    assert all(len(v) == st["columns"] for v in st["bands"].values())
    hm = st["heatmap"]
    assert len(hm["rows"]) <= spread.HEAT_ROWS and len(hm["columns"]) <= spread.HEAT_COLUMNS
    assert len(hm["values"]) == len(hm["rows"]) * len(hm["columns"]) and hm["rows"][2] == [16, 23]
    assert [o["rank"] for o in st["outliers"]] == [17]
    assert hm["who"] is not None and {hm["who"][2 * len(hm["columns"]) + c] for c in range(len(hm["columns"]))} == {17}
    m = charts["memory"]["RSS"]
    assert [o["rank"] for o in m["outliers"]] == [0] and [n["rank"] for n in m["named"]] == [5]
    size = len(json.dumps(charts, allow_nan=False))
    assert size < 1_000_000, size
    # a run 10x shorter gives charts of about the same size: size follows columns, not steps
    short = {r: s[: steps // 10] for r, s in times.items()}
    short_size = len(json.dumps(spread.charts(PerStep(short, {}, {}, {"RSS": mem}), {})))
    assert 0.5 * size < short_size < 1.5 * size, (short_size, size)


def test_report_data_switches_to_bands_above_the_cutoff(tmp_path: Path) -> None:
    n = spread.LINES_UP_TO + 1
    bundle = load_bundle(write_run(tmp_path, [RankSpec(steps=5) for _ in range(n)]))
    data = build_report_data(bundle, run_detectors(bundle))
    charts = data["charts"]
    sp = charts["spread"]
    assert not sp["lines"] and sp["step_time"]["ranks_total"] == n
    assert charts["steps"]["time"] is None and charts["memory"]["series"] is None  # no per-rank lines
    assert sp["step_time"]["heatmap"]["rows"][0] == [0, 0] and sp["wait"] is not None
    small = build_report_data(load_bundle(write_run(tmp_path / "small", [RankSpec(steps=5)] * 2)), [])
    assert small["charts"]["spread"]["lines"] and len(small["charts"]["steps"]["time"]) == 2
    json.dumps(data, allow_nan=False)


def test_many_ranks_bound_the_collective_rows_and_group_the_end_pins(tmp_path: Path) -> None:
    n = 70
    specs = [RankSpec(steps=3) for _ in range(n)]
    specs[66] = RankSpec(steps=3, calls=[Call("all_reduce"), Call("broadcast"), Call("all_reduce")])
    for r in (5, 9, 40):
        specs[r] = RankSpec(steps=3, exception=("OutOfMemoryError", "CUDA out of memory. Tried to allocate 2 GiB"))
    data = build_report_data(load_bundle(write_run(tmp_path, specs)), [])
    col = data["charts"]["collectives"]
    # alike ranks share a row, as `analyze` condenses its table; the rank that differs has its own
    assert col["members_total"] == n and col["first"]["seq"] == 2
    assert col["rows"] == ["ranks 0-65, 67-69 (69)", "rank 66"]
    table = data["collective_table"]["table"]
    assert [(r["ranks"], r["count"]) for r in table] == [("0-65, 67-69", 69), ("66", 1)]
    pins = data["charts"]["memory"]["ends"]
    assert [(p["label"], p["ranks"], p["count"]) for p in pins] == [("OOM", [5, 9, 40], 3)]


def test_the_collectives_of_1024_ranks_that_agree_are_one_row(tmp_path: Path) -> None:
    """A 1,024-rank run whose ranks agree on every collective: one row in the chart and in
    the table (64 rows of the same calls were listed under "The ranks agree on every
    collective"); a rank-0-only call splits rank 0 off, the others stay one row; two ranks
    alike (fewer than MIN_ALIKE_RANKS) keep a row each."""
    n = 1024
    bundle = load_bundle(write_run(tmp_path / "agree", [RankSpec(steps=2) for _ in range(n)]))
    data = build_report_data(bundle, [])
    col = data["charts"]["collectives"]
    assert col["first"] is None and col["rows"] == ["ranks 0-1023 (1,024)"] and col["members_total"] == n
    assert [(r["ranks"], r["count"]) for r in data["collective_table"]["table"]] == [("0-1023", n)]
    assert {c[1] for c in col["cells"]} == {0}
    html = render(data)
    assert "The ranks agree on every collective" in html and "1 row(s) for\n    1024 ranks" in html
    odd = [RankSpec(steps=2) for _ in range(40)]
    odd[0] = RankSpec(steps=2, calls=[Call("all_reduce"), Call("barrier", bytes=0, dtype=None), Call("all_reduce")])
    col = build_report_data(load_bundle(write_run(tmp_path / "odd", odd)), [])["charts"]["collectives"]
    assert col["rows"] == ["rank 0", "ranks 1-39 (39)"] and col["first"]["seq"] == 2
    two = build_report_data(load_bundle(write_run(tmp_path / "two", [RankSpec(steps=2)] * 2)), [])
    assert two["charts"]["collectives"]["rows"] == ["rank 0", "rank 1"]
    assert [r["ranks"] for r in two["collective_table"]["table"]] == ["0", "1"]


def test_collective_rows_past_64_say_how_many_ranks_are_left_out(tmp_path: Path) -> None:
    """70 ranks whose calls all differ (a size each): 64 rows, and the page says that 6
    ranks are left out and which are shown."""
    specs = [RankSpec(steps=2, calls=[Call("all_reduce", bytes=1024 + 4 * r)] * 3) for r in range(70)]
    data = build_report_data(load_bundle(write_run(tmp_path, specs)), [])
    col = data["charts"]["collectives"]
    assert len(col["rows"]) == 64 == len(data["collective_table"]["table"]) and col["rows_ranks"] == 64
    assert col["rows"][:2] == ["rank 0", "rank 1"]
    assert "past 64 rows, 6 ranks are left out" in render(data)
