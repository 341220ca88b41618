"""Errors that name hosts: a ControlCollectives wrapper that appends, to every timeout
and abort error, where the ranks it names run (for example ``rank 3 on host node-b``)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from .base import METHODS, ControlCollectives
from .errors import MAX_LISTED, CollectiveAbortedError, CollectiveTimeoutError


class RankNamed(ControlCollectives):
    """``inner`` with errors that name each rank as ``names(rank)`` (a host, a pod...).

    Same methods and behaviour as ``inner``; only the messages of
    :class:`CollectiveTimeoutError` (missing ranks) and :class:`CollectiveAbortedError`
    (the aborting rank) gain the names. Attributes of the errors are kept.
    """

    def __init__(self, inner: ControlCollectives, names: Callable[[int], str] | Sequence[str]) -> None:
        self.inner = inner
        self._names = names

    @property
    def rank(self) -> int:
        """This instance's rank."""
        return self.inner.rank  # type: ignore[attr-defined,no-any-return]

    @property
    def world_size(self) -> int:
        """Number of ranks in the group."""
        return self.inner.world_size  # type: ignore[attr-defined,no-any-return]

    def name(self, rank: int) -> str:
        """Where ``rank`` runs, or ``"?"`` when unknown."""
        try:
            names = self._names
            return str(names(rank) if callable(names) else names[rank])
        except Exception:  # noqa: BLE001 - naming must never hide the real error
            return "?"

    def abort(self, reason: str = "") -> None:
        """See :meth:`ControlCollectives.abort`."""
        self.inner.abort(reason)

    def close(self, flush_timeout: float = 5.0) -> None:
        """See :meth:`ControlCollectives.close`."""
        self.inner.close(flush_timeout)

    def __repr__(self) -> str:
        return f"RankNamed({self.inner!r})"

    def _named(self, exc: Exception) -> Exception:
        if isinstance(exc, CollectiveTimeoutError) and exc.missing:
            where = ", ".join(f"{r}: {self.name(r)}" for r in exc.missing[:MAX_LISTED])
            named = CollectiveTimeoutError(
                f"{exc} (hosts of missing ranks: {where})",
                op=exc.op,
                key=exc.key,
                arrived=exc.arrived,
                world_size=exc.world_size,
                missing=exc.missing,
            )
        elif isinstance(exc, CollectiveAbortedError) and exc.rank >= 0:
            where = f"{exc} (rank {exc.rank} runs on {self.name(exc.rank)})"
            named = CollectiveAbortedError(where, exc.rank, exc.reason)
        else:
            return exc
        return named


def _forward(op: str) -> Callable[..., object]:
    def method(self: RankNamed, *args: object, **kwargs: object) -> object:
        try:
            return getattr(self.inner, op)(*args, **kwargs)
        except (CollectiveTimeoutError, CollectiveAbortedError) as exc:
            named = self._named(exc)
            if named is exc:
                raise
            raise named from None

    functools.update_wrapper(method, getattr(ControlCollectives, op))
    method.__isabstractmethod__ = False  # type: ignore[attr-defined]
    return method


for _op in METHODS:
    setattr(RankNamed, _op, _forward(_op))
RankNamed.__abstractmethods__ = frozenset()
