"""``PyStoreCollectives``: the pure-Python implementation of the protocol.

``csrc/store_collectives.cpp`` implements the same protocol with the same
structure and names; ``docs/protocol.md`` is the contract both follow. Read the
two side by side.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn, TypeVar

import torch.distributed as dist

from . import exit_gate, reaper
from . import keys as K
from .base import (
    DEFAULT_TIMEOUT,
    ControlCollectives,
    Data,
    Timeout,
    abort_unreachable,
    check_block,
    check_heartbeat,
    check_init,
    check_key,
    check_reachable,
    check_reason,
    closed,
    group_of,
    not_picklable,
    opened,
    spread_abort,
    to_bytes,
    to_bytes_list,
    to_int64,
    to_seconds,
    unreachable,
)
from .errors import (
    UNREACHABLE,
    CollectiveError,
    aborted_error,
    collective_error,
    forked_error,
    key_reused_error,
    one_line,
    timeout_error,
)
from .exit_gate import gated
from .lanes import Borrowed, Lane, Lanes, connection_lost, lost_text
from .watcher import Watcher, leaving

log = logging.getLogger(__name__)

T = TypeVar("T")
# The ops that count arrivals with add: a store error there may be a counter it cannot add to.
COUNTED = ("barrier", "all_gather", "all_sum")
DIAGNOSTICS_CONNECT = 2.0  # seconds a new connection may take to name the missing ranks
# An op's new connection gets at least this long, even with (almost) no time left: a timeout
# of 0 still reads a result that is there, and a connection slower than a millisecond is no
# sign of a server that is gone (see _lane).
MIN_CONNECT = 0.1
# A return from TCPStore's barrier with less time left than this is taken for the deadline
# (several waiters that time out together may return normally): the counter is then read
# quietly and trusted over the return.
AT_DEADLINE = 0.05
# After an early release from TCPStore's barrier every rank released polls the counter (see
# _until_counted), pausing from 1 ms, doubling, up to POLL_CAP; in a large group up to
# world / POLL_BUDGET seconds (at most POLL_CAP_MAX), so that the group's polls together stay
# near POLL_BUDGET per second (each a check and a get) instead of growing with the world size.
POLL_CAP = 0.05
POLL_CAP_MAX = 0.5
POLL_BUDGET = 4000.0


def poll_cap(world: int) -> float:
    """The longest pause between a released rank's polls of its barrier's counter, in seconds."""
    return min(POLL_CAP_MAX, max(POLL_CAP, world / POLL_BUDGET))


@dataclass
class _Op:
    """One collective call: its name, the user's key, its key prefix and deadline."""

    name: str
    label: str
    prefix: str
    seconds: float
    deadline: float

    def key(self, name: str) -> str:
        return K.field(self.prefix, name)

    def left(self) -> float:
        return self.deadline - time.monotonic()


