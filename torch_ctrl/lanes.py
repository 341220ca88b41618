"""Lanes: the store handles a collective talks through.

A TCPStore client holds its lock across a blocking ``wait``/``get``, so two
threads sharing one client serialize and can deadlock until timeout. Each
concurrent caller therefore takes its own *lane*: a ``clone()`` of the user's
store (a new connection) when the store is backed by TCPStore or FileStore.
Lanes are ours, so a blocking call may set the lane's timeout; the user's store
object is never used for traffic and its timeout is never touched.

Stores whose clones share state with the original (HashStore, Python stores, a
PrefixStore over them) are used directly ("shared" mode): they must be thread
safe, and blocking reads become ``wait(keys, timeout)`` followed by a read, so
that no timeout is ever set on them.

On a torch whose stores have no ``clone()`` (see :mod:`torch_ctrl.capabilities`), a
TCPStore's lanes are new clients to the same host and port. A PrefixStore over a TCPStore
cannot be rebuilt from Python there (its prefix is not exposed), so its one client is
shared, and blocking waits on it poll ``check`` (pauses of up to ``SLICE`` seconds): the
client's lock is never held while waiting, so other threads and the watcher's heartbeats get
through.
The C++ twin rebuilds such chains with new clients.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from types import FrameType

import torch.distributed as dist

from . import capabilities, exit_gate, reaper
from . import keys as K

_TICK = 0.001  # smallest timeout handed to a store (0 means "forever" to some stores)
SLICE = 0.05  # longest pause between checks on a TCPStore client shared by several callers (no clone())
# A FileStore's own blocking reads look every 10 ms: a value written just after a look is seen
# 10 ms late, which is the whole cost of most ops over a FileStore. Lanes over one poll `check`
# instead, from FILE_POLL_FIRST doubling to FILE_POLL (a look reads only what was appended).
FILE_POLL_FIRST = 0.0001
FILE_POLL = 0.01


def peek(store: dist.Store, key: str) -> bytes | None:
    """Read ``key`` without waiting or writing (one ``compare_set`` that cannot match);
    ``None`` when it does not exist."""
    value = bytes(store.compare_set(key, K.MISSING, K.NEVER))
    return None if value == K.MISSING else value


def connection_lost(exc: BaseException) -> bool:
    """Whether a store error means the connection is gone (the server died or restarted, or
    it dropped this connection). Twin of ``connection_lost`` in csrc/lanes.cpp."""
    if isinstance(exc, (dist.DistNetworkError, ConnectionError)):
        return True
    text = str(exc).lower()
    return any(t in text for t in ("connection", "broken pipe", "failed to recv", "socket"))


def server_of(store: dist.Store) -> str:
    """``host:port`` of the TCPStore under any PrefixStores, "" for other stores (twin of the
    address ``Lanes::Lanes`` keeps in csrc/lanes.cpp)."""
    base = base_store(store)
    return f"{base.host}:{base.port}" if isinstance(base, dist.TCPStore) else ""


def lost_text(server: str, text: str) -> str:
    """A lost connection's error text, naming the store's server (``host:port``; "" when the
    store has none) unless the text already does: that host is the one to look at. Twin of
    ``lost_text`` in csrc/lanes.cpp."""
    if not server or server in text:
        return text
    return f"the connection to the store's server {server} was lost: {text}"


def base_store(store: dist.Store) -> dist.Store:
    """The store under any number of PrefixStores."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


# What every store must implement. compare_set and delete_key are used where a store has them
# (torch's EtcdStore has neither): see Lanes.cas and Lanes.deletes.
BASIC = ("set", "get", "add", "check", "wait")


def takes_tcpstore_path(store: dist.Store) -> bool:
    """Whether ops over ``store`` take the TCPStore path: a TCPStore under any number of
    PrefixStores, where this torch's TCPStore has a server-side barrier (and, under
    PrefixStores, list_keys: Python learns their prefix with it). Both implementations apply
    this same rule to a given store (csrc/lanes.cpp)."""
    base = base_store(store)
    return isinstance(base, dist.TCPStore) and capabilities.tcpstore_path(store is not base)


def python_methods(store: dist.Store) -> frozenset[str] | None:
    """The store methods that the Python-written store under any PrefixStores defines, or
    ``None`` for torch's own stores (and Python subclasses of them), which have them all.
    torch's binding of a method the Python class does not define fails when called ("Not
    implemented"), so this is read from the class, never by calling."""
    defined: set[str] = set()
    for cls in type(base_store(store)).__mro__:
        if cls is dist.Store:
            return frozenset(defined)
        if cls.__module__.startswith("torch._C"):
            return None
        defined.update(cls.__dict__)
    return None


def python_list_keys(store: dist.Store) -> list[str] | None:
    """The key names of the Python-written store under any PrefixStores, relative to them, when
    its class defines ``list_keys``; ``None`` for other stores and when the listing fails.
    torch's PrefixStore cannot pass ``list_keys`` on to a Python store (nor can torch's C++
    binding of one, which the C++ twin calls through): both twins list such a store here (the
    C++ one through ``python_list_keys`` in csrc/bindings.cpp), so a timeout's diagnostics
    name the same ranks and world sizes in either."""
    methods = python_methods(store)
    if methods is None or "list_keys" not in methods:
        return None
    try:
        base = base_store(store)
        prefix = key_prefix(store) if store is not base else ""
        return [name[len(prefix) :] for name in base.list_keys() if name.startswith(prefix)]
    except Exception:  # noqa: BLE001 - diagnostics only: a store that cannot list is one without list_keys
        return None


