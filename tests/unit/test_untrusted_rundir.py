"""A run directory is untrusted input (docs/security.md): it lives on a shared filesystem,
at a predictable path, and on-call engineers (often root) analyse other people's runs.
Each test plants one attack and runs the real CLI (capped in memory and time): nothing
outside the run directory is read or written, nothing of anyone else's runs in the job,
every output is well-formed, every input bounded."""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lorascope.analysis import analyze
from lorascope.rundir.format.safe_pickle import load_pickle
from tests.helpers import FIXTURES, capped_cli, copied_run, edit_records

SECRET = "SECRET-7f3a"
#: A job that attaches the probes as a lone process (rank 0 of 1) and writes a marker.
JOB = "import sys, torch; open(sys.argv[1], 'w').write('ran')"
#: The same without torch (faster): where what the probes write does not matter.
PLAIN_JOB = "import sys; open(sys.argv[1], 'w').write('ran')"


def _secret_file(tmp_path: Path, text: str = f"Fatal Python error: {SECRET}\n") -> Path:
    folder = tmp_path / "elsewhere"
    folder.mkdir(exist_ok=True)
    path = folder / "secret.txt"
    path.write_text(text)
    return path


def _strict(text: str) -> Any:
    """JSON as a strict parser reads it: NaN, Infinity and -Infinity are errors."""

    def refuse(name: str) -> None:
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def _run(
    out: Path, *flags: str, marker: Path, job: str = JOB, seconds: float = 120
) -> subprocess.CompletedProcess[str]:
    return capped_cli(
        "run", "--out", str(out), "--no-summary", *flags, "--", sys.executable, "-c", job, str(marker), seconds=seconds
    )


# --- 1. reads that leave the run directory ---------------------------------------------------


def test_a_faulthandler_file_that_is_a_symlink_out_is_not_read(tmp_path: Path) -> None:
    run = copied_run(tmp_path)
    secret = _secret_file(tmp_path)

    process = next((run / "ranks" / "rank-0").glob("*.0000.jsonl")).name.split(".")[0]

    def planted(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        fatal = {"file": f"{process}.fatal.txt", "k": "fatal_handler", "t": records[0]["t"]}
        return [records[0], fatal, *records[1:]]

    stream = edit_records(run, 0, planted)
    (stream.parent / f"{process}.fatal.txt").symlink_to(secret)
    shown = capped_cli("analyze", str(run), "--no-hta")
    assert shown.returncode == 0, shown.stderr
    page = tmp_path / "report.html"
    written = capped_cli("report", str(run), "-o", str(page))
    assert written.returncode == 0, written.stderr
    assert SECRET not in shown.stdout + shown.stderr
    assert SECRET not in page.read_text()


def _relocated_dumps(scenario: str, tmp_path: Path, source_dir: Path) -> Path:
    """The scenario's flight-recorder dumps with their frames in record_more.py moved to a
    copy of it in SOURCE_DIR."""
    fr = FIXTURES / "flight-recorder"
    source_dir.mkdir(parents=True, exist_ok=True)
    (source_dir / "record_more.py").write_text((fr / "record_more.py").read_text())

    def moved(value: Any) -> Any:
        if isinstance(value, str):
            return value.replace("/work/main/fixtures/flight-recorder/", f"{source_dir}/")
        if isinstance(value, list):
            return [moved(v) for v in value]
        if isinstance(value, tuple):
            return tuple(moved(v) for v in value)
        if isinstance(value, dict):
            return {moved(k): moved(v) for k, v in value.items()}
        return value

    out = tmp_path / scenario
    out.mkdir()
    for dump in sorted((fr / scenario).glob("rank-*.pickle")):
        (out / dump.name).write_bytes(pickle.dumps(moved(load_pickle(dump))))
    return out


def test_a_flight_dump_reads_no_source_outside_the_jobs_roots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Dumps given alone: source is read under the current directory only (the job's
    checkout), so a dump naming the analyst's own files shows none of their lines."""
    analyst = tmp_path / "analyst-home"
    dumps = _relocated_dumps("rank0-broadcast-missing", tmp_path, analyst)
    monkeypatch.chdir(tmp_path / "rank0-broadcast-missing")
    sources = analyze(dumps).bundle.sources
    assert not [site for site in sources if site.startswith(str(analyst))], sources
    monkeypatch.chdir(analyst)  # run from the job's checkout: its source is read
    assert [site for site in analyze(dumps).bundle.sources if site.startswith(str(analyst))]


#: The body of the jobs' all_reduce: say it is inside (the file $MARK), then wait.
WAIT = 'open(__import__("os").environ["MARK"], "w").close(); __import__("time").sleep(120)'


def _spawn(code: str, cwd: Path, mark: Path) -> subprocess.Popen[bytes]:
    """A process running CODE, once it is inside its all_reduce."""
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=cwd, env={**os.environ, "MARK": str(mark)})
    began = time.monotonic()
    while not mark.exists() and time.monotonic() - began < 60:
        time.sleep(0.1)
    return proc


