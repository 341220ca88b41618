"""Real torchrun jobs on 127.0.0.1: two launchers x two workers, rendezvous backend ``ctrl``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import HOST, Node, free_port, freeze, torchrun_two_nodes

pytestmark = pytest.mark.timeout(240)

STORE_ERROR = "connection to the C10d store has failed"
OK = re.compile(r"WORKER OK .*?restart_count=(\d+)")  # lazy: two workers may print on one line


def _report(label: str, seconds: float) -> None:
    sys.stderr.write(f"\n[{label}] {seconds:.1f}s\n")


def test_every_collective_through_from_env() -> None:
    nodes = torchrun_two_nodes(["collectives"])
    for node in nodes:
        assert node.returncode == 0, node.output
    lines = [m for node in nodes for m in re.findall(r"WORKER OK rank=(\d) round=(\d+)", node.output)]
    assert sorted(lines) == [("0", "0"), ("1", "0"), ("2", "0"), ("3", "0")]


@pytest.mark.parametrize("store_on", ["healthy", "failing"])
def test_healthy_node_leaves_exit_barrier_naming_the_failed_node(store_on: str) -> None:
    """Node 1's local rank 1 exits 3 after 2 s; node 0's workers succeed at once, so its
    agent is in the exit barrier when the failure happens (torch: 300 s of waiting)."""
    nodes = torchrun_two_nodes(["fail-after", "2"], host_node=0 if store_on == "healthy" else 1, failing_node=1)
    healthy, failing = nodes
    _report(f"store on {store_on} node: healthy agent exited after", healthy.elapsed)
    assert failing.returncode == 1, failing.output
    assert healthy.returncode == 0, healthy.output  # its own workers succeeded
    # torch waits out the exit barrier (300 s); startup of 2 agents and 4 workers is ~15 s, more
    # on a loaded 2-core machine, so the bound is generous and still far from 300 s.
    assert healthy.elapsed < 120, healthy.output
    notice = re.search(r"torch_ctrl: (node 1 on host \S+ failed: rank 3: exit code 3)", failing.output)
    assert notice, failing.output
    assert notice.group(1) in healthy.output
    assert "left the exit barrier" in healthy.output
    assert STORE_ERROR not in healthy.output + failing.output


@pytest.mark.parametrize("store_on", ["healthy", "failing"])
def test_working_node_stops_at_once_when_another_node_fails(store_on: str) -> None:
    """Node 1's local rank 1 exits 3 at once while node 0's workers have 150 s of work
    (torch with the store on the failing node: RendezvousConnectionError, cause not shown)."""
    nodes = torchrun_two_nodes(["fail-running", "150"], host_node=0 if store_on == "healthy" else 1, failing_node=1)
    healthy, failing = nodes
    _report(f"store on {store_on} node, workers running: healthy agent exited after", healthy.elapsed)
    assert failing.returncode == 1 and healthy.returncode == 1, healthy.output
    # Its workers were stopped, not waited for: their 150 s of work would come on top of the
    # startup (~15 s, more under load).
    assert healthy.elapsed < 120, healthy.output
    assert re.search(r"node 1 on host \S+ failed: rank 3: exit code 3", healthy.output), healthy.output
    assert "stopping this node's workers" in healthy.output
    assert STORE_ERROR not in healthy.output + failing.output


def test_workers_blocked_in_collectives_are_released_by_the_notice() -> None:
    """Node 0 hosts the store and fails at once; node 1's workers are blocked in a barrier."""
    failing, healthy = torchrun_two_nodes(["fail-blocked"], host_node=0, failing_node=0)
    _report("store on failing node, workers blocked: healthy agent exited after", healthy.elapsed)
    assert failing.returncode == 1 and healthy.returncode == 1, healthy.output
    # Released by the notice: not stuck until the workers' barrier times out (120 s after startup).
    assert healthy.elapsed < 110, healthy.output
    assert re.search(r"node 0 on host \S+ failed: rank 1: exit code 3", healthy.output), healthy.output
    assert "stopping this node's workers" in healthy.output
    assert STORE_ERROR not in healthy.output + failing.output


def test_a_node_lost_without_a_word_is_named_by_its_heartbeat() -> None:
    """Node 1 (agent and workers) is SIGKILLed while node 0 waits in the exit barrier (store on
    node 0): node 0 names it once its heartbeat stops (0.5 s interval here; torch: 300 s)."""
    nodes = torchrun_two_nodes(
        ["node-works", "120"],
        failing_node=1,
        env={"TORCH_CTRL_AGENT_HEARTBEAT": "0.5"},
        during=lambda ns: (ns[1].wait_for("WORKING", 60), ns[1].kill_all()),
    )
    healthy = nodes[0]
    _report("node 1 killed: healthy agent exited after", healthy.elapsed)
    assert healthy.returncode == 0, healthy.output
    assert healthy.elapsed < 120, healthy.output  # torch: the exit barrier's 300 s
    assert re.search(r"node 1 on host \S+ failed: no heartbeat for [\d.]+s", healthy.output), healthy.output


