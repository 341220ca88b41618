"""Bad input fails before any store traffic; timeouts are one-line, typed, and name missing ranks."""

from __future__ import annotations

import copy
import pickle
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch.distributed as dist
from helpers import HOST, CppStoreCollectives, DictStore, Gate, Stores, make, run_ranks

import torch_ctrl
from torch_ctrl import CollectiveTimeoutError, KeyReusedError
from torch_ctrl import keys as K


def test_timeout_error_is_dist_store_error() -> None:
    assert issubclass(CollectiveTimeoutError, dist.DistStoreError)
    assert issubclass(torch_ctrl.CollectiveAbortedError, dist.DistStoreError)
    assert issubclass(KeyReusedError, ValueError) and issubclass(KeyReusedError, RuntimeError)


@pytest.mark.parametrize(
    "args, exc",
    [
        ((0, 0), ValueError),
        ((2, 2), ValueError),
        ((-1, 2), ValueError),
        (("0", 2), TypeError),
        ((0, 2.0), TypeError),
        ((True, 2), TypeError),
    ],
)
def test_bad_construction(impl: str, args: tuple, exc: type) -> None:
    store = dist.HashStore()
    with pytest.raises(exc):
        make(impl, store, *args)


def test_store_must_be_a_store(impl: str) -> None:
    with pytest.raises(TypeError, match="torch.distributed.Store"):
        make(impl, {"not": "a store"}, 0, 2)  # type: ignore[arg-type]


@pytest.mark.parametrize("copier", [pickle.dumps, copy.deepcopy, copy.copy])
def test_an_instance_does_not_pickle_and_says_what_to_send(impl: str, copier: Callable) -> None:
    # what multiprocessing and mp.spawn do with an instance passed as an argument
    stores = Stores("tcp")
    coll = make(impl, stores.client(0), 0, 1)
    with pytest.raises(TypeError, match=r"^cannot pickle a \w+StoreCollectives: .*store's address") as info:
        copier(coll)
    _one_line(info.value)
    assert coll.all_sum("still-usable", 3) == 3
    coll.close()


BAD_CALLS = [
    ("barrier", dict(key=b"bytes-key")),
    ("barrier", dict(key="k", timeout=-1)),
    ("barrier", dict(key="k", timeout="1s")),
    ("barrier", dict(key="k", timeout=timedelta(seconds=-1))),
    ("barrier", dict(key="k", block="no")),  # a truthy str would block
    ("barrier", dict(key="k", block=[False])),
    ("broadcast_send", dict(key="k", data=123)),
    ("broadcast_send", dict(key="k")),
    ("gather_send", dict(key="k", data=["x"])),
    ("gather_recv", dict(key="k", data=None)),
    ("scatter_send", dict(key="k", data=[b"a"])),
    ("scatter_send", dict(key="k", data=b"ab")),
    ("scatter_send", dict(key="k", data=[b"a", 1])),
    ("all_gather", dict(key="k", data=1.5)),
    ("all_sum", dict(key="k", data=1.5)),
    ("all_sum", dict(key="k", data="3")),
    ("all_sum", dict(key="k", data=1 << 63)),
    ("all_sum", dict(key="k")),
]


@pytest.mark.parametrize("method, kwargs", BAD_CALLS)
def test_bad_input_before_store_traffic(impl: str, method: str, kwargs: dict) -> None:
    store = DictStore()
    coll = make(impl, store, 0, 2)
    with pytest.raises((TypeError, ValueError)):
        getattr(coll, method)(**kwargs)
    assert store.num_keys() == 0
    coll.close()


def test_block_takes_bools_and_integers_and_says_what_else_it_got(impl: str) -> None:
    """As torch's class: an int is a bool (0 arrives without waiting); a str is refused, in
    one message shared by both implementations."""
    coll = make(impl, DictStore(), 0, 2)
    coll.barrier("arrive-only", block=0)  # returns at once: rank 1 never comes
    with pytest.raises(TypeError, match="^block must be a bool, got str$"):
        coll.barrier("refused", block="no")
    coll.close()


def test_key_reuse_rejected_before_store_traffic(impl: str) -> None:
    store = DictStore()
    coll = make(impl, store, 0, 1)
    coll.barrier("once")
    with pytest.raises(KeyReusedError, match="has already been used"):
        coll.all_gather("once", b"x")
    with pytest.raises(RuntimeError, match="has already been used"):
        coll.barrier("once")
    coll.close()
    assert store.num_keys() == 0


def test_bad_input_does_not_burn_the_key(impl: str) -> None:
    stores = Stores("hash")

    def fn(rank):
        coll = make(impl, stores.client(rank), rank, 2)
        if rank == 0:
            with pytest.raises(TypeError):
                coll.broadcast_send("k", 42)  # type: ignore[arg-type]
            coll.broadcast_send("k", b"fine", 10)
            return b"fine"
        return coll.broadcast_recv("k", 10)

    assert run_ranks(2, fn) == [b"fine", b"fine"]


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text, text
    assert "Exception raised from" not in text and "frame #" not in text
    return text


