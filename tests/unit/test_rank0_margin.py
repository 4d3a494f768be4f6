"""rank0-asymmetry: a finding at exactly its threshold is noise. A healthy DDP Trainer job
on CPU read "rank 0 holds 16.2 MiB more memory (6%)", "1.0x the threshold", on every try."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorascope.detect import rank0_asymmetry
from lorascope.ingest.load import load_bundle
from tests.helpers import RankSpec, write_run

MIB = 2**20


def _bundle(tmp_path: Path, extra_mib: float):  # type: ignore[no-untyped-def]
    """Two ranks at a flat 270 MiB (no growth: the 16 MiB floor is the threshold), rank 0
    ``extra_mib`` above at every sample."""
    bundle = load_bundle(write_run(tmp_path / "run", [RankSpec(steps=8), RankSpec(steps=8)]))
    for n, rank in bundle.run.ranks.items():
        for m in rank.mem:
            m["rss"] = int((270 + (extra_mib if n == 0 else 0)) * MIB)
    return bundle


def test_an_excess_at_the_threshold_is_not_a_finding(tmp_path: Path) -> None:
    assert rank0_asymmetry.detect(_bundle(tmp_path, 16.2)) == []


@pytest.mark.parametrize("extra", [24.5, 48.0])
def test_an_excess_past_the_margin_is(tmp_path: Path, extra: float) -> None:
    [finding] = rank0_asymmetry.detect(_bundle(tmp_path, extra))
    assert finding.ranks == [0]
    assert finding.confidence_reason.startswith(f"excess {extra / 16:.1f}x the threshold")
