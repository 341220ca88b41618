"""``python -m torch_ctrl bench rendezvous``: the ``ctrl`` rendezvous against torch's ``c10d``.

N rendezvous handlers as threads of one process (each with its own TCPStore client, one TCPStore
server, ``min_nodes = max_nodes = N``), for each backend side by side: time from the moment all
handlers call ``next_rendezvous()`` until the last one returns, and the store calls and bytes
each node made on its own thread (its critical path), through a metering wrapper. A backend that
has not completed within ``--cap`` seconds is reported as "no rendezvous within the cap" (its
handlers are left to time out in the background).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .counting import CountingStore

BACKENDS = ("ctrl", "c10d")
WORLDS = (8, 32, 128, 512, 2048)
MAX_NODES = 4096  # --nodes: a thread and a TCPStore client per node, in one process


class MeteredStore(CountingStore):
    """A ``CountingStore`` that also adds up the payload bytes each calling thread sends and
    receives (keys and values; counters as their decimal text). ``set_timeout`` reaches the
    inner store, so a caller's per-call timeouts cost no extra call (``forwards_timeout``)."""

    forwards_timeout = True

    def __init__(self, inner: dist.Store) -> None:
        super().__init__(inner)
        self._bytes: dict[int, int] = {}

    def _meter(self, n: int) -> None:
        ident = threading.get_ident()
        with self._lock:
            self._bytes[ident] = self._bytes.get(ident, 0) + n

    def bytes(self, thread: int | None = None) -> int:
        """Bytes moved by ``thread`` (a ``threading.get_ident()``) or by all threads."""
        with self._lock:
            return sum(v for k, v in self._bytes.items() if thread is None or k == thread)

    def set(self, key: str, value: Any) -> None:
        self._meter(len(key) + len(value))
        super().set(key, value)

    def get(self, key: str) -> bytes:
        out = super().get(key)
        self._meter(len(key) + len(out))
        return out

    def add(self, key: str, value: int) -> int:
        out = super().add(key, value)
        self._meter(len(key) + len(str(value)) + len(str(out)))
        return out

    def check(self, keys: list[str]) -> bool:
        self._meter(sum(map(len, keys)))
        return super().check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._meter(sum(map(len, keys)))
        super().wait(keys, timeout)

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        out = super().compare_set(key, expected_value, desired_value)
        self._meter(len(key) + len(expected_value) + len(desired_value) + len(out))
        return out

    def multi_get(self, keys: list[str]) -> list[bytes]:
        out = super().multi_get(keys)
        self._meter(sum(map(len, keys)) + sum(map(len, out)))
        return out

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._meter(sum(map(len, keys)) + sum(map(len, values)))
        super().multi_set(keys, values)

    def set_timeout(self, timeout: timedelta) -> None:  # type: ignore[override]
        self.inner.set_timeout(timeout)


def _params(backend: str, port: int, run_id: str, n: int, cap: float) -> Any:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    # c10d reads whole seconds; the cap bounds how long a run that cannot complete lingers
    return RendezvousParameters(
        backend, f"127.0.0.1:{port}", run_id, n, n, is_host=False, join_timeout=max(int(cap), 1), read_timeout=300
    )