def test_barrier_timeout_names_missing_ranks(impl: str, stores: Stores) -> None:
    world = 4

    def fn(rank):
        if rank in (0, 2, 3):
            return None  # never arrive
        coll = make(impl, stores.client(rank), rank, world)
        start = time.monotonic()
        with pytest.raises(CollectiveTimeoutError) as info:
            coll.barrier("lonely", timedelta(seconds=1))
        took = time.monotonic() - start
        coll.close()
        return info.value, took

    exc, took = run_ranks(world, fn)[1]
    text = _one_line(exc)
    assert took < 5
    assert "barrier" in text and "'lonely'" in text
    assert "1/4 ranks arrived" in text
    assert "missing ranks: [0, 2, 3]" in text
    assert exc.missing == [0, 2, 3] and exc.arrived == 1 and exc.world_size == 4


def test_barrier_timeout_several_present(impl: str) -> None:
    stores, world = Stores("tcp"), 5

    def fn(rank):
        if rank == 3:
            return None
        coll = make(impl, stores.client(rank), rank, world)
        with pytest.raises(CollectiveTimeoutError) as info:
            # 4 s: each rank names itself from its watcher's own connection, opened on first
            # use; a reverse DNS stall on this machine can hold that connect for a second or two.
            coll.barrier("b", 4.0)
        coll.close()
        return str(info.value)

    out = run_ranks(world, fn)
    for rank in (0, 1, 2, 4):
        assert "4/5 ranks arrived; missing ranks: [3]" in out[rank], out[rank]


@pytest.mark.parametrize("kind", ["tcp", "prefix"])
def test_barrier_timeout_names_ranks_with_later_deadlines(impl: str, kind: str) -> None:
    """Ranks 0-2 time out first and read the barrier's counter while rank 4 is still inside
    TCPStore's barrier with 2 s left. Rank 4 must keep waiting, and must not delete the NAMES
    log the others are reading (when their compare_set read woke it, it did, as if the barrier
    had completed: their errors then named ranks that were there as missing)."""
    stores, world = Stores(kind), 5

    def fn(rank):
        if rank == 3:
            return None
        coll = make(impl, stores.client(rank), rank, world)
        seconds = 5.0 if rank == 4 else 3.0  # 3 s: see test_barrier_timeout_several_present
        start = time.monotonic()
        with pytest.raises(CollectiveTimeoutError) as info:
            coll.barrier("b", seconds)
        elapsed = time.monotonic() - start
        coll.close()
        return str(info.value), elapsed

    out = run_ranks(world, fn)
    for rank in (0, 1, 2, 4):
        text, elapsed = out[rank]
        assert "4/5 ranks arrived; missing ranks: [3]" in text, (rank, text)
    assert out[4][1] >= 4.9, "rank 4 left the barrier before its own deadline"


@pytest.mark.parametrize("kind", ["tcp", "prefix"])
@pytest.mark.parametrize("op", ["all_gather", "all_sum"])
def test_a_rank_with_a_later_deadline_times_out_as_a_timeout(impl: str, op: str, kind: str) -> None:
    """Ranks 0 and 1 give up after 1 s, rank 2 after 2.5 s, rank 3 never comes. What the first
    two do as they time out (counting arrivals, naming the missing) must leave rank 2 waiting
    until its own deadline, and its error must be the timeout, naming rank 3."""
    stores, world = Stores(kind), 4

    def fn(rank):
        if rank == 3:
            return None
        coll = make(impl, stores.client(rank), rank, world)
        seconds = 2.5 if rank == 2 else 1.0
        start = time.monotonic()
        with pytest.raises(CollectiveTimeoutError) as info:
            coll.all_gather("k", b"x", seconds) if op == "all_gather" else coll.all_sum("k", 1, seconds)
        elapsed = time.monotonic() - start
        coll.close()
        return str(info.value), elapsed

    text, elapsed = run_ranks(world, fn)[2]
    assert elapsed >= 2.4, (elapsed, text)
    assert "3/4 ranks arrived; missing ranks: [3]" in text, text


@pytest.mark.parametrize("kind", ["tcp", "prefix"])
@pytest.mark.parametrize("op", ["barrier", "all_gather"])
def test_a_timeout_does_not_release_ranks_still_waiting(impl: str, op: str, kind: str) -> None:
    """Ranks 0 and 1 time out after 1 s and count arrivals. A third party waits in TCPStore's
    own barrier on the op's counter (as a rank with a later deadline does): nothing they do
    may release it before its own timeout. A compare_set read of the counter did (the server
    takes it for a write), and released ranks then polled until their own deadlines."""
    stores, world = Stores(kind), 4
    if not hasattr(dist.TCPStore, "barrier"):
        pytest.skip("no server-side barrier before torch 2.12: nothing to release")
    # The counter's name on the server (the prefix kind's PrefixStore puts "job/" before it).
    counter = ("job/" if kind == "prefix" else "") + K.field(K.op_prefix(world, "k", -1), K.BARRIER)

    def fn(rank):
        if rank == 2:  # the third party: one arrival, waiting 2.5 s
            waiter = dist.TCPStore(HOST, stores.port, is_master=False, timeout=timedelta(seconds=2.5))
            start = time.monotonic()
            with pytest.raises(dist.DistStoreError):
                waiter.barrier(counter, world)
            return time.monotonic() - start
        if rank == 3:
            return None
        coll = make(impl, stores.client(rank), rank, world)
        with pytest.raises(CollectiveTimeoutError):
            getattr(coll, op)("k", b"x", 1.0) if op == "all_gather" else coll.barrier("k", 1.0)
        coll.close()
        return None

    assert run_ranks(world, fn)[2] >= 2.4


