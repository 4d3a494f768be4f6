"""Issue 11: severity by consequence, the verdict order, and statistical findings that
survive noise (straggler persistence; rank0-asymmetry counting only what rank 0 keeps)."""

from __future__ import annotations

import copy
import random
import re
from pathlib import Path
from typing import Any

import pytest

from lorascope.detect import collective_mismatch, logits_spike, rank0_asymmetry, registry, straggler
from lorascope.detect.finding import Finding
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.ingest.load import load_bundle
from lorascope.rundir.loading.reader import Collective, RankData, RunData, recount

FIX = Path(__file__).resolve().parents[2] / "fixtures"


def finding(id: str, severity: str, confidence: str = "high") -> Finding:
    return Finding(id, "t", severity, confidence, "r", [0], [], "e", "f")  # type: ignore[arg-type]


def test_every_detector_has_a_place_in_the_verdict_order() -> None:
    assert len(registry.PRECEDENCE) == len(registry.DETECTORS) == len(registry.MODULES)


def test_issue_case_a_small_logits_share_does_not_outrank_rank0_asymmetry() -> None:
    """The issue's job: rank 0 kept gathered predictions (a warning) and the tiny model's
    logits were most of its small step: the asymmetry is the top verdict."""
    ordered = sorted(
        [finding("logits-spike", "warning"), finding("rank0-asymmetry", "warning", "medium")],
        key=registry.verdict_order,
    )
    assert [f.id for f in ordered] == ["rank0-asymmetry", "logits-spike"]


def test_errors_come_first_and_the_hang_leads_them() -> None:
    ordered = sorted(
        [
            finding("straggler", "warning"),
            finding("oom", "error"),
            finding("logits-spike", "error"),
            finding("rank-conditional-hang", "error", "medium"),
            finding("plan-deviation", "info"),
        ],
        key=registry.verdict_order,
    )
    assert [f.id for f in ordered] == ["rank-conditional-hang", "logits-spike", "oom", "straggler", "plan-deviation"]


def test_logits_spike_severity_follows_consequence() -> None:
    """The planted logits spike (187.5 MiB on a CPU job that did not run out of memory) is a
    note projecting the term to a real batch; the same logits on a rank that ran out of
    memory are an error; on a device where they take >= 10% of the memory, a warning."""
    bundle = load_bundle(FIX / "logits-spike")
    [note] = logits_spike.detect(bundle)
    assert note.severity == "info" and "lorascope plan" in note.explanation and "5.9 GiB" in note.explanation

    oom = copy.deepcopy(bundle)
    oom.run.ranks[1].exception = {"type": "OutOfMemoryError", "message": "CUDA out of memory. Tried to allocate"}
    assert logits_spike.detect(oom)[0].severity == "error"

    small_gpu = copy.deepcopy(bundle)
    small_gpu.run.ranks[0].mem.append(
        {"k": "mem", "src": "sampler", "step": 1, "t": 0.0, "rss": 1, "nvml": {"used": 2**29, "total": 2**30}}
    )
    assert logits_spike.detect(small_gpu)[0].severity == "warning"


def test_a_logits_estimate_above_the_measured_step_is_not_a_share_over_100_percent() -> None:
    """Where the estimate (3 fp32 copies, 187.5 MiB) is more than the step's heap was read
    to grow by (the fixture's readings capped at 142 MiB over their lowest: phase edges
    can miss the peak), it is said as such, never "132% of the step's memory"; a step
    measured larger (a reading past the estimate) gets its share."""
    bundle = load_bundle(FIX / "logits-spike")
    smaller = copy.deepcopy(bundle)
    for rank in smaller.run.ranks.values():
        low = min(m["heap"] for m in rank.mem if m.get("heap"))
        for m in rank.mem:
            if m.get("heap"):
                m["heap"] = min(m["heap"], low + 142 * 2**20)
    [note] = logits_spike.detect(smaller)
    text = " ".join([note.title, note.confidence_reason, *(e.value for e in note.evidence)])
    assert "more than" in note.title and "187.5 MiB estimated" in note.title
    assert all(int(percent) <= 100 for percent in re.findall(r"(\d+)%", text))
    assert "%" not in note.title and "more than all" in note.confidence_reason

    larger = copy.deepcopy(bundle)
    for rank in larger.run.ranks.values():
        heap = max(m["heap"] for m in rank.mem if m.get("heap")) + 400 * 2**20
        rank.mem.append({"k": "mem", "src": "optimizer.end", "step": 2, "t": 0.0, "rss": 1, "heap": heap})
    [shared] = logits_spike.detect(larger)
    [line] = [e for e in shared.evidence if e.label.startswith("share of the step's memory")]
    assert line.value.endswith("%") and "estimated" not in line.value and "more than" not in shared.title
    assert "% of the step's memory" in shared.confidence_reason