def make_handlers(backend: str, port: int, run_id: str, n: int, cap: float) -> tuple[list[Any], list[MeteredStore]]:
    """``n`` handlers of ``backend``, each on its own metered TCPStore client."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    from .elastic.ctrl_rendezvous import NativeRendezvousHandler, beat_store, config_from

    handlers, stores = [], []
    params = _params(backend, port, run_id, n, cap)
    beats = beat_store("127.0.0.1", port, 60.0) if backend == "ctrl" else None
    for _ in range(n):
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
        store = MeteredStore(client)
        if backend == "ctrl":
            handlers.append(NativeRendezvousHandler(config_from(params), store, beats))
        else:
            handlers.append(dynamic_rendezvous.create_handler(store, C10dRendezvousBackend(store, run_id), params))
        stores.append(store)
    return handlers, stores


def run_once(backend: str, port: int, n: int, cap: float) -> dict[str, Any]:
    """One rendezvous of ``n`` nodes: seconds until the last node returned (None past the cap),
    and per-node store calls and bytes (median and max over the nodes that returned)."""
    run_id = f"bench-{backend}-{n}-{os.getpid()}-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    handlers, stores = make_handlers(backend, port, run_id, n, cap)
    setup = time.perf_counter() - t0
    for s in stores:
        s.reset()
    done: list[float] = []
    idents: list[int | None] = [None] * n
    lock = threading.Lock()
    go = threading.Event()
    errors: list[str] = []

    def node(i: int) -> None:
        idents[i] = threading.get_ident()
        go.wait()
        try:
            handlers[i].next_rendezvous()
        except Exception as exc:  # noqa: BLE001 - reported in the results
            with lock:
                errors.append(type(exc).__name__)
            return
        with lock:
            done.append(time.perf_counter())

    old = threading.stack_size(256 << 10)
    threads = [threading.Thread(target=node, args=(i,), daemon=True) for i in range(n)]
    threading.stack_size(old)
    for t in threads:
        t.start()
    start = time.perf_counter()
    go.set()
    deadline = start + cap
    for t in threads:
        t.join(max(deadline - time.perf_counter(), 0))
    complete = len(done) == n
    elapsed = (max(done) - start) if complete else None
    calls = [stores[i].total(idents[i]) for i in range(n)]
    moved = [stores[i].bytes(idents[i]) for i in range(n)]
    if complete and backend == "ctrl":
        for h in handlers:
            h.shutdown() if h is handlers[0] else h._stop_heartbeats()
    return dict(
        backend=backend,
        n=n,
        seconds=None if elapsed is None else round(elapsed, 3),
        setup_s=round(setup, 2),
        returned=len(done),
        errors=sorted(set(errors)),
        calls_median=statistics.median(calls),
        calls_max=max(calls),
        bytes_median=int(statistics.median(moved)),
        bytes_max=max(moved),
    )


def table(records: list[dict[str, Any]], cap: float) -> str:
    """Markdown: one row per N, the two backends side by side."""
    rows = ["| N | ctrl | c10d | ctrl calls/node (median, max) | c10d calls/node | ctrl bytes/node | c10d bytes/node |"]
    rows.append("|---|---|---|---|---|---|---|")
    by = {(r["backend"], r["n"]): r for r in records}
    for n in sorted({r["n"] for r in records}):
        cells = [str(n)]
        for b in BACKENDS:
            r = by.get((b, n))
            cells.append("-" if r is None else _time_cell(r, cap))
        for field in ("calls", "bytes"):
            for b in BACKENDS:
                r = by.get((b, n))
                cells.append("-" if r is None else f"{r[field + '_median']:g}, {int(r[field + '_max']):,}")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _time_cell(r: dict[str, Any], cap: float) -> str:
    if r["seconds"] is not None:
        return f"{r['seconds']:.2f} s"
    return f"no rendezvous within the cap ({cap:g} s; {r['returned']}/{r['n']} returned)"


def plot(records: list[dict[str, Any]], cap: float, path: Path) -> str:
    """Time to rendezvous against N (log-log), both backends; runs past the cap drawn at the cap."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ""
    fig, ax = plt.subplots(figsize=(6, 4))
    for b, style in zip(BACKENDS, ("o-", "s--")):
        rs = sorted((r for r in records if r["backend"] == b), key=lambda r: r["n"])
        xs = [r["n"] for r in rs]
        ys = [r["seconds"] if r["seconds"] is not None else cap for r in rs]
        ax.plot(xs, ys, style, label=b)
        for r in rs:
            if r["seconds"] is None:
                ax.annotate("cap", (r["n"], cap), textcoords="offset points", xytext=(4, -10), fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("nodes (handlers as threads, one TCPStore)")
    ax.set_ylabel("seconds until the last node has its rank")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return str(path)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Options of ``python -m torch_ctrl bench rendezvous``."""
    from .bench import MAX_TIMEOUT, timeout_error

    p = argparse.ArgumentParser(
        prog="torch-ctrl bench rendezvous", description=(__doc__ or "").splitlines()[0].replace("``", "")
    )
    p.add_argument(
        "--nodes",
        default=",".join(map(str, WORLDS)),
        help=f"comma-separated N, each <= {MAX_NODES} (default: %(default)s)",
    )
    p.add_argument("--backends", default=",".join(BACKENDS), help="subset of %(default)s")
    p.add_argument(
        "--cap",
        type=float,
        default=120.0,
        help=f"seconds per run before giving up, > 0 and <= {MAX_TIMEOUT:.0f} (a week) (default: %(default)s)",
    )
    p.add_argument("--out", default="./bench-out", help="output directory, created if need be (default: %(default)s)")
    opts = p.parse_args(list(argv))
    try:
        opts.worlds = [int(x) for x in opts.nodes.split(",") if x.strip()]
    except ValueError:
        p.error(f"--nodes: not a list of integers: {opts.nodes!r}")
    opts.backend_list = [b.strip() for b in opts.backends.split(",") if b.strip()]
    if not opts.worlds:
        p.error("--nodes: no node counts given")
    if min(opts.worlds) < 1 or max(opts.worlds) > MAX_NODES:
        p.error(f"--nodes must be >= 1 and <= {MAX_NODES}")
    why = timeout_error("--cap", opts.cap)
    if why:
        p.error(why)
    if not opts.backend_list:
        p.error(f"--backends: no backends given; choose from {', '.join(BACKENDS)}")
    bad = [b for b in opts.backend_list if b not in BACKENDS]
    if bad:
        p.error(f"--backends: unknown {', '.join(map(repr, bad))}; choose from {', '.join(BACKENDS)}")
    return opts


def failures(records: Sequence[dict]) -> list[str]:
    """The ctrl runs that did not complete (past the cap, or a node raised): what makes the
    exit status 1. A c10d run past the cap is a result, not a failure of the tool."""
    return [
        f"ctrl N={r['n']}: {r['returned']}/{r['n']} returned" + (f" ({', '.join(r['errors'])})" if r["errors"] else "")
        for r in records
        if r["backend"] == "ctrl" and (r["seconds"] is None or r["errors"])
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the rendezvous benchmark; print the table, write ``rendezvous.json|md|png``."""
    from . import bench_report
    from .bench import machine, out_dir, raise_open_files
    from .broken_pipe import silence_stdout

    args = list(sys.argv[1:] if argv is None else argv)
    opts = parse_args(args)
    out = out_dir(opts.out, "python -m torch_ctrl bench rendezvous")
    if out is None:
        return 2
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")  # see bench.main: connection setup only
    meta = {**machine(), "command": "python -m torch_ctrl bench rendezvous " + shlex.join(args)}
    meta.update(open_files=raise_open_files(), backends=opts.backend_list, nodes=opts.worlds, cap_s=opts.cap)
    meta["started"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    records: list[dict[str, Any]] = []
    begin = time.perf_counter()
    try:
        print(f"# {meta['command']}\n# {meta['cpu']} x{meta['nproc']}, torch {meta['torch']}", flush=True)
        server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))
        # one backend at a time: c10d runs that hit the cap leave threads behind until their join timeout
        for b in opts.backend_list:
            for n in opts.worlds:
                r = run_once(b, server.port, n, opts.cap)
                records.append(r)
                print(
                    f"# {b:5} N={n:5}: {_time_cell(r, opts.cap)}; calls/node median {r['calls_median']:g} "
                    f"max {r['calls_max']:g}; bytes/node median {r['bytes_median']} max {r['bytes_max']}",
                    flush=True,
                )
        meta["seconds"] = round(time.perf_counter() - begin, 1)
        text = table(records, opts.cap)
        failed = failures(records)
        if failed:
            text += "\n\nFailed: " + "; ".join(failed)
        print(text)
        (out / "rendezvous.json").write_text(json.dumps(dict(meta=meta, records=records), indent=1))
        md = bench_report.header(meta, "torch_ctrl rendezvous benchmark") + "\n\n" + text + "\n"
        (out / "rendezvous.md").write_text(md)
        png = plot(records, opts.cap, out / "rendezvous.png")
        if png:
            print(f"# plot: {png}")
        code = 1 if failed else 0
        sys.stdout.flush()
    except BrokenPipeError:  # stdout's reader has gone (`| head`): leave quietly, as broken_pipe.run does
        silence_stdout()
        code = 1
    if any(r["seconds"] is None for r in records):
        # handlers past the cap are still inside TCPStore calls on daemon threads; tearing the
        # interpreter down under them aborts the process (C++ terminate): leave without it
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    from .broken_pipe import run

    sys.exit(run(main))
