"""fixtures/convert_v2.py: a format v2 run directory (every record in the stream) converted
in place reads as v3 with the same calls, steps, phase edges and readings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lorascope.errors import FormatVersionError
from lorascope.rundir.format.writer import record_launch
from lorascope.rundir.loading.reader import load_run
from tests.helpers import fixture_script

START = {"k": "start", "t": 1.0, "rank": 0, "world_size": 1, "local_rank": 0, "pid": 42, "host": "h", "argv": [],
         "versions": {}, "device": "cuda"}  # fmt: skip
CUDA = {"device": 0, "alloc": 3 << 30, "reserved": 4 << 30, "max_alloc": 5 << 30}
COLL = {"gid": 0, "op": "all_reduce", "bytes": 64, "dtype": "float32", "async": False, "site": "train.py:9 in f"}
V2: list[dict[str, Any]] = [
    START,
    {"k": "group", "t": 1.1, "gid": 0, "name": "default_pg", "ranks": [0], "backend": "nccl"},
    {"k": "phase", "t": 1.2, "name": "forward", "edge": "begin", "step": 0},
    {"k": "coll", "t": 1.3, "seq": 1, "step": 0, **COLL},
    {"k": "coll_end", "t": 1.4, "gid": 0, "seq": 1},
    {"k": "phase", "t": 1.5, "name": "forward", "edge": "end", "step": 0},
    {
        "k": "mem",
        "t": 1.6,
        "src": "sampler",
        "step": 0,
        "rss": 100,
        "heap": 50,
        "cuda": CUDA,
        "nvml": {"used": 7 << 30, "total": 80 << 30},
    },  # fmt: skip
    {"k": "step", "t": 1.7, "step": 1, "dur": 0.6, "loss": 2.5, "src": "deepspeed"},
    {"k": "coll_done", "t": 1.8, "seq": 2, "step": 1, "end": 1.9, "err": "RuntimeError('x')", **COLL},
    {"k": "step", "t": 2.0, "step": 2, "dur": 0.3, "loss": None, "src": "deepspeed"},
    {"k": "mem", "t": 2.1, "src": "step", "step": 2, "rss": 120},
    {"k": "end", "t": 2.2, "status": "exit", "code": 0},
]


def test_a_v2_run_converted_reads_as_it_was_recorded(tmp_path: Path) -> None:
    record_launch(tmp_path, "h-1", ["job"])
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    (tmp_path / "manifest.json").write_text(json.dumps({**manifest, "version": 2}))
    folder = tmp_path / "ranks" / "rank-0"
    folder.mkdir(parents=True)
    (folder / "h-42.0000.jsonl").write_text("".join(json.dumps(rec) + "\n" for rec in V2))
    with pytest.raises(FormatVersionError):
        load_run(tmp_path)
    fixture_script("convert_v2.py").convert(tmp_path)
    run = load_run(tmp_path)
    assert run.warnings == []
    rank = run.ranks[0]
    assert [(c.seq, c.op, c.bytes, c.start, c.end, c.err) for c in rank.collectives] == [
        (1, "all_reduce", 64, 1.3, 1.4, None),
        (2, "all_reduce", 64, 1.8, 1.9, "RuntimeError('x')"),
    ]
    assert [(s["step"], s["dur"], s["loss"], s["src"], s["t"]) for s in rank.steps] == [
        (1, 0.6, 2.5, "deepspeed", 1.7),
        (2, 0.3, None, "deepspeed", 2.0),
    ]
    assert [(p["name"], p["edge"], p["step"], p["t"]) for p in rank.phases] == [
        ("forward", "begin", 0, 1.2),
        ("forward", "end", 0, 1.5),
    ]
    first, second = rank.mem
    assert (first["src"], first["rss"], first["heap"], first["cuda"], first["nvml"]) == (
        "sampler", 100, 50, CUDA, {"used": 7 << 30, "total": 80 << 30}
    )  # fmt: skip
    assert (second["src"], second["step"], second["rss"], "cuda" in second) == ("step", 2, 120, False)
    kinds = {json.loads(line)["k"] for line in (folder / "h-42.0000.jsonl").read_text().splitlines()}
    assert not kinds & {"coll", "coll_done", "coll_end", "step", "phase", "mem"}
