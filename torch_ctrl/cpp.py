"""``CppStoreCollectives``: the C++ implementation (``torch_ctrl._C``) behind the
same Python interface. Arguments are checked in C++ as the Python implementation's
helpers check them (and by those helpers for unusual types), so bad input fails
identically and before any store traffic; the calls then run with the GIL released.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import weakref
from collections.abc import Sequence
from typing import Any, NoReturn

import torch  # noqa: F401 - loads libtorch before the extension
import torch.distributed as dist

from . import _C  # type: ignore[attr-defined]
from . import exit_gate as _exit_gate
from .base import (
    DEFAULT_TIMEOUT,
    METHODS,
    ControlCollectives,
    Data,
    Timeout,
    abort_unreachable,
    check_heartbeat,
    check_init,
    check_reachable,
    check_reason,
    closed,
    group_of,
    not_picklable,
    opened,
    spread_abort,
    to_seconds,
    unreachable,
)
from .errors import forked_error
from .lanes import store_api

_LIVE: weakref.WeakSet[CppStoreCollectives] = weakref.WeakSet()


# Implementations inherited by a forked child: never closed or destroyed there (their
# destructor would join a watcher thread that only exists in the parent).
_ORPHANS: list[object] = []


# The extension lets no thread but the main one take the GIL back during finalization.
os.register_at_fork(after_in_child=lambda: _C._set_main_thread(threading.main_thread().ident))


@atexit.register
def _close_all() -> None:
    """Stop background threads before the interpreter finalizes (they may call into Python
    stores), even while a thread is still blocked in a collective: see watcher._stop_all."""
    _C._leave_process()
    # Threads polling the store inside a collective park at their next pause (csrc/exit_gate.h).
    _C._settle_exit(_exit_gate.QUIET, _exit_gate.BOUND)
    for coll in list(_LIVE):
        if getattr(coll, "_owner", None) == os.getpid():
            coll.close(flush_timeout=2.0)


class CppStoreCollectives(ControlCollectives):
    """Store-backed collectives implemented in C++. Thread safe; see ``docs/protocol.md``.

    Same constructor, methods, defaults and errors as :class:`torch_ctrl.PyStoreCollectives`;
    the store calls run with the GIL released.

    Example::

        with torch_ctrl.StoreCollectives(store, rank, world_size) as coll:  # this class when built
            coll.barrier("ready", timeout=60)
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        *,
        heartbeat_interval: Timeout | None = None,
    ) -> None:
        rank, world_size = check_init(store, rank, world_size)
        heartbeat = check_heartbeat(heartbeat_interval)
        self._store = store
        self._owner = os.getpid()
        self._rank, self._world = rank, world_size
        check_reachable(store, rank, world_size)
        cas, deletes = store_api(store)  # the Python twin's answer, so that both agree
        try:
            self._native = _C.StoreCollectives(store, rank, world_size, heartbeat, cas, deletes)
        except Exception as exc:  # the C++ object closes its watcher as it unwinds
            raise unreachable(exc, store, rank, world_size) from None
        self._group_id = group_of(store, world_size)
        _LIVE.add(self)
        opened(self)
        spread_abort(self, self._native._notice())  # an abort read at construction
        self._shortcut()

    @property
    def _impl(self) -> Any:
        """The C++ object, in the process that made it; a forked child gets one error line."""
        if os.getpid() != self._owner:
            raise forked_error(sys._getframe(1).f_code.co_name, self._owner, os.getpid())
        return self._native

    @property
    def rank(self) -> int:
        """This instance's rank."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks in the group."""
        return self._world

    # Each method hands its arguments to C++ as they are: csrc/arguments.h checks and converts
    # them as base.py's helpers do (calling them for anything unusual), so errors are the
    # Python twin's. __init__ binds the C++ methods to the instance (see _shortcut), so these
    # bodies run only when a subclass calls them through super().

    def barrier(self, key: str | None = None, timeout: Timeout = DEFAULT_TIMEOUT, block: bool = True) -> None:
        self._impl.barrier(key, timeout, block)

    def broadcast_send(
        self, key: str | None = None, data: Data | None = None, timeout: Timeout = DEFAULT_TIMEOUT
    ) -> None:
        self._impl.broadcast_send(key, data, timeout)

    def broadcast_recv(self, key: str | None = None, timeout: Timeout = DEFAULT_TIMEOUT) -> bytes:
        return self._impl.broadcast_recv(key, timeout)  # type: ignore[no-any-return]

    def gather_send(self, key: str | None = None, data: Data | None = None, timeout: Timeout = DEFAULT_TIMEOUT) -> None:
        self._impl.gather_send(key, data, timeout)

    def gather_recv(
        self, key: str | None = None, data: Data | None = None, timeout: Timeout = DEFAULT_TIMEOUT
    ) -> list[bytes]:
        return self._impl.gather_recv(key, data, timeout)  # type: ignore[no-any-return]

    def scatter_send(
        self, key: str | None = None, data: Sequence[Data] | None = None, timeout: Timeout = DEFAULT_TIMEOUT
    ) -> bytes:
        return self._impl.scatter_send(key, data, timeout)  # type: ignore[no-any-return]

    def scatter_recv(self, key: str | None = None, timeout: Timeout = DEFAULT_TIMEOUT) -> bytes:
        return self._impl.scatter_recv(key, timeout)  # type: ignore[no-any-return]

    def all_gather(
        self, key: str | None = None, data: Data | None = None, timeout: Timeout = DEFAULT_TIMEOUT
    ) -> list[bytes]:
        return self._impl.all_gather(key, data, timeout)  # type: ignore[no-any-return]

    def all_sum(self, key: str | None = None, data: int | None = None, timeout: Timeout = DEFAULT_TIMEOUT) -> int:
        return self._impl.all_sum(key, data, timeout)  # type: ignore[no-any-return]

    def _shortcut(self, transparent: tuple[type, ...] = ()) -> None:
        """Bind the C++ methods to this instance, for every collective this class's own method
        would run: a call then goes from the caller straight to C++ (no Python frame of ours,
        which measurably slows short collectives when ranks share a GIL). A subclass that
        overrides a method keeps its override; ``transparent`` classes are ones that only pass
        calls through (naming.py's mixin without names)."""
        for name in self._direct(transparent):
            self.__dict__[name] = getattr(self._native, name)

    def _direct(self, transparent: tuple[type, ...] = ()) -> list[str]:
        """The collectives whose method, past ``transparent`` classes, is this class's own
        (not a subclass's override): those :meth:`_shortcut` binds to C++."""
        owners = {
            name: next(k for k in type(self).__mro__ if name in vars(k) and k not in transparent) for name in METHODS
        }
        return [name for name, owner in owners.items() if owner is CppStoreCollectives]

    def abort(self, reason: str = "") -> None:
        """Mark the group (every instance on this store namespace and world size) as failed by
        this rank. Peers blocked in any collective raise ``CollectiveAbortedError`` within a
        second; later collectives raise it at once. Idempotent: the first reason wins."""
        reason = check_reason(reason)  # a str, cut to MAX_REASON_BYTES like the Python twin's
        try:
            self._impl.abort(reason)
        except Exception as exc:
            raise abort_unreachable(exc, self._store) from None
        spread_abort(self, self._native._notice())

    def _learn_abort(self, notice: bytes) -> None:
        """Another instance of this group in this process learned of the group's abort (see
        base.spread_abort): fail every later op at once and wake blocked callers."""
        self._native._learn_abort(notice)

    def close(self, flush_timeout: Timeout = 5.0) -> None:
        """Finish background cleanup (up to ``flush_timeout``, a ``timedelta`` or seconds) and
        release connections; calls still running on other threads go on (see
        :meth:`torch_ctrl.ControlCollectives.close`)."""
        seconds = to_seconds(flush_timeout, "flush_timeout")  # before anything is stopped
        if os.getpid() != self._owner:
            self._orphan()  # a forked child: the connections and thread are the parent's
            return
        closed(self)
        self._native.close(seconds)

    def _orphan(self) -> None:
        native = self.__dict__.pop("_native", None)
        if native is not None:
            _ORPHANS.append(native)

    def __del__(self) -> None:
        if os.getpid() != getattr(self, "_owner", None):
            self._orphan()
            return
        impl = getattr(self, "_native", None)
        if impl is not None:
            try:
                impl.close(0.0)  # the watcher drains its queue on its own
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass

    def __reduce__(self) -> NoReturn:
        not_picklable(type(self).__name__)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size})"
