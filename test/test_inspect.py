"""``torch_ctrl.inspect`` / ``torch-ctrl inspect``: real groups stuck in every collective
(threads and processes), a SIGKILLed rank with heartbeats on, an aborted group, a store
that cannot list its keys, a 512-rank group's keys, a torchrun job stuck in a worker
barrier; and proof that inspecting writes nothing."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from helpers import HOST, DictStore, Node, Stores, free_port, poll

import torch_ctrl
from torch_ctrl import CollectiveAbortedError, StoreCollectives, capabilities
from torch_ctrl import keys as K
from torch_ctrl.inspect_text import render
from torch_ctrl.inspection import Inspector

WORLD = 4
# Enumerating a live store needs list_keys (torch 2.10+); elsewhere inspect says what it cannot
# enumerate (test_store_that_cannot_list_keys).
needs_list_keys = pytest.mark.skipif(not capabilities.LIST_KEYS, reason="this torch's TCPStore cannot list its keys")
OPS = ("barrier", "broadcast", "gather", "scatter", "all_gather", "all_sum")


def dump(store: dist.Store) -> dict[str, bytes]:
    """Every key and value of a TCPStore (list_keys + multi_get)."""
    keys = sorted(store.list_keys())
    return dict(zip(keys, (bytes(v) for v in store.multi_get(keys)))) if keys else {}


# What docs/inspect.md promises for every op in flight, whatever it is (null where it does not apply).
OP_FIELDS = {
    "key", "token", "op", "candidates", "world_size", "arrived", "blocked", "missing", "unnamed",
    "aborted", "root", "slots", "detail", "other_world_sizes", "pending_s", "unchanged_s",
}  # fmt: skip


def ops_by_key(report: dict[str, Any], world: int = WORLD) -> dict[str, dict[str, Any]]:
    ops = {op["key"]: op for g in report["groups"] if g["world_size"] == world for op in g["in_flight"]}
    for op in ops.values():
        assert set(op) == OP_FIELDS, sorted(set(op) ^ OP_FIELDS)
    return ops


def block(coll: Any, rank: int, op: str, timeout: float = 60) -> None:
    """Enter ``op`` under key ``op`` (the ranks of EXPECTED) and stay blocked until released."""
    try:
        if op == "barrier":
            coll.barrier(op, timeout)
        elif op == "broadcast":
            coll.broadcast_recv(op, timeout)
        elif op == "gather":
            coll.gather_recv(op, b"x", timeout) if rank == 0 else coll.gather_send(op, b"x", timeout)
        elif op == "scatter":
            coll.scatter_recv(op, timeout)
        elif op == "all_gather":
            coll.all_gather(op, b"host-%d" % rank, timeout)
        else:
            coll.all_sum(op, rank, timeout)
    except CollectiveAbortedError:
        pass  # the test's release


# op -> (ranks taking part, expected kind in candidates, arrived, blocked, missing)
EXPECTED = {
    "barrier": ((0, 1, 3), "barrier", 3, [0, 1, 3], [2]),
    "broadcast": ((1, 2), "broadcast", 2, [1, 2], [0, 3]),
    "gather": ((0, 1), "gather", 2, [0], [2, 3]),
    "scatter": ((2, 3), "scatter", 2, [2, 3], [0, 1]),
    "all_gather": ((0, 2), "all_gather", 2, [0, 2], [1, 3]),
    "all_sum": ((1, 3), "all_sum", 2, [1, 3], [0, 2]),
}


def stuck_everywhere(report: dict[str, Any]) -> bool:
    ops = ops_by_key(report)
    return all(k in ops and ops[k]["blocked"] == exp[3] for k, exp in EXPECTED.items())


def stuck_group(stores: Stores) -> tuple[list[Any], list[threading.Thread], dict[str, Any]]:
    """A group of WORLD ranks (threads) blocked in every collective as EXPECTED says, and the
    first report that shows all of them stuck."""
    colls = [StoreCollectives(stores.client(r), r, WORLD) for r in range(WORLD)]
    threads = [
        threading.Thread(target=block, args=(colls[r], r, op), daemon=True)
        for op, (ranks, *_) in EXPECTED.items()
        for r in ranks
    ]
    for t in threads:
        t.start()
    report = poll(
        lambda: (lambda r: r if stuck_everywhere(r) else None)(torch_ctrl.inspect(stores.admin, interval=0, timeout=30))
    )
    return colls, threads, report


def check_stuck(report: dict[str, Any]) -> None:
    ops = ops_by_key(report)
    for key, (_, kind, arrived, blocked, missing) in EXPECTED.items():
        op = ops[key]
        assert kind in op["candidates"] and kind in op["op"], op
        assert (op["arrived"], op["blocked"], op["missing"]) == (arrived, blocked, missing), op
        assert op["world_size"] == WORLD and op["pending_s"] >= 0
    assert ops["barrier"]["op"] == "barrier"
    assert ops["all_gather"]["op"] == "all_gather" and ops["all_sum"]["op"] == "all_sum"
    assert ops["gather"]["op"] == "gather" and ops["gather"]["root"] == 0


@needs_list_keys
@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["tcp", "prefix"])
def test_ranks_given_different_world_sizes_are_pointed_out(kind: str) -> None:
    """Ranks 0 and 1 told the group has 2 ranks, rank 2 told 3: two groups, each stuck in
    barrier 'ws'. The report marks the op in each group with the other's size."""
    stores = Stores(kind)
    worlds = [2, 2, 3]
    colls = [StoreCollectives(stores.client(r), r if r < 2 else 2, worlds[r]) for r in range(3)]
    colls[1].close()  # rank 1 of the group of 2 never comes: both groups stay stuck
    threads = [threading.Thread(target=block, args=(colls[r], r, "barrier")) for r in (0, 2)]
    for t in threads:
        t.start()
    try:

        def both_in_flight() -> dict[str, Any] | None:
            report = torch_ctrl.inspect(stores.admin, interval=0, timeout=30)
            return report if sum(len(g["in_flight"]) for g in report["groups"]) == 2 else None

        report = poll(both_in_flight, what="both groups in flight")
        sizes = {g["world_size"]: g["in_flight"][0].get("other_world_sizes") for g in report["groups"]}
        assert sizes == {2: [3], 3: [2]}, report["groups"]
        text = render(report)
        assert "also in flight with world_size 3: ranks given different world sizes?" in text, text
        assert "also in flight with world_size 2: ranks given different world sizes?" in text, text
    finally:
        colls[0].abort("test over")
        colls[2].abort("test over")
        for t in threads:
            t.join(30)
        for c in colls:
            c.close()
    assert not any(t.is_alive() for t in threads)


