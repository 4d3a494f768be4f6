"""Call sites and rank conditions up the stack, with the caches keyed by code id: the
same answers on the first call, on the cached calls, and past the cap on kept code."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from lorascope.probes import collectives
from lorascope.probes.collectives import CollectiveProbe
from lorascope.probes.session import Session
from lorascope.rundir.format.sources import rank_condition_in
from lorascope.rundir.format.writer import Stream

JOB = textwrap.dedent("""
    def begin(probe):
        return probe._site()        # _site looks 3 frames up: begin, wrapper, caller

    def wrapper(probe):
        return begin(probe)

    def collective(probe):
        return wrapper(probe)       # the call site: no rank condition here

    def save(probe):
        return collective(probe)

    def loop(probe, rank):
        out = []
        for _ in range(3):
            out.append(save(probe))
            if rank == 0:
                out.append(save(probe))
        return out

    def pair(probe, rank):
        if rank == 0:
            return collective(probe), save(probe), collective(probe)
        return None
""")


def _job(tmp_path: Path, source: str = JOB, name: str = "job_under_test") -> ModuleType:
    """``source`` written to ``tmp_path/NAME.py`` and imported from there (its lines are what
    the probe reads)."""
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _probe(tmp_path: Path) -> tuple[CollectiveProbe, list[dict[str, Any]]]:
    session = Session(Stream(tmp_path / "ranks" / "rank-0" / "h-1"), 0, 0, 1, 0.0)
    records: list[dict[str, Any]] = []
    session.record = lambda kind, **fields: records.append({"k": kind, **fields})  # type: ignore[method-assign]
    return CollectiveProbe(session, tmp_path / "ranks" / "rank-0" / "h-1"), records


@pytest.mark.parametrize("cap", [collectives.MAX_KEPT_CODES, 0])
def test_sites_and_rank_conditions_up_the_stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cap: int) -> None:
    monkeypatch.setattr(collectives, "MAX_KEPT_CODES", cap)
    job = _job(tmp_path)
    probe, records = _probe(tmp_path)
    got = job.loop(probe, 0)
    path = str(tmp_path / "job_under_test.py")
    site = f"{path}:9 in collective"
    # the unconditioned save (line 17) has no via; the one under `if rank == 0:` (line 19) does
    assert got == [(site, None), (site, f"{path}:19 in loop")] * 3
    assert job.loop(probe, 1) == [(site, None)] * 3
    described = {r["site"]: r for r in records if r["k"] == "site"}
    assert len(described) == len(records)  # each site's source context recorded once
    assert described[f"{path}:19 in loop"]["conditions"]
    assert not described[site]["conditions"] and not described[f"{path}:17 in loop"]["conditions"]
    if cap == 0:  # nothing cached by id: worked out again at every call, the same
        assert not probe._kept and not probe._internal and not probe._sites and not probe._foreign
    else:
        assert all(probe._kept[i] is not None for i in probe._internal)
        assert sys.getrefcount(job.collective.__code__) > 2  # kept alive by the probe


def test_calls_at_one_line_share_its_site_and_condition(tmp_path: Path) -> None:
    """The caches are keyed by instruction (``f_lasti``): three calls on one line, two of
    them straight and one through ``save``, are one site up the stack, read once."""
    job = _job(tmp_path)
    probe, records = _probe(tmp_path)
    path = str(tmp_path / "job_under_test.py")
    site, via = f"{path}:9 in collective", f"{path}:24 in pair"
    for _ in range(2):  # the first call fills the caches, the second reads them
        assert job.pair(probe, 0) == ((site, via),) * 3
    described = [r["site"] for r in records if r["k"] == "site"]
    assert described.count(via) == 1 and len(described) == len(set(described))
    # one entry per call instruction of that line, each looked at once
    assert len({key for key in probe._line_conditioned if key[0] == id(job.pair.__code__)}) == 3


COMMENTED = textwrap.dedent("""
    def begin(probe):
        return probe._site()

    def wrapper(probe):
        return begin(probe)

    def collective(probe):
        return wrapper(probe)

    def loop(probe, rank, step):
        out = []
        if step % 2 == 0:  # every rank saves here
            out.append(collective(probe))
        if rank == 0:  # the bug: only rank 0
            out.append(collective(probe))
        return out
""")


def test_a_comment_on_a_conditions_line_is_not_the_condition(tmp_path: Path) -> None:
    """``if step % 2 == 0:  # every rank saves here`` tests no rank: the word in its comment
    made it a rank condition (the probes flush and follow such a call, and the verdicts name
    it). Conditions are recorded without their comments; one recorded with its comment
    (an older run) is read without it."""
    job = _job(tmp_path, COMMENTED, "commented_job")
    path = tmp_path / "commented_job.py"
    probe, records = _probe(tmp_path)
    site = f"{path}:9 in collective"
    assert job.loop(probe, 1, 2) == [(site, None)]
    assert job.loop(probe, 0, 1) == [(site, f"{path}:16 in loop")]
    described = {r["site"]: r for r in records if r["k"] == "site"}
    assert described[f"{path}:14 in loop"]["conditions"] == ["if step % 2 == 0:"]
    assert described[f"{path}:16 in loop"]["conditions"] == ["if rank == 0:"]
    assert rank_condition_in({"conditions": ["if step % 2 == 0:  # every rank saves here"]}) is None
    assert rank_condition_in({"conditions": ["else of: if rank == 0:  # only rank 0"]}) == "else of: if rank == 0:"
    assert rank_condition_in({"conditions": ['if tag == "#rank":']}) == 'if tag == "#rank":'  # a string, not a comment


LIBRARY = textwrap.dedent("""
    def begin(probe):
        return probe._site()

    def wrapper(probe):
        return begin(probe)

    def gather(probe, depth):
        if depth:
            return gather(probe, depth - 1)
        return wrapper(probe)

    def through(probe, hook, depth):
        return hook(probe, depth)
