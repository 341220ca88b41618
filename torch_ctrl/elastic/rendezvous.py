"""The ``ctrl`` rendezvous backend: torch's ``c10d`` backend, plus torch_ctrl.

``torchrun --rdzv-backend=ctrl --rdzv-endpoint=HOST:PORT ...`` takes every ``c10d``
option (``--rdzv-conf is_host=...``, timeouts, ...) and adds:

* the adapter and agent hooks (:func:`torch_ctrl.elastic.install`), installed in the
  torchrun process when the backend is created;
* the bootstrap store address (MASTER_ADDR/MASTER_PORT) sent by node 0 through a
  broadcast in the round's own namespace, so a round can never read an earlier round's
  address;
* :attr:`CtrlRendezvousHandler.round`, exported to workers as ``TORCH_CTRL_ROUND`` and
  ``TORCHELASTIC_RESTART_COUNT`` (the same on every node of a round);
* a clean workers' store for every round: torch shares one TCPStore with the workers of all
  rounds and prefixes nothing per attempt, so after a restart a fast node's new workers could
  read the previous attempt's keys (e.g. gloo peer addresses of dead workers, "Connection
  refused"). Node 0 deletes them once the new round is complete (every old worker has been
  stopped by then) and before it sends the bootstrap address, i.e. before any new worker starts.

The backend is registered through the ``torchrun.handlers`` entry point
(:func:`handler_factory`); nothing else in this module runs at registration.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

BACKEND = "ctrl"
_BOOTSTRAP_TIMEOUT = 300.0
# Keys of torch's c10d rendezvous itself, never deleted (in case it shares the workers' store).
_RDZV_PREFIX = "torch.rendezvous."


def clear_worker_store(addr: str, port: int, timeout: float = 60.0) -> int:
    """Delete every key an earlier round's workers left in the shared workers' store
    (``addr:port``), except torch's rendezvous keys; returns how many were deleted."""
    from datetime import timedelta

    store = dist.TCPStore(addr, port, None, False, timedelta(seconds=timeout), wait_for_workers=False)
    stale = [k for k in store.list_keys() if not k.startswith(_RDZV_PREFIX)]
    for key in stale:
        store.delete_key(key)
    return len(stale)


def handler_factory() -> Any:
    """Entry point of the ``torchrun.handlers`` group: returns the handler creator."""
    return create_handler


def create_handler(params: Any) -> CtrlRendezvousHandler:
    """Create the ``ctrl`` handler from torchrun's ``RendezvousParameters``."""
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, dynamic_rendezvous

    from . import install

    install()
    backend, store = c10d_rendezvous_backend.create_backend(params)
    return CtrlRendezvousHandler(dynamic_rendezvous.create_handler(store, backend, params))


def _base() -> type:
    from torch.distributed.elastic.rendezvous import RendezvousHandler

    return RendezvousHandler


class CtrlRendezvousHandler(_base()):  # type: ignore[misc]
    """A ``DynamicRendezvousHandler`` (c10d) whose rounds are numbered for workers and whose
    bootstrap address travels through a round-scoped broadcast."""

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