@pytest.mark.parametrize("impl", ["auto", "python"])
def test_workers_blocked_when_a_node_is_lost_fail_at_once_naming_it(impl: str) -> None:
    """Node 1 (agent and workers) is SIGKILLed while node 0's workers are blocked in a
    from_env() barrier node 1's never join: node 0's agent sees node 1's heartbeat stop and
    aborts the round's workers' collectives, so its workers fail naming the lost node, not
    after the barrier's 120 s. ``auto``: the C++ twin where it is built; ``python``: agents and
    workers on the Python twin."""
    nodes = torchrun_two_nodes(
        ["lost-node", "120"],
        failing_node=1,
        env={"TORCH_CTRL_AGENT_HEARTBEAT": "0.5", "TORCH_CTRL_NOTICE_LINGER": "1", "TORCH_CTRL_IMPL": impl},
        during=lambda ns: (ns[1].wait_for("WORKING", 60), ns[1].kill_all()),
    )
    healthy = nodes[0]
    _report("node 1 killed while workers blocked: healthy agent exited after", healthy.elapsed)
    if impl == "python":
        assert healthy.output.count("BACKEND python") == 2, healthy.output
    assert healthy.returncode == 1, healthy.output  # its workers failed: no restarts left
    assert healthy.elapsed < 100, healthy.output  # not the barrier's 120 s
    lost = r"node 1 on host \S+ lost: its agent's heartbeat stopped [\d.]+s ago"
    assert re.search(r"torch_ctrl: " + lost, healthy.output), healthy.output
    # the workers' error names it, coming from node 1's first rank (2)
    said = r"WORKER ERROR CollectiveAbortedError: barrier 'never': group aborted by rank 2: " + lost
    assert re.search(said, healthy.output), healthy.output


def test_a_failure_is_reported_while_the_rendezvous_host_is_stopped() -> None:
    """Node 0's agent, which hosts the rendezvous store, is stopped (SIGSTOP) while the workers
    run; then a worker of node 1 exits 3, no restarts left. torch's store client held node 1's
    monitor loop for as long as the stop lasted, so the failure was never seen and the job
    hung. Now node 1's agent warns that the store does not answer, naming it, sees its
    worker fail, and exits 1 naming the failure."""
    endpoint = f"{HOST}:{free_port()}"

    def during(nodes: list[Node]) -> None:
        nodes[1].wait_for("WORKING", 90)
        freeze(nodes[0].proc.pid)
        try:
            nodes[1].wait(90)
        finally:
            nodes[0].kill_all()  # stopped: SIGKILL still ends it

    failed = torchrun_two_nodes(
        ["fail-working", "3"],
        host_node=0,
        failing_node=1,
        endpoint=endpoint,
        rdzv_conf="close_timeout=3",
        env={"TORCH_CTRL_NOTICE_LINGER": "1"},
        during=during,
    )[1]
    _report("rendezvous host stopped, then a worker failed: the other node exited after", failed.elapsed)
    assert failed.returncode == 1, failed.output
    assert failed.elapsed < 90, failed.output
    assert f"the rendezvous store at {endpoint} has not answered" in failed.output, failed.output
    said = r"node 1 on host \S+ failed: rank 3: exit code 3(, rank 2: killed by SIGTERM)? \(no restarts left\)"
    assert re.search(said, failed.output), failed.output


@pytest.mark.parametrize("mode", ["flaky-ctrl", "flaky-gloo"])
def test_restart_recovers_with_one_attempt_number(mode: str, tmp_path: object) -> None:
    """Rank 1 exits 3 on the first attempt only; with --max-restarts=1 the second attempt
    succeeds everywhere, and every worker of it sees the same TORCHELASTIC_RESTART_COUNT."""
    nodes = torchrun_two_nodes([mode, str(tmp_path / "failed-once")], max_restarts=1)  # type: ignore[operator]
    both = "\n".join(f"--- node {i} ---\n{node.output}" for i, node in enumerate(nodes))
    assert [node.returncode for node in nodes] == [0, 0], both
    counts = [c for node in nodes for c in OK.findall(node.output)]
    assert counts == ["1"] * 4, "\n".join(node.output for node in nodes)


