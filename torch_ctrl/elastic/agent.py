"""Elastic agent hooks: fail fast, name the failed node, and keep rounds apart.

Installed by :func:`torch_ctrl.elastic.install` (the ``ctrl`` rendezvous backend and
``python -m torch_ctrl.run`` call it). Per rendezvous round, each agent opens one
``StoreCollectives`` over ``PrefixStore("torch_ctrl/agents", round store)`` (rank =
node rank), with heartbeats, and uses it for:

* **rank assignment** when workers are not identical: gather of each node's role and
  worker count to node 0, scatter of the assigned ranks (round-scoped keys, deleted);
* **the node table**: an all_gather of (host, worker count), used to name hosts in
  errors, and exported to workers as ``TORCH_CTRL_HOSTS``;
* **the failure notice**: an agent whose worker group failed with no restarts left
  aborts the group with ``"node {rank} on host {host} failed: ..."`` (also the workers'
  round namespace), then waits up to ``TORCH_CTRL_NOTICE_LINGER`` seconds (default 5)
  for every peer to acknowledge, so a store it hosts stays up until they have read it;
* **the exit barrier**: a collective barrier that ends at once on a notice (or when a
  peer's heartbeat stops) and logs one line naming the failed node.

While workers run, each agent checks for a notice at most every ``POLL`` seconds (one
store read); on one it stops its workers and fails without restarting. It also watches the
next node's agent (ring order, one read per half heartbeat interval): a node whose agent's
heartbeat stops (SIGKILL, its host down) is reported, and the round's workers' collectives
are aborted naming it, so workers blocked in them fail at once (what follows, restart or
failure, is torch's ``--max-restarts``). Under the
``ctrl`` backend, workers' ``TORCHELASTIC_RESTART_COUNT`` is the rendezvous round.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .. import keys as K
from ..base import MAX_HEARTBEAT, MIN_HEARTBEAT, ControlCollectives
from ..bounded import Caller, NoAnswer, Silence, client_timeout, parked, within
from ..errors import CollectiveAbortedError, CollectiveTimeoutError, format_ranks
from ..lanes import await_server, peek, server_of
from ..loader import StoreCollectives
from ..watcher import DEAD_AFTER
from ..workers import ENV_HOSTS, ENV_ROUND, encode_hosts, worker_namespace
from .ctrl_rendezvous import this_host

log = logging.getLogger("torch_ctrl.elastic")

AGENT_PREFIX = "torch_ctrl/agents"
ACKS = "notice/acks"  # add() by each agent that has read the failure notice
POLL = 0.5  # seconds between notice checks while workers run
# Seconds the failure notice may take on top of the linger (TORCH_CTRL_NOTICE_LINGER) before the
# agent gives up on stores that do not answer and exits.
NOTIFY_BOUND = 10.0
# Seconds the abort of the workers' collectives may take (connect, post, close) before an agent
# that found a node lost gives up on a workers' store that does not answer and goes on.
ABORT_BOUND = 10.0
# Seconds the checks made from torch's monitor loop (a peer's notice, the next node's heartbeat)
# may wait for the rendezvous store: one whose host stopped answering (SIGSTOP, a debugger, a
# frozen machine, a network cut) would hold torch's client, and the loop, for ever.
CHECK_BOUND = 5.0
SILENT_LOG_EVERY = 60.0  # seconds between the warnings that the store still does not answer
# Seconds past --exit-barrier-timeout after which an agent leaves an exit barrier whose store
# never answered (torch's client waits past its timeout for a server that stopped answering).
EXIT_GRACE = 10.0
MAX_HOSTS_ENV = 32 << 10  # TORCH_CTRL_HOSTS is not exported beyond this size


def _signal_exception() -> type[BaseException]:
    """torch's exception for a signal to the agent (an ``Exception``: broad excepts catch it)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    return SignalException


