"""``from_env()``: collectives for the worker processes of a torchrun job.

Environment read (all set by torchrun; the last two by the ``ctrl`` rendezvous backend):

``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``
    the store and this worker's place in the job;
``TORCHELASTIC_USE_AGENT_STORE``
    ``True`` when the agent hosts that store (else rank 0 hosts it, as ``env://`` does,
    or joins a store already listening there);
``TORCH_CTRL_ROUND``
    the rendezvous round, the same on every node of one round: it namespaces the keys,
    so a restarted worker group never sees an earlier attempt's keys;
``TORCH_CTRL_HOSTS``
    ``host*count,host*count,...`` in global rank order: errors then name hosts.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist

from .base import ControlCollectives, Timeout, check_heartbeat, to_seconds
from .bounded import NoAnswer, client_timeout, within
from .errors import CollectiveTimeoutError, one_line
from .keys import escape
from .lanes import await_server
from .loader import StoreCollectives
from .naming import with_rank_names

ENV_ROUND = "TORCH_CTRL_ROUND"
ENV_HOSTS = "TORCH_CTRL_HOSTS"

log = logging.getLogger("torch_ctrl")
_warned = False
_HOSTED: list[dist.TCPStore] = []  # stores from_env() hosts (rank 0 outside torchrun)


def worker_namespace(env: Mapping[str, str]) -> str:
    """The key prefix of one rendezvous round's worker collectives.

    ``torch_ctrl/run/{run id}/round{N}`` under the ``ctrl`` backend. Without it (another
    backend), ``.../restart{TORCHELASTIC_RESTART_COUNT}``, which can differ between nodes
    after a restart (a warning says so once); outside torchrun, ``torch_ctrl/run/-``.
    """
    global _warned
    run = "torch_ctrl/run/" + (escape(env["TORCHELASTIC_RUN_ID"]) if env.get("TORCHELASTIC_RUN_ID") else "-")
    if env.get(ENV_ROUND):
        return f"{run}/round{_int_env(env, ENV_ROUND)}"
    if "TORCHELASTIC_RESTART_COUNT" not in env:
        return run
    if not _warned:
        _warned = True
        log.warning(
            "torch_ctrl.from_env: %s is not set, so keys are namespaced by TORCHELASTIC_RESTART_COUNT, "
            "which differs between nodes after a restart; launch with --rdzv-backend=ctrl",
            ENV_ROUND,
        )
    return f"{run}/restart{_int_env(env, 'TORCHELASTIC_RESTART_COUNT')}"


def encode_hosts(nodes: list[tuple[str, int]]) -> str:
    """``[(host, worker count), ...]`` in global rank order -> ``TORCH_CTRL_HOSTS``."""
    return ",".join(f"{host}*{count}" for host, count in nodes)


def decode_hosts(text: str) -> list[str]:
    """``TORCH_CTRL_HOSTS`` -> the host of each global rank."""
    hosts: list[str] = []
    for item in filter(None, text.split(",")):
        host, _, count = item.rpartition("*")
        hosts.extend([host] * int(count))
    return hosts


def from_env(
    *,
    store: dist.Store | None = None,
    timeout: Timeout = timedelta(seconds=300),
    heartbeat_interval: Timeout | None = None,
    env: Mapping[str, str] | None = None,
) -> ControlCollectives:
    """A ``StoreCollectives`` for this worker: rank ``RANK`` of ``WORLD_SIZE``, over a TCPStore
    client at ``MASTER_ADDR:MASTER_PORT`` (or over ``store``), namespaced by the rendezvous
    round (``torch_ctrl/run/{run id}/round{N}/``).

    The result is an instance of ``torch_ctrl.StoreCollectives``; when ``TORCH_CTRL_HOSTS``
    is set, its timeout and abort errors also name the hosts of the ranks they mention.

    Args:
        store: use this store instead of connecting to ``MASTER_ADDR:MASTER_PORT``.
        timeout: bounds connecting to the store (a ``timedelta`` or seconds; default 300 s).
        heartbeat_interval: passed to the collectives (``None``: liveness off).
        env: the environment to read (default ``os.environ``).

    Raises:
        ValueError: a variable is missing or malformed (the message names it).
        ValueError: ``RANK`` is not in ``[0, WORLD_SIZE)`` or ``MASTER_PORT`` is not a port
            (checked before connecting).
        CollectiveTimeoutError: no server accepted a connection at ``MASTER_ADDR:MASTER_PORT``
            within ``timeout``, or one accepted but did not answer as a TCPStore within it (a
            stopped process, another service on that port); one line: the address, the last
            error, who hosts that store.

    Example::

        coll = torch_ctrl.from_env()  # in a worker started by torchrun
        coll.barrier("epoch-3")
    """
    env = os.environ if env is None else env
    rank, world_size = _int_env(env, "RANK"), _int_env(env, "WORLD_SIZE")
    # Checked before connecting: a rank outside the group would otherwise wait for a server
    # for the whole timeout, or host one, before the collectives refuse it.
    if world_size < 1:
        raise ValueError(f"from_env: WORLD_SIZE must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"from_env: RANK must be in [0, {world_size}) (WORLD_SIZE), got {rank}")
    namespace = worker_namespace(env)
    check_heartbeat(heartbeat_interval)  # the collectives check it again; this is before any server
    if store is None:
        addr = env.get("MASTER_ADDR")
        if not addr:
            raise ValueError("from_env: MASTER_ADDR is not set (run under torchrun, or pass store=)")
        agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        port = _int_env(env, "MASTER_PORT")
        if not 0 < port < 65536:
            raise ValueError(f"from_env: MASTER_PORT must be a port from 1 to 65535, got {port}")
        seconds = to_seconds(timeout)
        try:
            store = _connect(addr, port, rank == 0 and not agent_store, seconds)
        except _NoServer as exc:
            hoster = "the torchrun agent of the round's node 0" if agent_store else "rank 0's from_env()"
            raise CollectiveTimeoutError(
                f"from_env (rank {rank} of {world_size}): no store server at {addr}:{port} "
                f"(MASTER_ADDR:MASTER_PORT) within {seconds:g}s ({exc}); {hoster} hosts it",
                op="from_env",
                world_size=world_size,
            ) from None
    hosts = decode_hosts(env.get(ENV_HOSTS, ""))
    return with_rank_names(StoreCollectives)(
        dist.PrefixStore(namespace, store),
        rank,
        world_size,
        heartbeat_interval=heartbeat_interval,
        rank_names=hosts if len(hosts) == world_size else None,
    )


def _connect(addr: str, port: int, host: bool, seconds: float) -> dist.TCPStore:
    """A TCPStore client, or the server when ``host``; a rank 0 that finds the port taken
    (a store someone already hosts there) connects to it instead."""
    timeout = timedelta(seconds=seconds)
    if host:
        try:
            server = dist.TCPStore(addr, port, is_master=True, timeout=timeout, wait_for_workers=False)
            # The server lives as long as this process, not as long as one instance: peers
            # may still be cleaning up after rank 0 has closed its collectives.
            _HOSTED.append(server)
            return server
        except (RuntimeError, dist.DistNetworkError) as exc:
            if "address already in use" not in str(exc).lower():
                raise
    # Wait for the server with plain sockets (it may start later): one that never comes is
    # one line at the timeout, where torch's connect loop retries for twice the timeout and
    # logs every failed attempt with a C++ stack trace.
    start = time.monotonic()
    exc = await_server(addr, port, seconds)
    if exc is not None:
        raise _NoServer(one_line(str(exc)) or type(exc).__name__)
    # The port accepts connections; a server that then never answers (its process stopped,
    # or not a TCPStore) would block torch's handshake for ever.
    left = max(seconds - (time.monotonic() - start), min(seconds, 5.0))
    made = client_timeout(left)
    try:
        store = within(left, lambda: dist.TCPStore(addr, port, is_master=False, timeout=made), f"{addr}:{port}")
    except NoAnswer as exc:
        raise _NoServer(str(exc)) from None
    store.set_timeout(timeout)  # our own client: the caller's timeout, not the construction's
    return store


class _NoServer(Exception):
    """No server accepted a connection at the address within the timeout (the last error)."""


def _int_env(env: Mapping[str, str], name: str) -> int:
    value = env.get(name)
    # 20 digits are past any rank, size or port (and int() refuses more than 4300)
    if value is None or not value.strip().lstrip("-").isdigit() or len(value.strip()) > 20:
        said = repr(value) if value is None or len(value) <= 40 else f"{value[:20]!r}... ({len(value)} characters)"
        raise ValueError(f"from_env: {name} must be set to an integer, got {said}")
    return int(value)
