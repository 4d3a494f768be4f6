"""Every torch.distributed collective and p2p call, whoever makes it (DeepSpeed, FSDP,
user code), with a per-rank, per-process-group sequence number, op, bytes, dtype, group
and the first call-site frame outside torch / deepspeed / lorascope.

The hot path writes a call's record into the rank's call file before the call starts
(:mod:`lorascope.rundir.format.callfile`: one ``struct.pack_into`` into a shared mapping,
no queue, no system call), and its end into the same record when it ends: the call a rank
blocks in, or dies in (gloo aborts the process on a size mismatch), is in the run
directory whatever happens next. The record names the call's shape (op, bytes, dtype,
async, site, via), a ``shape`` record written to the stream, on disk, the first time the
shape is seen (with the ``group`` and ``site`` records it needs); a call's error is a
``coll_err`` record, written at once.

Calls nested inside another recorded call (``all_gather_object`` uses ``all_gather``)
are not counted twice. On CUDA the device time of a synchronous call comes from two
CUDA events recorded on the payload's current stream around it (the collective's own
stream waits for that stream before it starts, and that stream waits for the
collective before the call returns), read at a later step end once the end event is
done (``Event.query``): nothing here waits for the device. An ``async_op`` call returns
before its work is waited for, so events around the call would time nothing: it gets
none, and ends when its work is seen completed (see :meth:`CollectiveProbe._returned`).

The paths FSDP takes (torch 2.13): FSDP2's all-gathers and reduce-scatters are
``dist.all_gather_single`` / ``dist.reduce_scatter_single`` (the new names of
``all_gather_into_tensor`` / ``reduce_scatter_tensor``, which now call them), FSDP1's
``dist.all_gather`` (gloo has no all_gather_single) or ``all_gather_single`` and
``reduce_scatter_single``: all looked up on ``torch.distributed`` at call time, so the
wrapped functions of ``distributed_c10d`` see them. A full state dict of FSDP2's
sharded parameters (DTensor ``full_tensor``) goes through the functional collectives
(``torch.distributed._functional_collectives``), which call C++ ops directly: their
Python functions are wrapped (``funcol.NAME``), and each ends when its output is waited
for (``wait_tensor``, wrapped too) or freed. What stays out of reach from Python (the
autograd backward of functional collectives, DDP's C++ Reducer) is said in the run by a
``coll_unseen`` record (see :meth:`CollectiveProbe.unseen`); the flight recorder has it.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from types import CodeType, FrameType, ModuleType
from typing import Any, NamedTuple

from lorascope.probes.callsteps import CallSteps
from lorascope.probes.session import Session
from lorascope.rundir.format.callfile import CallFile, calls_path, kept_calls_path
from lorascope.rundir.format.layout import DEFAULT_HEAD, DEFAULT_RING
from lorascope.rundir.format.ops import FUNCTIONAL_PAYLOAD_ARG, FUNCTIONAL_PREFIX, P2P_OPS, PAYLOAD_ARG
from lorascope.rundir.format.sources import MAX_VIA_FRAMES, describe, rank_condition_in
from lorascope.rundir.format.writer import Declared, Stream, json_str

MAX_PENDING_EVENTS = 4096

#: Code objects the call-site caches keep alive, at most (a process has a few thousand;
#: beyond this, sites are worked out again at every call instead of growing the caches).
MAX_KEPT_CODES = 1 << 16
#: Call-site shortcuts kept (``_Hop``), at most; and the fewest frames a walk must pass
#: before the site for its result to be kept as one (a shorter walk costs no more).
MAX_HOPS = 4096
HOP_MIN = 4
#: Distinct call shapes (op, dtype, async, site, via) a stream declares, at most;
#: the calls of shapes beyond them are not recorded (a ``probe_error`` says so once).
MAX_SHAPES = 1 << 16
#: (op, dtype, async, site, via); the dtype as the call holds it (torch's dtype object,
#: or its name), named when the shape is declared.
_ShapeKey = tuple[str, Any, bool, str | None, str | None]
#: Slots of the call file: ``LORASCOPE_CALL_SLOTS=HEAD,RING`` (tests and benchmarks).
ENV_CALL_SLOTS = "LORASCOPE_CALL_SLOTS"


def _json(text: str | None) -> str:
    return "null" if text is None else json_str(text)


class _Awaited:
    """A functional collective in flight: its call, and how many outputs are unwaited
    (-1 once it has ended)."""

    __slots__ = ("started", "left")

    def __init__(self, started: _Started, left: int) -> None:
        self.started, self.left = started, left


def _like(wrapper: Any, original: Any, name: str) -> Any:
    """Mark a wrapper as lorascope's and give it the original's name and module."""
    wrapper.__lorascope__ = True
    wrapper.__wrapped__ = original
    wrapper.__name__ = getattr(original, "__name__", name)
    wrapper.__qualname__ = getattr(original, "__qualname__", name)
    wrapper.__doc__ = getattr(original, "__doc__", None)
    wrapper.__module__ = str(getattr(original, "__module__", None) or wrapper.__module__)
    return wrapper


@functools.lru_cache(maxsize=64)
def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _fields(key: _ShapeKey) -> str:
    """A shape's fields as record text: ``,"op":...,"via":...``."""
    op, dtype, is_async, site, via = key
    flag = "true" if is_async else "false"
    name = None if dtype is None else _dtype_name(dtype)
    return f',"op":{_json(op)},"dtype":{_json(name)},"async":{flag},"site":{_json(site)},"via":{_json(via)}'


