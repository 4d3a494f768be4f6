"""Secrets never reach the report page."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorascope.ingest.load import load_bundle
from lorascope.report.data import build_report_data
from lorascope.report.render import render
from lorascope.report.scrub import REDACTED, scrub, scrub_text
from tests.helpers import RankSpec, write_run

SECRET = "hf_abcdefghijklmnopqrstuvwxyz0123"


@pytest.mark.parametrize(
    "text, kept",
    [
        (f"HF_TOKEN={SECRET} torchrun train.py", "HF_TOKEN="),
        ("WANDB_API_KEY='two words' python x.py", "WANDB_API_KEY="),
        ("x.py --api-key=s3cr3t-value --steps 8", "--steps 8"),
        ("x.py --hub_token s3cr3t-value --steps 8", "--steps 8"),
        ("git clone https://bob:s3cr3t-value@example.org/x", "https://bob:"),
        ("{'db_password': 's3cr3t-value', 'lr': 0.1}", "'lr': 0.1"),
        ("Authorization: Bearer s3cr3t-value-xyz", "Authorization: Bearer"),
        (f"loaded token {SECRET}", "loaded token"),
    ],
)
def test_secret_values_are_redacted(text: str, kept: str) -> None:
    out = scrub_text(text)
    assert "s3cr3t" not in out and SECRET not in out and "two words" not in out
    assert REDACTED in out and kept in out


@pytest.mark.parametrize(
    "text",
    [
        "--max-tokens 100 --num_key_value_heads 4 MAX_TOKENS=100",
        "KeyError: 'lora_A'",
        "tokenizer_class=LlamaTokenizer",
        "--password 1234",
    ],
)
def test_ordinary_values_are_kept(text: str) -> None:
    assert scrub_text(text) == text


def test_structures() -> None:
    assert scrub(["deepspeed", "--hf-token", "abc", "--steps", "8"]) == [
        "deepspeed",
        "--hf-token",
        REDACTED,
        "--steps",
        "8",
    ]
    cfg = {
        "num_key_value_heads": 4,
        "hub_token": "abc",
        "tokenizer_class": "T",
        "nested": [{"AWS_SECRET_ACCESS_KEY": "k", "r": 8}],
    }
    assert scrub(cfg) == {
        "num_key_value_heads": 4,
        "hub_token": REDACTED,
        "tokenizer_class": "T",
        "nested": [{"AWS_SECRET_ACCESS_KEY": REDACTED, "r": 8}],
    }


def test_no_secret_in_the_page(tmp_path: Path) -> None:
    run_dir = write_run(
        tmp_path,
        [RankSpec(exception=("ValueError", "bad request: api_key=s3cr3t-exc")), RankSpec()],
        command=["env", f"HF_TOKEN={SECRET}", "torchrun", "train.py", "--wandb-key", "s3cr3t-argv"],
        argv=["train.py", "--hub_token=s3cr3t-rank-argv"],
        configs={
            "model": {"hub_token": "s3cr3t-config", "num_key_value_heads": 4},
            "deepspeed": {"wandb": {"api_key": "s3cr3t-ds"}},
        },
    )
    page = render(build_report_data(load_bundle(run_dir), []))
    assert "s3cr3t" not in page and SECRET not in page
    assert page.count(REDACTED) >= 5 and "num_key_value_heads" in page
