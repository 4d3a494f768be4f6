"""`lorascope run` on the real 2-rank DeepSpeed + PEFT LoRA job (CPU, gloo)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lorascope.rundir.loading.reader import load_run
from tests.helpers import (
    LORASCOPE,
    TRAIN,
    Finished,
    free_port,
    job_env,
    losses,
    probed,
    rerun_if_teardown_abort,
    torchrun,
)

pytestmark = pytest.mark.e2e


def assert_complete_two_rank_run(fin: Finished, steps: int) -> None:
    assert fin.proc.returncode == 0, fin.proc.stderr[-3000:]
    assert f"lorascope: recording to {fin.out}" in fin.proc.stderr
    run = load_run(fin.out)
    assert sorted(run.ranks) == [0, 1] and run.world_size == 2
    for rank in run.ranks.values():
        assert rank.files, "each rank has its stream"
        assert [s["step"] for s in rank.steps] == list(range(1, steps + 1))
        assert all(s["src"] == "deepspeed" and s["dur"] > 0 for s in rank.steps)
        assert rank.mem and all(m["rss"] > 0 for m in rank.mem)
        assert {"deepspeed", "lora", "model"} <= set(rank.configs)
        assert rank.end == {**rank.end, "status": "exit", "code": 0}
        assert rank.probe_errors == []
        assert all(not c.pending and c.err is None for c in rank.collectives)
        # allocator history needs CUDA: off, silently, with the reason (no snapshot files)
        assert rank.memory_history == {**rank.memory_history, "on": False}
        assert "built without CUDA" in rank.memory_history["reason"] and rank.snapshots == []
    seqs = [[(c.group, c.op, c.bytes) for c in r.collectives] for r in run.ranks.values()]
    assert len(seqs[0]) > 10 * steps and seqs[0] == seqs[1], "ranks issue the same collectives in order"
    manifest = json.loads((fin.out / "manifest.json").read_text())
    assert {v["pid"] for v in manifest["ranks"].values()} == {r.pid for r in run.ranks.values()}
    assert manifest["launches"][0]["exit_status"] == 0


def test_torchrun_job_is_fully_recorded(torchrun_run: Finished) -> None:
    assert_complete_two_rank_run(torchrun_run, steps=20)
    summary = torchrun_run.summary()
    assert [r["steps"] for r in summary["ranks"]] == [20, 20]
    assert summary["manifest"]["configs"]["deepspeed"]["zero_optimization"]["stage"] == 3
    assert summary["manifest"]["versions"]["torch"].startswith("2.")
    # no summary table at the end of the run: `lorascope analyze` prints it (it printed twice)
    assert "world size 2" not in torchrun_run.proc.stderr
    assert f"lorascope analyze {torchrun_run.out}" in torchrun_run.proc.stderr
    # The healthy job raises no warning and no error (notes are allowed): 20 steps, past
    # the C heap's dense readings (test_detectors' healthy 8-step run is marked slow).
    assert not [f["title"] for f in summary["findings"] if f["severity"] != "info"], summary["findings"]


def test_what_the_probes_cost_is_measured_in_the_job(torchrun_run: Finished) -> None:
    """Each rank's cost records (step 1, the end): its threads' time in probe code a
    step, within the step, the C heap readings (four a step on this CPU job: the forward's
    begin and end, the backward's begin, the optimizer's end; and the logits probe's two
    around the second step's loss) and the kernel window (the default 5:2) apart."""
    summary = torchrun_run.summary()
    for rank in summary["ranks"]:
        cost = rank["probe_cost"]
        assert cost is not None and cost["steps"] == 19
        step_ms = rank["step_time_median_s"] * 1000
        assert 0 < cost["heap_ms_per_step"] < cost["job_ms_per_step"] < step_ms / 4
        assert cost["heap_reads_per_step"] == round(4 + 2 / 19, 2)
        assert cost["trace_window_ms"] > 0 and cost["threads_cpu_ms_per_step"] > 0
    assert summary["probe_cost"]["ranks"] == 2


def test_losses_are_identical_with_and_without_probes(torchrun_run: Finished, bare_losses: list[str]) -> None:
    assert len(bare_losses) == 20
    assert losses(torchrun_run.proc.stdout) == bare_losses
    last = load_run(torchrun_run.out).ranks[0].steps[-1]["loss"]
    assert repr(last) == bare_losses[-1]


def test_failing_probes_leave_the_job_unchanged(tmp_path: Path, bare_losses: list[str]) -> None:
    """Rank 1 cannot write its stream (its directory is taken by a file) and the memory
    probe raises inside rank 0 (planted by the job's own sitecustomize, which lorascope
    chains to): the job finishes, its losses unchanged, the failures recorded."""
    out = tmp_path / "run"
    (out / "ranks").mkdir(parents=True)
    (out / "ranks" / "rank-1").write_text("not a directory")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text(
        "from lorascope.probes.memory import MemoryProbe\n"
        "def broken(self, *args): raise RuntimeError('planted failure')\n"
        "MemoryProbe._cuda = broken\n"
    )
    proc = subprocess.run(
        [*LORASCOPE, "run", "--out", str(out), "--", *torchrun(free_port(), "--steps", "20", "--print-losses")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**job_env(), "PYTHONPATH": str(theirs)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert losses(proc.stdout) == bare_losses
    assert "probes off in pid" in (out / "probe-errors.log").read_text()
    run = load_run(out)
    assert sorted(run.ranks) == [0] and any("ranks [1] wrote no stream" in w for w in run.warnings)
    rank0 = run.ranks[0]
    # the memory probe, and the logits probe that takes its readings, switched off
    assert "memory" in {e["probe"] for e in rank0.probe_errors}
    assert all("planted failure" in e["error"] for e in rank0.probe_errors)
    assert len(rank0.steps) == 20 and rank0.collectives


def test_deepspeed_launcher_job_is_fully_recorded(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        TRAIN,
        "--steps",
        "6",
    ]
    assert_complete_two_rank_run(probed(tmp_path / "run", cmd), steps=6)


def test_plain_torch_loop_is_recorded(tmp_path: Path) -> None:
    fin = probed(tmp_path / "run", torchrun(free_port(), "--steps", "5", "--engine", "torch"), "--no-memory-history")
    assert fin.proc.returncode == 0, fin.proc.stderr[-3000:]
    for rank in load_run(fin.out).ranks.values():
        assert rank.memory_history["on"] is False and "switched off" in rank.memory_history["reason"]
        assert [s["src"] for s in rank.steps] == ["torch"] * 5
        assert all(s["loss"] is not None for s in rank.steps)
        assert {p["name"] for p in rank.phases} == {"forward", "backward", "optimizer"}
        # DDP's bucketed gradient all-reduce runs in its C++ Reducer, out of Python's sight;
        # the job's own collectives are seen.
        assert [c.op for c in rank.collectives] == ["barrier"]


def test_two_node_launch_makes_one_run(tmp_path: Path) -> None:
    out = tmp_path / "run"

    def launch(node: int, port: int) -> subprocess.Popen[str]:
        cmd = ["--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "1", "--master_addr", "127.0.0.1"]
        return subprocess.Popen(
            [
                *LORASCOPE,
                "run",
                "--out",
                str(out),
                "--",
                sys.executable,
                "-m",
                "torch.distributed.run",
                *cmd,
                "--master_port",
                str(port),
                TRAIN,
                "--steps",
                "4",
            ],  # fmt: skip
            env=job_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def both() -> list[tuple[int | None, str]]:
        port = free_port()
        procs = [launch(node, port) for node in (0, 1)]
        errs = [proc.communicate(timeout=300)[1] for proc in procs]
        return [(proc.returncode, err) for proc, err in zip(procs, errs, strict=True)]

    for rc, err in rerun_if_teardown_abort(out, both, lambda ended: any(rc for rc, _ in ended)):
        assert rc == 0, err[-3000:]
    summary = Finished(out, subprocess.CompletedProcess([], 0)).summary()
    assert summary["manifest"]["world_size"] == 2
    assert len(summary["manifest"]["launches"]) == 2
    assert [r["steps"] for r in summary["ranks"]] == [4, 4]
    assert summary["warnings"] == []


def _wait_for_steps(run_dir: Path, rank: int, steps: int, deadline: float) -> int:
    """The pid of ``rank`` once its stream shows ``steps`` finished steps."""
    while time.time() < deadline:
        try:
            data = load_run(run_dir).ranks.get(rank)
        except Exception:
            data = None
        if data is not None and len(data.steps) >= steps:
            return data.pid
        time.sleep(0.5)
    raise AssertionError(f"rank {rank} did not reach step {steps}")


def test_sigkilled_rank_is_read_up_to_its_last_record(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [*LORASCOPE, "run", "--out", str(out), "--", *torchrun(free_port(), "--steps", "500")],
        env=job_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pid = _wait_for_steps(out, 1, 3, time.time() + 240)
    os.kill(pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    run = load_run(out)
    killed = run.ranks[1]
    assert len(killed.steps) >= 3 and killed.end is None and killed.exception is None
    assert killed.collectives and killed.mem
    summary = Finished(out, subprocess.CompletedProcess([], 0)).summary()
    assert summary["ranks"][1]["ended"]["status"] == "unknown"
    text = subprocess.run([*LORASCOPE, "analyze", str(out)], capture_output=True, text=True, timeout=120)
    assert "no end record" in text.stdout


def test_crashing_rank_records_its_exception_and_warnings(tmp_path: Path) -> None:
    """The planted reentrant-checkpointing fault makes backward fail: each rank's stream
    holds the exception text and the warning that explains it, written before exit."""
    fin = probed(tmp_path / "run", torchrun(free_port(), "--steps", "3", "--fault", "reentrant-dead-grads"))
    assert fin.proc.returncode == 1
    for rank in load_run(fin.out).ranks.values():
        assert rank.exception is not None and "loss must be a scalar" in rank.exception["message"]
        assert "Traceback" in rank.exception["traceback"]
        assert rank.end is not None and rank.end["status"] == "exception"
        assert any("None of the inputs have requires_grad=True" in w["message"] for w in rank.warnings)


def test_kernel_window_is_what_hta_expects(torchrun_run: Finished, tmp_path: Path) -> None:
    """The default window (steps 6-7) is recorded on a profiler schedule: ProfilerStep#N
    ranges numbered as the job's steps, lorascope's module ranges inside; HTA reads the
    ranks' windows and finds the iterations (its temporal breakdown needs GPU kernels:
    benchmarks/gpu_check.sh runs it on a GPU window)."""
    import gzip
    import logging
    import shutil

    run = load_run(torchrun_run.out)
    for n, rank in run.ranks.items():
        [trace] = rank.trace_files
        names = {str(e.get("name", "")) for e in json.load(gzip.open(trace))["traceEvents"]}
        assert {"ProfilerStep#6", "ProfilerStep#7"} <= names and "ProfilerStep#5" not in names
        assert any(x.startswith("lorascope.module::") and "lora_A" in x for x in names)
        shutil.copy(trace, tmp_path / f"rank-{n}.json.gz")
    hta = pytest.importorskip("hta.trace_analysis", reason="HolisticTraceAnalysis is in the analysis extra")
    logging.disable(logging.WARNING)
    try:
        analysis = hta.TraceAnalysis(trace_dir=str(tmp_path))
        assert sorted(analysis.t.traces) == [0, 1]
        assert 6 in set(analysis.t.get_trace(0)["iteration"].tolist())
    finally:
        logging.disable(logging.NOTSET)