def _env_seconds(name: str, default: float, lo: float = 0.0, hi: float = math.inf) -> float:
    """``name`` from the environment as seconds: ``default`` (with a warning) unless it is 0 or
    a finite number within ``[lo, hi]`` (an infinite linger would keep a failed node from ever
    exiting; a heartbeat interval out of range would stop the launch with an error that does
    not name the variable)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (value == 0.0 or lo <= value <= hi) or not 0.0 <= value < math.inf:
        within = "" if (lo, hi) == (0.0, math.inf) else f" (0, or {lo:g} to {hi:g})"
        log.warning("torch_ctrl: %s=%r is not a number of seconds >= 0%s; using %g", name, raw, within, default)
        return default
    return value


@dataclass
class AgentGroup:
    """One agent's collectives for one rendezvous round."""

    coll: ControlCollectives
    store: dist.Store  # PrefixStore(AGENT_PREFIX, round store): the notice, its acks, the heartbeats read
    rank: int
    world_size: int
    host: str
    nodes: list[tuple[str, int]] = field(default_factory=list)  # (host, workers) per node rank
    worker_namespace: str | None = None
    next_poll: float = 0.0
    notice: tuple[int, str] | None = None  # (node rank, reason) of a peer's failure notice
    heartbeat: float | None = None  # this agent's heartbeat interval (None: liveness off)
    watched: tuple[bytes, float] | None = None  # the next node's counter and when it last moved
    next_watch: float = 0.0
    lost: bool = False  # a lost node was reported this round
    checks: Caller = field(default_factory=lambda: Caller("torch_ctrl-agent-check"))  # bounded
    silence: Silence = field(default_factory=lambda: Silence(SILENT_LOG_EVERY))  # when to warn of it
    reads: Any = field(init=False, repr=False, compare=False)  # ``store`` for calls that may be given up on

    def __post_init__(self) -> None:
        self.reads = parked(self.store)

    def host_of(self, rank: int) -> str:
        return self.nodes[rank][0] if 0 <= rank < len(self.nodes) else "?"

    def peer_notice(self) -> tuple[int, str] | None:
        """A failure notice from another node, if one has been posted (one store read)."""
        value = peek(self.reads, K.abort_key(self.world_size))
        if value is None:
            return None
        rank, reason = K.parse_notice(value)
        return None if rank == self.rank else (rank, reason)

    def lost_neighbour(self, now: float) -> tuple[int, float] | None:
        """``(node rank, seconds silent)`` when the next node in ring order (``rank + 1``) has
        an agent whose heartbeat stood still for ``DEAD_AFTER`` of its intervals (the longer
        of its declared one and this agent's); else None. One store read per half interval,
        so one per node and half interval for the whole job: every node is watched by one
        other. A counter that is gone (the agent closed its group) is never lost."""
        if self.heartbeat is None or self.world_size < 2 or self.lost or now < self.next_watch:
            return None
        self.next_watch = now + self.heartbeat / 2
        rank = (self.rank + 1) % self.world_size
        # A read that a slow or stopped store answers late: a new value is dated from the
        # answer (the beat may have come just before it), and silence is measured up to the
        # asking (a beat after that may be queued behind the read). Both err towards alive.
        asked = time.monotonic()
        value = peek(self.reads, K.group_key(self.world_size, f"hb/{rank}"))
        if value is None or value == b"0":
            self.watched = None
            return None
        if self.watched is None or self.watched[0] != value:
            self.watched = (value, time.monotonic())
            return None
        silent = asked - self.watched[1]
        interval = max(self.heartbeat, K.beat_interval(value) or 0.0)
        return (rank, silent) if silent > DEAD_AFTER * interval else None

    def first_rank(self, node: int) -> int | None:
        """The first global rank of node rank ``node`` (ranks follow node ranks), if known."""
        if not 0 <= node < len(self.nodes):
            return None
        return sum(count for _, count in self.nodes[:node])

    def describe(self, rank: int, reason: str) -> str:
        """One line naming the failed node: notices already do; heartbeat losses do not."""
        if reason.startswith("node "):
            return reason
        return f"node {rank} on host {self.host_of(rank)} failed: {reason}"

    def acknowledge(self, rank: int, reason: str) -> str:
        """Record a peer's notice and tell its sender it has been read; returns the log line."""
        self.notice = (rank, reason)
        try:
            within(CHECK_BOUND, lambda: self.reads.add(ACKS, 1), "the rendezvous store")
        except _signal_exception():
            raise  # torch's SIGTERM/SIGINT, delivered while this thread waited
        except Exception as exc:  # noqa: BLE001 - the sender may be gone already (or stopped)
            log.debug("torch_ctrl: could not acknowledge the failure notice: %s", exc)
        return self.describe(rank, reason)

    def linger(self, seconds: float) -> int:
        """Wait (bounded) until every peer has acknowledged our notice; returns how many did."""
        deadline = time.monotonic() + seconds
        acks = 0
        while self.world_size > 1:
            try:
                acks = int(self.reads.add(ACKS, 0))
            except _signal_exception():
                raise
            except Exception:  # noqa: BLE001 - the store's host read the notice and left
                return self.world_size - 1
            if acks >= self.world_size - 1 or time.monotonic() >= deadline:
                break
            time.sleep(0.05)  # polling a counter: nothing to wait on
        return acks

    def close(self) -> None:
        self.coll.close(flush_timeout=1.0)


