"""The detectors at many ranks. Their shortcuts give what the plain definitions give: the
others' median per rank and step (straggler), the aspects of a call compared at once (the
divergence finder), a memory figure read by a function of the sample alone. Ranks whose
evidence reads alike are one group of rows, from three ranks on."""

from __future__ import annotations

import copy
import statistics
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from lorascope.detect import reentrant_dead_grads
from lorascope.detect.common import (
    CUDA_ALLOCATED,
    HEAP_IN_USE,
    RSS,
    figure_ranges,
    has_figure,
    mem_reader,
    mem_value,
    memory_kind,
    per_rank_evidence,
)
from lorascope.detect.finding import Evidence
from lorascope.detect.hang.divergence import RUN_ALL, RUN_OP_SIZE, classify, splits
from lorascope.detect.pace import others_medians
from lorascope.ingest.load import load_bundle
from lorascope.rundir.loading.reader import Collective, RankData
from lorascope.text.artifacts import _render_flight

# Few distinct values, so that ties (a rank's own value held by others too) are common.
WORK = st.sampled_from([0.0, 1e-9, 0.1, 0.2, 0.30000000000000004, 0.3, 5.5, 1e300])


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 9), st.integers(1, 4), st.data())
def test_others_medians_are_the_median_of_the_others(n: int, steps: int, data: st.DataObject) -> None:
    ranks = sorted(data.draw(st.sets(st.integers(0, 50), min_size=n, max_size=n)))
    numbers = list(range(2, 2 + steps))
    work = {r: {s: data.draw(st.one_of(WORK, st.floats(0, 10))) for s in numbers} for r in ranks}
    got = others_medians(work, ranks, numbers)
    for r in ranks:
        for i, s in enumerate(numbers):
            want = statistics.median(work[o][s] for o in ranks if o != r)
            assert repr(got[r][i]) == repr(want), (work, r, s)


def _call(op: str, size: int | None, dtype: str | None, seq: int) -> Collective:
    return Collective(seq, "default_pg", op, size, dtype, False, None, 0, 1.0, 2.0, None)


def _classify_by_aspect(calls: dict[int, Any], aspects: list[tuple[str, Any]], missing: bool) -> str | None:
    """classify as it was written before the aspects were read at once: one key per aspect."""
    present = [c for c in calls.values() if c is not None]
    if not present:
        return None
    differ = [name for name, key in aspects if len({key(c) for c in present}) > 1]
    if differ:
        return differ[0] if differ[0] == "op" else "+".join(differ)
    return "missing" if missing and len(present) < len(calls) else None


CALLS = st.one_of(
    st.none(),
    st.builds(
        lambda op, size, dtype: (op, size, dtype),
        st.sampled_from(["all_reduce", "broadcast"]),
        st.sampled_from([None, 0, 4, 8]),
        st.sampled_from([None, "float32", "bfloat16"]),
    ),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(CALLS, min_size=1, max_size=6), min_size=2, max_size=5), st.booleans())
def test_aspects_read_at_once_classify_as_each_aspect_alone(rows: list[list[Any]], missing: bool) -> None:
    tables = {r: {seq: _call(*c, seq) for seq, c in enumerate(row, 1) if c is not None} for r, row in enumerate(rows)}
    plain = {
        "op_size": [("op", lambda c: c.op), ("size", lambda c: c.bytes)],
        "all": [("op", lambda c: c.op), ("size", lambda c: c.bytes), ("dtype", lambda c: c.dtype)],
    }
    for aspects, by_aspect in ((RUN_OP_SIZE, plain["op_size"]), (RUN_ALL, plain["all"])):
        seqs = sorted({s for t in tables.values() for s in t})
        for seq in seqs:
            calls = {r: tables[r].get(seq) for r in tables}
            assert classify(calls, aspects, missing) == _classify_by_aspect(calls, by_aspect, missing)
        # the splits (their shortcut past the agreeing prefix included) are the seqs that classify
        found = [(s.seq, s.kind) for s in splits(tables, aspects, missing)]
        users = [r for r in tables if tables[r]]
        if users:
            start = max(min(tables[r]) for r in users)
            want = [
                (seq, kind)
                for seq in seqs
                if seq >= start
                and (kind := _classify_by_aspect({r: tables[r].get(seq) for r in tables}, by_aspect, missing))
            ]
            assert found == want


SAMPLES = st.fixed_dictionaries(
    {},
    optional={
        "rss": st.integers(0, 2**40),
        "heap": st.one_of(st.none(), st.integers(0, 2**40)),
        "cuda": st.one_of(
            st.none(),
            st.just("odd"),
            st.fixed_dictionaries({}, optional={"alloc": st.one_of(st.none(), st.integers(0, 2**40))}),
        ),
    },
)


@settings(max_examples=300, deadline=None)
@given(SAMPLES)
def test_mem_reader_reads_as_mem_value(sample: dict[str, Any]) -> None:
    for kind in (None, CUDA_ALLOCATED, HEAP_IN_USE, RSS, "other"):
        assert mem_reader(kind)(sample) == mem_value(sample, kind)


