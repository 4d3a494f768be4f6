"""The probes in a real (single-process, gloo) torch.distributed job, in a subprocess so
that patching torch never leaks into the test process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from lorascope.detect import probes_off
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.probes.bootstrap import sitecustomize_source
from lorascope.rundir.format.writer import record_launch
from lorascope.rundir.loading.reader import load_run
from tests.helpers import free_port

JOB = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    import lorascope
    {attach}
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        loss = model(torch.ones(2, 4)).sum()
        loss.backward()
        dist.all_reduce(model.weight.grad)
        opt.step()
        opt.zero_grad()
    objs = [None]
    dist.all_gather_object(objs, {{"a": 1}})
    dist.barrier()
    dist.destroy_process_group()
    print("attached", lorascope.attach())
""")


def run_job(tmp_path: Path, attach: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "job.py"
    script.write_text(JOB.format(attach=attach, port=free_port()))
    return subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
        cwd=tmp_path,
    )


def test_attach_api_records_steps_collectives_and_memory(tmp_path: Path) -> None:
    out = tmp_path / "run"
    record_launch(out, "test", ["job.py"])
    proc = run_job(tmp_path, f"print('first', lorascope.attach({str(out)!r}))", {})
    assert proc.returncode == 0, proc.stderr
    assert "first True" in proc.stdout and "attached True" in proc.stdout  # twice is harmless
    run = load_run(out)
    rank = run.ranks[0]
    # Its stream, and its faulthandler file, empty: enabled to the end of the process, it
    # is left for `lorascope run` to remove (none runs after a job that attached itself).
    files = sorted((out / "ranks" / "rank-0").iterdir(), key=lambda f: f.suffix)
    suffixes = [".calls", ".jsonl", ".mem", ".steps", ".txt"]
    assert [f.suffix for f in files] == suffixes and files[4].name.endswith(".fatal.txt")
    assert files[4].stat().st_size == 0 and rank.fatal is None
    assert [s["step"] for s in rank.steps] == [1, 2, 3]
    assert all(s["src"] == "torch" and s["loss"] is not None for s in rank.steps)
    ops = [(c.op, c.bytes, c.seq) for c in rank.collectives]
    # all_gather_object's inner all_gather calls are not counted twice
    assert ops == [
        ("all_reduce", 16, 1),
        ("all_reduce", 16, 2),
        ("all_reduce", 16, 3),
        ("all_gather_object", None, 4),
        ("barrier", 0, 5),
    ]
    assert all(c.site and c.site.startswith(str(tmp_path / "job.py")) for c in rank.collectives)
    phases = {(p["name"], p["edge"]) for p in rank.phases}
    assert {("backward", "begin"), ("optimizer", "end")} <= phases
    assert all(m["rss"] > 0 for m in rank.mem) and len(rank.mem) >= 12
    assert rank.end is not None and rank.end["status"] == "exit"
    assert rank.probe_errors == []
    # torch was imported before attach(): the allocator probe still decided, silently
    assert rank.memory_history["on"] is False and "built without CUDA" in rank.memory_history["reason"]
    assert "allocator" not in proc.stderr


def test_bootstrap_attaches_ranks_only_and_chains_to_existing_sitecustomize(tmp_path: Path) -> None:
    out = tmp_path / "run"
    record_launch(out, "test", ["job.py"])
    boot = out / "bootstrap"
    boot.mkdir()
    (boot / "sitecustomize.py").write_text(sitecustomize_source({"run_dir": str(out), "bootstrap_dir": str(boot)}))
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import builtins\nbuiltins.THEIRS_RAN = True\n")
    # Only PYTHON* variables: the run directory comes from the bootstrap itself.
    base = {k: v for k, v in os.environ.items() if k.startswith("PYTHON")}
    base["PYTHONPATH"] = os.pathsep.join([str(boot), str(theirs), *os.environ.get("PYTHONPATH", "").split(os.pathsep)])
    code = (
        "import builtins, sys; print(getattr(builtins, 'THEIRS_RAN', False), 'lorascope.probes.attach' in sys.modules)"
    )

    def run(extra: dict[str, str], *argv: str) -> list[str]:
        res = subprocess.run([sys.executable, *argv, "-c", code], capture_output=True, text=True, env={**base, **extra})
        return res.stdout.split() + ([res.stderr] if res.returncode else [])

    assert run({}) == ["True", "False"]  # a lone process that never imports torch: nothing attached
    assert run({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}) == ["True", "True"]
    child = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LORASCOPE_ATTACHED_PID": "1"}
    assert run({**child, "LORASCOPE_ATTACHED_AS": "env:0/1"}) == ["True", "False"]  # a probed rank's child
    # A launcher imports torch and may see rank variables (`srun torchrun`): still no rank.
    launcher = [sys.executable, "-m", "torch.distributed.run", "--help"]
    res = subprocess.run(launcher, capture_output=True, env={**base, "SLURM_PROCID": "1", "SLURM_NTASKS": "2"})
    assert res.returncode == 0
    roles = [json.loads(line)["role"] for line in (boot / "processes.jsonl").read_text().splitlines()]
    assert roles == ["lone", "rank", "child", "launcher"]
    assert len(load_run(out).ranks) == 1


