"""Keeps the pure-Python implementation's threads out of torch while the interpreter finalizes.

A thread that returns from a call into torch's C++ bindings while CPython finalizes is ended
on its way back, and ending it inside C++ aborts the process (SIGABRT, ``terminate called
without an active exception``; torchrun reports a failed worker). The C++ implementation parks
such a thread in C++ (``csrc/bindings.cpp``). The pure-Python one calls torch's own bindings,
so it keeps its threads out of them instead: every collective runs inside :func:`gated`, and
once the process exits (:func:`settle`, an ``atexit`` hook, run after Python has joined every
non-daemon thread) a daemon thread that starts or ends a collective is parked for good: it
blocks on a lock nobody releases, outside any C++ frame, and goes with the process.

A thread that waits for other ranks by polling the store (on a FileStore, and on a TCPStore
client shared by every caller: torch 2.6 and 2.7 under PrefixStores) is never blocked in torch:
it calls into torch again after every pause. It pauses through :func:`pause`, which parks it
there, between two calls, once the process exits. The C++ implementation's polling threads do
the same in ``csrc/exit_gate.h``, this module's twin.

:func:`settle` then waits until threads stop entering and leaving collectives and pausing
between polls (``QUIET`` seconds without any of these, at most ``BOUND`` seconds; the pauses
are shorter). A thread still inside one after that is blocked in a call, waiting for other
ranks; nothing of torch_ctrl wakes it (the watchers stop next), so it stays blocked through
finalization, as with the C++ implementation. A parked thread keeps what it holds, as a
blocked one does: a lock the application took around the collective stays taken.

Cost per collective: two dict updates and two counter steps, well under a microsecond.
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable[..., object])

# settle(): how long without a thread entering or leaving a collective counts as settled, and
# the longest it waits (threads running collectives back to back park within one op).
QUIET = 0.1
BOUND = 2.0
_STEP = 0.01

# Thread ident -> how many gated calls it is inside (abort() may run inside an op's error path).
_INSIDE: dict[int, int] = {}
_EVENTS = itertools.count()
_last_event = 0
_closed = False
_settling_thread: int | None = None
_PARKED: list[int] = []  # list.append: atomic, unlike a counter's += between threads


def parked() -> int:
    """How many threads this process parked at its exit (for tests and diagnostics)."""
    return len(_PARKED)


def _park() -> None:
    """Block the calling thread for good (never the one running the exit)."""
    _PARKED.append(threading.get_ident())
    gate = threading.Lock()
    gate.acquire()
    gate.acquire()  # nobody releases it


def _enter() -> None:
    global _last_event
    ident = threading.get_ident()
    # Counted before the gate is looked at: settle() closes the gate before it looks at the
    # threads inside, so a thread passes the gate only if settle() will see it inside.
    _INSIDE[ident] = _INSIDE.get(ident, 0) + 1
    _last_event = next(_EVENTS)
    if _closed and ident != _settling_thread:
        _uncount(ident)
        _park()


def _leave() -> None:
    ident = threading.get_ident()
    _uncount(ident)
    if _closed and ident != _settling_thread:
        _park()


def _uncount(ident: int) -> None:
    global _last_event
    depth = _INSIDE.get(ident, 1) - 1
    if depth > 0:
        _INSIDE[ident] = depth
    else:
        _INSIDE.pop(ident, None)
    _last_event = next(_EVENTS)


def pause(seconds: float) -> None:
    """``time.sleep(seconds)`` between two polls of the store. In a collective, once the process
    exits, the thread parks here instead (before the pause or after it), outside any call into
    torch; each such pause counts as activity for :func:`settle`, so a thread polling for other
    ranks is parked before settle() returns. Elsewhere (a watcher's retries) a plain sleep."""
    checkpoint()
    time.sleep(seconds)
    checkpoint()


def checkpoint() -> None:
    """Between two calls into torch in a collective that waits by other means than
    :func:`pause`: parks the thread once the process exits (see :func:`pause`)."""
    ident = threading.get_ident()
    if ident in _INSIDE and ident != _settling_thread:
        _checkpoint(ident)


def _checkpoint(ident: int) -> None:
    """A sign of life of a thread inside a collective; it parks there once the gate is closed."""
    global _last_event
    _last_event = next(_EVENTS)
    if _closed:
        _INSIDE.pop(ident, None)
        _last_event = next(_EVENTS)
        _park()


def gated(method: F) -> F:
    """``method`` (a collective of the pure-Python implementation), run through the gate: it
    parks its thread when called, or when it returns or raises, once the process exits."""

    @functools.wraps(method)
    def run(*args: object, **kwargs: object) -> object:
        _enter()
        try:
            return method(*args, **kwargs)
        finally:
            _leave()

    return run  # type: ignore[return-value]


def settle(quiet: float = QUIET, bound: float = BOUND) -> None:
    """At exit: close the gate, then wait until no thread has entered or left a collective for
    ``quiet`` seconds (at most ``bound`` seconds; at once when none is inside one)."""
    global _closed, _settling_thread
    _settling_thread = threading.get_ident()
    _closed = True
    start = time.monotonic()
    last, since = _last_event, start
    while any(ident != _settling_thread for ident in list(_INSIDE)):
        now = time.monotonic()
        if _last_event != last:
            last, since = _last_event, now
        if now - since >= quiet or now - start >= bound:
            return
        time.sleep(_STEP)


def _forked() -> None:
    # The parent's threads are not in the child; a fork during the exit leaves the child open.
    global _closed, _settling_thread
    _INSIDE.clear()
    _PARKED.clear()
    _closed, _settling_thread = False, None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)
