"""Input limits: heartbeat intervals within a documented range, timeouts up to a documented
maximum (``inf`` means the maximum, in both implementations), and a world size that costs
nothing until ranks appear."""

from __future__ import annotations

import math
import resource
from datetime import timedelta

import pytest
import torch.distributed as dist
from helpers import IMPLS, Stores, make_cls, run_group

from torch_ctrl.base import MAX_HEARTBEAT, MAX_TIMEOUT, MAX_WORLD_SIZE, MIN_HEARTBEAT, to_seconds


@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "mixed"])
@pytest.mark.parametrize("interval", [math.inf, 1e12, 3601, 1e-9, 0.005, 0])
def test_heartbeat_interval_out_of_range_is_refused(impl: str, interval: float) -> None:
    store = dist.HashStore()
    with pytest.raises(ValueError, match="heartbeat_interval must be between 0.01 and 3600 seconds"):
        make_cls(impl, 0)(store, 0, 2, heartbeat_interval=interval)
    assert store.num_keys() == 0  # nothing written


@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "mixed"])
@pytest.mark.parametrize("interval", [-1, float("nan"), timedelta(seconds=-1)])
def test_negative_heartbeat_names_the_parameter_and_its_range(impl: str, interval: object) -> None:
    # The range, not ">= 0": 0 is refused too.
    with pytest.raises(ValueError, match=r"heartbeat_interval must be between 0.01 and 3600 seconds, got "):
        make_cls(impl, 0)(dist.HashStore(), 0, 2, heartbeat_interval=interval)


@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "mixed"])
@pytest.mark.parametrize("interval", [MIN_HEARTBEAT, MAX_HEARTBEAT, timedelta(minutes=5)])
def test_heartbeat_interval_at_the_limits_is_taken(impl: str, interval: object) -> None:
    make_cls(impl, 0)(dist.HashStore(), 0, 1, heartbeat_interval=interval).close()


@pytest.mark.parametrize("timeout", [math.inf, 1e15, timedelta.max, MAX_TIMEOUT])
def test_huge_timeouts_mean_the_maximum(impl: str, timeout: object) -> None:
    """``inf``, ``1e15`` and ``timedelta.max`` work in both implementations (and mixed
    groups), on a real TCPStore: they mean MAX_TIMEOUT."""
    assert to_seconds(timeout) == MAX_TIMEOUT
    stores = Stores("tcp")
    out = run_group(impl, stores, 2, lambda c, r: (c.barrier("b", timeout), c.all_sum("s", r + 1, timeout=timeout)))
    assert [o[1] for o in out] == [3, 3]


@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "mixed"])
def test_world_size_costs_nothing_until_ranks_appear(impl: str) -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    coll = make_cls(impl, 0)(dist.HashStore(), 0, 10**9)
    coll.close()
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50 * 1024  # KiB
    with pytest.raises(ValueError, match=f"world_size must be in \\[1, {MAX_WORLD_SIZE}\\]"):
        make_cls(impl, 0)(dist.HashStore(), 0, MAX_WORLD_SIZE + 1)
