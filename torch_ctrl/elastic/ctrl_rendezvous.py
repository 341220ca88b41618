"""The native ``ctrl`` rendezvous: O(1) store calls per node to join a round.

torch's ``c10d`` rendezvous keeps the whole rendezvous in one pickled blob that every node
rewrites with ``compare_set``: each join or keep-alive rewrites O(N) bytes and collides with
every other node's attempt. Here each node only touches keys of its own, plus counters that
the store increments atomically; one node per round (the *sealer*) reads the round's
membership once and writes everybody's rank in one request.

Keys, all on the rendezvous store (``R = torch_ctrl/rdzv/{run_id}``; ``r`` a round, ``k`` an
arrival slot, 1-based):

============================  ===============================================================
``R/open``                    ``"{r},{size of round r-1}"``: the round open for joining (a hint:
                              an arrival that finds ``r`` sealed moves on), or ``"closed"``
``R/closed``                  present once the run is closed
``R/hb/{node}``               ``"{unix time} {attempt}"``: the node's heartbeat (a ``set`` every
                              ``keep_alive_interval``; a negative time = withdrawn)
``R/da/{node}``               the node's ``keep_alive_interval`` x ``keep_alive_max_attempt`` in
                              seconds, written with its first heartbeat: when the rendezvous
                              takes it for dead, for readers that do not know the run's
                              settings (``inspect``)
``R/{r}/arrived``             counter: +1 per arrival, +2^24 more if the arriver was a member
                              of round r-1, +2^48 when the round is sealed or closed
``R/{r}/n/{k}``               ``"{host}\\t{pid}\\t{local id}\\t{attempt}"``: who took slot ``k``
``R/{r}/rank/{k}``            ``"{rank} {world size}"``, or ``s`` (spare: the round was full),
                              ``d`` (judged dead), ``c`` (closed)
``R/{r}/outcome``             every slot's outcome and the members, decided by one
                              ``compare_set`` (the sealer's, or the leader's when it takes over
                              from a sealer that died): the slot keys are written from it
``R/{r}/members``             node ids of round ``r`` in rank order (read only to find dead ones)
``R/{r}/seal``                the round's size (0: it did not form, and ``R/{r}/void`` is set)
``R/{r}/freed``               set by the leader once round r-1 is gone and round r cannot form
                              yet: its spares' join_timeout starts
``R/{r}/last_call``           unix time the last call started (the first writer wins)
``R/{r}/lead``                the slot of the round's leader, once another took over from slot 1
``R/{r}/boot``                ``"{addr}\\n{port}"``: the round's bootstrap store, from its node 0
============================  ===============================================================

The round's own store (``RendezvousInfo.store``) is ``PrefixStore("torch.rendezvous.{run_id}.{r}")``
over the rendezvous store, as with ``c10d``. See ``docs/protocol.md`` ("The ctrl rendezvous")
for what each node does and why each step costs what it costs.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
import socket
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from functools import cache, wraps
from typing import Any, Callable, TypeVar

import torch.distributed as dist

from ..bounded import Caller, NoAnswer, Silence, client_timeout, parked, within
from ..errors import one_line
from ..lanes import await_server, connection_lost, turn

log = logging.getLogger("torch_ctrl.elastic")

__all__ = ["NativeRendezvousHandler", "RendezvousConfig", "config_from", "connect", "create_native_handler"]

BACKEND = "ctrl"
DEFAULT_PORT = 29400
ROOT = "torch_ctrl/rdzv"

# The arrival counter packs three fields into one integer, so one atomic add both takes a
# slot and says who arrived: bits 0-23 count arrivals, bits 24-47 count members of the
# previous round among them, and 2^48 is added once when the round is sealed or closed.
COUNT_MASK = (1 << 24) - 1
MEMBER = 1 << 24
SEALED = 1 << 48

SPARE, DEAD, CLOSED = "s", "d", "c"

# torch's agent asks num_nodes_waiting() from the loop that monitors its workers (every
# --monitor-interval). A rendezvous store that stops answering (its host's agent stopped by
# SIGSTOP or a debugger, a frozen VM, a network cut) holds torch's client with no bound, so
# the ask waits at most this long; the loop then goes on (this node's workers are still
# watched, and a failure of theirs is still reported), counting no waiting nodes meanwhile.
ASK_BOUND = 5.0
# Seconds between the warnings that the store still does not answer.
SILENT_LOG_EVERY = 60.0
# Seconds a node that withdraws waits for a heartbeat of its own that is being sent.
FORGET_BOUND = 2.0

_local_ids = itertools.count()  # process-wide, like c10d's node descriptors (next() is atomic under the GIL)


def _errors() -> Any:
    from torch.distributed.elastic.rendezvous import api

    return api


def _closed_error(msg: str, spare: bool) -> Exception:
    """``RendezvousClosedError``; for a spare, also torch's ``RendezvousGracefulExitError``
    (c10d's spares exit gracefully when the run closes; torch's agent catches that type)."""
    api = _errors()
    graceful = getattr(api, "RendezvousGracefulExitError", None)
    if spare and graceful is not None:
        return type("RendezvousClosedGracefully", (graceful, api.RendezvousClosedError), {})(msg)
    return api.RendezvousClosedError(msg)


# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class RendezvousConfig:
    """What the ``ctrl`` rendezvous reads from torchrun's parameters (c10d's options, in seconds)."""

    run_id: str
    min_nodes: int
    max_nodes: int
    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    close_timeout: float = 30.0
    heartbeat_timeout: float = 5.0
    keep_alive_interval: float = 5.0
    keep_alive_max_attempt: int = 3
    read_timeout: float = 60.0
    local_addr: str | None = None

    @property
    def dead_after(self) -> float:
        """Seconds without a heartbeat after which a node counts as dead."""
        return self.keep_alive_interval * self.keep_alive_max_attempt


def _seconds(params: Any, name: str, default: float) -> float:
    value = params.get(name, default)
    try:
        seconds = float(value.total_seconds() if isinstance(value, timedelta) else value)
    except (TypeError, ValueError):
        raise ValueError(f"ctrl rendezvous: {name}={value!r} is not a number of seconds") from None
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"ctrl rendezvous: {name}={value!r} must be a positive number of seconds")
    return seconds


def config_from(params: Any) -> RendezvousConfig:
    """Validate torchrun's ``RendezvousParameters``; raises ``ValueError`` (one line) on bad input."""
    if not params.run_id:
        raise ValueError("ctrl rendezvous: the run id (--rdzv-id) must be a non-empty string")
    try:
        lo, hi = int(params.min_nodes), int(params.max_nodes)
    except (TypeError, ValueError):
        raise ValueError(f"ctrl rendezvous: --nnodes={params.min_nodes}:{params.max_nodes} is not numeric") from None
    if lo < 1:
        raise ValueError(f"ctrl rendezvous: min_nodes={lo} must be at least 1")
    if hi < lo:
        raise ValueError(f"ctrl rendezvous: min_nodes={lo} is greater than max_nodes={hi}")
    attempts = params.get("keep_alive_max_attempt", 3)
    try:
        attempts = int(attempts)
    except (TypeError, ValueError):
        raise ValueError(f"ctrl rendezvous: keep_alive_max_attempt={attempts!r} is not an integer") from None
    if attempts < 1:
        raise ValueError(f"ctrl rendezvous: keep_alive_max_attempt={attempts} must be at least 1")
    store_type = str(params.get("store_type", "tcp")).strip().lower()
    if store_type != "tcp":
        raise ValueError(f"ctrl rendezvous: store_type={store_type!r} is not supported (only 'tcp')")
    return RendezvousConfig(
        run_id=str(params.run_id),
        min_nodes=lo,
        max_nodes=hi,
        join_timeout=_seconds(params, "join_timeout", 600.0),
        last_call_timeout=_seconds(params, "last_call_timeout", 30.0),
        close_timeout=_seconds(params, "close_timeout", 30.0),
        heartbeat_timeout=_seconds(params, "heartbeat_timeout", 5.0),
        keep_alive_interval=_seconds(params, "keep_alive_interval", 5.0),
        keep_alive_max_attempt=attempts,
        read_timeout=_seconds(params, "read_timeout", 60.0),
        local_addr=getattr(params, "local_addr", None),
    )


