"""Render the example reports: ``python -m lorascope.report.gallery`` (from the repository root).

Every ``FIXTURES/<scenario>/manifest.json`` is a recorded run directory; its report goes to
``OUT/<scenario>.html``. Rendering is deterministic, so a fixture that did not change
gives the same file, and the committed reports show exactly what the code renders.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lorascope.analysis import analyze
from lorascope.errors import LorascopeError
from lorascope.report.write import write_report
from lorascope.rundir.format.schema import MANIFEST_FILE


def scenarios(fixtures: Path) -> list[Path]:
    """Every run directory directly under ``fixtures``, by name."""
    return sorted(p.parent for p in fixtures.glob(f"*/{MANIFEST_FILE}"))


def render_all(fixtures: Path, out: Path) -> list[tuple[Path, str]]:
    """Render each scenario; returns (report path, problem or '') per scenario."""
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for run_dir in scenarios(fixtures):
        target = out / f"{run_dir.name}.html"
        try:
            size = write_report(analyze(run_dir), target)
        except LorascopeError as exc:
            results.append((target, str(exc)))
        else:
            results.append((target, ""))
            print(f"{target}  {size / 1024:.0f} KiB  ({run_dir})")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lorascope.report.gallery", description=__doc__.splitlines()[0])
    parser.add_argument("--fixtures", type=Path, default=Path("fixtures"), help="folder of run directories")
    parser.add_argument("--out", type=Path, default=Path("reports"), help="folder for the HTML reports")
    args = parser.parse_args(argv)
    results = render_all(args.fixtures, args.out)
    if not results:
        print(f"no run directory under {args.fixtures} (looked for */{MANIFEST_FILE})", file=sys.stderr)
        return 1
    failed = [(t, why) for t, why in results if why]
    for target, why in failed:
        print(f"{target}: not rendered: {why}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
