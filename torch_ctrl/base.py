"""``ControlCollectives``: the abstract interface, and argument checking shared by
both implementations (so bad input fails the same way, before any store traffic)."""

from __future__ import annotations

import abc
import operator
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Union

import torch.distributed as dist

Data = Union[bytes, bytearray, memoryview, str]
Timeout = Union[timedelta, int, float]

DEFAULT_TIMEOUT = timedelta(seconds=300)

# The nine collective methods of ControlCollectives, in documentation order.
METHODS = (
    "barrier",
    "broadcast_send",
    "broadcast_recv",
    "gather_send",
    "gather_recv",
    "scatter_send",
    "scatter_recv",
    "all_gather",
    "all_sum",
)
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


class ControlCollectives(abc.ABC):
    """Collectives over small byte payloads for the control plane of a job.

    Every method takes a ``key`` that names the operation (``None``: the next
    automatic key of this instance, so all ranks must then call keyless
    collectives in the same order) and a ``timeout`` (``timedelta`` or seconds).
    """

    @abc.abstractmethod
    def barrier(self, key: str | None = None, timeout: Timeout = DEFAULT_TIMEOUT, block: bool = True) -> None:
        """Block until all ranks have entered the barrier (``block=False``: only arrive)."""

    @abc.abstractmethod
    def broadcast_send(
        self, key: str | None = None, data: Data | None = None, timeout: Timeout = DEFAULT_TIMEOUT
    ) -> None:
        """Send ``data`` to every other rank (called by exactly one rank)."""

    @abc.abstractmethod
    def broadcast_recv(self, key: str | None = None, timeout: Timeout = DEFAULT_TIMEOUT) -> bytes:
        """Receive the data broadcast under ``key``."""

    @abc.abstractmethod
    def gather_send(self, key: str | None = None, data: Data | None = None, timeout: Timeout = DEFAULT_TIMEOUT) -> None:
        """Send ``data`` to the gathering rank."""

    @abc.abstractmethod
    def gather_recv(
        self, key: str | None = None, data: Data | None = None, timeout: Timeout = DEFAULT_TIMEOUT
    ) -> list[bytes]:
        """Collect every rank's data, in rank order, this rank's ``data`` included."""

    @abc.abstractmethod
    def scatter_send(
        self, key: str | None = None, data: Sequence[Data] | None = None, timeout: Timeout = DEFAULT_TIMEOUT
    ) -> bytes:
        """Send ``data[i]`` to rank ``i``; return this rank's own element."""

    @abc.abstractmethod
    def scatter_recv(self, key: str | None = None, timeout: Timeout = DEFAULT_TIMEOUT) -> bytes:
        """Receive this rank's element of a scatter."""

    @abc.abstractmethod
    def all_gather(
        self, key: str | None = None, data: Data | None = None, timeout: Timeout = DEFAULT_TIMEOUT
    ) -> list[bytes]:
        """Every rank's data, in rank order, on every rank."""

    @abc.abstractmethod
    def all_sum(self, key: str | None = None, data: int | None = None, timeout: Timeout = DEFAULT_TIMEOUT) -> int:
        """The sum of every rank's integer (64-bit, wrapping like torch's store counters)."""

    def abort(self, reason: str = "") -> None:
        """Mark the group as failed by this rank; peers blocked in any collective raise
        ``CollectiveAbortedError``. Backends without fail-fast support raise NotImplementedError."""
        raise NotImplementedError(f"{type(self).__name__} does not support abort()")

    @contextmanager
    def abort_on_error(self) -> Iterator[None]:
        """Abort the group with the exception's type and message if the block raises, then re-raise."""
        try:
            yield
        except BaseException as exc:
            if not isinstance(exc, GeneratorExit):
                text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                self.abort(f"{type(exc).__name__}: {text}")
            raise

    def close(self, flush_timeout: float = 5.0) -> None:  # noqa: B027 - optional for other backends
        """Release resources (background threads, connections); a no-op by default."""

    def __enter__(self) -> ControlCollectives:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- checks


def check_init(store: object, rank: object, world_size: object) -> tuple[int, int]:
    """Validate constructor arguments; returns ``(rank, world_size)``."""
    if not isinstance(store, dist.Store):
        raise TypeError(f"store must be a torch.distributed.Store, got {type(store).__name__}")
    rank_i, world_i = _int("rank", rank), _int("world_size", world_size)
    if world_i < 1:
        raise ValueError(f"world_size must be >= 1, got {world_i}")
    if not 0 <= rank_i < world_i:
        raise ValueError(f"rank must be in [0, {world_i}), got {rank_i}")
    return rank_i, world_i


def check_heartbeat(heartbeat_interval: object) -> float | None:
    """``None`` (liveness off) or a positive interval in seconds."""
    if heartbeat_interval is None:
        return None
    seconds = to_seconds(heartbeat_interval)
    if seconds <= 0:
        raise ValueError(f"heartbeat_interval must be > 0, got {heartbeat_interval!r}")
    return seconds


def _int(name: str, value: object) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None


def check_key(key: object) -> str | None:
    """``None`` or a ``str``."""
    if key is None or isinstance(key, str):
        return key
    raise TypeError(f"key must be a str or None, got {type(key).__name__}")


def to_bytes(data: object, what: str = "data") -> bytes:
    """bytes, bytearray, memoryview or str (UTF-8) -> bytes."""
    if isinstance(data, bytes):
        return data
    if data is None:
        raise TypeError(f"{what} is required")
    if isinstance(data, str):
        return data.encode("utf-8")
    if isinstance(data, (bytearray, memoryview)):
        return bytes(data)
    raise TypeError(f"{what} must be bytes, bytearray, memoryview or str, got {type(data).__name__}")


def to_bytes_list(data: object, world_size: int) -> list[bytes]:
    """A scatter list: a sequence of ``world_size`` payloads."""
    if data is None:
        raise TypeError("data is required")
    if isinstance(data, (bytes, bytearray, memoryview, str)) or not isinstance(data, Sequence):
        raise TypeError(f"data must be a sequence of {world_size} payloads, got {type(data).__name__}")
    if len(data) != world_size:
        raise ValueError(f"data must have world_size={world_size} elements, got {len(data)}")
    return [to_bytes(d, f"data[{i}]") for i, d in enumerate(data)]


def to_int64(data: object) -> int:
    """An int in the signed 64-bit range."""
    if data is None:
        raise TypeError("data is required")
    value = _int("data", data)
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"data must fit in a signed 64-bit integer, got {value}")
    return value


def to_seconds(timeout: object) -> float:
    """timedelta or int/float seconds -> seconds (>= 0)."""
    if isinstance(timeout, timedelta):
        secs = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        secs = float(timeout)
    else:
        raise TypeError(f"timeout must be a timedelta or seconds, got {type(timeout).__name__}")
    if secs != secs or secs < 0:
        raise ValueError(f"timeout must be >= 0, got {timeout!r}")
    return secs


def wrap_int64(value: int) -> int:
    """Two's-complement wrap to signed 64 bits."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value
