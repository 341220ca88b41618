"""A TCPStore server that restarts mid-job: collectives recover on new connections, and so
does each instance's background work (cleanup, abort polling, naming): keys stay bounded and
an abort still wakes a blocked peer within a second. A server that answers late: every op
completes and cleans up."""

from __future__ import annotations

import gc
import os
import re
import signal
import threading
import time
import weakref

import pytest
import torch.distributed as dist
from helpers import HOST, IMPLS, DictStore, Gate, Stores, make, make_cls, poll, run_ranks

import torch_ctrl
from torch_ctrl.errors import CollectiveAbortedError, CollectiveError, CollectiveTimeoutError

WORLD = 2


def _retry(fn, seconds: float = 30.0):  # noqa: ANN001, ANN202
    """The first op after a restart may meet a pooled connection that died: it fails once,
    with one line, and the next op (a new key) takes a new connection."""
    deadline = time.monotonic() + seconds
    for attempt in range(1000):
        try:
            return fn(attempt)
        except CollectiveError:
            if time.monotonic() > deadline:
                raise


def _round(colls, tag: str) -> None:  # noqa: ANN001
    def body(rank: int) -> None:
        c = colls[rank]
        c.barrier(f"{tag}/b", timeout=30)
        assert c.all_sum(f"{tag}/s", rank + 1, timeout=30) == 3
        assert c.all_gather(f"{tag}/g", b"%d" % rank, timeout=30) == [b"0", b"1"]
        if rank == 0:
            c.broadcast_send(f"{tag}/bc", b"x", timeout=30)
        else:
            assert c.broadcast_recv(f"{tag}/bc", timeout=30) == b"x"

    run_ranks(WORLD, body)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("impl", IMPLS)
def test_background_work_survives_a_server_restart(impl: str) -> None:
    server = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    port = server.port
    colls = [make(impl, dist.TCPStore(HOST, port, is_master=False), r, WORLD) for r in range(WORLD)]
    _round(colls, "before")
    del server  # the server goes away ...
    server = dist.TCPStore(HOST, port, is_master=True, wait_for_workers=False)  # ... and comes back empty
    # every rank's first op may meet a dead pooled connection
    _retry(lambda n: run_ranks(WORLD, lambda r: colls[r].barrier(f"after/first{n}", timeout=10)))
    for i in range(40):
        _round(colls, f"after{i}")
    run_ranks(WORLD, lambda r: colls[r].barrier("settle", timeout=30))
    deadline = time.monotonic() + 10
    while server.num_keys() > 20 * WORLD + 20 and time.monotonic() < deadline:
        time.sleep(0.1)  # cleanup lags a finished op by a watcher tick
    assert server.num_keys() <= 20 * WORLD + 20, server.num_keys()

    # abort still reaches a blocked peer through its watcher's new connection
    woke: list[float] = []

    def body(rank: int) -> None:
        if rank == 1:
            with pytest.raises(CollectiveAbortedError, match="restarted-abort"):
                colls[1].barrier("never", timeout=60)
            woke.append(time.monotonic())
        else:
            time.sleep(0.5)  # let rank 1 block (its wake-up is what is measured)
            woke.append(time.monotonic())
            colls[0].abort("restarted-abort")

    run_ranks(WORLD, body)
    assert woke[1] - woke[0] < 1.5, woke  # documented: within 1 s (+0.5 s on a loaded machine)
    for c in colls:
        c.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "mixed"])
