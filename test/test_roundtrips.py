"""Store calls per op and rank (critical path: the calls made on the rank's own thread)
never exceed torch's _StoreCollectives on the same store. Counts do not jitter."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist
from helpers import DictStore, make, run_ranks

from torch_ctrl.counting import CountingStore

T = timedelta(seconds=300)  # the store's own timeout: the one-call path, like torch's
OPS = ["barrier", "broadcast", "gather", "scatter", "all_gather", "all_sum"]


def _per_op_calls(world: int, factory, inner_kind: str) -> dict[str, list[int]]:
    store = CountingStore(dist.HashStore() if inner_kind == "hash" else DictStore())
    colls = [factory(store, r) for r in range(world)]
    is_torch = isinstance(colls[0], dist._StoreCollectives)
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
    theirs = _per_op_calls(world, lambda s, r: dist._StoreCollectives(s, r, world), inner_kind)
    ours = _per_op_calls(world, lambda s, r: make(impl, s, r, world), inner_kind)
    for op in OPS:
        assert max(ours[op]) <= max(theirs[op]), (op, ours[op], theirs[op])
    # and strictly fewer where torch's design is wasteful
    assert max(ours["barrier"]) < max(theirs["barrier"])
    assert max(ours["all_sum"]) < max(theirs["all_sum"])
