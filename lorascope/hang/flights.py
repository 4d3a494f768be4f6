"""The flight-recorder dumps that go with the ranks' latest dumps, read as each rank
answers (while the others are still waited for) rather than all after the last one: at
1,024 ranks the safe unpickling of each is most of what is left to do once they answered.

A dump of torch's size (the last 2,000 collectives, ~370 KB) takes ~90 ms to read safely,
and what comes of it is a few hundred KB of plain records: those are read by worker
processes, one per core (``--workers``), while this process reads the ranks' streams.
"""

from __future__ import annotations

from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from types import TracebackType

from lorascope.detect.hang.diagnosis import FLIGHT_EARLY_S
from lorascope.errors import BadInputError
from lorascope.ingest.flight.reader import FlightDump, read_flight_dump
from lorascope.rundir.format import limits
from lorascope.rundir.loading import workers
from lorascope.rundir.loading.reader import RankData

#: A dump from this size on is read by a worker (a smaller one is read here: sending it
#: there and its records back costs about what reading it does).
POOL_FROM_BYTES = 64 << 10


def _read(path: Path, rank: int, configured: limits.Limits) -> FlightDump:
    """:func:`read_flight_dump` in a worker, under this process's limits."""
    limits.configure(**{f: getattr(configured, f) for f in limits.FLAGS})
    return read_flight_dump(path, rank, inside=path.parent)


class EarlyFlights:
    """Flight-recorder dumps read ahead, by path (or why one did not read; or the worker
    reading it); called as :func:`read_flight_dump` is (``rank_flight_timeline(...,
    read=flights)``), it gives the dump read ahead, else reads it then. A context manager:
    its workers end with it."""

    def __init__(self) -> None:
        self.read: dict[Path, FlightDump | BadInputError | Future[FlightDump]] = {}
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> EarlyFlights:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)

    def ahead(self, rank: RankData) -> None:
        """Read the flight-recorder dumps recorded with the rank's latest dump (those the
        diagnosis goes by: ``diagnosis.flight_since``), a large one by a worker."""
        if not rank.dumps:
            return
        since = float(rank.dumps[-1]["t"]) - FLIGHT_EARLY_S
        for record in rank.flight_dumps:
            path = Path(record["path"])
            if float(record["t"]) < since or path in self.read or not path.is_file():
                continue
            if workers.available() > 1 and path.stat().st_size >= POOL_FROM_BYTES:
                if self._pool is None:
                    self._pool = ProcessPoolExecutor(max_workers=workers.available())
                self.read[path] = self._pool.submit(_read, path, rank.rank, limits.current())
                continue
            try:
                self.read[path] = read_flight_dump(path, rank.rank, inside=path.parent)
            except BadInputError as exc:
                self.read[path] = exc

    def __call__(self, path: Path, rank: int) -> FlightDump:
        found = self.read.get(path)
        if isinstance(found, Future):
            try:
                found = self.read[path] = found.result()
            except BadInputError as exc:
                found = self.read[path] = exc
        if found is None:
            return read_flight_dump(path, rank, inside=path.parent)
        if isinstance(found, BadInputError):
            raise found
        return found