@needs_list_keys
@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["tcp", "tcp_nolibuv", "prefix"])
def test_threads_stuck_in_every_collective_then_aborted(kind: str) -> None:
    stores = Stores(kind)
    colls, threads, report = stuck_group(stores)
    admin = stores.admin
    check_stuck(report)
    group = report["groups"][0]
    assert group["abort"] is None and group["heartbeats"] is None and group["prefix"] == ""

    # Through the server's address, two samples: the same ops, seen pending for the interval,
    # without progress; a PrefixStore's groups carry its prefix.
    report = torch_ctrl.inspect(f"{HOST}:{stores.port}", interval=0.3, timeout=30)
    group = report["groups"][0]
    if kind == "prefix":
        assert group["prefix"] == "job/" and group["namespace"] == {"kind": "prefix"}
    check_stuck(report)
    for op in ops_by_key(report).values():
        assert op["pending_s"] >= 0.3 and op["unchanged_s"] == op["pending_s"]
    text = render(report)
    assert "barrier 'barrier'; 3/4 arrived; blocked: [0, 1, 3]; missing: [2]" in text, text
    assert "all_sum" in text and "gather 'gather'" in text

    # The abort: every blocked rank is released, and the report names who and why.
    colls[3].abort("disk full")
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    report = torch_ctrl.inspect(admin, interval=0, timeout=30)
    group = report["groups"][0]
    assert group["abort"] == {"rank": 3, "reason": "disk full"}
    assert "ABORTED by rank 3: disk full" in render(report)
    if kind != "prefix" and capabilities.BARRIER:  # a server-side barrier's counter carries the abort
        assert ops_by_key(report)["barrier"]["aborted"]
    for c in colls:
        c.close()


