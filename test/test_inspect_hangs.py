"""``torch-ctrl inspect`` / ``torch_ctrl.inspect`` where a job's processes hang or die: a port
that accepts connections but never answers, a TCPStore server whose process is stopped
(SIGSTOP: a torchrun agent under a debugger), a workers' store followed into such a process,
a SIGKILLed rank or torchrun agent (heartbeats), a store that goes away under ``--watch``.
Real TCPStore servers, real processes, real torchrun nodes."""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
from typing import Any

import pytest
import torch.distributed as dist
from helpers import HOST, Node, freeze, frozen_server, in_thread, mute_port, poll

import torch_ctrl
from torch_ctrl import capabilities
from torch_ctrl.inspect_text import render
from torch_ctrl.inspection import Inspector

needs_list_keys = pytest.mark.skipif(not capabilities.LIST_KEYS, reason="this torch's TCPStore cannot list its keys")
STUCK_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchrun", "stuck_worker.py")
NO_ANSWER = "(a stopped or hung process, e.g. a torchrun agent under SIGSTOP or a debugger, or not a TCPStore)"
ENV = {"RES_OPTIONS": "timeout:1 attempts:1"}


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``python -m torch_ctrl inspect ARGS``; a hang fails the test at ``timeout``. ``-W ignore``:
    a Python warning torch itself prints on import (e.g. without NumPy) is not the command's; C++
    log lines are no Python warnings, and still count."""
    return subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "torch_ctrl", "inspect", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **ENV},
    )


# --------------------------------------------------------------- servers that never answer


@pytest.mark.timeout(120)
def test_cli_on_a_port_that_accepts_but_never_answers() -> None:
    """A port that is not a TCPStore (it accepts and never answers): torch's client waited
    forever, whatever --timeout. Now one line on stderr after --timeout (+1 s), status 1."""
    with mute_port() as port:
        out = cli(f"{HOST}:{port}", "--timeout", "2", "--interval", "0")
    assert out.returncode == 1, (out.stdout, out.stderr)
    said = f"torch-ctrl inspect: {HOST}:{port} accepted a connection but did not answer within 2s {NO_ANSWER}"
    assert out.stderr.splitlines() == [said], out.stderr
    assert out.stdout == ""


@needs_list_keys
@pytest.mark.timeout(120)
def test_library_on_a_stopped_server_raises_and_recovers() -> None:
    """torch_ctrl.inspect() on a TCPStore server whose process is stopped raises a
    DistStoreError naming the address after timeout + 1 s. An Inspector connected before the
    stop: its sample raises too, later samples fail at once while the unanswered call is
    pending, and once the server runs again the next sample reads it."""
    with frozen_server({"torch_ctrl/3/w2/_/abort": b"1:gone"}) as (proc, port):
        address = f"{HOST}:{port}"
        insp = Inspector(address, timeout=1)
        assert insp.sample()["groups"][0]["abort"] == {"rank": 1, "reason": "gone"}
        freeze(proc.pid)

        _, exc, took = in_thread(lambda: torch_ctrl.inspect(address, interval=0, timeout=1), 60)
        assert isinstance(exc, dist.DistStoreError), exc
        assert str(exc) == f"{address} accepted a connection but did not answer within 1s {NO_ANSWER}"
        assert took < 30, took

        _, exc, _ = in_thread(insp.sample, 60)
        assert isinstance(exc, dist.DistStoreError), exc
        assert str(exc).startswith(f"{address} did not answer a read within 1s (a stopped or hung process"), exc
        _, exc, took = in_thread(insp.sample, 60)
        assert isinstance(exc, dist.DistStoreError) and "has not answered a store call for" in str(exc), exc
        assert took < 1.0, took  # at once: the unanswered call is still pending

        os.kill(proc.pid, signal.SIGCONT)

        def reads() -> dict[str, Any] | None:
            try:
                return insp.sample()
            except dist.DistStoreError:
                return None  # the unanswered call has not come back yet

        report = poll(reads, 60, "a sample after the server resumed")
        assert report["groups"][0]["abort"] == {"rank": 1, "reason": "gone"}


@needs_list_keys
@pytest.mark.timeout(120)
def test_a_followed_workers_store_stopped_at_first_is_read_once_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--watch`` follows a round's workers' store: one that did not answer when first
    opened (its host stopped) is opened again after RELINK, and read once it runs again."""
    from torch_ctrl import inspection

    monkeypatch.setattr(inspection, "RELINK", 0.5)
    main = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    with frozen_server({"torch_ctrl/3/w2/_/abort": b"1:gone"}) as (proc, port):
        master = f"{HOST}:{port}"
        insp = Inspector(f"{HOST}:{main.port}", timeout=1)
        freeze(proc.pid)
        report: dict[str, Any] = {"groups": [], "limitations": []}
        said, _, _ = in_thread(lambda: insp._follow_store(master, report), 60)
        assert said.startswith(f"{master} accepted a connection but did not answer within 1s"), said
        os.kill(proc.pid, signal.SIGCONT)
        poll(lambda: insp._follow_store(master, report) is None, 60, "the workers' store read after it resumed")
        assert report["groups"][0]["abort"] == {"rank": 1, "reason": "gone"}, report


