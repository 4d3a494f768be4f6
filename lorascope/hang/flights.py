"""The flight-recorder dumps that go with the ranks' latest dumps, read as each rank
answers (while the others are still waited for) rather than all after the last one: at
1,024 ranks the safe unpickling of each is most of what is left to do once they answered."""

from __future__ import annotations

from pathlib import Path

from lorascope.detect.hang.diagnosis import FLIGHT_EARLY_S
from lorascope.errors import BadInputError
from lorascope.ingest.flight.reader import FlightDump, read_flight_dump
from lorascope.rundir.loading.reader import RankData


class EarlyFlights:
    """Flight-recorder dumps read ahead, by path (or why one did not read); called as
    :func:`read_flight_dump` is (``rank_flight_timeline(..., read=flights)``), it gives the
    dump read ahead, else reads it then."""

    def __init__(self) -> None:
        self.read: dict[Path, FlightDump | BadInputError] = {}

    def ahead(self, rank: RankData) -> None:
        """Read the flight-recorder dumps recorded with the rank's latest dump (those the
        diagnosis goes by: ``diagnosis.flight_since``)."""
        if not rank.dumps:
            return
        since = float(rank.dumps[-1]["t"]) - FLIGHT_EARLY_S
        for record in rank.flight_dumps:
            path = Path(record["path"])
            if float(record["t"]) >= since and path not in self.read and path.is_file():
                try:
                    self.read[path] = read_flight_dump(path, rank.rank, inside=path.parent)
                except BadInputError as exc:
                    self.read[path] = exc

    def __call__(self, path: Path, rank: int) -> FlightDump:
        found = self.read.get(path)
        if found is None:
            return read_flight_dump(path, rank, inside=path.parent)
        if isinstance(found, BadInputError):
            raise found
        return found
