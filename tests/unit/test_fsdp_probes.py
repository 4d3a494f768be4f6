"""The FSDP side of the probes in a real single-process gloo job (a subprocess, so that
patching torch never leaks into the test process): the c10d functions FSDP calls
(``all_gather_single``, ``reduce_scatter_single``), the functional collectives (a full
state dict's) and their completion at ``wait_tensor``, ``via`` for a save helper of the
job's own called under a rank condition, FSDP2's and FSDP1's settings, torch's checkpoint
wrappers, and the ``coll_unseen`` record of DDP's Reducer. On one rank FSDP2 and a full
state dict skip their collectives: the 2-rank jobs are in tests/e2e/test_fsdp.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lorascope.analysis.summary import build_summary
from lorascope.rundir.format.writer import record_launch
from lorascope.rundir.loading.reader import RankData, load_run
from lorascope.text.summary import render_text, sharding_text
from tests.helpers import free_port

JOB = textwrap.dedent("""
    import functools, gc, torch, torch.distributed as dist
    import lorascope
    lorascope.attach({out!r})
    from torch.distributed._functional_collectives import all_gather_single, wait_tensor
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecisionPolicy, fully_shard

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
    rank = dist.get_rank()


    def save(tensors):
        return [all_gather_single(t, 0, dist.group.WORLD).wait() for t in tensors]


    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        model[0].weight.requires_grad_(False)  # a frozen base next to trainable weights
        return model


    model = build()
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT),
        check_fn=lambda m: m is model[2],
    )
    mesh = init_device_mesh("cpu", (1,))
    fully_shard(model[2], mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for step in range(2):
        model(torch.ones(2, 8, requires_grad=True)).float().sum().backward()
        opt.step()
        opt.zero_grad()
    out = torch.zeros(4)
    dist.all_gather_single(out, torch.ones(4))  # FSDP2's all-gather and reduce-scatter
    dist.reduce_scatter_single(torch.zeros(4), out)
    dist.all_gather_into_tensor(out, torch.ones(4))  # the old name calls the new: one record
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        state = save([torch.ones(2), torch.ones(3)])  # the helper's collectives name this line as their via
    lost = all_gather_single(torch.ones(3), 0, dist.group.WORLD)  # never waited for
    del lost
    gc.collect()

    fsdp1 = FullyShardedDataParallel(
        build(), auto_wrap_policy=lambda module, recurse, nonwrapped_numel: recurse or isinstance(module, torch.nn.Linear),
        device_id=torch.device("cpu"), use_orig_params=True)
    fsdp1(torch.ones(2, 8)).sum().backward()

    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    dist.destroy_process_group()
    from torch.distributed.tensor import _collective_utils  # bound c10d's at its import
    print("done", getattr(_collective_utils.broadcast, "__lorascope__", False))
""")


@pytest.fixture(scope="module")
def fsdp_rank(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, RankData]:
    root = tmp_path_factory.mktemp("fsdp")
    out = root / "run"
    record_launch(out, "test", ["job.py"])
    script = root / "job.py"
    script.write_text(JOB.format(out=str(out), port=free_port()))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, env=env, cwd=root)
    # DTensor's module imports broadcast/scatter from distributed_c10d: the wrapped ones
    assert proc.returncode == 0 and "done True" in proc.stdout, proc.stderr[-3000:]
    return script, load_run(out).ranks[0]


def _line(script: Path, site: str | None) -> str:
    assert site is not None and site.startswith(f"{script}:"), site
    return script.read_text().splitlines()[int(site.split(":")[1].split()[0]) - 1].strip()


def test_fsdp_c10d_collectives_are_recorded_with_their_call_sites(fsdp_rank: tuple[Path, RankData]) -> None:
    script, rank = fsdp_rank
    ops = [c.op for c in rank.collectives]
    assert ops[:3] == ["all_gather_single", "reduce_scatter_single", "all_gather_into_tensor"], ops
    for call in rank.collectives:
        assert call.end is not None and call.err is None, call
    assert [_line(script, c.site)[:28] for c in rank.collectives[:3]] == [
        "dist.all_gather_single(out, ",
        "dist.reduce_scatter_single(t",
        "dist.all_gather_into_tensor(",
    ]
    assert ops[-2:] == ["all_reduce", "all_reduce"]  # FSDP1 NO_SHARD's gradient all_reduce per unit


def test_full_state_dict_funcol_calls_end_at_their_wait_and_name_the_rank_condition(
    fsdp_rank: tuple[Path, RankData],
) -> None:
    script, rank = fsdp_rank
    funcol = [c for c in rank.collectives if c.op == "funcol.all_gather_single"]
    saved, lost = funcol[:-1], funcol[-1]
    assert len(saved) == 2 and all(c.is_async for c in funcol)
    for call in saved:
        assert _line(script, call.site).startswith("return [all_gather_single(t, 0")
        assert _line(script, call.via).startswith("state = save([torch.ones(2)")
        assert call.end is not None and call.end >= call.start and call.err is None
    assert lost.end is not None and lost.via is None  # ended when its output was freed
    assert _line(script, lost.site).startswith("lost = all_gather_single")


def test_fsdp_settings_and_checkpoint_wrappers_are_recorded(fsdp_rank: tuple[Path, RankData]) -> None:
    _, rank = fsdp_rank
    # FSDP2's root marks the forward phases; get_model_state_dict is a save phase
    forwards = [(p["edge"], p["step"]) for p in rank.phases if p["name"] == "forward"]
    assert forwards == [("begin", 0), ("end", 0), ("begin", 1), ("end", 1)]
    assert [(p["name"], p["edge"], p["step"]) for p in rank.phases if p["name"] == "save"] == [
        ("save", "begin", 2),
        ("save", "end", 2),
    ]
    fsdp = rank.configs["fsdp"]  # FSDP1 came last: the reader keeps the last record
    assert fsdp["version"] == 1 and fsdp["units"] == 3 and fsdp["use_orig_params"] is True
    assert fsdp["sharding_strategy"] == "NO_SHARD"  # FSDP1's own choice on one rank
    assert rank.grad_setup is not None
    assert rank.grad_setup["checkpointing"] == {"enabled": True, "use_reentrant": [True], "wrappers": 1}


def test_fsdp2_settings_record_each_unit(fsdp_rank: tuple[Path, RankData]) -> None:
    _, rank = fsdp_rank
    [stream] = Path(rank.files[0]).parent.glob("*.0000.jsonl")
    records = [json.loads(line) for line in stream.read_text().splitlines()]
    fsdp2 = [r["value"] for r in records if r["k"] == "config" and r["name"] == "fsdp" and r["value"]["version"] == 2]
    assert [v["units"] for v in fsdp2] == [1, 2]
    last = fsdp2[-1]
    assert last["mesh"] == [{"shape": [1], "dim_names": None, "device": "cpu"}]
    assert last["reshard_after_forward"] == [None, False]
    assert last["mixed_precision"][0]["param_dtype"] == "bfloat16" and last["mixed_precision"][1] is None
    assert last["offload"] == [None]
    assert last["by_unit"] == [
        {
            "module": "Linear (checkpointed)",
            "root": False,
            "reshard_after_forward": None,
            "mixed_precision": last["mixed_precision"][0],
            "param_dtypes": ["float32"],
            "count": 1,
        },
        {
            "module": "Sequential",
            "root": True,
            "reshard_after_forward": False,
            "mixed_precision": None,
            "param_dtypes": ["float32"],
            "count": 1,
        },
    ]


def test_the_fsdp2_summary_names_each_units_setting_and_the_parameters_precision() -> None:
    """It read "reshard after forward None | False" (one value per unit, unnamed) and "full
    precision" where the Trainer computed in bf16 (autocast: no MixedPrecisionPolicy)."""
    by_unit = [
        {
            "module": "Linear (checkpointed)",
            "root": False,
            "reshard_after_forward": None,
            "count": 1,
            "param_dtypes": ["float32"],
            "mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": None},
        },
        {
            "module": "Sequential",
            "root": True,
            "reshard_after_forward": False,
            "count": 1,
            "param_dtypes": ["float32"],
            "mixed_precision": None,
        },
    ]
    settings = {"version": 2, "units": 2, "mesh": [None], "offload": [None], "by_unit": by_unit}
    text = sharding_text({"engine": "FSDP2", "settings": settings, "checkpointing": None})
    assert "1 Linear (checkpointed): reshard after forward default (reshards; the root keeps its parameters), " in text
    assert "mixed precision bfloat16 param, parameters float32" in text
    assert "1 Sequential (root): reshard after forward False, no MixedPrecisionPolicy, parameters float32" in text
    assert "full precision" not in text and "None | False" not in text
    plain = [{**by_unit[1], "root": False}]
    autocast = sharding_text(
        {
            "engine": "FSDP2",
            "settings": {**settings, "by_unit": plain, "trainer_precision": "bf16"},
            "checkpointing": None,
        }
    )
    assert autocast.endswith("the Trainer's bf16 is autocast: computed in bf16, the parameters stay as stored")


def test_ddp_reducer_is_said_unseen_and_the_summary_shows_it(fsdp_rank: tuple[Path, RankData]) -> None:
    _, rank = fsdp_rank
    assert [u["path"] for u in rank.unseen_collectives] == ["ddp-reducer"]
    run = load_run(Path(rank.files[0]).parents[2])
    summary = build_summary(run)
    assert summary["manifest"]["sharding"]["engine"] == "FSDP1"
    text = render_text(summary)
    assert "sharding: FSDP1 NO_SHARD, 3 units" in text and "activation checkpointing reentrant" in text
    assert "not recorded: DistributedDataParallel's gradient bucket all_reduces" in text
    assert "flight-recorder dump" in text
