"""Failure paths that must not make things worse: abort_on_error with the store down, abort
reasons of any size, duck-typed stores under ``torch_ctrl.elastic.install()``, and the test
suite's own guard against reverse-lookup stalls."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
import torch.distributed as dist
from helpers import HOST, IMPLS, Stores, make, run_ranks

import torch_ctrl.elastic as elastic
from torch_ctrl import CollectiveAbortedError
from torch_ctrl.base import MAX_REASON_BYTES, check_reason
from torch_ctrl.elastic import store as store_util

# ----------------------------------------------------------------------------- abort_on_error

_SERVER = (
    "import sys, torch.distributed as dist\n"
    "s = dist.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
    "print(s.port, flush=True)\n"
    "sys.stdin.read()\n"  # serve until killed
)


class RemoteServer:
    """A TCPStore server in a process of its own, so the test can take it down for good."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("lanes", ["fresh", "used"])
def test_abort_on_error_reraises_the_callers_exception_when_the_store_is_down(
    impl: str, lanes: str, caplog: pytest.LogCaptureFixture
) -> None:
    """With the store gone, the abort fails at once (its open connection is dead, or the
    server's address refuses a new one); were it slower (a host that does not answer), the
    abort's bound (2 s) holds: either way the block's own exception comes out unchanged, and
    the failure is logged and noted."""
    server = RemoteServer()
    try:
        store = dist.TCPStore(HOST, server.port, is_master=False, timeout=timedelta(seconds=10))
        coll = make(impl, store, 0, 2)
        if lanes == "used":
            coll.barrier("arrive", 10, block=False)  # a collective: the instance's connections exist
    finally:
        server.kill()
    mine = KeyError("missing shard 7")
    start = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="torch_ctrl"):
            with pytest.raises(KeyError) as info:
                with coll.abort_on_error():
                    raise mine
        took = time.monotonic() - start
    finally:
        # Stop the instance's watcher now: left to a later collection, it would go on dialing
        # the dead server's port, which a later test's server may have taken by then (its
        # cleanup would then reach that test's store, whose keys may have the same names).
        coll.close(flush_timeout=0)
    assert info.value is mine and info.value.args == ("missing shard 7",)
    assert info.value.__context__ is None and info.value.__cause__ is None  # no store error chained
    assert took < 2.0 + 1.5, took  # the bound, plus scheduling on a loaded machine
    assert "the group was not aborted after KeyError" in caplog.text
    if sys.version_info >= (3, 11):
        assert any("the group was not aborted" in n for n in info.value.__notes__)


def test_abort_on_error_bound_is_configurable_and_checked(impl: str) -> None:
    coll = make(impl, dist.HashStore(), 0, 2)
    with pytest.raises(TypeError):
        with coll.abort_on_error(abort_timeout="soon"):  # type: ignore[arg-type]
            pass
    with pytest.raises(OSError, match="disk full"):
        with coll.abort_on_error(abort_timeout=timedelta(seconds=5)):
            raise OSError("disk full")
    with pytest.raises(CollectiveAbortedError, match="group aborted by rank 0: OSError: disk full"):
        coll.barrier("after")
    coll.close()


@pytest.mark.parametrize(
    "bound, exc, message",
    [
        ("soon", TypeError, "abort_timeout must be a timedelta or seconds, got str"),
        (None, TypeError, "abort_timeout must be a timedelta or seconds, got NoneType"),
        (-1, ValueError, "abort_timeout must be >= 0, got -1"),
        (
            timedelta(seconds=-1),
            ValueError,
            "abort_timeout must be >= 0, got datetime.timedelta(days=-1, seconds=86399)",
        ),
    ],
)
def test_abort_on_error_checks_its_bound_at_the_call_and_names_it(
    impl: str, bound: object, exc: type, message: str
) -> None:
    """Refused where it is written (not when the block is entered), naming ``abort_timeout``
    (not "timeout", a parameter it does not have), in both twins."""
    coll = make(impl, dist.HashStore(), 0, 2)
    with pytest.raises(exc) as info:
        coll.abort_on_error(bound)  # type: ignore[arg-type]
    assert str(info.value) == message
    coll.close()