def test_close_does_not_wait_for_cleanup_once_the_server_is_gone(impl: str) -> None:
    """Cleanup queued when the server died cannot run: close() drops it (its keys would stay,
    as after a crash) instead of waiting out one reconnect per task, up to flush_timeout."""
    world = 4
    server = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    colls = [make(impl, dist.TCPStore(HOST, server.port, is_master=False), r, world) for r in range(world)]

    def ops(rank: int, tag: str) -> None:  # each op leaves cleanup queued (a watcher tick behind)
        for i in range(3):
            colls[rank].all_gather(f"{tag}g{i}", b"x", timeout=30)
            colls[rank].all_sum(f"{tag}s{i}", 1, timeout=30)

    # Every watcher has its connection once a first round's keys are gone (each rank counts
    # itself out on its own watcher): what the second round queues meets a lost connection.
    # (A watcher still connecting when the server goes spends up to one attempt in torch's
    # connect loop, seconds, first.)
    run_ranks(world, lambda rank: ops(rank, "warm"))
    poll(lambda store=server: store.num_keys() <= 1, 30, "the first round's keys deleted")
    run_ranks(world, lambda rank: ops(rank, ""))
    del server
    start = time.monotonic()
    run_ranks(world, lambda rank: colls[rank].close(flush_timeout=10.0))  # as each rank would
    # Before: about 2 s per queued task (a reconnect each), 10 s or more here. Now only a
    # reconnect already under way when close() is called ends first (about 2 s).
    assert time.monotonic() - start < 3.5


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["tcp", "prefix"])
def test_every_op_completes_and_cleans_up_on_a_server_that_answers_late(impl: str, kind: str) -> None:
    """Rank 0 reaches the server through a gate that holds every answer 0.3 s (longer than
    the 0.25 s a quiet read's get waits, and than the 0.05 s under which a barrier's return
    counts as its deadline): every op still returns the right value on every rank, and once
    the instances are closed no key is left."""
    stores, world = Stores(kind), 3
    gate = Gate(stores.port)
    gate.slow(0.3)

    def fn(rank: int) -> None:
        coll = make(impl, stores.client(rank, gate.port if rank == 0 else None), rank, world)
        coll.barrier("b", 30)
        if rank == 0:
            coll.broadcast_send("bc", b"v", 30)
        else:
            assert coll.broadcast_recv("bc", 30) == b"v"
        if rank == 1:
            assert coll.gather_recv("g", b"1", 30) == [b"0", b"1", b"2"]
        else:
            coll.gather_send("g", b"%d" % rank, 30)
        if rank == 2:
            assert coll.scatter_send("s", [b"a", b"b", b"c"], 30) == b"c"
        else:
            assert coll.scatter_recv("s", 30) == b"ab"[rank : rank + 1]
        assert coll.all_gather("ag", b"%d" % rank, 30) == [b"0", b"1", b"2"]
        assert coll.all_sum("as", rank + 1, 30) == 6
        coll.barrier("nb", 30, block=rank != 1)
        coll.close(flush_timeout=30)

    try:
        run_ranks(world, fn, timeout=100)
    finally:
        gate.close()
    assert stores.admin.num_keys() == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "mixed"])
@pytest.mark.parametrize("kind", ["tcp", "prefix"])
def test_ops_fail_within_their_timeout_once_the_server_is_gone(impl: str, kind: str) -> None:
    """No store call, reconnect included, outlives an op's deadline: after the server is gone
    every op fails within its timeout (plus slack) with one line saying the store is
    unreachable (the client's own timeout is 300 s)."""
    from helpers import Stores

    stores = Stores(kind)
    colls = [make(impl, stores.client(r), r, WORLD) for r in range(WORLD)]
    run_ranks(WORLD, lambda r: colls[r].all_sum("warm", 1, timeout=30))
    port = stores.port
    del stores.server, stores.admin  # the server goes away
    for i in range(3):
        started = time.monotonic()
        with pytest.raises(CollectiveError) as info:
            colls[0].barrier(f"gone{i}", timeout=3)
        took = time.monotonic() - started
        text = str(info.value)
        assert "store unreachable" in text and "\n" not in text, text
        # The host to look at: a connection found dead and one refused alike name the server.
        assert f"the store's server {HOST}:{port} " in text, text
        # The timeout, plus torch's connect back-off (a retry it starts just before the
        # deadline, after a random delay of up to ~1.5 s) and slack for a loaded machine: seen
        # at 5.2 s once under the full suite, 6.4 s on torch 2.7 with two suites on 2 cores.
        # What this guards is the client's 300 s.
        assert took < 3 + 5.0, (i, took)
    for c in colls:
        c.close(flush_timeout=0.5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "mixed"])