class _Shapes:
    """The call shapes one stream has declared (:class:`Declared`): each one's id, its
    ``shape`` record, and its op."""

    __slots__ = ("ids", "ops", "_declared")

    def __init__(self, stream: Stream) -> None:
        self._declared: Declared[_ShapeKey] = Declared(stream, MAX_SHAPES)
        self.ids = self._declared.ids
        #: Each shape's op, by id.
        self.ops: list[str] = []

    def declare(self, key: _ShapeKey) -> int:
        """The id of a shape not in ``ids`` (the caller looks there first), its record
        written now, after everything queued before it (the ``group`` and ``site``
        records it names); -1 past MAX_SHAPES."""
        return self._declared.declare(
            key,
            lambda n: f'{{"k":"shape","t":{time.time():.6f},"id":{n}{_fields(key)}}}\n',
            lambda _: self.ops.append(key[0]),
        )


def _call_file(session: Session, prefix: Path, kept: bool = False) -> CallFile:
    """The rank process's call file (its slots from ``LORASCOPE_CALL_SLOTS=HEAD,RING`` if
    set), or with ``kept`` its file of the calls kept whole past the ring (a ring of as
    many, no head), and a ``calls_file`` record that says where and how it is written. A
    failed write turns the collective probe off, as any failing probe."""
    head, ring = DEFAULT_HEAD, DEFAULT_RING
    with contextlib.suppress(ValueError):
        head, ring = (int(n) for n in os.environ.get(ENV_CALL_SLOTS, "").split(","))
    if kept:
        head = 0
    path = kept_calls_path(prefix) if kept else calls_path(prefix)
    calls = CallFile(path, head, ring, on_error=lambda exc: session.fail("collectives", exc))
    session.stream.write(
        {"k": "calls_file", "file": path.name, "how": calls.how, "head": calls.head, "ring": calls.ring}
    )
    return calls


def _tensors(value: Any) -> list[Any]:
    if hasattr(value, "element_size"):
        return [value]
    if isinstance(value, (list, tuple)):
        out: list[Any] = []
        for item in value:
            out.extend(_tensors(getattr(item, "tensor", item)))  # P2POp carries .tensor
        return out
    return []


def _peer(args: tuple[Any, ...], kwargs: dict[str, Any], group: Any, c10d: ModuleType | None) -> int | None:
    """The global rank a point-to-point call sends to (``dst``, its second argument) or
    receives from (``src``), or that its ``group_dst``/``group_src`` (a rank of ``group``)
    is; None when it names none (a receive from any source, a ``batch_isend_irecv``'s list)."""
    peer = kwargs.get("dst", kwargs.get("src", args[1] if len(args) > 1 else None))
    in_group = kwargs.get("group_dst", kwargs.get("group_src"))
    if peer is None and isinstance(in_group, int) and c10d is not None:
        try:  # the call itself says what is wrong with its group: the probe stays on
            peer = c10d.get_global_rank(group if group is not None else c10d.GroupMember.WORLD, in_group)
        except Exception:
            return None
    return peer if isinstance(peer, int) and not isinstance(peer, bool) else None


class _Call:
    """A call in flight: its index in the call file (-1 if unrecorded) and what a dump
    says of it."""

    __slots__ = ("index", "t", "seq", "gid", "nbytes", "key", "flight", "peer")

    def __init__(
        self,
        index: int,
        t: float,
        seq: int,
        gid: int,
        nbytes: int | None,
        key: _ShapeKey,
        counter: int,
        peer: int | None = None,
    ) -> None:
        self.index, self.t, self.seq, self.gid, self.nbytes, self.key = index, t, seq, gid, nbytes, key
        #: Its key among the calls in flight: (the counter that numbered it, its number).
        self.flight = (counter, seq)
        #: A point-to-point call's peer (the global rank it sends to or receives from).
        self.peer = peer

    @property
    def p2p(self) -> dict[str, bool]:
        """What its ``coll_err`` and ``coll_dev`` records add: a point-to-point call's
        number is of its own count (``gid``, ``seq`` name a collective otherwise)."""
        return {"p2p": True} if self.flight[0] < 0 else {}

    def pending(self, group: str) -> dict[str, Any]:
        op, _, _, site, _ = self.key
        nbytes = self.nbytes
        out = {"group": group, "seq": self.seq, "op": op, "bytes": nbytes, "site": site, "since": self.t}
        if self.peer is not None:
            out["peer"] = self.peer
        return out


#: A call's first two frames above the wrapper: (id(code), f_lasti) of each.
_HopKey = tuple[int, int, int, int]


class _Hop(NamedTuple):
    """Where a walk from a call's first two frames found the call site: ``depth`` frames
    up, the site and the library frame just below it as (id(code), f_lasti)."""

    depth: int
    below: tuple[int, int]
    site: tuple[int, int]


class _Started(NamedTuple):
    """A recorded call in flight: its record, the CUDA events around it (a synchronous
    call on the device), and whether its payload is on a CUDA device."""

    call: _Call
    events: tuple[Any, Any, Any, float] | None
    on_device: bool


class _Spec(NamedTuple):
    """How a wrapped function's arguments read: its op, where its group, ``async_op`` and
    payload arguments are (-1: none), whether its calls are always async, and whether it
    is a functional collective (waited for right away)."""

    op: str
    group_pos: int
    async_pos: int
    payload_pos: int
    payload_kw: str
    always_async: bool
    functional: bool