@pytest.mark.parametrize("kind", ["tcp", "prefix"])
@pytest.mark.parametrize("op", ["barrier", "all_gather"])
def test_a_slow_server_still_counts_arrivals(impl: str, op: str, kind: str) -> None:
    """Rank 0 reaches the server through a gate that holds every answer 0.4 s, longer than the
    quiet read of the op's counter waits for its get (QUIET_WAIT, 0.25 s). As it times out, its
    count of arrivals falls back to a plain read: it names rank 2 as the one missing, as rank
    1 does, and reports no other failure. Rank 0 names itself about 1.5 s after rank 1 (its
    constructor and arrival go through the gate too); the 6 s timeout leaves rank 1 room for a
    stalled connection of rank 0's watcher before it reads the names (at 4 s, one such stall on a
    loaded machine left rank 0 counted but not yet named)."""
    from torch_ctrl import lanes

    assert lanes.QUIET_WAIT < 0.4
    stores, world = Stores(kind), 3
    gate = Gate(stores.port)
    try:
        gate.slow(0.4)

        def fn(rank):
            if rank == 2:
                return None
            coll = make(impl, stores.client(rank, gate.port if rank == 0 else None), rank, world)
            with pytest.raises(CollectiveTimeoutError) as info:
                coll.barrier("k", 6.0) if op == "barrier" else coll.all_gather("k", b"x", 6.0)
            coll.close()
            return str(info.value)

        out = run_ranks(world, fn)
    finally:
        gate.close()
    for rank in (0, 1):
        assert "2/3 ranks arrived; missing ranks: [2]" in out[rank], (rank, out[rank])


class _ReleasedEarly:
    """Rank 0 waits in barrier ``"k"`` (``seconds``, expecting the error ``expected``), its
    connections through a gate; once it is in TCPStore's barrier, rank 1 arrives with
    ``block=False`` (a plain add), which releases it early, and it polls the counter. The
    gate's count starts just before rank 1's arrival. ``out`` gets rank 0's
    ``(time, error text)``."""

    def __init__(self, impl: str, kind: str, world: int, seconds: float, expected: type) -> None:
        if not hasattr(dist.TCPStore, "barrier"):
            pytest.skip("no server-side barrier before torch 2.12: no early release")
        self.stores, self.world = Stores(kind), world
        self.counter = ("job/" if kind == "prefix" else "") + K.field(K.op_prefix(world, "k", -1), K.BARRIER)
        self.gate = Gate(self.stores.port)
        try:
            self._start(impl, world, seconds, expected)
        except BaseException:
            self.gate.close()
            raise

    def _start(self, impl: str, world: int, seconds: float, expected: type) -> None:
        self.waiting = make(impl, self.stores.client(0, self.gate.port), 0, world)
        self.arriving = make(impl, self.stores.client(1), 1, world)
        self.out: list = []

        def blocked() -> None:
            with pytest.raises(expected) as info:
                self.waiting.barrier("k", seconds)
            self.out.append((time.monotonic(), str(info.value)))

        self.thread = threading.Thread(target=blocked, daemon=True)
        self.thread.start()
        while not self.stores.server.check([self.counter]):  # rank 0 is in the server's barrier
            time.sleep(0.001)
        self.gate.count()
        self.arriving.barrier("k", seconds, block=False)  # releases rank 0 early

    def requests_at_least(self, n: int) -> None:
        """Until rank 0 has sent ``n`` requests since it was released."""
        seen = 0
        while seen < n:
            seen += self.gate.count()
            time.sleep(0.001)

    def end(self) -> str:
        """Rank 0's error, once it has returned; the instances and the gate closed."""
        try:
            self.thread.join(30)
            for coll in (self.waiting, self.arriving):
                coll.close()
        finally:
            self.gate.close()
        return self.out[0][1]


@pytest.mark.parametrize("kind", ["tcp", "prefix"])
def test_ranks_released_early_poll_less_in_a_large_group(impl: str, kind: str) -> None:
    """In a group of 4000, rank 0 released early polls the counter until its deadline; in a
    group this large every rank released would, so its pauses grow to 0.5 s (poll_cap), not
    50 ms: about 15 polls in 3 s where it made about 65. Counted at the gate: its requests to
    the server from the release on, polls and the timeout's report together."""
    from torch_ctrl import store_collectives

    assert store_collectives.poll_cap(4000) == 0.5 and store_collectives.poll_cap(8) == 0.05
    early = _ReleasedEarly(impl, kind, 4000, 3.0, CollectiveTimeoutError)
    early.thread.join(30)
    requests = early.gate.count()
    text = early.end()
    assert "2/4000 ranks arrived" in text, text
    assert requests < 100, requests  # 56 on torch 2.13; with 50 ms pauses, over 200


@pytest.mark.parametrize("kind", ["tcp", "prefix"])
def test_polls_after_an_early_release_do_not_release_others(impl: str, kind: str) -> None:
    """Rank 0, released early, polls the counter until its deadline (5 s). Once it has begun,
    a third party enters TCPStore's own barrier on the counter for 2 s. Rank 0's polls must
    leave it there: a compare_set poll would release it at once."""
    early = _ReleasedEarly(impl, kind, 4, 5.0, CollectiveTimeoutError)
    third = dist.TCPStore(HOST, early.stores.port, is_master=False, timeout=timedelta(seconds=2))
    early.requests_at_least(4)  # its first read of the counter, and a quiet poll (check, wait, get)
    start = time.monotonic()
    try:
        third.barrier(early.counter, early.world)
        released = True  # returned without its 4 arrivals: a poll woke it
    except dist.DistStoreError:
        released = False
    held = time.monotonic() - start
    text = early.end()
    assert "timed out after 5s" in text, text
    assert not released and held >= 1.9, f"the third party was released after {held:.2f} s"


