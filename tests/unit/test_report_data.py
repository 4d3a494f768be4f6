"""The report's data builder, checked on the data (the page only lays it out)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from lorascope.analysis.summary import build_summary
from lorascope.detect.finding import Evidence, Finding
from lorascope.ingest.load import load_bundle
from lorascope.report.data import build_report_data
from lorascope.report.downsample import thin
from lorascope.report.render import render
from lorascope.text.summary import render_text
from lorascope.units import MAX_TABLE_RANKS, rank_ranges
from tests.helpers import FIXTURES, Call, RankSpec, write_run

REPO = Path(__file__).resolve().parents[2]
HEALTHY = REPO / "fixtures" / "healthy"


def finding(id_: str = "rank-conditional-hang", **details: object) -> Finding:
    return Finding(
        id=id_,
        title="the ranks disagree",
        severity="error",
        confidence="high",
        confidence_reason="because",
        ranks=[0],
        evidence=[Evidence("x", 1, "ranks/rank-0")],
        explanation="why",
        fix="fix",
        details=dict(details),
    )


def test_healthy_fixture_data() -> None:
    data = build_report_data(load_bundle(HEALTHY), [])
    charts = data["charts"]
    assert data["verdict"]["level"] == "ok"
    assert [s["rank"] for s in charts["memory"]["series"]] == [0, 1]
    assert all(s["end"]["label"] == "exit 0" and not s["end"]["bad"] for s in charts["memory"]["series"])
    # a CPU run: the C heap in use first (what the job holds), RSS beside it
    assert charts["memory"]["metric"] == "heap in use" and charts["memory"]["metrics"] == ["heap in use", "RSS"]
    assert charts["memory"]["steps"]
    assert charts["collectives"]["available"] and charts["collectives"]["first"] is None
    assert charts["collectives"]["pending"] == []
    assert {r["op"] for r in charts["op_times"]["rows"]} >= {"all_reduce", "broadcast"}
    assert [s["step"] for s in charts["steps"]["time"]] == [[1, 2, 3, 4, 5, 6]] * 2
    facts = data["facts"]
    assert facts["world_size"] == 2 and [c["name"] for c in facts["configs"]][:3] == ["deepspeed", "lora", "model"]
    assert "torch.distributed.run" in facts["launches"][0]["command"]  # fixtures/record_runs.py's launch
    kernels = charts["kernels"]  # from the run's Kineto traces (one traced step per rank)
    assert kernels["available"] and kernels["unit"] == "op" and [r["rank"] for r in kernels["ranks"]] == [0, 1]
    assert all(r["count"] > 1000 and 0 < r["lora_count"] < 1 and 0 < r["tiny_count"] < 1 for r in kernels["ranks"])
    assert all(r["source"].endswith(".trace.json.gz") for r in kernels["ranks"])
    json.dumps(data, allow_nan=False)  # plain, finite data


def test_kernel_section_says_what_is_missing() -> None:
    bundle = load_bundle(HEALTHY)
    bundle.traces = {}  # the trace files exist in the run, but nothing loaded them
    kernels = build_report_data(bundle, [])["charts"]["kernels"]
    assert not kernels["available"] and "2 kernel trace file(s)" in kernels["message"]
    bundle.run.ranks[0].trace_files = bundle.run.ranks[1].trace_files = []
    assert build_report_data(bundle, [])["charts"]["kernels"]["message"] == "no kernel trace in this run"


def test_disagreement_and_pending_are_found(tmp_path: Path) -> None:
    odd = Call("all_reduce", site="t.py:5 in ev", end=False)
    ranks = [
        RankSpec(
            calls=[Call("all_reduce"), Call("all_reduce"), odd],
            sites={"t.py:5 in ev": ("dist.all_reduce(x)", ["if rank == 0:"])},
        ),
        RankSpec(
            calls=[Call("all_reduce"), Call("all_reduce"), Call("barrier", bytes=0, dtype=None, end=False)], ends=False
        ),
    ]
    data = build_report_data(load_bundle(write_run(tmp_path, ranks)), [])
    col = data["charts"]["collectives"]
    assert col["first"]["seq"] == 3 and col["first"]["kind"] == "mismatch"
    assert "all_reduce" in col["first"]["text"] and "barrier" in col["first"]["text"]
    assert [(p[0], p[1], p[2]) for p in col["pending"]] == [(0, 3, "all_reduce"), (1, 3, "barrier")]
    focus = [c for row in data["collective_table"]["table"] for c in row["cells"] if c["focus"]]
    assert [c["status"] for c in focus] == ["pending", "pending"]
    assert focus[0]["line"] == "dist.all_reduce(x)" and focus[0]["conditions"] == ["if rank == 0:"]
    assert any("rank 1: the stream ends without an end record" in m for m in data["missing"])
    assert data["charts"]["memory"]["series"][1]["end"] == {
        "t": data["charts"]["memory"]["series"][1]["end"]["t"],
        "mib": 130.0,
        "label": "no end record",
        "bad": True,
    }


def test_a_call_only_some_ranks_made_is_a_disagreement(tmp_path: Path) -> None:
    ranks = [
        RankSpec(calls=[Call("all_reduce")] * 3),
        RankSpec(calls=[Call("all_reduce")] * 2, exception=("RuntimeError", "boom")),
    ]
    col = build_report_data(load_bundle(write_run(tmp_path, ranks)), [])["charts"]["collectives"]
    assert col["first"]["seq"] == 3 and col["first"]["kind"] == "missing" and col["first"]["ranks"] == [1]
    assert col["first"]["text"].startswith("rank 0 called all_reduce") and col["first"]["text"].endswith(
        "rank 1 never did"
    )


def test_a_detectors_pointer_wins(tmp_path: Path) -> None:
    bundle = load_bundle(write_run(tmp_path, [RankSpec(), RankSpec()]))
    data = build_report_data(bundle, [finding(group="default_pg", seq=2)])
    assert data["charts"]["collectives"]["first"]["seq"] == 2
    assert data["verdict"]["level"] == "error" and data["verdict"]["id"] == "rank-conditional-hang"
    assert data["findings"][0]["chart"] == "chart-collectives"
    assert data["findings"][0]["details"] == {"group": "default_pg", "seq": 2}


def test_oom_end_and_verdict_without_findings(tmp_path: Path) -> None:
    ranks = [RankSpec(exception=("OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB")), RankSpec()]
    data = build_report_data(load_bundle(write_run(tmp_path, ranks)), [])
    assert data["charts"]["memory"]["series"][0]["end"]["label"] == "OOM"
    assert data["verdict"]["level"] == "warning" and "rank 0 ended badly" in data["verdict"]["headline"]
    assert data["facts"]["ranks"][0]["exception"]["message"].startswith("CUDA out of memory")


def test_a_run_without_a_step_has_no_ok_verdict(tmp_path: Path) -> None:
    data = build_report_data(
        load_bundle(write_run(tmp_path, [RankSpec(steps=0, calls=[]), RankSpec(steps=0, calls=[])])), []
    )
    assert data["verdict"]["level"] == "unknown"
    assert data["verdict"]["headline"].startswith("no detector named a cause, but no training step was seen (all 2")


def test_phases_non_finite_losses_and_breakdown(tmp_path: Path) -> None:
    ranks = [
        RankSpec(phases=[("eval", 1), ("save", 3)], losses=[2.0, float("nan"), 1.5, float("inf")]),
        RankSpec(phases=[("eval", 1)]),
    ]
    breakdown = {"0": {"weights": 100 << 20, "logits": 50 << 20}, "1": {"weights": 100 << 20}}
    data = build_report_data(
        load_bundle(write_run(tmp_path, ranks)), [finding("rank0-asymmetry", memory_breakdown=breakdown)]
    )
    phases = data["charts"]["memory"]["phases"]
    assert [(p["name"], p["ranks"]) for p in phases] == [("eval", [0, 1]), ("save", [0])]
    steps = data["charts"]["steps"]
    assert steps["loss"][0]["step"] == [1, 3]
    assert [(r, s) for r, s, _ in steps["non_finite_losses"]] == [(0, 2), (0, 4)]
    assert data["charts"]["peak"]["breakdown"] == {"weights": [100.0, 100.0], "logits": [50.0, None]}
    assert "memory_breakdown" not in data["findings"][0]["details"]
    json.dumps(data, allow_nan=False)


def test_kernel_table_from_a_finding(tmp_path: Path) -> None:
    table = {
        "unit": "op",
        "threshold_us": 10.0,
        "ranks": {
            "0": {
                "rows": [
                    {"name": "aten::mm", "module": "lora_A", "durations_us": [2.0, 3.0]},
                    {"name": "aten::mm", "module": "base", "durations_us": [100.0, 5.0]},
                ]
            }
        },
    }
    bundle = load_bundle(write_run(tmp_path, [RankSpec()]))
    data = build_report_data(bundle, [finding("tiny-kernel-tail", kernels=table)])
    k = data["charts"]["kernels"]
    assert k["available"] and k["threshold_us"] == 10.0
    assert k["ranks"][0]["tiny_count"] == 0.75 and k["ranks"][0]["lora_count"] == 0.5
    assert k["ranks"][0]["lora_time"] == round(5 / 110, 4)
    assert sum(b["lora"] for b in k["bins"]) == 2 and sum(b["other"] for b in k["bins"]) == 2
    under = k["bins"][: k["threshold_bin"]]
    assert all(b["hi"] <= 10.0 + 1e-9 for b in under) and k["bins"][k["threshold_bin"]]["lo"] == 10.0
    assert data["findings"][0]["chart"] == "chart-kernels"


def test_kernel_table_from_a_loaded_kineto_trace(tmp_path: Path) -> None:
    def op(name: str, ts: float, dur: float, **args: object) -> dict[str, object]:
        return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur, "args": args}

    events = [
        {
            "ph": "X",
            "cat": "user_annotation",
            "name": "lorascope.module::m.q_proj.lora_A.default",
            "pid": 1,
            "tid": 1,
            "ts": 0,
            "dur": 100,
        },
        op("aten::linear", 1, 50, **{"Sequence number": 7}),
        op("aten::mm", 2, 40),  # leaf: mm only
        op("aten::add", 200, 5),  # outside any module
        op("autograd::engine::evaluate_function: MmBackward0", 300, 30, **{"Sequence number": 7}),
        op("aten::mm", 301, 20),  # backward of the lora_A op
    ]
    bundle = load_bundle(write_run(tmp_path, [RankSpec()]))
    bundle.traces = {0: {"traceEvents": events}}
    k = build_report_data(bundle, [])["charts"]["kernels"]
    assert k["available"] and k["ranks"][0]["count"] == 3
    assert k["ranks"][0]["lora_count"] == round(2 / 3, 4)
    assert {(t["name"], t["module"]) for t in k["top"]} == {("aten::mm", "lora_A"), ("aten::add", None)}


def test_truncated_stream_is_reported(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(HEALTHY, run_dir)
    stream = next((run_dir / "ranks" / "rank-1").glob("*.jsonl"))
    raw = stream.read_bytes()
    stream.write_bytes(raw[: len(raw) // 2])  # cut mid-record, like a SIGKILL mid-write
    data = build_report_data(load_bundle(run_dir), [])
    assert any("torn last record" in m for m in data["missing"])
    assert any("rank 1: the stream ends without an end record" in m for m in data["missing"])
    assert data["charts"]["memory"]["series"][1]["end"]["label"] == "no end record"


def test_downsampling_keeps_extremes_and_ends() -> None:
    xs = [float(i) for i in range(100_000)]
    ys = [float((i * 7919) % 1000) for i in range(100_000)]
    ys[54_321] = 5000.0  # a spike must survive
    tx, ty = thin(xs, ys, 1000)
    assert len(tx) <= 1000 and (tx[0], ty[0]) == (0.0, ys[0]) and (tx[-1], ty[-1]) == (xs[-1], ys[-1])
    assert 54_321.0 in tx and max(ty) == 5000.0 and min(ty) == 0.0
    assert tx == sorted(tx) and all(ys[int(x)] == y for x, y in zip(tx, ty, strict=True))
    assert thin([1.0] * 50, list(map(float, range(50))), 10)[1][1:-1] != []  # all x equal: still thinned


def test_memory_chart_opens_on_the_figure_the_verdict_used() -> None:
    """On CPU the memory detectors read the heap in use (RSS keeps freed memory): the chart
    and the peak bars draw that first, and RSS is there too."""
    data = build_report_data(load_bundle(FIXTURES / "rank0-asymmetry"), [])
    memory = data["charts"]["memory"]
    assert memory["metric"] == "heap in use" and memory["metrics"] == ["heap in use", "RSS"]
    assert [s["rank"] for s in memory["others"]["RSS"]] == [0, 1] and memory["others"]["RSS"][0]["mib"]
    assert data["charts"]["peak"]["metric"] == "peak C heap in use: bytes malloc handed out, not RSS"


def test_every_peak_memory_figure_says_what_it_is() -> None:
    """The terminal's table showed "peak mem 502 MiB" (RSS) and the report's header "peak heap
    in use 2,107 MiB" for one run, neither saying what it was."""
    bundle = load_bundle(FIXTURES / "rank0-asymmetry")
    summary = build_summary(bundle.run)
    header = next(line for line in render_text(summary).splitlines() if line.lstrip().startswith("rank "))
    assert "peak RSS" in header and "peak mem" not in header
    data = build_report_data(bundle, [], summary)
    [figure] = [f for f in data["figures"] if "rank 0" in f["label"]]
    assert "heap in use" in figure["label"] and "not RSS" in figure["label"]
    rss = summary["ranks"][0]["peak_memory"]["rss_bytes"] / 2**20
    assert f"; peak RSS {rss:,.0f} MiB" in figure["value"]


