"""torch_ctrl.elastic.store against torch's utils/store.py contract, and install()/uninstall().

The first tests are torch's own behavioural tests of ``utils/store.py`` (HashStore and
threads), run against the adapter; torch's MockStore tests pin torch's internal key
protocol, which the adapter deliberately replaces, so they are not ported.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from datetime import timedelta
from multiprocessing.pool import ThreadPool
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from helpers import _CONNECT, Stores, make, run_ranks

import torch_ctrl.elastic as elastic
from torch_ctrl import capabilities
from torch_ctrl import keys as K
from torch_ctrl.elastic import agent
from torch_ctrl.elastic import store as store_util

ADAPTER_KINDS = ["tcp", "file", "hash", "prefix", "python"]


def _keys(stores: Stores) -> int:
    """Keys in the store. A FileStore writes a bookkeeping key the first time one of its
    handles closes: close one first, so that key is in every count."""
    if stores.kind == "file":
        dist.FileStore(stores.path, -1)
    return stores.admin.num_keys()


@pytest.fixture(autouse=True)
def implementation(impl: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run every test with the C++, Python and mixed implementations under the adapter."""
    monkeypatch.setattr(store_util, "StoreCollectives", lambda s, r, w: make(impl, s, r, w))
    return impl


# ------------------------------------------------------------------ torch's tests, ported
def test_synchronize_hash_store() -> None:
    n = 4
    store = dist.HashStore()

    def f(i: int) -> list[bytes]:
        return store_util.synchronize(store, f"data{i}", i, n, key_prefix="test/store")

    with ThreadPool(n) as pool:
        out = pool.map(f, range(n))
    assert out == [[f"data{i}".encode() for i in range(n)]] * n


def test_barrier_hash_store() -> None:
    n = 4
    store = dist.HashStore()
    with ThreadPool(n) as pool:
        out = pool.map(lambda i: store_util.barrier(store, n, key_prefix="test/store"), range(n))
    assert out == [None] * n


def test_barrier_timeout_rank_tracing() -> None:
    """torch: only rank 0 names the missing ranks. Here every rank does."""
    n = 3
    store = dist.HashStore()

    def run_barrier_for_rank(i: int) -> str:
        try:
            store_util.barrier(
                store,
                n,
                key_prefix="test/store",
                barrier_timeout=0.5,
                rank=i,
                rank_tracing_decoder=lambda x: f"Rank {x} host",
                trace_timeout=0.01,
            )
        except dist.DistStoreError as e:
            return str(e)
        return ""

    with ThreadPool(n - 1) as pool:
        outputs = pool.map(run_barrier_for_rank, range(n - 1))
    for rank, msg in enumerate(outputs):
        assert msg.startswith(f"Timed out waiting on barrier on rank {rank}, for key prefix: test/store"), msg
        assert "missing_ranks=[Rank 2 host]" in msg, msg


def test_tracing_requires_rank() -> None:
    store = dist.HashStore()
    with pytest.raises(AssertionError, match="Tracing requires rank information"):
        store_util.barrier(store, 2, key_prefix="x", rank_tracing_decoder=str)
    assert store.num_keys() == 0


# ------------------------------------------------------------------ on every store kind
@pytest.mark.parametrize("kind", ADAPTER_KINDS)
def test_synchronize_is_an_all_gather_and_leaves_no_keys(kind: str) -> None:
    stores, n = Stores(kind), 5
    before = _keys(stores)
    out = run_ranks(n, lambda r: store_util.synchronize(stores.client(r), b"d%d" % r, r, n, key_prefix="sync/"))
    assert out == [[b"d%d" % r for r in range(n)]] * n
    assert _keys(stores) == before


@pytest.mark.parametrize("kind", ADAPTER_KINDS)
def test_barrier_can_reuse_its_prefix(kind: str) -> None:
    stores, n = Stores(kind), 4
    before = _keys(stores)
    for rank_given in (True, False, True):
        run_ranks(n, lambda r, g=rank_given: store_util.barrier(stores.client(r), n, "b", rank=r if g else None))
    assert _keys(stores) == before


