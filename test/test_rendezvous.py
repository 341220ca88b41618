"""The native ``ctrl`` rendezvous, handler by handler: real TCPStore servers on 127.0.0.1, one
client per handler, handlers as threads (and one as a process that is SIGKILLed)."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist
from helpers import HOST, free_port, freeze, frozen_server, in_thread, mute_port, poll
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousParameters,
    RendezvousTimeoutError,
)

from torch_ctrl.bench_rendezvous import MeteredStore
from torch_ctrl.counting import CountingStore
from torch_ctrl.elastic import ctrl_rendezvous
from torch_ctrl.elastic.ctrl_rendezvous import (
    NativeRendezvousHandler,
    beat_store,
    config_from,
    create_native_handler,
)

os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")  # connection setup: see docs/troubleshooting.md
pytestmark = pytest.mark.timeout(90)

FAST = dict(keep_alive_interval=0.2, keep_alive_max_attempt=2, last_call_timeout=0.3, join_timeout=20)


class Job:
    """One TCPStore server and a run id; ``node()`` makes a handler with its own client."""

    def __init__(self, lo: int, hi: int, **conf: Any) -> None:
        self.server = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
        self.port = self.server.port
        self.lo, self.hi, self.conf = lo, hi, {**FAST, **conf}
        self.run_id = f"run{self.port}"

    def params(self, **conf: Any) -> RendezvousParameters:
        return RendezvousParameters(
            "ctrl", f"{HOST}:{self.port}", self.run_id, self.lo, self.hi, is_host=False, **{**self.conf, **conf}
        )

    def node(self, **conf: Any) -> NativeRendezvousHandler:
        return create_native_handler(self.params(**conf))

    def wrapped(self, store: dist.Store) -> NativeRendezvousHandler:
        """A node whose calls go through ``store`` (a wrapper of a client of this job's server)."""
        return NativeRendezvousHandler(config_from(self.params()), store, beat_store(HOST, self.port, 60.0))

    def client(self) -> dist.Store:
        return dist.TCPStore(HOST, self.port, is_master=False)

    def key(self, rest: str) -> str:
        return f"torch_ctrl/rdzv/{self.run_id}/{rest}"

    def stale(self, node: NativeRendezvousHandler) -> None:
        """Until ``node``'s heartbeat (stopped) is older than dead_after."""
        limit = self.conf["keep_alive_interval"] * self.conf["keep_alive_max_attempt"]
        hb = self.key(f"hb/{node.node}")
        poll(lambda: time.time() - float(self.server.get(hb).split()[0]) > limit + 0.1)


class Call:
    """``fn()`` on a thread of its own; ``result()`` re-raises its error."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.started = time.monotonic()
        self.elapsed = 0.0
        threading.Thread(target=self._run, args=(fn,), daemon=True).start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.value = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc
        self.elapsed = time.monotonic() - self.started
        self.done.set()

    def result(self, timeout: float = 30.0) -> Any:
        assert self.done.wait(timeout), "still blocked"
        if self.error is not None:
            raise self.error
        return self.value


def join_all(handlers: list[NativeRendezvousHandler], timeout: float = 30.0) -> list[Any]:
    calls = [Call(h.next_rendezvous) for h in handlers]
    return [c.result(timeout) for c in calls]


def _boot(info: Any) -> tuple[str, int]:
    return info.bootstrap_store_info.master_addr, info.bootstrap_store_info.master_port


# ----------------------------------------------------------------------------- rounds


def test_full_round_completes_at_once_with_deterministic_ranks() -> None:
    job = Job(4, 4, last_call_timeout=60)  # the last call must not matter: max_nodes arrive
    nodes = [job.node() for _ in range(4)]
    start = time.monotonic()
    infos = join_all(nodes)
    assert time.monotonic() - start < 5
    assert sorted(i.rank for i in infos) == [0, 1, 2, 3]
    assert {i.world_size for i in infos} == {4}
    assert len({_boot(i) for i in infos}) == 1  # every node: node 0's address
    assert all(h.round == 0 and h.get_backend() == "ctrl" and h.get_run_id() == job.run_id for h in nodes)
    # ranks follow the node ids (host, pid, local id), not who arrived first
    by_rank = sorted(zip((i.rank for i in infos), nodes), key=lambda x: x[0])
    assert [h._local_id for _, h in by_rank] == sorted(h._local_id for h in nodes)
    # node 0 hosts a workers' store at that address
    addr, port = _boot(infos[0])
    dist.TCPStore(HOST, port, is_master=False, wait_for_workers=False).set("probe", "1")
    # the round's store is the round's own namespace
    infos[0].store.set("k", "v")
    assert job.server.get(f"torch.rendezvous.{job.run_id}.0/k") == b"v"
    assert [h.num_nodes_waiting() for h in nodes] == [0] * 4


def test_last_call_admits_what_arrived_after_min_nodes() -> None:
    job = Job(2, 4, last_call_timeout=1.0)
    nodes = [job.node() for _ in range(2)]
    calls = [Call(h.next_rendezvous) for h in nodes]
    infos = [c.result() for c in calls]
    assert {i.world_size for i in infos} == {2}
    assert min(c.elapsed for c in calls) >= 0.9  # waited out the last call for more nodes
    assert max(c.elapsed for c in calls) < 6


def test_last_call_ends_on_time_with_the_default_keep_alive() -> None:
    # The node that starts the last call keeps its time: the round does not wait for the
    # leader's next keep-alive wake (5 s by default) once the last call is over.
    job = Job(2, 3, last_call_timeout=1.0, keep_alive_interval=5.0, keep_alive_max_attempt=3)
    nodes = [job.node() for _ in range(2)]
    calls = [Call(h.next_rendezvous) for h in nodes]
    infos = [c.result() for c in calls]
    assert {i.world_size for i in infos} == {2}
    assert min(c.elapsed for c in calls) >= 0.9
    assert max(c.elapsed for c in calls) < 3.0, [c.elapsed for c in calls]


def test_join_timeout_names_who_joined() -> None:
    job = Job(3, 4, join_timeout=1.5)
    calls = [Call(job.node().next_rendezvous) for _ in range(2)]
    for c in calls:
        with pytest.raises(RendezvousTimeoutError) as err:
            c.result()
        msg = str(err.value)
        assert "\n" not in msg
        assert "2 of min_nodes=3" in msg and "join_timeout=1.5s" in msg, msg
        assert f":{os.getpid()}" in msg  # hosts named as host:pid
        assert c.elapsed < 6


def test_late_joiner_is_admitted_by_the_next_round() -> None:
    """After a round of 2 (min 2, max 3), a third node waits, is counted by num_nodes_waiting()
    on every node, and the next round has world size 3 with its own namespace and address
    (torch's c10d: the third node never returns)."""
    job = Job(2, 3)
    a, b = job.node(), job.node()
    first = join_all([a, b])
    c = job.node()
    late = Call(c.next_rendezvous)
    poll(lambda: a.num_nodes_waiting() == 1 and b.num_nodes_waiting() == 1)
    again = join_all([a, b])  # torch's agent restarts its workers into a new round
    third = late.result()
    infos = [*again, third]
    assert sorted(i.rank for i in infos) == [0, 1, 2] and {i.world_size for i in infos} == {3}
    assert a.round == b.round == c.round == 1
    assert len({_boot(i) for i in infos}) == 1
    assert _boot(infos[0]) != _boot(first[0])  # a fresh bootstrap store for the new round
    infos[0].store.set("k", "round1")
    assert first[0].store.check(["k"]) is False  # nothing of the other round is visible
    assert [h.num_nodes_waiting() for h in (a, b, c)] == [0, 0, 0]


def test_closed_is_seen_everywhere() -> None:
    job = Job(2, 3)
    a, b = job.node(), job.node()
    join_all([a, b])
    waiting = Call(job.node().next_rendezvous)
    poll(lambda: a.num_nodes_waiting() == 1)
    assert not a.is_closed()
    b.set_closed()
    assert a.is_closed() and b.is_closed()
    with pytest.raises(RendezvousClosedError):
        waiting.result()  # woken at once, not after a timeout
    assert waiting.elapsed < 10
    with pytest.raises(RendezvousClosedError):
        a.next_rendezvous()
    with pytest.raises(RendezvousClosedError):
        job.node().next_rendezvous()


def test_shutdown_closes_the_run_like_c10d() -> None:
    job = Job(1, 2)
    a = job.node()
    join_all([a])
    assert a.shutdown() is True
    assert job.node().is_closed()


def test_spares_wait_and_are_admitted_when_a_round_has_room() -> None:
    """max 2: a third node is a spare (not counted as waiting: no restart for nothing); when a
    member re-joins (its workers failed), the next round admits the spare."""
    job = Job(1, 2)
    a, b = job.node(), job.node()
    join_all([a, b])
    spare = job.node()
    call = Call(spare.next_rendezvous)
    poll(lambda: int(job.server.add(f"torch_ctrl/rdzv/{job.run_id}/1/arrived", 0)) == 1)
    assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0
    rejoin_a = Call(a.next_rendezvous)  # a's workers failed: it re-joins
    poll(lambda: b.num_nodes_waiting() >= 2)  # now everyone must restart
    rejoin_b = Call(b.next_rendezvous)
    info = call.result()
    assert info.world_size == 2 and spare.round == 1
    admitted = [c for c in (rejoin_a, rejoin_b) if c.done.wait(5)]
    assert len(admitted) == 1  # the round was full: the last to re-join is now the spare
    left_out = rejoin_b if admitted == [rejoin_a] else rejoin_a
    assert not left_out.done.is_set()
    spare.set_closed()
    with pytest.raises(RendezvousClosedError):
        left_out.result()


def test_a_node_whose_heartbeat_stops_never_holds_a_round_back() -> None:
    """min 2, max 3: one of three arrivals stops heartbeating before the round fills; the other
    two get a round of 2 after the last call (and it is told it was judged dead)."""
    job = Job(2, 3, last_call_timeout=0.5)
    a, b, dead = job.node(), job.node(), job.node()
    dead_call = Call(dead.next_rendezvous)
    poll(lambda: job.server.check([f"torch_ctrl/rdzv/{job.run_id}/0/n/1"]))
    dead._stop_heartbeats()
    limit = job.conf["keep_alive_interval"] * job.conf["keep_alive_max_attempt"]
    hb = f"torch_ctrl/rdzv/{job.run_id}/hb/{dead.node}"
    poll(lambda: time.time() - float(job.server.get(hb).split()[0]) > limit + 0.1)  # its heartbeat is stale
    infos = join_all([a, b])
    assert {i.world_size for i in infos} == {2}
    job.server.set(f"torch_ctrl/rdzv/{job.run_id}/closed", "1")  # release the dead node's thread
    a.set_closed()
    with pytest.raises(RendezvousClosedError):
        dead_call.result()


_NODE = """
import os, sys
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch_ctrl.elastic.ctrl_rendezvous import create_native_handler
port, run_id = int(sys.argv[1]), sys.argv[2]
h = create_native_handler(RendezvousParameters("ctrl", f"127.0.0.1:{port}", run_id, 2, 3, is_host=False,
    keep_alive_interval=0.2, keep_alive_max_attempt=2, last_call_timeout=1.0, join_timeout=20))
info = h.next_rendezvous()
print("ROUND", h.round, info.world_size, flush=True)
sys.stdin.read()
"""


def test_a_member_killed_with_sigkill_is_dropped_by_keep_alive() -> None:
    """Round 0 = two threads + one process; the process is SIGKILLed; the two re-join and get a
    round of 2 within keep_alive_interval * keep_alive_max_attempt + last call (+ slack)."""
    job = Job(2, 3, last_call_timeout=1.0)
    proc = subprocess.Popen(
        [sys.executable, "-c", _NODE, str(job.port), job.run_id],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        a, b = job.node(), job.node()
        poll(lambda: job.server.check([f"torch_ctrl/rdzv/{job.run_id}/0/n/1"]))  # the process has arrived
        infos = join_all([a, b])
        assert proc.stdout is not None and proc.stdout.readline().split() == ["ROUND", "0", "3"]
        assert {i.world_size for i in infos} == {3}
        proc.kill()
        proc.wait()
        start = time.monotonic()
        again = join_all([a, b])
        assert {i.world_size for i in again} == {2} and a.round == b.round == 1
        assert time.monotonic() - start < 8
    finally:
        proc.kill()


# ----------------------------------------------------------------------------- deaths and races


class _Hooked(CountingStore):
    """A node's connection with one call hooked: ``hook(method, args)`` runs before the call."""

    def __init__(self, inner: dist.Store, hook: Callable[[str, tuple], None]) -> None:
        super().__init__(inner)
        self._hook = hook

    def add(self, key: str, value: int) -> int:
        self._hook("add", (key, value))
        return super().add(key, value)

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        self._hook("compare_set", (key, expected_value, desired_value))
        return super().compare_set(key, expected_value, desired_value)


def test_a_spare_takes_the_place_of_a_member_that_died() -> None:
    """max 2, a spare waiting behind the full round; member b dies (heartbeats stop, as after
    SIGKILL). As with c10d, the survivor then counts the spare as waiting (its agent restarts),
    and its re-join forms a round with the spare. Before, the survivor counted 0 for ever."""
    job = Job(1, 2)
    a, b = job.node(), job.node()
    join_all([a, b])
    spare = job.node()
    call = Call(spare.next_rendezvous)
    poll(lambda: int(job.server.add(job.key("1/arrived"), 0)) == 1)
    assert a.num_nodes_waiting() == 0  # b is alive: no restart for nothing
    b._stop_heartbeats()
    job.stale(b)
    poll(lambda: a.num_nodes_waiting() == 1, 10, "the survivor counts the spare")
    again = Call(a.next_rendezvous)
    assert [again.result().world_size, call.result().world_size] == [2, 2] and a.round == spare.round == 1
    a.set_closed()


def test_a_member_that_left_on_purpose_does_not_let_spares_in() -> None:
    """A negative heartbeat is a node that left (its agent finished, and closes the run as it
    goes): the survivor must not restart its workers for the spares then."""
    job = Job(1, 2)
    a, b = job.node(), job.node()
    join_all([a, b])
    call = Call(job.node().next_rendezvous)
    poll(lambda: int(job.server.add(job.key("1/arrived"), 0)) == 1)
    b._stop_heartbeats()
    job.server.set(job.key(f"hb/{b.node}"), f"-{time.time() - 60:.3f} 1")  # b withdrew a minute ago
    counted = []
    until = time.monotonic() + 5 * job.conf["keep_alive_interval"]  # several looks, not one kept
    while time.monotonic() < until:
        counted.append(a.num_nodes_waiting())
    assert set(counted) == {0}
    a.set_closed()
    with pytest.raises(RendezvousClosedError):
        call.result()


def test_a_spare_times_out_once_the_round_it_waited_behind_is_gone() -> None:
    """min=max=2; both members die and the one spare cannot form a round alone: it stops being
    a spare (c10d moves it to the wait list) and fails after join_timeout, instead of never."""
    job = Job(2, 2, join_timeout=2)
    a, b = job.node(join_timeout=20), job.node(join_timeout=20)
    join_all([a, b])
    call = Call(job.node().next_rendezvous)
    poll(lambda: int(job.server.add(job.key("1/arrived"), 0)) == 1)
    a._stop_heartbeats()
    b._stop_heartbeats()
    job.stale(a)
    job.stale(b)
    gone = time.monotonic()
    with pytest.raises(RendezvousTimeoutError, match=r"round 1: 1 of min_nodes=2 .*join_timeout=2s"):
        call.result(20)
    assert time.monotonic() - gone < 2 + 3, "its deadline starts when the round is found gone"


def test_a_node_judged_dead_waits_behind_a_full_round_as_a_spare() -> None:
    """A node whose heartbeat lapsed while a round formed without it is told `d`; the round it
    then waits behind is full, so it waits as a spare does: no join deadline, and a graceful
    exit when the run closes (before, it timed out, or failed when the run closed)."""
    from torch.distributed.elastic.rendezvous.api import RendezvousGracefulExitError

    job = Job(2, 2, join_timeout=3)
    c = job.node()
    slow = Call(c.next_rendezvous)
    poll(lambda: job.server.check([job.key("0/n/1")]))
    c._stop_heartbeats()  # c stalls past dead_after (a frozen VM)
    job.stale(c)
    m1, m2 = job.node(join_timeout=20), job.node(join_timeout=20)
    join_all([m1, m2])
    assert job.server.get(job.key("0/rank/1")) == b"d"
    past = slow.started + 3 + 1.5 - time.monotonic()  # well past the join_timeout of its call
    assert not slow.done.wait(max(past, 0.5)), f"a spare has no join deadline: {slow.error!r}"
    m1.shutdown()  # the job is done
    with pytest.raises(RendezvousGracefulExitError):
        slow.result()


def test_members_that_read_a_stale_open_hint_rejoin_as_members() -> None:
    """The sealer of round 0 wrote the ranks and died before advancing `open`. The survivors
    re-join, meet round 0's seal and move on to round 1, where they are members again (before,
    they arrived there as spares, were never counted, and waited for ever)."""
    job = Job(2, 3)

    def dies(method: str, args: tuple) -> None:
        if method == "compare_set" and args[0].endswith("/open") and str(args[2]).startswith("1,"):
            raise RuntimeError("injected: the sealer's process dies here")

    a, b = job.node(), job.node()
    first = [Call(a.next_rendezvous), Call(b.next_rendezvous)]
    poll(lambda: int(job.server.add(job.key("0/arrived"), 0)) == 2)
    c = job.wrapped(_Hooked(job.client(), dies))
    with pytest.raises(RendezvousConnectionError, match="injected"):
        c.next_rendezvous()
    c._stop_heartbeats()
    assert [f.result().world_size for f in first] == [3, 3]
    assert job.server.get(job.key("open")) == b"0,0"  # the stale hint
    job.stale(c)
    again = join_all([a, b])
    assert [i.world_size for i in again] == [2, 2] and a.round == b.round == 1
    a.set_closed()


def test_a_member_that_rejoined_and_died_is_counted_once() -> None:
    """Round 0 = {a, b, c}; c re-joins and dies, a re-joins; b is alive and still in round 0.
    Round 1 must wait for b (before, c counted both as re-joined and as dead, and round 1 was
    sealed without b); once b re-joins, a and b form it."""
    job = Job(1, 3, last_call_timeout=0.5)
    a, b, c = job.node(), job.node(), job.node()
    join_all([a, b, c])
    Call(c.next_rendezvous)
    poll(lambda: job.server.check([job.key("1/n/1")]))
    c._stop_heartbeats()
    job.stale(c)
    rejoin_a = Call(a.next_rendezvous)
    assert not rejoin_a.done.wait(3), "round 1 formed without b, a live member of round 0"
    rejoin_b = Call(b.next_rendezvous)
    assert [rejoin_a.result().world_size, rejoin_b.result().world_size] == [2, 2]
    a.set_closed()


def test_a_node_that_timed_out_while_its_round_was_sealed_is_not_admitted() -> None:
    """x's join_timeout runs out while the sealer is between its liveness read and closing the
    round: x withdraws and raises, so it must not be in the round (before, it was: the others got
    a world with a node that had left). The round (min 3) cannot form without x: the nodes left
    move on to the next round, and no world holds x."""
    job = Job(3, 3, read_timeout=10)
    x_done = threading.Event()

    def stall(method: str, args: tuple) -> None:
        if method == "add" and args[1] == ctrl_rendezvous.SEALED:
            x_done.wait(30)  # the sealer stalls before closing the round until x has given up

    leader = job.wrapped(_Hooked(job.client(), stall))
    first = Call(leader.next_rendezvous)
    poll(lambda: job.server.check([job.key("0/n/1")]))
    x = job.node(join_timeout=1.5)
    timed_out = Call(x.next_rendezvous)
    poll(lambda: job.server.check([job.key("0/n/2")]))
    third = job.wrapped(_Hooked(job.client(), stall))
    sealer = Call(third.next_rendezvous)
    with pytest.raises(RendezvousTimeoutError):
        timed_out.result()
    x_done.set()
    poll(lambda: job.server.check([job.key("0/seal")]))
    assert job.server.get(job.key("0/seal")) == b"0" and job.server.get(job.key("0/members")) == b""
    assert [job.server.get(job.key(f"0/rank/{k}")) for k in (1, 2, 3)] == [b"d"] * 3
    poll(lambda: int(job.server.add(job.key("1/arrived"), 0)) == 2)  # the two left wait in round 1
    leader.set_closed()
    for call in (first, sealer):
        with pytest.raises(RendezvousClosedError):
            call.result()


@pytest.mark.parametrize("dies_at", ["outcome", "slots"])
def test_a_round_whose_sealer_died_while_sealing_is_sealed_by_its_leader(dies_at: str) -> None:
    """The sealer closed the round to arrivals and died before any node's outcome was written:
    before, the round's nodes waited out join_timeout + read_timeout and failed (spares for ever).
    Now the leader seals it once it has stayed so for dead_after: from who is alive then (the
    sealer died before deciding the outcome), or with the outcome the sealer had decided (it died
    while writing the slots), so that a sealer that was only slow can never hand out another."""
    job = Job(2, 3, last_call_timeout=60)  # only c's arrival completes the round
    decided = dies_at == "slots"

    class Dies(_Hooked):
        def multi_set(self, keys: list[str], values: list[Any]) -> None:
            if any(k.endswith("/seal") for k in keys):
                raise RuntimeError("injected: the sealer's process dies here")
            super().multi_set(keys, values)

    def before_outcome(method: str, args: tuple) -> None:
        if method == "compare_set" and args[0].endswith("/outcome") and not decided:
            raise RuntimeError("injected: the sealer's process dies here")

    a, b = job.node(), job.node()
    waiting = [Call(a.next_rendezvous), Call(b.next_rendezvous)]
    poll(lambda: int(job.server.add(job.key("0/arrived"), 0)) == 2)
    c = job.wrapped(Dies(job.client(), before_outcome))
    with pytest.raises(RendezvousConnectionError, match="injected"):
        c.next_rendezvous()
    c._stop_heartbeats()
    assert int(job.server.add(job.key("0/arrived"), 0)) >= ctrl_rendezvous.SEALED
    assert not job.server.check([job.key("0/seal")])
    infos = [w.result() for w in waiting]
    assert [i.world_size for i in infos] == ([3, 3] if decided else [2, 2]) and a.round == b.round == 0
    members = job.server.get(job.key("0/members")).decode().split("\n")
    assert (c.node in members) == decided and {a.node, b.node} <= set(members)
    a.set_closed()


def test_a_member_lost_in_one_round_is_not_lost_in_the_next() -> None:
    """What the survivor found (b dead, in round 0) belongs to round 0: in round 1, formed with
    the spare, a new spare arriving must not be counted while everyone of round 1 is alive.
    Before, the finding outlived the round for up to keep_alive_interval, and the whole job
    restarted a second time for nothing. (a looks at most every 30 s, so a stale finding would
    be answered; b's last heartbeat is set 1000 s old.)"""
    job = Job(1, 2, keep_alive_max_attempt=50)  # 10 s: a's rare beats never look stale to s1
    a, b = job.node(keep_alive_interval=30.0, keep_alive_max_attempt=2), job.node()
    join_all([a, b])
    s1 = job.node()
    first_spare = Call(s1.next_rendezvous)
    poll(lambda: int(job.server.add(job.key("1/arrived"), 0)) == 1)
    b._stop_heartbeats()
    job.server.set(job.key(f"hb/{b.node}"), f"{time.time() - 1000:.3f} 1")
    assert a.num_nodes_waiting() == 1
    again = Call(a.next_rendezvous)
    assert [again.result().world_size, first_spare.result().world_size] == [2, 2] and a.round == 1
    s2 = job.node()
    Call(s2.next_rendezvous)
    poll(lambda: int(job.server.add(job.key("2/arrived"), 0)) == 1)
    assert a.num_nodes_waiting() == 0  # s1, a's neighbour in round 1, heartbeats
    a.set_closed()


def test_a_spare_whose_round_fell_apart_gets_a_whole_join_timeout() -> None:
    """A spare may wait longer than join_timeout. When the round it then waits in falls apart
    (its nodes die while it is sealed), it goes on as a plain node: with a whole join_timeout
    from then, not the deadline of its call, long past (before, it timed out at once)."""
    job = Job(3, 3, keep_alive_max_attempt=10)  # 2 s before a leader would take over the seal
    go, sealed = threading.Event(), threading.Event()

    class SealsThenStalls(_Hooked):
        def add(self, key: str, value: int) -> int:
            out = super().add(key, value)
            if value == ctrl_rendezvous.SEALED and "/1/" in key:
                sealed.set()
                go.wait(30)  # between closing round 1 and reading who is alive
            return out

    dead, released = threading.Event(), threading.Event()

    def gone(method: str, args: tuple) -> None:
        if dead.is_set():  # the process died: its calls never return (until the test ends)
            released.wait(60)
            raise RuntimeError("gone")

    a = job.wrapped(SealsThenStalls(job.client(), lambda method, args: None))
    b, c = job.wrapped(_Hooked(job.client(), gone)), job.wrapped(_Hooked(job.client(), gone))
    join_all([a, b, c])
    params = config_from(job.params(join_timeout=2))
    spare = Call(NativeRendezvousHandler(params, job.client(), beat_store(HOST, job.port, 60.0)).next_rendezvous)
    poll(lambda: job.server.check([job.key("1/n/1")]))
    assert not spare.done.wait(2.5), "a spare has no join deadline"
    rejoined = [Call(b.next_rendezvous), Call(c.next_rendezvous)]
    poll(lambda: int(job.server.add(job.key("1/arrived"), 0)) & ctrl_rendezvous.COUNT_MASK == 3)
    Call(a.next_rendezvous)
    assert sealed.wait(30)
    dead.set()
    for dying in (b, c):
        dying._stop_heartbeats()
        job.server.set(job.key(f"hb/{dying.node}"), f"{time.time() - 1000:.3f} {dying._attempt}")
    go.set()
    poll(lambda: job.server.check([job.key("1/seal")]))
    assert job.server.get(job.key("1/seal")) == b"0"
    fell_apart = time.monotonic()
    with pytest.raises(RendezvousTimeoutError, match="join_timeout=2s"):
        spare.result(20)
    assert 1.5 < time.monotonic() - fell_apart < 2 + 3, "a whole join_timeout from when it moved on"
    released.set()  # b's and c's threads end
    for call in rejoined:
        call.done.wait(10)
    a.set_closed()


def test_a_beat_on_its_way_never_lands_after_a_withdrawal() -> None:
    """A node that withdraws (its join_timeout ran out) while a heartbeat of its own is being
    sent: that beat must not land after the withdrawal and make it look alive again, or a sealer
    would admit it behind the error it raised. Its heartbeats' connection is made slow."""
    job = Job(3, 3, keep_alive_max_attempt=5)
    sending = threading.Event()

    class SlowBeats(CountingStore):
        def multi_set(self, keys: list[str], values: list[Any]) -> None:
            sending.set()
            time.sleep(0.25)  # the beat is on its way (the delay makes the window certain)
            super().multi_set(keys, values)

    x = NativeRendezvousHandler(config_from(job.params(join_timeout=1.0)), job.client(), SlowBeats(job.client()))
    call = Call(x.next_rendezvous)
    with pytest.raises(RendezvousTimeoutError):
        call.result(20)
    assert sending.is_set()
    hb = job.key(f"hb/{x.node}")
    withdrawn = job.server.get(hb)
    assert withdrawn.startswith(b"-"), withdrawn
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:  # longer than a beat takes to land
        assert job.server.get(hb) == withdrawn


def test_a_node_that_comes_back_to_its_round_holds_one_slot() -> None:
    """x times out of round 0 and joins again (an agent or tool that retries): it lands in round
    0 under a second slot. Only the slot of its current attempt is alive; before, both were
    (liveness was looked up by node, not attempt), x got two ranks, and the round broke."""
    job = Job(2, 3, join_timeout=1.0, read_timeout=3)
    x = job.node()
    with pytest.raises(RendezvousTimeoutError):
        x.next_rendezvous()
    again = Call(x.next_rendezvous)
    poll(lambda: int(job.server.add(job.key("0/arrived"), 0)) == 2)
    y = job.node(join_timeout=20)
    infos = [Call(y.next_rendezvous).result(), again.result()]
    assert [i.world_size for i in infos] == [2, 2] and sorted(i.rank for i in infos) == [0, 1]
    assert job.server.get(job.key("0/rank/1")) == b"d"  # its first attempt's slot
    y.set_closed()


def test_a_deadline_that_comes_while_the_round_is_being_sealed_waits_for_the_take_over() -> None:
    """c closes the round to arrivals shortly before a's and b's join_timeout and dies before
    deciding. Before, a and b withdrew at their deadline and waited read_timeout for an outcome
    nobody wrote (the leader takes over only while it waits); now they wait once more, alive,
    and the leader's take-over gives them the round."""
    job = Job(2, 3, join_timeout=1.5, read_timeout=3, last_call_timeout=60)
    a, b, c = job.node(), job.node(), job.node()
    calls = [Call(h.next_rendezvous) for h in (a, b)]
    poll(lambda: int(job.server.add(job.key("0/arrived"), 0)) == 2)
    close_at = calls[0].started + 1.3
    while time.monotonic() < close_at:  # (the scenario needs the close this late)
        time.sleep(0.02)
    slot = int(job.server.add(job.key("0/arrived"), 1))  # c arrives, closes the round, dies
    record = f"{c._host}\t{os.getpid()}\t{c._local_id}\t1"
    job.server.multi_set([job.key(f"hb/{c.node}"), job.key(f"0/n/{slot}")], [f"{time.time():.3f} 1", record])
    job.server.add(job.key("0/arrived"), ctrl_rendezvous.SEALED)
    assert [call.result().world_size for call in calls] == [2, 2]
    a.set_closed()


# ----------------------------------------------------------------------------- cost


def _per_node_calls(n: int) -> tuple[list[int], list[int]]:
    job = Job(n, n)
    params = job.params()
    beats = beat_store(HOST, job.port, 60.0)
    stores = [MeteredStore(dist.TCPStore(HOST, job.port, is_master=False)) for _ in range(n)]
    nodes = [NativeRendezvousHandler(config_from(params), s, beats) for s in stores]
    idents: list[int] = [0] * n

    def body(i: int) -> Any:
        idents[i] = threading.get_ident()
        return nodes[i].next_rendezvous()

    calls = [Call(lambda i=i: body(i)) for i in range(n)]
    for c in calls:
        c.result()
    return [s.total(i) for s, i in zip(stores, idents)], [s.bytes(i) for s, i in zip(stores, idents)]


def test_join_costs_o1_store_calls_and_bytes_per_node() -> None:
    """The critical path of each node (calls on its own thread): the same at 4 and 32 nodes,
    except for the one node that seals the round (a constant number of calls, O(N) bytes)."""
    small, small_bytes = _per_node_calls(4)
    large, large_bytes = _per_node_calls(32)
    assert sorted(small)[:-1] == [6] * 3 and sorted(large)[:-1] == [6] * 31, (small, large)
    assert max(small) == max(large) <= 13  # the sealer
    # bytes of the non-sealers do not grow with N (only key names and the rank text vary)
    assert sorted(large_bytes)[-2] <= sorted(small_bytes)[-2] + 16, (small_bytes, large_bytes)


# ----------------------------------------------------------------------------- bad input


def test_bad_input_is_one_line_before_anything_is_written() -> None:
    server = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    endpoint = f"{HOST}:{server.port}"

    def params(lo: int = 1, hi: int = 2, **conf: Any) -> RendezvousParameters:
        p = RendezvousParameters("ctrl", endpoint, "bad", 1, 2, is_host=False, **conf)
        p.min_nodes, p.max_nodes = lo, hi  # RendezvousParameters checks these too; ours must as well
        return p

    cases = [
        (params(3, 2), "min_nodes=3 is greater than max_nodes=2"),
        (params(0, 2), "min_nodes=0 must be at least 1"),
        (params(join_timeout="soon"), "join_timeout='soon' is not a number of seconds"),
        (params(last_call_timeout="-1"), "last_call_timeout='-1' must be a positive number"),
        (params(keep_alive_interval="x"), "keep_alive_interval='x'"),
        (params(keep_alive_max_attempt="many"), "keep_alive_max_attempt='many' is not an integer"),
        (params(store_type="file"), "store_type='file' is not supported (only 'tcp')"),
    ]
    for p, text in cases:
        with pytest.raises(ValueError) as err:
            create_native_handler(p)
        assert text in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert server.num_keys() == 0


def test_unreachable_endpoint_fails_within_join_timeout(capfd: pytest.CaptureFixture) -> None:
    p = RendezvousParameters("ctrl", f"{HOST}:{free_port()}", "nobody", 1, 2, is_host=False, join_timeout=2)
    start = time.monotonic()
    with pytest.raises(RendezvousConnectionError) as err:
        create_native_handler(p)
    took = time.monotonic() - start
    assert 1.9 < took < 3.0, took  # join_timeout, not torch's connect loop (which retries past it)
    msg = str(err.value)
    assert "cannot reach the rendezvous store" in msg and "join_timeout=2s" in msg and "\n" not in msg
    assert "refused" in msg.lower(), msg  # the cause a user can act on, not a socket timeout
    assert "Exception raised from" not in capfd.readouterr().err  # no C++ trace per attempt


@pytest.mark.timeout(60)
def test_an_endpoint_that_never_answers_fails_within_join_timeout() -> None:
    """The endpoint accepts connections but never answers (the hosting agent is stopped, or
    another service holds the port): torch's handshake would block for ever."""
    with mute_port() as port:
        p = RendezvousParameters("ctrl", f"{HOST}:{port}", "mute", 1, 2, is_host=False, join_timeout=2)
        start = time.monotonic()
        with pytest.raises(RendezvousConnectionError) as err:
            create_native_handler(p)
        took = time.monotonic() - start
    assert 1.9 < took < 5.0, took
    msg = str(err.value)
    assert "join_timeout=2s" in msg and "did not answer" in msg and "\n" not in msg, msg


def test_a_client_joins_a_host_that_starts_later() -> None:
    port = free_port()
    p = RendezvousParameters("ctrl", f"{HOST}:{port}", "later", 1, 2, is_host=False, join_timeout=20)
    host: list[dist.TCPStore] = []

    def start_host() -> None:  # the host's agent starts a second after this node's (the scenario)
        time.sleep(1.0)
        host.append(dist.TCPStore(HOST, port, is_master=True, wait_for_workers=False))

    t = threading.Thread(target=start_host, daemon=True)
    t.start()
    handler = create_native_handler(p)  # waits for the host instead of failing
    t.join(30)
    assert host and handler.get_backend() == "ctrl"
    handler.shutdown()


def test_a_lost_rendezvous_store_names_the_host_that_served_it(caplog: pytest.LogCaptureFixture) -> None:
    """The agent that hosts the rendezvous store dies: the other nodes' calls fail at once with
    one line naming the store's address and its host (the one to look at), not torch's bare
    socket error."""
    job = Job(2, 2)
    a, b = job.node(), job.node()
    infos = join_all([a, b])
    assert sorted(i.rank for i in infos) == [0, 1]
    del job.server  # the hosting agent is gone
    start = time.monotonic()
    with pytest.raises(RendezvousConnectionError) as err:
        a.num_nodes_waiting()
    assert time.monotonic() - start < 5
    msg = str(err.value)
    assert msg.startswith(f"ctrl rendezvous '{job.run_id}': the rendezvous store at {HOST}:{job.port} is gone: "), msg
    assert f"the torchrun agent that hosts it, on {HOST}, exited or cannot be reached (" in msg, msg
    assert "\n" not in msg, msg
    # Leaving then has nothing to close: the run went with its store. Said at INFO, not as a
    # warning (a failed node's agent routinely outlives the host it notified).
    with caplog.at_level(logging.INFO, logger="torch_ctrl"):
        assert [h.shutdown() for h in (a, b)] == [False, False]
    said = [r for r in caplog.records if "could not be closed" in r.getMessage()]
    assert len(said) == 2 and all(r.levelno == logging.INFO and " is gone: " in r.getMessage() for r in said)


def test_heartbeats_stop_with_one_warning_once_their_connection_is_lost(caplog: pytest.LogCaptureFixture) -> None:
    """The rendezvous store's host is gone while a handler lives on (an agent that outlives
    it, a handler nobody shut down): every beat failed and logged again, with torch's C++
    trace, for as long as the process lived. Now the handler stops beating after the first
    failure, with one warning naming the store."""
    job = Job(1, 1)
    a = job.node()
    join_all([a])
    with caplog.at_level(logging.WARNING, logger="torch_ctrl"):
        del job.server  # the hosting agent is gone
        poll(lambda: id(a) not in ctrl_rendezvous._beater._due, 30, "the handler no longer beating")
    said = [r.getMessage() for r in caplog.records if "heartbeat" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].startswith(
        f"torch_ctrl: rendezvous heartbeats stopped: the connection to the rendezvous store at {HOST}:{job.port} "
        "was lost ("
    ), said


def test_a_stopped_rendezvous_store_never_freezes_the_monitor_loop(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The agent hosting the rendezvous store is stopped (SIGSTOP): torch's client would hold
    num_nodes_waiting(), which torch's agent calls from the loop that watches its workers, for
    as long as the stop lasts (for ever), and shutdown() likewise. Now num_nodes_waiting()
    answers 0 after ASK_BOUND, then at once while its call is unanswered, with one warning
    naming the host; it counts again once the store answers; shutdown() gives up after
    close_timeout."""
    monkeypatch.setattr(ctrl_rendezvous, "ASK_BOUND", 1.0)
    with frozen_server() as (proc, port):
        params = RendezvousParameters("ctrl", f"{HOST}:{port}", f"run{port}", 2, 3, is_host=False, **FAST)
        a, b = create_native_handler(params), create_native_handler(params)
        join_all([a, b])
        assert a.num_nodes_waiting() == 0
        freeze(proc.pid)
        with caplog.at_level(logging.WARNING, logger="torch_ctrl"):
            took = [in_thread(a.num_nodes_waiting, 30) for _ in range(3)]
            assert [value for value, _, _ in took] == [0, 0, 0]
            assert 0.9 <= took[0][2] < 3, took  # the bound
            assert all(seconds < 0.5 for _, _, seconds in took[1:]), took  # its call still unanswered
        said = [r.getMessage() for r in caplog.records if "has not answered" in r.getMessage()]
        assert len(said) == 1, said
        store = f"the rendezvous store at {HOST}:{port}"
        assert f"ctrl rendezvous 'run{port}': {store} has not answered for 1s: " in said[0]
        assert f"the torchrun agent that hosts it, on {HOST}, is stopped or hung" in said[0]

        os.kill(proc.pid, signal.SIGCONT)
        arrive = dist.TCPStore(HOST, port, is_master=False)
        arrive.add(a._k(1, "arrived"), 1)  # a third node waits for the next round
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="torch_ctrl"):
            poll(lambda: a.num_nodes_waiting() == 1, 30, "the waiting node counted again")
        assert any("answers again" in r.getMessage() for r in caplog.records)

        freeze(proc.pid)
        a.config = dataclasses.replace(a.config, close_timeout=1.0)
        with caplog.at_level(logging.WARNING, logger="torch_ctrl"):
            left, error, seconds = in_thread(a.shutdown, 30)
        assert error is None and left is False and seconds < 3, (left, error, seconds)
        assert any(
            f"could not be closed: {store} did not answer within close_timeout=1s" in r.getMessage()
            for r in caplog.records
        )
        b._stop_heartbeats()


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("open", "xyz", "holds a value torch_ctrl did not write"),
        ("open", "0,abc", "holds a value torch_ctrl did not write"),
        ("open", "5", "holds a value torch_ctrl did not write"),
        # TCPStore's server drops a connection whose add meets a value that is not a number
        ("0/arrived", "foo", "dropped this node's connection, though its server is up"),
    ],
)
def test_foreign_values_under_the_run_are_one_line_errors(key: str, value: str, says: str) -> None:
    """Another program (or another version) wrote under this run id: the handler fails at once
    with one RendezvousError line saying so, not a bare ValueError or 'the store is gone'."""
    job = Job(1, 1)
    job.server.set(f"torch_ctrl/rdzv/{job.run_id}/{key}", value)
    node = job.node()
    start = time.monotonic()
    with pytest.raises(RendezvousError) as err:
        node.next_rendezvous()
    assert time.monotonic() - start < 5
    msg = str(err.value)
    assert msg.startswith(f"ctrl rendezvous '{job.run_id}': ") and says in msg and "\n" not in msg, msg
    node.shutdown()


def test_the_registry_creates_the_native_handler() -> None:
    from torch.distributed.elastic.rendezvous import registry

    import torch_ctrl.elastic as elastic

    was = elastic.is_installed()
    job = Job(1, 1)
    try:
        handler = registry.get_rendezvous_handler(job.params())
        assert isinstance(handler, NativeRendezvousHandler) and handler.get_backend() == "ctrl"
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        assert handler.shutdown() is True
    finally:
        if not was:
            elastic.uninstall()


class _TurnProbe:
    """``torch.distributed`` as the rendezvous module sees it, recording for each TCPStore and
    PrefixStore it makes whether the process's turn was held."""

    def __init__(self, seen: list[tuple[str, bool]]) -> None:
        self._seen = seen

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    def _made(self, kind: str, cls: Any, *args: Any, **kwargs: Any) -> Any:
        self._seen.append((kind, _turn_held()))
        return cls(*args, **kwargs)

    def TCPStore(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - torch's name
        return self._made("TCPStore", dist.TCPStore, *args, **kwargs)

    def PrefixStore(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - torch's name
        return self._made("PrefixStore", dist.PrefixStore, *args, **kwargs)


def _turn_held() -> bool:
    """Whether the process's turn is held while a store is made: by this thread, or by the
    thread that waits for this one (a connection bounded by torch_ctrl.bounded.within)."""
    from torch_ctrl import lanes

    if lanes._CONNECT._is_owned():
        return True
    if lanes._CONNECT.acquire(blocking=False):
        lanes._CONNECT.release()
        return False
    return True


def test_handlers_make_their_stores_in_the_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a torch without clone() (2.6, 2.7) a TCPStore constructed while another thread makes or
    frees a torch object can abort the process: handlers joining on several threads (the
    rendezvous benchmark, or an agent next to torch_ctrl's own lanes) make their clients, the
    round's PrefixStore and node 0's workers' store in the process's turn."""
    from torch_ctrl import capabilities
    from torch_ctrl.elastic import ctrl_rendezvous

    monkeypatch.setattr(capabilities, "CLONE", False)  # turn() is the lock, as on torch 2.6
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)  # node 0 hosts a store
    seen: list[tuple[str, bool]] = []
    monkeypatch.setattr(ctrl_rendezvous, "dist", _TurnProbe(seen))
    job = Job(3, 3)
    handlers = [job.node() for _ in range(3)]
    infos = join_all(handlers)
    assert sorted(i.rank for i in infos) == [0, 1, 2]
    # TCPStores: three clients, the process's heartbeat connection, node 0's workers' store;
    # PrefixStores: each node's store of the round
    assert sorted(seen) == [("PrefixStore", True)] * 3 + [("TCPStore", True)] * 5, seen
    for h in handlers:
        h.shutdown()


_FIRST_IMPORT = """
import {module}
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters, registry
server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
params = RendezvousParameters("ctrl", f"127.0.0.1:{{server.port}}", "first", 1, 1, is_host=False, join_timeout=20)
handler = registry.get_rendezvous_handler(params)
info = handler.next_rendezvous()
print(type(handler).__name__, info.rank, info.world_size, handler.shutdown(), flush=True)
"""


@pytest.mark.parametrize(
    "module",
    ["torch_ctrl.elastic.rendezvous", "torch_ctrl.elastic.ctrl_rendezvous", "torch_ctrl.elastic", "torch_ctrl"],
)
def test_the_backend_registers_whatever_a_program_imports_first(module: str) -> None:
    """torch loads its rendezvous plugins while its rendezvous package is first imported, which
    may happen from inside torch_ctrl's rendezvous module: the entry point must still register
    ``ctrl`` (no warning, a working handler) in a fresh process."""
    out = subprocess.run(
        [sys.executable, "-c", _FIRST_IMPORT.format(module=module)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "RES_OPTIONS": "timeout:1 attempts:1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["NativeRendezvousHandler", "0", "1", "True"]
    assert "registering out of tree plugin" not in out.stderr, out.stderr[-2000:]
