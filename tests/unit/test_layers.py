"""The layers import one way (docs/architecture.md): a package imports only packages of
lower layers, and the probes, which run inside other people's jobs, nothing of the
analysis side. Read from the source with ast, so a violation fails here before review."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lorascope"

#: Higher layers may import lower ones, never the reverse. Packages of one layer do not
#: import each other.
LAYERS: dict[str, int] = {
    "errors": 0,
    "units": 1,
    "rundir": 2,
    "probes": 3,
    "ingest": 3,
    "plan": 3,
    "detect": 4,
    "analysis": 5,
    "text": 6,
    "report": 6,
    "hang": 6,
    "inject": 6,
    "export": 6,
    "cli": 7,
    "__main__": 8,
}
#: The probe side's whole world (plus the package root for ``__version__``).
PROBE_SIDE = {"probes", "rundir", "units", "errors", "__init__"}


def _imports(path: Path) -> set[str]:
    """The lorascope packages a module imports (``lorascope.X...`` -> X)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "lorascope":
                found.add(parts[1] if len(parts) > 1 else "__init__")
    return found


def _package(path: Path) -> str:
    rel = path.relative_to(PACKAGE).parts
    return rel[0][:-3] if len(rel) == 1 else rel[0]


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if _package(p) != "__init__")


def test_every_package_has_a_layer() -> None:
    assert {_package(p) for p in MODULES} <= set(LAYERS), "add new packages to LAYERS (and docs/architecture.md)"


@pytest.mark.parametrize("module", MODULES, ids=[str(p.relative_to(PACKAGE)) for p in MODULES])
def test_imports_go_down(module: Path) -> None:
    own = _package(module)
    imported = _imports(module) - {own, "__init__"}
    upward = sorted(name for name in imported if LAYERS.get(name, -1) >= LAYERS[own])
    assert upward == [], f"{module.relative_to(PACKAGE)} ({own}, layer {LAYERS[own]}) imports {upward}"
    if own == "probes":
        assert imported <= PROBE_SIDE, f"the probes import {sorted(imported - PROBE_SIDE)}"


def test_the_check_bites() -> None:
    """A module of a low layer importing a higher one is caught (the rule is not vacuous)."""
    assert _imports(PACKAGE / "cli" / "analyze.py") & {"analysis", "report", "text"}
    assert LAYERS["rundir"] < LAYERS["detect"] < LAYERS["analysis"] < LAYERS["cli"]


def _modules_imported(path: Path) -> set[str]:
    """Every module a file imports, by its full dotted name (top-level imports and the
    ones inside functions alike)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


FORMAT_SIDE = sorted((PACKAGE / "rundir" / "format").glob("*.py"))
PROBE_MODULES = sorted((PACKAGE / "probes").glob("*.py"))


@pytest.mark.parametrize("module", FORMAT_SIDE + PROBE_MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_probe_side_reads_only_the_format(module: Path) -> None:
    """The run format (what the probes import) is standard library only and never imports
    the loading half; the probes import the format, never the loading half."""
    imported = _modules_imported(module)
    loading = sorted(m for m in imported if m.startswith("lorascope.rundir.loading"))
    assert loading == [], f"{module.relative_to(PACKAGE)} imports {loading}"
    if module.parent.name == "format":
        outside = sorted(
            m
            for m in imported
            if m.split(".")[0] not in sys.stdlib_module_names
            and m.split(".")[0] != "__future__"
            and not m.startswith(("lorascope.rundir.format", "lorascope.errors", "lorascope.units"))
            and m != "lorascope"
        )
        assert outside == [], f"{module.relative_to(PACKAGE)} imports {outside} (the format is standard library only)"


def test_the_format_check_bites() -> None:
    assert any(
        m.startswith("lorascope.rundir.loading")
        for m in _modules_imported(PACKAGE / "rundir" / "loading" / "reader.py")
    )
    assert FORMAT_SIDE and PROBE_MODULES
