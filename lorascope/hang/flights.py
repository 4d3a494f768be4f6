"""The flight-recorder dumps that go with the ranks' latest dumps, read as each rank
answers (while the others are still waited for) rather than all after the last one.

A dump of torch's size (the last 2,000 collectives, ~370 KB) takes ~90 ms to read
safely: at 1,024 ranks, a minute and a half. The probes write each dump's tail beside
it (each process group's collectives from a few before its last completed one on,
``probes.flight.flight_tail``), and the tail is what is read here: the ranks of a hung
job are a few collectives apart, and the diagnosis aligns them where they part. Where
the tails leave a group's ranks without a collective in common (a rank further ahead
than a tail holds), the dumps are read whole. A dump without a tail (an older probe's)
is read whole, a large one by a worker process, one per core (``--workers``), while this
process reads the ranks' streams.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from types import TracebackType

from lorascope.detect.hang.diagnosis import FLIGHT_EARLY_S, FlightTimeline
from lorascope.errors import BadInputError
from lorascope.ingest.flight.reader import FlightDump, read_flight_dump
from lorascope.ingest.load import rank_flight_timeline
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
    read=flights)``), it gives the dump read ahead (its tail, where there is one), else
    reads it then. A context manager: its workers end with it."""

    def __init__(self) -> None:
        self.read: dict[Path, FlightDump | BadInputError | Future[FlightDump]] = {}
        #: The dumps given by their tail: the tail's path -> the whole dump's.
        self.tails: dict[Path, Path] = {}
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> EarlyFlights:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)

    def ahead(self, rank: RankData) -> None:
        """Read the flight-recorder dumps recorded with the rank's latest dump (those the
        diagnosis goes by: ``diagnosis.flight_since``): their tails, or a whole dump, a
        large one by a worker."""
        if rank.dumps:
            self._ahead(rank, float(rank.dumps[-1]["t"]) - FLIGHT_EARLY_S)

    def timeline(self, rank: RankData, warnings: list[str], since: float) -> list[tuple[float, FlightDump]]:
        """:func:`rank_flight_timeline` of the dumps recorded from ``since`` on (the rank's
        ending's too, which it wrote with no dump), read through this."""
        self._ahead(rank, since)
        return rank_flight_timeline(rank, warnings, since, self)

    def _ahead(self, rank: RankData, since: float) -> None:
        for record in rank.flight_dumps:
            path = Path(record["path"])
            if float(record["t"]) < since or path in self.read or not path.is_file():
                continue
            tail = record.get("tail_path")
            if tail is not None:
                self.tails[Path(tail)] = path
            self._start(path, Path(tail) if tail is not None else path, rank.rank)

    def _start(self, key: Path, path: Path, rank: int) -> None:
        """Read ``path`` as the dump ``key``: by a worker when it is large, else here."""
        try:
            large = path.stat().st_size >= POOL_FROM_BYTES
        except OSError:
            large = False
        if workers.available() > 1 and large:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(max_workers=workers.available())
            self.read[key] = self._pool.submit(_read, path, rank, limits.current())
            return
        try:
            self.read[key] = read_flight_dump(path, rank, inside=path.parent)
        except BadInputError as exc:
            self.read[key] = exc

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

    def covering(self, timeline: FlightTimeline) -> FlightTimeline:
        """``timeline`` (read through this), or, where its tails leave the ranks of a group
        without a collective in common, the same dumps read whole."""
        if not any(d.path in self.tails for dumps in timeline.values() for _, d in dumps):
            return timeline
        if in_common(d for dumps in timeline.values() for _, d in dumps):
            return timeline
        whole = {
            d.path: (self.tails[d.path], n) for n, dumps in timeline.items() for _, d in dumps if d.path in self.tails
        }
        for path, rank in whole.values():
            self.read.pop(path, None)
            self._start(path, path, rank)
        out: dict[int, list[tuple[float, FlightDump]]] = {}
        for n, dumps in timeline.items():
            for t, d in dumps:
                try:
                    out.setdefault(n, []).append((t, self(*whole[d.path]) if d.path in whole else d))
                except BadInputError:
                    continue  # its tail read: the whole dump was replaced or cut since
        return out


def in_common(dumps: Iterable[FlightDump]) -> bool:
    """Whether, in every process group, the dumps that hold its collectives share a
    sequence number (each holds a run of them: the last of its ring, or of its tail)."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for dump in dumps:
        seqs: dict[str, list[int]] = {}
        for e in dump.entries:
            if e.seq is not None and not e.is_p2p:
                seqs.setdefault(e.group, []).append(e.seq)
        for group, held in seqs.items():
            spans.setdefault(group, []).append((min(held), max(held)))
    return all(max(lo for lo, _ in held) <= min(hi for _, hi in held) for held in spans.values())
