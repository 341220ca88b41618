"""Bounds on an op's calls over torch_ctrl's own TCPStore connections (twin: csrc/reaper.cpp).

torch's TCPStore client reads most replies with no time limit, and a timed-out ``wait`` tells
the server and then reads its answer with none either. A server that stops answering without
closing the connection (its host frozen or swapped out, a network partition) therefore holds
the call, and the op with it, for ever. So each connection torch_ctrl opens for itself is
identified by its socket as it is made (:func:`opened`), an op registers its lane's socket with
its deadline (:class:`Bound`), and this module's one thread shuts that socket down once the op
is ``GRACE`` seconds past its deadline. Shutting it down ends the connection, not the file
descriptor (which stays torch's): the call returns with torch's error, the lane is dropped, and
the op fails with one line naming the server (:func:`no_answer`).

A connection that cannot be told apart (another socket to the same server opened at the same
moment) is left unbounded, as every connection is where ``/proc/self/fd`` does not exist. A
client still connecting past its time is found as a new socket to the server's port that no
other client of torch_ctrl's claimed: a connection the application itself opened to the same
server in that same moment would be shut down with it.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Callable, TypeVar

import torch.distributed as dist

T = TypeVar("T")

# How long past its deadline an op may stay in a store call before its connection is shut
# down. A live server answers a timed-out wait's cancel in microseconds.
GRACE = 2.0
# abort() has no timeout: its one store call is given this long before its GRACE.
ABORT_WAIT = 3.0
# How often the thread looks for calls past their time, and after how long without any
# registered it sleeps until the next registration wakes it.
_TICK = 0.25
_IDLE = 10.0


class Socket:
    """A connection's socket: its descriptor, and its inode (the descriptor number may be
    reused once torch closes it; the inode tells)."""

    __slots__ = ("fd", "inode")

    def __init__(self, fd: int, inode: int) -> None:
        self.fd, self.inode = fd, inode


def _sockets() -> dict[int, int] | None:
    """``{inode: fd}`` of this process's sockets; None where ``/proc/self/fd`` is missing."""
    found: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return None
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile (listdir's own descriptor among them)
        if link.startswith("socket:["):
            found[int(link[8:-1])] = int(name)
    return found


def _duplicate(fd: int) -> socket.socket | None:
    """A socket object on a duplicate of ``fd`` (closing it leaves ``fd`` open); None when
    ``fd`` is closed or no socket."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        return socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None


def _peer_port(fd: int) -> int | None:
    sock = _duplicate(fd)
    if sock is None:
        return None
    try:
        peer = sock.getpeername()
        return peer[1] if isinstance(peer, tuple) else None
    except OSError:
        return None
    finally:
        sock.close()


def opened(connect: Callable[[], T], server: str, port: int, seconds: float) -> T:
    """``connect()``, a new TCPStore client of ``server`` (on ``port``), which torch gives
    ``seconds`` to connect. Bounded too: torch's client reads the server's first answer with no
    time limit, so a new socket to that port still connecting ``GRACE`` seconds after that is
    shut down (DistNetworkError naming the server). The new client's socket, the one socket to
    that port that was not there before, is what :func:`take_opened` returns next on this
    thread (None when there is not exactly one)."""
    _LOCAL.opened = None
    before = _sockets()
    call = _Call(None, time.monotonic() + seconds + GRACE, port, before) if before is not None else None
    if call is not None:
        _REAPER.add(call)
    try:
        client = connect()
    except Exception:
        if call is not None and call.fired:
            raise dist.DistNetworkError(no_answer(server, seconds + GRACE)) from None
        raise
    finally:
        if call is not None:
            _REAPER.remove(call)
    after = _sockets() if before is not None else None
    if before is not None and after is not None:
        new = [(ino, fd) for ino, fd in after.items() if ino not in before and _peer_port(fd) == port]
        _KNOWN.intersection_update(after)  # only sockets still open
        _KNOWN.update(ino for ino, _ in new)
        _LOCAL.opened = Socket(new[0][1], new[0][0]) if len(new) == 1 else None
    return client


def take_opened() -> Socket | None:
    """The socket of the connection :func:`opened` made last on this thread (once)."""
    sock, _LOCAL.opened = getattr(_LOCAL, "opened", None), None
    return sock


def _shut(sock: Socket) -> None:
    """End the connection on ``sock`` if its descriptor still holds it."""
    try:
        if os.fstat(sock.fd).st_ino != sock.inode:
            return  # closed and the number reused: not ours to touch
    except OSError:
        return
    dup = _duplicate(sock.fd)
    if dup is None:
        return
    try:
        dup.shutdown(socket.SHUT_RDWR)  # acts on the connection, shared with torch's descriptor
    except OSError:
        pass
    finally:
        dup.close()


def _shut_new(port: int, before: dict[int, int]) -> None:
    """End every connection to ``port`` opened since ``before`` (a client still connecting),
    but those already known as other clients' (opened by them meanwhile)."""
    for inode, fd in (_sockets() or {}).items():
        if inode not in before and inode not in _KNOWN and _peer_port(fd) == port:
            _shut(Socket(fd, inode))


class _Call:
    """A registered call: on ``sock``, or (``sock`` None) a client connecting to ``port``
    since the sockets ``before``."""

    __slots__ = ("sock", "until", "fired", "port", "before")

    def __init__(self, sock: Socket | None, until: float, port: int = 0, before: dict[int, int] | None = None) -> None:
        self.sock, self.until, self.fired = sock, until, False
        self.port, self.before = port, before


class _Reaper:
    """The registered calls and the thread that ends those past their time. The thread looks
    every ``_TICK`` seconds and is never woken for a registration (that would cost every op a
    thread switch), except after ``_IDLE`` seconds without any, when it sleeps until one."""

    def __init__(self) -> None:
        self.cv = threading.Condition(threading.Lock())
        self.calls: set[_Call] = set()
        self.thread: threading.Thread | None = None
        self.idle = False

    def add(self, call: _Call) -> None:
        with self.cv:
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="torch_ctrl-reaper", daemon=True)
                self.thread.start()
            self.calls.add(call)
            if self.idle:
                self.idle = False
                self.cv.notify()

    def remove(self, call: _Call) -> None:
        with self.cv:
            self.calls.discard(call)

    def _run(self) -> None:
        last = time.monotonic()  # when a call was last registered, as far as the thread knows
        with self.cv:
            while True:
                now = time.monotonic()
                if self.calls:
                    last = now
                    for call in self.calls:
                        if not call.fired and call.until <= now:
                            call.fired = True
                            if call.sock is not None:
                                _shut(call.sock)
                            else:
                                _shut_new(call.port, call.before or {})
                elif now - last > _IDLE:
                    self.idle = True
                    while self.idle:
                        self.cv.wait()
                    last = time.monotonic()
                self.cv.wait(_TICK)


