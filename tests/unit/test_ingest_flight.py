"""Flight-recorder dumps recorded from the real 2-rank gloo job (fixtures/flight-recorder/),
read and aligned: the planted hang, a healthy run, a same-bytes dtype mismatch."""

from __future__ import annotations

import copy
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from lorascope.cli import cli
from lorascope.detect.hang.flight_align import align
from lorascope.errors import BadInputError
from lorascope.ingest.flight.reader import FlightEntry, call_chain, call_site, parse_flight_dump, read_flight_dump

FR = Path(__file__).resolve().parents[2] / "fixtures" / "flight-recorder"


def _dumps(scenario: str, ext: str = "pickle") -> dict[int, Any]:
    return {r: read_flight_dump(FR / scenario / f"rank-{r}.{ext}", r) for r in (0, 1)}


def test_gloo_dump_with_pg_config_keyed_by_empty_name() -> None:
    raw = pickle.loads((FR / "rank0-extra-allreduce" / "rank-0.pickle").read_bytes())
    assert list(raw["pg_config"]) == [""]  # what breaks torch's fr_trace on gloo dumps
    dump = read_flight_dump(FR / "rank0-extra-allreduce" / "rank-0.pickle", 0)
    assert dump.backends == ["gloo"] and dump.group_ranks == {"0": [0, 1]} and dump.group_desc["0"] == "default_pg"
    assert [e.seq for e in dump.entries] == [e["collective_seq_id"] for e in raw["entries"]]
    assert all(e.state == "scheduled" for e in dump.entries)  # gloo never moves the state on ...
    assert [e.completed for e in dump.entries] == [True, True, True, False]  # ... pg_status says what finished
    assert dump.status["0"].last_started is None  # -1: not tracked


def test_planted_hang_first_disagreement_with_frames() -> None:
    result = align(_dumps("rank0-extra-allreduce"))
    (group,) = result.groups
    assert group.expected_ranks == [0, 1] and group.missing_dumps == [] and group.window == (1, 4)
    first = group.first_disagreement
    assert first is not None and result.first_disagreement is first
    assert (first.seq, first.kind) == (4, "op")
    assert first.entries[0].op == "all_reduce" and first.entries[0].input_sizes == [[1]]
    assert first.entries[1].op == "barrier"
    assert any("record.py:" in f and "rank_main" in f for f in first.entries[0].frames)
    assert {r: (p.last_enqueued, p.last_completed, p.pending) for r, p in group.progress.items()} == {
        0: (4, 3, True),
        1: (4, 3, True),
    }


def test_json_dumps_align_the_same_without_frames() -> None:
    result = align(_dumps("rank0-extra-allreduce", "json"))
    first = result.first_disagreement
    assert first is not None and (first.seq, first.kind) == (4, "op")
    assert first.entries[0].frames == []


def test_healthy_and_dtype_mismatch() -> None:
    healthy = align(_dumps("healthy"))
    assert healthy.first_disagreement is None and healthy.groups[0].compared == 5
    mismatch = align(_dumps("dtype-mismatch")).first_disagreement
    assert mismatch is not None and (mismatch.seq, mismatch.kind) == (4, "size+dtype")
    assert mismatch.entries[0].input_dtypes == ["Float"] and mismatch.entries[1].input_dtypes == ["Double"]
    assert mismatch.extra_on == []


def test_missing_rank_dump_and_extra_collective_shift() -> None:
    one = {0: read_flight_dump(FR / "healthy" / "rank-0.pickle", 0)}
    assert align(one).groups[0].missing_dumps == [1]
    raw = pickle.loads((FR / "healthy" / "rank-0.pickle").read_bytes())
    extra = copy.deepcopy(raw)  # rank 0 runs one all_reduce more at #2; the rest shifts by one
    inserted = copy.deepcopy(extra["entries"][1])
    inserted["input_sizes"] = [[1]]
    extra["entries"].insert(1, inserted)
    for i, e in enumerate(extra["entries"]):
        e["collective_seq_id"] = i + 1
    dumps = {0: parse_flight_dump(extra, Path("rank-0"), 0), 1: parse_flight_dump(raw, Path("rank-1"), 1)}
    first = align(dumps).first_disagreement
    assert first is not None and first.seq == 2 and first.kind == "size" and first.extra_on == [0]