def test_lone_process_attaches_when_it_imports_torch(tmp_path: Path) -> None:
    """`python train.py` with no launcher and no rank variables: rank 0 of 1, with steps."""
    out = tmp_path / "run"
    record_launch(out, "test", ["job.py"])
    boot = out / "bootstrap"
    boot.mkdir()
    (boot / "sitecustomize.py").write_text(sitecustomize_source({"run_dir": str(out), "trace_window": "off"}))
    script = tmp_path / "lone.py"
    script.write_text(
        "import torch\n"
        "m = torch.nn.Linear(4, 1)\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for _ in range(3):\n"
        "    m(torch.ones(2, 4)).sum().backward()\n"
        "    opt.step()\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(boot), os.environ.get("PYTHONPATH", "")])}
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LORASCOPE_RUN_DIR"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rank = load_run(out).ranks[0]
    assert rank.start["rank_source"] == "lone" and rank.start["world_size"] == 1
    assert [s["step"] for s in rank.steps] == [1, 2, 3]
    assert rank.end is not None and rank.end["status"] == "exit"


def test_rank_from_launcher_variables_is_checked_against_torch_distributed(tmp_path: Path) -> None:
    """The probes take rank 1 of 2 from SLURM variables; the job's process group says rank
    0 of 1: the disagreement is recorded, said at run time, and the reader uses torch's."""
    out = tmp_path / "run"
    record_launch(out, "test", ["job.py"])
    proc = run_job(
        tmp_path,
        f"lorascope.attach({str(out)!r})",
        {"SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2", "RANK": "", "LOCAL_RANK": ""},
    )
    assert proc.returncode == 0, proc.stderr
    assert "probed as rank 1 of 2, but torch.distributed says rank 0 of 1" in proc.stderr
    assert (out / "ranks" / "rank-1").is_dir()
    run = load_run(out)
    assert list(run.ranks) == [0] and run.world_size == 1
    assert run.ranks[0].dist_init is not None and run.ranks[0].start["probed_as"] == [1, 2]
    assert any("probed as rank 1 of 2 (from slurm)" in w for w in run.warnings)


def test_failing_probe_switches_off_and_job_goes_on(tmp_path: Path) -> None:
    out = tmp_path / "run"
    record_launch(out, "test", ["job.py"])
    attach = (
        "from lorascope.probes.memory import MemoryProbe\n"
        "def broken(self, *args): raise OSError('planted: /proc unreadable')\n"
        "MemoryProbe._cuda = broken\n"
        f"lorascope.attach({str(out)!r})"
    )
    proc = run_job(tmp_path, attach, {})
    assert proc.returncode == 0, proc.stderr
    assert "probe 'memory' switched off" in proc.stderr
    rank = load_run(out).ranks[0]
    assert "memory" in {e["probe"] for e in rank.probe_errors}
    assert all("planted" in e["error"] for e in rank.probe_errors)
    assert len(rank.steps) == 3 and len(rank.collectives) == 5  # the other probes go on
    # and `analyze` says what is missing instead of a clean bill
    (off,) = probes_off.detect(EvidenceBundle(path=out, run=load_run(out)))
    assert off.ranks == [0] and off.severity == "warning" and off.title.startswith("the memory probe switched off")


GROUPS_JOB = textwrap.dedent("""
    import gc, weakref, torch, torch.distributed as dist
    import lorascope
    lorascope.attach({out!r})
    for port in ({port}, {port2}):  # a second process group after the first is destroyed
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=0, world_size=1)
        sub = dist.new_group([0])
        dist.all_reduce(torch.ones(2))
        dist.all_reduce(torch.ones(2), group=sub)
        refs = [weakref.ref(dist.group.WORLD), weakref.ref(sub)]
        del sub
        dist.destroy_process_group()
        gc.collect()
        print("alive", sum(r() is not None for r in refs))
""")


def test_process_groups_are_not_kept_alive_past_the_jobs_destroy(tmp_path: Path) -> None:
    """A group the probes held would be destroyed in the interpreter's teardown instead,
    where gloo can abort the process after a finished job (CI saw it once)."""
    out = tmp_path / "run"
    record_launch(out, "test", ["job.py"])
    script = tmp_path / "job.py"
    script.write_text(GROUPS_JOB.format(out=str(out), port=free_port(), port2=free_port()))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["alive 0", "alive 0"], proc.stdout
    # Each group made is its own group (its own record), its calls numbered from 1.
    records = [json.loads(line) for p in (out / "ranks" / "rank-0").glob("*.jsonl") for line in p.open()]
    assert len({r["gid"] for r in records if r["k"] == "group"}) == 4
    assert sorted((c.op, c.seq) for c in load_run(out).ranks[0].collectives) == [("all_reduce", 1)] * 4


TRAINER_JOB = textwrap.dedent("""
    import os, torch
    import lorascope
    lorascope.attach({out!r})
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    model = LlamaForCausalLM(config)
    rows = [{{"input_ids": torch.arange(8) % 64, "labels": torch.arange(8) % 64}} for _ in range(8)]
    kept = []
    def compute_metrics(pred):
        kept.append(pred.predictions)  # the gathered logits, kept (the issue's eval growth)
        return {{"n": len(kept)}}
    args = TrainingArguments(output_dir={tmp!r}, use_cpu=True, per_device_train_batch_size=4,
                             per_device_eval_batch_size=4, max_steps=2, report_to=[], save_strategy="no",
                             logging_strategy="no", eval_strategy="steps", eval_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=rows, eval_dataset=rows,
                      compute_metrics=compute_metrics)
    trainer.train()
    print("evaluated", len(kept))
""")


def test_trainer_evaluation_is_an_eval_phase(tmp_path: Path) -> None:
    """Issue 11: a rank-0 growth in compute_metrics was placed "between step and
    forward.begin": the Trainer's evaluation (which under DDP runs the unwrapped model)
    had no phase edges. evaluate() is now an eval phase, gathering and metrics included."""
    out = tmp_path / "run"
    record_launch(out, "test", ["job.py"])
    script = tmp_path / "job.py"
    script.write_text(TRAINER_JOB.format(out=str(out), tmp=str(tmp_path / "trainer")))
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=os.environ
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "evaluated 2" in proc.stdout
    phases = [(p["name"], p["edge"], p["step"]) for p in load_run(out).ranks[0].phases]
    evals = [p for p in phases if p[0] == "eval"]
    assert evals[:2] == [("eval", "begin", 1), ("eval", "end", 1)] and len(evals) == 4, phases


def test_a_cuda_rank_reads_the_heap_only_from_the_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    """Phase edges on a CUDA rank take the allocator's counters, not mallinfo2 (which
    walks every free chunk); the background sampler still reads the host heap."""
    from lorascope.probes import memory

    probe = memory.MemoryProbe.__new__(memory.MemoryProbe)
    probe.session = types.SimpleNamespace(heap_ns=0, heap_reads=0)  # type: ignore[assignment]
    probe._rss = lambda: 1
    probe._nvml = lambda: None
    calls: list[int] = []
    monkeypatch.setattr(memory, "heap_in_use", lambda: calls.append(1) or 5)
    probe._cuda = lambda from_main_thread: {"device": 0, "alloc": 7, "reserved": 8, "max_alloc": 9}  # type: ignore[method-assign]
    assert "heap" not in probe.reading(from_main_thread=True) and not calls
    assert probe.reading(from_main_thread=False)["heap"] == 5 and calls == [1]
    probe._cuda = lambda from_main_thread: None  # type: ignore[method-assign]
    assert probe.reading(from_main_thread=True)["heap"] == 5 and calls == [1, 1]
    assert "heap" not in probe.reading(from_main_thread=True, heap=False) and calls == [1, 1]
    # the job's cost counts the training thread's reading, not the sampler's
    assert probe.session.heap_reads == 1 and probe.session.heap_ns > 0


def test_a_step_ending_at_the_optimizer_reads_memory_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step's end takes the reading the optimizer's end edge took a moment before
    (each costs a mallinfo2 walk): one reading, recorded for both. The optimizer's begin is
    read without the heap (RSS_ONLY_EDGES)."""
    from lorascope.probes import memory
    from lorascope.probes.session import Session
    from lorascope.rundir.format.writer import Stream
    from tests.helpers import mem_records, step_probe

    stream = Stream(tmp_path / "r" / "s")
    session = Session(stream, rank=0, local_rank=0, world_size=1, sample_interval=0)
    mem = memory.MemoryProbe(session)
    readings = iter(range(1, 100))
    monkeypatch.setattr(mem, "reading", lambda from_main_thread=True, heap=True: {"rss": next(readings), "heap": heap})
    steps = step_probe(session, mem, tmp_path / "k")
    for _ in range(2):
        steps.phase("forward", "begin")
        steps._optimizer_begin()
        steps._optimizer_end()
    stream.close()
    got = [(m["src"], m["rss"], m["heap"]) for m in mem_records(tmp_path / "r")]
    assert got == [
        ("forward.begin", 1, True), ("optimizer.begin", 2, False), ("optimizer.end", 3, True), ("step", 3, True),
        ("forward.begin", 4, True), ("optimizer.begin", 5, False), ("optimizer.end", 6, True), ("step", 6, True),
    ]  # fmt: skip


DDP_JOB = textwrap.dedent("""
    import torch, torch.distributed as dist
    import lorascope
    lorascope.attach({out!r})
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2), find_unused_parameters=True)
    model(torch.ones(3, 4)).sum().backward()
    dist.destroy_process_group()