class CollectiveProbe:
    def __init__(self, session: Session, prefix: Path, torch_seq: bool = False) -> None:
        self.session = session
        #: Number calls by torch's own per-group sequence number (``lorascope attach``: the
        #: ranks were attached at different calls, so a count from attach would differ
        #: between them; torch's counts every collective since the group began).
        self._torch_seq = torch_seq
        self._local = threading.local()
        self._seq: dict[int, int] = {}
        #: id(group) -> (gid, a weak reference to the group, or the group itself when it
        #: cannot be referenced weakly). A ProcessGroup is held weakly: kept alive past the
        #: job's ``destroy_process_group``, gloo's backend would be destroyed during the
        #: interpreter's teardown, where it can abort the process ("terminate called
        #: without an active exception", pytorch/pytorch#190489). A group's entry goes when
        #: the group does, so that its id, reused by another object, is not mistaken for it.
        self._gids: dict[int, tuple[int, Any]] = {}
        self._next_gid = 0
        # The call-site caches are keyed by id(code): hashing a code object hashes its
        # constants, nested functions' code included, at every lookup (~1 us for
        # Module._call_impl), and a call looks at up to MAX_VIA_FRAMES frames. The code
        # objects are kept alive here, so that no id is ever reused for another.
        self._kept: dict[int, CodeType] = {}
        #: id(code) -> whether it is torch's, DeepSpeed's, lorascope's or the stdlib's.
        self._internal: dict[int, bool] = {}
        self._described: set[str] = set()
        #: (id(code), f_lasti) -> its site text, made once (a call site's lines are few).
        #: Keyed by the instruction, not the line: ``f_lineno`` decodes the code's line
        #: table from its start at every read (~10 us at the end of a 400-line loop).
        self._sites: dict[tuple[int, int], str] = {}
        #: site -> whether a rank condition encloses its line.
        self._conditioned: dict[str, bool] = {}
        #: The same per (id(code), f_lasti) of the job's callers, and which code is not the job's.
        self._line_conditioned: dict[tuple[int, int], bool] = {}
        self._foreign: dict[int, bool] = {}
        #: A call's first two frames -> where the walk from them found its site.
        self._hops: dict[_HopKey, _Hop] = {}
        self._stdlib = os.path.dirname(os.__file__) + os.sep
        self._events: collections.deque[tuple[_Call, Any, Any, float]] = collections.deque(maxlen=MAX_PENDING_EVENTS)
        self._lock = threading.Lock()
        self._c10d: ModuleType | None = None
        self._group_names: dict[int, str] = {}
        #: (gid, seq) -> what is in flight now, for on-demand and stall dumps.
        self._in_flight: dict[tuple[int, int], _Call] = {}
        #: The default process group's timeout in seconds, once the job sets it.
        self.pg_timeout: float | None = None
        #: id(output tensor) of a functional collective in flight -> its call and the
        #: finalizer that ends it if the output is freed without a wait.
        self._awaited: dict[int, tuple[_Awaited, Any]] = {}
        self._unseen: set[str] = set()
        #: id(work) -> (its call, the work) of a host async call not yet seen completed
        #: (the work is held, so that no id is reused while it is here).
        self._open: dict[int, tuple[_Started, Any]] = {}
        self._shapes = _Shapes(session.stream)
        self.calls = _call_file(session, prefix)
        self._call_steps = CallSteps(
            self.calls,
            self._shapes.ops.__getitem__,
            lambda fields: session.record("calls_step", **fields),
            session.keep_steps,
            lambda: _call_file(session, prefix, kept=True),
        )
        session.stream.before_flush = self._poll
        self.resolve_device_times = session.guarded("collectives")(self._resolve_device_times)
        self.check_rank = session.guarded("rank-check")(self._check_rank)
        self.unseen = session.guarded("collectives")(self._record_unseen)

    # -- installation -------------------------------------------------------------
    def install(self, c10d: ModuleType) -> None:
        """Wrap the functions of ``torch.distributed.distributed_c10d`` (the names that
        ``torch.distributed`` re-exports are bound after this hook runs)."""
        self._c10d = c10d
        dist = sys.modules.get("torch.distributed")
        for op in PAYLOAD_ARG:
            original = getattr(c10d, op, None)
            if original is None or getattr(original, "__lorascope__", False):
                continue
            wrapped = self._wrap(op, original)
            setattr(c10d, op, wrapped)
            if dist is not None and getattr(dist, op, None) is original:
                setattr(dist, op, wrapped)
        work = getattr(c10d, "Work", None)
        wait = getattr(work, "wait", None)
        if wait is not None and not getattr(wait, "__lorascope__", False):
            work.wait = self._wrap_work_wait(wait)  # type: ignore[union-attr]
        self._watch_init(c10d, dist)

    def install_deepspeed_comm(self, comm: ModuleType) -> None:
        """DeepSpeed's torch backend keeps ``all_gather_into_tensor`` and
        ``reduce_scatter_tensor`` as attributes (``all_gather_function``,
        ``reduce_scatter_function``: ZeRO-3's gathers and ZeRO's gradient reductions),
        taken when it was built. A job probed from its start built it from the wrappers;
        one attached later holds the originals: re-pointed here to the wrappers."""
        backend = getattr(comm, "cdb", None)
        c10d = self._c10d
        if backend is None or c10d is None:
            return
        for attr in ("all_gather_function", "reduce_scatter_function"):
            held = getattr(backend, attr, None)
            name = getattr(held, "__name__", None)
            wrapper = getattr(c10d, name, None) if isinstance(name, str) else None
            if held is not None and not getattr(held, "__lorascope__", False):
                if getattr(wrapper, "__wrapped__", None) is held:
                    setattr(backend, attr, wrapper)

    def _watch_init(self, c10d: ModuleType, dist: ModuleType | None) -> None:
        """Learn the process-group timeout the job sets (the stall watchdog scales with it),
        and check the rank the probes took against torch.distributed's."""
        original = c10d.init_process_group
        if getattr(original, "__lorascope__", False):
            return
        signature = inspect.signature(original)
        probe = self

        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            try:
                timeout = signature.bind_partial(*args, **kwargs).arguments.get("timeout")
                if timeout is not None:
                    probe.pg_timeout = float(timeout.total_seconds())
            except Exception:
                pass
            out = original(*args, **kwargs)
            probe.check_rank(c10d)
            return out

        init_process_group.__lorascope__ = True  # type: ignore[attr-defined]
        init_process_group.__wrapped__ = original  # type: ignore[attr-defined]
        c10d.init_process_group = init_process_group  # type: ignore[attr-defined]
        if dist is not None and getattr(dist, "init_process_group", None) is original:
            dist.init_process_group = init_process_group  # type: ignore[attr-defined]

    def install_functional(self, funcol: ModuleType) -> None:
        """Wrap the functional collectives and their ``wait_tensor`` (callers look them up
        on the module at call time: DTensor's ``funcol.all_gather_single(...)``)."""
        for name in FUNCTIONAL_PAYLOAD_ARG:
            original = getattr(funcol, name, None)
            if original is not None and not getattr(original, "__lorascope__", False):
                setattr(funcol, name, self._wrap_functional(funcol, name, original))
        wait = getattr(funcol, "wait_tensor", None)
        if wait is not None and not getattr(wait, "__lorascope__", False):
            funcol.wait_tensor = self._wrap_wait(wait)  # type: ignore[attr-defined]

    def install_ddp(self, ddp_module: ModuleType) -> None:
        """DDP's gradient all_reduces come from its C++ Reducer, which no Python wrapper
        sees: say so in the run when a job builds one."""
        ddp = ddp_module.DistributedDataParallel
        original = getattr(ddp, "_ddp_init_helper", None)
        if original is None or getattr(original, "__lorascope__", False):
            return
        probe = self

        @functools.wraps(original)
        def _ddp_init_helper(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            probe.unseen(
                "ddp-reducer", "DistributedDataParallel's gradient bucket all_reduces are issued by its C++ Reducer"
            )
            return out

        _ddp_init_helper.__lorascope__ = True  # type: ignore[attr-defined]
        ddp._ddp_init_helper = _ddp_init_helper

    def _record_unseen(self, path: str, why: str) -> None:
        """A ``coll_unseen`` record, once per path: the job uses a collective path the
        probes cannot wrap from Python (the analysis points to the flight recorder)."""
        if path in self._unseen:
            return
        self._unseen.add(path)
        self.session.record("coll_unseen", path=path, why=why, step=self.session.step)

    def _check_rank(self, c10d: ModuleType) -> None:
        """A ``dist_init`` record: torch.distributed's rank and world size, which the reader
        trusts over the launcher variables the probes read at start."""
        session = self.session
        rank, world = int(c10d.get_rank()), int(c10d.get_world_size())
        session.record("dist_init", rank=rank, world_size=world, backend=str(c10d.get_backend()))
        if (rank, world) != (session.rank, session.world_size):
            print(
                f"lorascope: this process was probed as rank {session.rank} of {session.world_size}, "
                f"but torch.distributed says rank {rank} of {world}; the analysis uses the latter",
                file=sys.stderr,
            )

    def pending(self) -> list[dict[str, Any]]:
        """The calls in flight now (a copy; read from the dump thread)."""
        self._poll()
        names = self._group_names
        return [c.pending(names.get(c.gid, str(c.gid))) for c in list(self._in_flight.values())]

    def made(self) -> dict[str, int]:
        """The collectives made so far on each process group, by its name (the sequence
        number of its latest call; sends and receives, numbered apart, are left out)."""
        names = self._group_names
        return {names.get(gid, str(gid)): seq for gid, seq in list(self._seq.items()) if gid >= 0}

    def _wrap(self, op: str, original: Any) -> Any:
        params = list(inspect.signature(original).parameters)
        group_pos = params.index("group") if "group" in params else -1
        async_pos = params.index("async_op") if "async_op" in params else -1
        payload_pos, payload_kw = PAYLOAD_ARG[op]
        always_async = op in ("isend", "irecv", "batch_isend_irecv")
        spec = _Spec(op, group_pos, async_pos, payload_pos, payload_kw, always_async, False)
        return self._recorded(op, original, functools.partial(self._begin, spec), self._returned)

    def _wrap_functional(self, funcol: ModuleType, name: str, original: Any) -> Any:
        """A functional collective: recorded as an async call (it returns an
        ``AsyncCollectiveTensor`` before the work is done) on the process group its
        ``group`` argument names (a group, a mesh, a mesh dimension, a name)."""
        params = list(inspect.signature(original).parameters)
        group_pos = params.index("group")
        payload_pos, payload_kw = FUNCTIONAL_PAYLOAD_ARG[name]
        op = FUNCTIONAL_PREFIX + name
        spec = _Spec(op, -1, -1, 0, payload_kw, True, True)
        probe = self

        def begin(args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Started | None:
            group = probe._functional_group(
                funcol, kwargs.get("group", args[group_pos] if group_pos < len(args) else None)
            )
            payload = kwargs.get(payload_kw, args[payload_pos] if payload_pos < len(args) else None)
            return probe._begin(spec, (payload,), {"group": group})

        return self._recorded(name, original, begin, self._end_when_waited)

    def _recorded(
        self,
        name: str,
        original: Any,
        begin: Callable[[tuple[Any, ...], dict[str, Any]], _Started | None],
        returned: Callable[[_Started | None, Any], None],
    ) -> Any:
        """``original`` recorded as one call: ``begin`` before it, ``returned`` with what it
        returned, or its end with the error it raised. A call made inside another recorded
        call (``all_gather_object`` uses ``all_gather``), or with the probe off, passes
        straight through."""
        probe = self
        session = self.session
        clock = time.perf_counter_ns

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            local = probe._local
            if getattr(local, "depth", 0) or "collectives" in session.disabled:
                return original(*args, **kwargs)
            local.depth = 1
            spent = 0
            try:
                began = clock()
                started = begin(args, kwargs)
                # Counted whether or not the call returns: the reading of a new call site's
                # source is counted apart inside it (``sites_ns``), and a call that raises
                # (a hang's timeout) must not leave it out of the calls' own time.
                spent = clock() - began
                try:
                    result = original(*args, **kwargs)
                except BaseException as exc:
                    back = clock()
                    probe._end(started, repr(exc)[:500])
                    spent += clock() - back
                    raise
                back = clock()
                returned(started, result)
                spent += clock() - back
                return result
            finally:
                session.calls_ns += spent
                session.calls += 1
                local.depth = 0

        return _like(wrapper, original, name)

    def _functional_group(self, funcol: ModuleType, group: Any) -> Any:
        """The ProcessGroup a functional collective's ``group`` argument names; else the
        argument as given (the group record then names it as best it can)."""
        c10d = self._c10d
        if c10d is None or isinstance(group, c10d.ProcessGroup):
            return group
        try:
            return c10d._resolve_process_group(funcol._resolve_group_name(group))
        except Exception:
            return group

    def _end_when_waited(self, started: _Started | None, result: Any) -> None:
        """A functional collective ends when every output it returned is waited for
        (``wait_tensor`` on it) or freed; one that returned plain tensors (waited inside,
        or traced) ends now."""
        if started is None:
            return
        try:
            outputs = result if isinstance(result, (list, tuple)) else [result]
            elems = [out.elem for out in outputs if hasattr(out, "trigger_wait") and hasattr(out, "elem")]
            if not elems:
                self._end(started, None)
                return
            call = _Awaited(started, len(elems))
            for elem in elems:
                key = id(elem)
                self._awaited[key] = (call, weakref.finalize(elem, self._output_done, key, None))
        except Exception as exc:
            self._end(started, None)
            self.session.fail("collectives", exc)

    def _output_done(self, key: int, err: str | None) -> None:
        entry = self._awaited.pop(key, None)
        if entry is None:
            return
        call, finalizer = entry
        finalizer.detach()
        call.left -= 1
        if call.left == 0 or (err is not None and call.left > 0):
            call.left = -1  # ended: the call's other outputs end nothing more
            self._end(call.started, err)

    def _wrap_wait(self, original: Any) -> Any:
        probe = self
        session, local, clock = self.session, self._local, time.perf_counter_ns

        def wait_tensor(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            began = clock()
            try:
                out = original(tensor, *args, **kwargs)
            except BaseException as exc:
                probe._output_done(id(tensor), repr(exc)[:500])
                raise
            finally:
                back = clock()
                if not getattr(local, "depth", 0) and "collectives" not in session.disabled:
                    session.waited_ns += back - began
            if probe._awaited:
                probe._output_done(id(tensor), None)
            session.calls_ns += clock() - back
            return out

        return _like(wait_tensor, original, "wait_tensor")

    # -- one call -----------------------------------------------------------------
    def _begin(self, spec: _Spec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Started | None:
        """A call begins: its record in the call file before the call starts (the rank may
        block or die in it). The hot path of every call: written for few Python
        operations (each costs ~0.3-0.5 us on the job's thread, ~10x a warm loop's)."""
        try:
            op, group_pos, async_pos, payload_pos, payload_kw, always_async, functional = spec
            group = kwargs.get("group", args[group_pos] if 0 <= group_pos < len(args) else None)
            is_async = always_async or bool(
                kwargs.get("async_op", args[async_pos] if 0 <= async_pos < len(args) else False)
            )
            known = self._gids.get(id(group)) if group is not None else None
            gid = known[0] if known is not None else self._gid(group)
            seqs = self._seq
            peer = None
            if op in P2P_OPS:  # numbered apart: a send is no collective of the group (~gid: its own counter)
                counter = ~gid
                seq = seqs[counter] = seqs.get(counter, 0) + 1
                peer = _peer(args, kwargs, group, self._c10d)
            else:
                counter = gid
                seq = seqs[gid] = (self._group_seq(group) if self._torch_seq else None) or seqs.get(gid, 0) + 1
            nbytes: int | None = None
            dtype: Any = None
            first = None
            if payload_pos >= 0:
                payload: Any = kwargs.get(payload_kw, args[payload_pos] if payload_pos < len(args) else None)
                if hasattr(payload, "element_size"):  # one tensor (most calls)
                    first = payload
                    nbytes, dtype = payload.nbytes, payload.dtype
                else:
                    tensors = _tensors(payload)
                    if tensors:
                        first = tensors[0]
                        nbytes = first.nbytes if len(tensors) == 1 else sum(t.nbytes for t in tensors)
                        dtype = first.dtype
            elif op in ("barrier", "monitored_barrier"):
                nbytes = 0
            site, via = self._site()
            key = (op, dtype, is_async, site, via)
            shape = self._shapes.ids.get(key)
            if shape is None:
                shape = self._shapes.declare(key)
            t = time.time()
            # in the call file before the call starts: the rank may block in it, or die
            size = -1 if nbytes is None else nbytes
            # CallFile.begin without its call layer: its end 0.0, not yet
            index = self.calls.put(t, 0.0, seq, size, self.session.step, gid, shape) if shape >= 0 else -1
            call = _Call(index, t, seq, gid, nbytes, key, counter, peer)
            self._in_flight[call.flight] = call
            # tuple.__new__: a NamedTuple's own __new__ is a Python function (a call's worth)
            if first is not None and getattr(first, "is_cuda", False):
                events = None if is_async else self._cuda_events(first)
                return tuple.__new__(_Started, (call, events, True))
            return tuple.__new__(_Started, (call, None, False))
        except Exception as exc:
            self.session.fail("collectives", exc)
            return None

    def _group_seq(self, group: Any) -> int | None:
        """The number torch gives this call in its group (its count of the group's
        collectives so far, plus one), or None where the backend keeps none."""
        if group is None and self._c10d is not None:
            group = self._c10d.GroupMember.WORLD
        try:
            return int(group._get_sequence_number_for_group()) + 1
        except Exception:
            return None

    def on_stack(self) -> list[dict[str, Any]]:
        """The collective the main thread is inside now that the wrappers never saw begin
        (it began before ``lorascope attach``), read from its stack: op and call site, no
        sequence number or group. Empty when none or when a recorded call is in flight."""
        if self._in_flight:
            return []
        frame: FrameType | None = sys._current_frames().get(threading.main_thread().ident or -1)
        op = None
        while frame is not None:
            code = frame.f_code
            if op is None and code.co_name in PAYLOAD_ARG and code.co_filename.endswith("distributed_c10d.py"):
                op = code.co_name
            elif op is not None and not self._is_internal(code.co_filename):
                site = self._describe(frame)
                return [
                    {
                        "group": "?",
                        "seq": "?",
                        "op": op,
                        "bytes": None,
                        "site": site,
                        "via": self._via(frame, site),
                        "source": "begun before lorascope attached: read from its stack",
                    }
                ]
            frame = frame.f_back
        return []

    def _end(self, started: _Started | None, err: str | None) -> None:
        if started is None:
            return
        call, events, _ = started
        if err is not None and call.index >= 0:  # before the end: a reader that sees it ended sees why
            self.session.stream.write(
                {"k": "coll_err", "index": call.index, "gid": call.gid, "seq": call.seq, "err": err, **call.p2p}
            )
            self.session.keep_steps.add(self.session.step)
        self.calls.end(call.index, time.time())
        self._in_flight.pop(call.flight, None)
        if events is not None:
            try:
                start, end, stream, began = events
                end.record(stream)
                self._events.append((call, start, end, time.perf_counter() - began))
            except Exception as exc:
                self.session.fail("collectives", exc)

    def _returned(self, started: _Started | None, result: Any) -> None:
        """A c10d call returned: any call but an ``async_op`` one has ended. An ``async_op``
        call ends when its work completes (the rank may wait for it much later,
        ``work.wait()``: blocked there, it is in a collective), not when it returns.

        A host call (gloo, a CPU payload) ends when its work is first seen completed: when
        the job's ``wait()`` on it returns (the exact end when the rank blocked there), or
        at the stream's next flush (the writer's 40 ms tick, a synchronous call, a dump,
        the end), whichever comes first. Not a callback on the work's future: that runs on
        the backend's worker thread, which must then take the GIL, and while the job's
        thread holds it (up to the 5 ms switch interval) the worker starts no other queued
        collective and the peer waits (on the CPU job, ~4 points of step time in paired
        runs). On a CUDA payload ``wait()`` returns once the job's stream
        waits for the collective, not when it is done, so a device call keeps the
        callback (which takes the time and the future's error). Without a way to tell
        completion, the call ends now."""
        if result is None or started is None or not hasattr(result, "get_future"):
            self._end(started, None)
            return
        try:
            if not started.on_device and hasattr(result, "is_completed"):
                self._open[id(result)] = (started, result)
                return
            future = result.get_future()
            future.add_done_callback(lambda done: self._end(started, _future_error(done)))
        except Exception:
            self._end(started, None)

    def _poll(self) -> None:
        """End the host async calls whose work has completed (called before every flush of
        the stream, from whichever thread flushes, and before pending calls are read).
        A call is ended by the one thread that takes it out of ``_open``. On the stream's
        writer thread, the calls the ring will overwrite are folded into step sums."""
        steps = self._call_steps
        if steps.due() and threading.current_thread() is self.session.stream.writer_thread:
            try:
                steps.look(self.session.step)
            except Exception as exc:
                self.session.fail("collectives", exc)
        if not self._open:
            return
        try:
            for key, (_, work) in list(self._open.items()):
                if work.is_completed():
                    entry = self._open.pop(key, None)
                    if entry is not None:  # this thread took it: only now ask for its error
                        self._end(entry[0], _failure(work))
        except Exception as exc:
            self.session.fail("collectives", exc)

    def _end_open(self, key: int, err: str | None) -> None:
        """End the open call of work ``id`` ``key`` with ``err`` (None: it succeeded), if
        no other thread has taken it out of ``_open`` first."""
        entry = self._open.pop(key, None)
        if entry is not None:
            self._end(entry[0], err)

    def _wrap_work_wait(self, original: Any) -> Any:
        """``Work.wait`` at class level: a host async call ends when the job's wait for it
        returns (or raises: its error). Any other work passes straight through. The time
        blocked in it, outside a recorded call (a synchronous call waits on its own work:
        its time is the call's), adds to ``session.waited_ns``, as ``wait_tensor``'s does."""
        probe = self
        session, opened, in_flight, clock = self.session, self._open, self._in_flight, time.perf_counter_ns
        calls, local = self.calls, self._local

        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            began = clock()
            try:
                out = original(work, *args, **kwargs)
            except BaseException as exc:
                if probe._open:
                    probe._end_open(id(work), repr(exc)[:500])
                raise
            finally:
                back = clock()
                if not getattr(local, "depth", 0) and "collectives" not in session.disabled:
                    session.waited_ns += back - began
            if opened:
                entry = opened.pop(id(work), None)
                if entry is not None:  # _end of a host call (no events), inline
                    call = entry[0].call
                    calls.end(call.index, time.time())
                    in_flight.pop(call.flight, None)
            session.calls_ns += clock() - back
            return out

        return _like(wait, original, "wait")

    def _cuda_events(self, tensor: Any) -> tuple[Any, Any, Any, float]:
        """A start event recorded now on the payload device's current stream, the end
        event to record on the same stream, and the host clock."""
        torch = sys.modules["torch"]
        stream = torch.cuda.current_stream(tensor.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        return start, end, stream, time.perf_counter()

    def _resolve_device_times(self) -> None:
        """Turn finished CUDA event pairs into ``coll_dev`` records (called at step ends
        and at the end). In call order: the first pair not done yet stops the walk, so
        no event is ever waited for."""
        while self._events:
            call, start, end, host_s = self._events[0]
            if not end.query():
                return
            self._events.popleft()
            self.session.record(
                "coll_dev",
                seq=call.seq,
                gid=call.gid,
                **call.p2p,
                ms=round(float(start.elapsed_time(end)), 4),
                host_ms=round(host_s * 1e3, 4),
            )

    # -- groups and call sites ----------------------------------------------------
    def _gid(self, group: Any) -> int:
        c10d = self._c10d
        if group is None and c10d is not None:
            group = c10d.GroupMember.WORLD
        key = id(group)
        known = self._gids.get(key)
        if known is not None:
            return known[0]
        with self._lock:
            known = self._gids.get(key)
            if known is not None:  # another thread named it first
                return known[0]
            gid = self._next_gid
            self._next_gid += 1
            try:
                held: Any = weakref.ref(group, lambda ref: self._forget_group(key, ref))
            except TypeError:  # None, a name, a list of ranks
                held = group
            self._gids[key] = (gid, held)
        name: str = str(gid)
        ranks: list[int] | None = None
        backend: str | None = None
        if c10d is not None and group is not None:
            try:
                name = str(c10d._get_process_group_name(group))
            except Exception:
                name = str(getattr(group, "group_name", gid))
            try:
                ranks = [int(r) for r in c10d.get_process_group_ranks(group)]
            except Exception:
                ranks = None
            try:
                backend = str(c10d.get_backend(group))
            except Exception:
                backend = None
        if group is not None and c10d is not None and group is c10d.GroupMember.WORLD:
            name = "default_pg"
        self._group_names[gid] = name
        # on disk at once: the call file's records name the group by gid
        self.session.stream.write({"k": "group", "gid": gid, "name": name, "ranks": ranks, "backend": backend})
        return gid

    def _forget_group(self, key: int, ref: weakref.ref[Any]) -> None:
        """A group is gone (a weak reference's callback): its entry goes, if it is still
        the one this reference was made for."""
        entry = self._gids.get(key)
        if entry is not None and entry[1] is ref:
            self._gids.pop(key, None)

    def _site(self, depth: int = 3) -> tuple[str | None, str | None]:
        """The call site (the first frame outside torch, DeepSpeed and lorascope) and, when
        its line sits in no rank condition, ``via``: the nearest caller in the job's own
        code whose line does (a save helper, a library's or the job's own, called under
        ``if rank == 0:``).

        Most calls come from deep in a library (a ZeRO-3 step's reduce-scatters are ~17
        frames below the job's ``engine.step()``), and following ``f_back`` makes a frame
        object of every frame on the way (~0.5 us each in the job; a frame object also
        copies its locals when its frame returns). So a walk that passed library frames
        leaves a ``_Hop``: for a call whose first two frames are the same instructions
        again, the frame that many up is read straight (``sys._getframe`` makes no frame
        object of the frames it passes) and taken as the site when it and the frame
        below it are the same instructions as the walk's; else the walk is taken."""
        first = sys._getframe(depth)  # from the wrapper up (our own frames are skipped)
        second = first.f_back
        key: _HopKey | None = None
        if second is not None:
            key = (id(first.f_code), first.f_lasti, id(second.f_code), second.f_lasti)
            hop = self._hops.get(key)
            if hop is not None:
                try:
                    under: FrameType | None = sys._getframe(depth + hop.depth - 1)
                except ValueError:  # a shallower stack than the walk's
                    under = None
                found = under.f_back if under is not None else None
                if (
                    found is not None
                    and under is not None
                    and (id(under.f_code), under.f_lasti) == hop.below
                    and (id(found.f_code), found.f_lasti) == hop.site
                ):
                    site = self._sites.get(hop.site) or self._describe(found)
                    return site, self._via(found, site)
        frame: FrameType | None = first
        below: FrameType | None = None
        depth = 0
        internal = self._internal
        while frame is not None:
            code = frame.f_code
            skip = internal.get(id(code))
            if skip is None:
                skip = self._is_internal(code.co_filename)
                if self._keep(code):
                    internal[id(code)] = skip
            if not skip:
                site = self._describe(frame)
                if key is not None and second is not None and below is not None and depth >= HOP_MIN:
                    self._remember_hop(key, first, second, below, frame, depth)
                return site, self._via(frame, site)
            below = frame
            frame = frame.f_back
            depth += 1
        return None, None

    def call_site(self) -> tuple[str | None, str | None]:
        """The site and ``via`` (as :meth:`_site`) of the job's call into another probe's
        wrapper, called straight from that probe's method, itself called straight from the
        wrapper (the same depth as a collective's)."""
        return self._site(4)

    def _remember_hop(
        self, key: _HopKey, first: FrameType, second: FrameType, below: FrameType, site: FrameType, depth: int
    ) -> None:
        """Keep a walk's result as a ``_Hop`` for calls from the same first two frames, if
        every code object it names is kept alive (so that no id in it is another's later)
        and there is room."""
        if len(self._hops) >= MAX_HOPS:
            return
        if all(self._keep(frame.f_code) for frame in (first, second, below, site)):
            self._hops[key] = _Hop(depth, (id(below.f_code), below.f_lasti), (id(site.f_code), site.f_lasti))

    def _keep(self, code: CodeType) -> bool:
        """Whether ``code`` may be cached by its id (kept alive here: under MAX_KEPT_CODES)."""
        kept = self._kept
        if kept.get(id(code)) is code:
            return True
        if len(kept) >= MAX_KEPT_CODES:
            return False
        kept[id(code)] = code
        return True

    def _describe(self, frame: FrameType) -> str:
        """The frame as a site, its source context recorded once."""
        code = frame.f_code
        key = (id(code), frame.f_lasti)
        site = self._sites.get(key)
        if site is not None:
            return site
        line = frame.f_lineno
        site = f"{code.co_filename}:{line} in {code.co_name}"
        if site not in self._described:
            began = time.perf_counter_ns()
            context = describe(code.co_filename, line)
            # known before the site is cached or marked described: the dump thread of an
            # attached process describes sites too, and a caller reads this at once
            self._conditioned[site] = rank_condition_in(context) is not None
            self._described.add(site)
            self.session.record("site", site=site, **context)
            self.session.sites_ns += time.perf_counter_ns() - began
            self.session.sites += 1
        if self._keep(code):
            self._sites[key] = site
        return site

    def _via(self, frame: FrameType, site: str) -> str | None:
        """Up from a call site whose own line sits in no rank condition to the first
        caller in the job's own code whose line does, at most MAX_VIA_FRAMES frames up.
        Library (and torch, DeepSpeed, lorascope) frames on the way are not read (parsing
        every library file a call passes through would cost memory and time at the first
        call); the job's own files are read once, as call sites are, and each of its
        lines is looked at once (cached by code object and line). The loop is the probes'
        hottest: ~0.4 us a frame here."""
        if self._conditioned.get(site):
            return None  # the condition is at the call site itself
        caller = frame.f_back
        foreign, lines = self._foreign, self._line_conditioned
        left = MAX_VIA_FRAMES
        while left and caller is not None:
            code = caller.f_code
            skip = foreign.get(id(code))
            if skip is None:
                filename = code.co_filename
                skip = self._library_file(filename) or self._is_internal(filename)
                if self._keep(code):
                    foreign[id(code)] = skip
            if not skip:
                key = (id(code), caller.f_lasti)
                conditioned = lines.get(key)
                if conditioned is None:
                    conditioned = self._conditioned[self._describe(caller)]
                    if self._keep(code):
                        lines[key] = conditioned
                if conditioned:
                    return self._describe(caller)
            caller = caller.f_back
            left -= 1
        return None

    def _library_file(self, filename: str) -> bool:
        return "-packages" in filename or self._stdlib_file(filename)

    def _is_internal(self, filename: str) -> bool:
        """Called once per code object (the answer is cached by _site)."""
        for name in ("torch", "deepspeed", "lorascope"):
            module = sys.modules.get(name)
            file = getattr(module, "__file__", None) if module is not None else None
            if file and filename.startswith(os.path.dirname(file) + os.sep):
                return True
        return self._stdlib_file(filename)

    def _stdlib_file(self, filename: str) -> bool:
        return filename.startswith(self._stdlib) and "-packages" not in filename


def _failure(work: Any) -> str | None:
    """A completed work's error, as the ``err`` of its call (None: it succeeded), read
    from its future: ``Work.exception()`` and ``Work.is_success()`` are deprecated in
    torch and print a warning on the job's stderr the first time."""
    try:
        future = work.get_future()
    except Exception:
        return None  # a work without a future: an error of it surfaces in its wait()
    return _future_error(future)


def _future_error(future: Any) -> str | None:
    """A completed future's error (``value()`` raises it), else None."""
    try:
        future.value()
    except Exception as exc:
        return repr(exc)[:500]
    return None
