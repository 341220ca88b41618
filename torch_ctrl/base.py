"""``ControlCollectives``: the abstract interface, and argument checking shared by
both implementations (so bad input fails the same way, before any store traffic)."""

from __future__ import annotations

import abc
import inspect
import logging
import math
import operator
import os
import sys
import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from typing import NoReturn, Union

import torch.distributed as dist

from . import lanes
from .errors import UNREACHABLE, CollectiveAbortedError, CollectiveError, StoreUnreachableError, init_error, one_line
from .lanes import BASIC, base_store, check_server, connection_lost, lost_text, python_methods, server_of

Data = Union[bytes, bytearray, memoryview, str]
Timeout = Union[timedelta, int, float]

DEFAULT_TIMEOUT = timedelta(seconds=300)
# The longest timeout: larger ones (inf, timedelta.max) mean this. Store clients wait with
# poll()'s 32-bit millisecond timeouts (at most 24.8 days); 10 days stays well inside them.
MAX_TIMEOUT = 10 * 24 * 3600.0
MIN_HEARTBEAT = 0.01  # seconds: 100 writes a second per rank at most
MAX_WORLD_SIZE = (1 << 31) - 1  # ranks are 32-bit in the C++ implementation
MAX_HEARTBEAT = 3600.0

# An abort reason is cut to this many bytes of UTF-8 (marker included) before it is written:
# it travels in every peer's error message, and TCPStore cannot carry a value over 8 MiB.
MAX_REASON_BYTES = 4096
# How long abort_on_error() lets the abort take before it re-raises the caller's exception
# (a healthy abort is one store round trip; a dead store can take the store's timeout, twice).
ABORT_ON_ERROR_TIMEOUT = 2.0

log = logging.getLogger("torch_ctrl")

# The nine collective methods of ControlCollectives, in documentation order.
METHODS = (
    "barrier",
    "broadcast_send",
    "broadcast_recv",
    "gather_send",
    "gather_recv",
    "scatter_send",
    "scatter_recv",
    "all_gather",
    "all_sum",
)
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


