"""Which stack frames are the job's: torch's and lorascope's probes' are not, wherever the
interpreter lives (the GPU check's machine keeps its virtual environment in /opt/torch)."""

from __future__ import annotations

import pytest

from lorascope.ingest.flight.reader import call_site
from lorascope.ingest.frames import is_user_frame, site_of

VENV = "/opt/torch/.venv/lib/python3.12/site-packages"


@pytest.mark.parametrize(
    ("filename", "user"),
    [
        (f"{VENV}/transformers/models/llama/modeling_llama.py", True),
        (f"{VENV}/torch/nn/modules/module.py", False),
        ("/home/me/pytorch/torch/nn/modules/linear.py", False),  # a source checkout
        ("/home/me/pytorch/torch/_tensor.py", False),
        ("/opt/torch/train.py", True),  # the job's own, in a directory named torch
        (f"{VENV}/lorascope/probes/steps.py", False),
        ("/work/main/lorascope/probes/collectives.py", False),
        ("/work/lorascope/probes/train_lora.py", True),  # the repository's jobs, not the probes
        ("/srv/job/train.py", True),
    ],
)
def test_user_frames(filename: str, user: bool) -> None:
    assert is_user_frame({"filename": filename, "line": 1, "name": "f"}) is user


def test_site_skips_the_probes_wrapper() -> None:
    frames = [
        {"filename": f"{VENV}/torch/nn/modules/linear.py", "line": 134, "name": "forward"},
        {"filename": "/work/main/lorascope/probes/steps.py", "line": 249, "name": "forward"},
        {"filename": "/work/main/probes/train_lora.py", "line": 343, "name": "compute_loss"},
    ]
    assert site_of(frames) == "/work/main/probes/train_lora.py:343 in compute_loss"


def test_flight_call_site_under_a_venv_named_torch() -> None:
    frames = [
        "torch/distributed/distributed_c10d.py:4401 in gather",
        "/work/main/lorascope/probes/collectives.py:482 in wrapper",
        "/opt/torch/job/train.py:413 in gather_to_rank0",
    ]
    assert call_site(frames) == "/opt/torch/job/train.py:413 in gather_to_rank0"
