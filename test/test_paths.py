"""Which path an op takes is part of the protocol: both implementations must choose the
TCPStore path (server-side barrier, one log per op) for a TCPStore under any chain of
PrefixStores, where this torch's TCPStore has a server-side barrier, and the generic path
elsewhere. A timed-out all_sum leaves its keys in the store, and the keys tell the path:
the log ``g`` on the TCPStore path, the running total ``s`` on the generic path."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from helpers import IMPLS, Stores, make

from torch_ctrl import capabilities
from torch_ctrl import keys as keys_mod
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


@pytest.mark.skipif("mixed" not in IMPLS, reason="the C++ extension is not built")
@pytest.mark.skipif(not capabilities.LIST_KEYS, reason="this torch's TCPStore cannot list keys")
@pytest.mark.parametrize("op", ["all_sum", "all_gather"])
@pytest.mark.parametrize("kind", ["prefix", "prefix_nested"])
def test_a_mixed_group_under_prefix_stores_takes_one_path(kind: str, op: str) -> None:
    """A C++ rank and a Python rank of one group, under PrefixStores, write to the same keys of
    the same path: both frames land in one log on the TCPStore path (one running total on the
    generic path), and both name the rank that never came."""
    from helpers import run_ranks

    stores = Stores(kind)

    def body(rank: int) -> str:
        coll = make("mixed", stores.client(rank), rank, 3)  # rank 0 C++, rank 1 Python; rank 2 never comes
        try:
            with pytest.raises(CollectiveTimeoutError) as info:
                if op == "all_sum":
                    coll.all_sum("mixedpath", 5, timeout=1.0)
                else:
                    coll.all_gather("mixedpath", b"v", timeout=1.0)
            return str(info.value)
        finally:
            coll.close()

    errors = run_ranks(2, body)
    for text in errors:
        assert "2/3 ranks arrived" in text and "missing ranks: [2]" in text, text
    keys = [k for k in stores.server.list_keys() if "/kmixedpath/" in k]
    fields = {k.rsplit("/", 1)[1] for k in keys}
    if TCP_PATH:
        assert "g" in fields and "s" not in fields, fields
        (log_key,) = [k for k in keys if k.endswith("/g")]
        frames = keys_mod.parse_frames(stores.server.get(log_key), 3)
        assert sorted(rank for rank, _ in frames) == [0, 1], frames
    else:
        expected = {"s"} if op == "all_sum" else {"r0", "r1"}
        assert expected <= fields and "g" not in fields, fields


def _generic_on_tcp(
    impl: str, store: dist.Store, rank: int, world_size: int, monkeypatch: pytest.MonkeyPatch
) -> object:
    """An instance that takes the generic path over a TCPStore, as on a torch without
    TCPStore.barrier (2.6-2.11): each twin reads the capability when an instance is made
    (Python: ``capabilities.BARRIER``; C++: the extension's test hook)."""
    from torch_ctrl import lanes
    from torch_ctrl.store_collectives import PyStoreCollectives

    if impl == "cpp":
        from torch_ctrl import _C  # type: ignore[attr-defined]

        previous = _C._emulate_no_server_barrier(True)
        try:
            return make("cpp", store, rank, world_size)
        finally:
            _C._emulate_no_server_barrier(previous)
    with monkeypatch.context() as m:
        m.setattr(lanes.capabilities, "BARRIER", False)
        coll = PyStoreCollectives(store, rank, world_size)
    assert not coll._lanes.native_barrier
    return coll


@pytest.mark.skipif(not TCP_PATH, reason="this torch takes the generic path on every store")
@pytest.mark.parametrize("op", ["barrier", "all_gather", "all_sum"])
@pytest.mark.parametrize("kind", ["tcp", "prefix"])
@pytest.mark.parametrize("generic", [i for i in IMPLS if i != "mixed"])
@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "mixed"])
def test_ranks_on_both_sides_of_torch_2_12_time_out_naming_the_other_path(
    impl: str, generic: str, kind: str, op: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group whose ranks run torch releases on both sides of 2.12 takes two paths: the
    TCPStore path where TCPStore.barrier exists, the generic path where it does not. The
    paths count on different keys, so no rank passes a barrier early or returns a sum
    without the other ranks' values: every rank times out, and says why. Rank 0 (``impl``)
    takes the TCPStore path, rank 1 (``generic``) the generic path; had either taken the
    other's path, the op would have completed."""
    from helpers import run_ranks

    stores = Stores(kind)
    colls = [make(impl, stores.client(0), 0, 2), _generic_on_tcp(generic, stores.client(1), 1, 2, monkeypatch)]
    call = {
        "barrier": lambda c: c.barrier("twopaths", timeout=1.5),
        "all_gather": lambda c: c.all_gather("twopaths", b"v", timeout=1.5),
        "all_sum": lambda c: c.all_sum("twopaths", 5, timeout=1.5),
    }[op]

    def body(rank: int) -> str:
        try:
            with pytest.raises(CollectiveTimeoutError) as info:
                call(colls[rank])
            return str(info.value)
        finally:
            colls[rank].close()

    for text in run_ranks(2, body):
        assert "ranks arrived on the other store path" in text and "2.12" in text, text
        assert "\n" not in text