def test_device_at_90_percent_makes_rank0_asymmetry_an_error() -> None:
    bundle = load_bundle(FIX / "rank0-asymmetry")
    [plain] = rank0_asymmetry.detect(bundle)
    assert plain.severity == "warning"
    full = copy.deepcopy(bundle)
    full.run.ranks[0].mem.append(
        {"k": "mem", "src": "sampler", "step": 5, "t": 0.0, "rss": 1, "nvml": {"used": 93, "total": 100}}
    )
    assert rank0_asymmetry.detect(full)[0].severity == "error"


def test_rank0_asymmetry_ignores_a_transient_caught_by_the_sampler() -> None:
    """The logits-spike fixture: rank 0's background sampler caught the 62 MiB logits at
    the loss, rank 1's did not; at every phase edge both ranks read the same heap."""
    assert rank0_asymmetry.detect(load_bundle(FIX / "logits-spike")) == []
    [kept] = rank0_asymmetry.detect(load_bundle(FIX / "rank0-asymmetry"))
    assert "48.0 MiB" in kept.title and "eval" in kept.title


def _gaps_growing(edges: list[str], grows_at: str, steps: int = 4) -> list[tuple[tuple[int, str, int], float]]:
    """Rank 0's gap at each edge of ``steps`` steps: 64 MiB more from the first ``grows_at``.
    A ``step`` sample is numbered as the probes number it: the step it ends plus one."""
    out, gap = [], 0.0
    for step in range(steps):
        for edge in edges:
            if edge == grows_at and step == 1:
                gap = 64.0 * 2**20
            out.append(((step + (edge == "step"), edge, 1), gap))
    return out


CUDA_EDGES = [
    "forward.begin",
    "forward.end",
    "backward.begin",
    "backward.end",
    "optimizer.begin",
    "optimizer.end",
    "step",
]
#: A CPU rank's edges with a heap reading (RSS_ONLY_EDGES in probes/memory.py left out).
CPU_EDGES = ["forward.begin", "forward.end", "backward.begin", "optimizer.end", "step"]


@pytest.mark.parametrize(
    ("edges", "grows_at", "phase"),
    [
        (CUDA_EDGES, "optimizer.end", "optimizer"),
        (CUDA_EDGES, "backward.end", "backward"),
        (CPU_EDGES, "optimizer.end", "the backward phase or the optimizer phase"),
        (CPU_EDGES, "forward.end", "forward"),
        (CPU_EDGES, "forward.begin", "the training loop's own code between steps"),
        (["forward.begin", "forward.end", "backward.begin", "optimizer.end", "step", "eval.begin", "eval.end"],
         "forward.begin", "eval"),
    ],
)  # fmt: skip
def test_the_divergence_names_every_phase_its_interval_may_hold(edges: list[str], grows_at: str, phase: str) -> None:
    """Where rank 0 pulls away is named from the edges read on both sides of the growth; a
    CPU rank's heap skips the backward's end and the optimizer's begin, so growth there is
    named as either phase, not pinned on one."""
    point = rank0_asymmetry.divergence_point(_gaps_growing(edges, grows_at), 64.0 * 2**20)
    assert point is not None and point["phase"] == phase and point["step"] == 1


# -- straggler -------------------------------------------------------------------------