@pytest.mark.parametrize("data", [{"version": "2.10"}, [], {"entries": "x"}])
def test_not_a_dump(data: Any, tmp_path: Path) -> None:
    path = tmp_path / "rank-0.json"
    path.write_text(json.dumps(data))
    with pytest.raises(BadInputError, match="not a flight-recorder dump"):
        read_flight_dump(path, 0)


def test_odd_entries_are_tolerated() -> None:
    raw = pickle.loads((FR / "healthy" / "rank-0.pickle").read_bytes())
    raw["entries"] += ["junk", {"profiling_name": None, "process_group": None, "input_sizes": "?"}]
    raw["pg_status"] = {"0": "nonsense"}
    dump = parse_flight_dump(raw, Path("rank-0"), 0)
    assert len(dump.entries) == 6 and dump.warnings and dump.entries[-1].op == "?"


def test_analyze_shows_a_disagreements_stack_from_its_call_site_out() -> None:
    """fixtures/hung-ranks' first disagreement: each rank's stack line starts at DeepSpeed's
    call site (not at torch's wrappers, which were all five frames shown before) and ends
    at the outermost frame the dump holds; a chain that reaches the job's code ends there,
    and a call made by the job's own line (the disagreement line names it) gets none."""
    result = CliRunner().invoke(cli, ["analyze", str(FR.parent / "hung-ranks")])
    assert result.exit_code == 0, result.output
    lines = [line.strip() for line in result.output.splitlines() if "called from:" in line]
    assert len(lines) == 2, result.output
    zero = lines[0].removeprefix("rank 0 called from: ").split(" < ")
    assert zero[0] == "deepspeed/comm/torch.py:437 in reduce_scatter_tensor"
    assert zero[-1] == "deepspeed/comm/comm.py:294 in reduce_scatter_fn"  # the outermost frame the dump holds
    assert not [f for f in zero if f.startswith(("torch/", "typing_extensions"))]
    one = lines[1].removeprefix("rank 1 called from: ").split(" < ")
    assert one[0] == "deepspeed/comm/torch.py:380 in all_gather_into_tensor"
    assert one[-1].endswith("in _allgather_params_coalesced")
    result = CliRunner().invoke(cli, ["analyze", str(FR / "library-save-rank0")])
    [lib] = [line.strip() for line in result.output.splitlines() if line.strip().startswith("rank 0 called from:")]
    result = CliRunner().invoke(cli, ["analyze", str(FR / "rank0-extra-allreduce")])
    assert "disagreement:" in result.output and "called from:" not in result.output
    assert lib.split(" < ")[0] == "rank 0 called from: savelib.py:11 in save_full" and lib.endswith(
        "/record_more.py:63 in rank_main"
    )


def test_the_call_site_is_past_the_wrappers_a_call_passes_through() -> None:
    """A ZeRO step's reduce_scatter_tensor as torch 2.13 records it in a probed DeepSpeed
    job (fixtures/hung-ranks): torch marks it ``@deprecated``, so typing_extensions'
    wrapper sits between torch.distributed and DeepSpeed; a standard-library decorator may
    too. The call site is DeepSpeed's line; the chain goes on to the job's own code. An
    FSDP call's site is the model's line, past torch's module-call machinery."""
    frames = [
        "torch/distributed/distributed_c10d.py:4936 in reduce_scatter_single",
        "torch/distributed/c10d_logger.py:83 in wrapper",
        "torch/distributed/distributed_c10d.py:4962 in reduce_scatter_tensor",
        "typing_extensions.py:3140 in wrapper",
        "torch/distributed/c10d_logger.py:83 in wrapper",
        "/work/main/lorascope/probes/collectives.py:134 in wrapper",
        "/usr/lib/python3.11/contextlib.py:81 in inner",
        "deepspeed/comm/torch.py:437 in reduce_scatter_tensor",
        "deepspeed/comm/comm.py:326 in reduce_scatter_tensor",
        "/usr/lib/python3.11/functools.py:23 in wrapped",
        "/home/u/job/train.py:314 in backward_and_step",
    ]
    assert call_site(frames) == "deepspeed/comm/torch.py:437 in reduce_scatter_tensor"
    assert call_chain(frames) == [
        "deepspeed/comm/torch.py:437 in reduce_scatter_tensor",
        "deepspeed/comm/comm.py:326 in reduce_scatter_tensor",
        "/home/u/job/train.py:314 in backward_and_step",
    ]
    assert call_site(frames[:6]) == frames[0]  # only torch's and lorascope's: the innermost
    # FSDP2's all_gather before a layer's forward: torch.distributed's frames, then torch's
    # module-call machinery running the pre-forward hook, then the model's line.
    fsdp = [
        "torch/distributed/distributed_c10d.py:4387 in all_gather_into_tensor",
        "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:293 in foreach_all_gather",
        "torch/distributed/fsdp/_fully_shard/_fsdp_state.py:246 in _pre_forward",
        "torch/nn/modules/module.py:1840 in inner",
        "torch/nn/modules/module.py:1879 in _call_impl",
        "transformers/models/llama/modeling_llama.py:420 in forward",
        "/home/u/job/train_fsdp.py:88 in step",
    ]
    assert call_site(fsdp) == "transformers/models/llama/modeling_llama.py:420 in forward"
    assert call_chain(fsdp) == fsdp[-2:]