@pytest.mark.parametrize("kind", ["tcp", "prefix"])
def test_an_abort_ends_the_pause_between_polls(impl: str, kind: str) -> None:
    """Rank 0 of a group of 4000, released early, polls the counter with pauses grown to
    0.5 s. An abort (here from another thread, on its own instance) must end the pause at
    once, not when it runs out."""
    early = _ReleasedEarly(impl, kind, 4000, 60.0, torch_ctrl.CollectiveAbortedError)
    early.requests_at_least(36)  # about 12 polls (check, wait, get): the pauses have grown to 0.5 s
    aborted_at = time.monotonic()
    early.waiting.abort("stop")
    text = early.end()
    assert "group aborted by rank 0: stop" in text, text
    took = early.out[0][0] - aborted_at
    assert took < 0.2, took  # a pause of up to 0.5 s ran out before


def test_missing_ranks_list_is_capped(impl: str) -> None:
    stores, world = Stores("hash"), 40
    coll = make(impl, stores.client(0), 0, world)
    with pytest.raises(CollectiveTimeoutError) as info:
        coll.all_gather("ag", b"x", 0.2)
    text = str(info.value)
    assert "missing ranks: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16] and 23 more" in text
    assert "1/40 ranks arrived" in text
    coll.close()


@pytest.mark.parametrize("op", ["all_gather", "all_sum", "gather_recv"])
def test_participant_ops_name_missing_ranks(impl: str, stores: Stores, op: str) -> None:
    world = 4

    def fn(rank):
        coll = make(impl, stores.client(rank), rank, world)
        try:
            if rank == 1:
                return None
            if op == "gather_recv":
                if rank == 0:
                    with pytest.raises(CollectiveTimeoutError) as info:
                        coll.gather_recv("k", b"me", 1.5)
                    return str(info.value)
                coll.gather_send("k", b"x", 1.5)
                return None
            with pytest.raises(CollectiveTimeoutError) as info:
                if op == "all_gather":
                    coll.all_gather("k", b"x", 1.5)
                else:
                    coll.all_sum("k", 1, 1.5)
            return str(info.value)
        finally:
            coll.close()

    out = run_ranks(world, fn)
    text = out[0]
    assert text.startswith(f"{op} 'k' timed out after 1.5s"), text
    assert "3/4 ranks arrived; missing ranks: [1]" in text
    _one_line(Exception(text))


@pytest.mark.parametrize("op", ["broadcast_recv", "scatter_recv"])
def test_rooted_receive_timeout_says_nothing_sent(impl: str, op: str) -> None:
    stores = Stores("tcp")
    coll = make(impl, stores.client(1), 1, 2)
    with pytest.raises(CollectiveTimeoutError) as info:
        getattr(coll, op)("never", 0.3)
    text = _one_line(info.value)
    assert text == f"{op} 'never' timed out after 0.3s: nothing was sent"
    coll.close()


@pytest.mark.parametrize("op", ["barrier", "all_gather", "all_sum", "gather", "broadcast"])
@pytest.mark.parametrize("kind", ["tcp", "prefix", "hash", "file", "prefix_file", "listing", "prefix_listing"])
def test_a_rank_given_another_world_size_is_named(impl: str, kind: str, op: str) -> None:
    """A rank given the wrong world_size waits in a group of its own: the timeout says which
    world sizes used the op's key, instead of only calling the rank missing. A Python-written
    store that defines list_keys is listed on every torch, also under a PrefixStore (which
    cannot pass list_keys on to it), by both implementations."""
    if "listing" not in kind and not torch_ctrl.capabilities.LIST_KEYS:
        pytest.skip("this torch's stores cannot list keys")
    stores = Stores(kind)
    try:
        stores.admin.list_keys()
    except RuntimeError:
        pytest.skip(f"this torch's {kind} store cannot list keys")
    worlds = [2, 3]  # rank 0 is told the group has 2 ranks, rank 1 that it has 3

    def body(rank: int) -> str | None:
        coll = make(impl, stores.client(rank), rank, worlds[rank])
        try:
            if op == "gather" and rank == 1:
                return coll.gather_send("ws", b"v", timeout=1.0)  # returns: a send waits for nobody
            if op == "broadcast" and rank == 0:
                return coll.broadcast_send("ws", b"v", timeout=1.0)
            with pytest.raises(CollectiveTimeoutError) as info:
                if op == "barrier":
                    coll.barrier("ws", timeout=1.0)
                elif op == "all_gather":
                    coll.all_gather("ws", b"v", timeout=1.0)
                elif op == "all_sum":
                    coll.all_sum("ws", 1, timeout=1.0)
                elif op == "gather":
                    coll.gather_recv("ws", b"v", timeout=1.0)
                else:
                    coll.broadcast_recv("ws", timeout=1.0)
            return _one_line(info.value)
        finally:
            coll.close()

    texts = run_ranks(2, body)
    hint = K.OTHER_WORLD_SIZES.replace("{sizes}", "{}")
    if op in ("barrier", "all_gather", "all_sum"):
        assert texts[0].endswith("missing ranks: [1]; " + hint.format(3)), texts[0]
        assert texts[1].endswith("missing ranks: [0, 2]; " + hint.format(2)), texts[1]
    elif op == "gather":
        assert texts[0].endswith("1/2 ranks arrived; missing ranks: [1]; " + hint.format(3)), texts[0]
    else:
        assert texts[1] == "broadcast_recv 'ws' timed out after 1s: nothing was sent; " + hint.format(2)
    if "listing" in kind:
        assert stores._shared.listed > 0  # listed through the Python store's own method


