"""Calls into torch that a server which accepts connections but never answers would block
for ever: a TCPStore's process stopped (SIGSTOP, a debugger) or swapping, its host frozen or
cut off, or a port that is not a TCPStore's. torch's client connects, then waits for its
handshake's reply with no bound, whatever its timeout; and every later request that expects a
reply (``add``, ``get``, ``check``, ``compare_set``, ``wait``) waits for it without bound too.

:func:`within` runs such a call on a daemon thread and gives up on it after a bound. The
thread is left behind, still blocked (nothing can interrupt it), and ends with the
connection, or with the process. :class:`Caller` does the same for a connection that stays
in use: while a call it gave up on is still blocked, later calls fail at once instead of
queueing behind it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")

# Seconds past its bound that an abandoned store construction's own timeout runs (see
# :func:`client_timeout`).
OUTLIVE = 60.0


class NoAnswer(TimeoutError):
    """The call did not return within its bound; ``str()`` says which call and how long.
    ``waited``: how long the call has gone unanswered, in seconds (None where not known)."""

    waited: float | None = None


class Unanswered(NoAnswer):
    """An earlier call on the same connection is still unanswered, since ``waited`` seconds."""

    def __init__(self, waited: float) -> None:
        super().__init__(f"an earlier call has not been answered for {waited:.0f}s")
        self.waited = waited


def _start(call: Callable[[], T], name: str) -> tuple[threading.Event, dict[str, object]]:
    """``call()`` on a daemon thread: (set when it returned, ``{"value"}`` or ``{"error"}``)."""
    done = threading.Event()
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name=name, daemon=True).start()
    return done, box


def _wait(done: threading.Event, seconds: float) -> bool:
    # Event.wait refuses bounds past threading.TIMEOUT_MAX (OverflowError); NaN waits not at all.
    return done.wait(min(seconds, threading.TIMEOUT_MAX) if seconds > 0 else 0.0)


def _outcome(box: dict[str, object]) -> Any:
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]


class Caller:
    """The calls of one connection that stays in use, each on a daemon thread and waited for at
    most a bound (:class:`NoAnswer` then). The call given up on stays blocked in torch's client,
    holding the connection; until it returns, every later :meth:`call` raises
    :class:`Unanswered` at once, rather than queue behind it. For one calling thread at a time."""

    def __init__(self, name: str = "torch_ctrl-bounded-call") -> None:
        self._name = name
        self._unanswered: tuple[threading.Event, float] | None = None  # (done, started)

    def call(self, seconds: float, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)``'s result or exception, or :class:`NoAnswer` after ``seconds``.

        Raises:
            Unanswered: an earlier call is still blocked (no new call is made).
            NoAnswer: this call did not return within ``seconds``.
        """
        if self._unanswered is not None:
            done, started = self._unanswered
            if not done.is_set():
                raise Unanswered(time.monotonic() - started)
            self._unanswered = None
        started = time.monotonic()
        done, box = _start(lambda: fn(*args), self._name)
        try:
            answered = _wait(done, seconds)
        except BaseException:  # a signal handler's exception (SIGTERM): the call goes on
            if not done.is_set():
                self._unanswered = (done, started)
            raise
        if not answered:
            self._unanswered = (done, started)
            error = NoAnswer(f"no answer within {seconds:g}s")
            error.waited = seconds
            raise error
        return _outcome(box)


class Silence:
    """When to warn that a store does not answer: at the first call given up on, then once every
    ``every`` seconds of the same silence; an answer ends it. One warning a minute, not one per
    monitor interval, and a new silence after an answer is warned about at once."""

    def __init__(self, every: float) -> None:
        self.every = every
        self._logged: float | None = None  # how long the store was silent at the last warning

    def due(self, waited: float) -> bool:
        """Whether a warning is due, the store having been silent for ``waited`` seconds."""
        logged = self._logged
        if logged is not None and logged <= waited < logged + self.every:
            return False  # (a smaller ``waited``: a new silence, after an answer)
        self._logged = waited
        return True

    def answered(self) -> bool:
        """The store answered: whether that ends a silence that was warned about."""
        ended, self._logged = self._logged is not None, None
        return ended


def within(seconds: float, call: Callable[[], T], what: str) -> T:
    """``call()``'s result or exception, or :class:`NoAnswer` once ``seconds`` have passed.

    Args:
        seconds: the bound, > 0 (larger than ``threading.TIMEOUT_MAX``: that; not > 0: no wait).
        call: what to run (typically ``lambda: dist.TCPStore(...)``).
        what: the call, for the error, e.g. ``"127.0.0.1:29500"``.

    Raises:
        NoAnswer: ``"{what} accepted a connection but did not answer within {seconds}s"``.
    """
    done, box = _start(call, "torch_ctrl-bounded-call")
    if not _wait(done, seconds):
        raise NoAnswer(
            f"{what} accepted a connection but did not answer within {seconds:g}s "
            "(its process is stopped or hung, or it is not a TCPStore server)"
        )
    return _outcome(box)


def client_timeout(bound: float) -> timedelta:
    """The timeout to construct a TCPStore client with under ``within(bound, ...)``: ``OUTLIVE``
    seconds longer (set the one the store should keep with ``set_timeout`` once it is made).

    Why: a construction abandoned at the bound does return if the server goes away or closes
    the connection, once torch's connect loop has retried until the store's timeout. With that
    timeout equal to the bound, it would return just as the caller reports the failure, often
    while the process exits, and a thread that comes back from torch while the interpreter
    finalizes aborts the process (``terminate called without an active exception``). Past
    the bound by a minute, it comes back after the caller has gone on, or never.
    """
    return timedelta(seconds=bound + OUTLIVE)


_PARKED_OPS = frozenset({"add", "compare_set", "get", "set", "check", "multi_set", "multi_get", "num_keys"})


class _Parked:
    """``store``'s calls through the extension's ``_parked_call`` (see :func:`parked`)."""

    def __init__(self, store: Any, call: Callable[..., Any], ops: frozenset[str]) -> None:
        self.store = store
        self._call = call
        self._ops = ops

    def __getattr__(self, name: str) -> Any:
        if name in self._ops:
            return lambda *args: self._call(self.store, name, *args)
        return getattr(self.store, name)


def parked(store: Any) -> Any:
    """``store``, for calls that :class:`Caller` or :func:`within` may give up on: with the C++
    extension loaded, its ``add``, ``compare_set``, ``get``, ``set``, ``check``,
    ``multi_set``, ``multi_get``, ``num_keys`` and ``list_keys`` run through the extension, which parks a
    thread whose call is answered while the interpreter finalizes. Through torch's own
    binding, such a thread takes the GIL back in a destructor, and CPython's end of a daemon
    thread there aborts the process (``terminate called without an active exception``): a
    stopped store's host killed while this process exits. Without the extension, or for a
    store that is not a TCPStore under any PrefixStores, ``store`` itself."""
    from . import loader

    base = store
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    # Only a TCPStore's server can stop answering: other stores are called as they are.
    if loader.backend() != "cpp" or not isinstance(base, dist.TCPStore):
        return store
    from . import _C  # type: ignore[attr-defined]

    ops = _PARKED_OPS | ({"list_keys"} if _C._capabilities["list_keys"] else set())
    return _Parked(store, _C._parked_call, ops)
