#!/usr/bin/env python3
"""False alarms on healthy runs: the real ``probes/`` job, healthy, across configurations,
each run under ``lorascope run`` and analysed; prints one row per run with the warnings
and errors the detectors raised (a script, not a test).

Configurations vary what the detectors' rules read: sequence length, vocabulary,
micro-batch, 2 and 3 ranks, DeepSpeed ZeRO-3 / ZeRO-2 and plain DDP (``--engine torch``),
fp32 and bf16; each runs once bare and once with a CPU hog beside it (a busy-looping
process, so the ranks share the cores unevenly: the noise a shared machine adds). A
Trainer variant runs when ``probes/train_trainer.py`` exists; without it the table says
so. Run directories are kept under ``--out`` so that ``--analyze-only`` re-analyses them
after a detector changes, without running the jobs again.

    python benchmarks/healthy_runs.py --steps 12                # ~25 min on 2 cores
    python benchmarks/healthy_runs.py --analyze-only            # the kept runs, current detectors
    python benchmarks/healthy_runs.py --only ddp --no-hog       # a subset
    python benchmarks/healthy_runs.py --stop --steps 400         # each run stopped from outside

``--stop`` stops every run from outside at a random moment after its first step (seeded by
``--seed``), as a user or a scheduler does: Ctrl-C (SIGINT to ``lorascope run``) on every
other run, SIGTERM on the rest; a stopped healthy run must raise no warning either.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lorascope.rundir.loading.steps import read_steps, step_numbers

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "probes" / "train_lora.py"
TRAINER_JOB = REPO / "probes" / "train_trainer.py"
HOG = "import time\nwhile True:\n    sum(range(10_000))\n"


@dataclass(frozen=True)
class Config:
    name: str
    args: tuple[str, ...]
    nproc: int = 2
    job: Path = JOB
    #: The deepspeed launcher instead of torchrun.
    deepspeed_launcher: bool = False


CONFIGS: list[Config] = [
    Config("ds-default", ()),
    Config("ds-seq128", ("--seq", "128")),
    Config("ds-vocab8k", ("--vocab", "8192")),
    Config("ds-mb16", ("--micro-batch", "16")),
    Config("ds-3ranks", (), nproc=3),
    Config("ds-zero2-bf16", ("--zero", "2", "--dtype", "bf16")),
    Config("ds-launcher", (), deepspeed_launcher=True),
    Config("ddp-default", ("--engine", "torch")),
    Config("ddp-3ranks-seq64", ("--engine", "torch", "--seq", "64"), nproc=3),
    Config("ddp-vocab4k-mb8", ("--engine", "torch", "--vocab", "4096", "--micro-batch", "8")),
    Config("trainer", (), job=TRAINER_JOB),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def command(cfg: Config, steps: int) -> list[str]:
    port = str(free_port())
    if cfg.deepspeed_launcher:
        launch = ["deepspeed", "--num_gpus", str(cfg.nproc), "--master_port", port]
    else:
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(cfg.nproc)]
        launch += ["--master_port", port]
    return [*launch, str(cfg.job), "--steps", str(steps), *cfg.args]


def run_one(
    cfg: Config,
    out: Path,
    steps: int,
    hog: bool,
    timeout: float,
    stop: tuple[signal.Signals, float] | None = None,
    before_stop: Callable[[], None] | None = None,
) -> tuple[int, float]:
    """Run the job under ``lorascope run``; the job's exit status and wall seconds. With
    ``stop`` (a signal, seconds): that signal is sent to ``lorascope run`` that long after
    the job's first step record, once ``before_stop`` (if given) has returned."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    hog_proc = subprocess.Popen([sys.executable, "-c", HOG]) if hog else None
    start = time.monotonic()
    cmd = [sys.executable, "-m", "lorascope", "run", "--no-summary", "--out", str(out), "--", *command(cfg, steps)]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=_terminal_signals
    )
    try:
        if stop is not None:
            _stop_after_first_step(proc, out, stop, start + timeout, before_stop)
        output, _ = proc.communicate(timeout=max(1.0, timeout - (time.monotonic() - start)))
        rc = proc.returncode
        if rc and stop is None:
            (out / "job-output.txt").write_text(output)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        rc = 124
    finally:
        if hog_proc is not None:
            hog_proc.kill()
            hog_proc.wait()
    return rc, time.monotonic() - start


def _terminal_signals() -> None:
    """The job gets Ctrl-C as from a terminal, whatever this script inherited."""
    for signum in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


