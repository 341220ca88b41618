"""The ``torchrun.handlers`` entry point of the ``ctrl`` rendezvous backend.

torch loads its rendezvous plugins while ``torch.distributed.elastic.rendezvous`` is first
imported, and that import can come from inside :mod:`torch_ctrl.elastic.rendezvous` itself (a
program whose first import is that module). So the entry point lives in this module, which
imports nothing of torch_ctrl's rendezvous until a handler is created: the plugin registers
whatever is being imported at the time.
"""

from __future__ import annotations

from typing import Any

__all__ = ["handler_factory"]


def handler_factory() -> Any:
    """Entry point of the ``torchrun.handlers`` group: returns the ``ctrl`` handler creator
    (``create_handler`` of :mod:`torch_ctrl.elastic.rendezvous`, imported when first called)."""
    return _create_handler


def _create_handler(params: Any) -> Any:
    from .rendezvous import create_handler

    return create_handler(params)
