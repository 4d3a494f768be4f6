"""`lorascope attach` without a GPU: how a process is injected (chosen by its Python, read
from /proc), the scripts it is given, the request run inside a process, the ranks found
under a launcher, who may be attached, and, with gdb, real processes attached, dumped on
signal and detached (the probes/ job itself is attached in tests/e2e/test_attach.py)."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

from lorascope.hang.ask import tgkill
from lorascope.hang.targets import verify
from lorascope.inject import gdb as gdb_inject
from lorascope.inject import remote
from lorascope.inject.attach import explain, refusal
from lorascope.inject.procs import Process, describe, method_for, python_version, ranks_of
from lorascope.probes.collectives import CollectiveProbe
from lorascope.probes.live import one_line, script_source
from lorascope.rundir.format.procfs import start_ticks
from lorascope.rundir.format.ranks import Identity
from lorascope.rundir.format.schema import DUMP_SIGNAL
from lorascope.rundir.format.writer import record_attach
from lorascope.rundir.loading.reader import load_run
from tests.helpers import LORASCOPE, REPO, Call, RankSpec, why_no_ptrace, write_run

needs_gdb = pytest.mark.skipif(why_no_ptrace() is not None, reason=str(why_no_ptrace()))
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a process as another user (setpriv)")
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


# -- the path chosen by the target's Python --------------------------------------------------


def test_the_injection_follows_the_targets_python_not_ours() -> None:
    maps = b"7f00-7f01 r-xp 0 08:01 1 /usr/lib/libpython3.14.so.1.0\n"
    assert python_version(maps, "/usr/bin/python3.14") == (3, 14)
    assert python_version(maps, "/opt/bin/whatever") == (3, 14)  # the library says it
    assert python_version(b"", "/usr/bin/python3.11") == (3, 11)  # a static build: its name
    assert python_version(b"", "/usr/bin/sleep") is None
    assert method_for((3, 14)) == method_for((3, 15)) == "remote_exec"
    assert method_for((3, 13)) == method_for((3, 10)) == "gdb"
    me = describe(os.getpid())
    assert me.python == sys.version_info[:2] and me.why is None


def test_a_process_that_is_not_python_is_named() -> None:
    proc = subprocess.Popen(["sleep", "30"])
    try:
        found = describe(proc.pid)
        assert found.why is not None and "not a Python process" in found.why and found.fix
    finally:
        proc.kill()
        proc.wait()


def test_the_scripts_compile_and_say_how_they_run(tmp_path: Path) -> None:
    request = {"action": "attach", "pid": 7, "run_dir": str(tmp_path), "result": str(tmp_path / "r.json")}
    compile(script_source(request), "script", "exec")
    compile(one_line(str(tmp_path / "s.py")), "line", "exec")
    gdb_script = gdb_inject.script("print(1)", "queue")
    compile(gdb_script, "gdb-script", "exec")
    assert '"mode": "queue"' in gdb_script and "Py_AddPendingCall" in gdb_script
    cmd = gdb_inject.command("gdb", 7, tmp_path / "g.py")
    assert cmd.index("set auto-solib-add off") < cmd.index("-p")  # libtorch's symbols never read
    assert remote.command(7, tmp_path / "s.py") == ["/proc/7/exe", "-I", "-c", remote.CALL, "7", str(tmp_path / "s.py")]
    assert remote.classify(1, "PermissionError: [Errno 1] Operation not permitted")[0] == "ptrace-denied"
    assert remote.classify(1, "RuntimeError: Remote debugging is not enabled in the remote process")[0] == (
        "remote-debug-off"
    )
    assert gdb_inject.parse('noise\nLORASCOPE {"ok": true, "stopped_ms": 3.5}\n') == {"ok": True, "stopped_ms": 3.5}


# -- the request, run inside a process -------------------------------------------------------

RUN_AS_GDB_WOULD = textwrap.dedent(
    """
    import sys, time
    exec(sys.argv[1], {"__name__": "__main__"})  # PyRun_SimpleString's namespace: __main__'s
    print("alive", flush=True)
    time.sleep(float(sys.argv[2]))
    """
)


def _request(tmp_path: Path, pid: int, action: str, name: str) -> tuple[Path, Path]:
    result = tmp_path / f"{name}.json"
    script = tmp_path / f"{name}.py"
    run_dir = tmp_path / "run"
    request = {"action": action, "pid": pid, "run_dir": str(run_dir), "result": str(result), "how": "test"}
    script.write_text(script_source(request))
    return script, result


def test_a_failure_inside_the_injected_code_never_reaches_the_job(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("raise SystemExit(3)\n")
    res = subprocess.run(
        [sys.executable, "-c", RUN_AS_GDB_WOULD, one_line(str(bad)), "0"], capture_output=True, text=True, env=ENV
    )
    assert res.returncode == 0 and "alive" in res.stdout, res.stderr
    missing = subprocess.run(
        [sys.executable, "-c", RUN_AS_GDB_WOULD, one_line(str(tmp_path / "gone.py")), "0"],
        capture_output=True,
        text=True,
        env=ENV,
    )
    assert missing.returncode == 0 and "alive" in missing.stdout and not missing.stderr


def test_a_request_attaches_once_and_writes_its_result(tmp_path: Path) -> None:
    """The script a process runs: the probes start (no torch here), the result says so, the
    start record says the run was attached; the same request run again does nothing."""
    code = textwrap.dedent(
        """
        import os, sys
        from lorascope.probes.live import one_line, script_source
        def make(name, action, run="/run"):
            request = {"action": action, "pid": os.getpid(), "run_dir": sys.argv[1] + run,
                       "result": sys.argv[1] + "/" + name + ".json", "how": "test"}
            path = sys.argv[1] + "/" + name + ".py"
            open(path, "w").write(script_source(request))
            return one_line(path)
        for name in ("first", "first"):  # the same request twice (a queued call after the direct one)
            exec(make(name, "attach"), {"__name__": "__main__"})
        exec(make("second", "attach"), {"__name__": "__main__"})
        exec(make("elsewhere", "attach", "/other"), {"__name__": "__main__"})
        import glob, time
        deadline = time.time() + 30  # the attach dump is written by a thread of its own
        while time.time() < deadline and not any(
            '"reason": "attach"' in open(f).read() or '"reason":"attach"' in open(f).read()
            for f in glob.glob(sys.argv[1] + "/run/ranks/rank-0/*.jsonl")
        ):
            time.sleep(0.05)
        exec(make("off", "detach"), {"__name__": "__main__"})
        print("alive", flush=True)
        """
    )
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=ENV)
    assert res.returncode == 0 and "alive" in res.stdout, res.stderr
    first = json.loads((tmp_path / "first.json").read_text())
    assert first["ok"] and first["rank"] == 0 and first["main_thread"] and first["how"] == "test"
    assert first["pause_ms"] > 0
    second = json.loads((tmp_path / "second.json").read_text())
    assert second["ok"] and second["error"] == "already attached"
    elsewhere = json.loads((tmp_path / "elsewhere.json").read_text())
    assert not elsewhere["ok"] and elsewhere["error"] == f"already attached, recording into {tmp_path / 'run'}"
    assert json.loads((tmp_path / "off.json").read_text())["ok"]
    run = load_run(tmp_path / "run")
    rank = run.ranks[0]
    assert rank.start["attached"]["how"] == "test" and rank.start["attached"]["proc_start_ticks"] > 0
    assert rank.end is not None and rank.end["status"] == "detached"
    assert [d["reason"] for d in rank.dumps] == ["attach"]
    assert any("attached to a running job" in w for w in run.warnings)


def test_deepspeeds_captured_collectives_are_pointed_at_the_wrappers() -> None:
    """DeepSpeed's backend took all_gather_into_tensor before the attach: re-pointed."""

    def all_gather_into_tensor() -> None: ...

    def wrapper() -> None: ...

    wrapper.__wrapped__ = all_gather_into_tensor  # type: ignore[attr-defined]
    wrapper.__lorascope__ = True  # type: ignore[attr-defined]
    backend = SimpleNamespace(all_gather_function=all_gather_into_tensor, reduce_scatter_function=None)
    probe = CollectiveProbe.__new__(CollectiveProbe)
    probe._c10d = SimpleNamespace(all_gather_into_tensor=wrapper)  # type: ignore[assignment]
    probe.install_deepspeed_comm(SimpleNamespace(cdb=backend))  # type: ignore[arg-type]
    assert backend.all_gather_function is wrapper and backend.reduce_scatter_function is None


