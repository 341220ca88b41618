"""Collectives over torch's own EtcdStore, on a real etcd server (v2 API, what python-etcd
and torch's EtcdStore speak). EtcdStore defines set, get, add, check and wait only: no
compare_set, no delete_key, no num_keys (see test_basic_stores for what the ops do instead).

Needs the ``etcd`` binary (Debian package ``etcd-server``) and the ``python-etcd`` package;
``.ci/run`` installs both."""

from __future__ import annotations

import base64
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist
from helpers import CppStoreCollectives, make, make_cls, run_ranks, torchrun_two_nodes

from torch_ctrl import CollectiveAbortedError, CollectiveTimeoutError
from torch_ctrl import keys as K

if os.environ.get("TORCH_CTRL_REQUIRE_ETCD"):  # CI: these tests must run, not skip
    import etcd

    assert shutil.which("etcd"), "TORCH_CTRL_REQUIRE_ETCD is set but the etcd binary is not installed"
else:
    etcd = pytest.importorskip("etcd", reason="python-etcd is not installed")
    if shutil.which("etcd") is None:
        pytest.skip("the etcd server binary is not installed (Debian: etcd-server)", allow_module_level=True)

from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore  # noqa: E402

pytestmark = pytest.mark.timeout(120)
WORLD = 4
CLASSES = ["cpp", "python"] if CppStoreCollectives is not None else ["python"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def etcd_port() -> Iterator[int]:
    """One etcd server for the module, its data in a temporary directory."""
    data = tempfile.mkdtemp(prefix="torch_ctrl_etcd_")
    client, peer = _free_port(), _free_port()
    c_url, p_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    proc = subprocess.Popen(
        ["etcd", "--enable-v2", "--data-dir", data, "--listen-client-urls", c_url, "--advertise-client-urls", c_url,
         "--listen-peer-urls", p_url, "--initial-advertise-peer-urls", p_url,
         "--initial-cluster", f"default={p_url}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                etcd.Client(host="127.0.0.1", port=client).version  # noqa: B018 - a request
                break
            except Exception:  # noqa: BLE001 - not up yet
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("etcd did not start") from None
                time.sleep(0.05)
        yield client
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(data, ignore_errors=True)


def _stores(port: int, namespace: str) -> list[dist.Store]:
    """One EtcdStore per rank, each with its own etcd client (as separate hosts would have)."""
    return [
        EtcdStore(etcd.Client(host="127.0.0.1", port=port), f"/torch_ctrl_test/{namespace}", timedelta(seconds=60))
        for _ in range(WORLD)
    ]


@pytest.mark.parametrize("prefixed", [False, True], ids=["etcd", "prefix-over-etcd"])
def test_every_op_on_etcd(etcd_port: int, impl: str, prefixed: bool) -> None:
    etcd_stores = _stores(etcd_port, f"ops-{impl}-{prefixed}")  # referenced: see the next test
    stores = [dist.PrefixStore("job", s) for s in etcd_stores] if prefixed else etcd_stores

    def fn(rank: int):
        coll = make(impl, stores[rank], rank, WORLD)
        out = []
        for i in range(2):
            coll.barrier()
            out.append(coll.broadcast_recv() if rank else coll.broadcast_send(data=b"cfg%d" % i))
            out.append(coll.gather_recv(data=b"0") if rank == 0 else coll.gather_send(data=b"%d" % rank))
            out.append(coll.scatter_send(data=[b"s%d" % r for r in range(WORLD)]) if rank == 0 else coll.scatter_recv())
            out.append(coll.all_gather(data=b"%d" % rank))
            out.append(coll.all_sum(data=rank + 1))
        coll.close()
        return out

    out = run_ranks(WORLD, fn, timeout=100)
    for i in range(2):
        at = 5 * i
        assert [o[at] for o in out] == [None] + [b"cfg%d" % i] * 3
        assert out[0][at + 1] == [b"0", b"1", b"2", b"3"]
        assert [o[at + 2] for o in out] == [b"s0", b"s1", b"s2", b"s3"]
        assert {tuple(o[at + 3]) for o in out} == {(b"0", b"1", b"2", b"3")}
        assert {o[at + 4] for o in out} == {10}


@pytest.mark.parametrize("cls", CLASSES)
def test_a_prefix_store_over_an_etcd_store_nobody_holds_is_a_type_error(etcd_port: int, cls: str) -> None:
    """torch keeps a Python-written store's methods only while its Python object lives: a
    PrefixStore over a dropped EtcdStore holds a bare Store, and every call on it fails."""
    orphan = dist.PrefixStore("job", _stores(etcd_port, "orphan")[0])
    with pytest.raises(TypeError, match="bare torch.distributed.Store.*keep a reference"):
        make_cls(cls, 0)(orphan, 0, 2)


def test_a_timeout_on_etcd_names_the_missing_rank(etcd_port: int, impl: str) -> None:
    stores = _stores(etcd_port, f"timeout-{impl}")

    def fn(rank: int):
        if rank == 1:
            return None
        coll = make(impl, stores[rank], rank, WORLD)
        with pytest.raises(CollectiveTimeoutError) as info:
            coll.all_gather("late", b"x", timeout=2)
        coll.close()
        return info.value

    for exc in [e for e in run_ranks(WORLD, fn, timeout=100) if e is not None]:
        assert exc.missing == [1] and exc.arrived == 3, str(exc)
        assert isinstance(exc, dist.DistStoreError) and "\n" not in str(exc)


def test_an_abort_on_etcd_wakes_the_blocked_ranks(etcd_port: int, impl: str) -> None:
    stores = _stores(etcd_port, f"abort-{impl}")

    def fn(rank: int):
        coll = make(impl, stores[rank], rank, WORLD)
        coll.barrier("ready", timeout=60)
        if rank == 3:
            coll.abort("bad shard")
            coll.close()
            return None
        start = time.monotonic()
        with pytest.raises(CollectiveAbortedError) as info:
            coll.barrier("never", timeout=60)
        coll.close()
        return time.monotonic() - start, info.value

    for took, exc in [o for o in run_ranks(WORLD, fn, timeout=100) if o is not None]:
        assert exc.rank == 3 and exc.reason == "bad shard"
        assert took < 5, took  # not the op's 60 s


@pytest.mark.timeout(240)
@pytest.mark.parametrize("launcher", ["torch_ctrl.run", "torchrun"])
def test_a_torchrun_job_on_the_etcd_rendezvous(etcd_port: int, launcher: str) -> None:
    """torchrun's ``etcd`` rendezvous hands the agents an EtcdStore: with torch_ctrl's adapter
    and agent hooks (``python -m torch_ctrl.run``) the agents' rank assignment and exit barrier
    run as torch_ctrl collectives on it; the workers take ``from_env()`` either way."""
    run_id = f"etcd-{launcher}"
    nodes = torchrun_two_nodes(
        ["collectives"],
        backend="etcd",
        endpoint=f"127.0.0.1:{etcd_port}",
        run_id=run_id,
        launcher=("-m", launcher if launcher == "torch_ctrl.run" else "torch.distributed.run"),
    )
    for node in nodes:
        assert node.returncode == 0, node.output
    lines = [m for node in nodes for m in re.findall(r"WORKER OK rank=(\d)", node.output)]
    assert sorted(lines) == ["0", "1", "2", "3"]
    # The agents' exit barrier ran as a torch_ctrl barrier on the EtcdStore (its keys stay
    # there), and only with torch_ctrl's launcher.
    ours = [k for k in _agent_store_keys(etcd_port, run_id) if f"{K.PROTOCOL}/w2/kexit" in k]
    assert bool(ours) == (launcher == "torch_ctrl.run"), ours


def _agent_store_keys(port: int, run_id: str) -> list[str]:
    """The keys of the agents' EtcdStore(s) of job ``run_id`` (torch's etcd rendezvous puts
    them under ``/torchelastic/p2p/run_{run_id}/rdzv/v_{n}/kv/`` as base64, which may itself
    contain ``/``)."""
    client = etcd.Client(host="127.0.0.1", port=port)
    found = []
    for leaf in client.read(f"/torchelastic/p2p/run_{run_id}", recursive=True).leaves:
        at = leaf.key.find("/kv/")
        if at >= 0 and not leaf.dir:
            found.append(base64.b64decode(leaf.key[at + 4 :]).decode())
    return found
