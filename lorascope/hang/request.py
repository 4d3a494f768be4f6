"""The dump request `lorascope hang` writes into the run directory: every rank's probe
thread looks at it once a second, on whatever host or in whatever PID namespace it runs
(``lorascope.probes.dumps``), and answers with a ``dump`` record carrying its id."""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from pathlib import Path

from lorascope.rundir.format.schema import DUMP_REQUEST


def write_request(run_dir: Path) -> tuple[str | None, str | None]:
    """Write a new request (atomically: a new file renamed over the old, so a rank's
    probe sees a new inode); returns (its id, None), or (None, why it could not be
    written: then only the ranks on this host are asked, by signal)."""
    request = f"{socket.gethostname()}-{os.getpid()}-{time.time():.6f}-{secrets.token_hex(4)}"
    path = run_dir / DUMP_REQUEST
    tmp = run_dir / f".{DUMP_REQUEST}.{request}"
    try:
        with open(tmp, "x") as f:
            f.write(json.dumps({"id": request, "t": time.time(), "host": socket.gethostname()}) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        try:
            tmp.unlink()
        except OSError:
            pass
        return (
            None,
            f"could not write the dump request {path} ({exc.strerror or exc}): only this host's ranks were asked",
        )
    return request, None