@pytest.mark.parametrize("kind", ADAPTER_KINDS)
def test_get_all_reads_the_callers_keys(kind: str) -> None:
    stores, n = Stores(kind), 3
    for r in range(n):
        stores.admin.set(f"data/{r}", f"v{r}")
    before = _keys(stores)
    out = run_ranks(n, lambda r: store_util.get_all(stores.client(r), r, "data/", n))
    assert out == [[b"v0", b"v1", b"v2"]] * n
    assert _keys(stores) == before  # the callers' keys stay, ours are gone
    assert stores.admin.get("data/1") == b"v1"


def test_timeout_names_missing_ranks_on_every_rank_through_the_decoder() -> None:
    stores, n = Stores("tcp"), 4
    hosts = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-c"}
    clients = [stores.client(r) for r in range(2)]

    def body(r: int) -> str:
        # 3 s: a connection the barrier opens may stall the server for the resolver's 1 s
        # (conftest.py), and rank 1 must still arrive before rank 0 gives up.
        with pytest.raises(dist.DistStoreError) as info:
            store_util.barrier(clients[r], n, "tb", 3.0, rank=r, rank_tracing_decoder=hosts.__getitem__)
        return str(info.value)

    msgs = run_ranks(2, body)
    for r, msg in enumerate(msgs):
        assert f"on rank {r}," in msg and "missing_ranks=[node-b, node-c]" in msg, msg
        assert "\n" not in msg


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("kind", "rank_given"), [(k, True) for k in ADAPTER_KINDS] + [("tcp", False)])
def test_a_timed_out_barrier_leaves_no_keys_and_its_prefix_works_again(kind: str, rank_given: bool) -> None:
    """Ranks 0 and 1 of 3 time out (rank 2 never comes): every rank raises, and the last one
    to time out deletes the barrier's keys. Then all three use the same prefix: the barrier
    holds (rank 2 does not pass alone on the old count) and again leaves no keys."""
    stores, n = Stores(kind), 3
    before = _keys(stores)
    clients = [stores.client(r) for r in range(n)]

    def enter(r: int, seconds: float) -> str:
        try:
            store_util.barrier(clients[r], n, "reuse", seconds, rank=r if rank_given else None)
        except dist.DistStoreError as exc:
            return str(exc)
        return "ok"

    msgs = run_ranks(2, lambda r: enter(r, 3.0))
    assert all("Timed out waiting on barrier" in m for m in msgs), msgs
    assert _keys(stores) == before
    assert run_ranks(n, lambda r: enter(r, 30.0)) == ["ok"] * n
    assert _keys(stores) == before


def test_rankless_timeout_reports_arrivals() -> None:
    stores = Stores("tcp")
    with pytest.raises(dist.DistStoreError, match=r"key prefix: lone \(world_size=3, arrived=1"):
        store_util.barrier(stores.client(0), 3, "lone", barrier_timeout=0.3)


def test_only_store_timeout_touches_the_store_timeout() -> None:
    stores, n = Stores("tcp"), 2
    clients = [stores.client(r) for r in range(n)]
    for c in clients:
        c.set_timeout(timedelta(seconds=123))
    run_ranks(n, lambda r: store_util.barrier(clients[r], n, "t1", barrier_timeout=7, rank=r))
    run_ranks(n, lambda r: store_util.synchronize(clients[r], b"x", r, n, "t2", timeout=9))
    assert all(c.timeout == timedelta(seconds=123) for c in clients)
    with pytest.raises(KeyError), store_util.store_timeout(clients[0], 5):
        assert clients[0].timeout == timedelta(seconds=5)
        raise KeyError("restored even when the block raises")
    assert clients[0].timeout == timedelta(seconds=123)