def rank_with_work(n: int, work_s: list[float], wait_s: list[float]) -> RankData:
    """A rank whose step s takes work + wait seconds, the wait in one all_reduce."""
    t, steps, colls = 100.0, [], []
    for i, (w, wait) in enumerate(zip(work_s, wait_s, strict=True)):
        colls.append(Collective(i + 1, "0", "all_reduce", 4, "float32", False, "x.py:1", i, t + w, t + w + wait))
        t += w + wait
        steps.append({"k": "step", "step": i + 1, "dur": w + wait, "t": t})
    return recount(RankData(rank=n, start={"rank": n, "pid": n, "host": "h"}, files=[], steps=steps, collectives=colls))


def run_of(*ranks: RankData) -> EvidenceBundle:
    run = RunData(path=Path("/run"), manifest={}, ranks={r.rank: r for r in ranks}, warnings=[])
    return EvidenceBundle(path=run.path, run=run)


def pair(slow: list[float], fast: list[float]) -> EvidenceBundle:
    """Rank 1 works ``slow``, rank 0 ``fast``; whoever finishes first waits for the other."""
    return run_of(
        rank_with_work(0, fast, [max(0.0, s - f) + 0.001 for s, f in zip(slow, fast, strict=True)]),
        rank_with_work(1, slow, [max(0.0, f - s) + 0.001 for s, f in zip(slow, fast, strict=True)]),
    )