@pytest.mark.parametrize("kind", ["tcp", "prefix"])
def test_a_server_gone_fails_ops_and_abort_at_once_in_one_line(
    impl: str, kind: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """Once the server is gone its address refuses connections: an op that needs a new
    connection, and abort(), fail at once with one line naming the address (they spent their
    connect budget in torch's connect loop, the store's timeout for abort, and torch logged
    every failed attempt with a C++ stack trace). What reaches stderr is at most torch's own
    warning for a connection it found dead, never its connect loop's."""
    from torch_ctrl import capabilities

    stores = Stores(kind)
    colls = [make(impl, stores.client(r), r, WORLD) for r in range(WORLD)]
    run_ranks(WORLD, lambda r: colls[r].all_gather("warm", b"x", timeout=30))
    # Both watchers have opened their connections once the all_gather's keys are deleted
    # (each rank counts itself out on its own watcher): none is connecting when the server goes.
    deadline = time.monotonic() + 10
    while stores.admin.num_keys() > 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stores.admin.num_keys() <= 1, stores.admin.num_keys()
    port = stores.port
    del stores.server, stores.admin  # the server goes away
    for i in range(3):
        started = time.monotonic()
        # a StoreUnreachableError, also what torch raises for a lost server (DistNetworkError)
        with pytest.raises(torch_ctrl.StoreUnreachableError) as info:
            colls[0].barrier(f"gone{i}", timeout=20)
        assert isinstance(info.value, CollectiveError)
        assert isinstance(info.value, dist.DistNetworkError) and isinstance(info.value, dist.DistStoreError)
        took = time.monotonic() - started
        text = str(info.value)
        assert text.startswith(f"barrier 'gone{i}': store unreachable: "), text
        assert "\n" not in text, text
        assert took < 1.5, (i, took)  # was the connect budget: half the op's 20 s
        assert f"the store's server {HOST}:{port} " in text, text  # the host to look at
        # The first op may find its pooled connection dead instead; so does every op where the
        # Python twin shares the chain's one client (torch without clone()).
        if i > 0 and not (impl == "python" and kind == "prefix" and not capabilities.CLONE):
            assert f"{HOST}:{port} is unreachable" in text and "refused" in text, text
    # A non-blocking arrival (a plain add) fails in the same one line, on a pooled connection
    # found dead as on a new one refused.
    for i in range(2):
        with pytest.raises(torch_ctrl.StoreUnreachableError) as info:
            colls[1].barrier(f"nb{i}", timeout=20, block=False)
        text = str(info.value)
        assert text.startswith(f"barrier 'nb{i}': store unreachable: ") and "\n" not in text, text
    started = time.monotonic()
    with pytest.raises(torch_ctrl.StoreUnreachableError) as info:
        colls[1].abort("gone")
    assert time.monotonic() - started < 1.5
    text = str(info.value)
    assert text.startswith("abort: store unreachable: ") and "\n" not in text, text
    assert f"the store's server {HOST}:{port} " in text, text
    for c in colls:
        c.close(flush_timeout=0.5)
    # torch's connect loop logs "failed to connect/validate" and "timed out ... while trying to
    # connect"; fd 2 is the whole process's, so only lines about this server's port count (a
    # watcher left by an earlier test may be reconnecting to its own server).
    mine = (f"{HOST}:{port} ", f"({HOST}, {port})")
    loop = [
        line
        for line in capfd.readouterr().err.splitlines()
        if any(m in line for m in mine) and ("failed to connect/validate" in line or "while trying to connect" in line)
    ]
    assert not loop, loop


class _TurnHeld:
    """Another caller holding the Python twin's one-at-a-time turn to construct a client (torch
    2.6-2.7), as a watcher reconnecting to a server that is gone, or a connect to a server that
    hangs, does for seconds."""

    def __enter__(self) -> None:
        from torch_ctrl import lanes

        held, self.release = threading.Event(), threading.Event()

        def hold() -> None:
            with lanes._CONNECT:
                held.set()
                self.release.wait(30)

        self.thread = threading.Thread(target=hold, daemon=True)
        self.thread.start()
        assert held.wait(10)

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.thread.join(10)


def test_a_connection_to_itself_is_no_server() -> None:
    """With nothing listening on a local port of the ephemeral range, a plain connect to it
    now and then gets that very port as its source and the kernel connects the socket to
    itself: both twins' plain connect take that for a refusal (else a watcher probing a gone
    server would hand it to torch's connect loop, which logs a C++ trace per attempt)."""
    import socket

    from torch_ctrl import lanes

    itself = socket.socket()
    itself.bind((HOST, 0))
    itself.connect(itself.getsockname())  # what such a connect amounts to
    listener = socket.socket()
    listener.bind((HOST, 0))
    listener.listen()
    other = socket.create_connection(listener.getsockname())
    with itself, listener, other:
        assert lanes._self_connected(itself) and not lanes._self_connected(other)
        if torch_ctrl.backend() == "cpp":
            from torch_ctrl import _C

            assert _C._connected_to_itself(itself.fileno()) and not _C._connected_to_itself(other.fileno())


@pytest.mark.timeout(60)
@pytest.mark.skipif(torch_ctrl.backend() != "cpp", reason="the C++ extension did not load")
def test_twins_word_a_connection_that_fails_alike() -> None:
    """Both twins' plain connect (lanes._attempt, csrc/lanes.cpp connects()) reach a live
    server, and word a refusal and a name that does not resolve in the same words, so an op's
    "store unreachable" line reads the same from either implementation."""
    from torch_ctrl import _C, lanes

    server = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)

    def both(host: str, port: int) -> tuple[str, str]:
        py = lanes._attempt(host, port, 5.0)
        return ("" if py is None else str(py)), _C._attempt(host, port, 5.0)

    assert both(HOST, server.port) == ("", "")
    assert both(HOST, 1) == ("[Errno 111] Connection refused",) * 2
    # Each twin asks the resolver itself, and a resolver that cannot reach its server answers
    # "temporary failure" (EAI_AGAIN) one time and "not known" (EAI_NONAME) the next: compare
    # the words of answers with the same code.
    gai = re.compile(r"\[Errno -\d+\] \S")
    for _ in range(5):
        py, cpp = both("no-such-host.invalid", 29500)
        assert gai.match(py) and gai.match(cpp), (py, cpp)
        if py.split("]")[0] == cpp.split("]")[0]:
            assert py == cpp
            break
    else:
        pytest.fail(f"the resolver never gave both twins the same answer: {py!r}, {cpp!r}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["tcp", "prefix"])
def test_ops_fail_within_their_timeout_while_another_connect_holds_the_turn(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch 2.6-2.7 (no clone()), server gone: every op fails within its own timeout, though
    another caller holds the turn to construct clients: a server that is gone is found with a
    plain socket, without the turn. (Over a PrefixStore, those torches share the user's one
    client and open none: the bound must hold there too.)"""
    from torch_ctrl import capabilities

    monkeypatch.setattr(capabilities, "CLONE", False)  # as torch 2.6-2.7 have it
    server = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore(HOST, server.port, is_master=False)
    coll = make("python", dist.PrefixStore("job", client) if kind == "prefix" else client, 0, 2)
    del server
    texts = []
    with _TurnHeld():
        for i in range(3):  # the first ops may take the pooled lanes (dead): they fail at once
            started = time.monotonic()
            with pytest.raises(CollectiveError) as info:
                coll.barrier(f"gone{i}", timeout=2)
            took = time.monotonic() - started
            texts.append(str(info.value))
            # Without the bound: as long as the other holds its turn (30 s here).
            assert took < 2 + 1.0, (i, took, texts)
    assert all("store unreachable" in t for t in texts), texts
    if kind == "tcp":
        assert any("is unreachable" in t for t in texts), texts  # the socket found it
    coll.close(flush_timeout=0.5)


@pytest.mark.timeout(60)
def test_a_new_connection_waits_for_its_turn_only_within_its_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.6-2.7 (no clone()), server up: a new lane whose turn does not come within the
    time it was given (an op's time left) fails then, saying why."""
    from torch_ctrl import capabilities, lanes

    monkeypatch.setattr(capabilities, "CLONE", False)
    server = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    pool = lanes.Lanes(dist.TCPStore(HOST, server.port, is_master=False))
    pool.release(pool.open(5.0))  # the turn is free: connects as before
    with _TurnHeld():
        started = time.monotonic()
        with pytest.raises(dist.DistNetworkError, match="one at a time"):
            pool.open(1.0)
        assert time.monotonic() - started < 1.0 + 1.0
    pool.release(pool.open(5.0))  # and once the turn is free again


@pytest.mark.timeout(60)
def test_close_frees_the_clients_in_the_construction_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.6-2.7 (no clone()): a client freed while another thread constructs one can
    corrupt pybind11's registry (the process aborts later), so close() frees the Python
    lanes' clients in the same one-at-a-time turn their construction takes."""
    from torch_ctrl import capabilities, lanes

    monkeypatch.setattr(capabilities, "CLONE", False)
    server = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    pool = lanes.Lanes(dist.TCPStore(HOST, server.port, is_master=False))
    pool.release(pool.open(5.0))
    closer = threading.Thread(target=pool.close, daemon=True)
    with _TurnHeld():
        closer.start()
        closer.join(0.5)
        assert closer.is_alive()  # waits for the turn
    closer.join(10)
    assert not closer.is_alive()
    assert pool.acquire(5.0) is not None  # nothing pooled any more: a new client


@pytest.mark.timeout(60)
def test_dropped_lanes_are_freed_in_the_construction_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.6-2.7 (no clone()), as test_close_frees_the_clients_in_the_construction_turn for
    the other ways a lane is dropped: one that saw an error, and a pool the garbage collector
    frees without close(). Each is kept while another thread holds the turn, and freed in the
    next turn this process takes (a new connection, a close())."""
    from torch_ctrl import capabilities, lanes

    monkeypatch.setattr(capabilities, "CLONE", False)
    monkeypatch.setattr(lanes, "_RETIRED", [])
    server = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    pool = lanes.Lanes(dist.TCPStore(HOST, server.port, is_master=False))
    first, second = pool.open(5.0), pool.open(5.0)
    pool.release(first)
    pool.release(second)
    other = lanes.Lanes(dist.TCPStore(HOST, server.port, is_master=False))
    other.release(other.open(5.0))
    dropped = []
    with _TurnHeld():
        for _ in range(2):  # the second drop finds the turn taken: the first is kept too
            with pytest.raises(RuntimeError, match="op failed"), pool.lane() as lane:
                raise RuntimeError("op failed")
            dropped.append(weakref.ref(lane))
            del lane
        dropped.append(weakref.ref(other._free[0]))
        del other
        del first, second
        gc.collect()
        assert all(ref() is not None for ref in dropped)
    gc.collect()
    assert all(ref() is not None for ref in dropped)  # nothing took the turn yet
    pool.release(pool.open(5.0))  # a new connection: its turn frees them
    assert [ref() for ref in dropped] == [None, None, None]
    pool.close()


@pytest.mark.timeout(60)
def test_a_connect_to_a_server_gone_behind_its_address_gives_up_the_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.6-2.7 (no clone()): an address that accepts connections while the server behind
    it is gone (a server that dies between the check and the connect looks so) holds the turn
    for one attempt at a time, not for the store's whole timeout: a connection to a live
    server still opens within its time. (Seen on torch 2.6: a watcher reconnecting to a dying
    server held every connection of the process for the store's 300 s.)"""
    from datetime import timedelta

    from torch_ctrl import capabilities, lanes

    monkeypatch.setattr(capabilities, "CLONE", False)
    live = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    pool = lanes.Lanes(dist.TCPStore(HOST, live.port, is_master=False))
    dying = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    gate = Gate(dying.port)
    # What a watcher reconnects with: the store's own timeout (20 s here, 300 s by default).
    stuck = lanes.Lanes(dist.TCPStore(HOST, gate.port, is_master=False, timeout=timedelta(seconds=20)))
    del dying  # the gate still accepts; behind it the server is gone
    in_turn = threading.Event()
    connect = lanes._tcp_client

    def _tcp_client(store, connect_timeout):  # noqa: ANN001, ANN202 - torch's connect, observed
        if store.port == gate.port:
            in_turn.set()
        return connect(store, connect_timeout)

    monkeypatch.setattr(lanes, "_tcp_client", _tcp_client)
    reconnecting = threading.Thread(target=lambda: pytest.raises(dist.DistError, stuck.open), daemon=True)
    reconnecting.start()
    try:
        assert in_turn.wait(10)  # it holds the turn now, inside torch's connect
        started = time.monotonic()
        pool.release(pool.open(10.0))  # without the bound: "one at a time" after 10 s
        assert time.monotonic() - started < 8.0
    finally:
        gate.close()  # the reconnecting thread now fails its check; it ends by its 20 s
        reconnecting.join(30)
    assert not reconnecting.is_alive()


@pytest.mark.timeout(60)
def test_a_chain_whose_prefix_is_unknown_connects_within_the_time_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.8-2.9 without the extension: a PrefixStore chain over a TCPStore has clone() but
    no list_keys, so its prefix cannot be learned and new lanes are clones, which connect within
    the store's own timeout (300 s here). A new lane must still fail within the time it was
    given once the server is gone: that is what keeps ops and the watcher's reconnects bounded."""
    from torch_ctrl import capabilities, lanes

    if not capabilities.CLONE:
        pytest.skip("this torch's stores have no clone(): chains share the user's client")
    monkeypatch.setattr(capabilities, "LIST_KEYS", False)  # as torch 2.8-2.9 have them
    monkeypatch.setattr(capabilities, "BARRIER", False)
    monkeypatch.setattr(lanes, "_reads_prefixes", lambda: False)  # as without the extension
    server = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    pool = lanes.Lanes(dist.PrefixStore("job", dist.TCPStore(HOST, server.port, is_master=False)))
    assert pool.owned and pool.prefix == ""  # new lanes are clones
    pool.release(pool.open(5.0))  # while the server is up, a clone as before
    del server
    started = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017 - torch's connect error, whatever its type
        pool.open(1.0)
    # 1 s plus torch's connect back-off and slack; without the bound, the client's 300 s.
    assert time.monotonic() - started < 1.0 + 4.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "mixed"])
