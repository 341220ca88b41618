"""Real torchrun jobs that change size under the ``ctrl`` rendezvous: a node joins a running
job (scale-up), a node's process tree is SIGKILLed (scale-down), a spare takes a dead node's
place. Launchers on 127.0.0.1, two gloo workers each."""

from __future__ import annotations

import os
import re
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from helpers import HOST, Node, free_port, poll

pytestmark = pytest.mark.timeout(180)

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchrun", "elastic_worker.py")
OK = re.compile(r"WORKER OK rank=(\d+) world=(\d+) round=(\d+)")
ENV = {"RES_OPTIONS": "timeout:1 attempts:1", "TORCH_CTRL_AGENT_HEARTBEAT": "1"}


def _node(port: int, nnodes: str, host: bool, mode: str, final: int, max_restarts: int) -> Node:
    conf = f"is_host={int(host)},keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=1,join_timeout=60"
    args = [
        f"--nnodes={nnodes}",
        "--nproc-per-node=2",
        "--rdzv-backend=ctrl",
        f"--rdzv-endpoint={HOST}:{port}",
        f"--rdzv-id=elastic{port}",
        f"--rdzv-conf={conf}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.1",
        WORKER,
        mode,
        str(final),
    ]
    return Node(args, ENV, ["-m", "torch.distributed.run"])


def _both(nodes: list[Node]) -> str:
    return "\n".join(f"--- node {i} ---\n{n.output}" for i, n in enumerate(nodes))


def test_scale_up_a_node_started_later_joins_the_running_job() -> None:
    """A runs alone (--nnodes=1:2); B starts later: A's agent sees B waiting, restarts its workers,
    and both end in round 1 with 2 x 2 workers (torch's c10d: B crashes after 60 s waiting for a
    MASTER_ADDR that A never writes again)."""
    port = free_port()
    nodes: list[Node] = []
    try:
        nodes.append(_node(port, "1:2", True, "scale-up", 4, 0))
        nodes[0].wait_for("RUNNING rank=1 world=2", 90)
        nodes.append(_node(port, "1:2", False, "scale-up", 4, 0))
        joined = time.monotonic()
        for n in nodes:
            n.wait(120)
        sys.stderr.write(f"\n[scale-up] both exited {time.monotonic() - joined:.1f}s after B started\n")
        assert [n.returncode for n in nodes] == [0, 0], _both(nodes)
        lines = sorted(m for n in nodes for m in OK.findall(n.output))
        assert lines == [(str(r), "4", "1") for r in range(4)], _both(nodes)
    finally:
        for n in nodes:
            n.kill()


def test_scale_down_the_survivors_continue_in_a_new_round() -> None:
    """Three nodes (--nnodes=2:3) in a gloo all_reduce loop; one node's agent and workers are
    SIGKILLed. The other two restart into round 1 (once the dead node's heartbeat is stale and the
    last call is over), finish with 2 x 2 workers and exit 0."""
    port = free_port()
    nodes: list[Node] = []
    try:
        for i in range(3):
            nodes.append(_node(port, "2:3", i == 0, "scale-down", 4, 1))
        for n in nodes:
            n.wait_for("LOOPING", 90)
        victim = nodes[2]
        victim.kill_all()
        killed = time.monotonic()
        survivors = nodes[:2]
        for n in survivors:
            n.wait(120)
        sys.stderr.write(f"\n[scale-down] survivors exited {time.monotonic() - killed:.1f}s after the kill\n")
        assert [n.returncode for n in survivors] == [0, 0], _both(nodes)
        lines = sorted(m for n in survivors for m in OK.findall(n.output))
        assert lines == [(str(r), "4", "1") for r in range(4)], _both(nodes)
    finally:
        for n in nodes:
            n.kill()


def test_a_spare_node_takes_the_place_of_a_node_that_died() -> None:
    """--nnodes=2:2 with a third node waiting as a spare; one member's agent and workers are
    SIGKILLed while the other's workers idle (healthy: nothing of theirs fails). As with c10d,
    the survivor's agent finds the spare waiting once the dead node's heartbeat is stale,
    restarts, and the survivor and the spare finish round 1 with 2 x 2 workers and exit 0."""
    port = free_port()
    nodes: list[Node] = []
    try:
        for i in range(2):
            nodes.append(_node(port, "2:2", i == 0, "replace", 4, 1))
        for n in nodes:
            n.wait_for("IDLE", 90)
        nodes.append(_node(port, "2:2", False, "replace", 4, 1))  # the spare
        store = dist.TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=30))
        poll(lambda: int(store.add(f"torch_ctrl/rdzv/elastic{port}/1/arrived", 0)) == 1, 60, "the spare arrived")
        victim = nodes[1]
        victim.kill_all()
        killed = time.monotonic()
        finishers = [nodes[0], nodes[2]]
        for n in finishers:
            n.wait(120)
        sys.stderr.write(f"\n[spare] survivor and spare exited {time.monotonic() - killed:.1f}s after the kill\n")
        assert [n.returncode for n in finishers] == [0, 0], _both(nodes)
        lines = sorted(m for n in finishers for m in OK.findall(n.output))
        assert lines == [(str(r), "4", "1") for r in range(4)], _both(nodes)
    finally:
        for n in nodes:
            n.kill()