# -- which processes -------------------------------------------------------------------------


def test_the_ranks_under_a_launcher_are_its_descendants_with_rank_variables() -> None:
    code = textwrap.dedent(
        """
        import os, subprocess, sys, time
        kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                 env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2"})
                for r in (1, 0)]
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # no rank variables
        print("ready", flush=True)
        time.sleep(60)
        """
    )
    env = {k: v for k, v in ENV.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert launcher.stdout is not None and launcher.stdout.readline().strip() == "ready"
        found = ranks_of(launcher.pid)
        assert [(p.identity.rank, p.identity.world_size) for p in found] == [(0, 2), (1, 2)]
        assert all(p.python == sys.version_info[:2] and p.why is None for p in found)
    finally:
        for child in [launcher.pid, *(p.pid for p in ranks_of(launcher.pid))]:
            os.kill(child, 9)
        launcher.wait()


def test_only_the_calling_users_processes_unless_root_says_so() -> None:
    theirs = Process(1234, Identity(0, 0, 1, "env"), uid=os.getuid() + 1, python=(3, 11))
    refused = refusal(theirs, any_user=False)
    assert refused is not None and "not by" in refused[0]
    assert refusal(theirs, any_user=True) is (None if os.getuid() == 0 else refusal(theirs, any_user=True))
    if os.getuid() == 0:
        assert "--any-user" in refused[1]
    mine = Process(1234, Identity(0, 0, 1, "env"), uid=os.getuid(), python=(3, 11))
    assert refusal(mine, any_user=False) is None


# -- real processes, through gdb ---------------------------------------------------------------

LOOP = "import time\nwhile True:\n    time.sleep(0.05)\n"
BLOCKED = "import socket\na, b = socket.socketpair()\na.recv(1)\n"


@contextmanager
def python_process(code: str, *prefix: str) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([*prefix, sys.executable, "-c", code], env=ENV, text=True)
    time.sleep(0.5)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def attach(run_dir: Path, *args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*prefix, *LORASCOPE, "attach", "--out", str(run_dir), *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )


def _wait_for(check, timeout: float = 30.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.time() + timeout
    while time.time() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


@needs_gdb
def test_gdb_attaches_a_process_dumps_it_on_signal_and_detaches(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with python_process(LOOP) as proc:
        res = attach(run_dir, "--pid", str(proc.pid), "--json")
        assert res.returncode == 0, res.stdout + res.stderr
        entry = json.loads(res.stdout)
        assert "nothing before t is recorded" in entry["unknown_before"]
        [p] = entry["processes"]
        assert p["ok"] and p["how"] == ["gdb-queue", "ran by gdb-queue"] and p["dump_thread"], p
        assert _wait_for(lambda: any(d["reason"] == "attach" for d in load_run(run_dir).ranks[0].dumps))
        tgkill(proc.pid, p["dump_thread"], DUMP_SIGNAL)  # as `lorascope hang` asks an attached rank
        assert _wait_for(lambda: any(d["reason"] == "signal" for d in load_run(run_dir).ranks[0].dumps))
        off = attach(run_dir, "--detach")
        assert off.returncode == 0, off.stdout + off.stderr
        assert _wait_for(lambda: (load_run(run_dir).ranks[0].end or {}).get("status") == "detached")
        time.sleep(0.3)
        assert proc.poll() is None  # the job goes on
        again = attach(run_dir, "--detach")
        assert again.returncode != 0 and "nothing to detach" in again.stderr


@needs_gdb
def test_a_main_thread_blocked_in_native_code_is_attached_by_gdb_directly(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with python_process(BLOCKED) as proc:
        res = attach(run_dir, "--pid", str(proc.pid), "--json", "--wait", "1")
        assert res.returncode == 0, res.stdout + res.stderr
        [p] = json.loads(res.stdout)["processes"]
        assert p["ok"] and p["how"][:2] == ["gdb-queue", "gdb-direct"] and p["stopped_ms"] > 0, p
        assert proc.poll() is None


@needs_root
@needs_gdb
def test_another_users_process_is_refused_without_any_user() -> None:
    shared = Path(tempfile.mkdtemp(prefix="lorascope-attach-", dir="/tmp"))
    shared.chmod(0o755)
    try:
        nobody = ("setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups")
        with python_process(LOOP, *nobody) as proc, python_process(LOOP) as mine:
            res = attach(shared / "run", "--pid", str(proc.pid), "--pid", str(mine.pid))
            assert res.returncode == 1
            assert "NOT attached: owned by nobody" in res.stdout and "--any-user" in res.stdout, res.stdout
            assert "attached 1 of 2 processes" in res.stdout  # the others are attached all the same
            assert [p.name.split("-")[0] for p in (shared / "run").glob("attach/*.json")] == [str(mine.pid)]
            allowed = attach(shared / "theirs", "--pid", str(proc.pid), "--any-user")
            assert allowed.returncode == 0, allowed.stdout + allowed.stderr
            assert load_run(shared / "theirs").ranks[0].start["pid"] == proc.pid
    finally:
        shutil.rmtree(shared, ignore_errors=True)


@needs_root
@needs_gdb
def test_a_process_that_refuses_ptrace_is_named_with_the_reason_and_the_fix() -> None:
    """A non-dumpable process cannot be traced by its own (unprivileged) user."""
    shared = Path(tempfile.mkdtemp(prefix="lorascope-attach-", dir="/tmp"))
    shared.chmod(0o777)
    undumpable = "import ctypes, time\nctypes.CDLL(None).prctl(4, 0, 0, 0, 0)\nwhile True:\n    time.sleep(0.05)\n"
    nobody = ("setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups")
    try:
        with python_process(undumpable, *nobody) as proc:
            res = attach(shared / "run", "--pid", str(proc.pid), prefix=nobody)
            assert res.returncode == 1, res.stdout + res.stderr
            assert (
                "NOT attached: its memory map cannot be read (not dumpable, or ptrace is not permitted)" in res.stdout
            )
            assert "fix: run `lorascope attach` as the job's user, with ptrace allowed" in res.stdout, res.stdout
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_an_attached_run_compares_ranks_from_the_latest_ranks_first_call(tmp_path: Path) -> None:
    """Rank 0 was attached two calls before rank 1: its first two calls are no divergence."""
    run_dir = write_run(
        tmp_path / "run",
        [
            RankSpec(calls=[Call("broadcast")] * 2 + [Call("all_reduce")] * 3),
            RankSpec(calls=[Call("all_reduce")] * 3, first_seq=3),
        ],
    )
    for n in (0, 1):
        [stream] = (run_dir / "ranks" / f"rank-{n}").glob("*.jsonl")
        records = [json.loads(line) for line in stream.read_text().splitlines()]
        for rec in records:
            if rec["k"] == "start":
                rec["attached"] = {"t": rec["t"], "how": "gdb-queue"}
        stream.write_text("".join(json.dumps(r) + "\n" for r in records))
    res = subprocess.run([*LORASCOPE, "analyze", str(run_dir), "--json"], capture_output=True, text=True, env=ENV)
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert not [f for f in summary["findings"] if f["id"] in ("rank-conditional-hang", "collective-mismatch")]
    assert any("attached to a running job" in w for w in summary["warnings"])
    assert [c.seq for c in load_run(run_dir).ranks[0].collectives] == [3, 4, 5]


def test_gdb_refused_by_ptrace_and_no_gdb_are_named_with_the_fix(tmp_path: Path) -> None:
    fake = tmp_path / "gdb"
    fake.write_text("#!/bin/sh\necho 'ptrace: Operation not permitted.' >&2\nexit 1\n")
    fake.chmod(0o755)
    denied = gdb_inject.inject(os.getpid(), "pass", "queue", tmp_path / "s.py", str(fake))
    assert not denied.ok and denied.why == "ptrace-denied"
    why, fix = explain("ptrace-denied")
    assert "ptrace" in why and fix
    missing = gdb_inject.inject(os.getpid(), "pass", "queue", tmp_path / "s.py", str(tmp_path / "no-gdb"))
    assert not missing.ok and missing.why == "no-gdb" and "install gdb" in explain("no-gdb")[1]


def test_hang_signals_an_attached_process_only_while_its_pid_names_it(tmp_path: Path) -> None:
    """An attached process's environment predates the attach (no LORASCOPE_RUN_DIR): `hang`
    trusts the pid only at the start time recorded, and signals the dump thread recorded."""
    ticks = start_ticks(os.getpid())
    start = {"rank": 0, "pid": os.getpid(), "host": socket.gethostname(), "t": time.time()}
    write_run(tmp_path / "run", [RankSpec()])
    record_attach(
        tmp_path / "run",
        {"action": "attach", "processes": [{"pid": os.getpid(), "start_ticks": ticks, "ok": True, "dump_thread": 77}]},
    )
    mine = verify({**start, "attached": {"proc_start_ticks": ticks}}, tmp_path / "run")
    assert mine.ours and mine.attached and mine.thread == 77
    reused = verify({**start, "attached": {"proc_start_ticks": (ticks or 0) + 1}}, tmp_path / "run")
    assert not reused.ours and "another process" in reused.why
    plain = verify(start, tmp_path / "run")  # not attached, and no LORASCOPE_RUN_DIR: not ours
    assert not plain.ours


def test_the_path_is_chosen_by_the_targets_python_and_falls_back_to_gdb(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """3.14+: sys.remote_exec (its refusal: gdb's direct path); older: gdb's queued call.
    The injections are stood in for: each writes the result the process would."""
    from lorascope.inject import attach as orchestrate

    calls: list[tuple[str, str]] = []
    refuse = {"remote": False}

    def ran(script: Path) -> None:
        request = ast.literal_eval(re.search(r"run_request\((.*), began\)", script.read_text())[1])
        Path(request["result"]).write_text(json.dumps({"ok": True, "how": request["how"], "pause_ms": 1.0}))

    def fake_remote(pid: int, script: Path, exe: str | None = None) -> remote.RemoteOutcome:
        calls.append(("remote_exec", script.name))
        if refuse["remote"]:
            return remote.RemoteOutcome(False, "remote-debug-off", "", 1.0)
        ran(script)
        return remote.RemoteOutcome(True, None, "", 1.0)

    def fake_gdb(pid: int, code: str, mode: str, script_path: Path, gdb: str | None = None) -> gdb_inject.GdbOutcome:
        calls.append((f"gdb-{mode}", code))
        ran(Path(re.search(r"open\('([^']+)'", code)[1]))
        return gdb_inject.GdbOutcome(True, None, "", 5.0, 10.0)

    monkeypatch.setattr(orchestrate.remote, "inject", fake_remote)
    monkeypatch.setattr(orchestrate.gdb_inject, "inject", fake_gdb)
    monkeypatch.setattr(orchestrate.shutil, "which", lambda name: "/usr/bin/gdb")
    options = orchestrate.Options(run_dir=tmp_path / "run", wait_s=0.5)
    for python, refuse_remote, paths in (
        ((3, 14), False, ["remote_exec"]),
        ((3, 13), False, ["gdb-queue"]),
        ((3, 14), True, ["remote_exec", "gdb-direct"]),
    ):
        calls.clear()
        refuse["remote"] = refuse_remote
        proc = Process(os.getpid(), Identity(0, 0, 1, "env"), uid=os.getuid(), python=python)
        [attempt] = orchestrate.run_all([proc], options)
        assert attempt.ok and [c[0] for c in calls] == paths, (python, calls, attempt)
        assert attempt.how[-1] == f"ran by {paths[-1]}"