class ControlCollectives(abc.ABC):
    """Collectives over small byte payloads for the control plane of a job.

    Every method takes a ``key`` that names the operation (``None``: the next
    automatic key of this instance, so all ranks must then call keyless
    collectives in the same order) and a ``timeout`` (``timedelta`` or seconds,
    default 300 s). ``data`` is ``bytes``, ``bytearray``, ``memoryview`` or ``str``
    (UTF-8); results are ``bytes``. Bad arguments raise ``TypeError``/``ValueError``
    before anything is written to the store.

    Every collective raises :class:`~torch_ctrl.CollectiveTimeoutError` when it does not
    complete in time, :class:`~torch_ctrl.CollectiveAbortedError` when the group is
    aborted, :class:`~torch_ctrl.CollectiveError` when the store fails, and
    :class:`~torch_ctrl.KeyReusedError` when an explicit key was already used on this
    instance. Instances are context managers (:meth:`close` on exit).

    Type code against this class; :class:`torch_ctrl.StoreCollectives` is the implementation.

    Example::

        def sync_step(coll: torch_ctrl.ControlCollectives, step: int) -> None:
            coll.barrier(f"step-{step}", timeout=60)
    """

    @abc.abstractmethod
    def barrier(self, key: str | None = None, timeout: Timeout = DEFAULT_TIMEOUT, block: bool = True) -> None:
        """Block until all ranks have entered the barrier.

        Args:
            key: names this barrier; ``None``: the next automatic key.
            timeout: how long to wait for the other ranks.
            block: ``False`` only arrives and returns at once (the others still wait for this rank).

        Raises:
            CollectiveTimeoutError: not every rank arrived in time (``missing`` names them).

        Example::

            coll.barrier("checkpoint-saved", timeout=120)
        """

    @abc.abstractmethod
    def broadcast_send(
        self, key: str | None = None, data: Data | None = None, timeout: Timeout = DEFAULT_TIMEOUT
    ) -> None:
        """Send ``data`` to every other rank; exactly one rank (the root) calls it.

        Args:
            key: names this broadcast; the receivers use the same key.
            data: the payload (any size: values over 4 MiB are chunked).
            timeout: bounds the store calls.

        Example::

            if coll.rank == 0:
                coll.broadcast_send("plan", json.dumps(plan))
        """

    @abc.abstractmethod
    def broadcast_recv(self, key: str | None = None, timeout: Timeout = DEFAULT_TIMEOUT) -> bytes:
        """Receive the data broadcast under ``key``.

        Returns:
            The root's payload.

        Raises:
            CollectiveTimeoutError: the root sent nothing in time (``nothing was sent``).

        Example::

            plan = json.loads(coll.broadcast_recv("plan", timeout=60))
        """

    @abc.abstractmethod
    def gather_send(self, key: str | None = None, data: Data | None = None, timeout: Timeout = DEFAULT_TIMEOUT) -> None:
        """Send ``data`` to the gathering rank (the one calling :meth:`gather_recv` with this key).

        Example::

            coll.gather_send("stats", json.dumps(my_stats))
        """

    @abc.abstractmethod
    def gather_recv(
        self, key: str | None = None, data: Data | None = None, timeout: Timeout = DEFAULT_TIMEOUT
    ) -> list[bytes]:
        """Collect every rank's data on this rank (the root).

        Args:
            key: names this gather; the senders use the same key.
            data: this rank's own contribution.
            timeout: how long to wait for the senders.

        Returns:
            ``world_size`` payloads in rank order, this rank's ``data`` included.

        Raises:
            CollectiveTimeoutError: some ranks sent nothing in time (``missing`` names them).

        Example::

            stats = [json.loads(b) for b in coll.gather_recv("stats", json.dumps(my_stats))]
        """

    @abc.abstractmethod
    def scatter_send(
        self, key: str | None = None, data: Sequence[Data] | None = None, timeout: Timeout = DEFAULT_TIMEOUT
    ) -> bytes:
        """Send ``data[i]`` to rank ``i`` (this rank is the root).

        Args:
            key: names this scatter; the receivers use the same key.
            data: a sequence of exactly ``world_size`` payloads.
            timeout: bounds the store calls.

        Returns:
            This rank's own element, ``data[rank]``.

        Raises:
            ValueError: ``data`` does not have ``world_size`` elements.

        Example::

            mine = coll.scatter_send("shards", [f"shard-{i}" for i in range(coll.world_size)])
        """

    @abc.abstractmethod
    def scatter_recv(self, key: str | None = None, timeout: Timeout = DEFAULT_TIMEOUT) -> bytes:
        """Receive this rank's element of a scatter.

        Returns:
            ``data[rank]`` of the root's :meth:`scatter_send`.

        Raises:
            CollectiveTimeoutError: the root sent nothing in time.

        Example::

            shard = coll.scatter_recv("shards", timeout=60).decode()
        """

    @abc.abstractmethod
    def all_gather(
        self, key: str | None = None, data: Data | None = None, timeout: Timeout = DEFAULT_TIMEOUT
    ) -> list[bytes]:
        """Every rank's data, in rank order, on every rank.

        Args:
            key: names this all_gather.
            data: this rank's payload.
            timeout: how long to wait for every rank.

        Returns:
            ``world_size`` payloads in rank order.

        Raises:
            CollectiveTimeoutError: not every rank arrived in time (``missing`` names them).

        Example::

            hosts = [h.decode() for h in coll.all_gather("hosts", socket.gethostname())]
        """

    @abc.abstractmethod
    def all_sum(self, key: str | None = None, data: int | None = None, timeout: Timeout = DEFAULT_TIMEOUT) -> int:
        """The sum of every rank's integer, on every rank.

        Args:
            key: names this all_sum.
            data: this rank's integer (signed 64-bit).
            timeout: how long to wait for every rank.

        Returns:
            The sum, wrapping at 64 bits like torch's store counters.

        Raises:
            ValueError: ``data`` does not fit in a signed 64-bit integer.
            CollectiveTimeoutError: not every rank arrived in time.

        Example::

            total = coll.all_sum("samples", len(my_samples))
        """

    def abort(self, reason: str = "") -> None:
        """Mark the group as failed by this rank: peers blocked in any collective raise
        :class:`~torch_ctrl.CollectiveAbortedError` within a second, later collectives at once.

        Args:
            reason: one line saying why; the first abort's reason is what every rank reports.
                Cut to ``MAX_REASON_BYTES`` (4096) bytes of UTF-8, ending in
                ``" [truncated from N bytes]"``, by both implementations.

        Raises:
            NotImplementedError: the backend has no fail-fast support.
            CollectiveError: the store cannot be reached (``abort: store unreachable: ...``,
                at once when the store's server refuses connections).

        Example::

            coll.abort("disk full")
        """
        raise NotImplementedError(f"{type(self).__name__} does not support abort()")

    def abort_on_error(self, abort_timeout: Timeout = ABORT_ON_ERROR_TIMEOUT) -> AbstractContextManager[None]:
        """Context manager: if the block raises, abort the group with the exception's type and
        first line (``"OSError: disk full"``), then re-raise that exception unchanged
        (``sys.exit(0)`` and ``sys.exit()`` abort nothing).

        The abort is given at most ``abort_timeout`` (default 2 s): a healthy abort takes one
        store round trip, but with the store down it could take the store's timeout. If it
        fails or is not done in time, the caller's exception is still what is raised: the
        failure is logged (logger ``torch_ctrl``, warning) and added to the exception as a
        note (Python 3.11+); an abort still in progress goes on in the background.

        Args:
            abort_timeout: how long to wait for the abort (``timedelta`` or seconds).

        Example::

            with coll.abort_on_error():
                load_checkpoint()
        """
        # Checked here, at the call, not when the block is entered: ``abort_on_error("soon")``
        # fails at once, naming its own parameter.
        return _aborting_on_error(self, to_seconds(abort_timeout, "abort_timeout"))

    def close(self, flush_timeout: Timeout = 5.0) -> None:  # noqa: B027 - optional for other backends
        """Release resources (background threads, connections); a no-op by default.

        Calls still running on other threads are not interrupted, and ``close()`` does not wait
        for them: they complete, fail or time out as they would have (call :meth:`abort` first
        to release them, and the whole group, at once). An instance used after ``close()``
        opens what it needs again.

        Args:
            flush_timeout: how long to let background key cleanup finish first (``timedelta``
                or seconds, at least 0; above 10 days means 10 days, as every timeout). Checked
                before anything is done: a bad value raises and leaves the instance open.

        Example::

            coll.close()  # or: with torch_ctrl.StoreCollectives(...) as coll: ...
        """

    def __enter__(self) -> ControlCollectives:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        """Close; if the block raised, first abort the group, as :meth:`abort_on_error` does
        (bounded by 2 s, the exception is re-raised unchanged), so that peers blocked in a
        collective with this rank fail within a second instead of waiting out their timeout.
        Not for ``sys.exit(0)``, nor when the group is already aborted."""
        if exc is not None and fails(exc) and not isinstance(exc, CollectiveAbortedError):
            if type(self).abort is not ControlCollectives.abort:  # a backend that can abort
                _abort_for(self, exc, ABORT_ON_ERROR_TIMEOUT)
        self.close()