_REAPER = _Reaper()
_LOCAL = threading.local()
# Inodes of the sockets opened() found, while open: never shut down as another client's connect
# (a socket's inode is not reused while it is open).
_KNOWN: set[int] = set()


def _forked() -> None:
    global _REAPER, _LOCAL
    _REAPER = _Reaper()  # the parent's thread is not in the child, and its lock may be held
    _LOCAL = threading.local()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def _active() -> list[_Call]:
    calls = getattr(_LOCAL, "calls", None)
    if calls is None:
        calls = _LOCAL.calls = []
    return calls


class Bound:
    """``with Bound(sock, deadline)``: the connection on ``sock`` is shut down if the block is
    still running ``GRACE`` seconds after ``deadline`` (``time.monotonic()``). A no-op for
    ``sock=None``."""

    __slots__ = ("_call",)

    def __init__(self, sock: Socket | None, deadline: float) -> None:
        self._call = _Call(sock, deadline + GRACE) if sock is not None else None

    def __enter__(self) -> None:
        if self._call is not None:
            _REAPER.add(self._call)
            _active().append(self._call)

    def __exit__(self, *exc: object) -> None:
        if self._call is not None:
            _REAPER.remove(self._call)
            calls = _active()
            for i in range(len(calls) - 1, -1, -1):  # the last, unless blocks ended out of order
                if calls[i] is self._call:
                    del calls[i]
                    break


def fired() -> bool:
    """Whether a connection this thread is using was shut down for not answering in time."""
    return any(call.fired for call in _active())


def no_answer(server: str, within: float | None = None) -> str:
    """The error text for a connection shut down by this module: an op's (``GRACE`` seconds
    past its deadline), or a call given ``within`` seconds in all (``abort``)."""
    when = f"for {GRACE:g}s past the op's deadline" if within is None else f"within {round(within, 1):g}s"
    return f"the store's server {server} did not answer {when} (its host frozen or unreachable over the network?)"