def test_abort_on_error_when_the_backend_cannot_abort() -> None:
    """A ControlCollectives without abort(): the caller's exception, not NotImplementedError."""
    from torch_ctrl import ControlCollectives

    methods = {name: (lambda self, *a, **k: None) for name in ControlCollectives.__abstractmethods__}
    no_abort = type("NoAbort", (ControlCollectives,), methods)()
    with pytest.raises(ValueError, match="bad plan") as info:
        with no_abort.abort_on_error():
            raise ValueError("bad plan")
    assert info.value.__context__ is None


def test_abort_on_error_with_a_healthy_store_aborts_before_reraising(impl: str) -> None:
    """The success of the abort is not traded away: it has landed when the exception leaves."""
    stores = Stores("tcp")
    coll = make(impl, stores.client(0), 0, 2)
    with pytest.raises(RuntimeError):
        with coll.abort_on_error():
            raise RuntimeError("first line\nsecond line")
    peer = make(impl, stores.client(1), 1, 2)
    with pytest.raises(CollectiveAbortedError) as info:
        peer.barrier("b", 10)
    assert info.value.rank == 0 and info.value.reason == "RuntimeError: first line"
    coll.close()
    peer.close()


# ----------------------------------------------------------------------------- abort reasons


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [MAX_REASON_BYTES + 1, 9 << 20, 16 << 20])
def test_abort_reason_of_any_size_aborts_the_group(impl: str, size: int) -> None:
    """TCPStore cannot carry a value over 8 MiB: reasons are cut to MAX_REASON_BYTES (marker
    included) before they are written, the same way by both implementations."""
    stores = Stores("tcp")
    reason = ("x" * 100 + "\n") * (size // 101) + "y" * (size % 101)
    assert len(reason) == size

    def fn(rank: int) -> CollectiveAbortedError | None:
        coll = make(impl, stores.client(rank), rank, 2)
        try:
            if rank == 0:
                coll.abort(reason)
                return None
            with pytest.raises(CollectiveAbortedError) as info:
                coll.barrier("b", 30)
            return info.value
        finally:
            coll.close()

    exc = run_ranks(2, fn)[1]  # mixed: rank 0 (C++) aborts, rank 1 (Python) reads
    assert exc.rank == 0
    assert len(exc.reason.encode()) <= MAX_REASON_BYTES
    assert exc.reason.endswith(f" [truncated from {size} bytes]")
    assert reason.startswith(exc.reason[: -len(f" [truncated from {size} bytes]")])


@pytest.mark.parametrize("impl_name", IMPLS)
def test_abort_reason_is_cut_at_a_character_boundary_identically(impl_name: str) -> None:
    """Multi-byte text cut in the middle of a character, and text that is not valid UTF-8:
    what peers read is exactly check_reason(reason), whichever implementation aborted."""
    for reason in ["é" * 3000, "ok \udcff surrogate", "€" * 1366 + "tail"]:
        stores = Stores("hash")
        make(impl_name, stores.client(0), 0, 2).abort(reason)
        with pytest.raises(CollectiveAbortedError) as info:
            make("python", stores.client(1), 1, 2).barrier("b", 10)
        expected = check_reason(reason)
        assert info.value.reason == expected
        assert len(expected.encode("utf-8")) <= MAX_REASON_BYTES
    assert check_reason("short") == "short"
    with pytest.raises(TypeError):
        check_reason(b"bytes")


# ----------------------------------------------------------------------------- error text


def test_a_timeout_with_every_rank_arrived_says_where_the_time_went() -> None:
    """Seen when a stalled connect ate the deadline: "2/2 ranks arrived" alone contradicts
    "timed out"; the text names the possible causes (both twins build it here)."""
    from torch_ctrl.errors import timeout_error

    exc = timeout_error("all_sum", "s0", 5, 2, arrived=2, missing=[])
    text = str(exc)
    assert text.startswith("all_sum 's0' timed out after 5s: 2/2 ranks arrived, but this rank did not finish")
    assert "store calls stalled" in text and "\n" not in text
    assert (exc.arrived, exc.world_size, exc.missing) == (2, 2, [])
    assert str(timeout_error("barrier", "b", 5, 4, arrived=3, missing=[2])) == (
        "barrier 'b' timed out after 5s: 3/4 ranks arrived; missing ranks: [2]"
    )


def test_a_rank_counted_but_not_yet_named_is_told_apart() -> None:
    """A barrier counts arrivals on its counter and names them in a later append: a rank with a
    slow store is counted before its name lands. "2/3 ranks arrived; missing ranks: [0, 2]"
    alone contradicts itself; the text says one of the listed ranks did arrive."""
    from torch_ctrl.errors import timeout_error

    exc = timeout_error("barrier", "k", 4, 3, arrived=2, missing=[0, 2])
    assert str(exc) == (
        "barrier 'k' timed out after 4s: 2/3 ranks arrived; missing ranks: [0, 2] (1 of them arrived"
        " but did not name itself in time: slow store calls or a stalled process)"
    )
    assert (exc.arrived, exc.missing) == (2, [0, 2])
    assert "2 of them arrived but did not name themselves" in str(
        timeout_error("barrier", "k", 4, 5, arrived=4, missing=[0, 1, 3])
    )


# ----------------------------------------------------------------------------- duck-typed stores


class MockStore:
    """A store by duck typing, like the mocks of torch's own tests: records every call."""

    def __init__(self) -> None:
        self.ops: list[tuple[Any, ...]] = []
        self.data: dict[str, bytes] = {}
        self._timeout = timedelta(seconds=1234)

    @property
    def timeout(self) -> timedelta:
        return self._timeout

    def set_timeout(self, timeout: timedelta) -> None:
        self.ops.append(("set_timeout", timeout))
        self._timeout = timeout

    def set(self, key: str, value: Any) -> None:
        self.ops.append(("set", key))
        self.data[key] = value.encode() if isinstance(value, str) else bytes(value)

    def get(self, key: str) -> bytes:
        self.ops.append(("get", key))
        return self.data[key]

    def add(self, key: str, value: int) -> int:
        self.ops.append(("add", key, value))
        new = int(self.data.get(key, b"0")) + value
        self.data[key] = str(new).encode()
        return new

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.ops.append(("multi_get", tuple(keys)))
        return [self.data[k] for k in keys]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.ops.append(("wait", tuple(keys)))
        missing = [k for k in keys if k not in self.data]
        if missing:
            raise dist.DistStoreError(f"wait timeout: {missing}")


def _exercise(store_module: Any, distributed_module: Any) -> list[Any]:
    """Every public function of torch's utils/store.py on a one-rank job of duck-typed stores,
    called the way torch's callers call them; returns the results and every store's calls."""
    out: list[Any] = []
    s = MockStore()
    s.set("addr/0", b"a0")
    out.append(store_module.get_all(s, 0, "addr/", 1))
    out.append(store_module.synchronize(s, b"mine", 0, 1, "sync", timeout=7))
    store_module.barrier(s, 1, "b1", barrier_timeout=5, rank=0)
    store_module.barrier(s, 1, "b2")
    distributed_module.barrier(s, 1, "b3")  # imported by name into another torch module
    with store_module.store_timeout(s, 3):
        out.append(s.timeout)
    out.append(s.timeout)
    out.append(s.ops)
    magic = mock.MagicMock()
    store_module.get_all(magic, 1, "test/store", 3)
    out.append([c for c in magic.mock_calls if not c[0].startswith("multi_get().")])
    return out


def test_duck_typed_stores_behave_as_in_torch_after_install() -> None:
    import importlib

    torch_store = importlib.import_module("torch.distributed.elastic.utils.store")
    torch_distributed = importlib.import_module("torch.distributed.elastic.utils.distributed")
    assert not elastic.is_installed()
    expected = _exercise(torch_store, torch_distributed)
    with elastic.installed():
        assert torch_store.barrier is store_util.barrier
        assert _exercise(torch_store, torch_distributed) == expected
        # a real store still takes torch_ctrl's path (no torch keys such as .../num_members)
        hash_store = dist.HashStore()
        torch_store.barrier(hash_store, 1, "real", barrier_timeout=5, rank=0)
        assert hash_store.num_keys() == 0
    assert _exercise(store_util, torch_distributed) == expected  # the adapter called directly


def test_duck_typed_barrier_timeout_is_torchs_error() -> None:
    with elastic.installed():
        import torch.distributed.elastic.utils.store as torch_store

        with pytest.raises(dist.DistStoreError, match="wait timeout"):
            torch_store.barrier(MockStore(), 2, "lonely", barrier_timeout=0.1)


# ----------------------------------------------------------------------------- reverse lookups


def test_test_processes_cap_reverse_lookup_stalls() -> None:
    """The suite's processes (and those they start) resolve with a 1 s cap, and CI does not
    edit /etc/hosts to get there."""
    assert "timeout:1" in os.environ.get("RES_OPTIONS", "") and "attempts:1" in os.environ["RES_OPTIONS"]
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.environ.get('RES_OPTIONS', ''))"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert child.stdout.strip() == os.environ["RES_OPTIONS"]
    ci = open(os.path.join(os.path.dirname(__file__), "..", ".ci", "run")).read()
    assert "/etc/hosts" not in "".join(line for line in ci.splitlines() if not line.lstrip().startswith("#"))