# Instances of this process not closed yet: an exit on an uncaught exception aborts their
# groups (abort_open_groups_on_crash), and an abort one of them learns of reaches the others of
# its group (spread_abort). Both implementations add and discard themselves.
_OPEN: weakref.WeakSet[ControlCollectives] = weakref.WeakSet()


@contextmanager
def _aborting_on_error(coll: ControlCollectives, seconds: float) -> Iterator[None]:
    """The context manager of :meth:`ControlCollectives.abort_on_error`, its bound checked."""
    try:
        yield
    except BaseException as exc:
        if fails(exc):  # not a generator's close, not sys.exit(0)
            _abort_for(coll, exc, seconds)
        raise


def opened(coll: ControlCollectives) -> None:
    """``coll`` was made in this process (its constructor calls this)."""
    _OPEN.add(coll)


def closed(coll: ControlCollectives) -> None:
    """``coll`` was closed: an exit afterwards, even on an exception, is not its group's failure."""
    _OPEN.discard(coll)


def _snapshot(instances: weakref.WeakSet[ControlCollectives]) -> list[ControlCollectives]:
    """The instances in ``instances`` now. No lock: another thread may add one while this
    iterates, or a collection may close one (both raise RuntimeError, and this reads again);
    a lock held here could be wanted again by a ``__del__`` that a collection runs."""
    while True:
        try:
            return list(instances)
        except RuntimeError:
            continue


