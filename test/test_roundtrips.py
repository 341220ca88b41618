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


def _per_op_calls(world: int, factory, inner_kind: str) -> dict[str, list[int]]:
    store = CountingStore(dist.HashStore() if inner_kind == "hash" else DictStore())
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