def _stop_after_first_step(
    proc: subprocess.Popen[str],
    out: Path,
    stop: tuple[signal.Signals, float],
    deadline: float,
    before_stop: Callable[[], None] | None,
) -> None:
    """Send ``stop``'s signal to ``proc`` its seconds after a step record first shows in
    the run directory (or not at all if the job ends first)."""
    while time.monotonic() < deadline and proc.poll() is None:
        if any(step_numbers(read_steps(p, "rank 0", []).records) for p in out.glob("ranks/rank-0/*.steps")):
            break
        time.sleep(0.5)
    time.sleep(stop[1])
    if before_stop is not None and proc.poll() is None:
        before_stop()
    if proc.poll() is None:
        proc.send_signal(stop[0])


def analyze(out: Path) -> dict:
    """``lorascope analyze --json`` of one run directory."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    res = subprocess.run(
        [sys.executable, "-m", "lorascope", "analyze", str(out), "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    if res.returncode not in (0, 4):
        return {"error": (res.stderr or res.stdout).strip().splitlines()[-1:]}
    return json.loads(res.stdout)


def row(name: str, rc: int | str, data: dict, stopped: str | None = None) -> dict:
    findings = data.get("findings", [])
    return {
        "run": name,
        "rc": rc,
        "stopped": stopped,
        "steps": max((r.get("steps") or 0 for r in data.get("ranks", [])), default=0),
        "errors": sum(f["severity"] == "error" for f in findings),
        "warnings": sum(f["severity"] == "warning" for f in findings),
        "notes": sum(f["severity"] == "info" for f in findings),
        "findings": [f"{f['id']} {f['severity']}: {f['title']}" for f in findings if f["severity"] != "info"],
        "analysis_error": data.get("error"),
    }


def print_table(rows: list[dict]) -> None:
    print(f"{'run':<28} {'rc':>4} {'steps':>5} {'errors':>6} {'warnings':>8} {'notes':>5}  stopped")
    for r in rows:
        print(
            f"{r['run']:<28} {r['rc']!s:>4} {r['steps']:>5} {r['errors']:>6} {r['warnings']:>8} {r['notes']:>5}"
            f"  {r.get('stopped') or ''}"
        )
        for f in r["findings"]:
            print(f"    {f}")
        if r["analysis_error"]:
            print(f"    analysis failed: {r['analysis_error']}")
    ran = [r for r in rows if r["rc"] in (0, "kept") or (r.get("stopped") and r["rc"] != 124)]
    alarms = sum(1 for r in ran if r["errors"] or r["warnings"])
    print(f"\n{len(ran)} healthy runs analysed; {alarms} with a warning or error")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "runs" / "healthy", help="where run directories are kept")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--only", help="only configurations whose name contains this")
    p.add_argument("--no-hog", action="store_true", help="skip the runs with a CPU hog beside them")
    p.add_argument("--analyze-only", action="store_true", help="re-analyse the kept runs, run no job")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument("--stop", action="store_true", help="stop each run from outside at a random moment")
    p.add_argument("--seed", type=int, default=0, help="the random moments of --stop")
    p.add_argument("--stop-within", type=float, default=20.0, help="--stop: at most this many s after step 1")
    args = p.parse_args(argv)
    chance = random.Random(args.seed)
    runs = 0

    rows = []
    for cfg in CONFIGS:
        if args.only and args.only not in cfg.name:
            continue
        if not cfg.job.exists():
            print(f"{cfg.name}: skipped: {cfg.job.relative_to(REPO)} is not in this checkout", file=sys.stderr)
            continue
        for hog in (False,) if args.no_hog else (False, True):
            name = cfg.name + ("+hog" if hog else "")
            out = args.out / name
            if args.analyze_only:
                if not (out / "manifest.json").exists():
                    continue
                rc: int | str = "kept"
            else:
                if out.exists():
                    subprocess.run(["rm", "-rf", str(out)], check=True)
                stop = None
                if args.stop:
                    stop = (signal.SIGINT if runs % 2 == 0 else signal.SIGTERM, chance.uniform(0, args.stop_within))
                    runs += 1
                rc, wall = run_one(cfg, out, args.steps, hog, args.timeout, stop)
                how = f", stopped by {stop[0].name} {stop[1]:.1f} s after step 1" if stop else ""
                print(f"{name}: exit {rc} in {wall:.0f} s{how}", file=sys.stderr, flush=True)
            stopped = None if not args.stop or args.analyze_only else f"{stop[0].name} +{stop[1]:.1f} s"
            rows.append(row(name, rc, analyze(out), stopped))
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
