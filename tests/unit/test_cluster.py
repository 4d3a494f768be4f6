"""`--cluster ADDRESS`: a run directory's rank streams read on a real Dask cluster (a
scheduler and two worker processes on this machine) give the analysis and the report a
local read gives; a cluster that cannot read the run is one line and exit 5, a bad
address one line and exit 2."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lorascope.errors import ClusterError
from lorascope.rundir.loading.cluster import check_workers, manifest_digest, reader_code, worker_state
from tests.helpers import FIXTURES, LORASCOPE, Call, RankSpec, write_run

distributed = pytest.importorskip("distributed", reason="the cluster extra (Dask's distributed) is not installed")


@pytest.fixture(scope="module")
def scheduler() -> Iterator[str]:
    cluster = distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None, host="127.0.0.1"
    )
    try:
        yield str(cluster.scheduler_address)
    finally:
        cluster.close()


def lorascope(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*LORASCOPE, *args], capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})}
    )


@pytest.mark.parametrize("fixture", ["rank-conditional-hang", "rank0-asymmetry", "hung-ranks"])
def test_a_run_read_on_the_cluster_analyses_as_a_local_read(scheduler: str, fixture: str) -> None:
    run = str(FIXTURES / fixture)  # absolute: on a cluster the paths shown are absolute
    local = lorascope("analyze", run, "--json")
    remote = lorascope("analyze", run, "--json", "--cluster", scheduler)
    assert local.returncode == remote.returncode == 0, remote.stderr
    assert remote.stdout == local.stdout
    assert '"findings"' in remote.stdout


def test_long_streams_and_the_report_read_on_the_cluster(scheduler: str, tmp_path: Path) -> None:
    """Long streams and steps files (6,000 steps), a pending call on one rank; and the
    report, byte for byte."""
    calls = [Call("all_reduce", bytes=4 * (i % 7 + 1)) for i in range(3000)]
    specs = [RankSpec(steps=6000, calls=calls), RankSpec(steps=6000, calls=[*calls[:-1], Call("barrier", end=False)])]
    run = write_run(tmp_path / "run", specs)
    for folder in run.glob("ranks/rank-*"):  # its stream, steps file (6,000 steps, 240 KB) and memory file (384 KB)
        files = [*folder.glob("*.jsonl"), *folder.glob("*.steps"), *folder.glob("*.mem")]
        assert sum(p.stat().st_size for p in files) > 700_000
    local = lorascope("analyze", str(run), "--json")
    remote = lorascope("analyze", str(run), "--json", "--cluster", scheduler)
    assert local.returncode == remote.returncode == 0, remote.stderr
    assert remote.stdout == local.stdout
    assert "collective-mismatch" in remote.stdout or "rank-conditional-hang" in remote.stdout
    pages = [tmp_path / "local.html", tmp_path / "remote.html"]
    assert lorascope("report", str(run), "-o", str(pages[0])).returncode == 0
    done = lorascope("report", str(run), "-o", str(pages[1]), "--cluster", scheduler)
    assert done.returncode == 0, done.stderr
    assert pages[1].read_bytes() == pages[0].read_bytes()


def test_export_reads_on_the_cluster(scheduler: str, tmp_path: Path) -> None:
    run = str(FIXTURES / "rank-conditional-hang")
    outs = [tmp_path / "local.json", tmp_path / "remote.json"]
    assert lorascope("export", run, "--perfetto", str(outs[0])).returncode == 0
    done = lorascope("export", run, "--perfetto", str(outs[1]), "--cluster", scheduler)
    assert done.returncode == 0, done.stderr
    assert outs[1].read_bytes() == outs[0].read_bytes()


def test_hang_reads_on_the_cluster(scheduler: str) -> None:
    run = str(FIXTURES / "hung-ranks")  # its ranks are long gone: nothing is signalled
    args = ["hang", run, "--json", "--no-html", "--wait", "0"]
    local = lorascope(*args)
    remote = lorascope(*args, "--cluster", scheduler)
    assert local.returncode == remote.returncode == 0, remote.stderr
    assert remote.stdout == local.stdout and '"over"' in remote.stdout  # its processes are gone: analyze's account
    assert "stuck outside any collective" in remote.stdout
    assert not (FIXTURES / "hung-ranks" / "dump-request.json").exists()  # no rank to ask: nothing written


def one_line_error(result: subprocess.CompletedProcess[str], code: int, text: str) -> None:
    assert result.returncode == code, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lorascope: error: ") and text in lines[0], result.stderr


@pytest.mark.parametrize(
    ("address", "said"),
    [("nonsense::", "invalid address"), ("foo://host:1", "unknown address scheme"), ("tcp://host", "missing port")],
)
def test_a_bad_address_is_a_usage_error(address: str, said: str) -> None:
    one_line_error(lorascope("analyze", str(FIXTURES / "healthy"), "--cluster", address), 2, said)


def test_an_unreachable_scheduler_is_one_line_and_exit_5() -> None:
    result = lorascope(
        "analyze",
        str(FIXTURES / "healthy"),
        "--cluster",
        "tcp://127.0.0.1:1",
        env={"DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "1s"},
    )
    one_line_error(result, 5, "cannot reach the Dask scheduler at tcp://127.0.0.1:1")


def test_without_distributed_it_says_which_extra() -> None:
    code = (
        "import sys; sys.modules['distributed'] = None; from lorascope.cli import main; "
        f"main(['analyze', {str(FIXTURES / 'healthy')!r}, '--cluster', 'tcp://127.0.0.1:8786'])"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    one_line_error(result, 2, "pip install 'lorascope[cluster]'")


def test_workers_that_cannot_read_the_run_are_named(tmp_path: Path) -> None:
    """What each worker reported (worker_state, run here as a worker runs it)."""
    run = FIXTURES / "healthy"
    here = manifest_digest(str(run))
    good = worker_state(str(run))
    assert good == (reader_code(), here) and here is not None
    check_workers({"tcp://a:1": good, "tcp://b:1": good}, run, "tcp://s:1", here)
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    (copy / "manifest.json").write_text(
        (run / "manifest.json").read_text().replace('"exit_status": 0', '"exit_status": 1')
    )
    stale = worker_state(str(copy))
    assert stale[1] not in (None, here)
    cases = {
        "has no workers": {},
        "tcp://b:1 does not see": {"tcp://a:1": good, "tcp://b:1": worker_state(str(tmp_path))},
        "tcp://b:1 sees another": {"tcp://a:1": good, "tcp://b:1": stale},
        "tcp://a:1 runs lorascope 0.0.9 (0123456789ab)": {"tcp://a:1": ("0.0.9 (0123456789ab)", here)},
        "tcp://a:1 cannot run lorascope (ModuleNotFoundError": {"tcp://a:1": ModuleNotFoundError("lorascope")},
    }
    for said, states in cases.items():
        with pytest.raises(ClusterError, match=re.escape(said)):
            check_workers(states, run, "tcp://s:1", here)