@needs_list_keys
@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["hash", "file"])
def test_generic_path_stuck_in_every_collective(kind: str) -> None:
    """The generic path's keys (every store but a TCPStore with a server-side barrier, so also
    every TCPStore before torch 2.12) tell the six ops apart as well: an add-based all_sum is
    not a barrier."""
    stores = Stores(kind)
    colls, threads, report = stuck_group(stores)
    check_stuck(report)
    assert "all_sum 'all_sum'; 2/4 arrived; blocked: [1, 3]; missing: [0, 2]" in render(report)
    colls[3].abort("disk full")
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    report = torch_ctrl.inspect(stores.admin, interval=0, timeout=30)
    assert report["groups"][0]["abort"] == {"rank": 3, "reason": "disk full"}
    # The abort notice in a done flag marks the op aborted, not finished; its counter still counts.
    ops = ops_by_key(report)
    assert ops["barrier"]["aborted"] and ops["barrier"]["arrived"] == 3, ops.get("barrier")
    assert ops["all_sum"]["aborted"] and ops["all_sum"]["arrived"] == 2, ops.get("all_sum")
    # The notice in every slot of the all_gather: aborted, not finished (who arrived went with them).
    assert ops["all_gather"]["aborted"] and ops["all_gather"]["arrived"] is None, ops.get("all_gather")
    assert report["groups"][0]["finished_awaiting_cleanup"] == 0
    text = render(report)
    assert "barrier 'barrier'; 3/4 arrived; ABORTED; seen" in text and "all_sum 'all_sum'; 2/4 arrived; ABORTED" in text
    assert "all_gather 'all_gather'; ABORTED; released by the abort; its slots hold the notice" in text
    for c in colls:
        c.close()


@needs_list_keys
def test_inspecting_writes_nothing() -> None:
    """Byte-for-byte the same store before and after, with ops in flight, heartbeats, an
    abort notice and torchrun-like keys; and only read calls reach a Python store."""
    stores = Stores("tcp")
    colls, threads, _ = stuck_group(stores)
    admin = stores.admin
    admin.set(K.group_key(2, "hb/0"), b"7")  # a second group: heartbeat counters, an abort notice
    admin.set(K.group_key(2, "hb/1"), b"9")
    admin.set(K.abort_key(2), b"1:gone")
    admin.set("torch.rendezvous.r1", b"Y2FuaW1hZGFt")
    before = dump(admin)
    report = torch_ctrl.inspect(f"{HOST}:{stores.port}", interval=0.2, timeout=30)
    assert dump(admin) == before
    assert {g["world_size"] for g in report["groups"]} == {2, WORLD}
    assert report["torchrun"][0]["run_id"] == "r1" and report["torchrun"][0]["state"] is None

    class Recording(DictStore):
        calls: set[str] = set()

        def __getattribute__(self, name: str) -> Any:
            if not name.startswith("_"):
                type(self).calls.add(name)
            return super().__getattribute__(name)

    py = Recording()
    for key, value in before.items():
        py.set(key, value)
    Recording.calls.clear()
    torch_ctrl.inspect(py, interval=0.1, prefix=K.PROTOCOL + "/w2/")
    assert Recording.calls <= {"check", "get", "multi_get", "list_keys", "num_keys", "clone", "set_timeout"}
    colls[0].abort("test over")
    for t in threads:
        t.join(30)
    for c in colls:
        c.close()


def _process_rank(port: int, rank: int, ops: list[str], ready: Any, done: Any) -> None:
    import threading

    import torch.distributed as dist

    from torch_ctrl import StoreCollectives

    coll = StoreCollectives(dist.TCPStore("127.0.0.1", port, is_master=False), rank, WORLD)
    threads = [threading.Thread(target=block, args=(coll, rank, op), daemon=True) for op in ops]
    for t in threads:
        t.start()
    ready.put(rank)
    for t in threads:
        t.join(60)
    coll.close()
    done.put(rank)