def group_of(store: dist.Store, world_size: int, prefix: str | None = None) -> tuple | None:
    """What names an instance's group within this process, without store traffic: the storage
    under any PrefixStores (a TCPStore's server address, any other store by identity: two
    handles of one FileStore file count as two), the PrefixStores' key prefix, and the world
    size. ``None`` when the prefix cannot be told (PrefixStores and no extension to read it,
    unless the caller learned it: ``prefix``); such an instance learns of aborts by itself."""
    base = base_store(store)
    if store is base:
        prefix = ""
    elif not prefix:
        if not lanes._reads_prefixes():  # the extension reads a PrefixStore's prefix; Python cannot
            return None
        from ._C import _base_key  # type: ignore[attr-defined]

        prefix = str(_base_key(store, "")[1])
    where = ("tcp", base.host, base.port) if isinstance(base, dist.TCPStore) else base
    return where, prefix, world_size


def spread_abort(coll: ControlCollectives, notice: bytes | None) -> None:
    """``coll`` knows that its group is aborted (``notice``: ``b"{rank}:{reason}"``): tell the
    other open instances of the group in this process, so that their next op fails at once and
    their blocked callers wake, rather than at their next poll. Once per instance; no store
    traffic (each instance's ``_group_id`` is from :func:`group_of`)."""
    group = getattr(coll, "_group_id", None)
    if notice is None or group is None or getattr(coll, "_spread", False):
        return
    coll._spread = True  # type: ignore[attr-defined]
    pid = os.getpid()
    members = _snapshot(_OPEN)
    for other in members:
        if other is not coll and getattr(other, "_owner", None) == pid and getattr(other, "_group_id", None) == group:
            other._learn_abort(notice)  # type: ignore[attr-defined]


def spread_native(native: object) -> None:
    """:func:`spread_abort` for the C++ object ``native`` (called by the extension as an op of
    it raises an abort error)."""
    members = _snapshot(_OPEN)
    for coll in members:
        if getattr(coll, "_native", None) is native:
            spread_abort(coll, native._notice())  # type: ignore[attr-defined]
            return


def fails(exc: BaseException) -> bool:
    """Whether an exception ending a block means this rank failed: not a generator's
    close, and not ``sys.exit()`` / ``sys.exit(0)``."""
    if isinstance(exc, GeneratorExit):
        return False
    return not (isinstance(exc, SystemExit) and exc.code in (0, None))


def abort_open_groups_on_crash() -> None:
    """At interpreter exit: when the process is ending on an uncaught exception (a script's
    traceback, ``sys.last_exc``), abort the group of every instance it did not close, as
    :meth:`ControlCollectives.abort_on_error` would have, so that peers learn it at once,
    with the exception's first line, rather than at their timeout. Registered by
    ``import torch_ctrl`` to run before the watchers stop."""
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if exc is None or hasattr(sys, "ps1") or "ipykernel" in sys.modules:
        return  # a normal exit, or an interactive session (an earlier error there ended nothing)
    if not isinstance(exc, BaseException) or not fails(exc) or isinstance(exc, CollectiveAbortedError):
        return
    for coll in _snapshot(_OPEN):
        if getattr(coll, "_owner", os.getpid()) == os.getpid() and type(coll).abort is not ControlCollectives.abort:
            _abort_for(coll, exc, ABORT_ON_ERROR_TIMEOUT)


