"""Per-step sums of the calls the call file's ring will overwrite (probe side).

The call file keeps every call of its head and the newest ``ring`` calls. Before the ring
comes round to a call, the probes' writer thread folds it into its step's sums, per
group and op: calls, bytes, time in the calls, the longest call, and how many had not
ended when folded. A step's sums are one ``calls_step`` record, queued once the step is
over: what the straggler and pace detectors, the collective totals and the report read
of a step whose calls are gone.

The calls of the steps in ``keep`` (an eval or a save, a failed call, a stall, a slow
step: the windows the detectors read closely) are also copied whole into a second call
file, ``HOST-PID.kept-calls`` (the same layout; its own ring), made when first needed.

Folding starts when half the ring is used (a run whose calls all stay in the file writes
no sums) and then keeps up from the first call after the head: a call is folded once
it is :data:`LAG` calls old (a quarter of a smaller ring) and its step is over, so it has ended (or never
will) and its record is not being written.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lorascope.rundir.format.callfile import CallFile

#: Calls a call must be behind the newest before it is folded (at most a quarter of the
#: ring: it must be folded long before the ring comes round to it).
LAG = 4096
#: Calls folded at most per look (the writer thread looks every 40 ms): a backlog (the
#: first look, or a burst of calls) is caught up over several looks.
MOST_PER_LOOK = 1 << 15


class CallSteps:
    """Folds a call file's calls into ``calls_step`` records, on the probes' own thread."""

    def __init__(
        self,
        calls: CallFile,
        op_of: Callable[[int], str],
        write: Callable[[dict[str, Any]], None],
        keep: set[int],
        kept_file: Callable[[], CallFile],
    ) -> None:
        self._calls = calls
        self._keep = keep
        self._kept_file = kept_file
        self._kept: CallFile | None = None
        self._busy = False
        self._op_of = op_of
        self._write = write
        self._lag = min(LAG, max(1, calls.ring // 4))
        #: The next call to fold.
        self.folded = calls.head
        self._step: int | None = None
        #: (gid, op) -> [calls, bytes, ms in them, longest ms, not ended]
        self._sums: dict[tuple[int, str], list[float]] = {}

    def due(self) -> bool:
        calls = self._calls
        return calls.count - calls.head >= calls.ring // 2 or self.folded > calls.head

    def look(self, step_now: int) -> None:
        """Fold the calls old enough (see the module), writing each step's record as the
        next step's first call is folded."""
        if self._busy:  # re-entered: making the kept file writes a record, which flushes
            return
        self._busy = True
        try:
            self._look(step_now)
        finally:
            self._busy = False

    def _look(self, step_now: int) -> None:
        calls = self._calls
        last = min(calls.count - self._lag, self.folded + MOST_PER_LOOK)
        if last <= self.folded:
            return
        for index, rec in calls.read(self.folded, last):
            t, end, _, nbytes, step, gid, shape, _ = rec
            if step >= step_now:  # its step is not over
                self.folded = index
                return
            if step != self._step:
                self._flush()
                self._step = step
                self._forget_before(step)
            if step in self._keep:
                kept = self._kept = self._kept or self._kept_file()
                copy = kept.begin(t, rec[2], nbytes, step, gid, shape)
                if end > 0:
                    kept.end(copy, end)
            sums = self._sums.get((gid, shape_op := self._op_of(shape)))
            if sums is None:
                sums = self._sums[(gid, shape_op)] = [0, 0, 0.0, 0.0, 0]
            sums[0] += 1
            sums[1] += max(nbytes, 0)
            if end > 0:
                ms = (end - t) * 1e3
                sums[2] += ms
                sums[3] = max(sums[3], ms)
            else:
                sums[4] += 1
            self.folded = index + 1

    def _forget_before(self, step: int) -> None:
        """Drop the steps before ``step`` from ``keep``: their calls are folded or lie in
        the head, never overwritten (a kept step with no call past the head, an eval
        without collectives, would stay in it for the life of the job)."""
        done = [s for s in self._keep if s < step]
        for s in done:
            self._keep.discard(s)

    def _flush(self) -> None:
        if self._step is None or not self._sums:
            return
        groups = [
            [gid, op, int(n), int(nbytes), round(ms, 3), round(longest, 3), int(open_)]
            for (gid, op), (n, nbytes, ms, longest, open_) in sorted(self._sums.items())
        ]
        self._write({"step": self._step, "groups": groups})
        self._sums = {}
