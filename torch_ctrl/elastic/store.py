"""Drop-in for ``torch.distributed.elastic.utils.store``, built on StoreCollectives.

Same functions, signatures and return values as torch's module; what changes:

* a timed-out :func:`barrier` raises ``DistStoreError`` on *every* rank, naming the
  missing ranks (through ``rank_tracing_decoder``, e.g. as host names) without a
  second tracing round;
* every key written under ``key_prefix`` is deleted once all ranks are done (where the
  store can delete keys: not torch's EtcdStore, see ``docs/protocol.md``), so a
  prefix can be reused and the store does not grow; a :func:`barrier`'s also once every
  rank that came has timed out (a timed-out :func:`synchronize` or :func:`get_all` leaves
  its keys, as any timed-out op does);
* only :func:`store_timeout` changes a store's timeout (and restores it even when
  the block raises); the collectives pass their timeout per call.

Key layout: each call runs one collective of a fresh ``StoreCollectives`` on ``store``
itself, keyed ``{key_prefix}/{op}``, so its keys are
``torch_ctrl/3/w{world_size}/k{escaped key_prefix/op}/...`` (see ``docs/protocol.md``);
no PrefixStore is involved, so Python-written stores (which torch's PrefixStore cannot
delete keys from) are cleaned up too. :func:`get_all` still reads the ``{prefix}{idx}``
keys its callers set.

Stores that are not a ``torch.distributed.Store`` (duck-typed objects with the store methods,
which torch's functions accept, e.g. the mocks in torch's own tests) are handed to torch's
original function, so they behave exactly as they do without torch_ctrl.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .. import keys as K
from .. import lanes
from ..base import check_init, to_bytes, to_seconds
from ..errors import CollectiveTimeoutError
from ..loader import StoreCollectives

DistStoreError = dist.DistStoreError
log = logging.getLogger(__name__)

__all__ = ["store_timeout", "get_all", "synchronize", "barrier"]

# Counter that hands out arrival indices to rank-less barrier callers.
_ARRIVALS = "/torch_ctrl_arrivals"
# Counter of the callers whose barrier timed out (see _clear_timed_out).
_TIMED_OUT = "/torch_ctrl_timed_out"


@contextmanager
def store_timeout(store: dist.Store, timeout: float) -> Iterator[None]:
    """Set ``store``'s timeout to ``timeout`` seconds for the block, then restore it
    (also when the block raises).

    Example::

        with store_timeout(store, 30):
            store.get("ready")
    """
    old = store.timeout
    store.set_timeout(timedelta(seconds=to_seconds(timeout)))
    try:
        yield
    finally:
        store.set_timeout(old)


def _duck(store: object) -> bool:
    """True for a store torch_ctrl cannot run collectives on (not a ``torch.distributed.Store``)."""
    return not isinstance(store, dist.Store)


def _torch(name: str) -> Any:
    """torch's own ``torch.distributed.elastic.utils.store.{name}``, also while install() has
    put this module's function in its place."""
    import importlib

    from . import _original  # the package imports this module first: resolved at call time

    original = _original(importlib.import_module("torch.distributed.elastic.utils.store"), name)
    if getattr(original, "__module__", None) == __name__:  # never hand a call back to ourselves
        raise RuntimeError(f"torch's original {name}() is not available")
    return original


@contextmanager
def _group(store: dist.Store, rank: int, world_size: int) -> Iterator[StoreCollectives]:
    coll = StoreCollectives(store, rank, world_size)
    try:
        yield coll
    finally:
        coll.close()


def _check(store: object, rank: object, world_size: object, key_prefix: object) -> tuple[int, int]:
    if not isinstance(key_prefix, str):
        raise TypeError(f"key_prefix must be a str, got {type(key_prefix).__name__}")
    return check_init(store, rank, world_size)