# ----------------------------------------------------------------------------- state


def group_of(agent: Any) -> AgentGroup | None:
    """The agent's group for the current round (None before the first rendezvous)."""
    return getattr(agent, "_torch_ctrl_group", None)


def _open(agent: Any, store: dist.Store, rank: int, world_size: int) -> AgentGroup:
    _close(agent)
    prefixed = dist.PrefixStore(AGENT_PREFIX, store)
    heartbeat = _env_seconds("TORCH_CTRL_AGENT_HEARTBEAT", 5.0, MIN_HEARTBEAT, MAX_HEARTBEAT)
    interval = heartbeat if heartbeat > 0 else None
    coll = StoreCollectives(prefixed, rank, world_size, heartbeat_interval=interval)
    # The name the rendezvous records for this node: --local-addr when given, else the FQDN.
    host = getattr(getattr(getattr(agent, "_worker_group", None), "spec", None), "local_addr", None) or this_host()
    group = AgentGroup(coll, prefixed, rank, world_size, host, heartbeat=interval)
    agent._torch_ctrl_group = group
    return group


def _close(agent: Any) -> None:
    group = group_of(agent)
    if group is not None:
        agent._torch_ctrl_group = None
        group.close()


def _timeout(store: dist.Store) -> float:
    try:
        return float(store.timeout.total_seconds())
    except Exception:  # noqa: BLE001 - Python stores may not report one
        return 300.0


# ----------------------------------------------------------------------------- hooks
# Each hook takes the original method as its first argument (bound by install()).


def assign_worker_ranks(
    original: Callable[..., Any], self: Any, store: dist.Store, group_rank: int, group_world_size: int, spec: Any
) -> list[Any]:
    """Open the round's group, assign ranks through gather/scatter, share the node table."""
    group = _open(self, store, group_rank, group_world_size)
    timeout = _timeout(store)
    if os.environ.get("TORCH_ELASTIC_WORKER_IDENTICAL", "0") == "1":
        workers = original(self, store, group_rank, group_world_size, spec)
    else:
        workers = _assign_by_collectives(group.coll, spec, timeout)
    table = group.coll.all_gather(key="nodes", data=json.dumps([group.host, spec.local_world_size]), timeout=timeout)
    group.nodes = [(str(h), int(n)) for h, n in (json.loads(v) for v in table)]
    return workers


def _assign_by_collectives(coll: ControlCollectives, spec: Any, timeout: float) -> list[Any]:
    from torch.distributed.elastic.agent.server.api import Worker

    mine = json.dumps([spec.role, spec.local_world_size])
    if coll.rank == 0:  # type: ignore[attr-defined]
        infos = [json.loads(v) for v in coll.gather_recv(key="role_info", data=mine, timeout=timeout)]
        plan = [json.dumps(p) for p in plan_ranks([(str(r), int(n)) for r, n in infos])]
        assigned = coll.scatter_send(key="ranks", data=plan, timeout=timeout)
    else:
        coll.gather_send(key="role_info", data=mine, timeout=timeout)
        assigned = coll.scatter_recv(key="ranks", timeout=timeout)
    base_global, world, base_role, role_world = json.loads(assigned)
    return [
        Worker(
            local_rank=i,
            global_rank=base_global + i,
            role_rank=base_role + i,
            world_size=world,
            role_world_size=role_world,
        )
        for i in range(spec.local_world_size)
    ]