@pytest.mark.parametrize("kind", ["tcp", "prefix"])
def test_an_op_out_of_time_to_connect_reports_its_timeout(impl: str, kind: str) -> None:
    # A timed-out op drops its connection, so the next op opens a new one. When the server
    # takes no new connection, an op with (almost) no time left cannot tell a slow
    # connection from a server that is gone: it is the op's timeout, not "store unreachable"
    # (which a poll with timeout 0 reported, before, whenever its connection took over 1 ms).
    # With time to tell, it is still an unreachable store.
    from torch_ctrl import capabilities

    if impl == "python" and kind == "prefix" and not capabilities.CLONE:
        pytest.skip("this torch's stores have no clone(): the Python twin shares the chain's client")
    server = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    gate = Gate(server.port)
    client = dist.TCPStore(HOST, gate.port, is_master=False)
    store = dist.PrefixStore("job", client) if kind == "prefix" else client
    coll = make(impl, store, 1, WORLD)
    try:
        with pytest.raises(CollectiveTimeoutError):
            coll.barrier("first", timeout=0)  # rank 0 never comes; the connection is dropped
        gate.shut()
        out_of_time = 0
        for key, seconds in (("poll", 0), ("poll-again", 0), ("short", 0.05)):
            # (A connection still pooled serves the op; naming the missing ranks at the deadline
            # then needs a new one, which also times out: the op's timeout either way.)
            start = time.monotonic()
            with pytest.raises(CollectiveTimeoutError) as info:
                coll.barrier(key, timeout=seconds)
            msg = str(info.value)
            assert "store unreachable" not in msg and "\n" not in msg, msg
            if "no new connection to the store opened in the time left" in msg:
                out_of_time += 1
                assert time.monotonic() - start < 5  # a connect budget of 0.1 s (torch retries once past it)
        assert out_of_time >= 1
        with pytest.raises(CollectiveError, match="store unreachable") as info:
            coll.barrier("time-to-tell", timeout=1)
        assert not isinstance(info.value, CollectiveTimeoutError)
    finally:
        gate.open()
        coll.close()
        gate.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("heartbeat", [None, 0.2])