def test_ranks_that_ended_alike_are_shown_once(tmp_path: Path) -> None:
    # 12 ranks: rank 0 ran out of memory; 1-9 lost their peer (the message differs in its
    # port only); 10 too, with the exact text of rank 1; 11 exited cleanly.
    lost = "Connection closed by peer [127.0.0.1]:{}"
    ranks = [RankSpec(exception=("OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB"))]
    ranks += [RankSpec(exception=("RuntimeError", lost.format(40000 + n))) for n in range(1, 10)]
    ranks += [RankSpec(exception=("RuntimeError", lost.format(40001))), RankSpec()]
    data = build_report_data(load_bundle(write_run(tmp_path, ranks)), [])
    facts = data["facts"]
    assert len(facts["ranks"]) == 12  # the table keeps a row per rank
    oom, peer = facts["endings"]
    assert (oom["ranks"], oom["label"], oom["same"]) == ([0], "rank 0", None)
    assert peer["ranks"] == list(range(1, 11)) and peer["same"] == "shape"
    assert peer["label"] == "ranks 1-10 (10 ranks, the same ending but for its numbers; rank 1's shown)"
    assert peer["exception"]["message"] == lost.format(40001)
    # identical text: said so
    same = build_report_data(load_bundle(write_run(tmp_path / "same", [ranks[1], ranks[10], ranks[1]])), [])
    [group] = same["facts"]["endings"]
    assert (group["ranks"], group["same"]) == ([0, 1, 2], "text")
    assert group["label"] == "ranks 0-2 (3 ranks, the same ending)"


