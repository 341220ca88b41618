"""Calls into torch that a server which accepts connections but never answers would block
for ever: a TCPStore's process stopped (SIGSTOP, a debugger) or swapping, or a port that is
not a TCPStore's. torch's client connects, then waits for its handshake's reply with no
bound, whatever its timeout.

:func:`within` runs such a call on a daemon thread and gives up on it after a bound. The
thread is left behind, still blocked (nothing can interrupt it), and ends with the
connection: for the paths that use this, the process is about to report an error and
usually to exit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

T = TypeVar("T")

# Seconds past its bound that an abandoned store construction's own timeout runs (see
# :func:`client_timeout`).
OUTLIVE = 60.0


class NoAnswer(TimeoutError):
    """The call did not return within its bound; ``str()`` says which call and how long."""


def within(seconds: float, call: Callable[[], T], what: str) -> T:
    """``call()``'s result or exception, or :class:`NoAnswer` once ``seconds`` have passed.

    Args:
        seconds: the bound, > 0 (larger than ``threading.TIMEOUT_MAX``: that; not > 0: no wait).
        call: what to run (typically ``lambda: dist.TCPStore(...)``).
        what: the call, for the error, e.g. ``"127.0.0.1:29500"``.

    Raises:
        NoAnswer: ``"{what} accepted a connection but did not answer within {seconds}s"``.
    """
    done = threading.Event()
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name="torch_ctrl-bounded-call", daemon=True).start()
    # Event.wait refuses bounds past threading.TIMEOUT_MAX (OverflowError); NaN waits not at all.
    if not done.wait(min(seconds, threading.TIMEOUT_MAX) if seconds > 0 else 0.0):
        raise NoAnswer(
            f"{what} accepted a connection but did not answer within {seconds:g}s "
            "(its process is stopped or hung, or it is not a TCPStore server)"
        )
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


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