def test_a_ranks_pending_entry_follows_the_number_it_names() -> None:
    """The progress line names the pending entry beside its number ("last enqueued #4
    (all_reduce ... at ...)"), not after "completed #3", which it is not; an entry with
    no sizes or dtypes (a barrier) reads without a gap."""
    result = CliRunner().invoke(cli, ["analyze", str(FR / "rank1-stalls")])
    lines = [line.strip() for line in result.output.splitlines() if "last enqueued" in line]
    assert lines[0].startswith("rank 0: last enqueued #4 (all_reduce [[16]] Float at ") and lines[0].endswith(
        "/record_more.py:68 in rank_main), started -, completed #3"
    )
    assert lines[1] == "rank 1: last enqueued #3, started -, completed #3"
    result = CliRunner().invoke(cli, ["analyze", str(FR / "library-save-rank0")])
    assert "rank 1 at group 0 #4: barrier at " in result.output and "barrier  at" not in result.output


def _call(op: str, ins: list[Any], outs: list[Any], in_dt: list[str], out_dt: list[str]) -> FlightEntry:
    return FlightEntry(
        record_id=1, group="0", group_desc="default_pg", seq=6, p2p_seq=None, is_p2p=False, op=op,
        backend="gloo", input_sizes=ins, output_sizes=outs, input_dtypes=in_dt, output_dtypes=out_dt,
        state="scheduled", retired=False, completed=False, frames=[], time_created_ns=None,
        timeout_ms=None, duration_ms=None,
    )  # fmt: skip


def test_rooted_calls_compare_the_side_every_rank_holds() -> None:
    """The GPU check's gather: [[2, 1048576]] outputs on the root, none on rank 1."""
    root = _call("gather", [[1048576]], [[2, 1048576]], ["Float"], ["Float"])
    other = _call("gather", [[1048576]], [], ["Float"], [])
    assert root.signature() == other.signature()
    assert _call("gather", [[8]], [], ["Float"], []).signature() != other.signature()  # a real mismatch
    assert _call("gather", [[1048576]], [], ["Double"], []).signature() != other.signature()
    scatter_root = _call("scatter", [[2, 4]], [[4]], ["Float"], ["Float"])
    assert scatter_root.signature() == _call("scatter", [], [[4]], [], ["Float"]).signature()
    # every other op compares both sides
    assert _call("all_gather", [[1]], [[2, 1]], ["Long"], ["Long"]).signature() != (
        _call("all_gather", [[1]], [], ["Long"], []).signature()
    )


def test_an_entry_keeps_its_first_twelve_python_frames_innermost_first() -> None:
    """A DeepSpeed call's entry holds ~30 frames, native ones among them: the first 12
    Python frames are kept, as labels, site-packages cut off; the rest are not read."""
    site = "/env/lib/python3.11/site-packages/"
    frames: list[Any] = [{"name": "c10d::barrier", "filename": "libtorch.so", "line": 0}]  # native: skipped
    frames += [{"name": f"f{i}", "filename": f"{site}deepspeed/m{i}.py", "line": i} for i in range(11)]
    frames += [{"name": "<module>", "filename": "/job/train.py", "line": 9}, "not a frame"]
    frames += [{"name": "late", "filename": "/job/late.py", "line": 1}, {"filename": ["no", "label"]}]
    entry = {"collective_seq_id": 1, "profiling_name": "gloo:barrier", "process_group": ["0", ""], "frames": frames}
    (read,) = parse_flight_dump({"entries": [entry]}, Path("rank-0.pickle"), 0).entries
    assert read.frames == [f"deepspeed/m{i}.py:{i} in f{i}" for i in range(11)] + ["/job/train.py:9 in <module>"]