@settings(max_examples=300, deadline=None)
@given(st.lists(SAMPLES, max_size=6))
def test_the_figures_found_in_c_are_those_a_scan_finds(samples: list[dict[str, Any]]) -> None:
    """has_figure and memory_kind test a key's presence in C before scanning: the same
    answers as the plain scans they replace."""
    rank = RankData(rank=0, start={}, files=[], mem=samples)
    for kind in (CUDA_ALLOCATED, HEAP_IN_USE, RSS):
        assert has_figure(rank, kind) == any(mem_value(m, kind) is not None for m in samples)
    if any(isinstance(m.get("cuda"), dict) for m in samples):
        want = CUDA_ALLOCATED
    elif any(m.get("heap") is not None for m in samples):
        want = HEAP_IN_USE
    else:
        want = RSS
    assert memory_kind(rank) == want


def _rows(n: int, port: int, op: str = "barrier") -> list[tuple[str, Any, str]]:
    return [
        (
            " at default_pg #7",
            f"{op} #7 (0 B) — failed: Connection closed by peer [127.0.0.1]:{port}",
            f"ranks/rank-{n}/s.jsonl",
        ),
        (" source", "dist.barrier()", "train.py:12 in main"),
    ]


def test_per_rank_evidence_groups_ranks_alike_but_for_numbers() -> None:
    rows = {0: _rows(0, 1000, op="all_reduce"), **{n: _rows(n, 1000 + n) for n in range(1, 6)}}
    ev = per_rank_evidence(rows)
    assert [e.label for e in ev] == [
        "rank 0 at default_pg #7",
        "rank 0 source",
        "ranks 1-5 at default_pg #7",
        "ranks 1-5 source",
    ]
    assert ev[2].value == rows[1][0][1] + " (5 ranks alike but for their numbers; rank 1's shown)"
    assert ev[2].source == "ranks/rank-1/s.jsonl"
    # kept apart: its own rows, at its place
    apart = per_rank_evidence(rows, apart=frozenset({3}))
    assert [e.label for e in apart][2:] == [
        "ranks 1, 2, 4, 5 at default_pg #7",
        "ranks 1, 2, 4, 5 source",
        "rank 3 at default_pg #7",
        "rank 3 source",
    ]


def test_per_rank_evidence_keeps_few_ranks_as_they_were() -> None:
    # two alike ranks (under MIN_ALIKE_RANKS) and a different one between them: a row each, in rank order
    rows = {1: _rows(1, 5), 2: _rows(2, 5, op="all_reduce"), 3: _rows(3, 6)}
    ev = per_rank_evidence(rows)
    assert [e.label.split()[1] for e in ev] == ["1", "1", "2", "2", "3", "3"]
    assert [e.value for e in ev] == [v for n in (1, 2, 3) for _, v, _ in rows[n]]
    assert per_rank_evidence({0: _rows(0, 1), 1: _rows(1, 2)}) == [
        Evidence(f"rank {n}{s}", v, src) for n in (0, 1) for s, v, src in _rows(n, n + 1)
    ]


def test_figure_ranges_give_each_differing_figure_its_range() -> None:
    values = [
        "median 120.5 ms over 96 steps (noise 2.1 ms MAD)",
        "median 118.2 ms over 96 steps (noise 12.4 ms MAD)",
        "median 125.9 ms over 96 steps (noise 1.9 ms MAD)",
    ]
    assert figure_ranges(values) == "median 118.2-125.9 ms over 96 steps (noise 1.9-12.4 ms MAD)"
    assert figure_ranges(["no figures"]) == "no figures" and figure_ranges(["a 7", "a 7"]) == "a 7"


def test_measured_evidence_of_a_group_shows_each_figures_range() -> None:
    rows = {
        n: [(" work per step", f"median {100 + n}.{n} ms over 96 steps", f"ranks/rank-{n}/s.jsonl")] for n in range(6)
    }
    ev = per_rank_evidence(rows, apart=frozenset({3}), show="ranges")
    assert [(e.label, e.value) for e in ev] == [
        (
            "ranks 0-2, 4, 5 work per step",
            "median 100.0-105.5 ms over 96 steps (5 ranks alike but for their numbers; each figure's range over them)",
        ),
        ("rank 3 work per step", "median 103.3 ms over 96 steps"),
    ]


def test_rank_lists_in_evidence_and_the_flight_section_stay_one_short_line() -> None:
    """At 1,024 ranks a list of every rank (``[0, 1, ..., 1023]``, ~6 KB) in an evidence
    line or the flight-recorder section reads as ranges: ``0-1023``."""
    bundle = load_bundle(Path(__file__).resolve().parents[2] / "fixtures" / "reentrant-dead-grads")
    assert bundle.run is not None
    template = bundle.run.ranks[1]
    for n in range(2, 1024):
        rank = copy.copy(template)
        rank.rank = n
        bundle.run.ranks[n] = rank
    [finding] = reentrant_dead_grads.detect(bundle)
    [warned] = [e for e in finding.evidence if e.label == "torch warned"]
    assert warned.value.endswith("on ranks 0-1023")

    group = {"group": "0", "desc": "default_pg", "window": [1, 9], "expected_ranks": list(range(1024))}
    group |= {"missing_dumps": list(range(2, 1024)), "progress": {}, "disagreements": [], "compared": 9}
    data = {"flight_records": {"0": {"backends": ["nccl"], "version": "2.10", "warnings": []}}}
    lines = _render_flight({**data, "flight_alignment": {"groups": [group]}})
    assert "ranks 0-1023, #1..#9" in lines[1] and lines[2] == "    no dump from ranks 2-1023"
    assert max(map(len, lines)) < 120
