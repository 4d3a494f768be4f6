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
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from healthy_runs import JOB, REPO, Config, analyze, run_one  # the same runner

VARIANTS = REPO / "probes" / "variants.py"
STALL = ("--fault", "rank1-stall", "--fault-step", "5", "--pg-timeout", "900")


@dataclass(frozen=True)
class Scenario:
    config: Config
    stop: signal.Signals
    expected: str
    rank: int


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "runs" / "stopped-hangs", help="where run directories are kept")
    p.add_argument("--after", type=float, default=30.0, help="seconds past the first step to stop the job")
    p.add_argument("--analyze-only", action="store_true", help="re-analyse the kept runs, run no job")
    args = p.parse_args(argv)
    print(f"{'scenario':<26} {'expected':<24} {'named':>5}  top finding")
    named = 0
    for s in SCENARIOS:
        out = args.out / s.config.name
        if not args.analyze_only:
            subprocess.run(["rm", "-rf", str(out)], check=True)
            assert s.config.job in (JOB, VARIANTS)
            rc, wall = run_one(s.config, out, 30, False, 300.0, (s.stop, args.after))
            print(f"{s.config.name}: exit {rc} in {wall:.0f} s, stopped by {s.stop.name}", file=sys.stderr)
        findings = analyze(out).get("findings", [])
        top = findings[0] if findings else None
        hit = top is not None and top["id"] == s.expected and top["ranks"] == [s.rank]
        named += hit
        shown = f"{top['id']} {top['confidence']} ranks {top['ranks']}: {top['title'][:90]}" if top else "(none)"
        print(f"{s.config.name:<26} {s.expected + f' r{s.rank}':<24} {'yes' if hit else 'no':>5}  {shown}")
    print(f"\n{named} of {len(SCENARIOS)} stopped hangs named as expected")
    return 0


if __name__ == "__main__":
    sys.exit(main())
