"""Python-written stores with only set, get, add, check and wait (torch's EtcdStore has no
compare_set, delete_key or num_keys): what the ops do instead, in both implementations.
The ops themselves run on such a store in the shared suites (store kind ``basic``)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist
from helpers import BasicStore, CppStoreCollectives, DictStore, make, make_cls, run_ranks

from torch_ctrl import CollectiveAbortedError, CollectiveTimeoutError
from torch_ctrl.lanes import python_methods, store_api

pytestmark = pytest.mark.timeout(60)
WORLD = 4
CLASSES = ["cpp", "python"] if CppStoreCollectives is not None else ["python"]


class _NoWait(dist.Store):
    """A Python store that forgot ``wait`` (and ``check``)."""

    def __init__(self) -> None:
        super().__init__()
        self._inner = BasicStore()
        self.calls = 0

    def set(self, key: str, value: bytes) -> None:
        self.calls += 1
        self._inner.set(key, value)

    def get(self, key: str) -> bytes:
        self.calls += 1
        return self._inner.get(key)

    def add(self, key: str, value: int) -> int:
        self.calls += 1
        return self._inner.add(key, value)


class _SubHash(dist.HashStore):
    """A Python subclass of a torch store: it has every method of that store."""


def test_what_each_kind_of_store_is_taken_to_implement() -> None:
    assert python_methods(dist.HashStore()) is None and store_api(dist.HashStore()) == (True, True)
    assert python_methods(_SubHash()) is None
    assert store_api(DictStore()) == (True, True)
    assert store_api(BasicStore()) == (False, False)
    assert store_api(dist.PrefixStore("p", dist.PrefixStore("q", BasicStore()))) == (False, False)
    assert {"set", "get", "add", "check", "wait"} <= python_methods(BasicStore())


@pytest.mark.parametrize("cls", CLASSES)
def test_a_python_store_without_the_basic_methods_is_a_type_error_before_any_write(cls: str) -> None:
    store = _NoWait()
    for target in (store, dist.PrefixStore("job", store)):
        with pytest.raises(TypeError) as info:
            make_cls(cls, 0)(target, 0, 2)
        text = str(info.value)
        assert "_NoWait" in text and "check, wait" in text and "\n" not in text
    assert store.calls == 0


def test_keys_stay_and_no_cleanup_traffic_is_sent(impl: str) -> None:
    """No delete_key: nothing is deleted, so no rank counts itself out either (no exit keys)."""
    store = BasicStore()

    def fn(rank: int):
        coll = make(impl, store, rank, WORLD)
        for _ in range(3):
            coll.barrier()
            got = coll.broadcast_recv() if rank else coll.broadcast_send(data=b"b")
            total = coll.all_sum(data=rank)
            everyone = coll.all_gather(data=b"%d" % rank)
        coll.close()
        return got, total, everyone

    out = run_ranks(WORLD, fn)
    assert [o[0] for o in out] == [None, b"b", b"b", b"b"]
    assert {o[1] for o in out} == {6} and {tuple(o[2]) for o in out} == {(b"0", b"1", b"2", b"3")}
    names = [k.rsplit("/", 1)[-1] for k in store._data]
    assert "x" not in names  # no exit counts
    assert names.count("d") == 3 * 3  # barrier, broadcast, all_sum: their keys stay


def test_a_timed_out_barrier_names_the_missing_rank_from_numbered_entries(impl: str) -> None:
    store = BasicStore()

    def fn(rank: int):
        if rank == 2:
            return None
        coll = make(impl, store, rank, WORLD)
        with pytest.raises(CollectiveTimeoutError) as info:
            coll.barrier("late", timeout=1.5)
        coll.close()
        return info.value

    errors = [e for e in run_ranks(WORLD, fn) if e is not None]
    for exc in errors:
        assert exc.missing == [2] and exc.arrived == 3, str(exc)
    # Each blocked rank took numbers and wrote its name under them (once when blocked past
    # the grace period, once more at its timeout), and nothing else was written there.
    names = {k: v for k, v in store._data.items() if "/klate/a/" in k}
    count = int(names.pop(next(k for k in names if k.endswith("/a/e"))))
    assert sorted(k.rsplit("/", 1)[-1] for k in names) == [f"e{i}" for i in range(1, count + 1)]
    assert sorted(set(names.values())) == [b"0,", b"1,", b"3,"] and 3 <= count <= 6


def test_the_first_abort_stands_for_every_rank(impl: str) -> None:
    store = BasicStore()
    start = threading.Barrier(WORLD)

    def fn(rank: int):
        coll = make(impl, store, rank, WORLD)
        start.wait()
        if rank in (0, 1):
            coll.abort(f"reason {rank}")
        with pytest.raises(CollectiveAbortedError) as info:
            coll.barrier("b", timeout=30)
        coll.close()
        return info.value.rank, info.value.reason

    seen = run_ranks(WORLD, fn)
    assert len(set(seen)) == 1 and seen[0] in ((0, "reason 0"), (1, "reason 1")), seen


def test_a_closed_rank_is_not_declared_dead_where_its_heartbeat_cannot_be_deleted(impl: str) -> None:
    """Closing brings the heartbeat counter back to 0, which peers read as gone: rank 0 then
    times out waiting for rank 1 rather than aborting the group for a dead rank."""
    store = BasicStore()
    left = make_cls(impl, 1)(store, 1, 2, heartbeat_interval=0.05)
    left.close()
    hb = next(k for k in store._data if k.endswith("/_/hb/1"))
    assert store.get(hb) == b"0"
    stays = make_cls(impl, 0)(store, 0, 2, heartbeat_interval=0.05)
    with pytest.raises(CollectiveTimeoutError):
        stays.barrier("b", timeout=timedelta(seconds=1))  # 8 heartbeat periods: dead would show
    stays.close()


def test_a_names_log_is_read_past_one_entry_per_rank() -> None:
    """A rank appends its name twice at most (past the grace period, at its timeout): a name
    first written as entry N+1 of a world of N is still read."""
    from torch_ctrl.lanes import Lanes

    lanes = Lanes(BasicStore())
    with lanes.lane() as lane:
        for name in (b"0,", b"1,", b"0,", b"1,", b"3,"):
            lane.append("names", name)
        assert lane.peek_log("names", 2 * WORLD) == b"0,1,0,1,3,"


class _SlowNotice(BasicStore):
    """The first abort's notice is written only once a second claimer has looked for it: the
    window between taking the ticket and writing, held open."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.ticket_taken = threading.Event()
        self.looked = threading.Event()

    def set(self, key: str, value: bytes) -> None:
        if self.armed and key.endswith("/_/abort"):
            self.ticket_taken.set()
            assert self.looked.wait(10), "the second claimer never looked"
        BasicStore.set(self, key, value)

    def check(self, keys: list[str]) -> bool:
        found = BasicStore.check(self, keys)
        if self.armed and self.ticket_taken.is_set() and any(k.endswith("/_/abort") for k in keys):
            self.looked.set()
        return found


@pytest.mark.parametrize("prefixed", [False, True], ids=["raw", "prefix"])
@pytest.mark.parametrize("second", CLASSES)
@pytest.mark.parametrize("first", CLASSES)
def test_a_later_claimer_waits_for_the_first_notice(first: str, second: str, prefixed: bool) -> None:
    """Without compare_set the first to take the abort ticket writes the notice just after; a
    second caller that looks in between waits for it rather than keeping its own reason, so
    every rank reports the same abort (on the store itself and under a PrefixStore)."""
    store = _SlowNotice()
    target = dist.PrefixStore("job", store) if prefixed else store
    a = make_cls(first, 0)(target, 0, 2)
    b = make_cls(second, 1)(target, 1, 2)
    store.armed = True

    def second_abort() -> None:
        assert store.ticket_taken.wait(10)
        b.abort("reason 1")

    t = threading.Thread(target=second_abort)
    t.start()
    a.abort("reason 0")
    t.join(20)
    for coll in (a, b):
        with pytest.raises(CollectiveAbortedError) as info:
            coll.barrier("b", timeout=5)
        assert (info.value.rank, info.value.reason) == (0, "reason 0")
        coll.close()
