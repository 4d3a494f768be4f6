"""The flight recorder and stacks, when a rank ends by an exception or a signal.

torch keeps the last ``TORCH_FR_BUFFER_SIZE`` collectives of each process group in its
flight recorder (gloo included); ``lorascope run`` sets that variable for the job when
it is unset. The dump is written as torch writes it (a pickle of plain data) next to
the rank's stream.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from lorascope.probes.session import Session

ENV_BUFFER = "TORCH_FR_BUFFER_SIZE"
DEFAULT_BUFFER = "2000"


def dump_flight_recorder(session: Session, out_prefix: Path, reason: str) -> None:
    """Write torch's flight-recorder dump, if torch.distributed has one to give."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    dump = getattr(sys.modules["torch"]._C._distributed_c10d, "_dump_fr_trace", None)
    if dump is None:
        return
    data = dump()
    path = out_prefix.with_name(f"{out_prefix.name}.flight.{reason}.pickle")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    session.record("flight_dump", file=path.name, reason=reason, bytes=len(data))
