"""Exceptions raised by the collectives, and their one-line messages.

All of them but :class:`KeyReusedError` (a caller's mistake, raised before anything is
written) subclass :class:`torch.distributed.DistStoreError`, so code written for torch's
store errors keeps catching them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist

MAX_LISTED = 16


class CollectiveError(dist.DistStoreError):
    """A collective failed for a reason other than a timeout or an abort (the store failed,
    or it holds data torch_ctrl did not write); one line naming the op and key. A
    ``torch.distributed.DistStoreError``, so existing handlers keep catching it.

    Example::

        try:
            coll.barrier("ready")
        except torch_ctrl.CollectiveError as exc:  # timeouts and aborts included
            log.error("control plane failed: %s", exc)
    """


class StoreUnreachableError(CollectiveError, getattr(dist, "DistNetworkError", dist.DistError)):  # type: ignore[misc]
    """The store's server could not be reached, or the connection to it was lost: one line,
    ``... store unreachable: ...``, naming the server's address. Also a
    ``torch.distributed.DistNetworkError``, what torch's own store calls raise then, so
    handlers written for either keep catching it.

    Example::

        try:
            coll.barrier("ready")
        except torch_ctrl.StoreUnreachableError:
            restart_from_checkpoint()  # the job's store is gone
    """


# How every store-unreachable detail starts; the C++ twin's kUnreachable (csrc/errors.h) is
# the same text. Both implementations build their errors here, and the class follows from it.
UNREACHABLE = "store unreachable: "


def _error_class(detail: str) -> type[CollectiveError]:
    return StoreUnreachableError if detail.startswith(UNREACHABLE) else CollectiveError


class CollectiveTimeoutError(CollectiveError):
    """A collective did not complete within its timeout.

    Attributes: ``op``, ``key``, ``arrived`` (or None when unknown), ``world_size``
    and ``missing`` (ranks known not to have arrived; empty when unknown).

    Example::

        try:
            coll.barrier("epoch-3", timeout=60)
        except torch_ctrl.CollectiveTimeoutError as exc:
            print(exc.missing)  # [2]; str(exc): "barrier 'epoch-3' timed out after 60s: 3/4 ..."
    """

    def __init__(
        self,
        message: str,
        op: str = "",
        key: str = "",
        arrived: int | None = None,
        world_size: int = 0,
        missing: list[int] | None = None,
    ) -> None:
        super().__init__(message)
        self.op = op
        self.key = key
        self.arrived = arrived
        self.world_size = world_size
        self.missing = list(missing or [])


class CollectiveAbortedError(CollectiveError):
    """The group was aborted (by a rank's ``abort()`` or because a rank died).

    Attributes: ``rank`` (the rank that aborted or was found dead) and ``reason``.

    Example::

        try:
            coll.all_gather("hosts", host)
        except torch_ctrl.CollectiveAbortedError as exc:
            print(exc.rank, exc.reason)  # 2 disk full
    """

    def __init__(self, message: str, rank: int = -1, reason: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.reason = reason


class KeyReusedError(ValueError, RuntimeError):
    """An explicit key was used twice on one instance (also a RuntimeError, like torch's);
    raised before any store traffic.

    Example::

        coll.barrier("ready")
        coll.barrier("ready")  # KeyReusedError: barrier: key 'ready' has already been used ...
    """


def format_ranks(ranks: Iterable[int]) -> str:
    """``[0, 2, 3]``, or the first 16 and ``and N more``."""
    ranks = sorted(ranks)
    shown = ", ".join(str(r) for r in ranks[:MAX_LISTED])
    if len(ranks) > MAX_LISTED:
        return f"[{shown}] and {len(ranks) - MAX_LISTED} more"
    return f"[{shown}]"


def one_line(text: str) -> str:
    """First line of a store error, without C++ frames ("Exception raised from ...")."""
    line = str(text).strip().splitlines()[0] if str(text).strip() else ""
    return line.split(" Exception raised from ")[0].strip()


def timeout_error(
    op: str,
    key: str,
    seconds: float,
    world_size: int,
    arrived: int | None = None,
    missing: list[int] | None = None,
    detail: str = "",
) -> CollectiveTimeoutError:
    """Build the one-line timeout error of ``op``."""
    msg = f"{op} {key!r} timed out after {seconds:g}s"
    if arrived is not None:
        msg += f": {arrived}/{world_size} ranks arrived"
        if world_size and arrived >= world_size:
            # No rank was missing, so the time went elsewhere: say where it can have gone.
            msg += (
                ", but this rank did not finish in time: the last rank arrived at the deadline, or"
                " this rank's store calls stalled (a connection stuck in a reverse lookup or an"
                " overloaded store; see docs/troubleshooting.md)"
            )
        if missing:
            msg += f"; missing ranks: {format_ranks(missing)}"
            # Ranks are counted by one request and named by a later one (a barrier's counter,
            # then its NAMES log): a rank whose store calls are slow is counted before its name
            # is there. Say so, rather than a count and a list that disagree.
            unnamed = arrived + len(missing) - world_size
            if unnamed > 0:
                msg += (
                    f" ({unnamed} of them arrived but did not name {'itself' if unnamed == 1 else 'themselves'}"
                    " in time: slow store calls or a stalled process)"
                )
    if detail:
        msg += f"{';' if arrived is not None else ':'} {detail}"
    return CollectiveTimeoutError(msg, op=op, key=key, arrived=arrived, world_size=world_size, missing=missing)


def aborted_error(op: str, key: str, rank: int, reason: str) -> CollectiveAbortedError:
    """Build the one-line abort error of ``op``."""
    why = reason or "no reason given"
    msg = f"{op} {key!r}: group aborted by rank {rank}: {why}"
    return CollectiveAbortedError(msg, rank=rank, reason=reason)


def collective_error(op: str, key: str, detail: str) -> CollectiveError:
    """Build the one-line error of ``op`` failing for another reason (store error, bad data)."""
    return _error_class(detail)(f"{op} {key!r}: {detail}")


def init_error(rank: int, world_size: int, detail: str) -> CollectiveError:
    """A new instance that cannot reach its store (``StoreCollectives(rank R of N): ...``)."""
    return _error_class(detail)(f"StoreCollectives(rank {rank} of {world_size}): {detail}")


def key_reused_error(op: str, key: str) -> KeyReusedError:
    """An explicit key used twice on one instance."""
    return KeyReusedError(f"{op}: key {key!r} has already been used on this instance")


def forked_error(op: str, owner: int, pid: int) -> CollectiveError:
    """An instance used in a process forked from the one that made it: its connections and
    background thread belong to the parent."""
    return CollectiveError(
        f"{op}: this instance was created in process {owner} and cannot be used in the forked child {pid};"
        " create a new StoreCollectives in the child"
    )