def get_all(store: dist.Store, rank: int, prefix: str, world_size: int) -> list[bytes]:
    """Read the ``{prefix}{idx}`` keys (idx in ``range(world_size)``) that the callers set.

    One ``multi_get`` (blocking up to the store's timeout); rank 0 then waits until every
    rank has read, so a rank 0 that hosts the store leaves last. Other ranks only arrive.
    Time: O(N) per rank. Keys: those of a barrier keyed ``{prefix}/finished``, deleted afterwards;
    the ``{prefix}{idx}`` keys belong to the callers and are left alone.

    Raises:
        torch.distributed.DistStoreError: a key was not set within the store's timeout.

    Example::

        store.set(f"addr/{rank}", my_addr)
        addrs = get_all(store, rank, "addr/", world_size)
    """
    if _duck(store):
        return _torch("get_all")(store, rank, prefix, world_size)  # type: ignore[no-any-return]
    rank, world_size = _check(store, rank, world_size, prefix)
    values = [bytes(v) for v in store.multi_get([f"{prefix}{idx}" for idx in range(world_size)])]
    with _group(store, rank, world_size) as coll:
        coll.barrier(key=f"{prefix}/finished", timeout=store.timeout, block=rank == 0)
    return values


def synchronize(
    store: dist.Store,
    data: bytes,
    rank: int,
    world_size: int,
    key_prefix: str,
    timeout: float = 300,
) -> list[bytes]:
    """Every rank's ``data``, in rank order, on every rank (an all_gather).

    Time: O(1) store round trips per rank on TCPStore (one appended log), O(N) bytes read;
    torch's version costs O(N) per rank and O(N^2) overall. Keys are those of an all_gather
    keyed ``{key_prefix}/synchronize``, deleted once all ranks have read them.

    Raises:
        torch.distributed.DistStoreError: not every rank arrived within ``timeout`` seconds
            (a :class:`~torch_ctrl.CollectiveTimeoutError` naming the missing ranks).

    Example::

        infos = synchronize(store, json.dumps(info).encode(), rank, world_size, "node-info")
    """
    if _duck(store):
        return _torch("synchronize")(store, data, rank, world_size, key_prefix, timeout)  # type: ignore[no-any-return]
    rank, world_size = _check(store, rank, world_size, key_prefix)
    payload = to_bytes(data)
    with _group(store, rank, world_size) as coll:
        return coll.all_gather(key=f"{key_prefix}/synchronize", data=payload, timeout=to_seconds(timeout))


def barrier(
    store: dist.Store,
    world_size: int,
    key_prefix: str,
    barrier_timeout: float = 300,
    rank: int | None = None,
    rank_tracing_decoder: Callable[[int], str] | None = None,
    trace_timeout: float = 10,
) -> None:
    """Block until ``world_size`` callers have entered the barrier under ``key_prefix``.

    Time: O(1) per rank. With ``rank``, a timeout names the missing ranks on every rank,
    each passed through ``rank_tracing_decoder`` (default ``str``); ``trace_timeout`` is
    accepted for compatibility and unused (ranks name themselves while they wait, so no
    second tracing round is needed). Without ``rank``, callers take arrival indices from
    a counter (one more ``add``) and a timeout reports how many arrived.
    Keys are those of a barrier keyed ``{key_prefix}/barrier`` (and, without ``rank``, the
    counter ``{key_prefix}/torch_ctrl_arrivals``); all are deleted after the barrier, so
    the prefix can be used again once every rank has left. After a timeout too: each
    timed-out caller counts itself on ``{key_prefix}/torch_ctrl_timed_out``, and the one that
    finds every arrival counted deletes the keys (a caller arriving after that starts a new
    barrier, and times out alone).

    Raises:
        torch.distributed.DistStoreError: the barrier timed out (on every rank, naming the
            missing ranks when ``rank`` is given).
        AssertionError: ``rank_tracing_decoder`` without ``rank`` (as torch's).

    Example::

        barrier(store, world_size, key_prefix="ckpt-saved", barrier_timeout=600, rank=rank)
    """
    if _duck(store):
        return _torch("barrier")(  # type: ignore[no-any-return]
            store, world_size, key_prefix, barrier_timeout, rank, rank_tracing_decoder, trace_timeout
        )
    if rank is None and rank_tracing_decoder is not None:
        raise AssertionError("Tracing requires rank information")
    seconds = to_seconds(barrier_timeout)
    to_seconds(trace_timeout)
    if rank is None:
        _check(store, 0, world_size, key_prefix)
        arrival = int(store.add(key_prefix + _ARRIVALS, 1))
        if arrival == world_size:
            store.delete_key(key_prefix + _ARRIVALS)  # everyone has taken an index
        if arrival > world_size:
            raise ValueError(f"barrier {key_prefix!r}: more than world_size={world_size} callers entered")
        me = arrival - 1
    else:
        me, world_size = _check(store, rank, world_size, key_prefix)
    try:
        with _group(store, me, world_size) as coll:
            coll.barrier(key=f"{key_prefix}/barrier", timeout=seconds)
    except CollectiveTimeoutError as exc:
        error = _barrier_timeout(exc, key_prefix, rank, rank_tracing_decoder, seconds)
        _clear_timed_out(store, world_size, key_prefix)
        raise error from None