def plan_ranks(nodes: list[tuple[str, int]]) -> list[list[int]]:
    """``[(role, workers)]`` per node rank -> ``[base global rank, world size, base role rank,
    role world size]`` per node: ranks are handed out in node-rank order, globally and per role."""
    world = sum(n for _, n in nodes)
    role_world: dict[str, int] = {}
    for role, n in nodes:
        role_world[role] = role_world.get(role, 0) + n
    plan, next_global, next_role = [], 0, dict.fromkeys(role_world, 0)
    for role, n in nodes:
        plan.append([next_global, world, next_role[role], role_world[role]])
        next_global += n
        next_role[role] += n
    return plan


def setup_local_watchdog(original: Callable[..., Any], self: Any, envs: dict[int, dict[str, str]]) -> Any:
    """Export the round (as TORCHELASTIC_RESTART_COUNT too) and the host table to workers."""
    group = group_of(self)
    handler = self._worker_group.spec.rdzv_handler
    rnd = getattr(handler, "round", None)
    hosts = encode_hosts(group.nodes) if group is not None else ""
    for env in envs.values():
        if rnd is not None:
            env[ENV_ROUND] = str(rnd)
            env["TORCHELASTIC_RESTART_COUNT"] = str(rnd)
        if hosts and len(hosts) <= MAX_HOSTS_ENV:
            env[ENV_HOSTS] = hosts
    if group is not None and envs:
        group.worker_namespace = worker_namespace(next(iter(envs.values())))
    return original(self, envs)


def monitor_workers(original: Callable[..., Any], self: Any, worker_group: Any) -> Any:
    """After torch's check, look for a peer's failure notice (throttled while healthy)."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

    result = original(self, worker_group)
    group = group_of(self)
    if group is None or group.notice is not None or result.state == WorkerState.SUCCEEDED:
        return result
    now = time.monotonic()
    if result.state == WorkerState.HEALTHY and now < group.next_poll:
        return result
    group.next_poll = now + POLL
    healthy = result.state == WorkerState.HEALTHY
    try:
        notice, lost = group.checks.call(CHECK_BOUND, _look, group, healthy, now)
    except NoAnswer as exc:
        _silent(group, exc.waited or CHECK_BOUND)
        return result
    except _signal_exception():
        raise  # torch's SIGTERM/SIGINT, delivered while this thread waited for the check
    except Exception as exc:  # noqa: BLE001 - torch's own store calls will report it
        log.debug("torch_ctrl: notice check failed: %s", exc)
        return result
    if group.silence.answered():
        log.warning("torch_ctrl: the rendezvous store%s answers the agents' checks again", _at(group))
    if notice is None:
        if lost is not None:
            _lost(self, worker_group, group, *lost)
        return result
    line = group.acknowledge(*notice)
    self._remaining_restarts = 0  # the job has failed on another node: restarting cannot help
    log.error("[%s] torch_ctrl: %s; stopping this node's workers", worker_group.spec.role, line)
    if not healthy:
        return result
    return RunResult(state=WorkerState.FAILED, failures=_stopped(worker_group, line))


def _look(group: AgentGroup, healthy: bool, now: float) -> tuple[tuple[int, str] | None, tuple[int, float] | None]:
    """A peer's failure notice, and (workers healthy, no notice) a lost next node."""
    notice = group.peer_notice()
    if notice is not None or not healthy:
        return notice, None
    try:
        return None, group.lost_neighbour(now)
    except Exception as exc:  # noqa: BLE001 - torch's own store calls will report it
        log.debug("torch_ctrl: liveness check failed: %s", exc)
        return None, None


def _at(group: AgentGroup) -> str:
    server = server_of(group.store)
    return f" at {server}" if server else ""


def _silent(group: AgentGroup, waited: float) -> None:
    """Warn that the store does not answer the checks: at once, then every SILENT_LOG_EVERY s."""
    if not group.silence.due(waited):
        return
    log.warning(
        "torch_ctrl: the rendezvous store%s has not answered the agents' checks for %.0fs: the agent that "
        "hosts it is stopped or hung (SIGSTOP, a debugger, a frozen machine), or the network to it is down; "
        "this agent goes on watching its workers",
        _at(group),
        waited,
    )


