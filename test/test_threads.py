"""One instance used from many threads; per-call timeouts never touch the store's timeout."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from helpers import Stores, make, run_ranks

from torch_ctrl import CollectiveTimeoutError
from torch_ctrl import keys as K


@pytest.mark.timeout(60)
def test_one_instance_many_threads_opposite_key_order(impl: str) -> None:
    """World 2, one instance per rank, 4 threads per rank x 3 barriers; rank 1's threads start
    in the opposite key order.

    torch's _StoreCollectives deadlocks here until its timeout (a TCPStore client holds
    its lock across a blocking wait).
    """
    stores, world, threads, rounds = Stores("tcp"), 2, 4, 3

    def rank_main(rank: int) -> int:
        coll = make(impl, stores.client(rank), rank, world)
        keys = [f"t{t}/b{i}" for t in range(threads) for i in range(rounds)]
        per_thread = [keys[t * rounds : (t + 1) * rounds] for t in range(threads)]
        if rank == 1:  # rank 1 starts its threads in the opposite key order
            per_thread = list(reversed(per_thread))
        done = []

        def worker(ks: list[str]) -> None:
            for k in ks:
                coll.barrier(k, timedelta(seconds=20))
                done.append(k)

        ts = [threading.Thread(target=worker, args=(ks,)) for ks in per_thread]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        coll.close()
        return len(done)

    assert run_ranks(world, rank_main, timeout=40) == [threads * rounds] * world


@pytest.mark.parametrize("kind", ["tcp", "prefix", "file", "hash"])
def test_store_timeout_never_changes(impl: str, kind: str) -> None:
    stores, world = Stores(kind), 2
    clients = [stores.client(r) for r in range(world)]
    before = [c.timeout for c in clients]

    def fn(rank: int) -> None:
        coll = make(impl, clients[rank], rank, world)
        coll.barrier("a", timedelta(seconds=7))
        coll.all_gather("b", b"x", 3.5)
        if rank == 0:
            coll.broadcast_send("c", b"y", 1)
        else:
            coll.broadcast_recv("c", 11)
        with pytest.raises(CollectiveTimeoutError):
            coll.barrier(f"solo-{rank}", 0.2)
        # concurrent threads with different timeouts
        errs = []

        def worker(i: int) -> None:
            try:
                coll.all_sum(f"s{i}", i, timedelta(seconds=5 + i))
            except Exception as exc:  # noqa: BLE001
                errs.append(exc)

        ts = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        assert not errs
        coll.close()

    run_ranks(world, fn)
    assert [c.timeout for c in clients] == before


@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", ["barrier", "all_gather"])
@pytest.mark.parametrize("kind", ["tcp", "prefix", "file", "hash"])
def test_close_while_another_thread_is_blocked(impl: str, kind: str, op: str) -> None:
    """close() on one thread while another thread of the same instance is blocked in a
    collective: close() returns without waiting out its flush_timeout (it waited all of it), the
    blocked call completes normally once the peer arrives, and its cleanup still runs."""
    stores, world = Stores(kind), 2
    colls = [make(impl, stores.client(r), r, world) for r in range(world)]
    results: dict[int, object] = {}

    def call(rank: int) -> None:
        if op == "barrier":
            results[rank] = colls[rank].barrier("k", timedelta(seconds=30))
        else:
            results[rank] = colls[rank].all_gather("k", b"%d" % rank, timedelta(seconds=30))

    # The op's keys (a FileStore counts keys of its own: look for these, not at num_keys).
    prefix = K.op_prefix(world, "k", -1)
    fields = [K.ARRIVE, K.BARRIER, K.DONE, K.LOG, K.NAMES, K.EXIT, K.SUM, "r0", "r1"]

    def left() -> list[str]:
        return [f for f in fields if stores.admin.check([K.field(prefix, f)])]

    blocked = threading.Thread(target=call, args=(0,))
    blocked.start()
    deadline = time.monotonic() + 20
    while not left():  # rank 0 has arrived: it writes before it blocks
        assert time.monotonic() < deadline, "rank 0 never arrived"
        time.sleep(0.01)
    started = time.monotonic()
    colls[0].close(flush_timeout=10.0)
    took = time.monotonic() - started
    assert blocked.is_alive()  # close() did not end the call
    call(1)
    blocked.join(30)
    assert not blocked.is_alive()
    expected = None if op == "barrier" else [b"0", b"1"]
    assert results == {0: expected, 1: expected}
    assert took < 2.0, took  # it waited the whole flush_timeout (10 s) before
    colls[1].close()
    deadline = time.monotonic() + 20
    while left():  # the blocked call's cleanup ran after close()
        assert time.monotonic() < deadline, left()
        time.sleep(0.02)