@needs_list_keys
@pytest.mark.timeout(300)
def test_cli_on_a_stopped_torchrun_agent_and_following_into_it() -> None:
    """A torchrun node (ctrl rendezvous on a store this test hosts) whose agent, which hosts
    the workers' store, is stopped with SIGSTOP. Inspecting the rendezvous endpoint follows
    into the workers' store: the report comes, naming the workers' store that did not answer
    (it hung forever). Inspecting the workers' store itself: one line, status 1."""
    rdzv = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    endpoint = f"{HOST}:{rdzv.port}"
    args = [
        "--nnodes=1",
        "--nproc-per-node=2",
        "--rdzv-backend=ctrl",
        f"--rdzv-endpoint={endpoint}",
        "--rdzv-id=frozen",
        "--rdzv-conf=is_host=false",
        "--monitor-interval=0.1",
        STUCK_WORKER,
    ]
    node = Node(args, ENV, ["-m", "torch.distributed.run"])
    try:
        node.wait_for("RANK 1 STALLING", 150)
        run = poll(
            lambda: (lambda r: r if r["workers_store"] else None)(
                torch_ctrl.inspect(endpoint, interval=0, timeout=30)["torchrun"][0]
            ),
            60,
            "the workers' store named",
        )
        workers = run["workers_store"]
        freeze(node.proc.pid)  # the agent: its workers' store and rendezvous keep-alive stop

        out = cli(endpoint, "--timeout", "2", "--interval", "0")
        assert out.returncode == 0, out.stderr
        assert "torchrun run 'frozen' (ctrl rendezvous): round 0" in out.stdout, out.stdout
        said = f"  workers' store: {workers} ({workers} accepted a connection but did not answer within 2s {NO_ANSWER})"
        assert said in out.stdout.splitlines(), out.stdout

        out = cli(workers, "--timeout", "2", "--interval", "0")
        assert out.returncode == 1, (out.stdout, out.stderr)
        said = f"torch-ctrl inspect: {workers} accepted a connection but did not answer within 2s {NO_ANSWER}"
        assert out.stderr.splitlines() == [said], out.stderr
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(node.proc.pid, signal.SIGCONT)
        node.kill()


# ------------------------------------------------------------------ heartbeats that stop


def _beating_rank(port: int, rank: int, interval: float, ready: Any, release: Any) -> None:

    import torch.distributed as dist

    from torch_ctrl import StoreCollectives

    coll = StoreCollectives(dist.TCPStore("127.0.0.1", port, is_master=False), rank, 3, heartbeat_interval=interval)
    ready.put(rank)
    if rank == 2:  # SIGKILLed by the test; never touches a queue's lock again
        threading.Event().wait(120)
        return
    release.get(timeout=120)  # idle, beating, until the test has looked
    coll.close()


@needs_list_keys
@pytest.mark.timeout(180)
def test_a_sigkilled_rank_is_told_by_its_declared_interval_with_default_options() -> None:
    """Ranks 1 and 2 beat every 3 s, rank 0 every 0.2 s; rank 2 is SIGKILLed. With default
    options (--interval 1) inspect sampled at most 4 s and could never see rank 2 stop (3
    beats of another rank at its interval, or it used rank 0's beats to judge rank 1). Now it
    samples until each counter moved or stood still for 3 of its own intervals: rank 2 is
    stopped after 9 s or more, rank 1 beats, and the text does not call rank 2 beating."""
    server = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    ready, release = ctx.Queue(), ctx.Queue()
    intervals = [0.2, 3.0, 3.0]
    procs = [ctx.Process(target=_beating_rank, args=(server.port, r, intervals[r], ready, release)) for r in range(3)]
    for p in procs:
        p.start()
    try:
        assert sorted(ready.get(timeout=90) for _ in procs) == [0, 1, 2]
        os.kill(procs[2].pid, signal.SIGKILL)
        procs[2].join(30)
        report = torch_ctrl.inspect(f"{HOST}:{server.port}")
        hb = report["groups"][0]["heartbeats"]
        assert hb["stopped"] == [2], hb
        ranks = {r["rank"]: r for r in hb["ranks"]}
        assert [ranks[r]["interval_s"] for r in range(3)] == intervals, hb
        assert ranks[2]["status"] == "stopped" and ranks[2]["age_s"] >= 9.0, hb
        assert ranks[0]["status"] == ranks[1]["status"] == "ok", hb
        assert report["observed_s"] < 20 + 2, report["observed_s"]
        text = render(report)
        assert "heartbeats (interval 0.2-3s): over " in text and "s, 2/3 ranks beating, 1 STOPPED" in text, text
        assert "  STOPPED: [2]" in text and "    rank 2: no beat for " in text, text
    finally:
        for _ in procs:
            release.put(None)
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


