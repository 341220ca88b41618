"""Store calls per op and rank (critical path: the calls made on the rank's own thread)
never exceed torch's _StoreCollectives on the same store. Counts do not jitter."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist
from helpers import DictStore, make, run_ranks

from torch_ctrl.capabilities import private_store_collectives
from torch_ctrl.counting import CountingStore

T = timedelta(seconds=300)  # the store's own timeout: the one-call path, like torch's
OPS = ["barrier", "broadcast", "gather", "scatter", "all_gather", "all_sum"]
# torch's _StoreCollectives per op and rank, measured on torch 2.6-2.13 (any world, HashStore
# or Python store): the reference where torch no longer has the class (2.14+).
TORCH_CALLS = {"barrier": 3, "broadcast": 1, "gather": 1, "scatter": 1, "all_gather": 2, "all_sum": 5}


def _per_op_calls(world: int, factory, inner_kind: str, T: timedelta = T) -> dict[str, list[int]]:  # noqa: N803
    inner = dist.HashStore() if inner_kind == "hash" else DictStore()
    inner.set_timeout(T)  # the store's own timeout is the ops': what a wrapper reports too
    store = CountingStore(inner)
    colls = [factory(store, r) for r in range(world)]
    torch_cls = private_store_collectives()
    is_torch = torch_cls is not None and isinstance(colls[0], torch_cls)
    enc = (lambda b: b.decode()) if is_torch else (lambda b: b)
    sync = threading.Barrier(world)

    def rank_main(rank: int) -> dict[str, int]:
        c = colls[rank]
        steps = {
            "barrier": lambda: c.barrier("b", T),
            "broadcast": lambda: c.broadcast_send("bc", enc(b"x"), T) if rank == 0 else c.broadcast_recv("bc", T),
            "gather": lambda: c.gather_recv("g", enc(b"x"), T) if rank == 0 else c.gather_send("g", enc(b"x"), T),
            "scatter": lambda: c.scatter_send("s", [enc(b"x")] * world, T) if rank == 0 else c.scatter_recv("s", T),
            "all_gather": lambda: c.all_gather("ag", enc(b"x"), T),
            "all_sum": lambda: c.all_sum("sum", 1, T),
        }
        out = {}
        me = threading.get_ident()
        for op in OPS:
            sync.wait()
            before = store.total(me)
            steps[op]()
            out[op] = store.total(me) - before
        return out

    per_rank = run_ranks(world, rank_main)
    for c in colls:
        if hasattr(c, "close"):
            c.close()
    return {op: [per_rank[r][op] for r in range(world)] for op in OPS}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("inner_kind", ["hash", "python"])
def test_no_op_costs_more_calls_than_torch(impl: str, world: int, inner_kind: str) -> None:
    torch_cls = private_store_collectives()
    if torch_cls is None:
        theirs = {op: [n] * world for op, n in TORCH_CALLS.items()}
    else:
        theirs = _per_op_calls(world, lambda s, r: torch_cls(s, r, world), inner_kind)
        assert {op: max(n) for op, n in theirs.items()} == TORCH_CALLS  # the reference still holds
    ours = _per_op_calls(world, lambda s, r: make(impl, s, r, world), inner_kind)
    for op in OPS:
        assert max(ours[op]) <= max(theirs[op]), (op, ours[op], theirs[op])
    # and strictly fewer where torch's design is wasteful
    assert max(ours["barrier"]) < max(theirs["barrier"])
    assert max(ours["all_sum"]) < max(theirs["all_sum"])


@pytest.mark.parametrize("inner_kind", ["hash", "python"])
def test_a_store_whose_timeout_is_the_ops_costs_no_more_calls_than_torch(impl: str, inner_kind: str) -> None:
    """Ops with a 30 s timeout on a store set to 30 s take the one-call path as at 300 s: the
    counting wrapper reports the timeout of the store it wraps (the benchmark's count tables
    run at --timeout 120 on stores set to it)."""
    short = timedelta(seconds=30)
    theirs = {op: [n] * 3 for op, n in TORCH_CALLS.items()}
    ours = _per_op_calls(3, lambda s, r: make(impl, s, r, 3), inner_kind, short)
    for op in OPS:
        assert max(ours[op]) <= max(theirs[op]), (op, ours[op], theirs[op])


class _CountingFileStore(dist.FileStore):
    """A real FileStore that counts the calls made through Python (the Python implementation's)."""

    def __init__(self, path: str, world: int, calls: list[str] | None = None) -> None:
        super().__init__(path, world)
        self.args = (path, world)
        self.calls: list[str] = [] if calls is None else calls

    def clone(self) -> _CountingFileStore:  # a lane's own handle counts into the same list
        return _CountingFileStore(*self.args, self.calls)

    def compare_set(self, *args):  # noqa: ANN002, ANN201
        self.calls.append("compare_set")
        return super().compare_set(*args)

    def check(self, *args):  # noqa: ANN002, ANN201
        self.calls.append("check")
        return super().check(*args)

    def get(self, *args):  # noqa: ANN002, ANN201
        self.calls.append("get")
        return super().get(*args)


def test_filestore_read_of_a_value_already_there_is_one_call(tmp_path) -> None:  # noqa: ANN001
    """On a FileStore, a blocking read looks with one ``compare_set`` that also reads the
    value (not ``check`` then ``get``, two passes over the file): one call when it is there."""
    from torch_ctrl import PyStoreCollectives

    root = PyStoreCollectives(dist.FileStore(str(tmp_path / "f"), 2), 0, 2)
    store = _CountingFileStore(str(tmp_path / "f"), 2)
    leaf = PyStoreCollectives(store, 1, 2)
    root.broadcast_send("bc", b"payload", 30)
    before = len(store.calls)
    assert leaf.broadcast_recv("bc", 30) == b"payload"
    assert store.calls[before:] == ["compare_set"]
    root.scatter_send("s", [b"a", b"b"], 30)
    before = len(store.calls)
    assert leaf.scatter_recv("s", 30) == b"b"
    assert store.calls[before:] == ["compare_set"]
    root.close()
    leaf.close()
