#!/usr/bin/env python3
"""Hangs stopped from outside before anyone ran `lorascope hang` (a script, not a test).

On-call engineers often stop a hung job by hand (Ctrl-C on `lorascope run`, a `kill`, a
scheduler's SIGTERM) and analyse it afterwards. Each scenario plants a hang, stops the job
``--after`` seconds past its first step with the scenario's signal (sent to `lorascope
run`, which passes it on), and prints the verdict `analyze` makes of the run directory
next to the expected one. Written after the stop reading (hung-ranks, docs/detectors.md)
was fixed: none of them was used to develop it. Healthy runs stopped the same way:
``healthy_runs.py --stop``.

    python benchmarks/stopped_hangs.py            # ~5 min on 2 cores
    python benchmarks/stopped_hangs.py --analyze-only
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
from healthy_runs import JOB, REPO, Config, analyze, run_one  # the same runner

VARIANTS = REPO / "probes" / "variants.py"
STALL = ("--fault", "rank1-stall", "--fault-step", "5", "--pg-timeout", "900")


@dataclass(frozen=True)
class Scenario:
    config: Config
    #: None: not stopped, left to its process-group timeout.
    stop: signal.Signals | None
    expected: str
    rank: int
    live: bool = False


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
GROUPS = {"S": SCENARIOS, "F": FLIGHT_SCENARIOS}


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
    p.add_argument(
        "--group", choices=sorted(GROUPS), default="S", help="S: stopped hangs; F: DDP hangs (flight recorder)"
    )
    args = p.parse_args(argv)
    scenarios = GROUPS[args.group]
    print(f"{'scenario':<26} {'expected':<24} {'named':>5}  top finding")
    named = named_live = 0
    for s in scenarios:
        out = args.out / s.config.name
        if not args.analyze_only:
            subprocess.run(["rm", "-rf", str(out)], check=True)
            assert s.config.job in (JOB, VARIANTS)
            hang: dict[str, Any] = {}
            rc, wall = run_one(
                s.config,
                out,
                30,
                False,
                300.0,
                (s.stop, args.after) if s.stop is not None else None,
                functools.partial(_into, hang, out) if s.live else None,
            )
            how = f"stopped by {s.stop.name}" if s.stop is not None else "left to its timeout"
            print(f"{s.config.name}: exit {rc} in {wall:.0f} s, {how}", file=sys.stderr)
            if s.live:
                live_hit = hang.get("id") == s.expected and hang.get("odd_ranks") == [s.rank]
                named_live += live_hit
                print(f"  live `lorascope hang`: {'yes' if live_hit else 'no'}  {hang.get('verdict')}")
        findings = analyze(out).get("findings", [])
        top = findings[0] if findings else None
        hit = top is not None and top["id"] == s.expected and top["ranks"] == [s.rank]
        named += hit
        shown = f"{top['id']} {top['confidence']} ranks {top['ranks']}: {top['title'][:90]}" if top else "(none)"
        print(f"{s.config.name:<26} {s.expected + f' r{s.rank}':<24} {'yes' if hit else 'no':>5}  {shown}")
    print(f"\n{named} of {len(scenarios)} stopped hangs named as expected by `analyze`")
    if any(s.live for s in scenarios) and not args.analyze_only:
        print(f"{named_live} of {sum(s.live for s in scenarios)} named as expected by a live `lorascope hang`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
