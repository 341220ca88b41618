"""torch_ctrl.from_env() (worker processes of a torchrun job) and host-naming errors."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest
import torch.distributed as dist
from helpers import HOST, IMPLS, Stores, free_port, make_cls, mute_port, run_ranks

import torch_ctrl
from torch_ctrl import CollectiveTimeoutError, workers


def _env(stores: Stores, rank: int, world: int, **extra: str) -> dict[str, str]:
    return {
        "MASTER_ADDR": HOST,
        "MASTER_PORT": str(stores.port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # the test's server plays the agent's store
        "TORCHELASTIC_RUN_ID": "job 7",
        **extra,
    }


def test_from_env_runs_collectives_in_the_rounds_namespace() -> None:
    stores, n = Stores("tcp"), 3

    def body(r: int) -> list[bytes]:
        with torch_ctrl.from_env(env=_env(stores, r, n, TORCH_CTRL_ROUND="2")) as coll:
            assert (coll.rank, coll.world_size) == (r, n)
            return coll.all_gather("k", b"%d" % r, 30)

    assert run_ranks(n, body) == [[b"0", b"1", b"2"]] * n

    # the same key in the next round is a fresh collective: rounds never mix
    def next_round(r: int) -> int:
        with torch_ctrl.from_env(env=_env(stores, r, n, TORCH_CTRL_ROUND="3")) as coll:
            return coll.all_sum("k", r, 30)

    assert run_ranks(n, next_round) == [3] * n


@pytest.mark.parametrize("hosted", [False, True], ids=["rank0-hosts", "already-hosted"])
def test_from_env_outside_torchrun(hosted: bool) -> None:
    """Plain env:// variables: rank 0 hosts the store (as torch's env:// does), or joins the
    store already listening on MASTER_PORT."""
    server = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False) if hosted else None
    port = server.port if server is not None else free_port()
    n = 3

    def body(r: int) -> list[bytes]:
        env = {"MASTER_ADDR": HOST, "MASTER_PORT": str(port), "RANK": str(r), "WORLD_SIZE": str(n)}
        with torch_ctrl.from_env(env=env) as coll:
            return coll.all_gather("k", b"%d" % r, 30)

    assert run_ranks(n, body) == [[b"0", b"1", b"2"]] * n


def test_from_env_without_a_server_fails_in_one_line_at_its_timeout(capfd: pytest.CaptureFixture[str]) -> None:
    """A client rank whose store never comes up: one CollectiveTimeoutError line at its timeout
    naming the address and who hosts it (torch's connect loop: DistNetworkError after twice the
    timeout, each attempt logged with a C++ stack trace)."""
    port = free_port()
    env = {"MASTER_ADDR": HOST, "MASTER_PORT": str(port), "RANK": "1", "WORLD_SIZE": "2"}
    started = time.monotonic()
    with pytest.raises(CollectiveTimeoutError) as info:
        torch_ctrl.from_env(env=env, timeout=1)
    took = time.monotonic() - started
    text = str(info.value)
    assert isinstance(info.value, dist.DistStoreError)
    assert text.startswith(f"from_env (rank 1 of 2): no store server at {HOST}:{port} (MASTER_ADDR:MASTER_PORT)"), text
    assert "rank 0's from_env() hosts it" in text and "\n" not in text, text
    assert info.value.op == "from_env" and info.value.world_size == 2
    assert 1.0 <= took < 2.5, took
    assert "TCPStore.cpp" not in capfd.readouterr().err


@pytest.mark.parametrize(
    ("rank", "world", "port", "match"),
    [
        ("2", "2", None, r"RANK must be in \[0, 2\)"),
        ("-1", "2", None, "RANK must be"),
        ("0", "0", None, "WORLD_SIZE"),
        ("0", "2", "99999", "MASTER_PORT must be a port"),
        ("1", "2", "0", "MASTER_PORT must be a port"),
    ],
)
def test_from_env_checks_rank_and_port_before_connecting(rank: str, world: str, port: str | None, match: str) -> None:
    """A rank outside the group, or a port that is none, is one ValueError at once: not a wait
    for a server for the whole timeout (nobody listens here), nor a pybind TypeError."""
    env = {"MASTER_ADDR": HOST, "MASTER_PORT": port or str(free_port()), "RANK": rank, "WORLD_SIZE": world}
    started = time.monotonic()
    with pytest.raises(ValueError, match=match) as info:
        torch_ctrl.from_env(env=env, timeout=30)
    assert time.monotonic() - started < 5
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("extra", "kwargs", "match"),
    [
        ({"TORCH_CTRL_ROUND": "x"}, {}, "TORCH_CTRL_ROUND must be set to an integer"),
        ({"TORCHELASTIC_RESTART_COUNT": "one"}, {}, "TORCHELASTIC_RESTART_COUNT must be set to an integer"),
        ({}, {"heartbeat_interval": -1}, "heartbeat_interval"),
    ],
)
def test_from_env_checks_its_namespace_and_heartbeat_before_hosting(extra: dict, kwargs: dict, match: str) -> None:
    """Rank 0 hosts the workers' store: bad input is refused before it does (the port stays
    free), not after a server that then lives as long as the process."""
    port = free_port()
    env = {"MASTER_ADDR": HOST, "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "2", **extra}
    with pytest.raises(ValueError, match=match):
        torch_ctrl.from_env(env=env, timeout=30, **kwargs)
    with socket.socket() as sock:
        sock.bind((HOST, port))  # nobody hosts it


@pytest.mark.timeout(60)
def test_from_env_on_a_port_that_never_answers_fails_at_its_timeout() -> None:
    """A port that accepts connections but never answers (the agent hosting the store is
    stopped, or another service): torch's handshake would wait for ever; from_env ends at its
    timeout, one line naming the address."""
    with mute_port() as port:
        env = {"MASTER_ADDR": HOST, "MASTER_PORT": str(port), "RANK": "1", "WORLD_SIZE": "2"}
        started = time.monotonic()
        with pytest.raises(CollectiveTimeoutError) as info:
            torch_ctrl.from_env(env=env, timeout=2)
        took = time.monotonic() - started
    text = str(info.value)
    assert isinstance(info.value, dist.DistStoreError)
    assert f"{HOST}:{port}" in text and "did not answer" in text and "\n" not in text, text
    assert 2.0 <= took < 8.0, took


def test_from_env_waits_for_a_server_that_starts_later() -> None:
    """Under torchrun every worker is a client of the agent's store; a store that comes up
    while a worker waits is joined, within the worker's timeout."""
    port = free_port()
    servers: list[dist.TCPStore] = []

    def host() -> None:
        servers.append(dist.TCPStore(HOST, port, is_master=True, wait_for_workers=False))

    later = threading.Timer(0.3, host)
    later.start()
    env = {"MASTER_ADDR": HOST, "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}
    env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    try:
        with torch_ctrl.from_env(env=env, timeout=20) as coll:
            assert coll.all_sum("k", 5, 10) == 5
    finally:
        later.join()
    assert len(servers) == 1


def test_namespace_is_the_round_not_the_restart_count(caplog: pytest.LogCaptureFixture) -> None:
    env = {"TORCHELASTIC_RUN_ID": "job/7", "TORCH_CTRL_ROUND": "4", "TORCHELASTIC_RESTART_COUNT": "1"}
    assert workers.worker_namespace(env) == "torch_ctrl/run/job%2F7/round4"
    assert workers.worker_namespace({}) == "torch_ctrl/run/-"
    workers._warned = False
    with caplog.at_level(logging.WARNING, logger="torch_ctrl"):
        assert workers.worker_namespace({"TORCHELASTIC_RUN_ID": "j", "TORCHELASTIC_RESTART_COUNT": "1"}).endswith(
            "/restart1"
        )
    assert "--rdzv-backend=ctrl" in caplog.text


@pytest.mark.parametrize("missing", ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"])
def test_from_env_names_a_missing_variable(missing: str) -> None:
    env = {"MASTER_ADDR": HOST, "MASTER_PORT": "1", "RANK": "0", "WORLD_SIZE": "2"}
    del env[missing]
    with pytest.raises(ValueError, match=missing):
        torch_ctrl.from_env(env=env)


def test_hosts_round_trip() -> None:
    text = workers.encode_hosts([("node-a", 2), ("node-b", 1)])
    assert text == "node-a*2,node-b*1"
    assert workers.decode_hosts(text) == ["node-a", "node-a", "node-b"]


def test_errors_name_hosts() -> None:
    stores, n = Stores("tcp"), 3
    hosts = workers.encode_hosts([("node-a", 2), ("node-b", 1)])

    def late(r: int) -> str:
        coll = torch_ctrl.from_env(env=_env(stores, r, n, TORCH_CTRL_ROUND="0", TORCH_CTRL_HOSTS=hosts))
        assert isinstance(coll, torch_ctrl.StoreCollectives)
        with pytest.raises(torch_ctrl.CollectiveTimeoutError) as info:
            # Long enough for rank 1 to be named present: its connections may each stall for the
            # resolver's 1 s (conftest) before its arrival and its name reach the store.
            coll.barrier("b", 5)
        coll.close()
        assert info.value.missing == [2]
        return str(info.value)

    for msg in run_ranks(2, late):
        assert "missing ranks: [2]" in msg and "2: node-b" in msg, msg

    def aborted(r: int) -> str:
        coll = torch_ctrl.from_env(env=_env(stores, r, n, TORCH_CTRL_ROUND="1", TORCH_CTRL_HOSTS=hosts))
        with coll:
            if r == 2:
                coll.abort("disk full")
                return ""
            with pytest.raises(torch_ctrl.CollectiveAbortedError) as info:
                coll.barrier("b", 30)
            assert info.value.rank == 2 and info.value.reason == "disk full"
            return str(info.value)

    msgs = run_ranks(n, aborted)
    assert all("rank 2 runs on node-b" in m for m in msgs[:2]), msgs


@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "mixed"])
def test_with_rank_names_keeps_the_class(impl: str) -> None:
    """Both classes name hosts in their errors (the C++ one in its error path only)."""
    store = dist.HashStore()
    base = make_cls(impl, 0)
    cls = torch_ctrl.with_rank_names(base)
    assert cls is torch_ctrl.with_rank_names(base)
    coll = cls(store, 1, 2, rank_names=["pod-a", "pod-b"])
    assert isinstance(coll, base) and coll.rank == 1
    with pytest.raises(
        torch_ctrl.CollectiveTimeoutError, match=r"missing ranks: \[0\] \(hosts of missing ranks: 0: pod-a\)"
    ) as info:
        coll.barrier("x", 0.3)
    assert info.value.missing == [0]
    assert info.value.__context__ is None or info.value.__suppress_context__  # one error shown
    with pytest.raises(torch_ctrl.CollectiveTimeoutError, match=r"hosts of missing ranks: 0: pod-a"):
        coll.all_gather(None, b"x", 0.2)  # also positional arguments, and automatic keys
    peer = base(store, 0, 2)
    peer.abort("disk full")
    with pytest.raises(torch_ctrl.CollectiveAbortedError, match=r"rank 0 runs on pod-a"):
        coll.all_gather("y", b"", 5)
    coll.close()
    peer.close()