def _abort_for(coll: ControlCollectives, exc: BaseException, seconds: float) -> None:
    """Abort ``coll``'s group because of ``exc``, waiting at most ``seconds``; never raises.

    The abort runs on a thread of its own so that a store that is down (a reconnect retries
    for the store's whole timeout) cannot hold the caller's exception back, and so that its
    own errors cannot replace that exception or become its ``__context__``."""
    try:
        text = str(exc).strip()
    except Exception:  # noqa: BLE001 - a broken __str__ must not hide the exception
        text = ""
    first = text.splitlines()[0] if text else ""
    reason = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    failed: list[BaseException] = []

    def attempt() -> None:
        try:
            coll.abort(reason)
        except BaseException as err:  # noqa: BLE001 - reported below, never raised
            failed.append(err)

    worker = threading.Thread(target=attempt, name="torch_ctrl-abort", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        problem = f"the abort did not complete within {seconds:g}s (store unreachable?); it goes on in the background"
    elif failed:
        err = failed[0]
        detail = one_line(str(err))
        problem = f"the abort failed: {type(err).__name__}" + (f": {detail}" if detail else "")
    else:
        return
    log.warning("torch_ctrl: the group was not aborted after %s: %s", type(exc).__name__, problem)
    add_note = getattr(exc, "add_note", None)  # Python 3.11+
    if add_note is not None:
        try:
            add_note(f"torch_ctrl: the group was not aborted: {problem}")
        except Exception:  # noqa: BLE001 - an exception type that refuses notes
            pass


# --------------------------------------------------------------------------- checks


def not_picklable(owner: str) -> NoReturn:
    """Raise the TypeError of pickling an instance (``multiprocessing``, ``mp.spawn`` arguments,
    ``copy.deepcopy``): it holds connections to its store and a background thread, which no
    other process can use, so the error says what to send instead."""
    raise TypeError(
        f"cannot pickle a {owner}: it holds connections to its store and a background thread; "
        "send the store's address (host and port, or a FileStore's path) to the other process "
        "and create the store and the instance there"
    )


def call_error(owner: str, method: str, args: tuple, kwargs: dict) -> NoReturn:
    """Raise the one-line TypeError of a call to ``method`` whose arguments do not fit its
    signature (what a Python method raises; the C++ methods' bindings call this rather than
    list pybind11's signatures over several lines)."""
    signature = inspect.signature(getattr(ControlCollectives, method))
    most = len(signature.parameters)  # self included; every other parameter has a default
    # CPython's words, as this interpreter says them: the class name comes first from 3.10.
    name = f"{owner}.{method}" if sys.version_info >= (3, 10) else method
    if len(args) + 1 > most:
        given = len(args) + 1
        raise TypeError(f"{name}() takes from 1 to {most} positional arguments but {given} were given")
    try:
        signature.bind(None, *args, **kwargs)
    except TypeError as exc:
        text = str(exc)
        raise TypeError(f"{name}() {text if text.startswith('got ') else 'got ' + text}") from None
    raise TypeError(f"{name}(): arguments {args!r}, {kwargs!r} do not fit {method}'s signature")


def check_init(store: object, rank: object, world_size: object) -> tuple[int, int]:
    """Validate constructor arguments; returns ``(rank, world_size)``."""
    if not isinstance(store, dist.Store):
        raise TypeError(f"store must be a torch.distributed.Store, got {type(store).__name__}")
    base = base_store(store)
    if type(base) is dist.Store:
        # What torch hands back for a Python-written store whose Python object is gone (only a
        # PrefixStore held it): its methods went with it, and every call would fail.
        raise TypeError(
            "the store under the PrefixStore is a bare torch.distributed.Store: a Python-written "
            "store's methods are lost once nothing holds its Python object (keep a reference to it)"
        )
    methods = python_methods(base)
    missing = [m for m in BASIC if methods is not None and m not in methods]
    if missing:
        raise TypeError(
            f"store {type(base).__name__} (written in Python) does not implement "
            f"{', '.join(missing)}: collectives need {', '.join(BASIC)} (compare_set and delete_key "
            "are used where present)"
        )
    rank_i, world_i = _int("rank", rank), _int("world_size", world_size)
    if not 1 <= world_i <= MAX_WORLD_SIZE:
        raise ValueError(f"world_size must be in [1, {MAX_WORLD_SIZE}], got {shown(world_i)}")
    if not 0 <= rank_i < world_i:
        raise ValueError(f"rank must be in [0, {world_i}), got {shown(rank_i)}")
    return rank_i, world_i


def check_reachable(store: dist.Store, rank: int, world_size: int) -> None:
    """Fail a new instance at once, with one line, when the TCPStore under ``store`` has no
    server any more (see :func:`torch_ctrl.lanes.check_server`); both twins call it first."""
    try:
        check_server(store)
    except dist.DistNetworkError as exc:
        raise init_error(rank, world_size, f"{UNREACHABLE}{exc}") from None


def unreachable(exc: BaseException, store: dist.Store, rank: int, world_size: int) -> BaseException:
    """A new instance's first store call failed: a lost connection (the server went away
    after :func:`check_reachable`) becomes the same one line, naming the server; anything else
    stays as it is."""
    if isinstance(exc, Exception) and connection_lost(exc):
        text = lost_text(server_of(store), one_line(str(exc)))
        return init_error(rank, world_size, f"{UNREACHABLE}{text}")
    return exc


def abort_unreachable(exc: BaseException, store: dist.Store) -> BaseException:
    """``abort()`` failed in a store call: a lost connection or a server that is gone becomes
    one line naming the server, ``abort: store unreachable: ...`` (a StoreUnreachableError: a
    DistStoreError and a DistNetworkError); any other store error one line too,
    ``abort: store error: ...`` (a CollectiveError; a Python-written store's exception with its
    type, as every op words it). Both twins raise this."""
    if not isinstance(exc, Exception) or isinstance(exc, CollectiveError):
        return exc  # KeyboardInterrupt and the like; or already one line saying what happened
    if connection_lost(exc):
        return StoreUnreachableError(f"abort: {UNREACHABLE}{lost_text(server_of(store), one_line(str(exc)))}")
    text = one_line(str(exc))
    if not isinstance(exc, dist.DistError):
        text = f"{type(exc).__name__}: {text}"
    return CollectiveError(f"abort: store error: {text}")


def check_reason(reason: object) -> str:
    """An abort reason: a ``str``, as valid UTF-8 (unencodable characters become ``?``), cut
    to :data:`MAX_REASON_BYTES` bytes ending in ``" [truncated from N bytes]"``. Both
    implementations write exactly this text."""
    if not isinstance(reason, str):
        raise TypeError(f"reason must be a str, got {type(reason).__name__}")
    data = reason.encode("utf-8", "replace")
    if len(data) <= MAX_REASON_BYTES:
        return reason if reason.isascii() else data.decode("utf-8")
    marker = f" [truncated from {len(data)} bytes]"
    # "ignore" drops a character cut in half at the end.
    return data[: MAX_REASON_BYTES - len(marker)].decode("utf-8", "ignore") + marker


def check_heartbeat(heartbeat_interval: object) -> float | None:
    """``None`` (liveness off) or an interval in seconds within
    [:data:`MIN_HEARTBEAT`, :data:`MAX_HEARTBEAT`]: shorter ones flood the store with
    writes, longer ones detect nothing in useful time."""
    if heartbeat_interval is None:
        return None
    try:
        seconds = to_seconds(heartbeat_interval, "heartbeat_interval", clamp=False)
    except ValueError:  # negative or NaN: say the range, not just ">= 0" (0 is refused too)
        seconds = float("nan")
    if not MIN_HEARTBEAT <= seconds <= MAX_HEARTBEAT:
        raise ValueError(
            f"heartbeat_interval must be between {MIN_HEARTBEAT:g} and {MAX_HEARTBEAT:g} seconds, "
            f"got {shown(heartbeat_interval)}"
        )
    return seconds


def _int(name: str, value: object) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None


def check_block(block: object) -> bool:
    """``barrier``'s ``block``: a bool, or an integer such as NumPy's ``bool_`` (torch's class
    refuses a ``str``; ``block="no"`` would otherwise block)."""
    if isinstance(block, bool):
        return block
    try:
        return bool(operator.index(block))  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"block must be a bool, got {type(block).__name__}") from None


