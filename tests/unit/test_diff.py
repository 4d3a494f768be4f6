"""`lorascope diff` on real run pairs recorded by fixtures/diff/record.py: the configuration
that differs, what it did (memory, plan terms, step time, collectives) and the findings
new, gone and changed, in the terminal, as JSON and as a page."""

from __future__ import annotations

import functools
import html
import json
import shutil
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from lorascope.analysis import Analysis, analyze
from lorascope.analysis.diff import build_diff
from lorascope.cli import cli
from lorascope.errors import UsageError
from lorascope.report.diff import diff_page_data
from lorascope.report.render import render_diff
from lorascope.text.diff import differing_words
from lorascope.text.diff import render_diff as render_text
from tests.helpers import FIXTURES

PAIRS = FIXTURES / "diff"


@functools.cache
def _analysis(name: str) -> Analysis:
    return analyze(PAIRS / name)


def _diff(a: str, b: str) -> dict[str, Any]:
    return build_diff(_analysis(a), _analysis(b))


def _config(data: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    rows = data["config"]["headline"] + data["config"]["other"]
    return {r["name"]: (r["a"], r["b"]) for r in rows}


def _terms(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["name"]: t for t in data["plan"]["terms"]}


def test_fixture_pairs_stay_small() -> None:
    size = sum(f.stat().st_size for f in PAIRS.rglob("*") if f.is_file())
    assert size < 2 * 2**20, size


def test_lora_rank_change_moves_the_adapter_terms_and_the_gathers() -> None:
    data = _diff("r8", "r64")
    config = _config(data)
    assert config["lora.r"] == (8, 64)
    assert config["lora.lora_alpha"] == (16, 128)
    assert [r["name"] for r in data["config"]["headline"]][:2] == ["lora.r", "lora.lora_alpha"]
    assert "versions.torch" not in config and "world_size" not in config
    terms = _terms(data)
    adapters = next(t for name, t in terms.items() if "adapter" in t["label"] and "weights" in t["label"])
    assert adapters["b"] == 8 * adapters["a"], adapters  # r 8 -> 64: the adapters' bytes x8
    ops = {r["op"]: r for r in data["collectives"]["per_rank_step"]}
    scatter = ops["reduce_scatter_tensor"]  # the adapters' gradients, reduce-scattered once a step
    assert scatter["changed"] and scatter["b_bytes"] == 8 * scatter["a_bytes"]
    assert scatter["a_calls"] == scatter["b_calls"]
    assert not data["findings"]["new"] and not data["findings"]["gone"]
    assert data["shared"]["notes"] == [] and data["shared"]["steps"] == 7
    assert not data["collectives"]["decimated"] and data["collectives"]["rank_steps"] == {"a": 12, "b": 12}


def test_sequence_length_and_logits_spike() -> None:
    data = _diff("seq256", "seq1024-spike")
    config = _config(data)
    assert config["measured.seq"] == (256, 1024)
    assert data["config"]["headline"][0]["name"] == "measured.seq"
    changed = {c["id"]: c for c in data["findings"]["changed"]}
    spike = changed["logits-spike"]
    assert spike["worse"] is True
    assert (spike["a"]["severity"], spike["b"]["severity"]) == ("info", "warning")
    assert spike["a"]["evidence"] and spike["b"]["evidence"]
    assert "256" in str(spike["a"]["evidence"][0]["value"]) and "1024" in str(spike["b"]["evidence"][0]["value"])
    logits = next(t for t in data["plan"]["terms"] if t["label"].startswith("logits"))
    assert logits["b"] == 4 * logits["a"]
    assert data["memory"]["moved_ranks"] == [0, 1]
    assert all(r["delta"] > 0 for r in data["memory"]["ranks"])
    assert data["steps"]["step"]["ratio"] > 1.5


def test_planted_straggler_is_a_new_finding_with_its_evidence() -> None:
    data = _diff("r8", "straggler")
    new = data["findings"]["new"]
    assert [f["id"] for f in new] == ["straggler"] and new[0]["ranks"] == [1]
    assert any("rank 1" in e["label"] for e in new[0]["evidence"])
    assert data["steps"]["step"]["ratio"] > 1.5
    assert list(_config(data)) == ["command"]  # the same job otherwise
    assert not any(r["changed"] for r in data["collectives"]["per_rank_step"] if r["op"] != "broadcast")
    gone = build_diff(_analysis("straggler"), _analysis("r8"))["findings"]["gone"]
    assert [f["id"] for f in gone] == ["straggler"]


def test_version_change_is_in_the_headline_rows() -> None:
    data = _diff("r8", "peft-0.20")
    config = _config(data)
    assert config["versions.peft"] == ("0.21.2", "0.20.0")
    assert config["lora.peft_version"] == ("0.21.2", "0.20.0")
    assert "lora.r" not in config
    text = render_text(data)
    assert "peft" in text and "0.21.2 -> 0.20.0" in text


def test_different_lengths_and_world_sizes_are_compared_on_what_they_share(tmp_path: Path) -> None:
    data = _diff("r8", "seq256")
    assert data["shared"]["steps"] == 3
    assert data["shared"]["completed"] == {"a": 7, "b": 3}
    assert any("steps 1-3" in n for n in data["shared"]["notes"])
    assert data["steps"]["steps_compared"] == [2, 3]
    one = tmp_path / "one-rank"
    shutil.copytree(PAIRS / "r64", one)
    shutil.rmtree(one / "ranks" / "rank-1")
    data = build_diff(_analysis("r8"), analyze(one))
    assert data["shared"]["ranks"] == [0]
    assert [r["rank"] for r in data["memory"]["ranks"]] == [0]
    assert any("A has 2 rank(s), B 1" in n for n in data["shared"]["notes"])
    assert "note: A has 2 rank(s), B 1" in render_text(data)


def test_terminal_page_is_one_page() -> None:
    for a, b in (("r8", "r64"), ("seq256", "seq1024-spike"), ("r8", "straggler"), ("r8", "peft-0.20")):
        lines = render_text(_diff(a, b)).splitlines()
        assert len(lines) <= 66, (a, b, len(lines))
        assert max(len(line) for line in lines) <= 110, (a, b)


def test_command_lines_are_cut_to_where_they_differ() -> None:
    a = "python -m torch.distributed.run --nproc_per_node 2 train.py --steps 7 --lora-r 8"
    b = "python -m torch.distributed.run --nproc_per_node 2 train.py --steps 7 --lora-r 64"
    assert differing_words(a, b) == ("... 8", "... 64")
    assert differing_words("x --seq 256 --steps 3", "x --seq 1024 --steps 3") == ("... 256 ...", "... 1024 ...")


def test_artifacts_of_one_kind_and_of_two_kinds() -> None:
    snaps = FIXTURES / "snapshots"
    data = build_diff(analyze(snaps / "lora-oom" / "rank-0.pickle"), analyze(snaps / "fragmented" / "rank-0.pickle"))
    assert data["kind"] == "snapshot"
    assert [f["id"] for f in data["findings"]["gone"]] == ["logits-spike"]
    rows = {r["name"]: (r["a"], r["b"]) for r in data["artifacts"]["rows"]}
    assert rows["snapshots.0.devices[0].peak.allocated"] == (1188036608, 188697600)
    with pytest.raises(UsageError, match="two of one kind"):
        build_diff(_analysis("r8"), analyze(snaps / "fragmented" / "rank-0.pickle"))


def test_cli_json_html_and_usage_error(tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "diff.html"
    result = runner.invoke(cli, ["diff", str(PAIRS / "r8"), str(PAIRS / "straggler"), "--json", "--html", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["findings"]["new"][0]["id"] == "straggler"
    page = out.read_text()
    assert "straggler" in page and "script-src 'none'" in html.unescape(page) and "<script" not in page
    from lorascope.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["diff", str(PAIRS / "r8"), str(FIXTURES / "snapshots" / "fragmented" / "rank-0.pickle")])
    assert exc.value.code == 2


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)


def test_page_escapes_run_text_and_scrubs_secrets() -> None:
    data = json.loads(json.dumps(_diff("r8", "straggler")))
    data["config"]["headline"].append(
        {"label": "command", "name": "command", "a": "<img src=x onerror=alert(1)>", "b": "HF_TOKEN=hf_abcdef123 x"}
    )
    data["findings"]["new"][0]["title"] = "<script>alert(1)</script>"
    page = render_diff(diff_page_data(data))
    parser = _Tags()
    parser.feed(page)
    assert "img" not in parser.tags and "script" not in parser.tags
    assert "&lt;img src=x" in page and "hf_abcdef123" not in page
    assert render_diff(diff_page_data(data)) == page  # deterministic


def test_collectives_of_a_run_past_the_readers_bounds_are_counted_on_whole_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a run's middle calls dropped (bounds far below the fixture's ~350 calls a rank),
    the per-step figures of the ops called alike every step are the same as with every call
    kept: they are taken over the steps kept whole."""
    from lorascope.rundir.loading import callreduce, reduce

    whole = _diff("r8", "r64")["collectives"]
    for module in (reduce, callreduce):
        monkeypatch.setattr(module, "HEAD_CALLS", 60)
        monkeypatch.setattr(module, "TAIL_CALLS", 120)
    data = build_diff(analyze(PAIRS / "r8"), analyze(PAIRS / "r64"))["collectives"]
    assert data["decimated"] and 0 < data["rank_steps"]["a"] < 12
    steady = {"all_gather_into_tensor", "all_reduce", "reduce_scatter_tensor"}  # the same calls every step
    assert [r for r in data["per_rank_step"] if r["op"] in steady] == [
        r for r in whole["per_rank_step"] if r["op"] in steady
    ]
