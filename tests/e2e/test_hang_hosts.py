"""`lorascope hang` on a job that spans hosts, scaled down to this machine: 16 gloo ranks
of a light job (probes/tiny_ranks.py) on two "hosts" that cannot signal each other, each
its own PID and UTS namespace (`unshare --pid --fork --uts --mount-proc`, hostnames
hosta and hostb), one run directory. A rank-conditional hang is planted on rank 11, on
hostb; `lorascope hang` runs on hosta (`nsenter` into its namespaces) and reaches every
rank through the dump request in the run directory.

Needs root (or user namespaces) for unshare and nsenter; skipped, saying why, where they
are refused. 16 ranks on 2 cores take ~40-60 s to start: marked slow."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from lorascope.rundir.loading.reader import RankData, RunData, load_run
from tests.helpers import LORASCOPE, REPO, default_signals, free_port, job_env

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

JOB = REPO / "probes" / "tiny_ranks.py"
HOSTS = ("hosta", "hostb")
PER_HOST = 8
HANG_RANK = 11  # on hostb: node rank 1 holds ranks 8-15


def _unshare_refused() -> str | None:
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        return "unshare/nsenter are not installed"
    res = subprocess.run(
        ["unshare", "--pid", "--fork", "--uts", "--mount-proc", "true"], capture_output=True, text=True, timeout=30
    )
    return None if res.returncode == 0 else f"unshare refused here: {res.stderr.strip()[:200]}"


@contextmanager
def two_hosts(out: Path, *args: str) -> Iterator[list[subprocess.Popen[bytes]]]:
    """The job's two nodes, each under `lorascope run` in namespaces of its own; ended
    (every process of each namespace, with its init) on exit."""
    port = free_port()
    hosts = []
    for node, name in enumerate(HOSTS):
        job = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
            "--nproc-per-node", str(PER_HOST), "--master-addr", "127.0.0.1", "--master-port", str(port),
            str(JOB), *args,
        ]  # fmt: skip
        inner = f"hostname {name} && exec {' '.join([*LORASCOPE, 'run', '--out', str(out), '--', *job])}"
        hosts.append(
            subprocess.Popen(
                ["unshare", "--pid", "--fork", "--uts", "--mount-proc", "sh", "-c", inner],
                env={**job_env(), "GLOO_SOCKET_IFNAME": "lo"},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                preexec_fn=default_signals,
            )
        )
    try:
        yield hosts
    finally:
        for host in hosts:
            for init in _children(host.pid):  # the namespace's init: its death ends them all
                try:
                    os.kill(init, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            host.kill()
            host.wait(timeout=60)


def _children(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children()]
    except psutil.NoSuchProcess:
        return []


def _wait(out: Path, check: object, timeout: float = 300) -> RunData:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            run = load_run(out)
            if len(run.ranks) == 2 * PER_HOST and check(run):  # type: ignore[operator]
                return run
        except Exception:
            pass
        time.sleep(1)
    raise AssertionError("the 16-rank job did not reach the planted hang")


def _waits(rank: RankData) -> bool:
    """The rank waits where the planting leaves it: rank 11 in its extra all_reduce, the
    others in the barrier (not a call of a step still moving)."""
    want = "all_reduce" if rank.rank == HANG_RANK else "barrier"
    return any(c.pending and c.op == want and c.site and "tiny_ranks.py" in c.site for c in rank.collectives)


def _hang_on(host: subprocess.Popen[bytes], out: Path, *extra: str) -> tuple[dict, float]:
    """`lorascope hang --json` run inside the host's namespaces; its output and wall time."""
    [init] = _children(host.pid)
    began = time.time()
    res = subprocess.run(
        ["nsenter", "-t", str(init), "-p", "-u", "-m", *LORASCOPE, "hang", str(out), "--json", "--no-html", *extra],
        capture_output=True,
        text=True,
        timeout=120,
        env=job_env(),
    )
    took = time.time() - began
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout), took


def _pid_of_rank(host: subprocess.Popen[bytes], rank: int) -> int:
    for proc in psutil.Process(host.pid).children(recursive=True):
        try:
            if proc.environ().get("RANK") == str(rank) and "tiny_ranks.py" in " ".join(proc.cmdline()):
                return proc.pid
        except psutil.Error:
            continue
    raise AssertionError(f"rank {rank}'s process not found")


def test_hang_on_one_host_reaches_every_rank_and_names_the_other_hosts_rank() -> None:
    refused = _unshare_refused()
    if refused:
        pytest.skip(refused)
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"lorascope-hosts-{os.getpid()}" / "run"
    shutil.rmtree(out.parent, ignore_errors=True)
    try:
        args = ("--steps", "400", "--hang-rank", str(HANG_RANK), "--hang-step", "5")
        with two_hosts(out, *args) as hosts:
            _wait(out, lambda r: all(_waits(rank) for rank in r.ranks.values()))
            time.sleep(1)
            data, took = _hang_on(hosts[0], out)
            assert took < 5.0, f"the verdict took {took:.1f} s"
            assert data["kind"] == "rank-conditional-hang" and data["odd_ranks"] == [HANG_RANK]
            line = next(i for i, t in enumerate(JOB.read_text().splitlines(), 1) if "no other rank ever joins" in t)
            assert data["verdict"] == (
                f"rank-conditional collective (rank {HANG_RANK} on host hostb): all_reduce #11 on default_pg at "
                f"{JOB}:{line} in main, under `if rank == hang_rank:`"
            )
            # every rank answered: hostb's by the request in the run directory (no signal
            # reaches them); hosta's by the signal, or by the request when their probe
            # thread looked at it before the signal came (one dump either way)
            dumped = {s["rank"]: s["dumped"] for s in data["ranks"]}
            assert all(dumped[n] in ("signal", "request") for n in range(PER_HOST)), dumped
            assert all(dumped[n] == "request" for n in range(PER_HOST, 2 * PER_HOST)), dumped
            assert data["silent"] == []
            # ranks whose answers agree (the same calls in flight and made, stack, step) are
            # read a few at a time; the others are told by their records, the odd rank never
            told = {s["rank"]: s["told_by"] for s in data["ranks"] if "told_by" in s}
            assert len(told) >= 3 and HANG_RANK not in told, told
            assert all(by not in told and by != HANG_RANK for by in told.values()), told
            assert any(n.startswith(f"{len(told)} of {2 * PER_HOST} ranks told by") for n in data["notes"])
            # a rank of the other host stopped: named with its host, local rank and last record's age
            os.kill(_pid_of_rank(hosts[1], 13), signal.SIGSTOP)
            again, _ = _hang_on(hosts[0], out, "--wait", "2")
            [silent] = again["silent"]
            assert (silent["rank"], silent["host"], silent["local_rank"]) == (13, "hostb", 5)
            assert silent["last_record_age_s"] is not None and silent["process"] is None  # not this host's
            assert any(n.startswith("rank 13 (host hostb, local rank 5) did not answer in 2 s") for n in again["notes"])
            assert again["odd_ranks"] == [HANG_RANK]  # the rest still diagnosed
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)