def test_bad_input_fails_before_any_store_write() -> None:
    store = dist.HashStore()
    with pytest.raises(ValueError):
        store_util.synchronize(store, b"x", 3, 2, "p")
    with pytest.raises(TypeError):
        store_util.synchronize(store, 5, 0, 2, "p")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        store_util.barrier(store, 2, key_prefix=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        store_util.barrier(store, 0, "p")
    assert store.num_keys() == 0


# ------------------------------------------------------------------ rank assignment
def test_rank_assignment_matches_torch_with_mixed_roles() -> None:
    """The gather/scatter assignment gives what torch's set/multi_get/multi_set gives."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    specs = [("trainer", 2), ("reader", 1), ("trainer", 3), ("reader", 2)]
    n = len(specs)
    ours_stores, torch_stores = Stores("tcp"), Stores("tcp")
    before = ours_stores.admin.num_keys()
    original = SimpleElasticAgent._assign_worker_ranks

    def ours(r: int) -> list[tuple[int, ...]]:
        spec = SimpleNamespace(role=specs[r][0], local_world_size=specs[r][1])
        me = SimpleNamespace()
        try:
            workers = agent.assign_worker_ranks(original, me, ours_stores.client(r), r, n, spec)
            assert agent.group_of(me).nodes == [(agent.group_of(me).host, c) for _, c in specs]
        finally:
            agent._close(me)
        return [(w.local_rank, w.global_rank, w.role_rank, w.world_size, w.role_world_size) for w in workers]

    def theirs(r: int) -> list[tuple[int, ...]]:
        spec = SimpleNamespace(role=specs[r][0], local_world_size=specs[r][1])
        workers = original(SimpleNamespace(), torch_stores.client(r), r, n, spec)
        return [(w.local_rank, w.global_rank, w.role_rank, w.world_size, w.role_world_size) for w in workers]

    assert run_ranks(n, ours) == run_ranks(n, theirs)
    assert ours_stores.admin.num_keys() == before  # round-scoped keys deleted, no torchelastic/ keys


def test_plan_ranks() -> None:
    assert agent.plan_ranks([("a", 2), ("b", 1), ("a", 1)]) == [[0, 4, 0, 3], [2, 4, 0, 1], [3, 4, 2, 3]]


# ------------------------------------------------------------------ install / uninstall
def _torch_targets() -> dict[str, object]:
    torch_store = importlib.import_module("torch.distributed.elastic.utils.store")
    distributed = importlib.import_module("torch.distributed.elastic.utils.distributed")
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    found: dict[str, object] = {f"store.{n}": getattr(torch_store, n) for n in store_util.__all__}
    found["distributed.barrier"] = distributed.barrier
    for cls, name, _ in agent.hook_table():
        found[f"{cls.__name__}.{name}"] = vars(cls)[name]
    assert SimpleElasticAgent and LocalElasticAgent
    return found


def test_install_replaces_everywhere_and_uninstall_restores_exactly() -> None:
    assert not elastic.is_installed()
    originals = _torch_targets()
    elastic.install()
    elastic.install()  # idempotent
    try:
        now = _torch_targets()
        assert now["store.barrier"] is store_util.barrier
        assert now["distributed.barrier"] is store_util.barrier  # a name imported directly
        if importlib.util.find_spec("torch.distributed.checkpoint._experimental") is not None:  # torch >= 2.9
            barriers = importlib.import_module("torch.distributed.checkpoint._experimental.barriers")
            assert barriers.store_util.barrier is store_util.barrier
        assert all(now[k] is not originals[k] for k in originals)
    finally:
        elastic.uninstall()
    elastic.uninstall()  # idempotent
    assert not elastic.is_installed()
    assert _torch_targets() == originals
    assert all(_torch_targets()[k] is originals[k] for k in originals)


def test_installed_context_manager_and_torch_callers_get_the_adapter() -> None:
    originals = _torch_targets()
    torch_store = importlib.import_module("torch.distributed.elastic.utils.store")
    with elastic.installed():
        store = dist.HashStore()
        with pytest.raises(dist.DistStoreError, match=r"on rank 1, .*missing_ranks=\[0, 2\]"):
            # called through torch's module: rank 1 learns who is missing (torch: only rank 0)
            torch_store.barrier(store, 3, "ctx", barrier_timeout=0.3, rank=1)
    assert _torch_targets() == originals


def test_install_logs_once(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    monkeypatch.setattr(elastic, "_logged", False)
    with caplog.at_level(logging.INFO, logger="torch_ctrl.elastic"):
        for _ in range(2):
            with elastic.installed():
                pass
    assert [r.getMessage() for r in caplog.records].count(
        "torch_ctrl: elastic store utilities and agent hooks installed"
    ) == 1


# ------------------------------------------------------------------ the ctrl rendezvous handler
class _Round:
    """A stand-in for torch's c10d handler after the join: one round on a real TCPStore."""

    def __init__(
        self, server_port: int, rnd: int, rank: int, world: int, address: tuple[str, int], shared: bool = False
    ) -> None:
        from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

        with _CONNECT:  # nodes run on threads: torch 2.6-2.7 abort when they construct clients at once
            store = dist.PrefixStore(f"torch.rendezvous.job.{rnd}", dist.TCPStore("127.0.0.1", server_port))
        self._info = RendezvousInfo(store, rank, world, RendezvousStoreInfo(*address))
        self._state_holder = SimpleNamespace(state=SimpleNamespace(round=rnd))
        self.use_agent_store = shared  # torch's default: the workers share one store across rounds

    def next_rendezvous(self):  # noqa: ANN201
        return self._info


def test_bootstrap_address_comes_from_node_0_of_the_same_round() -> None:
    """Node 1 holds a stale address (torch caches the first round's); the ctrl handler gives it
    the address node 0 of *this* round broadcasts, and exports the round."""
    from torch_ctrl.elastic.rendezvous import CtrlRendezvousHandler

    server = Stores("tcp")
    for rnd, node0 in ((0, ("node-a", 29500)), (1, ("node-b", 29600))):

        def node(rank: int, rnd: int = rnd, node0: tuple[str, int] = node0) -> tuple[object, ...]:
            mine = node0 if rank == 0 else ("stale-address", 1)
            handler = CtrlRendezvousHandler(_Round(server.port, rnd, rank, 2, mine))
            info = handler.next_rendezvous()
            boot = info.bootstrap_store_info
            return handler.round, boot.master_addr, boot.master_port, handler.get_backend()

        assert run_ranks(2, node) == [(rnd, *node0, "ctrl")] * 2
    assert server.admin.num_keys() == 0  # the broadcasts' keys are gone


@pytest.mark.skipif(not capabilities.LIST_KEYS, reason="this torch's TCPStore cannot list the keys to clear")
def test_each_round_starts_with_a_clean_workers_store() -> None:
    """torch shares one workers' store across rounds without a per-attempt prefix: the previous
    attempt's keys (here a dead gloo peer's address) must be gone before new workers start,
    while torch's rendezvous keys stay."""
    from torch_ctrl.elastic.rendezvous import CtrlRendezvousHandler

    rdzv, workers = Stores("tcp"), Stores("tcp")
    workers.admin.set("default_pg/0//cpu/rank_1", "127.0.0.1:15748")
    workers.admin.set(f"torch_ctrl/run/job/round0/{K.PROTOCOL}/w4/_/abort", "1:failed")
    workers.admin.set("torch.rendezvous.job.0/state", "kept")

    def node(rank: int) -> tuple[str, int]:
        handler = CtrlRendezvousHandler(_Round(rdzv.port, 1, rank, 2, ("127.0.0.1", workers.port), shared=True))
        boot = handler.next_rendezvous().bootstrap_store_info
        return boot.master_addr, boot.master_port

    assert run_ranks(2, node) == [("127.0.0.1", workers.port)] * 2
    assert workers.admin.list_keys() == ["torch.rendezvous.job.0/state"]


def test_the_failure_notice_names_root_causes_before_the_workers_torch_stopped() -> None:
    """torchrun stops the rest of a failed worker group with SIGTERM: a worker killed from
    outside (SIGKILL: the OOM killer) or one that exited with a code is the cause, and is
    named first, in the order they failed."""
    import signal

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from torch_ctrl.elastic.agent import _exit, _root_causes_first

    def failed(rank: int, code: int) -> ProcessFailure:
        return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code, error_file="")

    term, kill = -int(signal.SIGTERM), -int(signal.SIGKILL)
    failures = {0: failed(0, term), 1: failed(1, term), 2: failed(2, kill)}
    assert [r for r, _ in _root_causes_first(failures)] == [2, 0, 1]
    assert _exit(2, failures[2]) == "rank 2: killed by SIGKILL"
    failures = {0: failed(0, term), 3: failed(3, 3), 1: failed(1, kill)}
    first, second, third = _root_causes_first(failures)
    assert {first[0], second[0]} == {1, 3} and third[0] == 0  # causes by time, then the stopped
    assert first[1].timestamp <= second[1].timestamp