@pytest.mark.skipif(not torch_ctrl.capabilities.LIST_KEYS, reason="this torch's stores cannot list keys")
def test_a_gather_root_names_a_sender_given_another_world_size(impl: str) -> None:
    """The root (rank 2 of 3) waits alone, with rank 0's slot there: it lists the keys though
    it is not the lowest rank that arrived, and names the world size rank 1 was given."""
    stores = Stores("tcp")
    ranks, worlds = [2, 0, 1], [3, 3, 4]

    def body(i: int) -> str | None:
        coll = make(impl, stores.client(i), ranks[i], worlds[i])
        try:
            if i > 0:
                return coll.gather_send("wsg", b"v", timeout=1.0)
            with pytest.raises(CollectiveTimeoutError) as info:
                coll.gather_recv("wsg", b"v", timeout=1.0)
            return _one_line(info.value)
        finally:
            coll.close()

    text = run_ranks(3, body)[0]
    assert text.endswith("2/3 ranks arrived; missing ranks: [1]; " + K.OTHER_WORLD_SIZES.format(sizes="4")), text


@pytest.mark.skipif(not torch_ctrl.capabilities.LIST_KEYS, reason="this torch's stores cannot list keys")
def test_one_rank_per_group_lists_the_keys(impl: str) -> None:
    """Ranks 0 and 1 are told the group has 3 ranks, rank 2 that it has 4: the lowest rank that
    arrived in each group (0 and 2) lists the store's keys and names the other size; rank 1
    does not list them (thousands of ranks timing out must not each read the whole key list)."""
    stores = Stores("tcp")
    worlds = [3, 3, 4]

    def body(rank: int) -> str:
        coll = make(impl, stores.client(rank), rank, worlds[rank])
        try:
            with pytest.raises(CollectiveTimeoutError) as info:
                coll.barrier("ws3", timeout=1.0)
            return _one_line(info.value)
        finally:
            coll.close()

    texts = run_ranks(3, body)
    assert texts[0].endswith("2/3 ranks arrived; missing ranks: [2]; " + K.OTHER_WORLD_SIZES.format(sizes="4")), texts
    assert texts[1].endswith("2/3 ranks arrived; missing ranks: [2]"), texts
    assert texts[2].endswith("missing ranks: [0, 1, 3]; " + K.OTHER_WORLD_SIZES.format(sizes="3")), texts


@pytest.mark.skipif(not torch_ctrl.capabilities.tcpstore_path(True), reason="the generic path cannot tell")
@pytest.mark.parametrize("op", ["all_gather", "all_sum"])
@pytest.mark.parametrize("kind", ["tcp", "prefix"])
def test_two_processes_given_one_rank_are_told_so(impl: str, kind: str, op: str) -> None:
    """Two of three ranks were given rank 0: on the TCPStore path the op's log holds two frames
    of rank 0, and every rank's error says what may have happened."""
    stores = Stores(kind)

    def body(i: int) -> str:
        coll = make(impl, stores.client(i), 0 if i < 2 else 2, 3)  # rank 1 never comes
        try:
            with pytest.raises(torch_ctrl.CollectiveError) as info:
                if op == "all_gather":
                    coll.all_gather("dup", b"v", timeout=30)
                else:
                    coll.all_sum("dup", 1, timeout=30)
            return _one_line(info.value)
        finally:
            coll.close()

    for text in run_ranks(3, body):
        assert "two frames of rank 0" in text and "two processes were given the same rank" in text, text


def test_auto_key_label_in_errors(impl: str) -> None:
    stores = Stores("hash")
    coll = make(impl, stores.client(0), 0, 2)
    coll.barrier(block=False)
    with pytest.raises(CollectiveTimeoutError, match=r"barrier '#1' timed out"):
        coll.barrier(timeout=0.2)
    coll.close()


def test_store_error_is_one_line(impl: str) -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=2))
    coll = make(impl, client, 0, 2)
    coll.barrier("warm", block=False)
    del server  # the store goes away
    with pytest.raises(torch_ctrl.CollectiveError) as info:
        coll.broadcast_recv("gone", 5)
    _one_line(info.value)
    assert isinstance(info.value, dist.DistStoreError)


class _Interrupted(DictStore):
    """A Python-written store in which the user presses Ctrl-C (or a call runs sys.exit)."""

    def __init__(self, exc: type[BaseException]) -> None:
        super().__init__()
        self.exc = exc

    def add(self, key: str, value: int) -> int:
        raise self.exc()


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_an_interruption_in_a_python_store_reaches_the_caller_as_it_is(impl: str, exc: type) -> None:
    """Not a CollectiveError that an ``except CollectiveError`` would swallow: Ctrl-C stops."""
    store = _Interrupted(exc)
    coll = make(impl, store, 0, 2)
    with pytest.raises(exc):
        coll.barrier("k", timeout=5)  # the generic barrier's first call is an add
    coll.close(flush_timeout=0.5)


class _Index:
    """An int-like object (``operator.index`` accepts it), like numpy's integers."""

    def __index__(self) -> int:
        return 7


class _Key(str):
    pass


class _Bytes(bytes):
    """A bytes subclass (as NumPy's bytes_)."""