@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "mixed"])
@pytest.mark.parametrize("kind", ["tcp", "prefix"])
def test_a_new_instance_on_a_server_gone_fails_at_once(impl: str, kind: str, heartbeat: float | None) -> None:
    """A new instance's first connection would spend the client's timeout (300 s) in torch's
    connect loop once the server is gone, and then raise torch's error. It fails at once
    instead, with one line naming the rank and the address, and leaves no thread behind."""
    stores = Stores(kind)
    client, port = stores.client(0), stores.port
    del stores.server, stores.admin  # the server goes away
    threads = set(threading.enumerate())
    started = time.monotonic()
    with pytest.raises(torch_ctrl.StoreUnreachableError) as info:
        make_cls(impl, 0)(client, 0, WORLD, heartbeat_interval=heartbeat)
    took = time.monotonic() - started
    text = str(info.value)
    assert text.startswith(f"StoreCollectives(rank 0 of {WORLD}): store unreachable: "), text
    assert f"{HOST}:{port} " in text and "\n" not in text, text
    assert took < 2.0, took
    assert set(threading.enumerate()) <= threads


class _Unreachable(DictStore):
    """A Python-written store whose backend has gone (as an etcd client raises)."""

    def compare_set(self, key: str, expected: object, desired: object) -> bytes:
        raise ConnectionError("etcd at 10.0.0.7:2379: connection refused")

    def get(self, key: str) -> bytes:
        raise ConnectionError("etcd at 10.0.0.7:2379: connection refused")

    def check(self, keys: list[str]) -> bool:
        raise ConnectionError("etcd at 10.0.0.7:2379: connection refused")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "mixed"])