def test_rank_ranges() -> None:
    assert rank_ranges([]) == ""
    assert rank_ranges([3]) == "3"
    assert rank_ranges([0, 1]) == "0, 1"
    assert rank_ranges([0, 1, 2, 4, 6, 7, 8, 9, 1023]) == "0-2, 4, 6-9, 1023"


def test_the_per_rank_table_is_folded_past_the_limit(tmp_path: Path) -> None:
    """Up to MAX_TABLE_RANKS ranks the table is open; past it, folded behind a summary that
    names the ranks that ended badly (laid out only when opened)."""
    few = build_report_data(load_bundle(write_run(tmp_path / "few", [RankSpec(), RankSpec()])), [])
    assert few["facts"]["ranks_folded"] is None and '<details class="ranks">' not in render(few)
    specs = [RankSpec() for _ in range(MAX_TABLE_RANKS + 1)]
    specs[5] = RankSpec(exception=("RuntimeError", "boom"))
    many = build_report_data(load_bundle(write_run(tmp_path / "many", specs)), [])
    assert many["facts"]["ranks_folded"] == f"a row per rank ({MAX_TABLE_RANKS + 1} ranks; ended badly: 5)"
    page = render(many)
    folded = page.index('<details class="ranks">')
    assert folded < page.index('<table class="ranks">') < page.index("</details>", folded)


