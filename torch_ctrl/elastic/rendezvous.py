"""The ``ctrl`` rendezvous backend for torchrun.

``torchrun --rdzv-backend=ctrl --rdzv-endpoint=HOST:PORT ...`` takes every ``c10d`` option
(``--rdzv-conf is_host=...,join_timeout=...,last_call_timeout=...``, ``--nnodes=MIN:MAX``) and
runs torch_ctrl's own rendezvous (:mod:`torch_ctrl.elastic.ctrl_rendezvous`): O(1) store
calls per node to join, per-node heartbeats, working scale-up and scale-down, and

* the adapter and agent hooks (:func:`torch_ctrl.elastic.install`), installed in the
  torchrun process when the backend is created;
* every round has its own store namespace and its own bootstrap store (MASTER_ADDR/MASTER_PORT),
  hosted by node 0 of that round, so a round can never read an earlier round's address or keys;
* ``handler.round``, exported to workers as ``TORCH_CTRL_ROUND`` and
  ``TORCHELASTIC_RESTART_COUNT`` (the same on every node of a round).

:class:`CtrlRendezvousHandler` wraps any other torch handler (e.g. c10d's) with the round
number and a round-scoped bootstrap broadcast; :func:`clear_worker_store` empties a workers'
store shared across rounds. The backend is registered through the ``torchrun.handlers`` entry
point (:mod:`torch_ctrl.elastic.plugin`, which imports this module only when torchrun creates a
handler, so this module may be a program's first import).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from .ctrl_rendezvous import NativeRendezvousHandler, config_from, create_native_handler

__all__ = ["BACKEND", "CtrlRendezvousHandler", "NativeRendezvousHandler", "clear_worker_store", "create_handler"]

BACKEND = "ctrl"
_BOOTSTRAP_TIMEOUT = 300.0
# Keys of torch's c10d rendezvous itself, never deleted (in case it shares the workers' store).
_RDZV_PREFIX = "torch.rendezvous."


def clear_worker_store(addr: str, port: int, timeout: float = 60.0) -> int:
    """Delete every key an earlier round's workers left in the shared workers' store
    (``addr:port``), except torch's rendezvous keys; returns how many were deleted (none
    where this torch's stores have no ``list_keys``)."""
    from datetime import timedelta

    from ..capabilities import LIST_KEYS

    if not LIST_KEYS:  # this torch's stores cannot list their keys: leave them (torch's behaviour)
        return 0
    store = dist.TCPStore(addr, port, None, False, timedelta(seconds=timeout), wait_for_workers=False)
    stale = [k for k in store.list_keys() if not k.startswith(_RDZV_PREFIX)]
    for key in stale:
        store.delete_key(key)
    return len(stale)


def handler_factory() -> Any:
    """The handler creator (:func:`create_handler`), as the ``torchrun.handlers`` entry point
    (:func:`torch_ctrl.elastic.plugin.handler_factory`) returns it."""
    return create_handler


def create_handler(params: Any) -> NativeRendezvousHandler:
    """Create the ``ctrl`` handler from torchrun's ``RendezvousParameters``: the native
    rendezvous of :mod:`torch_ctrl.elastic.ctrl_rendezvous` (options validated first, one line
    per error), with the adapter and agent hooks installed in this process."""
    from . import install

    config_from(params)  # bad input fails before anything is installed or written
    install()
    return create_native_handler(params)


def _base() -> type:
    from torch.distributed.elastic.rendezvous import RendezvousHandler

    return RendezvousHandler


class CtrlRendezvousHandler(_base()):  # type: ignore[misc]
    """Wraps another torch handler (e.g. c10d's ``DynamicRendezvousHandler``): its rounds are
    numbered for workers, its bootstrap address travels through a round-scoped broadcast, and
    node 0 empties a workers' store shared across rounds. The ``ctrl`` backend itself uses
    :class:`NativeRendezvousHandler`, which needs none of this."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.round: int | None = None

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return bool(self._inner.use_agent_store)

    def next_rendezvous(self) -> Any:
        from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

        from ..loader import StoreCollectives
        from .agent import AGENT_PREFIX

        info = self._inner.next_rendezvous()
        self.round = int(self._inner._state_holder.state.round)
        coll = StoreCollectives(dist.PrefixStore(AGENT_PREFIX, info.store), info.rank, info.world_size)
        with coll:
            if info.rank == 0:
                mine = info.bootstrap_store_info
                if self.use_agent_store:
                    clear_worker_store(mine.master_addr, mine.master_port)
                text = f"{mine.master_addr}\n{mine.master_port}"
                coll.broadcast_send(key="bootstrap", data=text, timeout=_BOOTSTRAP_TIMEOUT)
            else:
                text = coll.broadcast_recv(key="bootstrap", timeout=_BOOTSTRAP_TIMEOUT).decode()
        addr, _, port = text.rpartition("\n")
        return RendezvousInfo(info.store, info.rank, info.world_size, RendezvousStoreInfo(addr, int(port)))

    def is_closed(self) -> bool:
        return bool(self._inner.is_closed())

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return int(self._inner.num_nodes_waiting())

    def get_run_id(self) -> str:
        return str(self._inner.get_run_id())

    def shutdown(self) -> bool:
        return bool(self._inner.shutdown())

    @property
    def settings(self) -> Any:
        """The wrapped c10d handler's settings."""
        return self._inner.settings
