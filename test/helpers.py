"""Shared test fixtures: real stores (one client per rank), implementations, and
a runner that executes one function per rank on its own thread."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

import torch_ctrl
from torch_ctrl import PyStoreCollectives, lanes

# The C++ implementation where the extension is usable with this torch (the loader's checks);
# on a pure-Python install the suite runs the Python implementation alone.
CppStoreCollectives = torch_ctrl.StoreCollectives if torch_ctrl.backend() == "cpp" else None

HOST = "127.0.0.1"
# torch 2.6 constructs a Python TCPStore without holding the GIL, pybind11's registration of
# the new object included: any torch object made or freed by another thread meanwhile (a store,
# an instance of ours) can corrupt pybind11's registry, and the process aborts later ("Tried to
# deallocate unregistered instance"). Test threads therefore make their clients, and make and
# free their instances, in the process's turn (lanes.turn(): the lock torch_ctrl's own lanes
# take to construct clients on torches without clone()); elsewhere they run concurrently, as
# users' threads do. _CONNECT is that lock, for tests that take it around more.
_CONNECT = lanes._CONNECT


class DictStore(dist.Store):
    """A Python-written store with the basic API, compare_set, delete_key and num_keys:
    thread safe."""

    def __init__(self) -> None:
        super().__init__()
        self._data: dict[str, bytes] = {}
        self._cv = threading.Condition()

    def set(self, key: str, value: Any) -> None:
        with self._cv:
            self._data[key] = value.encode() if isinstance(value, str) else bytes(value)
            self._cv.notify_all()

    def get(self, key: str) -> bytes:
        self.wait([key], timedelta(seconds=300))
        with self._cv:
            return self._data[key]

    def add(self, key: str, value: int) -> int:
        with self._cv:
            new = int(self._data.get(key, b"0")) + value
            self._data[key] = str(new).encode()
            self._cv.notify_all()
            return new

    def check(self, keys: list[str]) -> bool:
        with self._cv:
            return all(k in self._data for k in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        secs = 300.0 if timeout is None else timeout.total_seconds()
        with self._cv:
            if not self._cv.wait_for(lambda: all(k in self._data for k in keys), secs):
                raise dist.DistStoreError(f"wait timeout after {secs}s, keys: {keys}")

    def delete_key(self, key: str) -> bool:
        with self._cv:
            return self._data.pop(key, None) is not None

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        expected = expected.encode() if isinstance(expected, str) else bytes(expected)
        desired = desired.encode() if isinstance(desired, str) else bytes(desired)
        with self._cv:
            if key not in self._data:
                if expected == b"":
                    self._data[key] = desired
                    self._cv.notify_all()
                    return desired
                return expected
            if self._data[key] == expected:
                self._data[key] = desired
                self._cv.notify_all()
                return desired
            return self._data[key]

    def num_keys(self) -> int:
        with self._cv:
            return len(self._data)


class ListingStore(DictStore):
    """A :class:`DictStore` that also lists its keys (``list_keys``), counting the calls."""

    def __init__(self) -> None:
        super().__init__()
        self.listed = 0

    def list_keys(self) -> list[str]:
        with self._cv:
            self.listed += 1
            return list(self._data)


class BasicStore(dist.Store):
    """A Python-written store with the methods torch's EtcdStore defines (set, get, add,
    check, wait), so no compare_set and no delete_key. ``num_keys`` is there for the tests
    only (collectives never call it: test_etcd runs them on torch's EtcdStore itself)."""

    def __init__(self) -> None:
        super().__init__()
        self._data: dict[str, bytes] = {}
        self._cv = threading.Condition()

    set = DictStore.set
    get = DictStore.get
    add = DictStore.add
    check = DictStore.check
    wait = DictStore.wait

    def num_keys(self) -> int:
        with self._cv:
            return len(self._data)


def scratch() -> str | None:
    """The test session's scratch directory (conftest removes it at exit), else the system's."""
    return os.environ.get("TORCH_CTRL_TEST_SCRATCH")


class Stores:
    """A family of store handles on one backing store: ``client(rank)`` and ``admin``."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._cleanup: list[Callable[[], None]] = []
        if kind in ("tcp", "tcp_nolibuv", "prefix", "prefix_nested"):
            libuv = kind != "tcp_nolibuv"
            self.server = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, use_libuv=libuv)
            self.port = self.server.port
        elif kind in ("file", "prefix_file"):
            fd, self.path = tempfile.mkstemp(prefix="filestore_", dir=scratch())
            os.close(fd)
            os.unlink(self.path)
            self._keep = dist.FileStore(self.path, -1)
        elif kind == "hash":
            self._shared: dist.Store = dist.HashStore()
        elif kind in ("python", "prefix_python"):
            self._shared = DictStore()
        elif kind in ("listing", "prefix_listing"):  # not in STORE_KINDS: the tests of naming
            self._shared = ListingStore()
        elif kind == "basic":
            self._shared = BasicStore()
        else:
            raise ValueError(kind)
        # A PrefixStore cannot count a Python store's keys (torch's binding: "pure virtual"), and
        # num_keys counts every key below any prefix anyway: the admin of prefix_python is the store.
        self.admin = self._shared if kind in ("prefix_python", "prefix_listing") else self.client(-1)

    def client(self, rank: int, port: int | None = None) -> dist.Store:
        """A store handle for one rank (its own connection where the kind has them), through
        ``port`` (a :class:`Gate`'s) if given. Made one at a time: torch 2.6 aborts when
        threads construct TCPStore clients concurrently."""
        with _CONNECT:
            return self._client(rank, port)

    def _client(self, rank: int, port: int | None) -> dist.Store:
        if port is None and self.kind in ("tcp", "tcp_nolibuv", "prefix", "prefix_nested"):
            port = self.port
        if self.kind in ("tcp", "tcp_nolibuv"):
            return dist.TCPStore(HOST, port, is_master=False, use_libuv=self.kind == "tcp")
        if self.kind == "prefix":
            return dist.PrefixStore("job", dist.TCPStore(HOST, port, is_master=False))
        if self.kind == "prefix_nested":
            return dist.PrefixStore("a", dist.PrefixStore("b/", dist.TCPStore(HOST, port, is_master=False)))
        if self.kind == "file":
            return dist.FileStore(self.path, -1)
        if self.kind == "prefix_file":  # what init_process_group("file://...") hands out
            return dist.PrefixStore("job", dist.FileStore(self.path, -1))
        if self.kind in ("prefix_python", "prefix_listing"):  # the workers' namespace over a Python store (EtcdStore)
            return dist.PrefixStore("job", self._shared)
        return self._shared


# prefix_file and prefix_python: PrefixStores over the generic-path stores users get them as.
STORE_KINDS = [
    "tcp",
    "tcp_nolibuv",
    "file",
    "hash",
    "prefix",
    "prefix_nested",
    "python",
    "basic",
    "prefix_file",
    "prefix_python",
]
IMPLS = ["cpp", "python", "mixed"] if CppStoreCollectives is not None else ["python"]


def make_cls(impl: str, rank: int) -> type:
    """The class of rank ``rank`` under ``impl``; ``mixed``: odd ranks Python, even ranks C++."""
    if impl == "python" or (impl == "mixed" and rank % 2):
        return PyStoreCollectives
    assert CppStoreCollectives is not None, "C++ extension not built"
    return CppStoreCollectives


def make(impl: str, store: dist.Store, rank: int, world_size: int, **options: Any) -> torch_ctrl.ControlCollectives:
    """An instance of the implementation under test; ``mixed``: odd ranks Python, even ranks C++.
    ``options``: constructor keywords (``heartbeat_interval=...``)."""
    return make_cls(impl, rank)(store, rank, world_size, **options)


def run_ranks(world_size: int, fn: Callable[[int], Any], timeout: float = 60.0) -> list[Any]:
    """Run ``fn(rank)`` on one thread per rank; return results in rank order, re-raise the first error."""
    results: list[Any] = [None] * world_size
    errors: list[tuple[int, BaseException]] = []

    def target(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors.append((rank, exc))

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"ranks still running after {timeout}s")
    if errors:
        raise errors[0][1]
    return results


def run_group(
    impl: str,
    stores: Stores,
    world_size: int,
    fn: Callable[[Any, int], Any],
    timeout: float = 60.0,
    **options: Any,
) -> list[Any]:
    """``fn(coll, rank)`` on every rank, each with its own store client and instance (made with
    the constructor keywords ``options``)."""

    def body(rank: int) -> Any:
        with lanes.turn():
            coll = make(impl, stores.client(rank), rank, world_size, **options)
        try:
            return fn(coll, rank)
        finally:
            coll.close()
            with lanes.turn():
                del coll  # freed here, not when the thread ends (see _CONNECT)

    return run_ranks(world_size, body, timeout)


# The gate's forwarder, run in a process of its own: some of torch's bindings (list_keys on
# torch 2.14) hold the GIL while they wait for the server's answer, so a forwarder on a
# thread of the test's process could never pass that answer on.
_GATE = r"""
import contextlib, socket, sys, threading, time

host, target = sys.argv[1], int(sys.argv[2])
listener = socket.create_server((host, 0), backlog=1)
port = listener.getsockname()[1]
is_open = threading.Event()
acceptor = None
wakers = []
hold = 0.0  # seconds each chunk from the server waits before it is passed on ("slow")
sent = 0  # chunks passed on from clients to the server since the last "count"


def pump(src, dst, from_server=False):
    global sent
    try:
        while data := src.recv(65536):
            if from_server and hold:
                time.sleep(hold)
            dst.sendall(data)
            if not from_server:  # counted once passed on: the server has it
                sent += 1
    except OSError:
        pass
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


def forward(conn):
    try:
        up = socket.create_connection((host, target))
    except OSError:
        conn.close()
        return
    for src, dst, from_server in ((conn, up, False), (up, conn, True)):
        threading.Thread(target=pump, args=(src, dst, from_server), daemon=True).start()


def accept():
    while is_open.is_set():
        try:
            conn, _ = listener.accept()
        except OSError:
            return  # closed
        if not is_open.is_set():
            conn.close()
            return
        threading.Thread(target=forward, args=(conn,), daemon=True).start()


def start():
    global acceptor
    is_open.set()
    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()


start()
print(port, flush=True)
for line in sys.stdin:
    command = line.strip()
    if command == "open":
        start()
    elif command == "shut":  # wake the accepting thread, wait until it has stopped
        is_open.clear()
        waker = socket.socket()
        waker.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            waker.connect((host, port))
        wakers.append(waker)
        acceptor.join(10)
        if acceptor.is_alive():
            print("the gate's accepting thread did not stop", flush=True)
            continue
    elif command == "close":
        is_open.clear()
        listener.close()
    elif command.startswith("slow "):
        hold = float(command.split()[1])
    elif command == "count":
        print("ok", sent, flush=True)
        sent = 0
        continue
    print("ok", flush=True)
"""


class Gate:
    """A store server behind a gate: a TCP forwarder to ``port`` on a port of its own
    (:attr:`port`), in a child process. While open it passes every connection on; :meth:`shut`
    stops it taking new ones (its accept queue fills, so a new connection hangs in the TCP
    handshake, as to a server that no longer answers) while the connections already made
    carry on; :meth:`slow` delays the server's answers, :meth:`count` counts requests."""

    def __init__(self, port: int) -> None:
        import subprocess
        import sys

        self._proc = subprocess.Popen(
            [sys.executable, "-c", _GATE, HOST, str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.port = int(self._proc.stdout.readline())  # type: ignore[union-attr]
        self._fill: list[Any] = []

    def _command(self, command: str) -> str:
        self._proc.stdin.write(command + "\n")  # type: ignore[union-attr]
        self._proc.stdin.flush()  # type: ignore[union-attr]
        answer = self._proc.stdout.readline().strip()  # type: ignore[union-attr]
        assert answer.split(" ")[0] == "ok", answer or "the gate's process ended"
        return answer[3:]

    def open(self) -> None:
        """Pass new connections on again (the ones queued meanwhile first)."""
        self._command("open")

    def shut(self) -> None:
        """Take no new connection: stop the accepting thread (woken by one connection), then
        fill the queue. (Filled while the thread still accepted, the queue kept a free place,
        and a client's connect then completed with nobody to answer it: torch 2.6's client
        waits for that answer without a timeout.)"""
        import socket

        self._command("shut")
        for _ in range(3):  # the queue of 1 + 1, and one more
            sock = socket.socket()
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect((HOST, self.port))
            self._fill.append(sock)

    def count(self) -> int:
        """How many chunks the clients sent through the gate since the last count: about one per
        request (a request that waits for its answer is never sent together with the next)."""
        return int(self._command("count"))

    def slow(self, seconds: float) -> None:
        """Hold everything the server sends, on every connection, ``seconds`` before passing it
        on: a server that answers late (0 makes it prompt again)."""
        self._command(f"slow {seconds}")

    def close(self) -> None:
        """Stop for good (the connections already made stay, until the gate's process ends)."""
        self._command("close")
        for sock in self._fill:
            sock.close()


# ----------------------------------------------------------------------------- torchrun

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchrun", "worker.py")


def poll(fn: Callable[[], Any], timeout: float = 30.0, what: str = "condition", every: float = 0.02) -> Any:
    """``fn()`` until it returns something truthy (returned), for at most ``timeout`` seconds.

    For states a test can only observe (a counter moving, a key going, a process stopping):
    there is nothing to wait on, so it looks every ``every`` seconds. Fails with the last value.
    """
    deadline = time.monotonic() + timeout
    last = None
    while True:
        last = fn()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} not reached within {timeout}s; last: {last!r}")
        time.sleep(every)


def free_port() -> int:
    """A TCP port that was free a moment ago (for a rendezvous endpoint two launchers share)."""
    import socket

    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


class Node:
    """One torchrun (an agent and its workers) started as a real process, in its own session
    (so :meth:`kill_all` takes the workers too); its output is collected as it comes."""

    def __init__(self, args: list[str], env: dict[str, str], launcher: list[str]) -> None:
        import subprocess
        import sys
        import time

        self.start = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, *launcher, *args],
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self._lines: list[str] = []
        self._seen = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.returncode: int | None = None
        self.elapsed = 0.0

    @property
    def output(self) -> str:
        with self._seen:
            return "".join(self._lines)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._seen:
                self._lines.append(line)
                self._seen.notify_all()

    def wait_for(self, text: str, timeout: float) -> None:
        """Block until ``text`` appears in the output."""
        with self._seen:
            if not self._seen.wait_for(lambda: text in "".join(self._lines), timeout):
                raise TimeoutError(f"{text!r} not seen within {timeout}s:\n{''.join(self._lines)}")

    def wait(self, timeout: float) -> Node:
        import time

        self.proc.wait(timeout=timeout)
        self._reader.join(timeout)
        self.returncode = self.proc.returncode
        self.elapsed = time.monotonic() - self.start
        return self

    def kill_all(self) -> None:
        """SIGKILL the agent and its workers (a node lost without a word). torch starts each
        worker in a session of its own, so the process tree is walked through /proc."""
        import signal

        if self.proc.poll() is not None:
            return  # reaped: its pid may belong to someone else now
        for pid in [self.proc.pid, *_descendants(self.proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.kill_all()
        self.proc.wait()


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def torchrun_two_nodes(
    mode: list[str],
    *,
    host_node: int = 0,
    failing_node: int | None = None,
    max_restarts: int = 0,
    backend: str | None = "ctrl",
    launcher: tuple[str, ...] = ("-m", "torch.distributed.run"),
    timeout: float = 150.0,
    env: dict[str, str] | None = None,
    during: Callable[[list[Node]], None] | None = None,
    endpoint: str | None = None,
    run_id: str | None = None,
    rdzv_conf: str = "",
) -> list[Node]:
    """Two torchruns (2 workers each) on 127.0.0.1 running ``worker.py *mode``; node
    ``host_node`` hosts the rendezvous store; ``failing_node``'s local rank 1 gets
    ``CTRL_TEST_FAIL=1``; ``backend=None`` leaves ``--rdzv-backend`` out; ``env`` is added to
    both launchers' environment; ``during(nodes)`` runs once both are started; ``endpoint``
    replaces the rendezvous endpoint (a free port on 127.0.0.1) and ``run_id`` the run id
    (``test{port}``); ``rdzv_conf`` is added to ``--rdzv-conf``. Node 0 starts first, so it
    becomes node rank 0 (ranks follow pids)."""
    port = free_port()
    endpoint = endpoint or f"{HOST}:{port}"
    nodes: list[Node] = []
    try:
        for n in (0, 1):
            args = [
                "--nnodes=2",
                "--nproc-per-node=2",
                *([f"--rdzv-backend={backend}"] if backend else []),
                f"--rdzv-endpoint={endpoint}",
                f"--rdzv-id={run_id or f'test{port}'}",
                f"--rdzv-conf=is_host={int(n == host_node)}{',' + rdzv_conf if rdzv_conf else ''}",
                f"--max-restarts={max_restarts}",
                "--monitor-interval=0.1",
                WORKER,
                *mode,
            ]
            node_env = {"CTRL_TEST_FAIL": str(int(n == failing_node)), **(env or {})}
            nodes.append(Node(args, node_env, list(launcher)))
        if during is not None:
            during(nodes)
        return [node.wait(timeout) for node in nodes]
    finally:
        for node in nodes:
            node.kill()


# Descriptors of the connections mute_port() accepted, open for the life of the process (see there).
_MUTED: list[int] = []


@contextlib.contextmanager
def mute_port() -> Iterator[int]:
    """A port on 127.0.0.1 that accepts connections and never answers (a stopped server's
    process, another service, not a TCPStore): yields the port. On exit it stops accepting,
    but the connections it accepted stay open until the process ends: a torch call given up
    on (blocked in its handshake) then never returns, where a closed connection would send it
    into torch's connect loop, logging C++ traces until its timeout and then returning, maybe
    while the interpreter finalizes, which aborts the test process."""
    import socket

    listener = socket.socket()
    listener.bind((HOST, 0))
    listener.listen(64)
    accepted: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                accepted.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept(), which close() does not
        listener.close()
        thread.join(10)
        # Detached: the descriptors stay open through the interpreter's finalization too (a
        # socket object collected then would close its connection), until the process ends.
        _MUTED.extend(conn.detach() for conn in accepted)


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (state T in /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def freeze(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)
    poll(lambda: stopped(pid), 30, f"process {pid} stopped")


@contextlib.contextmanager
def frozen_server(keys: dict[str, bytes] | None = None) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """A subprocess hosting a TCPStore (with ``keys``), running: (process, port). The test
    stops it (:func:`freeze`); cleanup resumes and kills it."""
    code = (
        "import sys, torch.distributed as d\n"
        "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
        f"for k, v in {dict(keys or {})!r}.items(): s.set(k, v)\n"
        "print(s.port, flush=True)\n"
        "sys.stdin.read()\n"  # until the test ends it
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "RES_OPTIONS": os.environ.get("RES_OPTIONS", "timeout:1 attempts:1")},
    )
    try:
        assert proc.stdout is not None
        yield proc, int(proc.stdout.readline())
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(30)


def in_thread(fn: Callable[[], Any], limit: float) -> tuple[Any, BaseException | None, float]:
    """``fn()`` on a daemon thread, for at most ``limit`` seconds: (result, exception, seconds).
    A call still blocked at ``limit`` fails the test (the thread stays blocked until cleanup
    ends what it waits for)."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append((fn(), None))
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            box.append((None, exc))

    started = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    assert box, f"still blocked after {limit}s"
    return (*box[0], time.monotonic() - started)