def _why_no_pyspy() -> str | None:
    if shutil.which("py-spy") is None:
        return "py-spy is not installed"
    scope = Path("/proc/sys/kernel/yama/ptrace_scope")
    if os.geteuid() != 0 and scope.exists() and scope.read_text().strip() != "0":
        return "ptrace is restricted (yama ptrace_scope) and this is not root"
    return None


needs_pyspy = pytest.mark.skipif(_why_no_pyspy() is not None, reason=str(_why_no_pyspy()))


@needs_pyspy
def test_hang_pid_reads_no_fifo_device_or_file_outside_the_job(tmp_path: Path) -> None:
    """`hang --pid` reads the source of a frame only under the process's working directory,
    PYTHONPATH or script folder, and only a regular .py file: code compiled "from" a FIFO
    or /dev/zero blocked it or took 4 GB; a file of the analyst's showed its lines."""
    job = tmp_path / "job"
    job.mkdir()
    fifo = tmp_path / "fifo.py"
    os.mkfifo(fifo)
    secret = tmp_path / "analyst" / "secret.py"
    secret.parent.mkdir()
    secret.write_text(f"rank = 0\ndef all_reduce():\n    {WAIT}\nif rank == 0:  # {SECRET}\n    all_reduce()\n")
    body = f"def all_reduce():\n    {WAIT}\nall_reduce()\n"
    procs = [
        _spawn(f"exec(compile({body!r}, {str(fifo)!r}, 'exec'))", job, tmp_path / "in-0"),
        _spawn(f"exec(compile({body!r}, '/dev/zero', 'exec'))", job, tmp_path / "in-1"),
        _spawn(f"p = {str(secret)!r}; exec(compile(open(p).read(), p, 'exec'))", job, tmp_path / "in-2"),
    ]
    try:
        pids = [arg for p in procs for arg in ("--pid", str(p.pid))]
        proc = capped_cli("hang", *pids, "--json", seconds=90, cap=2 << 30)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert proc.returncode == 0, proc.stderr
    found = _strict(proc.stdout)
    assert [r["collective"] for r in found["ranks"]] == ["all_reduce"] * 3
    assert [r["condition"] for r in found["ranks"]] == [None, None, None]
    assert "rank == 0" not in json.dumps({k: v for k, v in found.items() if k != "fix"})  # the fix's example has it


