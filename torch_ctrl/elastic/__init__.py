"""torch_ctrl for torchrun / torch.distributed.elastic.

* :mod:`torch_ctrl.elastic.store`: drop-in for ``torch.distributed.elastic.utils.store``.
* :func:`install` / :func:`uninstall` / :func:`installed`: put it (and the agent hooks of
  :mod:`torch_ctrl.elastic.agent`) in place of torch's functions, wherever torch uses them.
* :mod:`torch_ctrl.elastic.rendezvous`: the ``ctrl`` rendezvous backend for torchrun.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from . import store

__all__ = ["install", "uninstall", "installed", "is_installed", "store"]

log = logging.getLogger("torch_ctrl.elastic")

_TORCH_STORE = "torch.distributed.elastic.utils.store"
_lock = threading.RLock()
# (owner, attribute) -> original value; owner is a module or a class.
_saved: dict[tuple[int, str], tuple[Any, str, Any]] = {}
_logged = False
_ABSENT = object()  # the attribute was inherited, not set on the owner itself


def is_installed() -> bool:
    """Whether :func:`install` is in effect.

    Example::

        torch_ctrl.elastic.is_installed()  # False until install()
    """
    return bool(_saved)


def install(agent_hooks: bool = True) -> None:
    """Replace torch's elastic store utilities with :mod:`torch_ctrl.elastic.store`, in
    ``torch.distributed.elastic.utils.store`` and in every loaded ``torch.*`` module that
    imported them by name (e.g. ``torch.distributed.elastic.utils.distributed``); with
    ``agent_hooks``, also wrap the elastic agent's methods (:mod:`torch_ctrl.elastic.agent`).

    Idempotent and reversible (:func:`uninstall`); logged once per process.

    Args:
        agent_hooks: also wrap the elastic agent's methods (default ``True``).

    Example::

        import torch_ctrl.elastic

        torch_ctrl.elastic.install()  # before torchrun's agent starts, e.g. in a launcher
    """
    global _logged
    import importlib

    torch_store = importlib.import_module(_TORCH_STORE)
    with _lock:
        for name in store.__all__:
            original = _original(torch_store, name)
            for module, attr in _importers(original):
                _patch(module, attr, getattr(store, name))
        if agent_hooks:
            from . import agent, internals

            for cls, name, hook in internals.usable_hooks(agent.hook_table()):
                original = _original(cls, name)
                _patch(cls, name, _bind(hook, original))
        if not _logged:
            _logged = True
            log.info("torch_ctrl: elastic store utilities%s installed", " and agent hooks" if agent_hooks else "")


def uninstall() -> None:
    """Restore every original that :func:`install` replaced (and torch modules imported since
    that copied a replacement). Idempotent.

    Example::

        torch_ctrl.elastic.uninstall()  # torch's functions exactly as before
    """
    with _lock:
        replaced = {
            id(getattr(owner, name)): original for owner, name, original in _saved.values() if original is not _ABSENT
        }
        for owner, name, original in list(_saved.values()):
            if original is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        _saved.clear()
        for module in list(sys.modules.values()):
            if getattr(module, "__name__", "").startswith("torch."):
                for name, value in list(vars(module).items()):
                    if id(value) in replaced and callable(value):
                        setattr(module, name, replaced[id(value)])


@contextmanager
def installed(agent_hooks: bool = True) -> Iterator[None]:
    """``install()`` for the block; restores torch's originals afterwards, unless it was
    already installed before the block.

    Args:
        agent_hooks: as for :func:`install`.

    Example::

        with torch_ctrl.elastic.installed():
            torch.distributed.run.main(args)
    """
    was = is_installed()
    install(agent_hooks)
    try:
        yield
    finally:
        if not was:
            uninstall()


def _original(owner: Any, name: str) -> Any:
    saved = _saved.get((id(owner), name))
    return getattr(owner, name) if saved is None or saved[2] is _ABSENT else saved[2]


def _patch(owner: Any, name: str, value: Any) -> None:
    key = (id(owner), name)
    if key in _saved:
        return
    _saved[key] = (owner, name, vars(owner).get(name, _ABSENT))
    setattr(owner, name, value)


def _importers(original: Any) -> list[tuple[Any, str]]:
    """``(module, attribute)`` for every loaded torch module holding ``original``, under any name."""
    found = []
    for module in list(sys.modules.values()):
        mod_name = getattr(module, "__name__", "")
        if module is None or not (mod_name == "torch" or mod_name.startswith("torch.")):
            continue
        try:
            items = list(vars(module).items())
        except TypeError:
            continue
        found.extend((module, attr) for attr, value in items if value is original)
    return found


def _bind(hook: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return hook(original, self, *args, **kwargs)

    method.__torch_ctrl_hook__ = hook  # type: ignore[attr-defined]
    return method
