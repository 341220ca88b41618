"""See a live job: :func:`inspect` decodes a store's torch_ctrl keys (``docs/protocol.md``).

It connects as a plain client and **writes nothing**: it lists the keys (``list_keys``),
checks which exist (``check``) and reads them (``multi_get``/``get`` after ``check``), on a
clone of the store whose timeout it may set (the caller's store object is not touched).
From that it reports, for every group found (key prefix x world size):

* each collective in flight: op, the user's key decoded from its token, ``k/N`` arrived,
  the ranks blocked in it (its NAMES log) and the ranks missing, and for how long it has
  been seen pending (the protocol records no times: two samples, or ``--watch``);
* heartbeats: how long since each rank's counter last moved, and which ranks stopped;
* the abort notice (rank and reason);
* under torchrun (``ctrl`` backend): the run, its rounds, the nodes of the current round
  (from torch's own rendezvous state), the agents' failure notice, and the workers' store,
  which is inspected too.

The result is one JSON-serializable dict (schema ``torch_ctrl.inspect/1``, documented in
``docs/inspect.md``); :func:`torch_ctrl.inspect_text.render` prints it for humans.

Every store call (connecting included) is bounded: a server that accepts the connection but
never answers (its process stopped, e.g. a torchrun agent under SIGSTOP or a debugger; or not
a TCPStore) holds torch's client forever, whatever its timeout, so each call runs on a daemon
thread and :class:`NoAnswerError` is raised after ``timeout + GRACE`` seconds.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Union
from urllib.parse import unquote_to_bytes

import torch.distributed as dist

from . import keys as K
from . import lanes
from . import rdzv_state as R
from .bounded import Caller, NoAnswer, Unanswered, parked
from .lanes import peek

SCHEMA = "torch_ctrl.inspect/1"
# A rank's counter stood still while another rank's moved this many times, or (when the rank
# declared its interval in its counter) for this many of its intervals: the rank is stopped.
STOPPED_AFTER = 3
# inspect() samples until every heartbeat counter moved or stood still long enough to tell
# (STOPPED_AFTER of its rank's intervals), for at most this many seconds: the torchrun agents
# beat every 5 s, so one of them is told stopped after 15 s.
MAX_OBSERVE = 20.0
# A rendezvous node whose keep-alive is older than this is dead to the rendezvous by default
# (keep_alive_interval 5 s x keep_alive_max_attempt 3, for c10d's and the ctrl backend alike):
# what a node is judged by when the store does not say its own (c10d's state never does; ctrl
# nodes record theirs in R/da/{node}).
KEEP_ALIVE_DEAD_AFTER = 15.0
# Seconds before a followed workers' store that could not be opened is tried again.
RELINK = 10.0
# Seconds a store call may take past the timeout before it counts as unanswered (a server that
# accepted the connection but never answers: a process under SIGSTOP or a debugger).
GRACE = 1.0
MAX_PROBE_WORLD = 1024  # world sizes probed on stores that cannot list their keys
# Rank lists (missing, absent) are spelled out up to this world size: a key naming a group of
# 2^31 ranks (or one torch_ctrl could not have written) must not cost billions of entries.
MAX_LISTED_WORLD = 1 << 20
MAX_WORLD = (1 << 31) - 1  # the largest world size torch_ctrl accepts (base.MAX_WORLD_SIZE)
_BATCH = 2048  # keys per check + multi_get
READ_WAIT = 0.2  # seconds a batch read may wait for a key that was deleted after it was checked
_KEY = re.compile(r"^(.*?)" + re.escape(K.PROTOCOL) + r"/w(\d+)/([^/]+)/(.+)$")
_SLOT = re.compile(r"^r(\d+)$")
_READ_FIELDS = (K.ARRIVE, K.BARRIER, K.EXIT, K.NAMES, K.LOG)
_AGENTS = "/torch_ctrl/agents/"
_WORKERS = re.compile(r"^torch_ctrl/run/([^/]+)/(?:round(\d+)|restart(\d+))/$")
_WORKERS_RUN = re.compile(r"^torch_ctrl/run/([^/]+)/")

StoreLike = Union[dist.Store, str]


# ---------------------------------------------------------------------------- decoding


def decode_token(token: str) -> str:
    """The user's key of an op token (``'#17'`` for the 18th keyless call; a hashed key
    cannot be decoded and reads ``<sha256 …>``)."""
    if token.startswith("k"):
        return unquote_to_bytes(token[1:]).decode("utf-8", "replace")
    if token.startswith("s") and token[1:].isdigit():
        return f"#{token[1:]}"
    if token.startswith("h"):
        return f"<sha256 {token[1:13]}…>"
    return token


def describe_prefix(prefix: str) -> dict[str, Any]:
    """What a group's key prefix means: ``kind`` is ``agents`` (torchrun agents of one
    rendezvous round), ``workers`` (``from_env()`` in one round), ``plain`` (no prefix) or
    ``prefix`` (a PrefixStore of the user's)."""
    if not prefix:
        return {"kind": "plain"}
    if prefix.startswith(R.RDZV_PREFIX) and prefix.endswith(_AGENTS):
        split = R.split_key(prefix)
        if split is not None and split[2] == _AGENTS[1:]:
            return {"kind": "agents", "run_id": split[0], "round": split[1]}
    m = _WORKERS.match(prefix)
    if m:
        run = unquote_to_bytes(m.group(1)).decode("utf-8", "replace")
        out: dict[str, Any] = {"kind": "workers", "run_id": None if run == "-" else run}
        if m.group(2) is not None:
            out["round"] = int(m.group(2))
        elif m.group(3) is not None:
            out["restart"] = int(m.group(3))
        return out
    if prefix.startswith("torch_ctrl/run/-/"):
        return {"kind": "workers", "run_id": None}
    return {"kind": "prefix"}


@dataclass
class _OpKeys:
    fields: set[str] = field(default_factory=set)
    slots: set[int] = field(default_factory=set)


@dataclass
class _GroupKeys:
    prefix: str
    world: int
    ops: dict[str, _OpKeys] = field(default_factory=dict)
    beats: dict[int, str] = field(default_factory=dict)  # rank -> key
    abort: str | None = None


def _new_run() -> dict[str, Any]:
    # state_key: c10d's pickled state; master: c10d's MASTER_ADDR/PORT per round; native: the
    # ctrl rendezvous's (round, rest) key names
    return {"state_key": None, "rounds": set(), "master": {}, "native": []}


def _parse(
    keys: Iterable[str], prefix: str = ""
) -> tuple[dict[tuple[str, int], _GroupKeys], dict[str, dict[str, Any]]]:
    """Sort keys into groups (prefix, world size), only from keys starting with ``prefix``,
    and torchrun runs (from every key: a run leads to the workers' store ``prefix`` may name)."""
    groups: dict[tuple[str, int], _GroupKeys] = {}
    runs: dict[str, dict[str, Any]] = {}
    for key in keys:
        m = _KEY.match(key)
        if m is not None and not key.startswith(prefix):
            continue
        if m is None:
            native = R.split_native(key)
            if native is not None:
                run = runs.setdefault(native[0], _new_run())
                run["native"].append(native[1:])
                if native[1] is not None:
                    run["rounds"].add(native[1])
                continue
            split = R.split_key(key)
            if split is not None:
                run = runs.setdefault(split[0], _new_run())
                if split[1] is None:
                    run["state_key"] = key
                else:
                    run["rounds"].add(split[1])
                    if split[2] in (R.MASTER_ADDR, R.MASTER_PORT):
                        run["master"][(split[1], split[2])] = key
            continue
        # the group's own prefix: ``prefix`` stays the filter for every later key
        where, world, token, rest = m.group(1), int(m.group(2)), m.group(3), m.group(4)
        if not 1 <= world <= MAX_WORLD:
            continue  # no torch_ctrl group has this size: not its key
        group = groups.get((where, world))
        if group is None:
            group = groups[(where, world)] = _GroupKeys(where, world)
        split = R.split_key(where)
        if split is not None and split[1] is not None:
            runs.setdefault(split[0], _new_run())["rounds"].add(split[1])
        if token == "_":
            if rest == "abort":
                group.abort = key
            elif rest.startswith("hb/") and rest[3:].isdigit():
                group.beats[int(rest[3:])] = key
            continue
        op = group.ops.get(token)
        if op is None:
            op = group.ops[token] = _OpKeys()
        slot = _SLOT.match(rest)
        if slot is not None:
            op.slots.add(int(slot.group(1)))
        elif "/" not in rest:
            op.fields.add(rest)
        # chunk keys (".../c{i}", "g/{rank}/c{i}") only say a payload is large: not read
    return groups, runs


def _run_in(run_id: str, prefix: str) -> bool:
    """Whether the torchrun run ``run_id`` is shown (and its workers' store followed) under
    ``prefix``: every run, unless the prefix is one run's namespace (its workers' rounds
    ``torch_ctrl/run/{run}/``, its agents ``torch.rendezvous.{run}.``, its ctrl rendezvous
    ``torch_ctrl/rdzv/{run}/``)."""
    named = _WORKERS_RUN.match(prefix)
    if named is not None:
        run = unquote_to_bytes(named.group(1)).decode("utf-8", "replace")
        return run == run_id
    split = R.split_native(prefix)
    if split is not None:
        return split[0] == run_id
    split = R.split_key(prefix)
    if split is not None and split[1] is not None:
        return split[0] == run_id
    return True


def _all_slots(op: _OpKeys, world: int) -> bool:
    """Every rank's slot is there (a generic all_gather that finished, or that an abort woke)."""
    return not op.fields - {K.EXIT, K.NAMES} and len({r for r in op.slots if 0 <= r < world}) >= world


def _beats(value: bytes | None) -> int | None:
    """A heartbeat counter's beats: each adds ``K.BEAT`` (the low bits hold the interval); a
    counter below ``K.BEAT`` counts them one by one (as earlier versions wrote them)."""
    number = _int(value)
    if number is None or number < 0:
        return None
    return number // K.BEAT if number >= K.BEAT else number


def _beat_status(just_moved: bool, moved: bool, age: float, interval: float | None, others: int) -> str:
    """One rank's heartbeat status: ``ok`` (seen moving, recently), ``late`` (should have
    moved by now), ``stopped``, or ``unknown`` (not seen long enough). ``age``: seconds since
    its counter was seen to move (or first seen); ``others``: other ranks' beats meanwhile.

    A rank that declared its interval is judged by it alone (ranks of one group may beat at
    different intervals): stopped after STOPPED_AFTER intervals without a move, late after
    1.5. A counter without one (earlier versions) is judged by the others' beats."""
    if just_moved:
        return "ok"
    if interval is not None:
        if age >= STOPPED_AFTER * interval:
            return "stopped"
        if age > 1.5 * interval:
            return "late"
        return "ok" if moved else "unknown"
    if moved and others == 0:
        return "ok"
    if others >= STOPPED_AFTER:
        return "stopped"
    return "late" if others > 0 else "unknown"


def _declared_interval(value: bytes | None) -> float | None:
    """The interval (seconds) a rank declared in its heartbeat counter; None for a counter
    without one (below ``K.BEAT``: one by one, as earlier versions counted)."""
    number = _int(value)
    if number is None or number < K.BEAT:
        return None
    return K.beat_interval(value or b"")


def _int(value: bytes | None) -> int | None:
    if value is None or not value.lstrip(b"-").isdigit():
        return None
    return int(value)


def _is_int_payload(value: bytes) -> bool:
    """Whether a tagged value/frame payload is what all_sum writes (``D`` + canonical decimal)."""
    if value[:1] != K.TAG_DATA:
        return False
    text = value[1:]
    return text.lstrip(b"-").isdigit() and text == b"%d" % int(text)


def _others(world: int, present: Iterable[int]) -> list[int] | None:
    """The ranks of ``range(world)`` not in ``present``; None above MAX_LISTED_WORLD."""
    if world > MAX_LISTED_WORLD:
        return None
    seen = set(present)
    return [r for r in range(world) if r not in seen]


def _classify(world: int, op: _OpKeys, values: dict[str, bytes | None], key_of: Any) -> dict[str, Any] | None:
    """What one op's keys say: ``None`` for a finished op whose keys await cleanup."""
    fields = op.fields
    # The TCPStore path's server-side barrier counts on `b`, the generic path on `n`.
    count_field = K.BARRIER if K.BARRIER in fields else K.ARRIVE
    counter = _int(values.get(key_of(count_field))) if count_field in fields else None
    names_raw = values.get(key_of(K.NAMES)) if K.NAMES in fields else None
    blocked = sorted(K.parse_names(names_raw)) if names_raw else []
    blocked = [r for r in blocked if 0 <= r < world]
    exits = _int(values.get(key_of(K.EXIT))) if K.EXIT in fields else None
    out: dict[str, Any] = {"blocked": blocked, "aborted": counter is not None and counter >= K.ABORT_BIAS}
    present: set[int] | None = None
    if K.LOG in fields:  # all_gather / all_sum on a TCPStore: the log's frames carry ranks
        frames = K.parse_frames(values.get(key_of(K.LOG)) or b"")
        if counter is not None and world <= counter < K.ABORT_BIAS:
            return None
        payloads = [p for r, p in frames if r >= 0]
        out["aborted"] = out["aborted"] or any(r < 0 for r, _ in frames)
        is_sum = bool(payloads) and all(_is_int_payload(p) for p in payloads)
        out["op"], out["candidates"] = (
            ("all_sum", ["all_sum", "all_gather"]) if is_sum else ("all_gather", ["all_gather"])
        )
        present = {r for r, _ in frames if 0 <= r < world}
    elif count_field in fields:  # barrier (TCPStore counter, or the generic add/done); all_sum (generic: + total)
        done = values.get(key_of(K.DONE)) if K.DONE in fields else None
        if done is not None and done[:1] == K.TAG_ABORT:
            out["aborted"] = True  # the watcher released the waiters by writing the notice there
        elif K.DONE in fields or (counter is not None and world <= counter < K.ABORT_BIAS):
            return None
        kind = "all_sum" if K.SUM in fields else "barrier"
        out["op"], out["candidates"] = kind, [kind]
        # A raised counter no longer counts arrivals; a generic counter still does after an abort.
        arrived = min(counter or 0, world) if counter is None or counter < K.ABORT_BIAS else None
        out["arrived"] = arrived
        named = set(blocked)
        if out["aborted"] and not named:  # released by the abort: nobody is waiting any more
            out["missing"], out["unnamed"] = None, 0
            return out
        out["missing"] = _others(world, named)
        out["unnamed"] = max(0, (arrived or 0) - len(named))
        return out
    elif op.slots:
        slots = {r for r in op.slots if 0 <= r < world}
        roots = [r for r in blocked if r not in slots]
        if len(slots) >= world:
            first = values.get(key_of("r0"))
            if first is None or first[:1] != K.TAG_ABORT:
                return None  # every rank's slot is there: a finished all_gather (generic)
            # The abort's notice overwrote every slot: who had arrived is gone with them.
            out["op"], out["candidates"] = "all_gather", ["all_gather"]
            out["aborted"] = True
            named = set(blocked)
            out["arrived"] = None
            out["missing"] = _others(world, named) if named else None
            out["unnamed"] = 0
            out["detail"] = "released by the abort; its slots hold the notice"
            return out
        if roots:  # a blocked rank without a slot: the root of a gather
            out["op"], out["candidates"] = "gather", ["gather"]
            out["root"] = roots[0]
            present = slots | set(roots)
        elif blocked:  # every blocked rank wrote its slot: all_gather (generic; all_sum adds to `s`)
            out["op"], out["candidates"] = "all_gather", ["all_gather"]
            present = slots
        else:  # slots and nobody waiting: a gather whose root has not come, or an untaken scatter
            out["op"], out["candidates"] = "gather|scatter", ["gather", "scatter"]
            out["slots"] = sorted(slots)
            out["arrived"], out["missing"], out["unnamed"] = None, None, 0
            out["detail"] = f"slots written for {len(slots)} rank(s), nobody blocked"
            return out
    elif K.DONE in fields:  # a broadcast the root has sent: receivers count out on x
        receivers = world - 1
        taken = exits or 0
        if taken >= receivers:
            return None
        out["op"], out["candidates"] = "broadcast", ["broadcast"]
        out["arrived"], out["missing"], out["unnamed"] = None, None, 0
        out["detail"] = f"sent; {taken}/{receivers} receivers took it"
        return out
    elif blocked:  # receivers waiting for a root that has not sent
        cands = ["broadcast", "scatter"] + (["gather"] if len(blocked) == 1 else [])
        out["op"], out["candidates"] = "|".join(cands), cands
        out["arrived"] = len(blocked)
        out["missing"] = _others(world, blocked)
        out["unnamed"] = 0
        out["detail"] = "waiting for the root to send"
        return out
    else:
        return None  # only an exit counter: a finished op being cleaned up
    assert present is not None
    out["arrived"] = len(present)
    out["missing"] = _others(world, present)
    out["unnamed"] = 0
    return out


# ------------------------------------------------------------------------------ reading

_STOPPED = "a stopped or hung process, e.g. a torchrun agent under SIGSTOP or a debugger"


class NoAnswerError(dist.DistStoreError):
    """A store call was not answered within the inspection's timeout (plus :data:`GRACE`):
    the server accepted the connection but never answered (its process is stopped or hung,
    or it is not a TCPStore). torch's TCPStore client waits for such an answer forever,
    whatever its timeout."""


class _Caller:
    """The store calls of one connection, each waited for at most ``timeout + GRACE`` seconds
    (a :class:`bounded.Caller`), then :class:`NoAnswerError`. While a call is unanswered, every
    later one fails at once (it would queue behind the unanswered one)."""

    def __init__(self, address: str, timeout: float) -> None:
        self.address = address
        self.timeout = timeout
        self._caller = Caller(f"torch_ctrl inspect {address}")

    def call(self, fn: Any, *args: Any, connecting: bool = False) -> Any:
        try:
            return self._caller.call(self.timeout + GRACE, fn, *args)
        except Unanswered as exc:
            raise NoAnswerError(
                f"{self.address} has not answered a store call for {exc.waited:.0f}s ({_STOPPED})"
            ) from None
        except NoAnswer:
            if connecting:
                raise NoAnswerError(
                    f"{self.address} accepted a connection but did not answer within {self.timeout:g}s "
                    f"({_STOPPED}, or not a TCPStore)"
                ) from None
            raise NoAnswerError(f"{self.address} did not answer a read within {self.timeout:g}s ({_STOPPED})") from None


class _Bounded:
    """A store whose calls that reach its server run through a :class:`_Caller` (bounded);
    everything else (``timeout``, ``set_timeout``) is the store's own."""

    _CALLS = frozenset({"get", "check", "multi_get", "list_keys", "num_keys", "compare_set"})

    def __init__(self, store: dist.Store, caller: _Caller) -> None:
        self.store = store
        self._caller = caller

    def __getattr__(self, name: str) -> Any:
        if name in self._CALLS:
            # Through the extension where it can: a call given up on that is answered while
            # this process exits then parks its thread rather than abort the process.
            call = getattr(parked(self.store), name)
            return lambda *args: self._caller.call(call, *args)
        return getattr(self.store, name)


def _clone(store: dist.Store, timeout: float) -> dist.Store:
    """A connection of our own (so its timeout can be set), or the store itself."""
    try:
        mine = _Caller(_address(store), timeout).call(store.clone, connecting=True)
    except NoAnswerError:
        raise
    except Exception:  # noqa: BLE001 - stores without clone() are read as they are
        return store
    try:
        mine.set_timeout(timedelta(seconds=timeout))
    except Exception:  # noqa: BLE001 - keep its own timeout
        pass
    return mine


def read_values(store: dist.Store, keys: Sequence[str], owned: bool = False) -> dict[str, bytes | None]:
    """``{key: value or None}`` without writing: ``check`` then ``multi_get`` per batch, each key
    read without waiting when a batch is incomplete.

    On a live job a listed (and checked) key can be deleted by its group's cleanup before it
    is read, and TCPStore's ``multi_get`` then waits for it until the connection's timeout:
    on a connection of our own (``owned``) the batch read waits at most ``READ_WAIT`` seconds
    before its keys are read one by one."""
    out: dict[str, bytes | None] = {}
    for start in range(0, len(keys), _BATCH):
        batch = list(keys[start : start + _BATCH])
        try:
            if store.check(batch):
                out.update(zip(batch, _read_existing(store, batch, owned)))
                continue
        except NoAnswerError:
            raise
        except Exception:  # noqa: BLE001 - a key went away in between: read one by one
            pass
        for key in batch:
            out[key] = _read_one(store, key, owned)
    return out


def _read_existing(store: dist.Store, batch: list[str], owned: bool) -> list[bytes]:
    """``multi_get`` of keys that existed a moment ago, waiting at most ``READ_WAIT`` on a
    connection of ours (its timeout is restored)."""
    if not owned:
        return [bytes(v) for v in store.multi_get(batch)]
    previous = store.timeout
    store.set_timeout(timedelta(seconds=READ_WAIT))
    try:
        return [bytes(v) for v in store.multi_get(batch)]
    finally:
        store.set_timeout(previous)


def _read_one(store: dist.Store, key: str, owned: bool = False) -> bytes | None:
    """One key, never waiting long. On a connection of ours: ``check``, then a read that waits
    at most ``READ_WAIT``, so nothing is written: TCPStore takes ``compare_set`` for a write to
    the key and releases the ranks waiting on it in its server-side barrier. Elsewhere (the
    caller's own store, whose timeout is not ours to change): ``compare_set`` that cannot match
    (stores without it: check + get)."""
    if owned:
        try:
            return _read_existing(store, [key], owned)[0] if store.check([key]) else None
        except NoAnswerError:
            raise
        except Exception:  # noqa: BLE001 - deleted between check and read
            return None
    try:
        return peek(store, key)
    except NoAnswerError:
        raise
    except Exception:  # noqa: BLE001 - stores without compare_set
        pass
    try:
        return bytes(store.get(key)) if store.check([key]) else None
    except NoAnswerError:
        raise
    except Exception:  # noqa: BLE001 - deleted between check and get
        return None


def list_keys(store: dist.Store) -> list[str] | None:
    """Every key of the store, or ``None`` when the store cannot list them."""
    try:
        return list(store.list_keys())
    except NoAnswerError:
        raise
    except Exception:  # noqa: BLE001 - older torch, Python stores
        return None


def _probe_keys(store: dist.Store, prefix: str) -> list[str]:
    """Without list_keys: the group-wide keys found under ``prefix`` for world sizes up to
    MAX_PROBE_WORLD (abort notice, heartbeats)."""
    found: list[str] = []
    for world in range(1, MAX_PROBE_WORLD + 1):
        abort = prefix + K.abort_key(world)
        hb0 = prefix + K.group_key(world, "hb/0")
        try:
            if store.check([abort]):
                found.append(abort)
            if store.check([hb0]):
                beats = [prefix + K.group_key(world, f"hb/{r}") for r in range(world)]
                found += [k for k in beats if store.check([k])]
        except NoAnswerError:
            raise
        except Exception:  # noqa: BLE001 - nothing more to find
            break
    return found


# ---------------------------------------------------------------------------- inspector


@dataclass
class _Seen:
    first: float
    changed: float
    signature: Any


@dataclass
class _Beats:
    """One group's heartbeat history: snapshots of every rank's counter."""

    times: list[float] = field(default_factory=list)
    values: list[dict[int, int]] = field(default_factory=list)
    # rank -> (snapshot index of its last change, whether it was a move rather than a first sighting)
    changed_at: dict[int, tuple[int, bool]] = field(default_factory=dict)


class Inspector:
    """Samples one store repeatedly and keeps what the protocol does not record: when each
    op was first seen and when it last changed, and each heartbeat counter's history.

    ``store``: a ``torch.distributed.Store`` (only read, never written; its timeout is not
    changed) or ``"HOST:PORT"`` of a TCPStore server, which is joined as a client.
    ``prefix``: only groups whose keys start with it (here and on the workers' store).
    ``follow``: also inspect the workers' store a torchrun round names. ``timeout``: seconds
    for connecting and for each read; a call not answered within ``timeout`` plus ``GRACE``
    raises ``NoAnswerError`` (a ``torch.distributed.DistStoreError``).
    """

    def __init__(
        self, store: StoreLike, *, prefix: str | None = None, follow: bool = True, timeout: float = 5.0
    ) -> None:
        self.address = store if isinstance(store, str) else _address(store)
        self._timeout = timeout
        self._source = store
        self._store = self._connect()
        # A connection of ours (its timeout may be changed for a read), not the caller's store.
        self._owned = isinstance(store, str) or self._store.store is not store
        self._prefix = prefix or ""
        self._follow = follow
        self._ops: dict[tuple[str, str, int, str], _Seen] = {}
        self._beats: dict[tuple[str, str, int], _Beats] = {}
        self._linked: dict[str, Inspector | tuple[str, float]] = {}  # or (error, when to try again)
        self._samples: list[float] = []

    def _connect(self) -> _Bounded:
        """The connection (the caller's store, or a clone of it), every read of it bounded."""
        source = self._source
        store = connect(source, self._timeout) if isinstance(source, str) else _clone(source, self._timeout)
        return _Bounded(store, _Caller(self.address, self._timeout))

    def _num_keys(self) -> int | None:
        """The store's key count, on a new connection of ours when the server dropped the last
        one: a legacy TCPStore server drops a connection whose read finds a key deleted after
        its wait (a live job's cleanup), and every later sample would read nothing."""
        try:
            return int(self._store.num_keys())
        except NoAnswerError:
            raise
        except Exception as exc:  # noqa: BLE001 - not every store counts
            if not (self._owned and lanes.connection_lost(exc)):
                return None
        self._store = self._connect()
        try:
            return int(self._store.num_keys())
        except NoAnswerError:
            raise
        except Exception:  # noqa: BLE001 - as above
            return None

    def sample(self) -> dict[str, Any]:
        """Read the store once and return the report (see ``docs/inspect.md``)."""
        now = time.monotonic()
        began = time.perf_counter()
        self._samples.append(now)
        report: dict[str, Any] = {
            "schema": SCHEMA,
            "store": self.address,
            "time": time.time(),
            "samples": len(self._samples),
            "observed_s": round(now - self._samples[0], 3),
            "enumerable": True,
            "limitations": [],
            "groups": [],
            "torchrun": [],
        }
        self._sample_into(report, now)
        report["client_s"] = round(time.perf_counter() - began, 3)
        return report

    def _sample_into(self, report: dict[str, Any], now: float) -> None:
        report["num_keys"] = self._num_keys()
        store = self._store
        keys = list_keys(store)
        if keys is None:
            report["enumerable"] = False
            report["limitations"].append(
                "this store cannot list its keys: collectives in flight cannot be enumerated; "
                "only abort notices and heartbeats were probed"
                + (f" under prefix {self._prefix!r}" if self._prefix else " (use --prefix for a namespace)")
            )
            keys = _probe_keys(store, self._prefix)
        groups, runs = _parse(keys, self._prefix)
        runs = {run_id: run for run_id, run in runs.items() if _run_in(run_id, self._prefix)}
        wanted: list[str] = []
        for g in groups.values():
            root = f"{g.prefix}{K.group_root(g.world)}/"
            for token, op in g.ops.items():
                wanted += [f"{root}{token}/{f}" for f in _READ_FIELDS if f in op.fields]
                if K.ARRIVE in op.fields and K.DONE in op.fields:
                    # A generic barrier's done flag (or all_sum's total): a few bytes, and an
                    # abort leaves its notice there. Never a broadcast's payload (no counter).
                    wanted.append(f"{root}{token}/{K.DONE}")
                if g.abort and _all_slots(op, g.world):
                    # An abort wakes a generic all_gather by writing its notice into every slot:
                    # one slot tells that op from a finished one. Read only in aborted groups.
                    wanted.append(f"{root}{token}/r0")
            wanted += list(g.beats.values()) + ([g.abort] if g.abort else [])
        for run_id, run in runs.items():
            wanted += ([run["state_key"]] if run["state_key"] else []) + list(run["master"].values())
            if run["native"]:
                run["current"], native_keys = R.native_keys_to_read(run_id, run["native"])
                wanted += native_keys
        values = read_values(store, wanted, self._owned)
        report["torch_ctrl_keys"] = sum(1 for k in keys if k.startswith(self._prefix) and _KEY.match(k))
        for _, g in sorted(groups.items()):
            report["groups"].append(self._group(g, values, now))
        _mark_other_world_sizes(report["groups"])
        for run_id, run in sorted(runs.items()):
            report["torchrun"].append(self._run(run_id, run, values, report))

    def _group(self, g: _GroupKeys, values: dict[str, bytes | None], now: float) -> dict[str, Any]:
        root = f"{g.prefix}{K.group_root(g.world)}/"
        ops, finished = [], 0
        for token, op in g.ops.items():
            try:
                info = _classify(g.world, op, values, lambda f, t=token: f"{root}{t}/{f}")
            except K.DecodeError as exc:
                # Shown, not fatal: a value torch_ctrl could not have written may be why a job hangs.
                info = {
                    "op": "unreadable",
                    "candidates": ["unreadable"],
                    "blocked": [],
                    "aborted": False,
                    "arrived": None,
                    "missing": None,
                    "unnamed": 0,
                    "detail": f"a value not written by torch_ctrl under {root}{token}/ ({exc})",
                }
            if info is None:
                finished += 1
                continue
            seen_key = (self.address, g.prefix, g.world, token)
            signature = (
                info["op"],
                info.get("arrived"),
                tuple(info["blocked"]),
                tuple(info.get("slots", ())),
                info.get("detail"),
            )
            seen = self._ops.get(seen_key)
            if seen is None:
                seen = self._ops[seen_key] = _Seen(now, now, signature)
            elif seen.signature != signature:
                seen.changed, seen.signature = now, signature
            ops.append(
                {
                    "key": decode_token(token),
                    "token": token,
                    # Every op has every field (null or empty where it does not apply), so
                    # that JSON readers can index them.
                    "root": None,
                    "slots": None,
                    "detail": None,
                    "other_world_sizes": [],
                    **info,
                    "world_size": g.world,
                    "pending_s": round(now - seen.first, 3),
                    "unchanged_s": round(now - seen.changed, 3),
                }
            )
        ops.sort(key=lambda o: (-o["pending_s"], o["key"]))
        abort = None
        if g.abort is not None and values.get(g.abort) is not None:
            rank, reason = K.parse_notice(values[g.abort] or b"")
            abort = {"rank": rank, "reason": reason}
        return {
            "prefix": g.prefix,
            "world_size": g.world,
            "namespace": describe_prefix(g.prefix),
            "store": self.address,
            "in_flight": ops,
            "finished_awaiting_cleanup": finished,
            "abort": abort,
            "heartbeats": self._heartbeats(g, values, now),
        }

    def _heartbeats(self, g: _GroupKeys, values: dict[str, bytes | None], now: float) -> dict[str, Any] | None:
        if not g.beats:
            return None
        raw = {r: values.get(k) for r, k in g.beats.items()}
        current = {r: v for r, v in ((r, _beats(value)) for r, value in raw.items()) if v is not None}
        hist = self._beats.setdefault((self.address, g.prefix, g.world), _Beats())
        if len(hist.times) >= 1000:  # --watch: a bounded history
            self._trim(hist, 500)
        index = len(hist.times)
        prev = hist.values[-1] if hist.values else {}
        hist.times.append(now)
        hist.values.append(current)
        for r, v in current.items():
            if r not in prev:
                hist.changed_at.setdefault(r, (index, False))
            elif prev[r] != v:
                hist.changed_at[r] = (index, True)
        ranks, stopped = [], []
        for r in sorted(current):
            at, moved = hist.changed_at[r]
            # Beats of the other ranks since this rank's counter last moved (or was first seen).
            base = hist.values[at]
            others = max((v - base[o] for o, v in current.items() if o != r and o in base), default=0)
            age_max = now - hist.times[at - 1] if moved else None
            interval = _declared_interval(raw[r])
            status = _beat_status(moved and at == index, moved, now - hist.times[at], interval, others)
            if status == "stopped":
                stopped.append(r)
            ranks.append(
                {
                    "rank": r,
                    "count": current[r],
                    "interval_s": interval,
                    "age_s": round(now - hist.times[at], 3),
                    "age_max_s": None if age_max is None else round(age_max, 3),
                    "others_beats_since": others,
                    "status": status,
                }
            )
        moved_now = [current[r] - prev[r] for r in current if r in prev and current[r] > prev[r]]
        window = now - hist.times[index - 1] if index > 0 else None
        return {
            "ranks": ranks,
            "stopped": stopped,
            # Ranks without a counter: closed (the watcher deletes its counter) or never beating.
            "absent": _others(g.world, current),
            # Only from counters that moved at least twice: one move only bounds it by the window.
            "estimated_interval_s": round(window / max(moved_now), 3)
            if moved_now and max(moved_now) > 1 and window
            else None,
            "window_s": None if window is None else round(window, 3),
            "observed_s": round(now - hist.times[0], 3),
        }

    @staticmethod
    def _trim(hist: _Beats, keep: int) -> None:
        drop = len(hist.times) - keep
        hist.times, hist.values = hist.times[drop:], hist.values[drop:]
        hist.changed_at = {r: (max(0, i - drop), m and i - drop > 0) for r, (i, m) in hist.changed_at.items()}

    def _run(self, run_id: str, run: dict[str, Any], values: dict[str, bytes | None], report: dict) -> dict[str, Any]:
        """One torchrun run: the native ctrl rendezvous's keys, or torch's c10d state."""
        state: dict[str, Any] | None = None
        master = None
        if run["native"]:
            backend = "ctrl"
            state = R.decode_native(run_id, run.get("current"), values, time.time())
            _mark_withdrawn(run_id, run.get("current"), state, values)
            master = R.native_workers_store(run_id, run.get("current"), values)
        else:
            backend = "c10d"
            raw = values.get(run["state_key"]) if run["state_key"] else None
            state = R.decode_state(raw) if raw is not None else None
            for rnd in sorted(run["rounds"], reverse=True):
                addr = values.get(run["master"].get((rnd, R.MASTER_ADDR), ""))
                port = values.get(run["master"].get((rnd, R.MASTER_PORT), ""))
                if addr and port and port.isdigit():
                    master = f"{addr.decode('utf-8', 'replace')}:{int(port)}"
                    break
        for node in (state or {}).get("nodes", []) + (state or {}).get("waiting", []):
            if "keep_alive_age_s" in node:  # by the node's own settings where it recorded them
                limit = node.get("keep_alive_dead_after_s", KEEP_ALIVE_DEAD_AFTER)
                node["keep_alive_stale"] = node["keep_alive_age_s"] > limit
        current = (state or {}).get("round")
        if current is None and run["rounds"]:
            current = max(run["rounds"])
        agents = [
            g
            for g in report["groups"]
            if g["namespace"].get("kind") == "agents" and g["namespace"].get("run_id") == run_id
        ]
        failure = next(
            (dict(g["abort"], round=current) for g in agents if g["abort"] and g["namespace"]["round"] == current),
            None,
        )
        out = {
            "run_id": run_id,
            "rendezvous": backend,
            "round": current,
            "rounds_seen": sorted(run["rounds"]),
            "state": state,
            "failure": failure,
            "workers_store": master,
            "workers_store_error": None,
        }
        if master and self._follow:
            out["workers_store_error"] = self._follow_store(master, report)
        return out

    def _follow_store(self, master: str, report: dict[str, Any]) -> str | None:
        """Inspect the workers' store of a torchrun round too (its groups join the report)."""
        if master == self.address:
            return None
        linked = self._linked.get(master)
        if linked is None or (isinstance(linked, tuple) and time.monotonic() >= linked[1]):
            opened = self._open_linked(master)
            # A failure is tried again after RELINK seconds (a stopped server resumed, a store
            # that was not up yet): not at every sample, since each try against a server that
            # does not answer leaves a thread blocked until it does.
            linked = opened if isinstance(opened, Inspector) else (opened, time.monotonic() + RELINK)
            self._linked[master] = linked
        if isinstance(linked, tuple):
            return linked[0]
        try:
            sub = linked.sample()
        except NoAnswerError as exc:  # names the address itself
            return str(exc)
        except Exception as exc:  # noqa: BLE001 - reported, the rest of the report stands
            return f"cannot read {master}: {_one_line(exc)}"
        report["groups"] += sub["groups"]
        report["limitations"] += [f"{master}: {x}" for x in sub["limitations"]]
        return None

    def _open_linked(self, master: str) -> Inspector | str:
        host, _, port = master.rpartition(":")
        candidates = [master]
        own_host = self.address.rpartition(":")[0]
        if own_host and own_host != host:
            candidates.append(f"{own_host}:{port}")  # the job's host name may not resolve here
        errors = []
        for address in candidates:
            try:
                return Inspector(address, prefix=self._prefix, follow=False, timeout=min(self._timeout, 3.0))
            except NoAnswerError as exc:  # the name resolved and the port accepted: no other to try
                return str(exc)
            except Exception as exc:  # noqa: BLE001 - try the next address
                errors.append(f"{address}: {_one_line(exc)}")
        return "cannot connect to the workers' store (" + "; ".join(errors) + ")"


def _mark_withdrawn(run_id: str, current: int | None, state: dict[str, Any], values: dict[str, bytes | None]) -> None:
    """Nodes of the ctrl rendezvous whose heartbeat is negative (they left: it holds minus the
    time they did) get ``withdrawn`` instead of a keep-alive age."""
    root = f"{R.NATIVE_ROOT}{run_id}"
    for node in state.get("nodes", []) + state.get("waiting", []):
        record = values.get(f"{root}/{current}/n/{node.get('slot')}")
        fields = (record or b"").decode("utf-8", "replace").split("\t")
        if len(fields) < 3:
            continue
        beat = values.get(f"{root}/hb/{fields[0]}_{fields[1]}_{fields[2]}") or b""
        if beat.startswith(b"-"):
            node.pop("keep_alive_age_s", None)
            node.pop("keep_alive_dead_after_s", None)
            node["withdrawn"] = True


def _mark_other_world_sizes(groups: list[dict[str, Any]]) -> None:
    """An op key in flight in groups of different sizes under one prefix of one store: ranks
    given different world sizes (each waits in a group of its own), or two groups reusing a
    key. Each such op gets ``other_world_sizes``, the sizes of the other groups."""
    sizes: dict[tuple[Any, str, str], set[int]] = {}
    for g in groups:
        for op in g["in_flight"]:
            sizes.setdefault((g["store"], g["prefix"], op["token"]), set()).add(g["world_size"])
    for g in groups:
        for op in g["in_flight"]:
            others = sorted(sizes[(g["store"], g["prefix"], op["token"])] - {g["world_size"]})
            if others:
                op["other_world_sizes"] = others


def _one_line(exc: BaseException) -> str:
    from .errors import one_line

    return one_line(str(exc)) or type(exc).__name__


def _address(store: dist.Store) -> str:
    base = store
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    if isinstance(base, dist.TCPStore):
        return f"{base.host}:{base.port}"
    return type(store).__name__


def connect(address: str, timeout: float = 5.0) -> dist.TCPStore:
    """A TCPStore client of the server at ``HOST:PORT`` (never a server)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT (a port from 1 to 65535), got {address!r}")
    # An address nothing listens on fails at once, in one line (torch's connect would retry it
    # for the whole timeout and print C++ stack traces).
    lanes.reach(host.strip("[]"), int(port), timeout)
    # A server that accepts the connection but never answers (stopped, hung, or not a
    # TCPStore) would hold torch's constructor forever: NoAnswerError after timeout + GRACE.
    name, number, wait = host.strip("[]"), int(port), timedelta(seconds=timeout)
    return _Caller(address, timeout).call(
        lambda: dist.TCPStore(name, number, None, False, wait, wait_for_workers=False), connecting=True
    )


def inspect(
    store: StoreLike,
    *,
    interval: float = 1.0,
    prefix: str | None = None,
    follow: bool = True,
    timeout: float = 5.0,
) -> dict[str, Any]:
    """Report what every torch_ctrl group on ``store`` is doing, without writing to it.

    Args:
        store: a ``torch.distributed.Store`` (TCPStore, PrefixStore, HashStore, FileStore, a
            Python store), or ``"HOST:PORT"`` of a TCPStore server to join as a client.
        interval: seconds between samples (at least two) that show which heartbeats move
            and which ops make no progress; ``0`` takes one sample (heartbeat ages unknown).
            While a rank's heartbeat counter has neither moved nor stood still for 3 of the
            intervals its rank declared, more samples are taken, ``interval`` apart, for at
            most ``MAX_OBSERVE`` (20) seconds: the torchrun agents beat every 5 s, so a
            dead agent is told after 15 s, a live one once its counter moves. (A counter
            without a declared interval, as earlier versions wrote: at most 3 more samples,
            while other ranks beat.)
        prefix: only groups whose keys start with it (a ``from_env()`` round, a
            PrefixStore's prefix), on ``store`` and on the workers' store a torchrun round
            names; torchrun runs are still found (and shown, unless ``prefix`` is another
            run's namespace). On stores that cannot list their keys, where to probe.
        follow: also inspect the workers' store named by a torchrun round.
        timeout: seconds for connecting and for each read. A call that the server does not
            answer within ``timeout`` plus ``GRACE`` (1) seconds (its process stopped or
            hung, or not a TCPStore: torch's client would wait forever) raises
            ``torch_ctrl.inspection.NoAnswerError``; on the followed workers' store, it is reported in
            ``workers_store_error`` instead. The call's thread (a daemon) stays blocked in it
            until the server answers or goes away.

    Returns:
        A JSON-serializable dict, schema ``torch_ctrl.inspect/1`` (``docs/inspect.md``):
        ``groups`` (each with ``in_flight`` ops, ``heartbeats``, ``abort``), ``torchrun``
        (runs, rounds, nodes, failure notice), ``limitations``.

    Raises:
        ValueError: ``store`` is a string that is not ``HOST:PORT``.
        torch.distributed.DistNetworkError: the server cannot be reached.
        torch.distributed.DistStoreError: ``torch_ctrl.inspection.NoAnswerError``, a subclass:
            the server did not answer within ``timeout`` (plus ``GRACE``).

    Example::

        >>> report = torch_ctrl.inspect("127.0.0.1:29500")  # doctest: +SKIP
        >>> for op in report["groups"][0]["in_flight"]:  # doctest: +SKIP
        ...     print(op["op"], op["key"], op["arrived"], op["missing"])
        barrier epoch-3 3 [2]
    """
    insp = Inspector(store, prefix=prefix, follow=follow, timeout=timeout)
    report = insp.sample()
    if interval <= 0:
        return report
    while True:
        time.sleep(interval)  # what moves is only seen across samples: nothing to wait on
        report = insp.sample()
        if not _undecided(report):
            return report


def _undecided(report: dict[str, Any]) -> bool:
    """Whether another sample may tell more: a rank whose heartbeat was not seen moving yet
    nor stood still long enough to be stopped (with a declared interval: for at most
    MAX_OBSERVE seconds of sampling; a counter without one: while other ranks beat, for at
    most 4 samples after the first)."""
    observed, samples = report["observed_s"], report["samples"]
    for g in report["groups"]:
        for r in (g["heartbeats"] or {}).get("ranks", []):
            if r["interval_s"] is not None:
                if r["status"] in ("late", "unknown") and observed < MAX_OBSERVE:
                    return True
            elif r["status"] == "late" and samples < 5:
                return True
    return False