def test_export_snapshot_copies_the_bytes_it_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The snapshot swapped for a symlink to a secret after the analysis read it: the copy
    is refused (not the secret)."""
    from lorascope.cli import export as export_cli
    from lorascope.cli import main

    run = copied_run(tmp_path, "gpu/oom")
    snapshot = run / "ranks" / "rank-0" / "vm-798.snapshot.oom.pickle"
    secret = _secret_file(tmp_path)
    real_analyze = export_cli.analyze

    def analyze_then_swap(*args: Any, **kwargs: Any) -> Any:
        analysis = real_analyze(*args, **kwargs)
        snapshot.unlink()
        snapshot.symlink_to(secret)
        return analysis

    monkeypatch.setattr(export_cli, "analyze", analyze_then_swap)
    out = tmp_path / "copy.pickle"
    with pytest.raises(SystemExit) as exited:
        main(["export", str(run), "--snapshot", "0", "-o", str(out)])
    assert exited.value.code == 3
    assert not out.exists() or SECRET not in out.read_bytes().decode("latin-1")


def test_a_fifo_or_device_manifest_does_not_hang_run(tmp_path: Path) -> None:
    """manifest.json a FIFO (or a symlink to /dev/zero) in the user's own run directory:
    `run` reads none of it, starts the job and records the launch."""
    for planted in ("fifo", "zero"):
        out = tmp_path / planted
        out.mkdir()
        manifest = out / "manifest.json"
        os.mkfifo(manifest) if planted == "fifo" else manifest.symlink_to("/dev/zero")
        marker = tmp_path / f"{planted}.ran"
        proc = _run(out, marker=marker, job=PLAIN_JOB)
        assert proc.returncode == 0, proc.stderr
        assert marker.exists()
        assert json.loads(manifest.read_text())["launches"], planted


def test_plan_refuses_a_fifo_config(tmp_path: Path) -> None:
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    proc = capped_cli("plan", "--model", str(fifo), seconds=30)
    assert proc.returncode == 3 and "FIFO" in proc.stderr, proc.stderr


# --- 2. writes that leave it, and code that is not the user's --------------------------------


def test_run_writes_through_no_planted_symlink(tmp_path: Path) -> None:
    out = tmp_path / "run"
    (out / "ranks").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (out / "manifest.json.lock").symlink_to(outside / "created-by-lock")
    (out / "ranks" / "rank-0").symlink_to(outside, target_is_directory=True)
    marker = tmp_path / "ran"
    proc = _run(out, marker=marker)
    assert proc.returncode == 0, proc.stderr  # the job's status: it ran, unprobed or not
    assert marker.exists()
    assert list(outside.iterdir()) == []


def test_the_launchers_own_files_are_written_through_no_planted_symlink(tmp_path: Path) -> None:
    """The names `run` and the bootstrap write that a planter can predict: the manifest's
    temporary file (.manifest.json.<pid>.tmp), processes.jsonl and the launch's bootstrap
    folder (bootstrap/<host>-<pid>, with a sitecustomize.py in it)."""
    from lorascope.cli import run as run_cli
    from lorascope.probes import bootstrap as boot
    from lorascope.rundir.format.ranks import discover
    from lorascope.rundir.format.writer import record_launch

    out = tmp_path / "run"
    planted = out / "bootstrap" / "h-1"
    planted.mkdir(parents=True)
    victims = {name: tmp_path / f"victim-{name}" for name in ("tmp", "log", "site")}
    for victim in victims.values():
        victim.write_text("untouched\n")
    (out / f".manifest.json.{os.getpid()}.tmp").symlink_to(victims["tmp"])
    (planted / "processes.jsonl").symlink_to(victims["log"])
    (planted / "sitecustomize.py").symlink_to(victims["site"])
    record_launch(out, "h-1", ["job"])
    assert victims["tmp"].read_text() == "untouched\n"
    boot._note({"bootstrap_dir": str(planted)}, "lone", discover({}))
    assert victims["log"].read_text() == "untouched\n"
    folder, launch_id = run_cli._prepare(out, "h-1", {"run_dir": str(out)})
    assert folder is not None and folder != planted and launch_id.startswith("h-1.")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert victims["site"].read_text() == "untouched\n"


def test_hang_writes_its_page_through_no_planted_symlink(tmp_path: Path) -> None:
    run = copied_run(tmp_path)
    target = _secret_file(tmp_path, "untouched\n")
    now = time.time()
    for s in range(-2, 60):  # the names the page may take in the next minute
        name = time.strftime("hang-%Y%m%d-%H%M%S.html", time.localtime(now + s))
        (run / name).symlink_to(target)
    proc = capped_cli("hang", str(run), "--wait", "1", seconds=60)
    assert proc.returncode == 0, proc.stderr
    assert target.read_text() == "untouched\n"
    assert any(p.is_file() and not p.is_symlink() for p in run.glob("hang-*.html"))


@pytest.mark.skipif(os.geteuid() != 0, reason="making a folder another user owns needs root (run as root in CI)")
def test_run_refuses_a_run_directory_another_user_owns(tmp_path: Path) -> None:
    out = tmp_path / "theirs"
    (out / "bootstrap").mkdir(parents=True)
    os.chown(out, 65534, 65534)
    marker = tmp_path / "ran"
    proc = _run(out, marker=marker)
    assert proc.returncode == 2 and "owned by" in proc.stderr and "--trust-run-dir" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not marker.exists()
    os.chown(out, 0, 0)
    os.chown(out / "bootstrap", 65534, 65534)  # the bootstrap folder in it, too
    proc = _run(out, marker=marker)
    assert proc.returncode == 2 and "bootstrap" in proc.stderr and not marker.exists(), proc.stderr


def test_run_refuses_a_group_writable_run_directory_unless_trusted(tmp_path: Path) -> None:
    out = tmp_path / "shared"
    out.mkdir()
    out.chmod(0o775)
    marker = tmp_path / "ran"
    proc = _run(out, marker=marker)
    assert proc.returncode == 2 and "writable by its group" in proc.stderr, proc.stderr
    assert not marker.exists()
    proc = _run(out, "--trust-run-dir", marker=marker)
    assert proc.returncode == 0 and marker.exists(), proc.stderr
    [bootstrap] = (out / "bootstrap").iterdir()
    assert stat.S_IMODE(bootstrap.stat().st_mode) == 0o700
    assert stat.S_IMODE((bootstrap / "sitecustomize.py").stat().st_mode) == 0o600


def test_run_refuses_an_out_path_with_a_colon(tmp_path: Path) -> None:
    """`--out runs/2026-01-05T10:30:00` on PYTHONPATH was two entries: no probes, and a
    sitecustomize.py in runs/2026-01-05T10 ran in the job."""
    planted = tmp_path / "runs" / "2026-01-05T10"
    planted.mkdir(parents=True)
    imported = tmp_path / "imported"
    (planted / "sitecustomize.py").write_text(f"open({str(imported)!r}, 'w').write('x')\n")
    marker = tmp_path / "ran"
    proc = _run(tmp_path / "runs" / "2026-01-05T10:30:00", marker=marker)
    assert proc.returncode == 2 and "PYTHONPATH" in proc.stderr, proc.stderr
    assert not marker.exists() and not imported.exists()


# --- 3. bounded, and never an internal error ------------------------------------------------


def test_a_huge_micro_batch_is_bounded(tmp_path: Path) -> None:
    """A logits record of shape[0] = 10^12 (the micro-batch the plan is checked against)
    and `plan --micro-batch 10**12` spun in plan/changes.py."""
    run = copied_run(tmp_path)

    def huge(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for r in records:
            if r["k"] == "logits" and r["where"] == "lm_head_output":
                r["shape"] = [10**12, *r["shape"][1:]]
        return records

    edit_records(run, 0, huge)
    edit_records(run, 1, huge)
    for args in (("analyze", str(run), "--no-hta"), ("report", str(run), "-o", str(tmp_path / "r.html"))):
        proc = capped_cli(*args, seconds=90)
        assert proc.returncode == 0, proc.stderr
    proc = capped_cli("export", str(run), "--perfetto", str(tmp_path / "t.json"), seconds=90)
    assert proc.returncode == 0, proc.stderr
    proc = capped_cli("plan", "--preset", "llama-3-8b", "--micro-batch", str(10**12), seconds=60)
    assert proc.returncode == 0, proc.stderr


def test_a_long_dotted_string_does_not_stall_the_report(tmp_path: Path) -> None:
    """300 KB of "a.a.a..." in the command line: the URL-credentials pattern backtracked
    (40k characters took 4.3 s)."""
    run = copied_run(tmp_path)
    edit_records(run, 0, lambda rs: [{**rs[0], "argv": ["train.py", "a." * 150_000]}, *rs[1:]])
    proc = capped_cli("report", str(run), "-o", str(tmp_path / "r.html"), seconds=45)
    assert proc.returncode == 0, proc.stderr


def test_non_utf8_argv_host_and_run_directory_path(tmp_path: Path) -> None:
    """A byte that is not UTF-8 in argv, in a host name and in the run directory's own
    path: report exited 1 (UnicodeEncodeError), a surrogate host failed analyze."""
    run = copied_run(tmp_path, name=os.fsdecode(b"run-\xff"))
    edit_records(run, 0, lambda rs: [{**rs[0], "argv": ["train.py", "--name", "\udcff"], "host": "vm\udcfe"}, *rs[1:]])
    shown = capped_cli("analyze", str(run), "--no-hta")
    assert shown.returncode == 0, shown.stderr
    assert "\\udcfe" in shown.stdout  # shown escaped
    page = tmp_path / "r.html"
    written = capped_cli("report", str(run), "-o", str(page))
    assert written.returncode == 0, written.stderr
    page.read_bytes().decode("utf-8")  # valid UTF-8


def test_json_outputs_are_strict(tmp_path: Path) -> None:
    """A NaN loss and an infinite step time: `analyze --json` and the Perfetto file parse
    with a strict parser (non-finite numbers are null)."""
    from lorascope.rundir.format.layout import HEADER, STEP, STEP_END, STEP_FIELDS, offset_of
    from lorascope.rundir.loading.steps import read_steps

    run = copied_run(tmp_path)
    [steps_file] = (run / "ranks" / "rank-0").glob("*.steps")
    table = read_steps(steps_file, "rank 0", [])
    ends = table.index[table.records["kind"] == STEP_END]
    data = bytearray(steps_file.read_bytes())  # the first step's time infinite
    at = HEADER.size + int(ends[0]) * STEP.size + offset_of(STEP_FIELDS, "dur")
    data[at : at + 8] = struct.pack("<d", math.inf)
    steps_file.write_bytes(bytes(data))
    last = int(table.records["step"][table.records["kind"] == STEP_END][-1])
    edit_records(
        run, 0, lambda records: [*records, {"k": "loss", "t": records[-1]["t"], "step": last, "loss": math.nan}]
    )
    shown = capped_cli("analyze", str(run), "--no-hta", "--json")
    assert shown.returncode == 0, shown.stderr
    _strict(shown.stdout)
    out = tmp_path / "t.json"
    exported = capped_cli("export", str(run), "--perfetto", str(out))
    assert exported.returncode == 0, exported.stderr
    _strict(out.read_text())


def test_escape_sequences_in_records_reach_no_terminal(tmp_path: Path) -> None:
    """A group name that clears the screen and prints a clean bill after an ERROR finding,
    a host with a bell: shown escaped."""
    run = copied_run(tmp_path, "hung-ranks")
    clear = "\x1b[2J\x1b[Hno findings; all ranks healthy\r\x07"
    for rank in (0, 1):
        edit_records(
            run,
            rank,
            lambda rs: [
                {**r, "host": r["host"] + "\x1b]0;x\x07"}
                if r["k"] == "start"
                else {**r, "name": clear}
                if r["k"] == "group"
                else r
                for r in rs
            ],
        )
    for args in (("analyze", str(run), "--no-hta", "--all-ranks"), ("hang", str(run), "--wait", "1", "--no-html")):
        proc = capped_cli(*args)
        assert proc.returncode in (0, 3), proc.stderr
        for char in "\x1b\x07\r":
            assert char not in proc.stdout + proc.stderr, (args, char)


# --- 4. `run` and the report keep going -----------------------------------------------------


def test_a_malformed_start_record_of_an_earlier_run_keeps_the_jobs_status(tmp_path: Path) -> None:
    out = tmp_path / "run"
    old = out / "ranks" / "rank-5"
    old.mkdir(parents=True)
    (old / "h-1.0000.jsonl").write_text('{"k":"start","t":1,"rank":"x","host":5}\n')
    marker = tmp_path / "ran"
    proc = capped_cli(
        "run", "--out", str(out), "--", sys.executable, "-c", PLAIN_JOB + "; sys.exit(7)", str(marker), seconds=120
    )
    assert proc.returncode == 7, proc.stderr
    assert marker.exists()


@pytest.mark.parametrize("value", ["nan", "inf", "1e308", "-1"])
def test_run_refuses_a_sample_interval_no_job_can_use(tmp_path: Path, value: str) -> None:
    marker = tmp_path / "ran"
    proc = _run(tmp_path / "run", "--sample-interval", value, marker=marker)
    assert proc.returncode == 2 and "--sample-interval" in proc.stderr, proc.stderr
    assert not marker.exists()


def test_a_report_of_many_ranks_that_wrote_only_a_start_record(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for rank in range(20):
        folder = run / "ranks" / f"rank-{rank}"
        folder.mkdir(parents=True)
        start = {"k": "start", "t": 1.0, "rank": rank, "world_size": 20, "local_rank": 0, "pid": 100 + rank}
        start |= {"host": "h", "argv": [], "versions": {}, "device": "cpu"}
        (folder / f"h-{100 + rank}.0000.jsonl").write_text(json.dumps(start) + "\n")
    (run / "manifest.json").write_text(json.dumps({"format": "lorascope-run", "version": 3, "launches": []}))
    for args in (("report", str(run), "-o", str(tmp_path / "r.html")), ("analyze", str(run), "--no-hta")):
        proc = capped_cli(*args)
        assert proc.returncode == 0, proc.stderr


def test_another_jobs_failed_launch_in_the_same_directory_is_not_blamed(tmp_path: Path) -> None:
    run = copied_run(tmp_path)
    manifest = json.loads((run / "manifest.json").read_text())
    earlier = {**manifest["launches"][0], "id": "vm-99", "pid": 99, "exit_status": 1}
    manifest["launches"].insert(0, earlier)
    (run / "manifest.json").write_text(json.dumps(manifest))
    proc = capped_cli("analyze", str(run), "--no-hta", "--json")
    assert proc.returncode == 0, proc.stderr
    assert "failed-after-exit" not in {f["id"] for f in _strict(proc.stdout)["findings"]}