def test_a_rank_killed_by_an_abort_gets_a_one_line_pin_and_faulthandlers_text_in_its_ending(tmp_path: Path) -> None:
    """The memory chart's pin for a rank gloo aborted was labelled with faulthandler's whole
    dump (every thread's stack, the extension modules: dozens of lines drawn over the
    chart). The pin and the ranks table say its first line; the ending shows the dump."""
    dump = (
        'Fatal Python error: Aborted\n\nThread 0x1 (most recent call first):\n  File "/job/t.py", line 3 in <module>\n'
    )
    run = write_run(tmp_path, [RankSpec(ends=False, fatal=dump), RankSpec()], exit_status=1)
    data = build_report_data(load_bundle(run), [])
    [pin] = [s["end"] for s in data["charts"]["memory"]["series"] if s["end"] and s["end"]["bad"]]
    assert pin["label"] == "Fatal Python error: Aborted (faulthandler)"
    [row] = [r for r in data["facts"]["ranks"] if r["rank"] == 0]
    assert row["end_label"] == pin["label"]
    [ending] = [e for e in data["facts"]["endings"] if e["rank"] == 0]
    assert ending["fatal"] == dump.strip()
    page = render(data)
    assert "what faulthandler wrote" in page and "line 3 in &lt;module&gt;" in page