@pytest.mark.parametrize(("cause", "aborter"), [(3, 3), (0, 0), (None, 2), (7, 2)])
def test_the_workers_notice_comes_from_the_rank_that_failed(cause: int | None, aborter: int) -> None:
    """A failed node aborts its workers' collectives on behalf of the worker whose failure is
    the root cause (rank 3, not the node's first worker, whom torch only SIGTERMed); a cause
    that is not one of this node's workers falls back to its first worker."""
    import torch_ctrl
    from torch_ctrl import CollectiveAbortedError

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    workers = [SimpleNamespace(global_rank=r, world_size=4) for r in (2, 3)]
    worker_group = SimpleNamespace(workers=workers, master_addr="127.0.0.1", master_port=server.port)
    group = SimpleNamespace(worker_namespace="torch_ctrl/run/x/round0")
    agent._abort_workers(worker_group, group, "node 1 on host h failed: rank 3: exit code 3", cause)
    peer = dist.PrefixStore(group.worker_namespace, dist.TCPStore("127.0.0.1", server.port, is_master=False))
    with torch_ctrl.StoreCollectives(peer, 0, 4) as coll, pytest.raises(CollectiveAbortedError) as info:
        coll.barrier("b", timeout=timedelta(seconds=30))
    assert info.value.rank == aborter, str(info.value)
    assert f"aborted by rank {aborter}: node 1 on host h failed" in str(info.value)