def check_key(key: object) -> str | None:
    """``None`` or a ``str`` that is valid UTF-8 text (a lone surrogate raises
    ``UnicodeEncodeError``, a ``ValueError``: the key could not be written to a store)."""
    if key is None:
        return key
    if isinstance(key, str):
        key.encode("utf-8")
        return key
    raise TypeError(f"key must be a str or None, got {type(key).__name__}")


def to_bytes(data: object, what: str = "data") -> bytes:
    """bytes, bytearray, memoryview or str (UTF-8) -> bytes (plain bytes: a subclass, such as
    NumPy's ``bytes_``, is copied, so results are plain bytes as from the C++ twin)."""
    if type(data) is bytes:
        return data
    if isinstance(data, bytes):
        return bytes(data)
    if data is None:
        raise TypeError(f"{what} is required")
    if isinstance(data, str):
        return data.encode("utf-8")
    if isinstance(data, (bytearray, memoryview)):
        return bytes(data)
    raise TypeError(f"{what} must be bytes, bytearray, memoryview or str, got {type(data).__name__}")


def to_bytes_list(data: object, world_size: int) -> list[bytes]:
    """A scatter list: a sequence of ``world_size`` payloads."""
    if data is None:
        raise TypeError("data is required")
    if isinstance(data, (bytes, bytearray, memoryview, str)) or not isinstance(data, Sequence):
        raise TypeError(f"data must be a sequence of {world_size} payloads, got {type(data).__name__}")
    if len(data) != world_size:
        raise ValueError(f"data must have world_size={world_size} elements, got {len(data)}")
    return [to_bytes(d, f"data[{i}]") for i, d in enumerate(data)]