def test_a_new_instance_whose_store_fails_to_connect_says_so_in_one_line(impl: str) -> None:
    """Past the address check, a first store call that finds the connection gone is the same
    one line (a Python-written store's connection error here)."""
    with pytest.raises(CollectiveError) as info:
        make_cls(impl, 1)(_Unreachable(), 1, WORLD)
    text = str(info.value)
    assert text.startswith(f"StoreCollectives(rank 1 of {WORLD}): store unreachable: "), text
    assert "10.0.0.7:2379" in text and "\n" not in text, text


@pytest.mark.timeout(60)
def test_an_address_that_neither_accepts_nor_refuses_is_left_to_torch() -> None:
    """The check fails a new instance only when its server's address refuses: one that does
    not answer within CHECK_CONNECT (a listener whose queue is full drops new connections,
    as an overloaded server does) passes, and torch's own connect decides as before."""
    import socket

    from torch_ctrl import lanes

    server = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    port = server.port
    client = dist.TCPStore(HOST, port, is_master=False)
    del server
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((HOST, port))
    listener.listen(0)  # room for one connection nobody accepts: later ones are not answered
    queued = []
    for _ in range(3):
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex((HOST, port))
        queued.append(sock)
    try:
        started = time.monotonic()
        lanes.check_server(client)  # no refusal: no error
        took = time.monotonic() - started
        assert lanes.CHECK_CONNECT * 0.9 <= took < lanes.CHECK_CONNECT + 3.0, took
    finally:
        for sock in [*queued, listener]:
            sock.close()