def test_torch_ctrl_run_defaults_to_the_ctrl_backend() -> None:
    nodes = torchrun_two_nodes(["collectives"], launcher=("-m", "torch_ctrl.run"), backend=None)
    for node in nodes:
        assert node.returncode == 0, node.output
    # TORCH_CTRL_ROUND is exported by the ctrl backend only.
    lines = [m for node in nodes for m in re.findall(r"WORKER OK rank=\d round=(\d+)", node.output)]
    assert lines == ["0"] * 4


def test_the_launcher_api_runs_the_ctrl_backend() -> None:
    """``elastic_launch(LaunchConfig(rdzv_backend="ctrl"), fn)`` in a fresh process (torch loads
    the backend through its entry point): the workers' collectives work and they see the round."""
    script = Path(__file__).parent / "torchrun" / "launch_api.py"
    out = subprocess.run(
        [sys.executable, str(script), "ctrl"],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "RES_OPTIONS": "timeout:1 attempts:1"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "RESULTS [(0, (['0', '1'], '0')), (1, (['0', '1'], '0'))]" in out.stdout, out.stdout + out.stderr
    assert "registering out of tree plugin" not in out.stderr, out.stderr


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        # torchrun's own default (static) becomes c10d --standalone here: ctrl, standalone.
        (
            ["--nproc-per-node=1", "w.py"],
            ["--rdzv-backend=ctrl", "--rdzv-endpoint=localhost:0", "ID", "--nproc-per-node=1", "w.py"],
        ),
        (
            ["--standalone", "w.py", "--standalone"],
            ["--rdzv-backend=ctrl", "--rdzv-endpoint=localhost:0", "ID", "w.py", "--standalone"],
        ),
        (
            ["--standalone", "--rdzv-backend=ctrl", "w.py"],
            ["--rdzv-endpoint=localhost:0", "ID", "--rdzv-backend=ctrl", "w.py"],
        ),
        # a static-style multi-node command line meets where its nodes would have met
        (
            ["--nnodes=2", "--master-addr=10.1.2.3", "w.py"],
            ["--rdzv-backend=ctrl", "--rdzv-endpoint=10.1.2.3:29400", "--nnodes=2", "--master-addr=10.1.2.3", "w.py"],
        ),
        (
            ["--nnodes=1:2", "--master-port=1234", "w.py"],
            ["--rdzv-backend=ctrl", "--rdzv-endpoint=127.0.0.1:1234", "--nnodes=1:2", "--master-port=1234", "w.py"],
        ),
        (
            ["--nnodes=1", "--master-port=1234", "w.py"],
            ["--rdzv-backend=ctrl", "--rdzv-endpoint=127.0.0.1:1234", "--nnodes=1", "--master-port=1234", "w.py"],
        ),
        (
            ["--nnodes=2", "--master-addr=::1", "w.py"],
            ["--rdzv-backend=ctrl", "--rdzv-endpoint=[::1]:29400", "--nnodes=2", "--master-addr=::1", "w.py"],
        ),
        (
            ["--nnodes=2", "--rdzv-endpoint=h:5", "w.py"],
            ["--rdzv-backend=ctrl", "--nnodes=2", "--rdzv-endpoint=h:5", "w.py"],
        ),
        # another backend: torchrun's own rules, untouched
        (["--rdzv-backend=c10d", "--standalone", "w.py"], ["--rdzv-backend=c10d", "--standalone", "w.py"]),
        (["--rdzv-backend=static", "w.py"], ["--rdzv-backend=static", "w.py"]),
    ],
)
def test_launcher_fills_in_what_torchrun_would(argv: list[str], expected: list[str]) -> None:
    from torch_ctrl.run import torchrun_args

    out = torchrun_args(argv)
    assert ["ID" if a.startswith("--rdzv-id=") else a for a in out] == expected


def test_two_single_node_jobs_on_one_machine_stay_apart() -> None:
    """Two ``python -m torch_ctrl.run --nproc-per-node=1`` jobs at once (no endpoint, no run
    id): each is its own job, as with torchrun, not a spare of the other's rendezvous."""
    from helpers import WORKER, Node

    first = Node(
        ["--nproc-per-node=1", "--monitor-interval=0.1", WORKER, "node-works", "30"],
        {"CTRL_TEST_FAIL": "1"},
        ["-m", "torch_ctrl.run"],
    )
    try:
        first.wait_for("WORKING", 90)
        second = Node(
            ["--nproc-per-node=1", "--monitor-interval=0.1", WORKER, "collectives"], {}, ["-m", "torch_ctrl.run"]
        ).wait(120)
        assert second.returncode == 0, second.output
        assert re.search(r"WORKER OK rank=0 round=0", second.output), second.output
        assert first.proc.poll() is None, first.output  # still working: the two overlapped
        assert first.wait(120).returncode == 0, first.output
    finally:
        first.kill()