@needs_list_keys
@pytest.mark.timeout(90)
def test_every_group_on_a_store_is_shown_and_prefix_narrows() -> None:
    """Four groups on one server, each with a rank blocked in a barrier: one on the store
    itself and three under PrefixStores. Every report shows all four (the CLI's too), whatever
    order the server lists the keys in; ``prefix`` keeps only the groups under it."""
    stores = Stores("tcp")
    prefixes = ["", "jobA/", "jobB/", "jobC/"]
    colls = [
        StoreCollectives(dist.PrefixStore(p[:-1], stores.client(0)) if p else stores.client(0), 0, 2) for p in prefixes
    ]
    threads = [threading.Thread(target=block, args=(c, 0, "barrier"), daemon=True) for c in colls]
    for t in threads:
        t.start()
    try:

        def stuck(report: dict[str, Any]) -> dict[str, list[str]]:
            return {g["prefix"]: [op["key"] for op in g["in_flight"]] for g in report["groups"]}

        everyone = dict.fromkeys(prefixes, ["barrier"])

        def all_stuck() -> dict[str, Any] | None:
            report = torch_ctrl.inspect(stores.admin, interval=0)
            return report if stuck(report) == everyone else None

        report = poll(all_stuck, what="four groups blocked")
        assert stuck(report) == everyone
        assert stuck(torch_ctrl.inspect(stores.admin, interval=0, prefix="jobB/")) == {"jobB/": ["barrier"]}
        assert set(stuck(torch_ctrl.inspect(stores.admin, interval=0, prefix="job"))) == {"jobA/", "jobB/", "jobC/"}
        # The parser alone, on the keys in every order the server could list them.
        from itertools import permutations

        from torch_ctrl.inspection import _parse

        names = sorted(stores.admin.list_keys())
        for order in permutations(sorted({k.split("torch_ctrl/")[0] for k in names})):
            listed = [k for p in order for k in names if k.split("torch_ctrl/")[0] == p]
            assert {where for where, _ in _parse(listed)[0]} == set(prefixes), order
        out = subprocess.run(
            [sys.executable, "-m", "torch_ctrl", "inspect", f"{HOST}:{stores.port}", "--interval", "0"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        for p in ("jobA/", "jobB/", "jobC/"):
            assert f"(prefix '{p}')" in out.stdout, out.stdout
        assert out.stdout.count("barrier 'barrier'") == 4, out.stdout
    finally:
        for c in colls:
            c.abort("test over")
        for t in threads:
            t.join(30)
        for c in colls:
            c.close()
    assert not any(t.is_alive() for t in threads)


@needs_list_keys
@pytest.mark.timeout(120)
def test_processes_stuck_in_every_collective() -> None:
    """The same ops as the threads test, each rank a spawned process."""
    server = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    ready, done = ctx.Queue(), ctx.Queue()
    plan = {r: [op for op, (ranks, *_) in EXPECTED.items() if r in ranks] for r in range(WORLD)}
    procs = [ctx.Process(target=_process_rank, args=(server.port, r, plan[r], ready, done)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.get(timeout=60)
        report = poll(
            lambda: (lambda r: r if stuck_everywhere(r) else None)(
                torch_ctrl.inspect(f"{HOST}:{server.port}", interval=0, timeout=30)
            )
        )
        check_stuck(report)
        StoreCollectives(dist.TCPStore(HOST, server.port, is_master=False), 0, WORLD).abort("release")
        for _ in procs:
            done.get(timeout=60)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def _beating_rank(port: int, rank: int, ready: Any, release: Any) -> None:
    import threading

    import torch.distributed as dist

    from torch_ctrl import CollectiveAbortedError, StoreCollectives

    coll = StoreCollectives(dist.TCPStore("127.0.0.1", port, is_master=False), rank, 3, heartbeat_interval=0.2)
    ready.put(rank)
    if rank == 2:  # SIGKILLed by the test; never touches a queue's lock again (it would die holding it)
        threading.Event().wait(120)
        return
    try:
        coll.barrier("wait-for-2", timeout=60)
    except CollectiveAbortedError as exc:
        ready.put(("aborted", rank, exc.rank))
    release.get(timeout=60)  # keep beating until the test has looked
    coll.close()


@needs_list_keys
@pytest.mark.timeout(120)
def test_sigkilled_rank_with_heartbeats() -> None:
    server = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    ready, release = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_beating_rank, args=(server.port, r, ready, release)) for r in range(3)]
    for p in procs:
        p.start()
    try:
        assert sorted(ready.get(timeout=60) for _ in procs) == [0, 1, 2]
        before = torch_ctrl.inspect(f"{HOST}:{server.port}", interval=0.6, timeout=30)
        hb = before["groups"][0]["heartbeats"]
        assert hb["stopped"] == [] and [r["status"] for r in hb["ranks"]] == ["ok"] * 3, hb
        os.kill(procs[2].pid, signal.SIGKILL)
        procs[2].join(10)
        report = torch_ctrl.inspect(f"{HOST}:{server.port}", interval=1.0, timeout=30)
        hb = report["groups"][0]["heartbeats"]
        assert hb["stopped"] == [2], hb
        dead = hb["ranks"][2]
        assert dead["status"] == "stopped" and dead["age_s"] >= 1.0 and dead["others_beats_since"] >= 3
        assert "STOPPED: [2]" in render(report)
        # The blocked peers declare rank 2 dead themselves (within 5 intervals) and abort.
        aborted = poll(
            lambda: (lambda g: g["abort"])(
                torch_ctrl.inspect(f"{HOST}:{server.port}", interval=0, timeout=30)["groups"][0]
            )
        )
        assert aborted["rank"] == 2 and "no heartbeat" in aborted["reason"]
        assert ready.get(timeout=30)[0] == "aborted"
    finally:
        for _ in procs:
            release.put(None)
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def test_store_that_cannot_list_keys() -> None:
    store = DictStore()  # like EtcdStore: no list_keys
    coll = StoreCollectives(store, 0, 2, heartbeat_interval=timedelta(seconds=30))
    coll.abort("node lost")
    report = torch_ctrl.inspect(store, interval=0)
    assert not report["enumerable"]
    assert "cannot list its keys" in report["limitations"][0]
    assert "cannot list its keys" in render(report)
    group = report["groups"][0]
    assert group["world_size"] == 2 and group["abort"] == {"rank": 0, "reason": "node lost"}
    assert [r["rank"] for r in group["heartbeats"]["ranks"]] == [0]
    coll.close()
    # Under a prefix, as from_env() namespaces a round.
    prefixed = StoreCollectives(dist.PrefixStore("torch_ctrl/run/-/round3", store), 1, 3)
    prefixed.abort("x")
    report = torch_ctrl.inspect(store, interval=0, prefix="torch_ctrl/run/-/round3/")
    assert [(g["world_size"], g["abort"]["reason"]) for g in report["groups"]] == [(3, "x")]
    assert report["groups"][0]["namespace"] == {"kind": "workers", "run_id": None, "round": 3}


@needs_list_keys
def test_512_ranks_and_thousands_of_finished_ops_in_under_a_second() -> None:
    """The keys a 512-rank group writes (heartbeats, a barrier 500/512 arrived, an all_gather
    log of 300 frames) next to 3000 finished ops' leftover keys: one sample in under a second,
    and a readable text (rank lists folded)."""
    n = 512
    server = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    writer = dist.TCPStore(HOST, server.port, is_master=False)
    root = K.group_root(n)
    keys, values = [], []
    keys += [K.group_key(n, f"hb/{r}") for r in range(n)]
    values += [b"5"] * n
    keys += [f"{root}/kstep/{K.BARRIER}", f"{root}/kstep/{K.NAMES}"]
    values += [b"500", b"".join(b"%d," % r for r in range(500))]
    keys += [f"{root}/khosts/{K.LOG}", f"{root}/khosts/{K.BARRIER}"]
    values += [b"".join(K.frame(r, b"Dhost-%d" % r) for r in range(300)), b"300"]
    for i in range(3000):  # finished ops: counters at N awaiting their deletion, exit counters
        keys.append(f"{root}/s{i}/{K.BARRIER if i % 2 else K.EXIT}")
        values.append(b"%d" % n)
    writer.multi_set(keys, values)
    report = torch_ctrl.inspect(f"{HOST}:{server.port}", interval=0.2, timeout=30)
    assert report["client_s"] < 1.0, report["client_s"]
    group = report["groups"][0]
    ops = ops_by_key(report, n)
    assert set(ops) == {"step", "hosts"} and group["finished_awaiting_cleanup"] == 3000
    assert ops["step"]["arrived"] == 500 and ops["step"]["missing"] == list(range(500, 512))
    assert ops["hosts"]["arrived"] == 300 and len(ops["hosts"]["missing"]) == 212
    text = render(report)
    assert len(text.splitlines()) < 30, text
    assert "and 196 more" in text and max(len(line) for line in text.splitlines()) < 400
    # Counters that never move (and declare no interval): none is counted as beating.
    assert "heartbeats: over 0." in text and "s, 0/512 ranks beating, 512 not seen beating yet" in text, text


@needs_list_keys
@pytest.mark.timeout(180)
def test_torchrun_job_stuck_in_a_worker_barrier() -> None:
    """One torchrun node (ctrl backend, 3 workers); rank 1 never reaches the barrier the others
    wait in. Inspecting the rendezvous endpoint shows the run, its round, the node, and (through
    the workers' store it names) the stuck barrier."""
    port = free_port()
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchrun", "stuck_worker.py")
    args = [
        "--nnodes=1",
        "--nproc-per-node=3",
        "--rdzv-backend=ctrl",
        f"--rdzv-endpoint={HOST}:{port}",
        "--rdzv-id=inspectme",
        "--monitor-interval=0.1",
        script,
    ]
    node = Node(args, {"RES_OPTIONS": "timeout:1 attempts:1"}, ["-m", "torch.distributed.run"])
    try:
        node.wait_for("RANK 1 STALLING", 90)

        insp = Inspector(f"{HOST}:{port}", timeout=30)  # one connection for every poll

        def stuck() -> dict[str, Any] | None:
            report = insp.sample()
            workers = [g for g in report["groups"] if g["namespace"]["kind"] == "workers"]
            ops = [op for g in workers for op in g["in_flight"] if op["blocked"] == [0, 2]]
            return report if ops else None

        report = poll(stuck, 60, "workers blocked in the barrier")
        run = report["torchrun"][0]
        assert run["run_id"] == "inspectme" and run["rendezvous"] == "ctrl"
        assert run["round"] == 0 and run["failure"] is None
        assert run["state"]["complete"] and len(run["state"]["nodes"]) == 1
        assert run["workers_store"] and run["workers_store_error"] is None
        workers = next(g for g in report["groups"] if g["namespace"]["kind"] == "workers")
        assert workers["namespace"] == {"kind": "workers", "run_id": "inspectme", "round": 0}
        op = workers["in_flight"][0]
        assert (op["op"], op["key"], op["arrived"], op["missing"]) == ("barrier", "stuck", 2, [1])
        agents = next(g for g in report["groups"] if g["namespace"]["kind"] == "agents")
        assert agents["world_size"] == 1 and agents["heartbeats"] is not None
        out = subprocess.run(
            [sys.executable, "-m", "torch_ctrl", "inspect", f"{HOST}:{port}", "--interval", "0", "--timeout", "30"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert "torchrun run 'inspectme' (ctrl rendezvous): round 0" in out.stdout
        assert "barrier 'stuck'; 2/3 arrived; blocked: [0, 2]; missing: [1]" in out.stdout, out.stdout

        # docs/inspect.md's example: --prefix of the round's namespace on the rendezvous
        # endpoint applies to the workers' store it leads to (it found nothing: the prefix
        # filtered out the rendezvous keys that name that store).
        namespace = "torch_ctrl/run/inspectme/round0/"
        cmd = [sys.executable, "-m", "torch_ctrl", "inspect", f"{HOST}:{port}", "--prefix", namespace]
        out = subprocess.run([*cmd, "--interval", "0", "--timeout", "30"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "torchrun run 'inspectme' (ctrl rendezvous): round 0" in out.stdout, out.stdout
        assert "barrier 'stuck'; 2/3 arrived; blocked: [0, 2]; missing: [1]" in out.stdout, out.stdout
        assert "torchrun agents" not in out.stdout and "no torch_ctrl group found" not in out.stdout, out.stdout
        report = torch_ctrl.inspect(f"{HOST}:{port}", interval=0, timeout=30, prefix=namespace)
        assert [g["prefix"] for g in report["groups"]] == [namespace], report["groups"]
        # Another run's namespace: neither this run nor its groups.
        other = torch_ctrl.inspect(f"{HOST}:{port}", interval=0, timeout=30, prefix="torch_ctrl/run/other/round0/")
        assert other["torchrun"] == [] and other["groups"] == [], other
    finally:
        node.kill()


@pytest.mark.timeout(30)
def test_a_key_deleted_after_its_check_does_not_stall_a_sample() -> None:
    """On a live job a listed and checked key can be deleted by its group's cleanup before it
    is read, and TCPStore's multi_get would then wait for it until the connection's timeout
    (``--timeout``): a sample froze for that long. The batch read of a connection of the
    inspector's own waits at most READ_WAIT, then reads the keys one by one, and the
    connection's timeout is restored (the test's own timeout is below the connection's)."""
    from torch_ctrl import inspection

    server = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore(HOST, server.port, is_master=False, timeout=timedelta(seconds=120))
    server.set("present", b"1")
    # multi_get of a checked batch in which "gone" was deleted meanwhile:
    with pytest.raises(dist.DistStoreError):
        inspection._read_existing(client, ["present", "gone"], owned=True)
    assert client.timeout == timedelta(seconds=120)
    assert inspection.read_values(client, ["present", "gone"], owned=True) == {"present": b"1", "gone": None}


def test_a_connection_the_server_dropped_is_opened_again() -> None:
    """A legacy TCPStore server drops a connection whose read finds a key deleted after the
    read's wait (a live job's cleanup does that under the inspector's reads), and every later
    sample read nothing: the next sample opens a new connection."""
    server = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, use_libuv=False)
    writer = dist.TCPStore(HOST, server.port, is_master=False, use_libuv=False)
    writer.set("kept", b"1")
    insp = Inspector(f"{HOST}:{server.port}", timeout=5.0)
    assert insp.sample()["num_keys"] == 1
    # The server drops the inspector's connection: a key read while it comes and goes.
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            writer.set("churn", b"1")
            writer.delete_key("churn")

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        with pytest.raises(dist.DistNetworkError):
            for _ in range(100_000):
                if insp._store.check(["churn"]):
                    insp._store.get("churn")
    finally:
        stop.set()
        thread.join()
    assert insp.sample()["num_keys"] == 1
    assert insp.sample()["num_keys"] == 1


@needs_list_keys
def test_foreign_values_are_shown_not_fatal() -> None:
    """Keys in torch_ctrl's layout that torch_ctrl could not have written (a log that does not
    parse, a group of 10^11 ranks, one of 2^31 - 1 ranks with one arrival): the report still
    comes, at once, naming the op that holds the bad value next to a real stuck barrier.
    Before, one bad log entry failed the whole command, and a huge world size hung it listing
    missing ranks."""
    server = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    server.set(f"{K.PROTOCOL}/w2/kfoo/g", b"garbage")
    server.set(f"{K.PROTOCOL}/w99999999999/kx/n", b"1")
    server.set(f"{K.PROTOCOL}/w2147483647/kbig/n", b"1")
    client = dist.TCPStore(HOST, server.port, is_master=False)
    coll = StoreCollectives(client, 0, 2)
    stuck = threading.Thread(target=lambda: pytest.raises(CollectiveAbortedError, coll.barrier, "stuck", timeout=20))
    stuck.start()
    try:
        deadline = time.monotonic() + 20
        while not server.check([f"{K.PROTOCOL}/w2/kstuck/{K.BARRIER}"]) and not server.check(
            [f"{K.PROTOCOL}/w2/kstuck/{K.ARRIVE}"]
        ):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        started = time.monotonic()
        report = torch_ctrl.inspect(f"{HOST}:{server.port}", interval=0, timeout=30)
        assert time.monotonic() - started < 5
        groups = {g["world_size"]: g for g in report["groups"]}
        assert set(groups) == {2, 2147483647}  # 10^11 ranks: no torch_ctrl group
        ops = {op["key"]: op for op in groups[2]["in_flight"]}
        assert ops["foo"]["op"] == "unreadable", ops
        assert f"{K.PROTOCOL}/w2/kfoo/" in ops["foo"]["detail"] and "malformed log entry" in ops["foo"]["detail"]
        assert ops["stuck"]["op"] == "barrier" and ops["stuck"]["arrived"] == 1, ops
        (big,) = groups[2147483647]["in_flight"]
        assert big["arrived"] == 1 and big["missing"] is None
        text = render(report)
        assert "unreadable 'foo'" in text and "barrier 'stuck'" in text, text
    finally:
        coll.abort("test over")
        stuck.join(30)
        coll.close()


@needs_list_keys
def test_rendezvous_keep_alive_stale_and_withdrawn_nodes() -> None:
    """A ctrl rendezvous round's nodes as its keys record them: a fresh keep-alive, one older
    than the 15 s after which the rendezvous takes a node for dead (it was shown without a
    word), and one withdrawn (a negative time: it left; it read as 50 years old). Nodes that
    recorded their own dead-after (``R/da/{node}``: interval x attempts) are judged by it: 5 s
    old is stale to a node that dies after 3 s, 20 s old is not to one after 60 s."""
    server = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    root, now = "torch_ctrl/rdzv/kept", time.time()
    nodes = [
        ("gpu-1", 11, f"{now - 1:.3f} 1", None),
        ("gpu-2", 12, f"{now - 20:.3f} 1", None),
        ("gpu-3", 13, f"-{now - 2:.3f} 1", "15"),
        ("gpu-4", 14, f"{now - 5:.3f} 1", "3"),
        ("gpu-5", 15, f"{now - 20:.3f} 1", "60"),
    ]
    server.set(f"{root}/0/seal", b"5")
    for slot, (host, pid, beat, dead_after) in enumerate(nodes, 1):
        server.set(f"{root}/0/n/{slot}", f"{host}\t{pid}\t0\t1")
        server.set(f"{root}/0/rank/{slot}", f"{slot - 1} 5")
        server.set(f"{root}/hb/{host}_{pid}_0", beat)
        if dead_after is not None:
            server.set(f"{root}/da/{host}_{pid}_0", dead_after)
    report = torch_ctrl.inspect(f"{HOST}:{server.port}", interval=0)
    state = report["torchrun"][0]["state"]
    fresh, stale, left, quick, patient = state["nodes"]
    assert quick["keep_alive_stale"] is True and quick["keep_alive_dead_after_s"] == 3, quick
    assert patient["keep_alive_stale"] is False and patient["keep_alive_age_s"] >= 20, patient
    assert "keep_alive_dead_after_s" not in stale, stale
    assert fresh["keep_alive_stale"] is False and fresh["keep_alive_age_s"] < 15, fresh
    assert stale["keep_alive_stale"] is True and stale["keep_alive_age_s"] >= 20, stale
    assert left.get("withdrawn") is True and "keep_alive_age_s" not in left and "keep_alive_dead_after_s" not in left
    lines = render(report).splitlines()
    assert any(x.startswith("    node 0: host gpu-1 (agent pid 11), keep-alive ") and "STALE" not in x for x in lines)
    said = ": STALE (past the 15s after which the rendezvous takes a node for dead, by default)"
    assert any(x.startswith("    node 1: host gpu-2 (agent pid 12), keep-alive 2") and x.endswith(said) for x in lines)
    assert "    node 2: host gpu-3 (agent pid 13), withdrew (left the rendezvous)" in lines, lines
    own = ": STALE (past the 3.0s after which the rendezvous takes it for dead)"
    assert any(x.startswith("    node 3: host gpu-4 (agent pid 14), keep-alive ") and x.endswith(own) for x in lines)
    assert any(x.startswith("    node 4: host gpu-5 (agent pid 15), keep-alive 2") and "STALE" not in x for x in lines)


@needs_list_keys
def test_a_round_that_did_not_form_is_not_shown_as_the_current_one() -> None:
    """Round 1 was sealed with too few of its nodes left alive (seal 0, every slot `d`, `void`):
    its nodes went on to round 2, which is forming. inspect shows round 2 with them, not round 1
    as complete with 0 nodes (nor round 0, the last round that formed)."""
    from torch_ctrl import rdzv_state as R

    names = [(None, "open"), (0, "seal"), (0, "n/1"), (1, "seal"), (1, "void"), (1, "n/1"), (2, "n/1"), (2, "n/2")]
    assert R.native_keys_to_read("r", names)[0] == 2
    assert R.native_keys_to_read("r", [(0, "seal"), (1, "n/1")])[0] == 0  # a running round 0
    assert R.native_keys_to_read("r", [(0, "seal"), (0, "void")])[0] == 0  # nothing newer seen

    server = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    root = "torch_ctrl/rdzv/void"
    server.set(f"{root}/0/seal", b"2")
    server.set(f"{root}/1/seal", b"0")
    server.set(f"{root}/1/void", b"1")
    for slot, host in enumerate(("gpu-1", "gpu-2"), 1):
        server.set(f"{root}/1/n/{slot}", f"{host}\t{slot}\t0\t2")
        server.set(f"{root}/1/rank/{slot}", b"d")
        server.set(f"{root}/2/n/{slot}", f"{host}\t{slot}\t0\t3")
        server.set(f"{root}/hb/{host}_{slot}_0", f"{time.time():.3f} 3")
    state = torch_ctrl.inspect(f"{HOST}:{server.port}", interval=0)["torchrun"][0]["state"]
    assert state["round"] == 2 and state["complete"] is False, state
    assert [n["host"] for n in state["waiting"]] == ["gpu-1", "gpu-2"], state
