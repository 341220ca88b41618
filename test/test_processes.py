"""Real processes: FileStore shared by separate processes, TCPStore ranks as spawned processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch.distributed as dist
from helpers import IMPLS, scratch

WORLD = 3


def _rank_main(store_spec: tuple, impl: str, rank: int, queue) -> None:  # noqa: ANN001
    import torch.distributed as dist
    from helpers import make

    kind, arg = store_spec
    if kind in ("file", "prefix_file"):
        store = dist.FileStore(arg, -1)
    else:
        store = dist.TCPStore("127.0.0.1", arg, is_master=False)
    if kind == "prefix_file":  # what init_process_group("file://...") hands out
        store = dist.PrefixStore("default_pg", store)
    try:
        coll = make(impl, store, rank, WORLD)
        coll.barrier("start", 60)
        got = coll.all_gather("ag", f"p{rank}:{os.getpid()}", 60)
        total = coll.all_sum("sum", rank + 1, 60)
        if rank == 0:
            coll.broadcast_send("bc", b"hello", 60)
            bc = b"hello"
            gathered = coll.gather_recv("g", b"g0", 60)
            mine = coll.scatter_send("s", [b"s0", b"s1", b"s2"], 60)
        else:
            bc = coll.broadcast_recv("bc", 60)
            coll.gather_send("g", b"g%d" % rank, 60)
            gathered = None
            mine = coll.scatter_recv("s", 60)
        coll.barrier("end", 60)
        coll.close()
        pids = {x.decode().split(":")[1] for x in got}
        queue.put((rank, len(pids), total, bc, gathered, mine, None))
    except Exception as exc:  # noqa: BLE001
        queue.put((rank, 0, 0, b"", None, b"", repr(exc)))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["file", "prefix_file", "tcp"])
def test_separate_processes(impl: str, kind: str) -> None:
    ctx = mp.get_context("spawn")
    server = None
    if kind in ("file", "prefix_file"):
        fd, path = tempfile.mkstemp(prefix="filestore_", dir=scratch())
        os.close(fd)
        os.unlink(path)
        spec = (kind, path)
    else:
        server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        spec = ("tcp", server.port)
    queue = ctx.Queue()
    env_path = os.path.dirname(__file__)
    old = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = env_path + (os.pathsep + old if old else "")
    try:
        procs = [ctx.Process(target=_rank_main, args=(spec, impl, r, queue)) for r in range(WORLD)]
        for p in procs:
            p.start()
        results = sorted(queue.get(timeout=150) for _ in range(WORLD))
        for p in procs:
            p.join(30)
    finally:
        os.environ["PYTHONPATH"] = old
    for rank, npids, total, bc, _gathered, mine, err in results:
        assert err is None, err
        assert npids == WORLD  # three distinct processes took part
        assert total == 6 and bc == b"hello" and mine == b"s%d" % rank
    assert results[0][4] == [b"g0", b"g1", b"g2"]
    if server is not None:
        assert server.num_keys() <= 2


def test_unclosed_instances_exit_cleanly() -> None:
    """Instances never closed, watcher threads busy: the interpreter still exits with 0."""
    code = textwrap.dedent(
        """
        import threading, torch.distributed as dist, torch_ctrl
        from torch_ctrl import PyStoreCollectives
        server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        def rank(c):
            for i in range(30):
                c.all_gather(None, b"x", 30)
        for cls in {classes}:
            # made on this thread: torch 2.6-2.7 abort when threads construct clients at once
            cs = [cls(dist.TCPStore("127.0.0.1", server.port, is_master=False), r, 2) for r in range(2)]
            ts = [threading.Thread(target=rank, args=(c,)) for c in cs]
            [t.start() for t in ts]; [t.join() for t in ts]
        print("done")
        """
    ).format(classes="[PyStoreCollectives, torch_ctrl.StoreCollectives]")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "done"
    assert "terminate called" not in out.stderr


assert IMPLS
