"""Progress bars on stderr for analyses that take more than a couple of seconds (many
ranks, large snapshots, big traces): tqdm's (the ``analysis`` extra), shown only when
stderr is a terminal and only once a step has run for ``delay`` seconds; nothing when
piped, with ``--json``, or without tqdm."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

from lorascope.rundir.loading.reader import Progress

#: Seconds a step runs before its bar appears.
DELAY_S = 2.0


@contextmanager
def terminal_progress(
    enabled: bool, stream: IO[str] | None = None, delay: float = DELAY_S
) -> Iterator[Progress | None]:
    """A :data:`Progress` that draws one bar per step on ``stream`` (stderr), or None."""
    out = stream if stream is not None else sys.stderr
    if not enabled or not out.isatty():
        yield None
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield None
        return
    bars: dict[str, Any] = {}

    def update(what: str, done: int, total: int) -> None:
        bar = bars.get(what)
        if bar is None:
            bar = bars[what] = tqdm(total=total, desc=what, file=out, delay=delay, leave=False, dynamic_ncols=True)
        bar.update(done - bar.n)

    try:
        yield update
    finally:
        for bar in bars.values():
            bar.close()