def test_aborting_the_workers_gives_up_on_a_store_that_does_not_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent that found a node lost aborts the workers' collectives from torch's monitor
    loop: a workers' store that accepts connections but never answers (the agent hosting it
    stopped) holds it for ABORT_BOUND at most, and a store that is gone (refused) not at all."""
    import time

    from helpers import free_port, mute_port

    monkeypatch.setattr(agent, "ABORT_BOUND", 1.5)
    group = SimpleNamespace(worker_namespace="torch_ctrl/run/x/round0")
    workers = [SimpleNamespace(global_rank=r, world_size=4) for r in (2, 3)]
    with mute_port() as port:
        worker_group = SimpleNamespace(workers=workers, master_addr="127.0.0.1", master_port=port)
        started = time.monotonic()
        agent._abort_workers(worker_group, group, "node 0 on host h lost", 0)
        assert 1.5 <= time.monotonic() - started < 10
    worker_group = SimpleNamespace(workers=workers, master_addr="127.0.0.1", master_port=free_port())
    started = time.monotonic()
    agent._abort_workers(worker_group, group, "node 0 on host h lost", 0)
    assert time.monotonic() - started < 3  # the plain-socket check: 1 s of refusals, no torch connect loop


@pytest.mark.parametrize(
    ("raw", "seconds"), [("2.5", 2.5), ("0", 0.0), ("inf", 5.0), ("nan", 5.0), ("-1", 5.0), ("x", 5.0)]
)
def test_notice_linger_from_the_environment(monkeypatch: pytest.MonkeyPatch, raw: str, seconds: float) -> None:
    """TORCH_CTRL_NOTICE_LINGER: a finite number of seconds >= 0, else the default (an
    infinite linger would keep a failed node from exiting; the notice's bound adds to it)."""
    monkeypatch.setenv("TORCH_CTRL_NOTICE_LINGER", raw)
    assert agent._env_seconds("TORCH_CTRL_NOTICE_LINGER", 5.0) == seconds


@pytest.mark.parametrize(
    ("raw", "seconds"),
    [("0.5", 0.5), ("0", 0.0), ("3600", 3600.0), ("7200", 5.0), ("0.001", 5.0), ("-1", 5.0), ("abc", 5.0)],
)
def test_agent_heartbeat_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, raw: str, seconds: float
) -> None:
    """TORCH_CTRL_AGENT_HEARTBEAT: 0 (off) or what a collective accepts, 0.01-3600 s. Out of
    range it used to stop the whole launch with a ValueError that did not name the variable;
    now, as for a non-number, the default with a warning that names it and the range."""
    from torch_ctrl.base import MAX_HEARTBEAT, MIN_HEARTBEAT

    monkeypatch.setenv("TORCH_CTRL_AGENT_HEARTBEAT", raw)
    with caplog.at_level(logging.WARNING, logger="torch_ctrl"):
        got = agent._env_seconds("TORCH_CTRL_AGENT_HEARTBEAT", 5.0, MIN_HEARTBEAT, MAX_HEARTBEAT)
    assert got == seconds
    warned = [r.getMessage() for r in caplog.records if "TORCH_CTRL_AGENT_HEARTBEAT" in r.getMessage()]
    if got == float(raw.replace("abc", "nan")):
        assert not warned
    else:
        said = f"torch_ctrl: TORCH_CTRL_AGENT_HEARTBEAT={raw!r} is not a number of seconds >= 0 (0, or 0.01 to 3600)"
        assert warned == [f"{said}; using 5"]