def _clear_timed_out(store: dist.Store, world_size: int, key_prefix: str) -> None:
    """Count this timed-out caller out of barrier ``key_prefix``; the caller that brings the
    count to the number of arrivals deletes the barrier's keys, so that the prefix can be used
    again (torch's barrier leaves them, and can be used once per prefix).

    A caller that arrives before that count is read is an arrival the count has not reached:
    the keys stay until it times out too (or completes the barrier). Cost: one ``add`` and one
    read per timed-out caller, and 6 deletes by the last. Stores that cannot delete keys
    (see ``docs/protocol.md``) keep them, as after any op there. Never raises: the timeout is
    the error to report."""
    base = lanes.base_store(store)
    if not lanes.store_api(store)[1] or (base is not store and lanes.python_methods(store) is not None):
        return  # no deletes, or a PrefixStore over a Python store (it cannot pass deletes on)
    prefix = K.op_prefix(world_size, f"{key_prefix}/barrier", 0)
    counter = K.field(prefix, K.counter(lanes.takes_tcpstore_path(store)))
    try:
        out = int(store.add(key_prefix + _TIMED_OUT, 1))
        arrived = lanes.peek(store, counter)
        if arrived is not None and out < K.parse_counter(arrived):
            return  # a caller still waits: the last to time out deletes
        for name in (K.DONE, K.EXIT, K.NAMES):
            store.delete_key(K.field(prefix, name))
        for key in (key_prefix + _ARRIVALS, key_prefix + _TIMED_OUT, counter):
            store.delete_key(key)
    except Exception as exc:  # noqa: BLE001 - the keys stay, as they would without this
        log.debug("barrier %r: keys left after the timeout (%s: %s)", key_prefix, type(exc).__name__, exc)


def _barrier_timeout(
    exc: CollectiveTimeoutError,
    key_prefix: str,
    rank: int | None,
    decoder: Callable[[int], str] | None,
    seconds: float,
) -> CollectiveTimeoutError:
    """torch's message format, with the missing ranks known on every rank."""
    if rank is None:
        arrived = "unknown" if exc.arrived is None else exc.arrived
        msg = (
            f"Timed out waiting on barrier for key prefix: {key_prefix} "
            f"(world_size={exc.world_size}, arrived={arrived}, timeout={seconds:g})"
        )
        missing: list[int] = []
    else:
        decode = decoder or str
        missing = exc.missing
        names = ", ".join(_decode(decode, r) for r in missing[:16])
        if len(missing) > 16:
            names += f", and {len(missing) - 16} more"
        msg = (
            f"Timed out waiting on barrier on rank {rank}, for key prefix: {key_prefix} "
            f"(world_size={exc.world_size}, missing_ranks=[{names}], timeout={seconds:g})"
        )
    return CollectiveTimeoutError(
        msg, op="barrier", key=key_prefix, arrived=exc.arrived, world_size=exc.world_size, missing=missing
    )


def _decode(decode: Callable[[int], str], rank: int) -> str:
    try:
        return str(decode(rank))
    except Exception as exc:  # noqa: BLE001 - a failing decoder must not hide the timeout
        return f"{rank} (decoder failed: {type(exc).__name__})"