class PyStoreCollectives(ControlCollectives):
    """Store-backed collectives, pure Python. Thread safe; see ``docs/protocol.md``.

    Args:
        store: any ``torch.distributed.Store`` (TCPStore, PrefixStore, FileStore, HashStore,
            a Python subclass); every rank passes its own client of the same store.
        rank: this rank, in ``[0, world_size)``.
        world_size: the number of ranks of the group (>= 1).
        heartbeat_interval: keyword-only; ``None`` (default) or a ``timedelta``/seconds:
            beat every interval, so that blocked peers detect this rank's death within
            5 intervals.

    Raises:
        TypeError: ``store`` is not a ``torch.distributed.Store``, or ``rank``/``world_size``
            are not ints.
        ValueError: ``rank`` out of range, ``world_size < 1``, or an interval outside
            0.01-3600 s.

    Example::

        store = dist.TCPStore("127.0.0.1", 29500, is_master=(rank == 0))
        with torch_ctrl.PyStoreCollectives(store, rank, world_size, heartbeat_interval=1.0) as coll:
            total = coll.all_sum("work", rank + 1, timeout=30)
    """

    @gated
    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        *,
        heartbeat_interval: Timeout | None = None,
    ) -> None:
        self._rank, self._world = check_init(store, rank, world_size)
        heartbeat = check_heartbeat(heartbeat_interval)
        self._owner = os.getpid()  # a forked child must not use the parent's lanes and thread
        self._store = store
        check_reachable(store, self._rank, self._world)
        try:
            self._lanes = Lanes(store)
        except Exception as exc:
            raise unreachable(exc, store, self._rank, self._world) from None
        self._group_id = group_of(store, self._world, self._lanes.prefix)
        self._lock = threading.Lock()
        self._seq = 0
        self._used: set[str] = set()
        self._watcher = Watcher(self._lanes, self._rank, self._world, heartbeat)
        # One read at construction: a group aborted earlier fails every op at once.
        try:
            with self._lanes.lane() as lane:
                notice = lane.peek(self._watcher.abort_key)
                if heartbeat is not None:
                    lane.add(K.group_key(self._world, f"hb/{self._rank}"), K.first_beat(heartbeat))
        except Exception as exc:
            self._watcher.close(0.0)  # its heartbeats must not outlive a failed constructor
            raise unreachable(exc, store, self._rank, self._world) from None
        if notice is not None:
            self._watcher.aborted(notice)
        opened(self)
        spread_abort(self, notice)

    # ------------------------------------------------------------------ public
    @property
    def rank(self) -> int:
        """This instance's rank."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks in the group."""
        return self._world

    @gated
    def barrier(self, key: str | None = None, timeout: Timeout = DEFAULT_TIMEOUT, block: bool = True) -> None:
        self._check_process("barrier")
        user_key, seconds, block = check_key(key), to_seconds(timeout), check_block(block)
        op = self._begin("barrier", user_key, seconds)
        if self._world == 1:
            return
        with self._lane(op) as lane:
            if block:
                if lane.native_barrier:
                    self._check_counter(op, self._meet(op, lane))
                    if self._rank == 0:
                        self._delete_later([op.key(K.BARRIER)])
                else:
                    self._arrive(op, lane)
                    self._exit_later(op, self._world, [K.ARRIVE, K.DONE])
                return
            try:  # a non-blocking arrival's store errors are the op's one line too, as a send's
                count = lane.add(op.key(K.counter(lane.native_barrier)), 1)
                if not lane.native_barrier and count == self._world:
                    lane.set(op.key(K.DONE), K.TAG_DATA)
            except Exception as exc:
                raise self._failure(op, exc) from None  # the lane is dropped as this leaves
            if lane.native_barrier:
                if count == self._world or self._rank == 0:
                    self._delete_when_full(op)
                return
            self._exit_later(op, self._world, [K.ARRIVE, K.DONE])

    @gated
    def broadcast_send(
        self, key: str | None = None, data: Data | None = None, timeout: Timeout = DEFAULT_TIMEOUT
    ) -> None:
        self._check_process("broadcast_send")
        user_key, payload, seconds = check_key(key), to_bytes(data), to_seconds(timeout)
        op = self._begin("broadcast_send", user_key, seconds)
        if self._world == 1:
            return
        self._send(op, lambda lane: self._put(lane, op.key(K.DONE), payload))

    @gated
    def broadcast_recv(self, key: str | None = None, timeout: Timeout = DEFAULT_TIMEOUT) -> bytes:
        self._check_process("broadcast_recv")
        op = self._begin("broadcast_recv", check_key(key), to_seconds(timeout))
        done = op.key(K.DONE)
        with self._lane(op) as lane:
            value, chunks = self._read(op, lane, done)
        self._exit_later(op, self._world - 1, [K.DONE], chunks)
        return value

    @gated
    def gather_send(self, key: str | None = None, data: Data | None = None, timeout: Timeout = DEFAULT_TIMEOUT) -> None:
        self._check_process("gather_send")
        user_key, payload, seconds = check_key(key), to_bytes(data), to_seconds(timeout)
        op = self._begin("gather_send", user_key, seconds)
        if self._world == 1:  # the only rank is the root: nobody would ever read the slot
            return
        self._send(op, lambda lane: self._put(lane, K.rank_slot(op.prefix, self._rank), payload))

    @gated
    def gather_recv(
        self, key: str | None = None, data: Data | None = None, timeout: Timeout = DEFAULT_TIMEOUT
    ) -> list[bytes]:
        self._check_process("gather_recv")
        user_key, payload, seconds = check_key(key), to_bytes(data), to_seconds(timeout)
        op = self._begin("gather_recv", user_key, seconds)
        slots = K.rank_slots(op.prefix, self._world, self._rank)
        values: list[bytes] = []
        if slots:
            with self._lane(op) as lane:
                values, chunks = self._read_many(op, lane, slots)
            self._delete_later(slots + chunks)
        values.insert(self._rank, payload)
        return values

    @gated
    def scatter_send(
        self, key: str | None = None, data: Sequence[Data] | None = None, timeout: Timeout = DEFAULT_TIMEOUT
    ) -> bytes:
        self._check_process("scatter_send")
        user_key, payloads, seconds = check_key(key), to_bytes_list(data, self._world), to_seconds(timeout)
        op = self._begin("scatter_send", user_key, seconds)
        others = [r for r in range(self._world) if r != self._rank]
        if others:
            slots = [K.rank_slot(op.prefix, r) for r in others]

            def write(lane: Lane) -> None:
                lane.multi_set(slots, [self._stage(lane, slot, payloads[r]) for slot, r in zip(slots, others)])

            self._send(op, write)
        return payloads[self._rank]

    @gated
    def scatter_recv(self, key: str | None = None, timeout: Timeout = DEFAULT_TIMEOUT) -> bytes:
        self._check_process("scatter_recv")
        op = self._begin("scatter_recv", check_key(key), to_seconds(timeout))
        slot = K.rank_slot(op.prefix, self._rank)
        with self._lane(op) as lane:
            value, chunks = self._read(op, lane, slot)
        self._delete_later([slot, *chunks])
        return value

    @gated
    def all_gather(
        self, key: str | None = None, data: Data | None = None, timeout: Timeout = DEFAULT_TIMEOUT
    ) -> list[bytes]:
        self._check_process("all_gather")
        user_key, payload, seconds = check_key(key), to_bytes(data), to_seconds(timeout)
        op = self._begin("all_gather", user_key, seconds)
        if self._world == 1:
            return [payload]
        entries = self._exchange(op, payload)
        return [entries[r] for r in range(self._world)]

    @gated
    def all_sum(self, key: str | None = None, data: int | None = None, timeout: Timeout = DEFAULT_TIMEOUT) -> int:
        self._check_process("all_sum")
        user_key, value, seconds = check_key(key), to_int64(data), to_seconds(timeout)
        op = self._begin("all_sum", user_key, seconds)
        if self._world == 1:
            return value
        if not self._lanes.native_barrier:
            return self._sum_counted(op, value)
        entries = self._exchange(op, b"%d" % value)

        def bad() -> Exception:
            return collective_error(op.name, op.label, f"{op.key(K.LOG)}: {K.BAD_VALUE}")

        # A decimal int64 each, as the C++ twin reads it (int() would take b"+7", b" 7", b"1_0").
        return K.wrap_int64(sum(K.parse_total(v, bad) for v in entries.values()))

    @gated
    def abort(self, reason: str = "") -> None:
        """Mark the group (every instance on this store namespace and world size) as failed by
        this rank. Peers blocked in any collective raise ``CollectiveAbortedError`` within a
        second; later collectives raise it at once. Idempotent: the first reason wins."""
        reason = check_reason(reason)  # a str, cut to MAX_REASON_BYTES like the C++ twin's
        self._check_process("abort")
        mine = b"%d:%s" % (self._rank, reason.encode("utf-8", "replace"))
        try:
            # A new connection is bounded as long (see reaper.opened).
            lane = self._lanes.acquire(reaper.ABORT_WAIT)
            with Borrowed(self._lanes, lane, time.monotonic() + reaper.ABORT_WAIT) as lane:
                try:
                    notice = lane.claim(self._watcher.abort_key, mine)
                except Exception:
                    if reaper.fired():  # twin: StoreCollectives::abort
                        within = reaper.ABORT_WAIT + reaper.GRACE
                        raise dist.DistNetworkError(reaper.no_answer(self._lanes.server, within)) from None
                    raise
        except Exception as exc:
            raise abort_unreachable(exc, self._store) from None
        self._watcher.aborted(notice)
        spread_abort(self, notice)

    def _learn_abort(self, notice: bytes) -> None:
        """Another instance of this group in this process learned of the group's abort (see
        base.spread_abort): fail every later op at once and wake blocked callers."""
        if os.getpid() == self._owner:  # a forked child's copy: the parent's thread and locks
            self._watcher.aborted(notice)

    def close(self, flush_timeout: Timeout = 5.0) -> None:
        """Finish background cleanup (up to ``flush_timeout``, a ``timedelta`` or seconds) and
        release connections; calls still running on other threads go on (see
        :meth:`torch_ctrl.ControlCollectives.close`).

        Example::

            coll.close(flush_timeout=1.0)
        """
        seconds = to_seconds(flush_timeout, "flush_timeout")  # before anything is stopped
        if os.getpid() != self._owner:
            return  # a forked child: the connections and thread are the parent's (its locks may be held)
        closed(self)
        self._watcher.close(seconds)
        self._lanes.close()

    def __del__(self) -> None:
        watcher = getattr(self, "_watcher", None)
        if watcher is not None and os.getpid() == getattr(self, "_owner", None):
            watcher.close(0.0)  # the thread drains its queue on its own

    def __reduce__(self) -> NoReturn:
        not_picklable(type(self).__name__)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self._rank}, world_size={self._world})"

    # ----------------------------------------------------------------- internals
    def _begin(self, name: str, user_key: str | None, seconds: float) -> _Op:
        """Reserve the key (checked by the caller, with the other arguments, in the order of
        the method's parameters, as the C++ twin checks them) and make the op's prefix."""
        if self._watcher.notice is not None:
            label = user_key if user_key is not None else "#next"
            self._raise_abort(_Op(name, label, "", seconds, 0.0), self._watcher.notice)
        with self._lock:
            if user_key is None:
                seq, self._seq = self._seq, self._seq + 1
            else:
                if user_key in self._used:
                    raise key_reused_error(name, user_key)
                self._used.add(user_key)
                seq = -1
        label = user_key if user_key is not None else f"#{seq}"
        prefix = K.op_prefix(self._world, user_key, seq)
        return _Op(name, label, prefix, seconds, time.monotonic() + seconds)

    def _check_process(self, name: str) -> None:
        if os.getpid() != self._owner:
            raise forked_error(name, self._owner, os.getpid())

    def _lane(self, op: _Op) -> Borrowed:
        """``with self._lane(op) as lane``: borrow a lane for ``op`` (dropped, not reused, after
        an error); failing to open one (store gone) is a one-line CollectiveError, or the op's
        CollectiveTimeoutError when it had too little time left to tell."""
        # Half the time left: torch's connect loop may wait up to its timeout once more before
        # it gives up, and the op must still end by its deadline.
        budget = op.left() / 2
        try:
            return Borrowed(self._lanes, self._lanes.acquire(max(budget, MIN_CONNECT)), op.deadline)
        except Exception as exc:
            text = one_line(str(exc))
            if budget < MIN_CONNECT:
                # Too little time to tell a slow connection from a server that is gone: the op
                # ran out of time, which is what it reports.
                detail = f"no new connection to the store opened in the time left ({text})"
                raise timeout_error(op.name, op.label, op.seconds, self._world, detail=detail) from None
            raise collective_error(op.name, op.label, f"{UNREACHABLE}{text}") from None

    def _sum_counted(self, op: _Op, value: int) -> int:
        """all_sum on the generic path: O(1) store work per rank. Add to one running total,
        then arrive at the add/done barrier, whose last arriver reads the total and publishes
        it in the done flag: 3 calls per rank (``add``, ``add``, ``get``), 4 for the last."""
        total_key = op.key(K.SUM)
        with self._lane(op) as lane:
            try:
                lane.add(total_key, value)
            except Exception as exc:
                raise self._failure(op, exc) from None
            done = self._arrive(op, lane, lambda: b"%d" % K.wrap_int64(lane.add(total_key, 0)))
        self._exit_later(op, self._world, [K.ARRIVE, K.SUM, K.DONE])
        return K.parse_total(done, lambda: collective_error(op.name, op.label, f"{op.key(K.DONE)}: {K.BAD_VALUE}"))

    def _wake_native(self, op: _Op, counter: str) -> Callable[[Lane, bytes], None]:
        """How the watcher releases a caller in TCPStore's server-side barrier on abort: raise
        the counter by ``ABORT_BIAS`` (after an abort frame in the op's log, if it has one)."""
        log_key = op.key(K.LOG) if op.name in ("all_gather", "all_sum") else None

        def wake(ln: Lane, notice: bytes) -> None:
            if log_key is not None:
                ln.append(log_key, K.frame(-1, notice))
            ln.add(counter, K.ABORT_BIAS)

        return wake

    def _meet(self, op: _Op, lane: Lane) -> bytes | None:
        """The barrier op on a TCPStore: the server-side barrier, then the counter (see
        ``_until_counted``), read in the same blocked scope. A return from the server's barrier
        proves nothing alone: the server wakes its waiters on any write to the counter (a
        ``block=False`` arrival, or any ``compare_set`` of it). A rank released so must not leave
        the scope as if the op had completed: that deletes the NAMES log the others read to name
        the missing ranks."""
        counter = op.key(K.BARRIER)
        try:
            with self._watcher.blocked(op.key(K.NAMES), op.seconds, self._wake_native(op, counter)):
                lane.barrier(counter, self._world, op.left())
                return self._until_counted(op, lane)
        except Exception as exc:
            raise self._failure(op, exc) from None

    def _arrive(self, op: _Op, lane: Lane, publish: Callable[[], bytes] | None = None) -> bytes:
        """Arrive at the op's barrier and wait for every rank (native or add/done). On the
        add/done barrier the last arriver writes ``publish()`` (or nothing) as the done flag's
        payload, and every rank returns that payload."""
        counter = op.key(K.counter(lane.native_barrier))
        try:
            if lane.native_barrier:
                with self._watcher.blocked(op.key(K.NAMES), op.seconds, self._wake_native(op, counter)):
                    lane.barrier(counter, self._world, op.left())
                    if op.left() < AT_DEADLINE:
                        # TCPStore's native barrier can return normally when several waiters
                        # time out together: trust the counter, not the return (and raise
                        # while still blocked, so this rank's NAMES entry stays for the others).
                        # Read quietly: a compare_set would release ranks with later deadlines.
                        value = lane.peek_quietly(counter)
                        if value is not None and self._decode(op, counter, K.parse_counter, value) < self._world:
                            raise TimeoutError("barrier timeout")
                return b""
            count = lane.add(counter, 1)
            if count > self._world:
                detail = f"{count} arrivals in a group of {self._world}: {K.COLLISION}"
                raise collective_error(op.name, op.label, detail)
            if count == self._world:
                payload = publish() if publish is not None else b""
                lane.set(op.key(K.DONE), K.TAG_DATA + payload)
                return payload
            with self._watcher.blocked(op.key(K.NAMES), op.seconds, self._wake_set([op.key(K.DONE)])):
                done = lane.get(op.key(K.DONE), op.left())
        except Exception as exc:
            raise self._failure(op, exc) from None
        return self._untag(op, lane, op.key(K.DONE), done)[0]

    def _exchange(self, op: _Op, payload: bytes) -> dict[int, bytes]:
        """all_gather/all_sum: every rank's payload, by rank.

        On a TCPStore: append a frame to one log, meet at the server-side barrier,
        read the log once (O(N) server work). Elsewhere: one slot per rank and one
        multi_get of all slots (the fewest calls on stores without a native barrier).
        """
        if not self._lanes.native_barrier:
            return self._exchange_slots(op, payload)
        log_key = op.key(K.LOG)
        entries: dict[int, bytes] = {}
        garbage: list[str] = []
        with self._lane(op) as lane:
            lane.append(log_key, K.frame(self._rank, self._stage(lane, K.frame_key(log_key, self._rank), payload)))
            self._arrive(op, lane)
            log = lane.peek(log_key) or b""
            for rank, head in self._decode(op, log_key, K.parse_frames, log, self._world):
                if rank < 0:
                    self._raise_abort(op, head)
                if head[:1] == K.TAG_DATA:  # the common case: no chunk key to build
                    entries[rank] = head[1:]
                    continue
                entries[rank], used = self._untag(op, lane, K.frame_key(log_key, rank), head)
                garbage += used
        # Every rank has arrived (the counter reads N): its exits take it to 2N.
        self._exit_later(op, 2 * self._world, [K.LOG], garbage, counter=K.BARRIER)
        if len(entries) != self._world:
            raise collective_error(
                op.name,
                op.label,
                f"expected {self._world} entries, found ranks {sorted(entries)} (is the key used by another group?)",
            )
        return entries

    def _stage(self, lane: Lane, key: str, payload: bytes) -> bytes:
        """Write the chunks of ``payload`` (if any) and return the tagged value to store at ``key``."""
        head, chunks = K.pack(key, payload)
        for chunk_key, chunk in chunks:
            lane.set(chunk_key, chunk)
        return head

    def _put(self, lane: Lane, key: str, payload: bytes) -> None:
        """Write a tagged value: its chunks first (if any), then the value itself."""
        lane.set(key, self._stage(lane, key, payload))

    def _send(self, op: _Op, write: Callable[[Lane], None]) -> None:
        """The writes of a send (broadcast_send, gather_send, scatter_send) on a lane of its
        own: a store error is the op's one-line CollectiveError (or timeout), as in every other op."""
        with self._lane(op) as lane:
            try:
                write(lane)
            except Exception as exc:
                raise self._failure(op, exc) from None  # the lane is dropped as this leaves

    def _exchange_slots(self, op: _Op, payload: bytes) -> dict[int, bytes]:
        slots = K.rank_slots(op.prefix, self._world)
        with self._lane(op) as lane:
            try:
                self._put(lane, slots[self._rank], payload)
            except Exception as exc:
                raise self._failure(op, exc) from None
            values, chunks = self._read_many(op, lane, slots)
        # The slot keys are rebuilt by the rank that deletes them (the C++ twin saves N copies so).
        self._exit_later(op, self._world, [], chunks, slots=True)
        return dict(enumerate(values))

    def _read(self, op: _Op, lane: Lane, key: str) -> tuple[bytes, list[str]]:
        """Blocking read of one tagged value: ``(payload, chunk keys to delete)``."""
        try:
            with self._watcher.blocked(op.key(K.NAMES), op.seconds, self._wake_set([key])):
                value = lane.get(key, op.left())
        except Exception as exc:
            raise self._failure(op, exc) from None
        return self._untag(op, lane, key, value)

    def _read_many(self, op: _Op, lane: Lane, keys: list[str]) -> tuple[list[bytes], list[str]]:
        """Blocking read of several tagged values: ``(payloads, chunk keys to delete)``."""
        try:
            with self._watcher.blocked(op.key(K.NAMES), op.seconds, self._wake_set(keys)):
                heads = lane.multi_get(keys, op.left())
        except Exception as exc:
            raise self._failure(op, exc) from None
        values: list[bytes] = []
        chunks: list[str] = []
        for key, head in zip(keys, heads):
            value, used = self._untag(op, lane, key, head)
            values.append(value)
            chunks += used
        return values, chunks

    def _untag(self, op: _Op, lane: Lane, key: str, value: bytes) -> tuple[bytes, list[str]]:
        """Decode a tagged value read from ``key``: ``(payload, chunk keys)``; raise on abort."""
        if value[:1] == K.TAG_DATA:
            return value[1:], []
        if value[:1] == K.TAG_CHUNKS:
            names = [K.chunk_key(key, i) for i in range(self._decode(op, key, K.chunk_count, value))]
            # Chunks are written before the value that names them: one missing now never comes,
            # and the value was not written by torch_ctrl. One check says so at once, where
            # waiting for the chunks would hold the caller until its deadline (twin: untag).
            # One chunk per read: a reply of several 4 MiB chunks breaks the connection on some
            # torch releases' TCPStore servers (torch 2.7: "Broken pipe" at 16 MiB).
            try:
                there = bool(lane.store.check(names))
                parts = [lane.multi_get([name], max(op.left(), 1.0))[0] for name in names] if there else []
            except Exception as exc:
                if connection_lost(exc) or self._watcher.notice is not None:
                    raise self._failure(op, exc) from None
                there = False
            if not there:
                raise collective_error(op.name, op.label, f"{key}: {K.BAD_VALUE}")
            return self._decode(op, key, K.join_chunks, parts), names
        if value[:1] == K.TAG_ABORT:
            self._raise_abort(op, value[1:])
        raise collective_error(op.name, op.label, f"{key}: {K.BAD_VALUE}")

    @staticmethod
    def _decode(op: _Op, key: str, decoder: Callable[..., T], *args: object) -> T:
        """``decoder(*args)`` on what was read from ``key``; a value torch_ctrl could not have
        written there is a one-line CollectiveError naming the key and what was wrong."""
        try:
            return decoder(*args)
        except K.DecodeError as exc:
            raise collective_error(op.name, op.label, f"{key}: {exc}") from None

    @staticmethod
    def _wake_set(keys: list[str]) -> Callable[[Lane, bytes], None]:
        """How the watcher releases a caller blocked reading ``keys``: write the abort notice there."""

        def wake(lane: Lane, notice: bytes) -> None:
            lane.multi_set(keys, [K.TAG_ABORT + notice] * len(keys))

        return wake

    def _until_counted(self, op: _Op, lane: Lane) -> bytes | None:
        """The barrier counter once every rank has arrived (or an abort raised it); called
        while blocked, after the server-side barrier returned.

        TCPStore wakes native-barrier waiters on any write to the counter, ``compare_set``
        included: a rank arriving with ``block=False`` (a plain ``add``) releases them early.
        Then poll the counter until the count is complete, the group is aborted, or the
        deadline passes. Polls read it quietly, and so does the first read at the deadline: a
        ``compare_set`` would release the ranks still waiting, and they would poll too (a
        storm of requests at scale). The pauses grow to ``poll_cap(world)``: in a large group,
        every rank released polls.
        """
        key = op.key(K.BARRIER)
        counter = lane.peek(key) if op.left() >= AT_DEADLINE else lane.peek_quietly(key)
        pause, cap = 0.001, poll_cap(self._world)
        while counter is not None and self._decode(op, key, K.parse_counter, counter) < self._world:
            if self._watcher.notice is not None:
                self._raise_abort(op, self._watcher.notice)
            if op.left() <= 0:
                raise TimeoutError("barrier timeout")
            exit_gate.checkpoint()  # the process exits: park here, between two calls into torch
            self._watcher.pause(min(pause, op.left()))  # an abort ends the pause
            exit_gate.checkpoint()
            pause = min(pause * 2, cap)
            counter = lane.peek_quietly(key)
        return counter

    def _check_counter(self, op: _Op, counter: bytes | None) -> None:
        """After a server-side barrier: an abort raised the counter, or more ranks than the
        group arrived (another group on the same keys: it would pass without waiting)."""
        if counter is None:
            return  # rank 0 deleted it: every rank had arrived
        count = self._decode(op, op.key(K.BARRIER), K.parse_counter, counter)
        if count >= K.ABORT_BIAS:
            with self._lanes.lane() as lane:
                notice = lane.peek(self._watcher.abort_key)
            self._raise_abort(op, notice or self._watcher.notice or b"-1:")
        if count > self._world:
            detail = f"{count} arrivals in a group of {self._world}: {K.COLLISION}"
            raise collective_error(op.name, op.label, detail)

    def _aborted(self, op: _Op, notice: bytes) -> Exception:
        """The CollectiveAbortedError for ``notice`` (``b"{rank}:{reason}"``); remembers the abort."""
        self._watcher.aborted(notice)
        spread_abort(self, notice)
        rank, reason = K.parse_notice(notice)
        return aborted_error(op.name, op.label, rank, reason)

    def _raise_abort(self, op: _Op, notice: bytes) -> NoReturn:
        raise self._aborted(op, notice)

    # -------------------------------------------------------------- diagnostics
    def _failure(self, op: _Op, exc: BaseException) -> Exception:
        """Turn a store exception into a one-line CollectiveTimeoutError or CollectiveError."""
        if isinstance(exc, CollectiveError):
            return exc  # already says what happened (e.g. a value torch_ctrl could not have written)
        if self._watcher.notice is not None:
            return self._aborted(op, self._watcher.notice)
        if reaper.fired():  # the server held a call GRACE seconds past the deadline
            return collective_error(op.name, op.label, UNREACHABLE + reaper.no_answer(self._lanes.server))
        text = self._store_text(exc)
        in_time = time.monotonic() < op.deadline - 0.01 and "timeout" not in text.lower()
        if in_time and op.name in COUNTED:
            bad = self._bad_counter(op)
            if bad is not None:  # the store refused to add to it (a TCPStore server drops the connection)
                return collective_error(op.name, op.label, f"{bad}: {K.BAD_VALUE}")
        if connection_lost(exc):
            return collective_error(op.name, op.label, UNREACHABLE + lost_text(self._lanes.server, text))
        if in_time:
            return collective_error(op.name, op.label, f"store error: {text}")
        if op.name.endswith("_send"):  # a send waits for nobody: nothing to count or name
            detail = f"the store did not take the value ({text})"
            return timeout_error(op.name, op.label, op.seconds, self._world, detail=detail)
        try:  # at the deadline: a new connection for the diagnostics gets a budget of its own
            lane = self._lanes.acquire(DIAGNOSTICS_CONNECT)
            with Borrowed(self._lanes, lane, time.monotonic() + DIAGNOSTICS_CONNECT) as lane:
                return self._timeout(op, lane)
        except Exception as diag_exc:  # noqa: BLE001 - diagnostics must not hide the timeout
            detail = f"who arrived could not be read ({self._store_text(diag_exc)})"
            return timeout_error(op.name, op.label, op.seconds, self._world, detail=detail)

    def _bad_counter(self, op: _Op) -> str | None:
        """After a store error in a counting op: the first of its counters that holds something
        other than a decimal int64 (the store cannot add to it), or None. One read per counter
        on a new connection (the failed one may be gone); None when that fails too."""
        keys = [op.key(K.counter(self._lanes.native_barrier))]
        if op.name == "all_sum" and not self._lanes.native_barrier:
            keys.append(op.key(K.SUM))
        try:
            # within the op's deadline: a host that went down must not hold the error past it
            with Borrowed(self._lanes, self._lanes.acquire(min(DIAGNOSTICS_CONNECT, op.left())), op.deadline) as lane:
                for key in keys:
                    value = lane.peek(key)
                    if value is not None and K.counter_value(value) is None:
                        return key
        except Exception:  # noqa: BLE001 - the store error is the one to report then
            pass
        return None

    def _store_text(self, exc: BaseException) -> str:
        """A store call's error as one line. An exception of a Python-written store carries its
        type, as the C++ twin reads it (through torch's binding: "ValueError: bad value"); a
        value torch_ctrl could not have written (DecodeError) is its message alone, in both."""
        text = one_line(str(exc))
        if self._lanes.python and not isinstance(exc, (K.DecodeError, CollectiveError)):
            text = f"{type(exc).__name__}: {text}"
        return text

    def _timeout(self, op: _Op, lane: Lane) -> Exception:
        """Count who arrived (O(1) store reads) and name the missing ranks."""
        # The store's key names, read at most once however many checks below need them.
        names: Callable[[], list[str] | None] = functools.cache(lane.list_keys)
        if op.name in ("broadcast_recv", "scatter_recv"):
            sizes = self._other_world_sizes(op, names) if self._rank <= 1 else ""  # the lowest receiver
            detail = "; ".join(filter(None, ["nothing was sent", sizes]))
            return timeout_error(op.name, op.label, op.seconds, self._world, detail=detail)
        arrived: int | None = None  # the barrier's counter, where there is one
        if op.name == "gather_recv" or (op.name == "all_gather" and not lane.native_barrier):
            present = self._present_slots(op, lane, names)
        elif op.name in ("all_gather", "all_sum") and lane.native_barrier:
            present = {r for r, _ in K.parse_frames(lane.peek(op.key(K.LOG)) or b"", self._world) if r >= 0}
        else:  # barrier
            lane.append(op.key(K.NAMES), b"%d," % self._rank)
            # Each rank appends at most twice (past the grace period, at its timeout).
            log = lane.peek_log(op.key(K.NAMES), 2 * self._world)
            present = K.parse_names(log or b"", self._world)
            # Quietly: ranks with later deadlines may still be in TCPStore's barrier on it.
            counter = lane.peek_quietly(op.key(K.counter(lane.native_barrier)))
            arrived = K.parse_counter(counter) if counter is not None else len(present)
        present.add(self._rank)
        missing = [r for r in range(self._world) if r not in present]
        other_path = K.OTHER_PATH if self._other_path(op, lane, names) else ""
        lister = op.name == "gather_recv" or min(present) == self._rank  # a gather's root waits alone
        sizes = self._other_world_sizes(op, names) if lister else ""
        detail = "; ".join(filter(None, [other_path, sizes]))
        count = len(present) if arrived is None else min(arrived, self._world)
        return timeout_error(op.name, op.label, op.seconds, self._world, count, missing, detail)

    def _other_path(self, op: _Op, lane: Lane, names: Callable[[], list[str] | None]) -> bool:
        """Ranks on a torch without TCPStore.barrier take the generic path where this one takes
        the TCPStore path (or the reverse): their keys, not this path's, show that they came."""
        if not self._lanes.tcp or op.name == "gather_recv":
            return False  # only a TCPStore has two paths, and gather has one
        if not lane.native_barrier:
            return lane.store.check([op.key(K.BARRIER)])
        if op.name == "all_gather":
            return bool(self._present_slots(op, lane, names))
        return lane.store.check([op.key(K.ARRIVE)])

    def _other_world_sizes(self, op: _Op, names: Callable[[], list[str] | None]) -> str:
        """Name the world sizes of ranks that used this op's key in a group of another size (a
        rank given the wrong world_size waits in a group of its own): one ``list_keys``, where
        the store has it; nothing elsewhere. Called by one rank per group and op (the lowest
        that arrived; the lowest receiver), so that a timeout on thousands of ranks does not
        send the store's whole key list to each of them."""
        sizes = K.other_world_sizes(names() or [], self._world, op.prefix.rsplit("/", 1)[1])
        return K.OTHER_WORLD_SIZES.format(sizes=", ".join(map(str, sizes))) if sizes else ""

    def _present_slots(self, op: _Op, lane: Lane, names: Callable[[], list[str] | None]) -> set[int]:
        """Ranks whose gather slot exists: from the store's key names, or one check per rank
        where the store cannot list them."""
        prefix = op.prefix + "/r"
        listed = names()
        if listed is not None:
            found = set()
            for name in listed:
                tail = name[name.find(prefix) + len(prefix) :] if prefix in name else ""
                if tail.isascii() and tail.isdigit() and len(tail) <= 19 and int(tail) < self._world:
                    found.add(int(tail))
            return found
        return {r for r in range(self._world) if r != self._rank and lane.store.check([K.rank_slot(op.prefix, r)])}

    # ------------------------------------------------------------------ cleanup
    def _cleanup(self, task: Callable[[Lane], None]) -> None:
        """An op's cleanup: handed to the watcher, or made at once on an in-process store."""
        if not self._lanes.local:
            self._watcher.submit(task)  # a round trip or a file lock each: off the critical path
            return
        # A HashStore's calls never wait: handing them to the watcher thread (a wake-up, a
        # lock shared with it) would cost the caller more than the calls (docs/benchmarks.md).
        lane = self._lanes.acquire()
        try:
            task(lane)
        except Exception as exc:  # noqa: BLE001 - best effort, as on the watcher
            log.debug("torch_ctrl cleanup failed: %s", exc)
        else:
            self._lanes.release(lane)

    def _delete_later(self, keys: list[str]) -> None:
        if not self._lanes.deletes:  # a store whose keys stay (see lanes.store_api)
            return

        def task(lane: Lane) -> None:
            for key in keys:
                lane.delete(key)

        self._cleanup(task)

    def _exit_later(
        self,
        op: _Op,
        expected: int,
        fields: list[str],
        extra: Sequence[str] = (),
        counter: str = K.EXIT,
        slots: bool = False,
    ) -> None:
        """Count this rank out on ``counter``; the rank that brings it to ``expected`` deletes the
        op's keys, and every rank's slot if ``slots`` (NAMES logs are deleted by the ranks that
        wrote them, see Watcher.blocked)."""
        if not self._lanes.deletes:  # nothing to delete: no exit count either
            return
        keys = [op.key(f) for f in fields] + list(extra)
        if expected == 1:  # the only participant (a broadcast's one receiver): nothing to count
            self._delete_later(keys)
            return
        exit_key = op.key(counter)
        keys.append(exit_key)
        prefix, world = op.prefix, self._world

        def task(lane: Lane) -> None:
            # At or past ABORT_BIAS the op was aborted: its keys stay (like a timed-out op's).
            if expected <= lane.add(exit_key, 1) < K.ABORT_BIAS:
                for key in (K.rank_slots(prefix, world) if slots else []) + keys:
                    lane.delete(key)

        self._cleanup(task)

    def _delete_when_full(self, op: _Op) -> None:
        """Non-blocking arrival at a native barrier: delete the counter once everyone arrived."""
        counter, deadline = op.key(K.BARRIER), op.deadline
        world = self._world
        pause = 0.01

        def check(lane: Lane) -> float | None:
            # One look per run: between runs the watcher beats, polls and cleans (Watcher.retry).
            nonlocal pause
            value = lane.peek_quietly(counter)  # the blocking ranks wait on it in the server
            if value is None or K.parse_counter(value) >= world:  # garbage: DecodeError ends the task
                lane.delete(counter)
                return None
            if time.monotonic() > deadline or leaving():  # at exit the counter stays
                return None
            wait, pause = pause, min(pause * 2, 1.0)
            return wait

        self._watcher.retry(check)
