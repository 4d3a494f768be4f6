"""Small synthetic run directories for the report tests, written with the real writer (and
read back by the real reader), plus a check that they load as intended."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorascope.ingest.load import load_bundle
from lorascope.rundir.writer import Stream, record_launch, stream_prefix

T0 = 1_800_000_000.0


@dataclass
class Call:
    """One collective on one rank: ``end=False`` leaves it pending (no coll_end)."""

    op: str
    bytes: int = 4
    dtype: str | None = "float32"
    site: str = "train.py:10 in main"
    end: bool = True
    err: str | None = None


@dataclass
class RankSpec:
    steps: int = 4
    calls: list[Call] = field(default_factory=lambda: [Call("all_reduce")] * 3)
    exception: tuple[str, str] | None = None
    ends: bool = True
    losses: list[float] | None = None
    phases: list[tuple[str, int]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    sites: dict[str, tuple[str, list[str]]] = field(default_factory=dict)


def write_run(
    root: Path,
    ranks: list[RankSpec],
    *,
    command: list[str] | None = None,
    argv: list[str] | None = None,
    configs: dict[str, dict[str, Any]] | None = None,
) -> Path:
    """A run directory with one stream per rank; times are fixed, so output is reproducible."""
    record_launch(root, "h-1", command or ["torchrun", "train.py"], start=T0, end=T0 + 100, exit_status=0)
    for n, spec in enumerate(ranks):
        stream = Stream(stream_prefix(root, n, "h", 100 + n))
        t = T0 + 1 + n * 0.01

        def write(kind: str, stream: Stream = stream, **fields: Any) -> None:
            nonlocal t
            t += 0.1
            stream.write({"k": kind, "t": t, **fields})

        write(
            "start",
            rank=n,
            world_size=len(ranks),
            local_rank=n,
            pid=100 + n,
            host="h",
            argv=argv or ["train.py"],
            versions={"torch": "2.13.0"},
            device="cpu",
        )
        for name, value in (configs or {}).items():
            write("config", name=name, value=value)
        write("group", gid=0, name="default_pg", ranks=list(range(len(ranks))), backend="gloo")
        for site, (line, conditions) in spec.sites.items():
            write("site", site=site, line=line, conditions=conditions)
        for step in range(spec.steps):
            write("mem", src="forward.begin", step=step, rss=(100 + 10 * step + (50 if n == 0 else 0)) << 20)
            for name, at in spec.phases:
                if at == step:
                    write("phase", name=name, edge="begin", step=step)
                    write("phase", name=name, edge="end", step=step)
            loss = spec.losses[step] if spec.losses else 2.0 - 0.1 * step
            write("step", step=step + 1, dur=0.5 + 0.01 * n, loss=loss, src="torch")
        for seq, call in enumerate(spec.calls, 1):
            write(
                "coll",
                seq=seq,
                gid=0,
                op=call.op,
                bytes=call.bytes,
                dtype=call.dtype,
                site=call.site,
                step=spec.steps,
                **{"async": False},
            )
            if call.end:
                write("coll_end", seq=seq, gid=0, err=call.err)
        for message in spec.warnings:
            write("warning", category="UserWarning", message=message, filename="train.py", lineno=3)
        if spec.exception:
            write(
                "exception",
                type=spec.exception[0],
                message=spec.exception[1],
                traceback=f"Traceback (most recent call last):\n{spec.exception[0]}: {spec.exception[1]}\n",
            )
            write("end", status="exception", code=1)
        elif spec.ends:
            write("mem", src="end", step=spec.steps, rss=(200 + (50 if n == 0 else 0)) << 20)
            write("end", status="exit", code=0)
        stream.close()
    return root


def test_synthetic_run_loads(tmp_path: Path) -> None:
    hang = [
        RankSpec(calls=[Call("all_reduce"), Call("all_reduce", end=False)]),
        RankSpec(calls=[Call("all_reduce"), Call("barrier", bytes=0, dtype=None, end=False)], ends=False),
    ]
    bundle = load_bundle(write_run(tmp_path, hang))
    run = bundle.run
    assert run is not None and sorted(run.ranks) == [0, 1]
    assert [c.pending for c in run.ranks[1].collectives] == [False, True]
    assert run.ranks[1].end is None and run.ranks[0].end is not None