def store_api(store: dist.Store) -> tuple[bool, bool]:
    """``(cas, deletes)``: whether ops may call the store's ``compare_set`` and ``delete_key``.
    Without compare_set a read that must not block is ``check`` then ``get``, which is safe
    only while keys never vanish: so such a store gets no deletes either (its keys stay, as
    torch's class leaves them). Both implementations take this from here (the C++ one at
    construction), so a mixed group agrees on the key layout."""
    methods = python_methods(store)
    if methods is None:
        return True, True
    cas = "compare_set" in methods
    return cas, cas and "delete_key" in methods


def key_prefix(store: dist.Store) -> str:
    """What the PrefixStores over a Python-written store put before a key: ``key`` is
    ``prefix + key`` to that store. torch does not expose a PrefixStore's prefix to Python,
    so read it off one ``check`` call as the Python store's own method receives it (a
    profile hook on this thread, for that one call; any previous hook is restored)."""
    base, probe, seen = base_store(store), "torch_ctrl/probe", []

    def hook(frame: FrameType, event: str, arg: object) -> None:
        code = frame.f_code
        if event == "call" and not seen and code.co_argcount >= 2 and frame.f_locals.get("self") is base:
            seen.append(frame.f_locals[code.co_varnames[1]])

    previous = sys.getprofile()
    sys.setprofile(hook)
    try:
        store.check([probe])
    finally:
        sys.setprofile(previous)
    full = seen[0][0] if seen and isinstance(seen[0], list) and seen[0] else None
    if not isinstance(full, str) or not full.endswith(probe):
        raise RuntimeError("cannot tell the key prefix of a PrefixStore over this Python store")
    return full[: -len(probe)]


def _reads_prefixes() -> bool:
    """Whether the extension is in use: it reads a PrefixStore chain's prefix directly."""
    from . import loader  # at call time: the loader imports this module

    return loader.backend() == "cpp"


def chain_prefix(store: dist.Store) -> str:
    """What the PrefixStores over a TCPStore put before a key (``"job/"`` for
    ``PrefixStore("job", tcp)``): from the extension where it is in use, else by writing a
    probe key through them and finding it with the TCPStore's ``list_keys`` (once per
    instance; the probe is deleted)."""
    if _reads_prefixes():
        from ._C import _base_key  # type: ignore[attr-defined]

        return str(_base_key(store, "")[1])
    probe = f"torch_ctrl/probe/{os.getpid()}.{threading.get_ident()}.{time.monotonic_ns()}"
    store.set(probe, b"")
    try:
        found = [k for k in base_store(store).list_keys() if k.endswith(probe)]
    finally:
        store.delete_key(probe)
    if len(found) != 1:
        raise RuntimeError(f"cannot tell the key prefix of this PrefixStore (probe found {len(found)} times)")
    return found[0][: -len(probe)]


class _ForkGate:
    """No ``fork()`` while one of our threads opens a connection.

    Name resolution takes glibc's resolver lock; a child forked while another thread held it
    deadlocks as soon as one of its own threads ends (a watcher, at ``close()``). ``fork()``
    waits for connections in progress (at most ``FORK_WAIT`` seconds) and holds new ones off
    until it is done. Twin of ``ForkGate`` in csrc/lanes.cpp (which guards the extension's
    connections the same way)."""

    FORK_WAIT = 2.0

    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._connecting = 0

    def __enter__(self) -> None:
        with self._cv:
            self._connecting += 1

    def __exit__(self, *exc: object) -> None:
        with self._cv:
            self._connecting -= 1
            self._cv.notify_all()

    def before_fork(self) -> None:
        self._cv.acquire()  # held across fork(): no connection starts meanwhile
        self._cv.wait_for(lambda: self._connecting == 0, self.FORK_WAIT)

    def after_fork_in_parent(self) -> None:
        self._cv.release()

    def after_fork_in_child(self) -> None:
        self.__init__()  # type: ignore[misc]  # the connecting threads were not copied


_FORK_GATE = _ForkGate()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_FORK_GATE.before_fork,
        after_in_parent=_FORK_GATE.after_fork_in_parent,
        after_in_child=_FORK_GATE.after_fork_in_child,
    )


# torch 2.6's TCPStore constructor registers its Python object without holding the GIL: two
# threads constructing clients at once can corrupt pybind11's registry (the process aborts
# with "Tried to deallocate unregistered instance"). Those torches have no clone(), so lanes
# construct clients there: one at a time (re-entrant: a caller may hold it around its own
# construction of torch objects, as the test suite does).
_CONNECT = threading.RLock()
# Handles this process dropped on such a torch (a lane that saw an error, a connection replaced
# after a server restart, a watcher's lane when it stops, a pool freed by the garbage
# collector): held here and freed in that same turn (see retire). Appends and pops are atomic.
_RETIRED: list[object] = []
# How long one attempt to connect may hold that turn. A connection to a live server takes
# milliseconds (a second in a stalled reverse lookup); a server that went away after the
# check below makes torch's connect loop retry for its whole timeout (the store's 300 s
# for a watcher), and every other connection of the process would wait behind it.
_TURN = 2.0