# (method, kwargs) on a group of one: each either returns or raises at once, without peers.
ARGUMENT_CALLS = [
    ("barrier", dict(key=_Key("sub"))),
    ("barrier", dict(key="k", timeout=5)),
    ("barrier", dict(key="k", timeout=2.5)),
    ("barrier", dict(key="k", timeout=-0.0)),
    ("barrier", dict(key="k", timeout=True)),
    ("barrier", dict(key="k", timeout=float("nan"))),
    ("barrier", dict(key="k", timeout=10**400)),
    ("barrier", dict(key="k", timeout=timedelta.max)),
    ("barrier", dict(key="k", timeout=timedelta(days=-1, seconds=5))),
    ("barrier", dict(key="k", block=0)),
    ("barrier", dict(key="k", block="")),
    ("barrier", dict(key=1)),
    ("barrier", dict(key="lone \udcff surrogate")),
    ("barrier", dict(key=_Key("lone \udcff surrogate"))),
    ("broadcast_send", dict(key="k", data=bytearray(b"ba"))),
    ("broadcast_send", dict(key="k", data=None, timeout="x")),
    ("gather_recv", dict(key="k", data=memoryview(b"mv"))),
    ("gather_recv", dict(key="k", data="é")),
    ("gather_recv", dict(key=b"k", data=b"x")),
    ("scatter_send", dict(key="k", data=(b"t",))),
    ("scatter_send", dict(key="k", data=[bytearray(b"l")])),
    ("scatter_send", dict(key="k", data=[b"a", b"b"])),
    ("scatter_send", dict(key="k", data=[None])),
    ("scatter_send", dict(key="k", data="s")),
    ("all_gather", dict(key="k", data="text")),
    ("all_gather", dict(key="k", data=[b"x"])),
    ("all_gather", dict(key="k", data=_Bytes(b"sub"))),  # returned as plain bytes by both
    ("all_sum", dict(key="k", data=_Index())),
    ("all_sum", dict(key="k", data=-(1 << 63))),
    ("all_sum", dict(key="k", data=True)),
    ("all_sum", dict(key="k", data=1 << 64)),
    ("all_sum", dict(key="k", data=2.0)),
]


def _outcome(impl: str, method: str, kwargs: dict) -> tuple:
    coll = make(impl, dist.HashStore(), 0, 1)
    try:
        out = getattr(coll, method)(**kwargs)
        return ("returned", out, [type(x) for x in out] if isinstance(out, list) else type(out))
    except Exception as exc:  # noqa: BLE001 - compared below
        return ("raised", type(exc), str(exc))
    finally:
        coll.close()


@pytest.mark.skipif(CppStoreCollectives is None, reason="C++ extension not built")
@pytest.mark.parametrize("method, kwargs", ARGUMENT_CALLS)
def test_arguments_convert_alike_in_both_implementations(method: str, kwargs: dict) -> None:
    """The C++ class converts arguments itself (csrc/arguments.h); every type either twin
    accepts gives the same result, every type it refuses the same exception and message."""
    assert _outcome("cpp", method, kwargs) == _outcome("python", method, kwargs)


# Calls whose arguments fit no signature: (method, positional, keyword).
MISFIT_CALLS = [
    ("barrier", ("k",), dict(timeoutt=1)),
    ("barrier", ("k", 1, True, 5), {}),
    ("barrier", ("k",), dict(key="j")),
    ("all_gather", ("k", b"x", 1, 2), {}),
    ("scatter_recv", (), dict(data=b"x")),
]


@pytest.mark.skipif(CppStoreCollectives is None, reason="C++ extension not built")
@pytest.mark.parametrize("method, args, kwargs", MISFIT_CALLS)
def test_arguments_that_fit_no_signature_are_one_line_in_both(method: str, args: tuple, kwargs: dict) -> None:
    """What a Python method raises, from the C++ methods too (not pybind11's list of
    signatures over several lines), before any store traffic."""
    texts = []
    for impl in ("cpp", "python"):
        store = dist.HashStore()
        coll = make(impl, store, 0, 2)
        with pytest.raises(TypeError) as info:
            getattr(coll, method)(*args, **kwargs)
        text = str(info.value)
        # CPython's words: "PyStoreCollectives.barrier() got ..." from Python 3.10, "barrier() got ..." before
        owner = f"{type(coll).__name__}." if sys.version_info >= (3, 10) else ""
        assert text.startswith(f"{owner}{method}() "), text
        texts.append(text[len(owner) :])
        assert "\n" not in text
        assert store.num_keys() == 0
        coll.close()
    assert texts[0] == texts[1]


@pytest.mark.skipif(CppStoreCollectives is None, reason="C++ extension not built")
def test_the_calls_go_straight_to_cpp_unless_overridden() -> None:
    """An instance's collective methods are the C++ ones (no Python frame per call), except
    those a subclass overrides, and the naming mixin's when it has names to add."""
    store = dist.HashStore()
    calls = []

    class Mine(CppStoreCollectives):  # type: ignore[misc, valid-type]
        def barrier(self, key=None, timeout=30.0, block=True):  # noqa: ANN001, ANN202
            calls.append(key)
            super().barrier(key, timeout, block)

    plain, mine = CppStoreCollectives(store, 0, 1), Mine(store, 0, 1)
    assert "barrier" in vars(plain) and "barrier" not in vars(mine) and "all_sum" in vars(mine)
    for name in ("barrier", "scatter_recv", "all_sum"):  # help(coll.barrier) shows the interface's text
        assert getattr(torch_ctrl.ControlCollectives, name).__doc__ in getattr(plain, name).__doc__
    mine.barrier("b")
    assert calls == ["b"] and mine.all_sum("s", 3) == 3
    named = torch_ctrl.with_rank_names(CppStoreCollectives)
    assert "all_gather" in vars(named(store, 0, 1))
    assert "all_gather" in vars(named(store, 0, 1, rank_names=["host-a"]))  # names added in C++
    for coll in (plain, mine):
        coll.close()


