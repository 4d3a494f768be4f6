"""The ``slow`` marker: the second planting or variant of an end-to-end scenario whose
first one stays in the default run (CI runs the default run; each detector, launcher and
healthy job is covered there). Deselected unless asked for, and never silently: the
terminal summary says how many were left out and how to run them.

Hypothesis runs without its timing checks: the tests run on small shared machines, where
generating an example can take a second; what they test is not time."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("lorascope", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("lorascope")

_LEFT_OUT = pytest.StashKey[int]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow",
        action="store_true",
        help="also run the tests marked slow (second plantings of the e2e scenarios; deselected by default)",
    )


def _asked_for_slow(config: pytest.Config) -> bool:
    return bool(config.getoption("--slow")) or "slow" in (config.getoption("-m") or "")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _asked_for_slow(config):
        return
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    if slow:
        items[:] = [item for item in items if item.get_closest_marker("slow") is None]
        config.hook.pytest_deselected(items=slow)
    config.stash[_LEFT_OUT] = len(slow)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    left_out = config.stash.get(_LEFT_OUT, 0)
    if left_out:
        terminalreporter.write_line(
            f"{left_out} test(s) marked slow were deselected (second plantings of e2e scenarios): "
            "run them with `python -m pytest --slow` (everything) or `python -m pytest -m slow` (only them)"
        )