@needs_list_keys
@pytest.mark.timeout(300)
def test_a_sigkilled_torchrun_agent_is_stopped_with_default_options(tmp_path: Any) -> None:
    """Two torchrun nodes (ctrl rendezvous on a store this test hosts); node 1 (agent and
    worker) is SIGKILLed. `torch-ctrl inspect ENDPOINT --no-follow` with default options
    reports its agent STOPPED (agents beat every 5 s: it samples 15 s and more), never as
    beating, and its rendezvous keep-alive as stale (older than the 15 s after which the
    rendezvous takes a node for dead). The workers are idle, in no collective: node 0's
    agent, which aborts the workers' collectives when it finds node 1 lost, runs on."""
    rdzv = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    endpoint = f"{HOST}:{rdzv.port}"
    worker = tmp_path / "idle_worker.py"
    worker.write_text("import time\ntime.sleep(600)  # the workload: idle until the test kills the job\n")

    def start() -> Node:
        args = [
            "--nnodes=2",
            "--nproc-per-node=1",
            "--rdzv-backend=ctrl",
            f"--rdzv-endpoint={endpoint}",
            "--rdzv-id=killed",
            "--rdzv-conf=is_host=false",
            "--max-restarts=0",
            "--monitor-interval=0.1",
            str(worker),
        ]
        return Node(args, ENV, ["-m", "torch.distributed.run"])

    nodes = [start(), start()]
    try:

        def both_beating() -> dict[str, Any] | None:
            report = torch_ctrl.inspect(endpoint, interval=0, follow=False, timeout=30)
            agents = [g for g in report["groups"] if g["namespace"]["kind"] == "agents"]
            state = report["torchrun"][0]["state"] if report["torchrun"] else None
            if agents and agents[0]["heartbeats"] and len(agents[0]["heartbeats"]["ranks"]) == 2 and state:
                return report
            return None

        report = poll(both_beating, 150, "both agents beating")
        pids = {n["rank"]: n["pid"] for n in report["torchrun"][0]["state"]["nodes"]}
        victim = next(n for n in nodes if n.proc.pid == pids[1])  # node 0 hosts the workers' store
        victim.kill()

        out = cli(endpoint, "--no-follow", "--json", timeout=120)
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        agents = next(g for g in doc["groups"] if g["namespace"]["kind"] == "agents")
        hb = agents["heartbeats"]
        assert hb["stopped"] == [1], hb
        assert [r["interval_s"] for r in hb["ranks"]] == [5.0, 5.0] and hb["ranks"][0]["status"] in ("ok", "late"), hb
        nodes_seen = {n["rank"]: n for n in doc["torchrun"][0]["state"]["nodes"]}
        assert nodes_seen[1]["keep_alive_stale"] and not nodes_seen[0]["keep_alive_stale"], nodes_seen
        text = render(doc)
        assert "heartbeats (interval 5s): over " in text and "s, 1/2 ranks beating, 1 STOPPED" in text, text
        assert "  STOPPED: [1]" in text, text
        line = next(x for x in text.splitlines() if x.startswith("    node 1: host "))
        assert nodes_seen[1]["keep_alive_dead_after_s"] == 15, nodes_seen  # its own 5 s x 3, from its beat
        assert ": STALE (past the 15.0s after which the rendezvous takes it for dead)" in line, text
    finally:
        for n in nodes:
            n.kill()


# ----------------------------------------------------------------- a store that goes away


@needs_list_keys
@pytest.mark.timeout(120)
def test_watch_of_a_store_that_goes_away_prints_one_line() -> None:
    """`inspect --watch` while the store's process is killed: status 1 and one line on stderr.
    torch's C++ client logged ~15 lines of stack trace first (recvValue failed ...)."""
    with frozen_server({"torch_ctrl/3/w2/_/abort": b"1:gone"}) as (proc, port):
        address = f"{HOST}:{port}"
        watch = subprocess.Popen(
            [
                sys.executable,
                "-W",
                "ignore",
                "-m",
                "torch_ctrl",
                "inspect",
                address,
                "--watch",
                "--json",
                "--interval",
                "0.2",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **ENV},
        )
        try:
            assert watch.stdout is not None
            assert json.loads(watch.stdout.readline())["store"] == address
            proc.kill()
            proc.wait(30)
            _, err = watch.communicate(timeout=60)
        finally:
            if watch.poll() is None:
                watch.kill()
                watch.wait(30)
    assert watch.returncode == 1, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"torch-ctrl inspect: cannot read {address}: "), err
