"""Read torch's ``c10d`` rendezvous state from a store, for :mod:`torch_ctrl.inspection`.

torch keeps one key per run, ``torch.rendezvous.{run_id}``: the base64 of a pickled
``_RendezvousState`` (round, participants, wait list, keep-alive times). Unpickling store
data must not run code from the store, so :func:`decode_state` uses an unpickler that
knows only the few classes that state is made of, and builds plain stand-ins for torch's
classes instead of importing them.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import io
import math
import pickle
from typing import Any

RDZV_PREFIX = "torch.rendezvous."
# Keys torch's RendezvousStoreInfo.build writes under each round's prefix.
MASTER_ADDR, MASTER_PORT = "MASTER_ADDR", "MASTER_PORT"
_NULL_SENTINEL = b"Y2FuaW1hZGFt"  # c10d backend: "no state yet"
_TORCH_MODULE = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"


class _Plain:
    """Stand-in for a torch class of the state: takes whatever attributes it is given."""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update(state)

    def __hash__(self) -> int:
        return hash(tuple(sorted((k, repr(v)) for k, v in self.__dict__.items())))

    def __eq__(self, other: object) -> bool:
        return self is other


class _State(_Plain):
    pass


class _Node(_Plain):
    pass


class _SafeUnpickler(pickle.Unpickler):
    _ALLOWED = {
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
        ("builtins", "object"): object,
        ("datetime", "datetime"): datetime.datetime,
        ("datetime", "timedelta"): datetime.timedelta,
        ("datetime", "timezone"): datetime.timezone,
        ("_codecs", "encode"): lambda text, enc="latin-1": text.encode(enc),
    }

    def find_class(self, module: str, name: str) -> Any:
        if module == _TORCH_MODULE:
            if name == "_RendezvousState":
                return _State
            if name == "_NodeDesc":
                return _Node
        if module == "copyreg" and name in ("_reconstructor", "__newobj__"):
            return _reconstruct
        found = self._ALLOWED.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"unexpected class {module}.{name} in the rendezvous state")
        return found


def _reconstruct(cls: Any, *args: Any) -> Any:
    if cls in (_State, _Node):
        return cls()
    raise pickle.UnpicklingError(f"unexpected reconstruction of {cls!r}")


def decode_state(raw: bytes) -> dict[str, Any] | None:
    """The c10d rendezvous state stored at ``torch.rendezvous.{run_id}`` as plain data:
    ``round``, ``complete``, ``closed``, ``deadline``, ``nodes`` (participants by rank),
    ``waiting`` and ``redundant`` (node descriptions); ``None`` before the first write."""
    if raw == _NULL_SENTINEL:
        return None
    try:
        state = _SafeUnpickler(io.BytesIO(base64.b64decode(raw))).load()
    except (binascii.Error, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as exc:
        return {"error": f"unreadable rendezvous state: {exc}"}
    if not isinstance(state, _State):
        return {"error": "unreadable rendezvous state: not a _RendezvousState"}
    beats = getattr(state, "last_heartbeats", {}) or {}
    now = datetime.datetime.now(datetime.timezone.utc)

    def node(desc: Any, rank: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"host": getattr(desc, "addr", "?"), "pid": getattr(desc, "pid", None)}
        if rank is not None:
            out = {"rank": rank, **out}
        beat = beats.get(desc)
        if isinstance(beat, datetime.datetime):
            when = beat if beat.tzinfo else beat.replace(tzinfo=datetime.timezone.utc)
            out["keep_alive_age_s"] = round(max(0.0, (now - when).total_seconds()), 1)
        return out

    participants = getattr(state, "participants", {}) or {}
    deadline = getattr(state, "deadline", None)
    return {
        "round": int(getattr(state, "round", 0)),
        "complete": bool(getattr(state, "complete", False)),
        "closed": bool(getattr(state, "closed", False)),
        "deadline": deadline.isoformat() if isinstance(deadline, datetime.datetime) else None,
        "nodes": [node(d, r) for d, r in sorted(participants.items(), key=lambda kv: kv[1])],
        "waiting": [node(d) for d in getattr(state, "wait_list", ()) or ()],
        "redundant": [node(d) for d in getattr(state, "redundancy_list", ()) or ()],
    }


def split_key(key: str) -> tuple[str, int | None, str] | None:
    """``(run_id, round or None, rest)`` of a rendezvous key, or ``None`` for other keys.

    ``torch.rendezvous.{run}`` is the state (round None); ``torch.rendezvous.{run}.{round}/rest``
    is a key of one round's store.
    """
    if not key.startswith(RDZV_PREFIX):
        return None
    body = key[len(RDZV_PREFIX) :]
    head, sep, rest = body.partition("/")
    if not sep:
        return head, None, ""
    run, _, rnd = head.rpartition(".")
    if not run or not rnd.isdigit():
        return None
    return run, int(rnd), rest


# ------------------------------------------------------------------ the native ctrl rendezvous
# Layout of torch_ctrl.elastic.ctrl_rendezvous (its module docstring): R = torch_ctrl/rdzv/{run_id};
# R/open, R/closed, R/hb/{node}, R/da/{node}, R/{round}/{arrived, seal, boot, members, n/{k}, rank/{k}, ...}.
NATIVE_ROOT = "torch_ctrl/rdzv/"
_COUNT_MASK = (1 << 24) - 1
_SEALED = 1 << 48


def split_native(key: str) -> tuple[str, int | None, str] | None:
    """``(run_id, round or None, rest)`` of a native rendezvous key, or ``None``."""
    if not key.startswith(NATIVE_ROOT):
        return None
    run, sep, rest = key[len(NATIVE_ROOT) :].partition("/")
    if not sep or not run:
        return None
    head, sep, tail = rest.partition("/")
    if sep and head.isdigit():
        return run, int(head), tail
    return run, None, rest


def native_keys_to_read(run_id: str, names: list[tuple[int | None, str]]) -> tuple[int | None, list[str]]:
    """The current round (the newest sealed one, else the newest seen) and the keys to read
    for it: the run's ``open``/``closed``, every heartbeat, and that round's keys. A round that
    did not form (``void``: too few of its nodes were left when it was sealed) is not current:
    when it is newer than every round that formed, the newest round seen is (its nodes went on
    there)."""
    void = {r for r, rest in names if r is not None and rest == "void"}
    sealed = [r for r, rest in names if r is not None and rest == "seal" and r not in void]
    rounds = [r for r, _ in names if r is not None]
    current = max(sealed) if sealed else (max(rounds) if rounds else None)
    if void and rounds and max(void) > (max(sealed) if sealed else -1):
        current = max(rounds)
    root = f"{NATIVE_ROOT}{run_id}"
    keys = [f"{root}/{rest}" for r, rest in names if r is None]
    keys += [f"{root}/{r}/{rest}" for r, rest in names if r is not None and r == current]
    return current, keys


def decode_native(run_id: str, current: int | None, values: dict[str, bytes | None], now: float) -> dict[str, Any]:
    """The native rendezvous of one run as plain data (same fields as :func:`decode_state`)."""
    root = f"{NATIVE_ROOT}{run_id}"

    def text(key: str) -> str | None:
        raw = values.get(key)
        return None if raw is None else raw.decode("utf-8", "replace")

    beats: dict[str, float] = {}
    dead_after: dict[str, float] = {}  # what each node's own settings call dead (R/da/{node})
    for key, raw in values.items():
        if key.startswith(f"{root}/hb/") and raw:
            try:
                beats[key[len(root) + 4 :]] = float(raw.split()[0])
            except (ValueError, IndexError):
                pass
        elif key.startswith(f"{root}/da/") and raw:
            try:
                limit = float(raw)
            except ValueError:
                continue
            if math.isfinite(limit) and limit > 0:
                dead_after[key[len(root) + 4 :]] = limit
    out: dict[str, Any] = {"round": current, "closed": f"{root}/closed" in values or text(f"{root}/open") == "closed"}
    if current is None:
        return {**out, "complete": False, "nodes": [], "waiting": [], "redundant": []}
    r = f"{root}/{current}"
    out["complete"] = text(f"{r}/seal") is not None
    arrived = values.get(f"{r}/arrived")
    if arrived is not None and arrived.isdigit():
        out["arrived"] = int(arrived) & _COUNT_MASK
    nodes, spares = [], []
    for key in sorted(values):
        if not key.startswith(f"{r}/n/"):
            continue
        slot = key[len(r) + 3 :]
        fields = (text(key) or "").split("\t")
        if len(fields) < 3:
            continue
        host, pid, local = fields[0], fields[1], fields[2]
        node: dict[str, Any] = {"host": host, "pid": int(pid) if pid.isdigit() else pid, "slot": slot}
        beat = beats.get(f"{host}_{pid}_{local}")
        if beat:  # 0 means withdrawn
            node["keep_alive_age_s"] = round(max(0.0, now - beat), 1)
            limit = dead_after.get(f"{host}_{pid}_{local}")
            if limit is not None:
                node["keep_alive_dead_after_s"] = limit
        outcome = (text(f"{r}/rank/{slot}") or "").split()
        if outcome and outcome[0].lstrip("-").isdigit():
            nodes.append({"rank": int(outcome[0]), **node})
        else:
            spares.append(
                {
                    **node,
                    "outcome": {"s": "spare", "d": "dead", "c": "closed"}.get(outcome[0], "waiting")
                    if outcome
                    else "waiting",
                }
            )
    out["nodes"] = sorted(nodes, key=lambda n: n["rank"])
    out["waiting"] = spares
    out["redundant"] = []
    return out


def native_workers_store(run_id: str, current: int | None, values: dict[str, bytes | None]) -> str | None:
    """``addr:port`` of the round's bootstrap (workers') store, from ``R/{round}/boot``."""
    if current is None:
        return None
    raw = values.get(f"{NATIVE_ROOT}{run_id}/{current}/boot")
    if not raw:
        return None
    addr, _, port = raw.decode("utf-8", "replace").rpartition("\n")
    return f"{addr}:{port}" if addr and port.isdigit() else None
