"""``CountingStore``: a ``torch.distributed.Store`` that counts the calls made to it.

It wraps an inner store and forwards every call, counting it per method and per
calling thread. Because it is a Python subclass of ``dist.Store``, C++ code
(torch's ``_StoreCollectives``, torch_ctrl's C++ implementation) calls it through
torch's pybind trampoline too, so both kinds of caller are counted the same way.

It deliberately does not implement ``clone()``: torch_ctrl then uses the store
directly (its "shared" mode, see ``torch_ctrl/lanes.py``) instead of opening new
connections that would bypass the counters. Note that torch's trampoline calls the
C++ names ``deleteKey`` and ``getNumKeys``; both spellings are provided.
"""

from __future__ import annotations

import threading
from collections import Counter
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["METHODS", "CountingStore"]

METHODS = (
    "set",
    "get",
    "add",
    "check",
    "wait",
    "delete_key",
    "compare_set",
    "num_keys",
    "multi_get",
    "multi_set",
    "append",
    "list_keys",
)


class CountingStore(dist.Store):
    """Forward every call to ``inner`` and count it (thread safe).

    ``counts()`` gives the calls per method (all threads, or one thread's);
    ``reset()`` clears the counters.
    """

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner: Any = inner  # Any: torch's type stubs lack part of the Store API (append, multi_set, ...)
        # A blocking call here blocks for the inner store's timeout: say so, as a transparent
        # wrapper must (callers that match their timeout to the store's read it here).
        self.set_timeout(inner.timeout)
        self._lock = threading.Lock()
        self._counts: Counter[tuple[int, str]] = Counter()

    # ------------------------------------------------------------- counters
    def _count(self, method: str) -> None:
        with self._lock:
            self._counts[(threading.get_ident(), method)] += 1

    def counts(self, thread: int | None = None) -> dict[str, int]:
        """Calls per method (only non-zero entries), made by ``thread`` (a ``threading.get_ident()``) or by all."""
        out: Counter[str] = Counter()
        with self._lock:
            for (ident, method), n in self._counts.items():
                if thread is None or ident == thread:
                    out[method] += n
        return {m: out[m] for m in METHODS if out[m]}

    def total(self, thread: int | None = None) -> int:
        """Number of calls, by ``thread`` or by all threads."""
        return sum(self.counts(thread).values())

    def reset(self) -> None:
        """Clear all counters."""
        with self._lock:
            self._counts.clear()

    # ---------------------------------------------------------- forwarding
    def set(self, key: str, value: bytes | str) -> None:
        self._count("set")
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._count("get")
        return self.inner.get(key)

    def add(self, key: str, value: int) -> int:
        self._count("add")
        return self.inner.add(key, value)

    def check(self, keys: list[str]) -> bool:
        self._count("check")
        return self.inner.check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._count("wait")
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        self._count("delete_key")
        return self.inner.delete_key(key)

    deleteKey = delete_key  # noqa: N815 - the name torch's trampoline calls from C++

    def compare_set(self, key: str, expected_value: bytes | str, desired_value: bytes | str) -> bytes:
        self._count("compare_set")
        return self.inner.compare_set(key, expected_value, desired_value)

    def num_keys(self) -> int:
        self._count("num_keys")
        return self.inner.num_keys()

    getNumKeys = num_keys  # noqa: N815 - the name torch's trampoline calls from C++

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._count("multi_get")
        return self.inner.multi_get(keys)

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        self._count("multi_set")
        self.inner.multi_set(keys, values)

    def append(self, key: str, value: bytes | str) -> None:
        self._count("append")
        self.inner.append(key, value)

    def list_keys(self) -> list[str]:
        self._count("list_keys")
        return self.inner.list_keys()

    def has_extended_api(self) -> bool:
        """Whatever the inner store says (not counted)."""
        return self.inner.has_extended_api()

    def __repr__(self) -> str:
        return f"CountingStore({type(self.inner).__name__}, calls={self.total()})"
