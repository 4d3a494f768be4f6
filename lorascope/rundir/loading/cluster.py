"""Reading a run directory's rank streams on a Dask cluster (`--cluster ADDRESS`).

One machine reads ~30 MB of streams per CPU-second (docs/architecture.md): 1,024 ranks x
10,000 steps (~150 GB) is minutes on 16 cores. The reading of one process's stream is a
pure function of its files (:func:`lorascope.rundir.loading.reader.read_process`), so Dask's
workers run it as it is; this module is only the connection and the checks that make
its results the same as a local read: every worker runs this lorascope version and sees
the run directory at the same path (a shared filesystem). The alignment of the ranks,
the detectors and the report then run here, as without a cluster.

``distributed`` is imported only when a cluster is asked for (the ``cluster`` extra).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from lorascope import __version__
from lorascope.errors import BadInputError, ClusterError, UsageError
from lorascope.rundir.format.safe_open import open_regular
from lorascope.rundir.format.schema import MANIFEST_FILE

#: Bytes of the manifest digested (a manifest is a few KB; past this the rest is not compared).
MAX_MANIFEST_BYTES = 16 << 20


@functools.cache
def reader_code() -> str:
    """This lorascope's version and a digest of its reader's source (lorascope/rundir/):
    what must agree between this process and a worker for a worker's read to be the one
    this process would make (a version number alone does not change with a checkout)."""
    digest = hashlib.sha256()
    root = Path(__file__).parents[1]
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return f"{__version__} ({digest.hexdigest()[:12]})"


def manifest_digest(run_dir: str) -> str | None:
    """A digest of the run directory's manifest as this machine sees it; None when it
    cannot be read. A worker that reads a stale copy of the run, or another run at the
    same path, sees another manifest (it holds every launch's start and end)."""
    try:
        with open_regular(os.path.join(run_dir, MANIFEST_FILE)) as f:
            return hashlib.sha256(f.read(MAX_MANIFEST_BYTES)).hexdigest()
    except (OSError, BadInputError):
        return None


def worker_state(run_dir: str) -> tuple[str, str | None]:
    """Run on each worker: its :func:`reader_code` and its :func:`manifest_digest` of ``run_dir``."""
    return reader_code(), manifest_digest(run_dir)


class Cluster:
    """A connected Dask client, as the reader uses it."""

    def __init__(self, client: Any, address: str) -> None:
        self._client = client
        self.address = address
        self._executor = client.get_executor(pure=False)

    def prepare(self, run_dir: Path) -> None:
        """Check that every worker can read ``run_dir`` with this lorascope (ClusterError
        naming the first that cannot)."""
        try:
            states = self._client.run(worker_state, str(run_dir), on_error="return")
        except Exception as exc:
            raise ClusterError(f"the Dask cluster at {self.address} did not answer: {_reason(exc)}") from None
        check_workers(states, run_dir, self.address, manifest_digest(str(run_dir)))

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        return self._executor.submit(fn, *args)  # type: ignore[no-any-return]

    def result(self, future: Future[Any], what: str) -> Any:
        """The future's result; a worker lost or a failure of Dask's as ClusterError."""
        try:
            return future.result()
        except Exception as exc:
            raise ClusterError(f"the Dask cluster at {self.address} failed {what}: {_reason(exc)}") from None


def check_workers(states: dict[str, Any], run_dir: Path, address: str, manifest: str | None) -> None:
    """ClusterError for the first worker whose :func:`worker_state` (or the exception it
    raised) says it cannot read ``run_dir`` as this process would (``manifest``: this
    process's :func:`manifest_digest`)."""
    if not states:
        raise ClusterError(f"the Dask cluster at {address} has no workers")
    for worker, state in sorted(states.items()):
        if isinstance(state, BaseException):
            raise ClusterError(
                f"Dask worker {worker} cannot run lorascope ({_reason(state)}): "
                f"install lorascope {reader_code()} on every worker"
            )
        code, seen = state
        if code != reader_code():
            raise ClusterError(
                f"Dask worker {worker} runs lorascope {code}, this is {reader_code()}: the workers need the same lorascope"
            )
        if seen is None:
            raise ClusterError(
                f"Dask worker {worker} does not see {run_dir / MANIFEST_FILE}: the workers need "
                "the run directory at the same path (a shared filesystem)"
            )
        if seen != manifest:
            raise ClusterError(
                f"Dask worker {worker} sees another {run_dir / MANIFEST_FILE} than this machine "
                "(a stale copy, or another run at that path): the workers need this run directory"
            )


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split())[:200]
    return f"{exc.__class__.__name__}: {text}" if text else exc.__class__.__name__


@contextlib.contextmanager
def connect(address: str | None) -> Iterator[Cluster | None]:
    """The cluster at a Dask scheduler's ``address`` (``tcp://host:8786``) while the
    block runs; None (read on this machine) when ``address`` is None. How long to try
    to reach it is Dask's setting (``distributed.comm.timeouts.connect``, 30 s; env
    DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT)."""
    if address is None:
        yield None
        return
    try:
        import distributed
    except ImportError:
        raise UsageError("--cluster needs Dask's distributed: pip install 'lorascope[cluster]'") from None
    _check_address(address)
    try:
        client: Any = distributed.Client(address, set_as_default=False)  # type: ignore[no-untyped-call]
    except ValueError as exc:
        raise UsageError(f"--cluster {address}: {exc}") from None
    except (OSError, TimeoutError) as exc:
        raise ClusterError(f"cannot reach the Dask scheduler at {address}: {_reason(exc)}") from None
    try:
        yield Cluster(client, address)
    finally:
        with contextlib.suppress(Exception):
            client.close()


def _check_address(address: str) -> None:
    """UsageError for an address Dask cannot parse, before a Client is made of it (one
    made of a bad address prints a traceback when it is collected)."""
    from distributed.comm.addressing import get_address_host_port, parse_address
    from distributed.comm.registry import get_backend

    try:
        scheme, _ = parse_address(address)
        get_backend(scheme)
        if scheme != "inproc":
            get_address_host_port(address)
    except ValueError as exc:
        raise UsageError(f"--cluster {address}: {exc}") from None