class _Failing(DictStore):
    """A Python-written store whose writes fail, each with an exception of its own type."""

    def set(self, key: str, value: object) -> None:
        raise RuntimeError("disk quota exceeded")

    def multi_set(self, keys: list[str], values: list[object]) -> None:
        raise OSError("read-only file system")

    def add(self, key: str, value: int) -> int:
        raise ValueError("counter corrupted")


FAILING_CALLS = [
    ("broadcast_send", {"data": b"x"}),
    ("gather_send", {"data": b"x"}),
    ("scatter_send", {"data": [b"a", b"b"]}),
    ("barrier", {}),
    ("all_sum", {"data": 1}),
    ("all_gather", {"data": b"x"}),
]


@pytest.mark.skipif(CppStoreCollectives is None, reason="C++ extension not built")
@pytest.mark.parametrize("method, kwargs", FAILING_CALLS)
def test_a_python_store_error_is_the_same_one_line_in_both(method: str, kwargs: dict) -> None:
    """Sends included: the op, its key and the store's exception with its type, identical in
    the C++ and Python implementations."""
    texts = []
    for cls in (CppStoreCollectives, torch_ctrl.PyStoreCollectives):
        coll = cls(_Failing(), 0, 2)
        with pytest.raises(torch_ctrl.CollectiveError) as info:
            getattr(coll, method)("k", timeout=5, **kwargs)
        texts.append(str(info.value))
        coll.close(0.5)
    assert texts[0] == texts[1]
    assert texts[0].startswith(f"{method} 'k': store error: ") and "\n" not in texts[0]
    assert any(t in texts[0] for t in ("RuntimeError: disk", "OSError: read-only", "ValueError: counter"))


class _SocketNamed(DictStore):
    """A Python-written store whose error is raised in a frame named like a socket's (as from
    a client library's ``connection.py``): what decides is the exception, not its traceback."""

    def _read_from_socket(self) -> None:
        raise ValueError("bad value")

    def set(self, key: str, value: object) -> None:
        self._read_from_socket()

    def add(self, key: str, value: int) -> int:
        self._read_from_socket()
        return 0


@pytest.mark.skipif(CppStoreCollectives is None, reason="C++ extension not built")
@pytest.mark.parametrize("method, kwargs", FAILING_CALLS)
def test_a_python_store_error_raised_near_a_socket_is_still_a_store_error_in_both(method: str, kwargs: dict) -> None:
    texts = []
    for cls in (CppStoreCollectives, torch_ctrl.PyStoreCollectives):
        coll = cls(_SocketNamed(), 0, 2)
        with pytest.raises(torch_ctrl.CollectiveError) as info:
            getattr(coll, method)("k", timeout=5, **kwargs)
        assert not isinstance(info.value, torch_ctrl.StoreUnreachableError), (cls, str(info.value))
        texts.append(str(info.value))
        coll.close(0.5)
    assert texts[0] == texts[1] == f"{method} 'k': store error: ValueError: bad value"


class _CasFails(DictStore):
    """Works until told otherwise; then its compare_set (what abort() writes the notice with)
    raises a two-line error."""

    broken = False

    def compare_set(self, key: str, expected: object, desired: object) -> bytes:
        if self.broken:
            raise ValueError("cas exploded\nline two")
        return super().compare_set(key, expected, desired)


@pytest.mark.skipif(CppStoreCollectives is None, reason="C++ extension not built")
def test_abort_on_a_failing_store_is_one_line_in_both() -> None:
    texts = []
    for cls in (CppStoreCollectives, torch_ctrl.PyStoreCollectives):
        store = _CasFails()
        coll = cls(store, 0, 2)
        store.broken = True
        with pytest.raises(torch_ctrl.CollectiveError) as info:
            coll.abort("why")
        texts.append(str(info.value))
        coll.close(0.5)
    assert texts[0] == texts[1] == "abort: store error: ValueError: cas exploded"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method, kwargs", FAILING_CALLS[:3])
def test_a_send_to_a_server_that_died_names_the_op(impl: str, method: str, kwargs: dict) -> None:
    """A send whose connection broke (or cannot be opened again) is the op's one-line
    CollectiveError, not torch's raw DistNetworkError."""
    if impl == "mixed":
        pytest.skip("one rank: the cpp and python cases cover it")
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    coll = make(impl, dist.TCPStore("127.0.0.1", server.port, is_master=False), 0, 2)
    getattr(coll, method)("warm", timeout=5, **kwargs)  # its lane is open
    del server
    # The first write may still land in the socket's buffer; the next ones cannot.
    errors = []
    for i in range(3):
        try:
            getattr(coll, method)(f"k{i}", timeout=3, **kwargs)
        except Exception as exc:  # noqa: BLE001 - inspected below
            errors.append(exc)
    assert errors
    for exc in errors:
        assert isinstance(exc, torch_ctrl.CollectiveError), repr(exc)
        assert str(exc).startswith(f"{method} 'k") and "store unreachable" in str(exc) and "\n" not in str(exc)
    coll.close(0.5)


