"""A real headless Chromium (Debian's ``chromium``, driven by the ``playwright`` package with
``executable_path``; Playwright's own browser download is never used). Tests skip with the
reason when either is missing."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import CHROMIUM_ARGS, chromium_path


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    exe = chromium_path()
    if exe is None:
        pytest.skip("no chromium on PATH (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the playwright package is not installed (pip install playwright)")
    with sync_playwright() as p:  # launch() gives the browser a fresh, empty profile of its own
        b = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where screenshots go: $LORASCOPE_ARTIFACTS (CI keeps it) or the pytest tmp dir."""
    env = os.environ.get("LORASCOPE_ARTIFACTS")
    path = Path(env) if env else tmp_path_factory.mktemp("artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path
