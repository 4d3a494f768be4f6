#!/usr/bin/env python3
"""Hangs stopped from outside before anyone ran `lorascope hang` (a script, not a test).

On-call engineers often stop a hung job by hand (Ctrl-C on `lorascope run`, a `kill`, a
scheduler's SIGTERM) and analyse it afterwards. Each scenario plants a hang, stops the job
``--after`` seconds past its first step with the scenario's signal (sent to `lorascope
run`, which passes it on), and prints the verdict `analyze` makes of the run directory
next to the expected one. Written after the stop reading (hung-ranks, docs/detectors.md)
was fixed: none of them was used to develop it (S-ddp-stall-term was, later, for the
flight-recorder reading). Healthy runs stopped the same way: ``healthy_runs.py --stop``.
Two more groups (``--group``): F, DDP hangs only the flight recorder explains (a live
`lorascope hang` among them); R, stalls the job comes back from, and healthy jobs with the
stall watchdog set short (see the lists below).

    python benchmarks/stopped_hangs.py            # group S, ~3 min on 2 cores
    python benchmarks/stopped_hangs.py --group F  # ~3 min; --group R ~3 min
    python benchmarks/stopped_hangs.py --analyze-only [--group G] [--only NAME]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from healthy_runs import REPO, Config, analyze, run_one  # the same runner

VARIANTS = REPO / "probes" / "variants.py"
STALL = ("--fault", "rank1-stall", "--fault-step", "5", "--pg-timeout", "900")
STALL_ENV = "LORASCOPE_STALL_SECONDS"


@dataclass(frozen=True)
class Scenario:
    config: Config
    #: None: not stopped, left to its process-group timeout.
    stop: signal.Signals | None
    expected: str
    rank: int
    live: bool = False
    #: LORASCOPE_STALL_SECONDS for the job (None: the probes' own limit).
    stall_s: float | None = None
    steps: int = 30
    hog: bool = False
    #: The expected finding's severity ("" expected: no warning or error at all).
    severity: str = "error"


SCENARIOS = [
    Scenario(
        Config(
            "S-log-broadcast-int",
            ("--variant", "log-broadcast-hang", "--fault-step", "5", "--pg-timeout", "900"),
            job=VARIANTS,
        ),
        signal.SIGINT,
        "rank-conditional-hang",
        0,
    ),
    Scenario(Config("S-ddp-stall-term", ("--engine", "torch", *STALL)), signal.SIGTERM, "hung-ranks", 1),
    Scenario(
        Config("S-3ranks-stall-int", (*STALL, "--hidden", "48", "--intermediate", "96", "--layers", "3"), nproc=3),
        signal.SIGINT,
        "hung-ranks",
        1,
    ),
    Scenario(Config("S-ds-launcher-stall-int", STALL, deepspeed_launcher=True), signal.SIGINT, "hung-ranks", 1),
]


#: Group F: DDP hangs. DDP's gradient all_reduces and buffer broadcasts come from its C++
#: Reducer, unseen by the probes, so the waiting rank shows no call in flight: only the
#: flight-recorder dumps the probes write with each dump and ending say which rank is
#: ahead. Written after the flight reading (hung-ranks, docs/detectors.md) was fixed; its
#: tuning case was group S's S-ddp-stall-term. ``live``: `lorascope hang` runs on the job
#: before it is stopped, and its verdict is checked as well; F-ddp-timeout is not stopped:
#: the stall watchdog dumps a third into its 30 s process-group timeout, which ends it.
FLIGHT_SCENARIOS = [
    Scenario(
        Config(
            "F-ddp-3ranks-stall-int",
            ("--engine", "torch", *STALL, "--hidden", "48", "--intermediate", "96", "--layers", "3"),
            nproc=3,
        ),
        signal.SIGINT,
        "hung-ranks",
        1,
    ),
    Scenario(
        Config(
            "F-ddp-seq64-step2-term",
            (
                "--engine",
                "torch",
                *STALL[:2],
                "--fault-step",
                "2",
                "--pg-timeout",
                "900",
                "--seq",
                "64",
                "--vocab",
                "4096",
            ),
        ),
        signal.SIGTERM,
        "hung-ranks",
        1,
    ),
    Scenario(
        Config("F-ddp-mb8-hup", ("--engine", "torch", *STALL, "--micro-batch", "8", "--layers", "4")),
        signal.SIGHUP,
        "hung-ranks",
        1,
    ),
    Scenario(
        Config("F-ddp-timeout", ("--engine", "torch", *STALL[:2], "--fault-step", "4", "--pg-timeout", "30")),
        None,
        "hung-ranks",
        1,
    ),
    Scenario(
        Config("F-ddp-live-hang-term", ("--engine", "torch", *STALL, "--hidden", "96", "--intermediate", "192")),
        signal.SIGTERM,
        "hung-ranks",
        1,
        live=True,
    ),
]
#: Group R: stalls the job comes back from (the watchdog set to 4-6 s, the rank-1 stall
#: planting's sleep 12-20 s), and healthy jobs with the watchdog set to 0.2 s (it fires in
#: evaluations and slow steps), which must stay quiet. Written after the recovered-stall reading (hung-ranks, docs/detectors.md) was
#: fixed; its tuning run was the same planting under ZeRO-3 with a 15 s sleep at step 4.
RECOVERED = ("--fault", "rank1-stall", "--pg-timeout", "900")
RECOVERED_SCENARIOS = [
    Scenario(
        Config("R-ddp-stall15", ("--engine", "torch", *RECOVERED, "--fault-step", "4", "--stall-seconds", "15")),
        None, "hung-ranks", 1, stall_s=5.0, steps=12, severity="warning",
    ),
    Scenario(
        Config(
            "R-3ranks-stall12",
            (*RECOVERED, "--fault-step", "5", "--stall-seconds", "12", "--hidden", "48", "--layers", "3"),
            nproc=3,
        ),
        None, "hung-ranks", 1, stall_s=4.0, steps=12, severity="warning",
    ),
    Scenario(
        Config("R-zero2-stall20", ("--zero", "2", *RECOVERED, "--fault-step", "6", "--stall-seconds", "20")),
        None, "hung-ranks", 1, stall_s=6.0, steps=12, severity="warning",
    ),
    Scenario(
        Config("R-trainer-evals-healthy", ("--eval-steps", "2"), job=REPO / "probes" / "train_trainer.py"),
        None, "", 0, stall_s=0.2, steps=12,
    ),
    Scenario(Config("R-ds-hog-healthy", ()), None, "", 0, stall_s=0.2, steps=40, hog=True),
]  # fmt: skip
GROUPS = {"S": SCENARIOS, "F": FLIGHT_SCENARIOS, "R": RECOVERED_SCENARIOS}


def live_hang(out: Path) -> dict[str, Any]:
    """`lorascope hang --json` on the running job (its verdict, ``odd_ranks``, ``kind``)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "lorascope", "hang", str(out), "--json", "--no-html", "--wait", "20"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    try:
        found: dict[str, Any] = json.loads(res.stdout)
    except ValueError:
        return {"verdict": f"hang failed: {(res.stderr or res.stdout).strip()[-200:]}", "odd_ranks": [], "kind": "?"}
    return found


