"""How a rank ended, as far as its stream tells: the one reading of a rank's exception,
signal and end records that the summary, the hang diagnosis and the report share."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any

from lorascope.rundir.reader import RankData
from lorascope.units import ranks_named, strip_source_locations

#: faulthandler's first line ("Fatal Python error: Aborted") -> the signal.
FATAL_SIGNALS = {
    "Aborted": signal.SIGABRT,
    "Segmentation fault": signal.SIGSEGV,
    "Bus error": signal.SIGBUS,
    "Floating-point exception": signal.SIGFPE,
    "Illegal instruction": signal.SIGILL,
}


_FATAL_NUMBERS = {int(s) for s in FATAL_SIGNALS.values()}


@dataclass(frozen=True)
class Ending:
    #: "exception", "signal", the end record's status ("exit", ...), or "unknown" when
    #: the stream has no word on it (killed by SIGKILL or the OOM killer, or still running).
    status: str
    code: int | None
    detail: str | None
    #: When the rank recorded it (None: no record).
    t: float | None
    #: A fatal signal in the interpreter's teardown, after the rank recorded its exit
    #: (``t`` is that end record's: the job had finished).
    teardown: bool = False

    @property
    def fatal(self) -> bool:
        """Killed by a fatal signal the process raised itself (an abort, a segfault), not
        one sent to it (a launcher's SIGTERM once another rank died)."""
        return self.status == "signal" and self.code is not None and -self.code in _FATAL_NUMBERS

    @property
    def known(self) -> bool:
        """The rank recorded how it ended (an exception, a signal or an end record)."""
        return self.status != "unknown"

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, "code": self.code, "detail": self.detail}


def ending_of(rank: RankData) -> Ending:
    if rank.exception is not None:
        exc = rank.exception
        # torch's and gloo's C++ source locations left out ("[/__w/pytorch/.../pair.cc:537] "):
        # every one-line reading of the ending would show them before the message.
        message = "\n".join(strip_source_locations(line) for line in str(exc["message"]).splitlines())
        return Ending("exception", 1, f"{exc['type']}: {message}".strip(), float(exc["t"]))
    if rank.signal is not None:
        sig = rank.signal
        return Ending("signal", -sig["signum"], sig["name"], float(sig["t"]))
    if rank.fatal is not None:
        first = rank.fatal.splitlines()[0]
        signum = FATAL_SIGNALS.get(first.removeprefix("Fatal Python error: ").strip())
        code = None if signum is None else -signum
        if rank.end is not None:  # faulthandler wrote after the end record: in the teardown
            after = f"{rank.end['status']} {rank.end['code']}"
            detail = f"{first} (faulthandler) in the interpreter's teardown, after {after}\n{rank.fatal}"
            return Ending("signal", code, detail, float(rank.end["t"]), teardown=True)
        return Ending("signal", code, f"{first} (faulthandler)\n{rank.fatal}", None)
    if rank.end is not None:
        why = rank.end.get("why")
        return Ending(rank.end["status"], rank.end["code"], why if isinstance(why, str) else None, float(rank.end["t"]))
    return Ending("unknown", None, "no end record: killed (e.g. SIGKILL, OOM killer) or still running", None)


def ended_badly_headline(hows: dict[int, str]) -> str:
    """The headline of a run no detector named a cause for but some ranks ended badly,
    from each such rank's ending as one line, the first to end first (the others often
    fail because it did: a peer's connection closed): the ranks that ended like it, and
    the others apart (the terminal's and the report's, alike)."""
    first = next(iter(hows.values()))
    alike = [rank for rank, how in hows.items() if how == first]
    rest = [rank for rank in hows if rank not in alike]
    if not rest:
        verb = "ended" if len(alike) == 1 else "all ended"
        return f"no detector named a cause, but {ranks_named(alike)} {verb} badly: {first}"
    return (
        f"no detector named a cause, but {ranks_named(alike)} ended badly first: {first} "
        f"({ranks_named(rest)} ended otherwise after {'it' if len(alike) == 1 else 'them'})"
    )