# How long one attempt of a connection that takes turns (see new_client) may spend in torch,
# background ones included: a turn (a stalled reverse lookup on a live server takes a second or two).
# On a server that goes away during the attempt torch may make a second one after its
# back-off (about 6.5 s in all), which the watchers' exit grace covers.
BACKGROUND_TURN = _TURN


def turn() -> contextlib.AbstractContextManager[object]:
    """The process's turn to make and free torch store objects, for code that makes them on
    several threads.

    torch 2.6's ``TCPStore(...)`` registers the new Python object without holding the GIL: a
    thread that makes or frees a torch object meanwhile can corrupt pybind11's registry, and the
    process aborts later ("Tried to deallocate unregistered instance"). On a torch without
    ``Store.clone()`` (2.6, 2.7) this returns the re-entrant lock under which torch_ctrl's own
    connections are made and freed; holding it, a thread of yours makes or frees its stores and
    instances in turn with them. On newer torches it is a no-op context. Hold it around making
    and freeing only, never around a collective::

        with torch_ctrl.lanes.turn():
            store = dist.TCPStore(host, port, is_master=False)
            coll = dist.StoreCollectives(store, rank, world_size)
        ...
        coll.close()
        with torch_ctrl.lanes.turn():
            del coll, store
    """
    return _CONNECT if not capabilities.CLONE else contextlib.nullcontext()


def retire(handle: object) -> None:
    """Drop ``handle`` (a lane, a store client): on a torch without ``clone()`` it is kept
    until the next turn of :data:`_CONNECT` (the next connection this process opens, or a
    ``close()``), and freed there, never while another thread constructs a client. Handles
    retired earlier are freed now when the turn is free (their other references are gone by
    then; this one's caller still holds it). Elsewhere it is dropped at once."""
    if capabilities.CLONE:
        return
    if _RETIRED and _CONNECT.acquire(blocking=False):
        try:
            _free_retired()
        finally:
            _CONNECT.release()
    _RETIRED.append(handle)


def _free_retired() -> None:
    """Free what :func:`retire` kept (called in the turn)."""
    while _RETIRED:  # the only thread popping: it holds the turn
        _RETIRED.pop()


def new_client(
    store: dist.TCPStore, connect_timeout: float | None = None, stop: Callable[[], bool] | None = None
) -> dist.TCPStore:
    """A new client of ``store``'s server (same host, port, backend and timeout), connected
    within ``connect_timeout`` seconds when given (waiting for the one-at-a-time construction
    included: once a server is gone, every watcher of the process reconnects in turn, and an
    op queued behind them all would outlive its deadline).

    The server is reached with plain sockets before torch is called (:func:`_reach`): torch's
    connect loop retries a server that is gone for its whole timeout and logs each failed
    attempt with a C++ stack trace. A caller's connection (no ``stop``) fails at once when every
    address of the server refuses it: the server was up when the instance was made, so it is
    gone (the one line says so).

    ``stop`` marks a background connection (a watcher's): a refusal is retried (the server may
    come back), torch gets ``BACKGROUND_TURN`` seconds per attempt, and the attempt ends with
    DistNetworkError once ``stop()`` is true (the process exits). A thread inside torch's
    connect loop when the interpreter finalizes kills the process as the call returns; one in
    the plain-socket check does not, and a server that is gone keeps it there."""
    seconds = store.timeout.total_seconds() if connect_timeout is None else connect_timeout
    deadline = time.monotonic() + seconds
    if capabilities.CLONE and stop is None:
        _reach(store.host, store.port, deadline, ends=_REFUSED)
        left = None if connect_timeout is None else max(deadline - time.monotonic(), _TICK)
        return _tcp_client(store, left)
    pause = 0.01
    while True:
        # A server that is gone is found here, without the turn: one caller's reconnects to it
        # (a watcher's, every wake) must not hold every other caller's turn for seconds.
        _reach(store.host, store.port, deadline, stop, () if stop else _REFUSED)
        if not _CONNECT.acquire(timeout=max(deadline - time.monotonic(), _TICK)):
            raise dist.DistNetworkError(
                f"no connection could be started within {seconds:g}s: "
                "other connections of this process are being opened (one at a time on this torch)"
            )
        try:
            if stop is not None and stop():
                # Asked to stop while waiting for the turn: a server that refuses now ends the
                # attempt here, not after seconds in torch's connect loop (the C++ twin waits
                # for no turn).
                _reach(store.host, store.port, deadline, stop)
            _free_retired()
            return _tcp_client(store, max(min(deadline - time.monotonic(), BACKGROUND_TURN), _TICK))
        except Exception:
            if time.monotonic() >= deadline or (stop is not None and stop()):
                raise
            # The server went away after the check, or did not answer within one turn:
            # let the others have theirs, then check it again.
        finally:
            _CONNECT.release()
        time.sleep(max(min(pause, deadline - time.monotonic()), 0))
        pause = min(pause * 2, 0.5)


def under_prefix(prefix: str, client: dist.Store) -> dist.Store:
    """``client`` under the joined ``prefix`` of a PrefixStore chain ("a/b/", or "" for none)."""
    # PrefixStore(P, c) puts "P/" before a key: P is the joined prefix less its last "/".
    return dist.PrefixStore(prefix[:-1], client) if prefix else client