def _into(found: dict[str, Any], out: Path) -> None:
    found.update(live_hang(out))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "runs" / "stopped-hangs", help="where run directories are kept")
    p.add_argument("--after", type=float, default=30.0, help="seconds past the first step to stop the job")
    p.add_argument("--analyze-only", action="store_true", help="re-analyse the kept runs, run no job")
    p.add_argument("--only", help="only scenarios whose name contains this")
    p.add_argument(
        "--group",
        choices=sorted(GROUPS),
        default="S",
        help="S: stopped hangs; F: DDP hangs (flight recorder); R: stalls the job came back from",
    )
    args = p.parse_args(argv)
    scenarios = [s for s in GROUPS[args.group] if not args.only or args.only in s.config.name]
    print(f"{'scenario':<26} {'expected':<24} {'named':>5}  top finding")
    named = named_live = 0
    for s in scenarios:
        out = args.out / s.config.name
        if not args.analyze_only:
            subprocess.run(["rm", "-rf", str(out)], check=True)
            hang: dict[str, Any] = {}
            os.environ.pop(STALL_ENV, None)
            if s.stall_s is not None:
                os.environ[STALL_ENV] = str(s.stall_s)
            rc, wall = run_one(
                s.config,
                out,
                s.steps,
                s.hog,
                300.0,
                (s.stop, args.after) if s.stop is not None else None,
                functools.partial(_into, hang, out) if s.live else None,
            )
            how = f"stopped by {s.stop.name}" if s.stop is not None else "not stopped"
            print(f"{s.config.name}: exit {rc} in {wall:.0f} s, {how}", file=sys.stderr)
            if s.live:
                live_hit = hang.get("id") == s.expected and hang.get("odd_ranks") == [s.rank]
                named_live += live_hit
                print(f"  live `lorascope hang`: {'yes' if live_hit else 'no'}  {hang.get('verdict')}")
        findings = [f for f in analyze(out).get("findings", []) if f["severity"] in ("warning", "error")]
        top = findings[0] if findings else None
        if s.expected:
            hit = top is not None and (top["id"], top["severity"], top["ranks"]) == (s.expected, s.severity, [s.rank])
        else:
            hit = top is None
        named += hit
        shown = (
            f"{top['id']} {top['severity']} {top['confidence']} ranks {top['ranks']}: {top['title'][:90]}"
            if top
            else "(none)"
        )
        expected = f"{s.expected} {s.severity} r{s.rank}" if s.expected else "(quiet)"
        print(f"{s.config.name:<26} {expected:<24} {'yes' if hit else 'no':>5}  {shown}")
    print(f"\n{named} of {len(scenarios)} read as expected by `analyze`")
    if any(s.live for s in scenarios) and not args.analyze_only:
        print(f"{named_live} of {sum(s.live for s in scenarios)} named as expected by a live `lorascope hang`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
