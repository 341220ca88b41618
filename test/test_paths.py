"""Which path an op takes is part of the protocol: both implementations must choose the
TCPStore path (server-side barrier, one log per op) for a TCPStore under any chain of
PrefixStores, where this torch's TCPStore has a server-side barrier, and the generic path
elsewhere. A timed-out all_sum leaves its keys in the store, and the keys tell the path:
the log ``g`` on the TCPStore path, the running total ``s`` on the generic path."""

from __future__ import annotations

import pytest
from helpers import IMPLS, Stores, make

from torch_ctrl import capabilities
from torch_ctrl.errors import CollectiveTimeoutError

TCP_PATH = capabilities.BARRIER and capabilities.LIST_KEYS


def _fields_left(impl: str, kind: str) -> set[str]:
    stores = Stores(kind)
    coll = make(impl, stores.client(0), 0, 2)  # rank 1 never comes
    with pytest.raises(CollectiveTimeoutError) as info:
        coll.all_sum("paths", 5, timeout=0.5)
    coll.close()
    assert "1/2 ranks arrived" in str(info.value) and "missing ranks: [1]" in str(info.value)
    keys = stores.server.list_keys() if hasattr(stores, "server") else []
    return {k.rsplit("/", 1)[1] for k in keys if "/kpaths/" in k}


@pytest.mark.skipif(not capabilities.LIST_KEYS, reason="this torch's TCPStore cannot list keys")
@pytest.mark.parametrize("kind", ["tcp", "prefix", "prefix_nested"])
@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "mixed"])
def test_tcpstore_path_under_prefix_stores(impl: str, kind: str) -> None:
    fields = _fields_left(impl, kind)
    if TCP_PATH:
        assert "g" in fields and "s" not in fields, fields
    else:
        assert "s" in fields and "g" not in fields, fields


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", ["prefix", "file", "hash", "python"])
def test_all_sum_generic_and_prefix_mixed_values(impl: str, kind: str) -> None:
    """Negative, zero and int64-range values sum alike on every path, in mixed groups too."""
    from helpers import run_group

    stores = Stores(kind)
    values = [-(2**62), 2**62, 0, -7]
    totals = run_group(impl, stores, 4, lambda c, r: c.all_sum("mix", values[r], timeout=30))
    assert totals == [sum(values)] * 4