def test_rank_named_wraps_any_collectives() -> None:
    store = dist.HashStore()
    coll = torch_ctrl.RankNamed(torch_ctrl.StoreCollectives(store, 0, 2), lambda r: f"pod-{r}")
    assert isinstance(coll, torch_ctrl.ControlCollectives)
    with pytest.raises(torch_ctrl.CollectiveTimeoutError, match=r"1: pod-1"):
        coll.all_gather("x", b"", 0.3)
    with pytest.raises(TypeError):
        coll.all_gather("y", 5, 1)  # bad input still raises the inner instance's TypeError
    coll.close()


@pytest.mark.skipif("cpp" not in IMPLS, reason="C++ extension not built")
def test_names_are_added_once_when_a_subclass_overrides_a_collective() -> None:
    """With host names and a subclass that overrides a collective, the errors are named once
    (by the naming mixin, in Python), whichever method raised them."""

    class Mine(make_cls("cpp", 0)):  # type: ignore[misc]
        def barrier(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            return super().barrier(*args, **kwargs)

    coll = torch_ctrl.with_rank_names(Mine)(dist.HashStore(), 1, 2, rank_names=["pod-a", "pod-b"])
    for call in (lambda: coll.barrier("x", 0.2), lambda: coll.all_gather("y", b"", 0.2)):
        with pytest.raises(torch_ctrl.CollectiveTimeoutError) as info:
            call()
        assert str(info.value).count("hosts of missing ranks") == 1, str(info.value)
    coll.close()