_IDLE_RANK = """
import sys, time, torch.distributed as dist
sys.path.insert(0, {test_dir!r})
from helpers import make_cls
store = dist.TCPStore("127.0.0.1", {port}, is_master=False)
coll = make_cls({impl!r}, 0)(store, 0, 2, heartbeat_interval=0.05)
from torch_ctrl import keys as K
# Ready once the watcher beats on its own connection (a second beat after the constructor's):
# a server killed while that connection is being opened is another case (torch retries it).
while int(store.get(K.group_key(2, "hb/0"))) // K.BEAT < 2:
    time.sleep(0.01)
print("ready", flush=True)
sys.stdin.readline()  # the server is gone now
time.sleep(6.0)  # idle: 120 heartbeats due
print("done", flush=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "mixed"])
def test_an_idle_rank_whose_server_is_gone_does_not_log_every_heartbeat(impl: str) -> None:
    """Heartbeats on, the store's server killed, the rank idle: its watcher finds the
    connection lost once, then only tries to reconnect (plain-socket checks, which log
    nothing) instead of sending each beat on the dead connection, for which torch logs a C++
    trace (torch then logs about one a second: 6 or more in these 6 s before)."""
    import os
    import subprocess
    import sys

    server = subprocess.Popen([sys.executable, "-c", _SERVER], stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
    port = int(server.stdout.readline())
    code = _IDLE_RANK.format(test_dir=os.path.dirname(__file__), port=port, impl=impl)
    rank = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert rank.stdout.readline().strip() == "ready"
        server.kill()
        server.wait(10)
        out, err = rank.communicate("\n", timeout=40)
    finally:
        server.kill()
        rank.kill()
    assert rank.returncode == 0 and out.strip() == "done", err[-2000:]
    assert err.count("Exception raised from") <= 3, err[-3000:]


_SERVER = """
import time, torch.distributed as dist
server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
print(server.port, flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "mixed"])
@pytest.mark.parametrize("kind", ["tcp", "prefix"])
def test_an_op_on_a_frozen_server_fails_soon_after_its_deadline_naming_the_server(impl: str, kind: str) -> None:
    """A server that stops answering without closing its connections (its host frozen, a
    network partition; here SIGSTOP). torch's client reads most replies, and the reply to a
    timed-out wait, with no time limit: the op hung for ever, as torch's class does. Now the
    op's connection is shut down ``reaper.GRACE`` seconds past its deadline and the op fails
    with one StoreUnreachableError line naming the server: an op blocked when the server froze
    and one begun after alike. Once the server runs again, the same instances work."""
    from datetime import timedelta

    from helpers import freeze, frozen_server, poll

    from torch_ctrl import capabilities, reaper

    if impl == "python" and kind == "prefix" and not capabilities.CLONE:
        # The one case left unbounded (docs/troubleshooting.md): on a torch without clone(),
        # the Python twin calls through the chain's one client, which is the caller's.
        pytest.skip("the Python twin shares the caller's client of a PrefixStore chain on this torch")
    with frozen_server() as (proc, port):

        def client() -> dist.Store:
            tcp = dist.TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=60), wait_for_workers=False)
            return tcp if kind == "tcp" else dist.PrefixStore("job", tcp)

        admin = dist.TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=60), wait_for_workers=False)
        colls = [make(impl, client(), r, WORLD) for r in range(WORLD)]
        run_ranks(WORLD, lambda r: colls[r].all_gather("warm", b"x", timeout=30))
        poll(lambda: admin.num_keys() <= 1, 30, "the warm-up's keys deleted")
        before = admin.num_keys()
        outcome: dict[str, tuple[BaseException | None, float]] = {}

        def run(name: str, fn) -> None:  # noqa: ANN001
            started = time.monotonic()
            try:
                fn()
                outcome[name] = (None, time.monotonic() - started)
            except BaseException as exc:  # noqa: BLE001 - checked below
                outcome[name] = (exc, time.monotonic() - started)

        blocked = threading.Thread(target=run, args=("blocked", lambda: colls[0].barrier("b", timeout=3)), daemon=True)
        blocked.start()
        poll(lambda: admin.num_keys() > before, 30, "rank 0 in the barrier")
        freeze(proc.pid)
        recv = lambda: colls[1].broadcast_recv("r", timeout=3)  # noqa: E731
        later = threading.Thread(target=run, args=("later", recv), daemon=True)
        later.start()
        for thread in (blocked, later):
            thread.join(3 + reaper.GRACE + 20)
        assert set(outcome) == {"blocked", "later"}, f"still blocked: {outcome}"
        for name, (exc, took) in outcome.items():
            assert isinstance(exc, torch_ctrl.StoreUnreachableError), (name, exc)
            text = str(exc)
            assert "\n" not in text, text
            said = f"the store's server {HOST}:{port} did not answer for {reaper.GRACE:g}s past the op's deadline"
            # An op that had to open a connection (its pooled one busy; seen once on torch 2.6
            # under a PrefixStore) gives that connection half its time left, and says so.
            opened = re.escape(f"the store's server {HOST}:{port} did not answer within ") + r"[0-9.]+s "
            assert said in text or re.search(opened, text), text
            # Not before the deadline (the server may only be slow), and soon after its grace.
            assert 3 <= took < 3 + reaper.GRACE + 5, (name, took)
        # Both lanes were dropped: an op now needs a new connection, whose first read torch
        # makes with no time limit too; and abort(), which has no timeout, gets 3 s + GRACE.
        for name, call, bound in [
            ("new connection", lambda: colls[0].barrier("c", timeout=3), 3 + reaper.GRACE),
            ("abort", lambda: colls[1].abort("frozen"), reaper.ABORT_WAIT + reaper.GRACE),
        ]:
            started = time.monotonic()
            with pytest.raises(torch_ctrl.StoreUnreachableError) as info:
                call()
            took, text = time.monotonic() - started, str(info.value)
            assert f"the store's server {HOST}:{port} did not answer " in text and "\n" not in text, (name, text)
            assert took < bound + 5, (name, took)
        os.kill(proc.pid, signal.SIGCONT)
        assert run_ranks(WORLD, lambda r: colls[r].all_sum("again", 1, timeout=30)) == [2, 2]
        for c in colls:
            c.close(flush_timeout=5)