def _is_host(params: Any, host: str) -> bool:
    """c10d's rule: ``is_host`` if given, else whether the endpoint names this machine."""
    explicit = params.get_as_bool("is_host")
    if explicit is not None:
        return bool(explicit)
    from torch.distributed.elastic.rendezvous import utils

    matches = getattr(utils, "_matches_machine_hostname", None)  # torch-private; the only one used here
    if matches is not None:
        return bool(matches(host))
    return host in ("localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn())


def connect(params: Any, config: RendezvousConfig) -> tuple[dist.Store, str, int]:
    """The rendezvous TCPStore (hosted here when ``is_host``, c10d's rules) and its address.

    A client keeps retrying until ``join_timeout``; then ``RendezvousConnectionError``, one line.
    """
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    api = _errors()
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    hosting = _is_host(params, host)
    use_libuv = params.get_as_bool("use_libuv", True)
    explicit = params.get_as_bool("is_host") is not None
    last: Exception | None = None
    deadline = time.monotonic() + config.join_timeout
    for server in [hosting, False] if hosting else [False]:
        if not server:
            # Wait for the host with plain sockets (its agent may start later): a host that
            # never comes is one line at join_timeout, where torch's connect loop retries past
            # it and logs each failed attempt with a C++ stack trace.
            last = await_server(host, port, max(0.0, deadline - time.monotonic()))
            if last is not None:
                break
        left = max(deadline - time.monotonic(), 1.0)
        made = timedelta(seconds=left) if server else client_timeout(left)  # set to read_timeout below
        kwargs: dict[str, Any] = dict(is_master=server, multi_tenant=True, timeout=made)
        if use_libuv is not None and not use_libuv:
            kwargs["use_libuv"] = False
        try:
            with turn():  # torch 2.6-2.7: one thread at a time makes or frees torch stores
                if server:
                    store = dist.TCPStore(host, port, **kwargs)
                else:  # a server that accepts but never answers (stopped) would block for ever
                    store = within(left, functools.partial(dist.TCPStore, host, port, **kwargs), f"{host}:{port}")
        except (RuntimeError, ValueError, TimeoutError) as exc:
            last = exc
            if server and not explicit:
                continue  # guessed wrong: another process on this machine hosts it
            break
        store.set_timeout(timedelta(seconds=config.read_timeout))
        if server:
            log.info("torch_ctrl: process %d hosts the ctrl rendezvous store on port %d", os.getpid(), store.port)
        return store, host, int(store.port)
    cause = one_line(str(last)) or type(last).__name__
    raise api.RendezvousConnectionError(
        f"ctrl rendezvous: cannot reach the rendezvous store at {host}:{port} "
        f"within join_timeout={config.join_timeout:g}s ({cause})"
    ) from None


@cache
def this_host() -> str:
    """This machine's FQDN, looked up once per process (a stalled resolver costs seconds per
    lookup): the name nodes go by here, in the agents' errors and in torch's failure summary."""
    return socket.getfqdn()


# ----------------------------------------------------------------------------- heartbeats

_beat_lock = threading.Lock()
_beat_stores: dict[tuple[str, int], dist.Store] = {}


def beat_store(host: str, port: int, timeout: float) -> dist.Store:
    """One connection per rendezvous endpoint and process, for heartbeats only: a node's own
    connection is blocked in a read while it waits for its round."""
    with _beat_lock:
        store = _beat_stores.get((host, port))
        if store is None:
            with turn():
                store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
            _beat_stores[(host, port)] = store
        return store


class _Beater:
    """One daemon thread per process beats for every live handler: each due handler's
    heartbeat is one ``set`` of its own key (batched per connection into one ``multi_set``).
    Handlers are held weakly: a handler that is garbage collected stops beating, as in c10d."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._due: dict[int, tuple[weakref.ref[NativeRendezvousHandler], float]] = {}
        self._thread: threading.Thread | None = None
        self._sending = threading.Lock()  # held while a batch is built and sent (see forget)

    def watch(self, handler: NativeRendezvousHandler) -> None:
        with self._cv:
            self._due[id(handler)] = (weakref.ref(handler), time.monotonic() + handler.config.keep_alive_interval)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="torch_ctrl-rdzv-heartbeats", daemon=True)
                self._thread.start()
            self._cv.notify()

    def forget(self, handler: NativeRendezvousHandler) -> None:
        """Stop beating for ``handler``; returns once no beat of it is being sent, so a
        withdrawal written next is never overwritten by a beat already on its way. (A beat is
        one request without a reply; ``FORGET_BOUND`` covers a slow connection, and a store
        that stopped answering never holds a node's exit for longer.)"""
        with self._cv:
            self._due.pop(id(handler), None)
        if self._sending.acquire(timeout=FORGET_BOUND):
            self._sending.release()

    def _run(self) -> None:
        while True:
            with self._cv:
                now = time.monotonic()
                due = [(i, ref) for i, (ref, at) in self._due.items() if at <= now]
                if not due:
                    nxt = min((at for _, at in self._due.values()), default=None)
                    self._cv.wait(None if nxt is None else nxt - now)
                    continue
                for i, ref in due:
                    h = ref()
                    if h is None:
                        del self._due[i]
                    else:
                        self._due[i] = (ref, now + h.config.keep_alive_interval)
            with self._sending:
                self._send(due)

    def _send(self, due: list[tuple[int, weakref.ref[NativeRendezvousHandler]]]) -> None:
        batches: dict[int, list[tuple[int, weakref.ref[NativeRendezvousHandler]]]] = {}
        for i, ref in due:
            h = ref()
            if h is not None:
                batches.setdefault(id(h._beats), []).append((i, ref))
        for batch in batches.values():
            # Looked at again just before its send: a handler forgotten meanwhile (while another
            # connection's batch was slow, past FORGET_BOUND) has withdrawn and gets no beat.
            with self._cv:
                handlers = [(i, h) for i, ref in batch if i in self._due and (h := ref()) is not None]
            if not handlers:
                continue
            store = handlers[0][1]._beats
            try:  # a daemon thread's call: see parked()
                parked(store).multi_set([h._hb_key for _, h in handlers], [h._beat_value() for _, h in handlers])
            except Exception as exc:  # noqa: BLE001 - a missed beat is what keep_alive_max_attempt allows
                self._failed(store, [i for i, _ in handlers], exc)

    def _failed(self, store: dist.Store, ids: list[int], exc: Exception) -> None:
        """A lost connection stays lost (torch's client does not reconnect): its handlers stop
        beating, with one warning, where every later beat would fail and log again, with torch's
        C++ trace, for as long as the process lives. Their peers take them for dead."""
        cause = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if not connection_lost(exc):
            log.warning("torch_ctrl: rendezvous heartbeat failed: %s", cause)
            return
        # Warned before the handlers leave the schedule, so whoever sees them gone (a test, a
        # supervisor polling) finds the warning already logged.
        log.warning(
            "torch_ctrl: rendezvous heartbeats stopped: the connection to %s was lost (%s)",
            _store_named(_address_of(store)),
            cause,
        )
        with self._cv:
            for i in ids:
                self._due.pop(i, None)


_beater = _Beater()


# ----------------------------------------------------------------------------- the handler


@dataclass(frozen=True)
class _Record:
    host: str
    pid: int
    local_id: int
    attempt: int

    @property
    def node(self) -> str:
        return f"{self.host}_{self.pid}_{self.local_id}"

    @property
    def order(self) -> tuple[str, int, int]:
        return (self.host, self.pid, self.local_id)

    def encode(self) -> str:
        return f"{self.host}\t{self.pid}\t{self.local_id}\t{self.attempt}"

    @staticmethod
    def decode(raw: bytes) -> _Record:
        host, pid, local, attempt = raw.decode().split("\t")
        return _Record(host, int(pid), int(local), int(attempt))


class _Spare(Exception):
    """This node was not admitted to the round it joined (full, or judged dead): join the next."""

    def __init__(self, full: bool) -> None:
        super().__init__()
        self.full = full


def _base() -> type:
    from torch.distributed.elastic.rendezvous import RendezvousHandler

    return RendezvousHandler


_F = TypeVar("_F", bound=Callable[..., Any])


def _state_checked(method: _F) -> _F:
    """A value of this run that does not parse (written under the same run id by another
    program, or another torch_ctrl version) becomes one ``RendezvousStateError`` line instead of
    a bare ``ValueError`` from deep inside the handler."""

    @wraps(method)
    def checked(self: NativeRendezvousHandler, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except (ValueError, IndexError) as exc:
            raise _errors().RendezvousStateError(
                f"ctrl rendezvous '{self.config.run_id}': the rendezvous store holds a value torch_ctrl did "
                f"not write under '{self._root}/' ({type(exc).__name__}: {one_line(str(exc))}); is another "
                f"program, or another torch_ctrl version, using run id '{self.config.run_id}'?"
            ) from None

    return checked  # type: ignore[return-value]


class NativeRendezvousHandler(_base()):  # type: ignore[misc]
    """torch's ``RendezvousHandler`` contract on O(1)-per-node store calls (see the module doc).

    ``store`` is this node's connection to the rendezvous store (it blocks in reads while the
    node waits); ``beats`` a connection for heartbeats (shared by the handlers of a process).
    ``round`` is the last round this node was admitted to (exported to workers by the hooks).
    """

    def __init__(
        self,
        config: RendezvousConfig,
        store: dist.Store,
        beats: dist.Store | None = None,
        *,
        host: str | None = None,
    ) -> None:
        self.config = config
        self._store = store
        self._beats = beats if beats is not None else store
        self._host = host or config.local_addr or this_host()
        self._local_id = next(_local_ids)
        self._root = f"{ROOT}/{config.run_id}"
        self._hb_key = f"{self._root}/hb/{self.node}"
        self._attempt = 0
        self.round: int | None = None
        self._rank: int | None = None
        self._world_size = 0
        self._server: dist.Store | None = None  # the workers' store of the current round (node 0)
        self._lead_check = 0.0
        self._freed = -1  # the last round this node marked freed (see _maybe_seal)
        self._unsealed_since: tuple[int, float] | None = None  # (round, when) seen closed, no outcome
        self._members: tuple[int, list[str]] = (-1, [])  # (round, its members in rank order)
        self._member_look: tuple[int, float, bool] = (-1, 0.0, False)  # (round, next look, member lost)
        # Named in the errors of a lost store: the host to look at is the one that serves it.
        self._address = _address_of(store)
        self._asker = Caller("torch_ctrl-rdzv-ask")  # num_nodes_waiting()'s bounded calls
        self._parked = parked(store)  # the same connection, for calls that may be given up on
        self._silence = Silence(SILENT_LOG_EVERY)  # when to warn that the store does not answer

    # ---------------------------------------------------------------- identity and keys
    @property
    def node(self) -> str:
        """This node's id: ``{host}_{pid}_{local id}`` (as c10d's node descriptors)."""
        return f"{self._host}_{os.getpid()}_{self._local_id}"

    @property
    def settings(self) -> RendezvousConfig:
        """The validated configuration (c10d's handler has ``settings`` too)."""
        return self.config

    def _k(self, rnd: int, name: str) -> str:
        return f"{self._root}/{rnd}/{name}"

    def _beat_value(self) -> str:
        return f"{time.time():.3f} {self._attempt}"

    def _withdrawn(self) -> str:
        """A heartbeat that reads as dead at once: minus the time this node left."""
        return f"-{time.time():.3f} {self._attempt}"

    # ---------------------------------------------------------------- torch's contract
    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        """As c10d: workers share a store hosted by node 0's agent unless
        ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (here a fresh one per round)."""
        return os.getenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") != "1"

    def get_run_id(self) -> str:
        return self.config.run_id

    def is_closed(self) -> bool:
        """One ``check``."""
        return bool(self._call(self._store.check, [f"{self._root}/closed"]))

    @_state_checked
    def num_nodes_waiting(self) -> int:
        """Nodes waiting for the next round that it can admit: one ``add(…, 0)`` on the next
        round's arrival counter. Spares are not counted while this round is full, unless one of
        its members is re-joining (then every member must restart).

        Waits at most :data:`ASK_BOUND` seconds for the store: a store that does not answer
        counts as no waiting nodes (with a warning naming its host, every
        :data:`SILENT_LOG_EVERY` seconds), so torch's monitor loop never freezes on it."""
        if self.round is None:
            return 0
        try:
            # (the round as of now: a call given up on may finish after this node moved on)
            count = self._asker.call(ASK_BOUND, self._waiting, self.round, self._rank, self._world_size)
        except NoAnswer as exc:
            self._silent(exc.waited or ASK_BOUND)
            return 0
        if self._silence.answered():
            log.warning("torch_ctrl: ctrl rendezvous '%s': %s answers again", self.config.run_id, self._where())
        return count

    def _waiting(self, rnd: int, rank: int | None, world: int) -> int:
        """:meth:`num_nodes_waiting` for round ``rnd`` (this node's ``rank`` of ``world``), on
        the connection that may be given up on."""
        v = int(self._call(self._parked.add, self._k(rnd + 1, "arrived"), 0))
        count, members = v & COUNT_MASK, (v >> 24) & COUNT_MASK
        if members or world < self.config.max_nodes:
            return count
        if count and v < SEALED and rank is not None and self._member_lost(rnd, rank):
            return count  # spares can take the place of a member that died (c10d counts them then)
        return 0

    def _member_lost(self, rnd: int, rank: int) -> bool:
        """Whether the member after this node in round ``rnd``'s rank order stopped heartbeating
        (its host died, its agent was SIGKILLed). This node then counts the spares as waiting, so
        its agent restarts into a round with them; the others follow once it re-joins. One read
        per ``keep_alive_interval`` per node (the members once per round): O(1), whatever N,
        and only while spares wait behind a full round. A node that left on purpose (negative
        heartbeat: its agent finished and closed the run) is not lost. Restarting costs the whole
        job a round, so the heartbeat must be older than ``dead_after`` plus one interval.

        What it found is kept with its round (a new round starts with nothing found), since a
        call given up on by :meth:`num_nodes_waiting` may finish after this node moved on."""
        cfg = self.config
        now = time.monotonic()
        look_round, next_look, gone = self._member_look
        if look_round == rnd and now < next_look:
            return gone
        members_round, nodes = self._members
        if members_round != rnd:
            raw = self._call(self._parked.compare_set, self._k(rnd, "members"), "\x01", "\x02")
            nodes = [] if raw == b"\x01" or not raw else raw.decode().split("\n")
            self._members = (rnd, nodes)
        if len(nodes) < 2 or not 0 <= rank < len(nodes):
            return False
        after = nodes[(rank + 1) % len(nodes)]
        raw = self._call(self._parked.compare_set, f"{self._root}/hb/{after}", "\x01", "\x02")
        t = float(bytes(raw).decode().split()[0]) if raw != b"\x01" else 0.0
        lost = t > 0 and time.time() - t > cfg.dead_after + cfg.keep_alive_interval
        if lost and not (look_round == rnd and gone):
            log.warning(
                "torch_ctrl: ctrl rendezvous '%s': node %s of round %d has not heartbeated for %.0fs; "
                "the spares waiting take its place (this node restarts its workers)",
                cfg.run_id, after, rnd, time.time() - t,
            )  # fmt: skip
        self._member_look = (rnd, now + cfg.keep_alive_interval, lost)
        return lost

    def _where(self) -> str:
        return _store_named(self._address)

    def _silent(self, waited: float) -> None:
        """Warn that the store does not answer: at once, then every ``SILENT_LOG_EVERY`` s."""
        if not self._silence.due(waited):
            return
        hosted = "the process that hosts it"
        if self._address is not None:
            hosted = f"the torchrun agent that hosts it, on {self._address[0]},"
        log.warning(
            "torch_ctrl: ctrl rendezvous '%s': %s has not answered for %.0fs: %s is stopped or hung "
            "(SIGSTOP, a debugger, a frozen machine), or the network to it is down; this agent goes on "
            "watching its workers and counts no nodes waiting to join until it answers",
            self.config.run_id,
            self._where(),
            waited,
            hosted,
        )

    @_state_checked
    def set_closed(self) -> None:
        """Close the run for every node: ``closed`` and ``open`` are marked, and the rounds being
        formed are sealed as closed (their waiters wake at once). O(waiting nodes), once."""
        self._close_run(self._store)

    @_state_checked
    def _close_run(self, store: Any) -> None:
        """:meth:`set_closed` on ``store`` (this node's connection, or it :func:`parked`)."""
        self._call(store.set, f"{self._root}/closed", "1")
        current = self._read_open_raw(store)
        if current == CLOSED_OPEN:
            return  # closed before: whoever closed it sealed the rounds being formed
        while current != CLOSED_OPEN:
            got = self._call(store.compare_set, f"{self._root}/open", current, CLOSED_OPEN).decode()
            current = CLOSED_OPEN if got == CLOSED_OPEN else got
        rnd = self._open_round_hint
        for r in (rnd, rnd + 1):
            v = int(self._call(store.add, self._k(r, "arrived"), SEALED))
            if v < 2 * SEALED:  # we closed it before any sealer: nobody else writes its slots
                count = v & COUNT_MASK
                if count:
                    keys = [self._k(r, f"rank/{k}") for k in range(1, count + 1)]
                    self._call(store.multi_set, keys, [CLOSED] * count)

    def shutdown(self) -> bool:
        """Leave: stop heartbeating, withdraw this node at once (it never holds a round back),
        and close the run as torch's c10d handler does (torchrun calls this when its agent is
        done, and skips it when the agent is killed by a signal). False on a store error."""
        _beater.forget(self)
        try:
            self._call(self._beats.set, self._hb_key, self._withdrawn())
            # Bounded: a store that stopped answering would hold the agent's exit for ever.
            within(self.config.close_timeout, lambda: self._close_run(self._parked), self._where())
            return True
        except NoAnswer:
            log.warning(
                "torch_ctrl: the ctrl rendezvous '%s' could not be closed: %s did not answer within "
                "close_timeout=%gs (its host's agent stopped or hung, or the network to it is down)",
                self.config.run_id,
                self._where(),
                self.config.close_timeout,
            )
            return False
        except _errors().RendezvousError as exc:
            # A store that is gone took the run with it: its host's agent finished first (a
            # failed node's agent often outlives the host it notified). Nothing is left to close.
            level = logging.INFO if _GONE in str(exc) else logging.WARNING
            log.log(level, "torch_ctrl: the ctrl rendezvous '%s' could not be closed: %s", self.config.run_id, exc)
            return False
        finally:
            with turn():
                self._server = None

    def _stop_heartbeats(self) -> None:
        """Stop this node's heartbeats (c10d has the same private method): its peers will find
        it dead after ``keep_alive_interval * keep_alive_max_attempt``."""
        _beater.forget(self)

    # ---------------------------------------------------------------- joining
    @_state_checked
    def next_rendezvous(self) -> Any:
        """Join the open round; block until it is sealed with this node in it (or raise).

        Critical path per node: ``compare_set`` (read ``open``), ``add`` (take a slot),
        ``multi_set`` (heartbeat + record), ``wait`` + ``get`` of its rank, ``get``/``set`` of the
        bootstrap address: 6 calls, O(1) bytes. The sealer adds 7 calls, 5 of them moving O(N) bytes, once
        per round.
        """
        from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

        cfg = self.config
        deadline = time.monotonic() + cfg.join_timeout
        self._attempt += 1
        previous = self.round
        rnd, prev_size = self._read_open()
        member = previous is not None and rnd == previous + 1
        spare = rnd > 0 and prev_size >= cfg.max_nodes and not member
        while True:
            v = int(self._call(self._store.add, self._k(rnd, "arrived"), 1 + (MEMBER if member else 0)))
            if v >= SEALED:  # sealed (or closed) between our read of `open` and our arrival
                if self.is_closed():
                    raise _closed_error(f"ctrl rendezvous '{cfg.run_id}' is closed", spare)
                # (a stale `open` hint, its sealer having died before advancing it, leads a
                # member of the last round here too: at the next round it is a member again)
                rnd += 1
                member = previous is not None and rnd == previous + 1
                prev_size = self._sealed_size(rnd - 1)
                spare, deadline = self._still_spare(spare, prev_size >= cfg.max_nodes and not member, deadline)
                continue
            slot = v & COUNT_MASK
            record = _Record(self._host, os.getpid(), self._local_id, self._attempt)
            self._call(
                self._store.multi_set,
                [self._hb_key, self._k(rnd, f"n/{slot}"), f"{self._root}/da/{self.node}"],
                [self._beat_value(), record.encode(), f"{cfg.dead_after:g}"],
            )
            _beater.watch(self)
            try:
                rank, world = self._wait_for_seat(rnd, slot, v, prev_size, spare, deadline)
                break
            except _Spare as exc:
                rnd += 1
                member = previous is not None and rnd == previous + 1
                prev_size = self._sealed_size(rnd - 1)
                # a node judged dead that was only slow waits behind a full round like a spare
                behind = (exc.full or prev_size >= cfg.max_nodes) and not member
                spare, deadline = self._still_spare(spare, behind, deadline)
        addr, port, server = self._bootstrap(rnd, rank)
        with turn():
            self._server = server  # the previous round's workers' store (if any) goes away
        self.round, self._rank, self._world_size = rnd, rank, world
        log.info(
            "torch_ctrl: node %s joined round %d of the ctrl rendezvous '%s' as rank %d of %d",
            self.node,
            rnd,
            cfg.run_id,
            rank,
            world,
        )
        with turn():
            store = dist.PrefixStore(f"torch.rendezvous.{cfg.run_id}.{rnd}", self._store)
        return RendezvousInfo(store, rank, world, RendezvousStoreInfo(addr, port))

    def _still_spare(self, was: bool, spare: bool, deadline: float) -> tuple[bool, float]:
        """A spare that stops being one (its round fell apart, or the round it waited behind is
        gone) gets a whole ``join_timeout`` from now, as c10d's spares moved to the wait list:
        it may have waited longer than that already, which a spare is allowed to."""
        return spare, (time.monotonic() + self.config.join_timeout if was and not spare else deadline)

    def _wait_for_seat(
        self, rnd: int, slot: int, v: int, prev_size: int, spare: bool, deadline: float
    ) -> tuple[int, int]:
        """Block on this slot's rank key; the node that completes the round seals it. Waiters wake
        every ``keep_alive_interval`` only to notice a closed run or a dead leader (O(1) calls)."""
        cfg = self.config
        key = self._k(rnd, f"rank/{slot}")
        due = self._maybe_seal(rnd, v, prev_size, lead=slot == 1)
        # A node that started the last call keeps its time (as the leader does): it looks again
        # when the last call ends, not at its next keep-alive wake.
        keeper = due is not None
        extended = False  # the deadline was moved once for a round being sealed
        self._lead_check = time.monotonic() + cfg.dead_after
        while True:
            now = time.monotonic()
            wake = now + cfg.keep_alive_interval
            if due is not None:
                wake = min(wake, due)
            if not spare:
                wake = min(wake, deadline)
            raw = self._blocking_get(key, max(wake - now, 0.001))
            if raw is not None:
                return self._seat(raw, spare)
            if self.is_closed():
                raise _closed_error(f"ctrl rendezvous '{cfg.run_id}' is closed", spare)
            lead = self._leader(rnd, slot)
            due = self._maybe_seal(rnd, None, prev_size, lead=lead, keeper=keeper) if lead or keeper else None
            keeper = keeper or (due is not None)
            if spare and self._call(self._store.check, [self._k(rnd, "freed")]):
                # the full round it waited behind is gone (c10d moves its spares to the wait list)
                spare, deadline = False, time.monotonic() + cfg.join_timeout
            if not spare and time.monotonic() >= deadline:
                if not extended and int(self._call(self._store.add, self._k(rnd, "arrived"), 0)) >= SEALED:
                    # Being sealed (or closed: the next wake says so): its outcome comes from the
                    # sealer, or from the leader taking over from one that died; waiting for it
                    # withdrawn would leave this node out of it. Once, as long as a take-over takes.
                    extended = True
                    deadline = time.monotonic() + cfg.dead_after + 2 * cfg.keep_alive_interval
                    continue
                return self._time_out(rnd, slot, prev_size, spare)

    def _seat(self, raw: bytes, spare: bool) -> tuple[int, int]:
        text = raw.decode()
        if text == CLOSED:
            raise _closed_error(f"ctrl rendezvous '{self.config.run_id}' is closed", spare)
        if text in (SPARE, DEAD):
            raise _Spare(full=text == SPARE)
        rank, world = text.split()
        return int(rank), int(world)

    # ---------------------------------------------------------------- sealing
    def _maybe_seal(self, rnd: int, v: int | None, prev_size: int, lead: bool, keeper: bool = False) -> float | None:
        """Seal round ``rnd`` if it is complete; returns when to look again (last call), if known
        to this node: the leader, and the node that started the last call (``keeper`` once it did).

        Complete: round ``rnd - 1`` is released (each of its members re-joined or is dead) and
        either ``max_nodes`` live nodes arrived, or ``min_nodes`` did and the last call ran out.
        Only the leader looks for dead members of the previous round (O(N) bytes, one node)."""
        cfg = self.config
        if v is None:
            v = int(self._call(self._store.add, self._k(rnd, "arrived"), 0))
        if v >= SEALED:
            if lead:
                self._take_over(rnd, v, prev_size)
            return None
        count, rejoined = v & COUNT_MASK, (v >> 24) & COUNT_MASK
        released = rnd == 0 or rejoined >= prev_size
        if not released and lead:
            dead = self._dead_members(rnd - 1)
            if dead and rejoined + len(dead) >= prev_size:
                # a member that re-joined and died since is in both counts: count it once
                back = {r.node for r in self._records(rnd, 1, count) if r is not None}
                released = rejoined + len(dead - back) >= prev_size
        if released and lead and rnd > 0 and count < cfg.min_nodes and self._freed != rnd:
            # The previous round is gone (its members dead or back) and this one cannot form yet:
            # its spares stop waiting behind a full round, and their join_timeout starts now.
            self._call(self._store.set, self._k(rnd, "freed"), "1")
            self._freed = rnd
        if not released or count < cfg.min_nodes:
            return None
        if count >= cfg.max_nodes and self._seal(rnd, prev_size, last_call_over=False, v0=v):
            return None  # the fast path: max_nodes live nodes, sealed at once
        # The first node to see the round sealable starts the last call; only it and the leader
        # keep time (everyone else just waits for its rank), so expiry costs O(1) sealers.
        mine = f"{time.time():.3f}"
        started = self._call(self._store.compare_set, self._k(rnd, "last_call"), "", mine).decode()
        if started != mine and not (lead or keeper):
            return None
        left = float(started) + cfg.last_call_timeout - time.time()
        if left > 0:
            return time.monotonic() + left
        self._seal(rnd, prev_size, last_call_over=True)
        return None

    def _seal(self, rnd: int, prev_size: int, last_call_over: bool, v0: int | None = None) -> bool:
        """Seal round ``rnd``: check who is alive, close the arrival counter (the first closer
        is the only sealer), rank the members by node id and write every slot's outcome, the
        members and the size in one ``multi_set``. Returns whether this node sealed it."""
        cfg = self.config
        store = self._store
        if v0 is None:
            v0 = int(self._call(store.add, self._k(rnd, "arrived"), 0))
        if v0 >= SEALED:
            return False
        records = self._records(rnd, 1, v0 & COUNT_MASK)
        alive = self._alive(records)
        live = sum(alive)
        enough = live >= cfg.max_nodes or (live >= cfg.min_nodes and last_call_over)
        if not enough:
            return False
        v = int(self._call(store.add, self._k(rnd, "arrived"), SEALED))
        if v >= 2 * SEALED:
            return False  # another node is sealing (or the run was closed)
        count = v & COUNT_MASK
        if count > len(records):
            records += self._records(rnd, len(records) + 1, count)
        # Look again now that the round is closed: a node whose join_timeout ran out withdraws
        # (negative heartbeat), then reads the counter; if it found the round still open, its
        # withdrawal came before our add, so this read sees it, and it is not admitted behind
        # the error it raised. (One more multi_get, once per round.)
        self._publish(rnd, prev_size, records, self._alive(records))
        return True

    def _publish(self, rnd: int, prev_size: int, records: list[_Record | None], alive: list[bool]) -> None:
        """Decide round ``rnd``'s outcome from its slots' records and liveness, and write it.

        The outcome is decided by one ``compare_set`` of ``R/{r}/outcome``: the first writer wins,
        and whoever writes the slots' keys writes the winning outcome. So a node that takes over
        from a sealer that died while sealing (:meth:`_take_over`) and the sealer itself, should
        it only have been slow, can never hand out two different outcomes."""
        cfg = self.config
        count = len(records)
        live_slots = [k for k in range(count) if alive[k]]
        fell_apart = len(live_slots) < cfg.min_nodes
        if fell_apart:  # too few are left to form the round: all move on to the next one
            live_slots = []
        ordered = sorted(live_slots[: cfg.max_nodes], key=lambda k: records[k].order)  # type: ignore[union-attr]
        rank_of = {k: i for i, k in enumerate(ordered)}
        world = len(ordered)
        values = [
            f"{rank_of[k]} {world}" if k in rank_of else (SPARE if alive[k] and not fell_apart else DEAD)
            for k in range(count)
        ]
        members = [records[k].node for k in ordered]  # type: ignore[union-attr]
        mine = "\t".join(values) + "\n" + "\t".join(members)
        won = self._call(self._store.compare_set, self._k(rnd, "outcome"), "", mine).decode()
        if won != mine:  # another node decided it first: write that one
            slots, names = won.split("\n")
            values, members = slots.split("\t"), [n for n in names.split("\t") if n]
            world, fell_apart = len(members), not members
        keys = [self._k(rnd, f"rank/{k + 1}") for k in range(len(values))]
        keys += [self._k(rnd, "members"), self._k(rnd, "seal")] + ([self._k(rnd, "void")] if fell_apart else [])
        self._call(self._store.multi_set, keys, [*values, "\n".join(members), str(world)] + ["1"] * fell_apart)
        # advance the `open` hint unless the run was closed or a later round sealed meanwhile
        expected, desired = f"{rnd},{prev_size}", f"{rnd + 1},{world}"
        while True:
            got = self._call(self._store.compare_set, f"{self._root}/open", expected, desired).decode()
            if got in (desired, CLOSED_OPEN) or int(got.split(",")[0]) > rnd:
                break
            expected = got  # a stale hint (a sealer that died before advancing it): replace it
        if fell_apart:
            log.warning(
                "torch_ctrl: round %d of the ctrl rendezvous '%s' did not form: %d of its nodes were still alive "
                "when it closed (min_nodes=%d); they join the next round",
                rnd, cfg.run_id, sum(alive), cfg.min_nodes,
            )  # fmt: skip
        else:
            log.info("torch_ctrl: sealed round %d of the ctrl rendezvous '%s' with %d nodes", rnd, cfg.run_id, world)

    def _take_over(self, rnd: int, v: int, prev_size: int) -> None:
        """The leader's look at a round closed to arrivals whose outcome is not written: after
        ``dead_after`` seconds of that, its sealer died while sealing, and the leader seals it
        instead, from the records that exist (an arrival after the close writes none) and who
        is alive now. One ``check`` per wake while it waits; O(N) calls once if it takes over."""
        if self._call(self._store.check, [self._k(rnd, "seal")]) or self.is_closed():
            return
        now = time.monotonic()
        if self._unsealed_since is None or self._unsealed_since[0] != rnd:
            self._unsealed_since = (rnd, now)
            return
        if now - self._unsealed_since[1] < self.config.dead_after:
            return
        records: list[_Record | None] = []
        for k in range(1, (v & COUNT_MASK) + 1):
            key = self._k(rnd, f"n/{k}")
            present = self._call(self._store.check, [key])
            records.append(_Record.decode(bytes(self._call(self._store.get, key))) if present else None)
        log.warning(
            "torch_ctrl: round %d of the ctrl rendezvous '%s' has been closed to arrivals for %.0fs or more by a node "
            "that has not written its outcome (it died or stalled while sealing); node %s seals it",
            rnd, self.config.run_id, now - self._unsealed_since[1], self.node,
        )  # fmt: skip
        self._publish(rnd, prev_size, records, self._alive(records))

    def _records(self, rnd: int, first: int, last: int) -> list[_Record | None]:
        """Records of slots ``first..last`` (one ``multi_get``); a slot whose node died between
        taking it and writing its record reads as None (after the read timeout, per key)."""
        if last < first:
            return []
        keys = [self._k(rnd, f"n/{k}") for k in range(first, last + 1)]
        try:
            return [_Record.decode(bytes(raw)) for raw in self._call(self._store.multi_get, keys)]
        except _errors().RendezvousConnectionError:
            out: list[_Record | None] = []
            for key in keys:
                ok = self._call(self._store.check, [key])
                out.append(_Record.decode(bytes(self._call(self._store.get, key))) if ok else None)
            return out

    def _alive(self, records: Sequence[_Record | None], recent: bool = False) -> list[bool]:
        """Whether each slot's node heartbeats, for the attempt that took the slot (one
        ``multi_get``); with ``recent``, also nodes that withdrew within ``dead_after`` (e.g.
        that timed out together with this one)."""
        present = [r for r in records if r is not None]
        if not present:
            return [False] * len(records)
        beats = self._call(self._store.multi_get, [f"{self._root}/hb/{r.node}" for r in present])
        now, limit = time.time(), self.config.dead_after
        fresh = {}  # per (node, attempt): a node that timed out and came back holds two slots
        for r, raw in zip(present, beats):
            t, attempt = bytes(raw).decode().split()
            when = abs(float(t)) if recent else float(t)
            fresh[r.node, r.attempt] = when > 0 and now - when <= limit and int(attempt) == r.attempt
        return [r is not None and fresh[r.node, r.attempt] for r in records]

    def _dead_members(self, rnd: int) -> set[str]:
        """The members of sealed round ``rnd`` that have stopped heartbeating (the leader's slow path)."""
        raw = self._call(self._store.compare_set, self._k(rnd, "members"), "\x01", "\x02")
        if raw == b"\x01" or not raw:
            return set()
        nodes = raw.decode().split("\n")
        beats = self._call(self._store.multi_get, [f"{self._root}/hb/{n}" for n in nodes])
        now, limit = time.time(), self.config.dead_after
        return {n for n, b in zip(nodes, beats) if now - float(bytes(b).decode().split()[0]) > limit}

    def _leader(self, rnd: int, slot: int) -> bool:
        """Whether this node leads round ``rnd`` (watches timers and dead nodes). Slot 1 leads;
        every ``dead_after`` seconds the others check the leader's heartbeat and, if it stopped,
        one of them takes over with ``compare_set`` (2-3 calls per node per period)."""
        raw = self._call(self._store.compare_set, self._k(rnd, "lead"), "\x01", "\x02")
        lead = 1 if raw == b"\x01" else int(raw)
        if lead == slot:
            return True
        now = time.monotonic()
        if now < self._lead_check:
            return False
        self._lead_check = now + self.config.dead_after
        record = self._records(rnd, lead, lead)[0]
        if record is not None and self._alive([record])[0]:
            return False
        expected = "" if raw == b"\x01" else raw.decode()
        got = self._call(self._store.compare_set, self._k(rnd, "lead"), expected, str(slot))
        return bytes(got).decode() == str(slot)

    # ---------------------------------------------------------------- timeouts
    def _time_out(self, rnd: int, slot: int, prev_size: int, spare: bool) -> tuple[int, int]:
        """Withdraw (heartbeat time 0), unless a sealer already closed the round (then take its
        verdict); raise ``RendezvousTimeoutError`` naming who joined."""
        cfg = self.config
        _beater.forget(self)
        if self._beats is not self._store:
            # A beat sent on the heartbeats' connection just before is applied once this
            # answers (the server serves a connection in order): the withdrawal comes after it.
            self._call(self._beats.check, [self._hb_key])
        self._call(self._store.set, self._hb_key, self._withdrawn())
        v = int(self._call(self._store.add, self._k(rnd, "arrived"), 0))
        count, rejoined = v & COUNT_MASK, (v >> 24) & COUNT_MASK
        if v >= SEALED:  # a sealer read our heartbeat before we withdrew: its verdict stands
            raw = self._blocking_get(self._k(rnd, f"rank/{slot}"), cfg.read_timeout)
            if raw is None:  # closed to arrivals, but the outcome never came
                raise _errors().RendezvousTimeoutError(
                    f"ctrl rendezvous '{cfg.run_id}' round {rnd}: a node began sealing the round but did not "
                    f"write its outcome within read_timeout={cfg.read_timeout:g}s (its agent died while "
                    f"sealing); {count} nodes had arrived"
                )
            try:
                seat = self._seat(raw, spare)
                _beater.watch(self)
                return seat
            except _Spare:
                pass
        records = self._records(rnd, 1, count)
        joined = self._alive(records, recent=True)
        hosts = [f"{r.host}:{r.pid}" for r, a in zip(records, joined) if r is not None and (a or r.node == self.node)]
        named = ", ".join(hosts[:16]) + (f" and {len(hosts) - 16} more" if len(hosts) > 16 else "")
        waiting = ""
        if rnd > 0 and rejoined < prev_size:
            waiting = f"; {prev_size - rejoined} of the {prev_size} nodes of round {rnd - 1} never re-joined"
        raise _errors().RendezvousTimeoutError(
            f"ctrl rendezvous '{cfg.run_id}' round {rnd}: {len(hosts)} of min_nodes={cfg.min_nodes} "
            f"(max_nodes={cfg.max_nodes}) nodes joined within join_timeout={cfg.join_timeout:g}s "
            f"(hosts: {named or 'none'}){waiting}"
        )

    # ---------------------------------------------------------------- bootstrap
    def _bootstrap(self, rnd: int, rank: int) -> tuple[str, int, dist.Store | None]:
        """Node 0 of the round hosts a fresh workers' store (or picks a free port when workers
        host it themselves) and publishes its address in the round's namespace; the others
        read it: no earlier round's address or keys can ever be seen."""
        key = self._k(rnd, "boot")
        server = None
        if rank == 0:
            addr = self._host
            if self.use_agent_store:
                with turn():
                    server = dist.TCPStore(addr, 0, is_master=True, multi_tenant=True, wait_for_workers=False)
                port = int(server.port)
            else:
                port = _free_port()
            self._call(self._store.set, key, f"{addr}\n{port}")
            return addr, port, server
        try:
            raw = bytes(self._store.get(key))  # node 0 writes it right after the seal: one call
        except Exception as exc:  # noqa: BLE001 - node 0 died between the seal and its write
            if not _is_timeout(exc):
                raise self._store_error(exc) from None
            raise _errors().RendezvousTimeoutError(
                f"ctrl rendezvous '{self.config.run_id}' round {rnd}: node 0 did not publish the bootstrap "
                f"store address within read_timeout={self.config.read_timeout:g}s"
            ) from None
        addr, _, port = raw.decode().rpartition("\n")
        return addr, int(port), None

    # ---------------------------------------------------------------- store helpers
    _open_round_hint = 0

    def _read_open_raw(self, store: Any = None) -> str:
        store = self._store if store is None else store
        raw = self._call(store.compare_set, f"{self._root}/open", "", "0,0").decode()
        if raw != CLOSED_OPEN:
            self._open_round_hint = int(raw.split(",")[0])
        return raw

    def _read_open(self) -> tuple[int, int]:
        raw = self._read_open_raw()
        if raw == CLOSED_OPEN:
            raise _closed_error(f"ctrl rendezvous '{self.config.run_id}' is closed", False)
        rnd, size = raw.split(",")
        return int(rnd), int(size)

    def _sealed_size(self, rnd: int) -> int:
        """Size of sealed round ``rnd`` (0 if it was closed rather than sealed)."""
        if rnd < 0:
            return 0
        raw = self._blocking_get(self._k(rnd, "seal"), self.config.read_timeout)
        return int(raw) if raw is not None else 0

    def _blocking_get(self, key: str, seconds: float) -> bytes | None:
        """``get`` that waits at most ``seconds``; None on timeout (``wait`` + ``get``)."""
        store = self._store
        td = timedelta(seconds=seconds)
        try:
            # wait() then get(): a TCPStore get() that times out logs two warnings per wake
            store.wait([key], td)
            return bytes(store.get(key))
        except Exception as exc:  # noqa: BLE001 - a timeout is expected; anything else is a lost store
            if _is_timeout(exc):
                return None
            raise self._store_error(exc) from None

    def _store_error(self, exc: Exception) -> Exception:
        return _connection_error(exc, self.config.run_id, self._address)

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - one line, as a RendezvousConnectionError
            if isinstance(exc, _errors().RendezvousError):
                raise
            raise self._store_error(exc) from None


CLOSED_OPEN = "closed"


def _is_timeout(exc: Exception) -> bool:
    text = str(exc).lower()
    return isinstance(exc, TimeoutError) or "timeout" in text or "timed out" in text


# How a lost store's error says its server is gone (shutdown() reads it back: nothing to close).
_GONE = " is gone: "

# What torch's TCPStore client says when its server is gone (closed, reset, refused, unreachable).
_LOST = ("reset by peer", "broken pipe", "got 0 bytes", "refused", "likely closed", "unreachable")


def _address_of(store: dist.Store) -> tuple[str, int] | None:
    """A TCPStore's host and port, None for other stores."""
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    return (host, port) if isinstance(host, str) and isinstance(port, int) else None


def _store_named(address: tuple[str, int] | None) -> str:
    """``the rendezvous store at HOST:PORT`` (an IPv6 host in brackets)."""
    if address is None:
        return "the rendezvous store"
    host, port = address
    return f"the rendezvous store at {f'[{host}]' if ':' in host else host}:{port}"


def _connection_error(exc: Exception, run_id: str, address: tuple[str, int] | None) -> Exception:
    """One line: the run, the store's address, torch's cause, and, when the store is gone, where
    to look (the agent that hosts it, on the endpoint's host by c10d's ``is_host`` rules)."""
    lines = str(exc).strip().splitlines()
    cause = lines[0] if lines else type(exc).__name__
    what = "the rendezvous store failed:"
    if address is not None:
        host, port = address
        what = _store_named(address)
        if any(s in cause.lower() for s in _LOST) and await_server(host, port, 0.5) is not None:
            what += f"{_GONE}the torchrun agent that hosts it, on {host}, exited or cannot be reached"
            cause = f"({cause})"
        elif any(s in cause.lower() for s in _LOST):
            # Its server still accepts connections: it dropped this one, as TCPStore's server
            # does on a request it cannot serve (an add to a value that is not a number).
            what += " dropped this node's connection, though its server is up (a value not written by torch_ctrl?):"
        else:
            what += " failed:"
    return _errors().RendezvousConnectionError(f"ctrl rendezvous '{run_id}': {what} {cause}")


def _free_port() -> int:
    try:
        from torch.distributed.elastic.utils.distributed import get_free_port

        return int(get_free_port())
    except ImportError:
        with socket.socket() as sock:
            sock.bind(("", 0))
            return int(sock.getsockname()[1])


def create_native_handler(params: Any) -> NativeRendezvousHandler:
    """The ``ctrl`` handler from torchrun's ``RendezvousParameters``: validates every option
    (one-line ``ValueError`` before anything is written), then connects (hosting the store
    when ``is_host``, c10d's rules), retrying until ``join_timeout``."""
    config = config_from(params)
    store, host, port = connect(params, config)
    beats = beat_store(host, port, config.read_timeout)
    handler = NativeRendezvousHandler(config, store, beats)
    return handler
