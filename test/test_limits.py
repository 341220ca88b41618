"""Input limits: heartbeat intervals within a documented range, timeouts up to a documented
maximum (``inf`` means the maximum, in both implementations), and a world size that costs
nothing until ranks appear."""

from __future__ import annotations

import math
import resource
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers import IMPLS, Stores, make_cls, run_group

from torch_ctrl.base import MAX_HEARTBEAT, MAX_TIMEOUT, MAX_WORLD_SIZE, MIN_HEARTBEAT, to_seconds


@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "mixed"])
@pytest.mark.parametrize("interval", [math.inf, 1e12, pytest.param(10**400, id="10**400"), 3601, 1e-9, 0.005, 0])
def test_heartbeat_interval_out_of_range_is_refused(impl: str, interval: float) -> None:
    store = dist.HashStore()
    with pytest.raises(ValueError, match="heartbeat_interval must be between 0.01 and 3600 seconds"):
        make_cls(impl, 0)(store, 0, 2, heartbeat_interval=interval)
    assert store.num_keys() == 0  # nothing written


@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "mixed"])
@pytest.mark.parametrize("interval", [-1, float("nan"), timedelta(seconds=-1), pytest.param(-(10**400), id="-10**400")])
def test_negative_heartbeat_names_the_parameter_and_its_range(impl: str, interval: object) -> None:
    # The range, not ">= 0": 0 is refused too.
    with pytest.raises(ValueError, match=r"heartbeat_interval must be between 0.01 and 3600 seconds, got "):
        make_cls(impl, 0)(dist.HashStore(), 0, 2, heartbeat_interval=interval)


@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "mixed"])
@pytest.mark.parametrize("interval", [MIN_HEARTBEAT, MAX_HEARTBEAT, timedelta(minutes=5)])
def test_heartbeat_interval_at_the_limits_is_taken(impl: str, interval: object) -> None:
    make_cls(impl, 0)(dist.HashStore(), 0, 1, heartbeat_interval=interval).close()


@pytest.mark.parametrize("timeout", [math.inf, 1e15, pytest.param(10**400, id="10**400"), timedelta.max, MAX_TIMEOUT])
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


@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "mixed"])
@pytest.mark.parametrize("timeout", [-(10**400), -(10**5000)], ids=["-10**400", "-10**5000"])
def test_a_negative_int_too_large_for_a_float_is_a_negative_timeout(impl: str, timeout: int) -> None:
    """Not an OverflowError: the ValueError of any negative timeout, naming the parameter (an
    int too long to print is shown by its size)."""
    store = dist.HashStore()
    coll = make_cls(impl, 0)(store, 0, 2)
    with pytest.raises(ValueError, match=r"^timeout must be >= 0, got -(1000|<an int of \d+ bits>)"):
        coll.barrier("k", timeout)
    with pytest.raises(ValueError, match=r"^timeout must be >= 0, got -"):
        coll.all_sum("s", 1, timeout=timeout)
    assert store.num_keys() == 0  # nothing written
    coll.close()


@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "mixed"])
def test_ints_too_long_to_print_are_refused_by_their_size(impl: str) -> None:
    """A rank, world size or all_sum value of 5000 digits: the ValueError that names the
    parameter and its range, the int shown by its size (Python refuses to print it), in
    both implementations; from_env's environment likewise, shortened."""
    import torch_ctrl

    big = 10**5000
    cls = make_cls(impl, 0)
    with pytest.raises(ValueError, match=r"^rank must be in \[0, 2\), got <an int of 16610 bits>$"):
        cls(dist.HashStore(), big, 2)
    with pytest.raises(ValueError, match=r"^world_size must be in \[1, \d+\], got <an int of 16610 bits>$"):
        cls(dist.HashStore(), 0, big)
    store = dist.HashStore()
    coll = cls(store, 0, 1)
    with pytest.raises(ValueError, match=r"^data must fit in a signed 64-bit integer, got -<an int of 16610 bits>$"):
        coll.all_sum("s", -big)
    assert store.num_keys() == 0
    coll.close()
    env = {"RANK": "9" * 5000, "WORLD_SIZE": "2", "MASTER_ADDR": "x", "MASTER_PORT": "1"}
    with pytest.raises(
        ValueError, match=r"^from_env: RANK must be set to an integer, got '9{20}'\.\.\. \(5000 characters\)$"
    ):
        torch_ctrl.from_env(env=env)


@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "mixed"])
def test_every_duration_takes_an_int_too_large_for_a_float(impl: str) -> None:
    """close()'s and abort_on_error()'s bounds are timeouts like the others: 10**400 means the
    maximum, -10**400 is refused as a negative, naming the parameter."""
    assert to_seconds(10**400) == MAX_TIMEOUT
    coll = make_cls(impl, 0)(dist.HashStore(), 0, 1)
    with pytest.raises(ValueError, match=r"^abort_timeout must be >= 0, got -1000"):
        coll.abort_on_error(-(10**400))
    with coll.abort_on_error(10**400):
        pass
    with pytest.raises(ValueError, match=r"^flush_timeout must be >= 0, got -1000"):
        coll.close(-(10**400))
    coll.close(10**400)  # nothing queued: returns at once


def test_the_docs_say_how_a_rank_with_its_own_heartbeat_interval_is_judged() -> None:
    """By the longer of the reader's own interval and the one the rank declared (the rule of
    docs/protocol.md and both twins), not by the rank's own alone."""
    root = Path(__file__).resolve().parent.parent
    for page in ("README.md", "docs/troubleshooting.md"):
        text = " ".join((root / page).read_text().split())
        assert "is judged by its own" not in text and "it is judged by that." not in text, page
        assert "judged by the longer of" in text, page