""")

DEEP_JOB = textwrap.dedent("""
    def step(lib, probe, depth):
        return lib.gather(probe, depth)

    def other_step(lib, probe, depth):
        return lib.gather(probe, depth)

    def hook(probe, depth):
        return LIB.gather(probe, depth)

    def hooked_step(lib, probe, depth):
        return lib.through(probe, hook, depth)

    def save(lib, probe, rank, depth):
        if rank == 0:
            return step(lib, probe, depth)
        return None
""")


def _deep(tmp_path: Path) -> tuple[ModuleType, ModuleType, CollectiveProbe, str]:
    """A job whose calls pass library frames (``gather`` recursing ``depth`` + 1 frames
    deep, under ``wrapper``: its file is taken for a library's) before its own line."""
    lib = _job(tmp_path, LIBRARY, "library_under_test")
    job = _job(tmp_path, DEEP_JOB, "deep_job")
    job.LIB = lib
    probe, _ = _probe(tmp_path)
    lib_file = str(tmp_path / "library_under_test.py")
    is_internal = probe._is_internal
    probe._is_internal = lambda filename: filename == lib_file or is_internal(filename)  # type: ignore[method-assign]
    return lib, job, probe, str(tmp_path / "deep_job.py")


def test_a_call_from_the_same_library_frames_hops_to_its_site(tmp_path: Path) -> None:
    """A walk past library frames leaves a hop for calls from the same first two frames:
    the next such call reads its site straight from the frame that many up, not by
    following every frame (which makes a frame object of each)."""
    lib, job, probe, path = _deep(tmp_path)
    site = (f"{path}:3 in step", None)
    assert job.step(lib, probe, 6) == site
    assert len(probe._hops) == 1 and next(iter(probe._hops.values())).depth == 7  # gather's 7 frames
    # Taken for the job's own code now, gather's frames would be the site of a walk: the
    # site still found is the hop's (the walk was not taken).
    for code in list(probe._internal):
        if probe._kept.get(code) is lib.gather.__code__:
            probe._internal[code] = False
    probe._is_internal = lambda filename: False  # type: ignore[method-assign]
    assert job.step(lib, probe, 6) == site


def test_a_hop_is_taken_only_where_its_frames_are_the_walks(tmp_path: Path) -> None:
    """Calls from the same first two frames whose site lies at another depth, on another
    line, or behind a job frame in between (a library calling back into the job) get the
    walk's answer, as does the same call under a rank condition (its ``via``)."""
    lib, job, probe, path = _deep(tmp_path)
    step, other = f"{path}:3 in step", f"{path}:6 in other_step"
    for _ in range(2):  # the first round walks; the second may hop
        assert job.step(lib, probe, 6) == (step, None)
        assert job.step(lib, probe, 9) == (step, None)  # deeper: the hop's frames are gather's
        assert job.step(lib, probe, 4) == (step, None)  # shallower
        assert job.other_step(lib, probe, 6) == (other, None)  # same depth, another line
        assert job.hooked_step(lib, probe, 4) == (f"{path}:9 in hook", None)  # the job in between
        assert job.save(lib, probe, 0, 6) == (step, f"{path}:16 in save")
        assert job.save(lib, probe, 1, 6) is None
    assert probe._hops  # kept, and checked before each use


def test_no_hop_is_kept_past_the_cap_on_kept_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(collectives, "MAX_KEPT_CODES", 0)
    lib, job, probe, path = _deep(tmp_path)
    for _ in range(2):
        assert job.step(lib, probe, 6) == (f"{path}:3 in step", None)
    assert not probe._hops


@pytest.mark.parametrize(
    ("condition", "tests_rank"),
    [
        # `\b` after "get_rank()" never matched (no word character after the ")"): the
        # commonest rank test of all was no rank condition (run by hand: variants.py's
        # log-broadcast-hang read "no rank condition was found at the call sites")
        ("if dist.get_rank() == 0:", True),
        ("if torch.distributed.get_rank()==0:", True),
        ("if dist.get_node_local_rank() == 0:", True),
        ('if os.environ["RANK"] == "0":', True),
        ('if int(os.environ.get("LOCAL_RANK", 0)) == 0:', True),
        ("if accelerator.process_index == 0:", True),
        ("if trainer.is_world_process_zero():", True),
        ("if d.rank == 0:", True),
        # flags set from the rank, by the names jobs give them (an evaluation under
        # `if is_main and step % 4 == 0:` read as a branch on the data)
        ("if master_process:", True),
        ("if self.is_main and step % 4 == 0:", True),
        ("if trainer.is_global_zero:", True),
        ("if is_master:", True),
        ("if rank_zero():", True),
        ("if is_master_weights:", False),
        ("if main_process_first:", False),
        ("if ranking > 3:", False),
        ("if lora_rank > 8:", False),
        ("if self.args.rank_pattern:", False),
        ("if step % 10 == 0:", False),
    ],
)
def test_what_reads_as_a_rank_condition(condition: str, tests_rank: bool) -> None:
    assert (rank_condition_in({"conditions": [condition]}) is not None) is tests_rank
