"""Store capabilities that differ between torch releases, detected from the running torch's
classes (never from its version string). Twin of ``csrc/compat.h``, which detects the same
three from the headers the extension is compiled against; both must answer alike, since
whether an op takes TCPStore's server-side barrier is part of the protocol.

=========  ================================  ==================================================
name       torch API                         where it is missing
=========  ================================  ==================================================
clone      ``Store.clone()``                 torch < 2.8: lanes are new TCPStore clients
barrier    ``TCPStore.barrier(key, n)``      the generic barrier (``add`` + done flag)
list_keys  ``Store.list_keys()``             one ``check`` per rank to name missing ranks
=========  ================================  ==================================================
"""

from __future__ import annotations

import torch.distributed as dist

CLONE: bool = hasattr(dist.Store, "clone")
BARRIER: bool = hasattr(dist.TCPStore, "barrier")
LIST_KEYS: bool = hasattr(dist.Store, "list_keys")


def detected() -> dict[str, bool]:
    """The three capabilities of this torch's stores, as ``{name: available}``."""
    return {"clone": CLONE, "barrier": BARRIER, "list_keys": LIST_KEYS}


def tcpstore_path(chain: bool) -> bool:
    """Whether barrier, all_gather and all_sum take the TCPStore path over a TCPStore, bare
    (``chain=False``) or under PrefixStores: the server-side barrier, and under PrefixStores
    ``list_keys`` (the Python twin learns their prefix with it). Part of the protocol: every
    rank of a group must answer alike (``csrc/lanes.cpp`` applies the same rule)."""
    return BARRIER and (not chain or LIST_KEYS)


def private_store_collectives() -> type | None:
    """torch's own ``torch.distributed._StoreCollectives`` (torch 2.3 to 2.13), or None."""
    return getattr(dist, "_StoreCollectives", None)
