"""Session fixtures of the end-to-end tests: they run the real 2-rank LoRA job
(probes/train_lora.py) on CPU over gloo, under `lorascope run`. The helpers that start it
are in tests/helpers.py."""

from __future__ import annotations

import pytest

from tests.helpers import Finished, bare, free_port, losses, probed, torchrun


@pytest.fixture(scope="session")
def torchrun_run(tmp_path_factory: pytest.TempPathFactory) -> Finished:
    """The healthy job, 20 steps under torchrun, probed (shared by several tests)."""
    out = tmp_path_factory.mktemp("torchrun") / "run"
    return probed(out, torchrun(free_port(), "--steps", "20", "--print-losses"))


@pytest.fixture(scope="session")
def bare_losses() -> list[str]:
    """Rank 0's losses of the same 20-step job without lorascope."""
    proc = bare(torchrun(free_port(), "--steps", "20", "--print-losses"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return losses(proc.stdout)
