"""A CPU rank's training thread reads the C heap at every edge of its first steps, then
at those of every HEAP_EVERY-th step (probes/memory.py), and rank0-asymmetry reads such
a run: a gap held from one step on is found at full size, a steady growth in one phase is
still named, and a one-off growth in a step not read is placed between the steps read
around it, with no phase named."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lorascope.detect import rank0_asymmetry
from lorascope.detect.common import HEAP_IN_USE, RSS
from lorascope.ingest.evidence import EvidenceBundle
from lorascope.probes import memory
from lorascope.probes.session import Session
from lorascope.report import memory as report_memory
from lorascope.rundir.format.writer import Stream
from lorascope.rundir.loading.reader import RankData, RunData
from tests.helpers import mem_records, step_probe

MiB = 2**20
BASE = 900 * MiB
KEPT = 512 * MiB


def probed_loop(
    tmp_path: Path, rank: int, steps: int, held: Callable[[int, str], int], evals: tuple[int, ...] = ()
) -> list[dict[str, Any]]:
    """The ``mem`` records the real step probe writes for ``steps`` iterations of a plain
    torch loop (forward, backward, optimizer) and an eval after the steps in ``evals``;
    ``held(step, where)`` is what rank 0 holds beyond the others when the heap is read at
    ``where`` ("forward" inside the forward, "loop" between the optimizer and the next
    forward), as the job's code runs."""
    stream = Stream(tmp_path / f"rank{rank}" / "s")
    session = Session(stream, rank=rank, local_rank=rank, world_size=2, sample_interval=0)
    mem = memory.MemoryProbe(session)
    where = ["loop"]

    def reading(from_main_thread: bool = True, heap: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {"rss": 2 * BASE}
        value = BASE + (held(session.step, where[0]) if rank == 0 else 0)  # the job's memory, read or not
        if heap:
            out["heap"] = value
        return out

    mem.reading = reading  # type: ignore[method-assign]
    probe = step_probe(session, mem, tmp_path / "k")
    for step in range(steps):
        where[0] = "loop"
        probe.phase("forward", "begin")
        where[0] = "forward"
        probe.phase("forward", "end")
        where[0] = "loop"
        probe.phase("backward", "begin")
        probe.phase("backward", "end")
        probe._optimizer_begin()
        probe._optimizer_end()
        if step in evals:
            probe.phase("eval", "begin")
            where[0] = "eval"
            probe.phase("eval", "end")
    stream.close()
    return mem_records(tmp_path / f"rank{rank}")


def kept_from_forward_of(at: int) -> Callable[[int, str], int]:
    """Rank 0 keeps KEPT from the forward of step ``at`` on."""
    kept: list[bool] = []

    def held(step: int, where: str) -> int:
        if step == at and where == "forward":
            kept.append(True)
        return KEPT if kept else 0

    return held


def growing_in_each_forward(each: int) -> Callable[[int, str], int]:
    """Rank 0 keeps ``each`` more in every step's forward."""
    forwards: set[int] = set()

    def held(step: int, where: str) -> int:
        if where == "forward":
            forwards.add(step)
        return each * len(forwards)

    return held


def run_of(tmp_path: Path, steps: int, held: Callable[[int, str], int], evals: tuple[int, ...] = ()) -> EvidenceBundle:
    ranks = {
        n: RankData(
            rank=n, start={"rank": n, "pid": n, "host": "h"}, files=[], mem=probed_loop(tmp_path, n, steps, held, evals)
        )
        for n in (0, 1)
    }
    run = RunData(path=tmp_path, manifest={}, ranks=ranks, warnings=[])
    return EvidenceBundle(path=tmp_path, run=run)


def test_the_heap_is_read_at_every_edge_of_the_first_steps_then_every_tenth_step(tmp_path: Path) -> None:
    mem = probed_loop(tmp_path, 1, 45, lambda step, where: 0, evals=(33,))
    read = {(m["step"] - (m["src"] == "step"), m["src"]) for m in mem if "heap" in m}
    unread = {(m["step"] - (m["src"] == "step"), m["src"]) for m in mem if "heap" not in m}
    every = {"forward.begin", "forward.end", "backward.begin", "optimizer.end", "step"}
    for iteration in range(45):
        edges = {src for it, src in read if it == iteration} - {"eval.begin", "eval.end"}
        dense = iteration < memory.HEAP_DENSE_STEPS or iteration % memory.HEAP_EVERY == 0 or iteration == 34
        before_one = (iteration + 1) % memory.HEAP_EVERY == 0  # its end: the loop's code before a step read
        assert edges == (every if dense else {"optimizer.end", "step"} if before_one else set()), iteration
    assert {src for _, src in unread} >= memory.RSS_ONLY_EDGES
    # a phase outside the loop is always read, and so is the step after it (34: the eval
    # ran after 34 steps)
    assert not {src for _, src in unread} & {"eval.begin", "eval.end"}
    assert all("rss" in m for m in mem)  # RSS with every reading
    # the steps between the ones read are not written at all: RSS (read at every edge)
    # passes no peak there, flat in this loop
    between = {
        it for it in range(45) if not (it < memory.HEAP_DENSE_STEPS or it % memory.HEAP_EVERY in (0, 9) or it == 34)
    }
    assert between and not {it for it, _ in read | unread} & between


def test_between_the_steps_read_a_new_peak_is_written(tmp_path: Path) -> None:
    """RSS read at every edge: on a step between the ones read in full, the reading that
    passes every one before it is written (a peak is never lost), the others are not."""
    stream = Stream(tmp_path / "rank0" / "s")
    session = Session(stream, rank=0, local_rank=0, world_size=1, sample_interval=0)
    mem = memory.MemoryProbe(session)
    rss = {"now": BASE}
    mem.reading = lambda from_main_thread=True, heap=True: {"rss": rss["now"]}  # type: ignore[method-assign]
    probe = step_probe(session, mem, tmp_path / "k")
    for step in range(40):
        rss["now"] = BASE + (KEPT if step == 25 else 0)  # one step's forward holds more
        probe.phase("forward", "begin")
        probe.phase("forward", "end")
        probe._optimizer_begin()
        probe._optimizer_end()
    stream.close()
    # by iteration (a step record carries the number of the step it ends, plus one)
    written = [(m["step"] - (m["src"] == "step"), m["src"]) for m in mem_records(tmp_path / "rank0")]
    off_steps = {step for step, _ in written if 20 < step < 29}
    assert off_steps == {25} and (25, "forward.begin") in written
    assert [m for m in written if m[0] == 25] == [(25, "forward.begin")]  # the rest of step 25 is no higher


def test_a_gap_held_from_a_step_not_read_is_found_whole_and_placed_between_steps_read(tmp_path: Path) -> None:
    """Rank 0 keeps KEPT from the forward of step 33 on (a step whose heap is not read)."""
    bundle = run_of(tmp_path, 60, kept_from_forward_of(33))
    [finding] = rank0_asymmetry.detect(bundle)
    assert "512.0 MiB" in finding.title and "pulled away in" not in finding.title
    point = finding.details["divergence"]
    assert point["phase"] is None and point["unread"] == [31, 38] and point["since"] == 31 and point["step"] == 39
    assert finding.confidence == "medium"
    [pulled] = [e.value for e in finding.evidence if e.label == "rank 0 pulled away"]
    assert "in steps 31 to 38, whose memory was not read" in pulled and "between steps 31 and 39" in pulled


def test_a_steady_growth_in_one_phase_is_named_from_the_steps_read(tmp_path: Path) -> None:
    """Rank 0 keeps 16 MiB more in each forward (every step: read or not), from step 0:
    the forward's growth over the steps read outweighs any one stretch between them."""
    bundle = run_of(tmp_path, 60, growing_in_each_forward(16 * MiB))
    [finding] = rank0_asymmetry.detect(bundle)
    point = finding.details["divergence"]
    assert point["phase"] == "forward" and "unread" not in point
    assert "pulled away in the forward phase" in finding.title
    # half the excess (held at every edge of a step) was reached in a step not read
    assert point["since"] == 21 and point["step"] == 29  # the end of step 29: read before step 30
    [pulled] = [e.value for e in finding.evidence if e.label == "rank 0 pulled away"]
    assert "(+384.0 MiB over the 24 steps it was read in;" in pulled  # 16 MiB a forward of steps 0-20, 30, 40, 50


@pytest.mark.parametrize("at", [5, 40])
def test_a_gap_held_from_a_step_read_is_named_as_densely_read(tmp_path: Path, at: int) -> None:
    """From the forward of a step whose heap is read (one of the first, or a tenth), the
    phase is named as if every step were read."""
    bundle = run_of(tmp_path, 60, kept_from_forward_of(at))
    [finding] = rank0_asymmetry.detect(bundle)
    point = finding.details["divergence"]
    assert point["phase"] == "forward" and point["step"] == at and "since" not in point
    assert finding.confidence == "high"


def test_eval_output_kept_by_rank_0_is_named_at_an_eval_between_steps_not_read(tmp_path: Path) -> None:
    """Every rank evaluates after step 34; rank 0 keeps what its eval made (KEPT). An
    eval's edges are always read, so the gap is seen to open inside it, though the steps
    on both sides of it are not read."""
    kept: list[bool] = []

    def held(step: int, where: str) -> int:
        if where == "eval":
            kept.append(True)
        return KEPT if kept else 0

    [finding] = rank0_asymmetry.detect(run_of(tmp_path, 60, held, evals=(34,)))
    point = finding.details["divergence"]
    assert point["phase"] == "eval" and point["step"] == 35 and "since" not in point
    assert finding.confidence == "high" and "pulled away in the eval phase" in finding.title


def test_the_reports_heap_figure_holds_the_steps_read(tmp_path: Path) -> None:
    """A step whose edges were not read would show a background reading or the previous
    step's end as its peak: the heap's per-step figure leaves it out; RSS has every step."""
    bundle = run_of(tmp_path, 45, growing_in_each_forward(16 * MiB))
    assert bundle.run is not None
    bundle.run.ranks[0].mem.append({"k": "mem", "src": "sampler", "step": 33, "t": 0.0, "rss": 1, "heap": BASE})
    heap = report_memory.per_step(bundle.run, HEAP_IN_USE)
    assert [step for step, _ in heap[0]] == [*range(1, 22), 31, 41]  # steps 1-21, 31, 41 (a sample's step + 1)
    assert 34 in {step for step, _ in report_memory.per_step(bundle.run, RSS)[0]}


def test_what_the_loop_keeps_after_an_eval_is_named_the_evals_between_steps_not_read(tmp_path: Path) -> None:
    """Every rank evaluates after 34 steps; rank 0's loop code then keeps the outputs
    (gathered metrics) before the next step: the step after a phase outside the loop is
    read, so the gap opens between the eval's end and that step's forward, as when every
    step is read."""
    evaluated: list[bool] = []

    def held(step: int, where: str) -> int:  # read at the eval's end: not kept yet
        if where == "eval":
            evaluated.append(True)
            return 0
        return KEPT if evaluated else 0

    [finding] = rank0_asymmetry.detect(run_of(tmp_path, 60, held, evals=(33,)))
    point = finding.details["divergence"]
    assert (point["after"], point["edge"], point["phase"]) == ("eval.end", "forward.begin", "eval")
    assert finding.confidence == "high"
