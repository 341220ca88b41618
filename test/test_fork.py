"""An instance used in a forked child (os.fork, multiprocessing's fork start method) raises
at once with one line, its close() returns at once, and a new instance made in the child
works; the parent's instance is unaffected."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import subprocess
import sys
import time

import pytest
import torch.distributed as dist
from helpers import HOST, IMPLS, make

from torch_ctrl.errors import CollectiveError

IMPL_LIST = [i for i in IMPLS if i != "mixed"]


def _child(impl: str, coll, path: str, out) -> None:  # noqa: ANN001
    """In the child: the inherited instance fails fast, closes fast, a new one works (over a
    FileStore: a TCPStore client made in a child forked from a process with threads in c10d
    can hang in torch itself)."""
    started = time.monotonic()
    try:
        coll.barrier("inherited", timeout=30)
        out.put(("no error", 0.0))
    except CollectiveError as exc:
        out.put((str(exc), time.monotonic() - started))
    started = time.monotonic()
    coll.close()
    out.put(("closed", time.monotonic() - started))
    fresh = make(impl, dist.FileStore(path, -1), 1, 2)
    out.put(("sum", fresh.all_sum("after-fork", 2, timeout=30)))
    fresh.close()
    out.close()
    out.join_thread()  # os._exit() would drop what the queue's feeder thread has not sent yet


# The TCPStore server runs in a process of its own: its thread resolves the name of every new
# connection, and a child forked while that thread holds glibc's resolver lock deadlocks when
# one of its own threads ends (torch's hazard; torch_ctrl's own connections hold fork() off).
_SERVER = (
    "import sys, torch.distributed as dist\n"
    "s = dist.TCPStore(sys.argv[1], 0, is_master=True, wait_for_workers=False)\n"
    "print(s.port, flush=True)\n"
    "sys.stdin.read()\n"
)


def _client(store: str, port: int) -> dist.Store:
    """A raw TCPStore client, or a PrefixStore over one (what torchrun and from_env() hand out)."""
    client = dist.TCPStore(HOST, port, is_master=False)
    return dist.PrefixStore("job/", client) if store == "prefix" else client


def _check(impl: str, run_child, path: str, store: str) -> None:  # noqa: ANN001
    with subprocess.Popen(
        [sys.executable, "-c", _SERVER, HOST], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as server:
        try:
            assert server.stdout is not None
            _check_with(impl, run_child, path, int(server.stdout.readline()), store)
        finally:
            server.kill()


def _check_with(impl: str, run_child, path: str, port: int, store: str) -> None:  # noqa: ANN001
    parent = make(impl, _client(store, port), 0, 2)
    peer = make(impl, _client(store, port), 1, 2)
    # Used before the fork, so lanes and the watcher thread exist and are inherited.
    from helpers import run_ranks

    assert run_ranks(2, lambda r: (parent, peer)[r].all_sum("before", 1, timeout=30)) == [2, 2]
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    # Garbage of earlier tests (TCPStore servers in reference cycles, say) is collected here,
    # where its threads exist: collected in the child, a destructor joining a thread that only
    # exists in the parent crashes it (seen once in CI: a segfault in the child's first gc).
    gc.collect()
    run_child(lambda: _child(impl, parent, path, out))
    message, took = out.get(timeout=60)
    assert "cannot be used in the forked child" in message and "\n" not in message, message
    assert took < 1.0
    kind, took = out.get(timeout=60)
    assert kind == "closed" and took < 1.0
    mine = make(impl, dist.FileStore(path, -1), 0, 2)
    assert mine.all_sum("after-fork", 1, timeout=30) == 3
    assert out.get(timeout=60) == ("sum", 3)
    mine.close()
    # the parent's instance still works
    got = run_ranks(2, lambda r: (parent, peer)[r].all_gather("parent-ok", b"%d" % r, timeout=30))
    assert got == [[b"0", b"1"]] * 2
    parent.close()
    peer.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("store", ["raw", "prefix"])
@pytest.mark.parametrize("impl", IMPL_LIST)
def test_multiprocessing_fork_child(impl: str, store: str, tmp_path) -> None:  # noqa: ANN001
    def run(body) -> None:  # noqa: ANN001
        proc = mp.get_context("fork").Process(target=body)
        proc.start()
        _check.procs.append(proc)

    _check.procs = []  # type: ignore[attr-defined]
    _check(impl, run, str(tmp_path / "store"), store)
    for proc in _check.procs:  # type: ignore[attr-defined]
        proc.join(60)
        assert proc.exitcode == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("store", ["raw", "prefix"])
@pytest.mark.parametrize("impl", IMPL_LIST)
def test_os_fork_child(impl: str, store: str, tmp_path) -> None:  # noqa: ANN001
    pids = []

    def run(body) -> None:  # noqa: ANN001
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                body()
                code = 0
            except BaseException:  # noqa: BLE001 - the parent sees only the exit code: say why
                import traceback

                traceback.print_exc()
            finally:
                os._exit(code)
        pids.append(pid)

    _check(impl, run, str(tmp_path / "store"), store)
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