def _unreachable(host: str, port: int, exc: OSError) -> dist.DistNetworkError:
    """The error of a server no plain connection reached (csrc/lanes.cpp reach() words it alike)."""
    return dist.DistNetworkError(f"the store's server {host}:{port} is unreachable: {exc}")


def _self_connected(sock: socket.socket) -> bool:
    """Whether ``sock`` is connected to itself: with nothing listening on a local port of the
    ephemeral range, a connect to it now and then gets that very port as its source, and the
    kernel connects the socket to itself (a simultaneous open). That is a refusal, not a
    server. (csrc/lanes.cpp connected_to_itself() is its twin.)"""
    try:
        return bool(sock.getsockname() == sock.getpeername())
    except OSError:
        return False


def _attempt(host: str, port: int, seconds: float) -> OSError | None:
    """One plain TCP connection to each address of ``host:port`` in turn, each closed at once
    (the server only sees a client that left): None when one accepts, else an error. The error
    is a ``ConnectionRefusedError`` only when every address refused; a name that does not
    resolve gives its ``gaierror``, an address that neither accepts nor refuses within
    ``seconds`` a ``TimeoutError``. (csrc/lanes.cpp connects() is its twin.)"""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return exc
    refused: OSError | None = None
    other: OSError | None = None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as sock:
            sock.settimeout(max(seconds, _TICK))
            try:
                sock.connect(address)
                if not _self_connected(sock):
                    return None
                refused = ConnectionRefusedError(errno.ECONNREFUSED, os.strerror(errno.ECONNREFUSED))
            except ConnectionRefusedError as exc:
                refused = exc
            except (TimeoutError, socket.timeout):  # distinct classes before Python 3.10
                other = TimeoutError(errno.ETIMEDOUT, os.strerror(errno.ETIMEDOUT))
            except OSError as exc:
                other = exc
    return other or refused or ConnectionRefusedError(errno.ECONNREFUSED, os.strerror(errno.ECONNREFUSED))


# What ends a caller's wait for a server at once: every address refused. The server was up
# when the instance was made, so it is gone; torch's connect would retry it for its timeout.
_REFUSED: tuple[type[OSError], ...] = (ConnectionRefusedError,)


def reach(host: str, port: int, seconds: float) -> None:
    """Return once ``host:port`` accepts a plain TCP connection (closed at once), before a
    torch client is made of an address given by a user; raise DistNetworkError at once when
    the name does not resolve or every address refuses, else after ``seconds``. torch's
    connect loop would retry both for its whole timeout, logging every failed attempt with a
    C++ stack trace."""
    _reach(host, port, time.monotonic() + seconds, ends=(*_REFUSED, socket.gaierror))


def await_server(host: str, port: int, seconds: float) -> OSError | None:
    """Wait up to ``seconds`` for ``host:port`` to accept a plain TCP connection (closed at
    once): None once it does, else the last attempt's error. For a server that may start
    later (a job's rank 0): refusals and names that do not resolve yet are retried."""
    return _wait(host, port, time.monotonic() + seconds)


def _reach(
    host: str,
    port: int,
    deadline: float,
    stop: Callable[[], bool] | None = None,
    ends: tuple[type[OSError], ...] = (),
) -> None:
    """Return once ``host:port`` accepts a TCP connection (:func:`_attempt`), or raise
    DistNetworkError at ``deadline``, once it failed when ``stop()`` is true, or at once on an
    error of a type in ``ends`` (``_REFUSED``: every address refused). Plain sockets and sleeps:
    a thread waiting here holds no lock and is not inside torch when the process exits."""
    exc = _wait(host, port, deadline, stop, ends)
    if exc is not None:
        raise _unreachable(host, port, exc) from None


def _wait(
    host: str,
    port: int,
    deadline: float,
    stop: Callable[[], bool] | None = None,
    ends: tuple[type[OSError], ...] = (),
) -> OSError | None:
    """The loop of :func:`_reach` and :func:`await_server`: None once a connection is
    accepted, else the last error (at ``deadline``, on ``stop()``, or one of ``ends``)."""
    pause = 0.01
    while True:
        exc = _attempt(host, port, min(deadline - time.monotonic(), 1.0))
        if exc is None:
            return None
        left = deadline - time.monotonic()
        if left <= 0 or (stop is not None and stop()) or isinstance(exc, ends):
            return exc
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.5)


# How long the check of a new instance waits for one address of the store's server to accept
# or refuse a connection; one that does neither is left to torch's own connect.
CHECK_CONNECT = 1.0


def check_server(store: dist.Store) -> None:
    """Raise DistNetworkError at once when every address of the TCPStore under ``store``
    (through any PrefixStores) refuses a connection; other stores pass. A new instance's first
    connection would otherwise spend the store's whole timeout (300 s by default) in torch's
    connect loop before failing. Plain TCP connections, closed at once (the server sees a
    client that left). Only a refusal fails: an address that does not answer within
    ``CHECK_CONNECT`` seconds (a host that is down, a server dropping connections under load)
    and a name that does not resolve are left to torch, as before."""
    base = base_store(store)
    if not isinstance(base, dist.TCPStore):
        return
    exc = _attempt(base.host, base.port, CHECK_CONNECT)
    if isinstance(exc, ConnectionRefusedError):
        raise _unreachable(base.host, base.port, exc)