_STALL_PROBE = (
    "import socket, time\n"
    "t = time.monotonic()\n"
    "try:\n"
    "    socket.getnameinfo(('::ffff:127.0.0.1', 80), 0)\n"
    "except OSError:\n"
    "    pass\n"
    "lookup = time.monotonic() - t\n"
    "import torch.distributed as dist\n"
    "t = time.monotonic()\n"
    "server = dist.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
    "client = dist.TCPStore('127.0.0.1', server.port, is_master=False)\n"
    "client.set('k', 'v')\n"
    "print(lookup, time.monotonic() - t)\n"
)


@pytest.mark.timeout(120)
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_tcpstore_under_a_resolver_that_drops_queries(tmp_path: Any) -> None:
    """A resolver that never answers (a UDP socket that swallows queries, made the name server
    in a private mount namespace): a test process's TCPStore server and client come up within
    the capped lookup (about 1 s), not glibc's default 2 x 5 s."""
    hole = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for last in range(2, 250):  # any free 127.53.0.x:53
        try:
            hole.bind((f"127.53.0.{last}", 53))
            break
        except OSError:
            continue
    else:
        pytest.skip("no free loopback address for a name server")
    resolv = tmp_path / "resolv.conf"
    resolv.write_text(f"nameserver {hole.getsockname()[0]}\n")
    script = f'mount --bind {resolv} /etc/resolv.conf && exec {sys.executable} -c "$PROBE"'
    try:
        proc = subprocess.run(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
            env={**os.environ, "PROBE": _STALL_PROBE},
            capture_output=True,
            text=True,
            timeout=90,
        )
    finally:
        hole.close()
    if proc.returncode != 0 and "mount" in proc.stderr and not proc.stdout:
        pytest.skip(f"no private mount namespace here: {proc.stderr.strip()[:200]}")
    lookup, connect = (float(x) for x in proc.stdout.split())
    assert lookup >= 0.9, "the name server answered: the stall was not simulated"
    assert connect < 6.0, connect  # a 1 s capped stall or two, plus a loaded machine; 10 s without the cap