def to_int64(data: object) -> int:
    """An int in the signed 64-bit range."""
    if data is None:
        raise TypeError("data is required")
    value = _int("data", data)
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"data must fit in a signed 64-bit integer, got {shown(value)}")
    return value


def to_seconds(timeout: object, name: str = "timeout", clamp: bool = True) -> float:
    """timedelta or int/float seconds -> seconds (>= 0). With ``clamp``, anything above
    :data:`MAX_TIMEOUT` (``inf``, ``1e15``, ``10**400``, ``timedelta.max``: "wait as long as
    possible") is :data:`MAX_TIMEOUT`, the same in both implementations. An int too large for
    a float counts as infinite (``-10**400`` is a negative like any other)."""
    if isinstance(timeout, timedelta):
        secs = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        try:
            secs = float(timeout)
        except OverflowError:  # an int past the largest float
            secs = math.inf if timeout > 0 else -math.inf
    else:
        raise TypeError(f"{name} must be a timedelta or seconds, got {type(timeout).__name__}")
    if secs != secs or secs < 0:
        raise ValueError(f"{name} must be >= 0, got {shown(timeout)}")
    return min(secs, MAX_TIMEOUT) if clamp else secs


def shown(value: object) -> str:
    """``repr(value)`` for an error message; an int too long to print (Python refuses ints of
    more than 4300 digits) is shown by its size."""
    try:
        return repr(value)
    except ValueError:
        if isinstance(value, int):
            return f"{'-' if value < 0 else ''}<an int of {value.bit_length()} bits>"
        return f"<{type(value).__name__}>"