def _tcp_client(store: dist.TCPStore, connect_timeout: float | None) -> dist.TCPStore:
    timeout = store.timeout
    if connect_timeout is not None and connect_timeout < timeout.total_seconds():
        timeout = timedelta(seconds=max(connect_timeout, _TICK))  # connecting gives up then
    client = reaper.opened(
        lambda: dist.TCPStore(
            store.host,
            store.port,
            is_master=False,
            timeout=timeout,
            wait_for_workers=False,
            use_libuv=store.libuvBackend,
        ),
        f"{store.host}:{store.port}",
        store.port,
        timeout.total_seconds(),
    )
    client.set_timeout(store.timeout)
    return client


# Without compare_set, how long a later claimer waits for the first one's write (Lane.claim).
CLAIM_WAIT = 1.0
# How long Lane.peek_quietly's get waits (for a key that vanished after its check, it waits
# this long for nothing).
QUIET_WAIT = 0.25
# How long Lane.peek_quietly's new connection may take to open (see there): a server is gone
# when it refuses, at once; one that is busy or stalls in a reverse lookup needs seconds.
QUIET_RECONNECT = 5.0


class Lane:
    """One store handle, used by one caller at a time."""

    def __init__(
        self,
        store: dist.Store,
        owned: bool,
        native_barrier: bool,
        extended: bool,
        sliced: bool = False,
        polled: bool = False,
        cas: bool = True,
        deletes: bool = True,
    ) -> None:
        self.store = store
        self.cas = cas  # compare_set may be called (see store_api)
        self.deletes = deletes  # delete_key may be called
        self.owned = owned
        self.native_barrier = native_barrier
        self.extended = extended
        self.sliced = sliced  # a TCPStore client shared by every caller: waits poll check()
        self.polled = polled  # a FileStore (under any PrefixStores): waits poll check() faster than it
        self._timeout: float | None = None
        self._prefix: str | None = None  # what PrefixStores put before a key (see key_prefix)
        self.prefix = ""  # the same, on the TCPStore path (set by Lanes)
        self._base: dist.Store | None = None  # the TCPStore under the PrefixStores
        self.socket: reaper.Socket | None = None  # a TCPStore connection of its own (see reaper)

    # -- plain calls ---------------------------------------------------------
    def set(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def add(self, key: str, value: int) -> int:
        try:
            return int(self.store.add(key, value))
        except RuntimeError as exc:
            # A Python-written store (torch's EtcdStore) under PrefixStores keeps an unbounded
            # int: the add was made, but torch's binding cannot hand a result past int64 back
            # through the PrefixStore. Read it again from the Python store itself, wrapped at
            # 64 bits (the C++ twin's Lane::add does the same). Only running totals get there.
            if "Unable to cast Python instance" not in str(exc) or self.store is base_store(self.store):
                raise
            base, full = self._base_key(key)
            return K.wrap_int64(int(base.add(full, 0)))

    def delete(self, key: str) -> None:
        if not self.deletes:
            return
        try:
            self.store.delete_key(key)
        except RuntimeError as exc:
            # torch's PrefixStore cannot reach a Python-written store's delete_key ("pure
            # virtual"): delete the key from the Python store itself, under its full name.
            if "pure virtual" not in str(exc):
                raise
            base, full = self._base_key(key)
            base.delete_key(full)

    def _base_key(self, key: str) -> tuple[dist.Store, str]:
        """The store under this lane's PrefixStores, and ``key`` as that store sees it (the C++
        twin's ``base_key``): for the calls torch's PrefixStore cannot forward to a Python store."""
        if self._prefix is None:
            self._prefix = key_prefix(self.store)
        return base_store(self.store), self._prefix + key

    def drop_counter(self, key: str) -> None:
        """Delete a counter of this rank's own; where keys cannot be deleted, bring it back to
        0, which its readers take for absent (a heartbeat)."""
        if self.deletes:
            self.delete(key)
        else:
            self.add(key, -self.add(key, 0))

    def peek(self, key: str) -> bytes | None:
        """Read ``key`` without waiting or writing; ``None`` when it does not exist (without
        compare_set: ``check``, then ``get``; keys never vanish on such a store)."""
        if self.cas:
            return peek(self.store, key)
        return bytes(self.store.get(key)) if self.store.check([key]) else None

    def peek_quietly(self, key: str) -> bytes | None:
        """``peek`` for a counter that ranks may be waiting on in TCPStore's server-side
        barrier. The server takes ``compare_set`` for a write and releases every rank waiting
        on the key, so here: ``check``, then ``get`` (3 round trips where ``peek`` takes one: for
        timeouts and polls, never the success path). Elsewhere ``peek``.

        A key deleted between the get's wait and its read (a barrier's counter, deleted by rank
        0 once the barrier completed) reads as absent: the libuv server answers that read with
        no bytes, the legacy server drops the connection (a new one, opened within
        ``QUIET_RECONNECT`` seconds, then checks the key; if none opens, the lost connection's
        error is raised)."""
        if not self.native_barrier:
            return self.peek(key)
        if not self.store.check([key]):
            return None
        try:
            value = self.get(key, QUIET_WAIT)
        except Exception:  # noqa: BLE001 - told apart below
            if not self._still_there(key):
                return None  # deleted after the check: only once its barrier has completed
            # The key is there and the get timed out: a server slower than QUIET_WAIT. Read it
            # the usual way (at worst one early release) rather than report a timeout early.
            return self.peek(key)
        # No counter is empty: the key was deleted between the get's wait and its read, which
        # the libuv server answers with no bytes.
        return value or None

    def _still_there(self, key: str) -> bool:
        """``check`` after a failed read; on a connection the legacy server dropped (a get that
        found the key gone), on a new one."""
        try:
            return bool(self.store.check([key]))
        except Exception as lost:
            if not (self.owned and connection_lost(lost)):
                raise
            try:
                self._reconnect(QUIET_RECONNECT)
            except Exception:  # noqa: BLE001 - the server is gone: the lost connection is what to report
                raise lost from None
            return bool(self.store.check([key]))

    def _reconnect(self, connect_timeout: float) -> None:
        """A new connection for this owned lane, under the same PrefixStores."""
        dropped = base_store(self.store)
        # The new client connects within the old one's timeout at most, and this lane's last
        # get armed that to QUIET_WAIT: a server busy for that long is not gone.
        dropped.set_timeout(timedelta(seconds=connect_timeout))
        with _FORK_GATE:
            reaper.take_opened()
            client = new_client(dropped, connect_timeout)
            self.socket = reaper.take_opened()  # a Bound already entered keeps the old one
        retire(self.store)
        retire(dropped)  # its Python object may be held by nothing else
        self.store = under_prefix(self.prefix, client)
        self._timeout = None
        self._base = None

    def peek_log(self, key: str, most: int) -> bytes | None:
        """Read what was appended to ``key`` (see :meth:`append`), at most ``most`` entries
        where entries are separate keys; ``None`` when nothing was."""
        if self.extended or self.cas:
            return self.peek(key)
        count = self.peek(K.entry_count(key))
        if count is None:
            return None
        entries = [K.entry(key, i) for i in range(1, min(K.parse_counter(count), most) + 1)]
        # An entry is written just after its number is taken: one not there yet is left out.
        return b"".join(v for v in self.peek_many(entries) if v is not None)

    def claim(self, key: str, value: bytes) -> bytes:
        """Write ``value`` to ``key`` unless some value was written first; return the value
        that stands (``compare_set`` from empty). Without compare_set the first to take the
        ticket ``entry_count(key)`` writes; a later caller waits up to CLAIM_WAIT seconds for
        that write (the first caller writes right after its ticket), and gets its own
        ``value`` back only if none came (the first caller died in between)."""
        if self.cas:
            return bytes(self.store.compare_set(key, b"", value))
        if self.add(K.entry_count(key), 1) == 1:
            self.set(key, value)
            return value
        deadline = time.monotonic() + CLAIM_WAIT
        pause = 0.001
        while (stands := self.peek(key)) is None and time.monotonic() < deadline:
            exit_gate.pause(pause)
            pause = min(pause * 2, 0.05)
        return stands or value

    def swap(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """``compare_set``: write ``desired`` if ``key`` holds ``expected`` (or is absent and
        ``expected`` is empty); return what then stands. Where the key is absent and ``expected``
        is not empty, every torch store returns ``expected`` and writes nothing. Only where
        ``cas``."""
        return bytes(self.store.compare_set(key, expected, desired))

    def peek_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """``peek`` several keys: one check and one multi_get when all exist. A key deleted
        between the two (a rank that closes drops its heartbeat) would hold a plain multi_get
        for the store's whole timeout: where keys can vanish, the multi_get waits QUIET_WAIT on
        the lane's own connection, then falls back to one peek per key, as on shared clients
        and polled stores."""
        if not self.deletes:  # keys never vanish
            if self.store.check(list(keys)):
                return [bytes(v) for v in self.store.multi_get(list(keys))]
        elif self.owned and not self.polled and self.store.check(list(keys)):
            try:
                return [bytes(v) for v in self.multi_get(keys, QUIET_WAIT)]
            except Exception:  # noqa: BLE001 - deleted after the check (a lost connection: peek raises)
                pass
        return [self.peek(k) for k in keys]

    def append(self, key: str, value: bytes) -> None:
        """Atomic append; emulated with compare_set where the store lacks it, and as numbered
        entry keys (``entry_count``, ``entry``) where it lacks compare_set too."""
        if self.extended:
            self.store.append(key, value)
            return
        if not self.cas:
            self.set(K.entry(key, self.add(K.entry_count(key), 1)), value)
            return
        expected, desired = b"", value
        while True:
            current = bytes(self.store.compare_set(key, expected, desired))
            if current == desired:
                return
            expected, desired = current, current + value

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes]) -> None:
        """One call; stores without it get torch's default (one set per key)."""
        self.store.multi_set(list(keys), list(values))

    # -- blocking calls: ``seconds`` is the time left until the op's deadline --
    def _arm(self, seconds: float) -> None:
        """Make the lane's timeout ``seconds``, give or take its slack (0.1% + 1 ms, never less):
        it is reset only when off by more, to half the slack past ``seconds``, so back-to-back
        ops with one timeout reuse it (a blocking call may time out up to the slack late)."""
        seconds = max(seconds, _TICK)
        slack = 0.001 * seconds + 0.001
        if self._timeout is None or not 0.0 <= self._timeout - seconds <= slack:
            self._timeout = seconds + slack / 2
            self.store.set_timeout(timedelta(seconds=self._timeout))

    def wait(self, keys: Sequence[str], seconds: float) -> None:
        if self.sliced:
            self._wait_sliced(keys, seconds, 0.001, SLICE)
            return
        if self.polled:
            self._wait_sliced(keys, seconds, FILE_POLL_FIRST, FILE_POLL)
            return
        try:
            self.store.wait(list(keys), timedelta(seconds=max(seconds, _TICK)))
        except TypeError:
            # A Python store whose wait() takes no timeout: its own timeout applies.
            self.store.wait(list(keys))

    def _wait_sliced(self, keys: Sequence[str], seconds: float, first: float, longest: float) -> None:
        """``wait`` by polling ``check``, pausing ``first`` seconds and doubling up to ``longest``:
        on a client shared by every caller (1 ms to 50 ms), so the client is never held while
        waiting (a timed-out TCPStore ``wait`` would also log two warnings per slice); on a
        FileStore (0.1 ms to 10 ms), so a value written just after a look is not seen 10 ms late."""
        deadline = time.monotonic() + seconds
        pause = first
        while not self.store.check(list(keys)):
            left = deadline - time.monotonic()
            if left <= 0:
                raise dist.DistStoreError(f"wait timeout after {seconds:g}s, keys: {list(keys)}")
            exit_gate.pause(min(pause, left))  # where the thread parks when the process exits
            pause = min(pause * 2, longest)

    def _fits(self, seconds: float) -> bool:
        """True when a plain blocking read can be used: the lane is ours (its timeout is
        set per call), or the shared store's own timeout matches ours (within 1%) and no
        other caller needs its connection meanwhile (never on a FileStore: its waits are polled)."""
        if self.polled:
            return False
        if self.owned:
            self._arm(seconds)
            return True
        if self.sliced:
            return False
        try:
            own = self.store.timeout.total_seconds()
        except Exception:  # noqa: BLE001 - Python stores without a timeout
            return False
        return abs(own - seconds) <= 0.01 * seconds + 0.01

    def get(self, key: str, seconds: float) -> bytes:
        """Wait for ``key`` and read it: one call where the store's timeout fits, else wait + get
        (on a FileStore: peeks, so a value already there costs one call, not two)."""
        if self.polled:
            return self._get_polled(key, seconds)
        if not self._fits(seconds):
            self.wait([key], seconds)
        return bytes(self.store.get(key))

    def _get_polled(self, key: str, seconds: float) -> bytes:
        """``get`` by polling ``peek`` (the pauses of ``_wait_sliced`` on a FileStore): the look
        that finds the value also reads it."""
        deadline = time.monotonic() + seconds
        pause = FILE_POLL_FIRST
        while (value := self.peek(key)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise dist.DistStoreError(f"wait timeout after {seconds:g}s, keys: {[key]}")
            exit_gate.pause(min(pause, left))
            pause = min(pause * 2, FILE_POLL)
        return value

    def multi_get(self, keys: Sequence[str], seconds: float) -> list[bytes]:
        """Wait for all ``keys`` and read them (one call where the store's timeout fits;
        stores without multi_get get torch's default, one get per key)."""
        if self.polled and len(keys) == 1:
            return [self._get_polled(keys[0], seconds)]
        if not self._fits(seconds):
            self.wait(keys, seconds)
        return [bytes(v) for v in self.store.multi_get(list(keys))]

    def barrier(self, key: str, world_size: int, seconds: float) -> None:
        """TCPStore's server-side barrier: add 1 to ``key``, wait until it reaches ``world_size``."""
        # Only TCPStore lanes have it, and those are always owned (clones): the barrier takes
        # the lane's timeout (a PrefixStore passes set_timeout on to its TCPStore), so no
        # timedelta is built per call. Under PrefixStores it is called on the TCPStore itself.
        self._arm(seconds)
        if self.prefix and self.native_barrier:
            if self._base is None:
                self._base = base_store(self.store)
            self._base.barrier(self.prefix + key, world_size)
        else:
            self.store.barrier(key, world_size)

    def list_keys(self) -> list[str] | None:
        """The store's key names, relative to this lane's PrefixStores; ``None`` where they
        cannot be listed."""
        try:
            return list(self.store.list_keys())
        except Exception:  # noqa: BLE001 - optional API
            return python_list_keys(self.store)


class Borrowed:
    """A borrowed lane as a context manager: returned to the pool unless the block raised
    (a class, not a generator: every collective borrows one)."""

    __slots__ = ("_lanes", "_lane", "_bound")

    def __init__(self, lanes: Lanes, lane: Lane, deadline: float | None = None) -> None:
        """``deadline`` (``time.monotonic()``): the lane's connection is shut down if the block
        is still in it ``reaper.GRACE`` seconds later (a server that stopped answering)."""
        self._lanes, self._lane = lanes, lane
        self._bound = reaper.Bound(lane.socket, deadline) if deadline is not None and lane.socket else None

    def __enter__(self) -> Lane:
        if self._bound is not None:
            self._bound.__enter__()
        return self._lane

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if self._bound is not None:
            self._bound.__exit__()
        if exc_type is None:
            self._lanes.release(self._lane)
        elif self._lane.owned:
            retire(self._lane)


class Lanes:
    """A pool of lanes over one user store: one lane per concurrent caller."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store
        base = base_store(store)
        tcp = isinstance(base, dist.TCPStore)
        # Clones of TCPStore/FileStore are independent handles; others share state. Without
        # clone(): new clients for a TCPStore; a FileStore is shared (its waits poll, lock-free).
        if capabilities.CLONE:
            self.owned = tcp or isinstance(base, dist.FileStore)
        else:
            self.owned = isinstance(store, dist.TCPStore)
        self.sliced = tcp and not self.owned
        self.tcp = tcp  # a TCPStore under any PrefixStores (either path)
        # Its server, named when a connection to it is lost (twin of Lanes::server).
        self.server = server_of(store)
        self.polled = isinstance(base, dist.FileStore)
        # An in-process store (a HashStore under any PrefixStores): its calls never wait on I/O,
        # so an op's cleanup costs less made by the caller than handed to the watcher thread.
        self.local = isinstance(base, dist.HashStore)
        chain = store is not base
        self.native_barrier = takes_tcpstore_path(store)
        try:
            self.extended = bool(store.has_extended_api())
        except Exception:  # noqa: BLE001 - Python stores may not implement it
            self.extended = False
        self.cas, self.deletes = store_api(store)
        self.python = python_methods(store) is not None  # a Python-written store under any PrefixStores
        self._free: list[Lane] = []
        self._lock = threading.Lock()
        # What the PrefixStores put before a key: the server-side barrier is called on the
        # TCPStore under them, with the full key (PrefixStore does not forward barrier()).
        # Known too for any owned chain over a TCPStore where it can be learned: new lanes are
        # then new clients opened within an op's time left (clone() cannot be bounded).
        self.prefix = ""
        if chain and tcp and self.owned and (self.native_barrier or capabilities.LIST_KEYS or _reads_prefixes()):
            lane = self.acquire()
            self.prefix = lane.prefix = chain_prefix(lane.store)
            self.release(lane)

    def acquire(self, connect_timeout: float | None = None, stop: Callable[[], bool] | None = None) -> Lane:
        """A lane from the pool, or a new one (see :meth:`open`)."""
        with self._lock:
            if self._free:
                return self._free.pop()
        return self.open(connect_timeout, stop)

    def open(self, connect_timeout: float | None = None, stop: Callable[[], bool] | None = None) -> Lane:
        """A new lane (a new connection where lanes are owned), never one from the pool. A
        TCPStore's new connection opens within ``connect_timeout`` seconds when given (an op's
        time left): ``clone()`` would take the store's whole timeout to fail on a server that
        is gone. ``stop`` makes it a background connection (see :func:`new_client`)."""
        sock = None
        if not self.owned:
            handle = self.store
        else:
            with _FORK_GATE:
                reaper.take_opened()
                handle = self._connect(connect_timeout, stop)
                sock = reaper.take_opened()
        lane = Lane(
            handle, self.owned, self.native_barrier, self.extended, self.sliced, self.polled, self.cas, self.deletes
        )
        lane.prefix = getattr(self, "prefix", "")
        lane.socket = sock
        return lane

    def _connect(self, connect_timeout: float | None, stop: Callable[[], bool] | None) -> dist.Store:
        """A new connection for an owned lane."""
        if isinstance(self.store, dist.TCPStore):
            return new_client(self.store, connect_timeout, stop)
        if self.prefix and not self.sliced:  # a PrefixStore chain whose prefix is known
            return under_prefix(self.prefix, new_client(base_store(self.store), connect_timeout, stop))
        if capabilities.CLONE:
            base = base_store(self.store)
            if connect_timeout is not None and isinstance(base, dist.TCPStore):
                # A chain whose prefix cannot be learned (torch without list_keys, no
                # extension): clone() connects within the store's own timeout, minutes on a
                # server that is gone. Reach the server within the time given first; that
                # probe connection is dropped at once.
                new_client(base, connect_timeout, stop)
            elif isinstance(base, dist.TCPStore):
                # No time limit: a plain-socket check suffices (see new_client).
                deadline = time.monotonic() + base.timeout.total_seconds()
                _reach(base.host, base.port, deadline, stop, () if stop else _REFUSED)
            if isinstance(base, dist.TCPStore):
                seconds = base.timeout.total_seconds()
                return reaper.opened(self.store.clone, f"{base.host}:{base.port}", base.port, seconds)
            return self.store.clone()
        return new_client(self.store, stop=stop)

    def release(self, lane: Lane) -> None:
        with self._lock:
            self._free.append(lane)

    def lane(self) -> Borrowed:
        """``with lanes.lane() as lane``: borrow a lane; one that saw an error is dropped, not reused."""
        return Borrowed(self, self.acquire())

    def close(self) -> None:
        with self._lock:
            lanes, self._free = self._free, []
        if not capabilities.CLONE:
            # This torch registers a new client's Python object without the GIL (see _CONNECT):
            # freeing our clients while another thread constructs one can corrupt pybind11's
            # registry, so they are freed in the same one-at-a-time turn.
            with _CONNECT:
                del lanes
                _free_retired()

    def __del__(self) -> None:
        # Freed without close(): the lanes are retired, not freed here (see close()).
        try:
            if self._free and self.owned and not capabilities.CLONE:
                _RETIRED.extend(self._free)
        except Exception:  # noqa: BLE001, S110 - half-made, or the interpreter is finalizing
            pass