def _lost(agent: Any, worker_group: Any, group: AgentGroup, node: int, silent: float) -> None:
    """A node lost without a word (its agent SIGKILLed, its host down) while workers run:
    abort the workers' collectives of the round, so that workers blocked in them fail at once
    naming it, instead of waiting out their timeout. What happens next is torch's: the
    workers that fail end this round (restart or failure, as ``--max-restarts`` says)."""
    group.lost = True
    line = (
        f"node {node} on host {group.host_of(node)} lost: its agent's heartbeat stopped {silent:.1f}s ago "
        "(killed, or its host is down)"
    )
    log.error("[%s] torch_ctrl: %s; aborting this round's workers' collectives", worker_group.spec.role, line)
    _abort_workers(worker_group, group, line, group.first_rank(node))


def _stopped(worker_group: Any, line: str) -> dict[int, Any]:
    """ProcessFailure records for workers stopped because another node failed."""
    import signal

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failures = {}
    for worker in worker_group.workers:
        failure = ProcessFailure(
            local_rank=worker.local_rank, pid=worker.id or -1, exitcode=-int(signal.SIGTERM), error_file=""
        )
        failure.message = f"stopped by torch_ctrl: {line}"
        failures[worker.global_rank] = failure
    return failures


def invoke_run(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    """Run torch's loop; if this node's workers failed for good, tell the other nodes."""
    try:
        result = original(self, *args, **kwargs)
        group = group_of(self)
        if group is not None and result.is_failed() and group.notice is None:
            _announce(self, group, result)
        return result
    finally:
        _close(self)


def _announce(agent: Any, group: AgentGroup, result: Any) -> None:
    causes = _root_causes_first(result.failures)
    codes = ", ".join(_exit(rank, failure) for rank, failure in causes)
    reason = f"node {group.rank} on host {group.host} failed: {codes or 'workers failed'} (no restarts left)"
    log.error("[%s] torch_ctrl: %s; notifying the other nodes", agent._worker_group.spec.role, reason)
    linger = _env_seconds("TORCH_CTRL_NOTICE_LINGER", 5.0)
    # Bounded as a whole: a store whose server accepts connections but never answers (the
    # agent hosting it stopped, SIGSTOP or a debugger) would block every call below for ever,
    # and this node would never exit to report its failure.
    bound = max(linger, 0.0) + NOTIFY_BOUND
    try:
        within(bound, lambda: _notify(agent, group, reason, causes[0][0] if causes else None, linger), "the stores")
    except NoAnswer:
        log.warning(
            "torch_ctrl: the failure notice was not delivered within %gs: the rendezvous or workers' store "
            "does not answer (the agent hosting it stopped or hung?)",
            bound,
        )


def _notify(agent: Any, group: AgentGroup, reason: str, cause: int | None, linger: float) -> None:
    try:
        group.coll.abort(reason)
    except Exception as exc:  # noqa: BLE001 - the notice is best effort; the failure stands
        log.warning("torch_ctrl: could not post the failure notice: %s", exc)
        return
    _abort_workers(agent._worker_group, group, reason, cause)
    acks = group.linger(linger)
    if acks < group.world_size - 1:
        log.warning("torch_ctrl: %d of %d nodes read the failure notice within %gs", acks, group.world_size - 1, linger)


def _root_causes_first(failures: dict[int, Any]) -> list[tuple[int, Any]]:
    """The root causes first, in the order they failed (an exit code, or a signal from outside:
    SIGKILL from the OOM killer, SIGSEGV), then the workers torch stopped: torchrun stops the
    others of a failed group with SIGTERM."""
    import signal

    def stopped_by_torch(failure: Any) -> bool:
        return failure.exitcode == -int(signal.SIGTERM)

    return sorted(failures.items(), key=lambda item: (stopped_by_torch(item[1]), item[1].timestamp, item[0]))


def _exit(rank: int, failure: Any) -> str:
    import signal

    code = failure.exitcode
    if code < 0:
        try:
            return f"rank {rank}: killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"rank {rank}: exit code {code}"


def _abort_workers(worker_group: Any, group: AgentGroup, reason: str, cause: int | None = None) -> None:
    """Abort the workers' collectives of this round, so peers blocked in them fail at once;
    the notice comes from ``cause`` (the global rank whose failure is the root cause, or the
    first rank of a lost node) when it is a rank of the job, else from this node's first worker."""
    if group.worker_namespace is None or not worker_group.workers or not worker_group.master_addr:
        return
    addr, port, namespace = worker_group.master_addr, int(worker_group.master_port), group.worker_namespace
    # A store that is gone (it was on the lost node) refuses at once: say so without entering
    # torch's connect loop, which retries for its timeout and logs a C++ trace per attempt.
    gone = await_server(addr, port, 1.0)
    if gone is not None:
        log.debug("torch_ctrl: the workers' store %s:%d is gone (%s): nothing to abort", addr, port, gone)
        return
    first = worker_group.workers[0]
    rank = cause if cause is not None and 0 <= cause < first.world_size else first.global_rank

    def post() -> None:
        made = client_timeout(ABORT_BOUND)
        client = dist.TCPStore(addr, port, is_master=False, timeout=made, wait_for_workers=False)
        client.set_timeout(timedelta(seconds=5))
        coll = StoreCollectives(dist.PrefixStore(namespace, client), rank, first.world_size)
        try:
            coll.abort(reason)
        finally:
            coll.close(flush_timeout=0.5)

    try:
        # Bounded: a server that accepts connections but never answers (the agent hosting it
        # stopped) would hold torch's monitor loop, which calls this, for ever.
        within(ABORT_BOUND, post, f"the workers' store {addr}:{port}")
    except Exception as exc:  # noqa: BLE001 - best effort
        log.debug("torch_ctrl: could not abort the workers' collectives: %s", exc)


def exit_barrier(original: Callable[..., Any], self: Any) -> None:
    """torch's exit barrier, ending at once on a peer's failure notice or lost heartbeat."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    group = group_of(self)
    if group is None:
        return original(self)
    role = self._worker_group.spec.role
    log.info(
        "[%s] Local worker group finished (%s). Waiting up to %s seconds for other agents",
        role,
        self._worker_group.state,
        self._exit_barrier_timeout,
    )
    start = time.monotonic()
    self._in_exit_barrier = True
    timeout = float(self._exit_barrier_timeout)
    try:
        # On a thread, bounded: a store whose host stopped answering would hold this agent (and
        # the end of the job) for ever; the wait here also takes a SIGTERM at once.
        within(timeout + EXIT_GRACE, lambda: group.coll.barrier(key="exit", timeout=timeout), "the rendezvous store")
        log.info("[%s] Done waiting for other agents. Elapsed: %.1f seconds", role, time.monotonic() - start)
    except NoAnswer:
        log.error(
            "[%s] torch_ctrl: left the exit barrier after %.0fs: the rendezvous store%s does not answer (the agent "
            "that hosts it is stopped or hung, or the network to it is down)",
            role,
            time.monotonic() - start,
            _at(group),
        )
    except CollectiveAbortedError as exc:
        line = group.acknowledge(exc.rank, exc.reason)
        log.error("[%s] torch_ctrl: %s; left the exit barrier after %.1fs", role, line, time.monotonic() - start)
    except CollectiveTimeoutError as exc:
        where = ", ".join(f"node {r} on host {group.host_of(r)}" for r in exc.missing[:16]) or "unknown nodes"
        log.error(
            "[%s] torch_ctrl: exit barrier timed out after %ss: missing %s (%s)",
            role,
            self._exit_barrier_timeout,
            format_ranks(exc.missing) if exc.missing else "?",
            where,
        )
    except SignalException as exc:
        log.warning("Got termination signal: %s", exc.sigval)
        raise
    except Exception:
        log.exception("[%s] Error waiting on exit barrier. Elapsed: %.1f seconds", role, time.monotonic() - start)
    finally:
        self._in_exit_barrier = False
    return None


def hook_table() -> list[tuple[type, str, Callable[..., Any]]]:
    """``(class, method name, hook)`` for every agent method the hooks wrap."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    return [
        (SimpleElasticAgent, "_assign_worker_ranks", assign_worker_ranks),
        (SimpleElasticAgent, "_invoke_run", invoke_run),
        (SimpleElasticAgent, "_exit_barrier", exit_barrier),
        (LocalElasticAgent, "_monitor_workers", monitor_workers),
        (LocalElasticAgent, "_setup_local_watchdog", setup_local_watchdog),
    ]
