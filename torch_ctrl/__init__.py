"""torch_ctrl: fast, debuggable control-plane collectives over torch.distributed stores.

``import torch_ctrl`` registers ``torch.distributed.StoreCollectives`` and
``torch.distributed.ControlCollectives`` (see :func:`register`).
"""

from __future__ import annotations

import atexit

from . import base as _base
from . import exit_gate as _exit_gate
from .base import ControlCollectives
from .errors import (
    CollectiveAbortedError,
    CollectiveError,
    CollectiveTimeoutError,
    KeyReusedError,
    StoreUnreachableError,
)
from .inspection import inspect
from .loader import StoreCollectives, backend, import_error
from .naming import RankNamed, with_rank_names
from .store_collectives import PyStoreCollectives
from .workers import from_env

__version__ = "0.2.0"

__all__ = [
    "CollectiveAbortedError",
    "CollectiveError",
    "CollectiveTimeoutError",
    "ControlCollectives",
    "KeyReusedError",
    "PyStoreCollectives",
    "RankNamed",
    "StoreCollectives",
    "StoreUnreachableError",
    "backend",
    "from_env",
    "import_error",
    "inspect",
    "register",
    "with_rank_names",
]


def register() -> None:
    """Make ``torch.distributed.StoreCollectives`` and ``torch.distributed.ControlCollectives``
    torch_ctrl's classes. Idempotent; ``import torch_ctrl`` calls it.

    Where this torch has them (up to 2.13), torch's own private classes stay available as
    ``torch.distributed._StoreCollectives`` and ``torch.distributed._ControlCollectives``;
    nothing of torch is replaced.

    Example::

        import torch.distributed as dist
        import torch_ctrl  # calls register()

        assert dist.StoreCollectives is torch_ctrl.StoreCollectives
    """
    import torch.distributed as dist

    dist.StoreCollectives = StoreCollectives  # type: ignore[attr-defined]
    dist.ControlCollectives = ControlCollectives  # type: ignore[attr-defined]


register()


# atexit runs its callbacks in reverse order. Registered after the watchers' and the
# extension's hooks, so these run first: a process ending on an uncaught exception aborts its
# groups; then daemon threads of the pure-Python implementation park at their next
# collective's start or end (see exit_gate); then the watchers stop.
atexit.register(_exit_gate.settle)
atexit.register(_base.abort_open_groups_on_crash)
