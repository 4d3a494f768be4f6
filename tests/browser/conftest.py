"""A real headless Chromium (Debian's ``chromium``, driven by the ``playwright`` package with
``executable_path``; Playwright's own browser download is never used). Tests skip with the
reason when either is missing."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

#: The flags a closed network needs: without the background-networking ones Chromium keeps
#: trying to reach Google's services (requests a test would count).
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]


def chromium_path() -> str | None:
    return os.environ.get("LORASCOPE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


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