class _Unreachable(DictStore):
    """A Python-written store whose backend is down (torch's EtcdStore when etcd is): its calls
    raise torch's own DistNetworkError, or a socket's ConnectionError."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__()
        self.exc: BaseException | None = None
        self._raise = exc

    def down(self) -> None:
        self.exc = self._raise

    def _check(self) -> None:
        if self.exc is not None:
            raise type(self.exc)(*self.exc.args)

    def set(self, key: str, value: object) -> None:
        self._check()
        super().set(key, value)  # type: ignore[arg-type]

    def add(self, key: str, value: int) -> int:
        self._check()
        return super().add(key, value)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._check()
        super().wait(keys, timeout)


@pytest.mark.parametrize(
    "exc",
    [dist.DistNetworkError("etcd cluster is unavailable"), ConnectionResetError(104, "Connection reset by peer")],
    ids=["DistNetworkError", "ConnectionResetError"],
)
@pytest.mark.parametrize("method, kwargs", FAILING_CALLS + [("broadcast_recv", {})])
def test_a_python_store_network_error_is_store_unreachable_in_both(
    impl: str, method: str, kwargs: dict, exc: BaseException
) -> None:
    """Told by the exception's type, as lanes.connection_lost reads it: in C++ the Python
    exception arrives wrapped (error_already_set), and its text alone ("etcd cluster is
    unavailable") says nothing of a connection."""
    store = _Unreachable(exc)
    coll = make(impl, store, 0, 2)
    store.down()
    with pytest.raises(torch_ctrl.StoreUnreachableError) as info:
        getattr(coll, method)("k", timeout=5, **kwargs)
    assert isinstance(info.value, dist.DistNetworkError)
    text = _one_line(info.value)
    assert text == f"{method} 'k': store unreachable: {type(exc).__name__}: {exc}", text
    store.exc = None
    coll.close(0.5)


class _FailingCompareSet(DictStore):
    """A Python-written store whose compare_set fails on the op's keys: at the deadline the
    diagnostics that name the missing ranks fail too."""

    def compare_set(self, key: str, expected: object, desired: object) -> bytes:
        if "torch_ctrl/3/w2/k" in key:
            raise ValueError("bad")
        return super().compare_set(key, expected, desired)


@pytest.mark.parametrize("method, kwargs", [("barrier", {}), ("all_sum", {"data": 1})])
def test_a_python_store_error_in_a_timeouts_diagnostics_carries_its_type(impl: str, method: str, kwargs: dict) -> None:
    """As every other error of a Python-written store (docs/protocol.md), in both twins."""
    coll = make(impl, _FailingCompareSet(), 0, 2)
    with pytest.raises(CollectiveTimeoutError) as info:
        getattr(coll, method)("k", timeout=0.5, **kwargs)
    expected = f"{method} 'k' timed out after 0.5s: who arrived could not be read (ValueError: bad)"
    assert _one_line(info.value) == expected
    coll.close(0.5)


# Calls with two bad arguments: the error is about the first in the order of the parameters
# (key, data, timeout, block), in both twins.
TWO_BAD = [
    ("barrier", (5,), dict(block="no"), TypeError, "key must be a str or None, got int"),
    ("barrier", (5, -1), {}, TypeError, "key must be a str or None, got int"),
    ("barrier", ("k", -1), dict(block="no"), ValueError, "timeout must be >= 0, got -1"),
    ("barrier", ("k", "x", "no"), {}, TypeError, "timeout must be a timedelta or seconds, got str"),
    ("broadcast_send", (5, 5), {}, TypeError, "key must be a str or None, got int"),
    ("broadcast_send", (5,), {}, TypeError, "key must be a str or None, got int"),
    ("broadcast_send", ("k", 5, "x"), {}, TypeError, "data must be bytes, bytearray, memoryview or str, got int"),
    ("broadcast_recv", (5, "x"), {}, TypeError, "key must be a str or None, got int"),
    ("gather_send", (5, None), {}, TypeError, "key must be a str or None, got int"),
    ("gather_recv", (b"k", 1), {}, TypeError, "key must be a str or None, got bytes"),
    ("gather_recv", ("k", 1, -1), {}, TypeError, "data must be bytes, bytearray, memoryview or str, got int"),
    ("scatter_send", (5, b"ab"), {}, TypeError, "key must be a str or None, got int"),
    ("scatter_send", ("k", [b"a"], "x"), {}, ValueError, "data must have world_size=2 elements, got 1"),
    ("scatter_recv", (5, -1), {}, TypeError, "key must be a str or None, got int"),
    ("all_gather", (5, 1), {}, TypeError, "key must be a str or None, got int"),
    ("all_sum", (5, "1"), {}, TypeError, "key must be a str or None, got int"),
    ("all_sum", ("k", "1", -1), {}, TypeError, "data must be an int, got str"),
]


@pytest.mark.parametrize("method, args, kwargs, exc, message", TWO_BAD)
def test_arguments_are_checked_in_the_order_of_the_parameters(
    impl: str, method: str, args: tuple, kwargs: dict, exc: type, message: str
) -> None:
    store = DictStore()
    coll = make(impl, store, 0, 2)
    with pytest.raises(exc) as info:
        getattr(coll, method)(*args, **kwargs)
    assert str(info.value) == message
    assert store.num_keys() == 0
    coll.close()
