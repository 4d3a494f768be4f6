"""`lorascope hang`'s flight-recorder dumps read ahead: a large one by a worker process,
the same records as read here; one that is refused, the same one-line error."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest

from lorascope.errors import BadInputError
from lorascope.hang import flights
from lorascope.hang.flights import EarlyFlights
from lorascope.ingest.flight.reader import read_flight_dump
from lorascope.rundir.loading import workers
from lorascope.rundir.loading.reader import RankData

REAL = Path(__file__).resolve().parents[2] / "fixtures" / "rank-conditional-hang" / "ranks" / "rank-1"


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("ran",))


def _rank(paths: list[Path]) -> RankData:
    rank = RankData(rank=1, start={}, files=[], dumps=[{"t": 100.0}])
    rank.flight_dumps = [{"t": 100.0, "path": str(p)} for p in paths]
    return rank


@pytest.mark.parametrize("cores", [2, 1])  # --workers 1: read in this process
def test_a_large_dump_reads_the_same_through_a_worker(tmp_path: Path, cores: int) -> None:
    real = tmp_path / "vm-10962.flight.stall.pickle"
    shutil.copy(next(REAL.glob("*.flight.stall-*.pickle")), real)
    evil = tmp_path / "vm-10962.flight.evil.pickle"
    evil.write_bytes(pickle.dumps({"entries": [], "pad": "x" * flights.POOL_FROM_BYTES, "v": _Evil()}, protocol=2))
    assert real.stat().st_size >= flights.POOL_FROM_BYTES
    workers.configure(cores)
    try:
        with EarlyFlights() as early:
            early.ahead(_rank([real, evil]))
            assert (early._pool is not None) == (cores > 1)
            assert repr(early(real, 1)) == repr(read_flight_dump(real, 1))
            with pytest.raises(BadInputError, match=r"refused: the pickle asks to import __builtin__\.print"):
                early(evil, 1)
    finally:
        workers.configure(None)