def noisy(mean: float, n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [mean * rng.uniform(0.8, 1.2) for _ in range(n)]


def test_a_persistent_straggler_is_named_with_its_persistence() -> None:
    [f] = straggler.detect(pair(noisy(0.30, 12, 1), noisy(0.15, 12, 2)))
    assert f.ranks == [1] and f.severity == "warning"
    assert "in 11 of 11 steps" in f.title and f.details["ratio"] >= 1.5
    assert "noise" in f.confidence_reason


def test_a_rank_slow_for_a_few_steps_is_noise() -> None:
    slow = noisy(0.15, 12, 3)
    for s in (4, 5, 6):  # lost its core for three steps
        slow[s] *= 3
    assert straggler.detect(pair(slow, noisy(0.15, 12, 4))) == []


def test_a_small_persistent_gap_is_below_the_ratio() -> None:
    """Healthy runs here showed one rank persistently up to 1.34x the other."""
    assert straggler.detect(pair(noisy(0.20, 12, 5), [0.15] * 12)) == []


def test_too_few_steps_say_nothing() -> None:
    assert straggler.detect(pair([0.3] * 4, [0.1] * 4)) == []


@pytest.mark.parametrize("name", ["healthy", "rank0-asymmetry", "tiny-kernel-tail", "logits-spike"])
def test_recorded_runs_have_no_straggler(name: str) -> None:
    assert straggler.detect(load_bundle(FIX / name)) == []


def ddp_rank(n: int, work_s: list[float], wait_s: list[float]) -> RankData:
    """A DDP rank: no recorded collective; it waits for the gradient all_reduce inside its
    backward phase (0.05 s of backward compute plus the wait)."""
    t, steps, phases = 100.0, [], []
    for i, (w, wait) in enumerate(zip(work_s, wait_s, strict=True)):
        phases += [
            {"k": "phase", "name": "backward", "edge": "begin", "step": i, "t": t + w},
            {"k": "phase", "name": "backward", "edge": "end", "step": i, "t": t + w + 0.05 + wait},
        ]
        t += w + 0.05 + wait
        steps.append({"k": "step", "step": i + 1, "dur": w + 0.05 + wait, "t": t, "src": "torch"})
    return recount(RankData(rank=n, start={"rank": n, "pid": n, "host": "h"}, files=[], steps=steps, phases=phases))


def test_a_ddp_straggler_is_found_through_the_backward_phase() -> None:
    slow, fast = noisy(0.30, 12, 6), noisy(0.12, 12, 7)
    waits = [max(0.0, s - f) for s, f in zip(slow, fast, strict=True)]
    bundle = run_of(ddp_rank(0, fast, waits), ddp_rank(1, slow, [0.0] * 12))
    [f] = straggler.detect(bundle)
    assert f.ranks == [1] and "backward phase (DDP)" in f.evidence[0].value


def fsdp_rank(n: int, work_s: list[float], wait_s: list[float]) -> RankData:
    """An FSDP rank (plain torch loop): its recorded reduce-scatters run inside the backward
    phase (0.05 s of backward compute), where it also waits for the slower rank."""
    t, steps, phases, colls = 100.0, [], [], []
    for i, (w, wait) in enumerate(zip(work_s, wait_s, strict=True)):
        b = t + w
        phases += [
            {"k": "phase", "name": "backward", "edge": "begin", "step": i, "t": b},
            {"k": "phase", "name": "backward", "edge": "end", "step": i, "t": b + 0.05 + wait},
        ]
        colls.append(
            Collective(i + 1, "0", "reduce_scatter", 4, "float32", False, "fsdp.py:1", i, b + 0.01, b + 0.01 + wait)
        )
        t += w + 0.05 + wait
        steps.append({"k": "step", "step": i + 1, "dur": w + 0.05 + wait, "t": t, "src": "torch"})
    return RankData(
        rank=n, start={"rank": n, "pid": n, "host": "h"}, files=[], steps=steps, phases=phases, collectives=colls
    )


def test_collectives_inside_the_backward_phase_are_not_taken_out_twice() -> None:
    """Healthy FSDP1 job (issue 16): the waiting rank's reduce-scatter lies inside its backward
    phase; taking both out left it no work at all, and the other rank read as a 10^6x straggler."""
    fast, other = noisy(0.12, 12, 8), noisy(0.12, 12, 9)
    waits = [max(0.0, o - f) + 0.01 for f, o in zip(fast, other, strict=True)]
    bundle = run_of(fsdp_rank(0, fast, waits), fsdp_rank(1, other, [0.01] * 12))
    assert straggler.detect(bundle) == []
    work = straggler.step_work(bundle.run).work  # type: ignore[arg-type]
    assert all(w > 0.1 for w in work[0].values())
    # A real straggler is still one.
    slow = noisy(0.30, 12, 10)
    waits = [max(0.0, s - f) + 0.01 for f, s in zip(fast, slow, strict=True)]
    [f] = straggler.detect(run_of(fsdp_rank(0, fast, waits), fsdp_rank(1, slow, [0.01] * 12)))
    assert f.ranks == [1]


def mismatched_rank(n: int, nbytes: int, **ending: Any) -> RankData:
    """A rank whose third all_reduce, from the same line as every rank's, has its own size."""
    colls = [
        Collective(
            i + 1, "0", "all_reduce", 4 if i < 2 else nbytes, "float32", False, "t.py:9", i, 100.0 + i, 100.5 + i
        )
        for i in range(3)
    ]
    colls[-1].end = None  # the rank died in it
    rank = RankData(rank=n, start={"rank": n, "pid": n, "host": "h"}, files=[], collectives=colls, **ending)
    return recount(rank)


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_a_mismatch_names_the_rank_that_aborted_not_the_one_the_launcher_stopped(order: tuple[int, int]) -> None:
    """gloo aborts one rank (faulthandler: SIGABRT); torchrun then sends SIGTERM to the
    rest. Whichever rank number each has, the abort is how the job crashed (seen in CI: a
    loaded machine let the SIGTERM land before the other rank's own abort)."""
    aborted, stopped = order
    ranks = {
        aborted: mismatched_rank(
            aborted, 32, fatal="Fatal Python error: Aborted\n\nThread 0x1 (most recent call first):"
        ),
        stopped: mismatched_rank(stopped, 16, signal={"k": "signal", "t": 103.0, "signum": 15, "name": "SIGTERM"}),
    }
    [found] = collective_mismatch.detect(run_of(ranks[0], ranks[1]))
    assert f"it crashed the job (rank {aborted}: Fatal Python error: Aborted" in found.title
    assert "SIGTERM" not in found.title
