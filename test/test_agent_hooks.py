"""The agent hooks (torch_ctrl.elastic.agent) against a rendezvous store whose host is stopped
(SIGSTOP: a debugger, a frozen machine): torch's TCPStore client waits for its answer without
bound, whatever its timeout. A real TCPStore server in a child process; the parts of torch's
agent the hooks read are stand-ins."""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist
from helpers import HOST, DictStore, freeze, frozen_server, in_thread, poll

from torch_ctrl import keys as K
from torch_ctrl.elastic import agent

pytestmark = pytest.mark.timeout(120)


def _fake_agent() -> SimpleNamespace:
    """What the agent hooks read of torch's agent: one node, one worker, default role."""
    worker = SimpleNamespace(local_rank=0, global_rank=0, id=None)
    spec = SimpleNamespace(local_addr="node-a", role="default")
    group = SimpleNamespace(spec=spec, workers=[worker], state="SUCCEEDED", master_addr=None)
    return SimpleNamespace(_worker_group=group, _remaining_restarts=3, _exit_barrier_timeout=1, _in_exit_barrier=False)


def test_the_monitor_loop_checks_give_up_on_a_stopped_rendezvous_store(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """torch's monitor loop calls the agent hook that looks for a peer's failure notice. With
    the agent that hosts the rendezvous store stopped (SIGSTOP), torch's client would hold
    that look, and the loop, for as long as the stop lasts: a worker failing meanwhile would
    never be seen. Now the hook waits CHECK_BOUND, then returns torch's own result at once
    while its read is unanswered, with one warning naming the store; once the store answers, a
    notice posted meanwhile is seen."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

    import torch_ctrl

    monkeypatch.setattr(agent, "CHECK_BOUND", 1.0)
    monkeypatch.setenv("TORCH_CTRL_AGENT_HEARTBEAT", "0")  # no heartbeat thread blocked on the stopped store
    healthy = RunResult(state=WorkerState.HEALTHY)
    fake = _fake_agent()

    def monitor() -> RunResult:
        agent.group_of(fake).next_poll = 0.0  # not throttled
        return agent.monitor_workers(lambda self, wg: healthy, fake, fake._worker_group)

    with frozen_server() as (proc, port):
        rnd = "torch.rendezvous.job.0"
        agent._open(fake, dist.PrefixStore(rnd, dist.TCPStore(HOST, port, is_master=False)), 0, 2)
        try:
            assert monitor() is healthy
            freeze(proc.pid)
            with caplog.at_level(logging.WARNING, logger="torch_ctrl"):
                took = [in_thread(monitor, 30) for _ in range(3)]
            assert all(result is healthy and error is None for result, error, _ in took), took
            assert 0.9 <= took[0][2] < 3 and all(s < 0.5 for _, _, s in took[1:]), took
            said = [r.getMessage() for r in caplog.records if "has not answered" in r.getMessage()]
            assert said == [
                f"torch_ctrl: the rendezvous store at {HOST}:{port} has not answered the agents' checks for 1s: "
                "the agent that hosts it is stopped or hung (SIGSTOP, a debugger, a frozen machine), or the "
                "network to it is down; this agent goes on watching its workers"
            ], said
            os.kill(proc.pid, signal.SIGCONT)
            peer_store = dist.PrefixStore(rnd, dist.TCPStore(HOST, port, is_master=False))
            with torch_ctrl.StoreCollectives(dist.PrefixStore(agent.AGENT_PREFIX, peer_store), 1, 2) as peer:
                peer.abort("node 1 on host node-b failed: rank 1: exit code 3 (no restarts left)")
            result = poll(lambda: (r := monitor()) is not healthy and r, 30, "the notice seen")
            assert result.state == WorkerState.FAILED and fake._remaining_restarts == 0
            assert "stopped by torch_ctrl: node 1 on host node-b failed" in result.failures[0].message
            assert int(peer_store.add(f"{agent.AGENT_PREFIX}/{agent.ACKS}", 0)) == 1  # acknowledged
        finally:
            agent._close(fake)


def test_the_exit_barrier_leaves_a_stopped_rendezvous_store(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An agent whose workers succeeded waits for the others in the exit barrier: with the
    agent that hosts the rendezvous store stopped (SIGSTOP), torch's client held it past the
    barrier's timeout, for as long as the stop lasted. Now it leaves EXIT_GRACE after the
    timeout, saying which store did not answer."""
    monkeypatch.setattr(agent, "EXIT_GRACE", 1.0)
    monkeypatch.setenv("TORCH_CTRL_AGENT_HEARTBEAT", "0")
    fake = _fake_agent()
    with frozen_server() as (proc, port):
        agent._open(fake, dist.PrefixStore("torch.rendezvous.job.0", dist.TCPStore(HOST, port, is_master=False)), 0, 2)
        try:
            freeze(proc.pid)
            with caplog.at_level(logging.ERROR, logger="torch_ctrl"):
                _, error, took = in_thread(lambda: agent.exit_barrier(lambda self: None, fake), 30)
            assert error is None and 1.9 <= took < 5, (error, took)
            said = [r.getMessage() for r in caplog.records]
            assert any(
                f"left the exit barrier after 2s: the rendezvous store at {HOST}:{port} does not answer" in m
                for m in said
            ), said
            assert fake._in_exit_barrier is False
        finally:
            agent._close(fake)


def test_a_signal_during_a_check_on_a_stopped_store_reaches_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch turns SIGTERM into a SignalException raised on the agent's main thread, which now
    waits for the bounded check: it must leave the hook, not be logged as a failed check
    (the agent would go on running)."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.multiprocessing.api import SignalException

    monkeypatch.setattr(agent, "CHECK_BOUND", 30.0)
    monkeypatch.setenv("TORCH_CTRL_AGENT_HEARTBEAT", "0")
    fake = _fake_agent()
    healthy = RunResult(state=WorkerState.HEALTHY)

    def terminate(signum: int, frame: object) -> None:
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    with frozen_server() as (proc, port):
        agent._open(fake, dist.PrefixStore("torch.rendezvous.job.0", dist.TCPStore(HOST, port, is_master=False)), 0, 2)
        previous = signal.signal(signal.SIGALRM, terminate)
        try:
            freeze(proc.pid)
            signal.setitimer(signal.ITIMER_REAL, 0.5)  # the signal arrives while the check waits
            with pytest.raises(SignalException):
                agent.monitor_workers(lambda self, wg: healthy, fake, fake._worker_group)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            os.kill(proc.pid, signal.SIGCONT)
            agent._close(fake)


@pytest.mark.timeout(120)
def test_a_neighbour_that_beats_is_not_lost_after_the_store_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rendezvous store is stopped for longer than the lost-node bound (2.5 heartbeat
    intervals), then resumes; the next node's agent beat all along. The look that was held by
    the stop dated the counter it read to the start of the stop, and the next look took the
    neighbour for lost (and aborted a healthy job's workers). The time of a read is when it
    returned."""
    import time

    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

    import torch_ctrl

    monkeypatch.setattr(agent, "CHECK_BOUND", 1.0)
    monkeypatch.setenv("TORCH_CTRL_AGENT_HEARTBEAT", "1")
    fake = _fake_agent()
    healthy = RunResult(state=WorkerState.HEALTHY)

    def watch(seconds: float) -> None:  # torch's monitor loop, every 0.1 s, for `seconds`
        end = time.monotonic() + seconds
        while time.monotonic() < end and not agent.group_of(fake).lost:
            agent.monitor_workers(lambda self, wg: healthy, fake, fake._worker_group)
            time.sleep(0.1)  # torch's --monitor-interval, not synchronization

    with frozen_server() as (proc, port):
        rnd = "torch.rendezvous.job.0"
        agent._open(fake, dist.PrefixStore(rnd, dist.TCPStore(HOST, port, is_master=False)), 0, 2)
        neighbour_store = dist.PrefixStore(rnd, dist.TCPStore(HOST, port, is_master=False))
        neighbour = torch_ctrl.StoreCollectives(
            dist.PrefixStore(agent.AGENT_PREFIX, neighbour_store), 1, 2, heartbeat_interval=1.0
        )
        try:
            watch(2.5)  # the neighbour's counter is being watched
            freeze(proc.pid)
            watch(4.0)  # the stop: longer than 2.5 intervals
            os.kill(proc.pid, signal.SIGCONT)
            watch(5.0)
            assert not agent.group_of(fake).lost
        finally:
            os.kill(proc.pid, signal.SIGCONT)
            neighbour.close()
            agent._close(fake)


class HeldReads(DictStore):
    """A Python store whose ``compare_set`` (how the agent peeks) waits while ``held`` is
    clear: a read the store answers late, as a stopped server does once it resumes."""

    def __init__(self) -> None:
        super().__init__()
        self.released = threading.Event()
        self.released.set()

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self.released.wait(60)
        return super().compare_set(key, expected, desired)


@pytest.mark.parametrize("beat", [True, False], ids=["beat-during-the-read", "no-beat"])
def test_a_read_answered_late_never_makes_a_neighbour_lost(beat: bool) -> None:
    """The look for a lost node (heartbeat interval 0.2 s: lost after 0.5 s of silence) is
    answered 1 s late. With a beat the neighbour made meanwhile, the next look (no new beat)
    counted the silence from when the late read was asked; without one, the late read itself
    counted the time it was held as silence. A late answer proves nothing about the
    neighbour: neither may call it lost (deterministic twin of
    test_a_neighbour_that_beats_is_not_lost_after_the_store_stopped)."""
    import time

    store = HeldReads()
    group = agent.AgentGroup(coll=None, store=store, rank=0, world_size=2, host="a", heartbeat=0.2)  # type: ignore[arg-type]
    key = K.group_key(2, "hb/1")
    store.add(key, K.first_beat(0.2))
    assert group.lost_neighbour(time.monotonic()) is None  # first sight of the counter
    store.released.clear()
    held: list[Any] = []
    look = threading.Thread(target=lambda: held.append(group.lost_neighbour(time.monotonic() + 0.2)), daemon=True)
    look.start()  # past the throttle (half an interval)
    if beat:
        store.add(key, K.BEAT)  # the neighbour beats while the read is held
    time.sleep(1.0)  # the read stays unanswered for 5 intervals (the scenario, not synchronization)
    store.released.set()
    look.join(30)
    assert held == [None]
    if beat:
        assert group.lost_neighbour(time.monotonic()) is None  # 0 s since the beat was seen, not 1 s


def test_a_call_whose_wait_a_signal_interrupted_still_counts_as_unanswered() -> None:
    """A signal handler's exception (torch's SIGTERM) leaves Caller.call's wait: the call goes
    on, and the next call must fail at once as Unanswered, not start a second call that queues
    behind it on the connection."""
    from torch_ctrl.bounded import Caller, Unanswered

    release = threading.Event()
    caller = Caller()

    class Interrupted(Exception):
        pass

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(Interrupted):
            caller.call(30, release.wait, 60)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    with pytest.raises(Unanswered):
        caller.call(30, lambda: "second")
    release.set()
    assert poll(lambda: _answered(caller), 30, "the first call answered") == "third"


def _answered(caller: Any) -> Any:
    from torch_ctrl.bounded import Unanswered

    try:
        return caller.call(30, lambda: "third")
    except Unanswered:
        return None


def test_a_silent_store_is_warned_about_at_once_then_once_a_minute() -> None:
    """The throttle both the agent hooks and the ctrl rendezvous warn through: a warning at the
    first call given up on, none for the calls that fail at once while it is unanswered, the
    next after `every` more seconds of the same silence; an answer ends the silence (and says
    whether one was warned about), and a second silence is warned about at once."""
    from torch_ctrl.bounded import NoAnswer, Silence

    silence = Silence(60.0)
    assert silence.answered() is False  # nothing was warned about
    assert [silence.due(w) for w in (5.0, 5.1, 30.0, 64.9, 65.0, 100.0, 125.0)] == [
        True, False, False, False, True, False, True
    ]  # fmt: skip
    assert silence.answered() is True
    assert silence.answered() is False
    assert silence.due(5.0) is True  # a new silence
    assert silence.due(2.0) is True  # shorter than the last warned: a new silence, after an unseen answer
    assert NoAnswer("x").waited is None


def test_a_call_given_up_on_says_how_long_it_waited() -> None:
    """What the warnings print: a call given up on waited its bound; a later call, refused at
    once, how long the first one has gone unanswered."""
    from torch_ctrl.bounded import Caller, NoAnswer, Unanswered

    release = threading.Event()
    caller = Caller()
    try:
        with pytest.raises(NoAnswer) as given_up:
            caller.call(0.2, release.wait, 60)
        assert given_up.value.waited == 0.2 and not isinstance(given_up.value, Unanswered)
        with pytest.raises(Unanswered) as refused:
            caller.call(30, lambda: None)
        assert refused.value.waited >= 0.2
    finally:
        release.set()