""")


def test_ddp_settings_are_recorded(tmp_path: Path) -> None:
    """plan-deviation reads DDP's copy of the outputs (find_unused_parameters) from them."""
    out = tmp_path / "run"
    record_launch(out, "test", ["job.py"])
    script = tmp_path / "job.py"
    script.write_text(DDP_JOB.format(out=str(out), port=free_port()))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ddp = load_run(out).ranks[0].configs["ddp"]
    assert ddp["find_unused_parameters"] is True and ddp["static_graph"] is False and ddp["sink_clone"] is True
    assert ddp["bucket_bytes_cap"] == 25 * 2**20  # torch's default bucket_cap_mb


def test_allocator_counters_read_once_or_fall_back() -> None:
    """The CUDA counters come from one read of the allocator's nested statistics (torch's
    ``memory_stats_as_nested_dict`` form); where that is missing or shaped otherwise, from
    the public flattened ``memory_stats``."""
    from types import SimpleNamespace

    from lorascope.probes.memory import _allocator_counters

    nested = {"allocated_bytes": {"all": {"current": 5, "peak": 9}}, "reserved_bytes": {"all": {"current": 8}}}
    flat = {"allocated_bytes.all.current": 6, "reserved_bytes.all.current": 7, "allocated_bytes.all.peak": 10}
    calls: list[int] = []

    def stats(dev: int) -> dict[str, object]:
        calls.append(dev)
        return nested

    cuda = SimpleNamespace(memory_stats=lambda dev: flat)
    fake = SimpleNamespace(_C=SimpleNamespace(_cuda_memoryStats=stats), cuda=cuda)
    assert _allocator_counters(fake, 1) == {"alloc": 5, "reserved": 8, "max_alloc": 9} and calls == [1]
    assert _allocator_counters(SimpleNamespace(_C=SimpleNamespace(), cuda=cuda), 0) == {
        "alloc": 6,
        "reserved": 7,
        "max_alloc": 10,
    }
    odd = SimpleNamespace(_C=SimpleNamespace(_cuda_memoryStats=lambda dev: {}), cuda=cuda)
    assert _allocator_counters(odd, 0)["alloc"] == 6