def test_the_heatmaps_have_a_column_per_step(tmp_path: Path) -> None:
    """20 steps are 20 columns: the samples a rank that exited 0 takes after its last step
    (its teardown) are no step (they drew a 21st column); a rank that died keeps the step
    it died in."""
    data = build_report_data(load_bundle(write_run(tmp_path / "ok", [RankSpec(steps=20)] * 2)), [])
    spread = data["charts"]["spread"]
    memory = spread["memory"]["RSS"]["heatmap"]
    assert memory["columns"] == [[s, s] for s in range(1, 21)] == spread["step_time"]["heatmap"]["columns"]
    assert "20 column(s) of 1 step each" in render(data) and "21 column(s)" not in render(data)
    healthy = build_report_data(load_bundle(HEALTHY), [])["charts"]["spread"]
    columns = healthy["memory"]["heap in use"]["heatmap"]["columns"]
    assert len(columns) == len(healthy["step_time"]["heatmap"]["columns"]) == 6
    died = RankSpec(steps=3, extra=[{"k": "mem", "src": "sampler", "step": 3, "rss": 900 << 20}], ends=False)
    data = build_report_data(load_bundle(write_run(tmp_path / "died", [RankSpec(steps=3), died])), [])
    heat = data["charts"]["spread"]["memory"]["RSS"]["heatmap"]
    assert heat["columns"][-1] == [4, 4] and heat["values"][-1] == 900.0  # rank 1, in the step it never finished


def test_the_memory_chart_opens_on_the_steps() -> None:
    """The memory chart's view starts just before the first step (not at the start of a
    run whose startup took most of its time) and ends at the last sample."""
    data = build_report_data(load_bundle(HEALTHY), [])
    mem = data["charts"]["memory"]
    first_step_end, last = mem["steps"][0][0], max(t for s in mem["series"] for t in s["t"])
    view = mem["view"]
    assert view is not None and view[1] == last
    assert first_step_end - 2.0 < view[0] < first_step_end  # the first step took 1.26 s
    assert view[0] > last / 2  # the startup (over 30 s of the 36) is left out of the view
    assert f"It opens on the steps (from\n    {view[0]} s)" in render(data)
