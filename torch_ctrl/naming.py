"""Errors that name hosts: timeout and abort errors that also say where the ranks they name
run (for example ``rank 3 runs on node-b``).

Two forms, one rule (:func:`name_error`):

* :func:`with_rank_names` makes a subclass of a collectives class whose constructor takes
  ``rank_names=``; instances stay instances of that class (``from_env()`` uses it);
* :class:`RankNamed` wraps any existing :class:`ControlCollectives` instance.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Union

from .base import METHODS, ControlCollectives
from .errors import MAX_LISTED, CollectiveAbortedError, CollectiveTimeoutError

Names = Union[Callable[[int], str], Sequence[str]]


def rank_name(names: Names | None, rank: int) -> str:
    """Where ``rank`` runs, or ``"?"`` when unknown."""
    try:
        return str(names(rank) if callable(names) else names[rank])  # type: ignore[index]
    except Exception:  # noqa: BLE001 - naming must never hide the real error
        return "?"


def name_error(exc: Exception, names: Names | None) -> Exception:
    """``exc`` with the hosts of the ranks it names appended (same type and attributes), or
    ``exc`` itself when it names no rank."""
    if names is None:
        return exc
    if isinstance(exc, CollectiveTimeoutError) and exc.missing:
        where = ", ".join(f"{r}: {rank_name(names, r)}" for r in exc.missing[:MAX_LISTED])
        return CollectiveTimeoutError(
            f"{exc} (hosts of missing ranks: {where})",
            op=exc.op,
            key=exc.key,
            arrived=exc.arrived,
            world_size=exc.world_size,
            missing=exc.missing,
        )
    if isinstance(exc, CollectiveAbortedError) and exc.rank >= 0:
        return CollectiveAbortedError(
            f"{exc} (rank {exc.rank} runs on {rank_name(names, exc.rank)})", exc.rank, exc.reason
        )
    return exc


def _call(fn: Callable[..., Any], names: Names | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    try:
        return fn(*args, **kwargs)
    except (CollectiveTimeoutError, CollectiveAbortedError) as exc:
        named = name_error(exc, names)
        if named is exc:
            raise
        raise named from None


class _NamedErrors:
    """Mixin (first in the MRO): every collective's errors pass through :func:`name_error`."""

    _rank_names: Names | None = None

    def __init__(self, *args: Any, rank_names: Names | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rank_names = rank_names
        direct = getattr(self, "_direct", None)
        if direct is None:
            return
        if rank_names is not None:
            if len(direct((_NamedErrors,))) != len(METHODS):
                return  # a subclass overrides a collective: its errors are named here, in Python
            # The C++ class names its own errors (only a failing call runs Python code then).
            self._native._namer = functools.partial(name_error, names=rank_names)  # type: ignore[attr-defined]
        self._shortcut((_NamedErrors,))  # type: ignore[attr-defined]  # these methods only pass calls through


def _named_method(op: str) -> Callable[..., Any]:
    def method(self: _NamedErrors, *args: Any, **kwargs: Any) -> Any:
        return _call(getattr(super(_NamedErrors, self), op), self._rank_names, args, kwargs)

    return functools.wraps(getattr(ControlCollectives, op))(method)


for _op in METHODS:
    setattr(_NamedErrors, _op, _named_method(_op))


@functools.cache
def with_rank_names(cls: type) -> type:
    """A subclass of ``cls`` (a ControlCollectives class) whose constructor also takes
    ``rank_names=`` (a sequence indexed by rank, or a callable) and whose errors use it.

    Example::

        Named = torch_ctrl.with_rank_names(torch_ctrl.StoreCollectives)
        coll = Named(store, rank, world_size, rank_names=["node-a", "node-a", "node-b", "node-b"])
        # a timeout now ends with "(hosts of missing ranks: 2: node-b)"
    """
    return type(cls.__name__, (_NamedErrors, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})


class RankNamed(ControlCollectives):
    """``inner`` (any ControlCollectives instance) with errors that name each rank as
    ``names(rank)`` (a host, a pod...). Same methods and behaviour as ``inner``; only the
    messages of timeout and abort errors gain the names. Attributes of the errors are kept.

    Args:
        inner: the instance to wrap.
        names: a sequence indexed by rank, or a callable ``rank -> name``.

    Example::

        coll = torch_ctrl.RankNamed(torch_ctrl.StoreCollectives(store, rank, 4), lambda r: f"pod-{r // 2}")
    """

    def __init__(self, inner: ControlCollectives, names: Names) -> None:
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

    def abort(self, reason: str = "") -> None:
        """See :meth:`ControlCollectives.abort`."""
        self.inner.abort(reason)

    def close(self, flush_timeout: float = 5.0) -> None:
        """See :meth:`ControlCollectives.close`."""
        self.inner.close(flush_timeout)

    def __repr__(self) -> str:
        return f"RankNamed({self.inner!r})"


def _forward(op: str) -> Callable[..., Any]:
    def method(self: RankNamed, *args: Any, **kwargs: Any) -> Any:
        return _call(getattr(self.inner, op), self._names, args, kwargs)

    method = functools.wraps(getattr(ControlCollectives, op))(method)
    method.__isabstractmethod__ = False  # type: ignore[attr-defined]
    return method


for _op in METHODS:
    setattr(RankNamed, _op, _forward(_op))
RankNamed.__abstractmethods__ = frozenset()
