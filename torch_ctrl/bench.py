"""``python -m torch_ctrl bench``: latency and store traffic of the collectives, next to torch's.

One run uses one TCPStore server (libuv backend). A world of N ranks is N threads, N processes
(``--mode processes``) or the N workers of a real ``python -m torch_ctrl.run --standalone`` job
(``--mode torchrun``, see :mod:`torch_ctrl.bench_worker`). Every contender runs over the same kind
of store (``--store``): ``raw`` (a TCPStore client per rank), ``prefix`` (a PrefixStore over one, what
torchrun, ``init_process_group`` and ``from_env()`` hand out), ``file`` (a FileStore) or ``hash`` (one
shared HashStore). Every rank has its own store per contender; the instances are made once per N
and store kind and reused across rounds, with a unique key per round. Rounds interleave the
contenders (their order rotates each round, so that none always runs right after another one's
background cleanup), or, with ``--order blocks``, each contender runs all its rounds back to back,
as an application that uses one implementation does (its cleanup then meets its own next op).
All ranks start each op on a shared barrier; an op's time is ``max(end) - min(start)`` over the
ranks. See ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import shlex
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from queue import Empty
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.elastic.utils import store as elastic_store

from . import capabilities, lanes, loader
from .counting import CountingStore
from .store_collectives import PyStoreCollectives

# The C++ implementation where the extension is usable with this torch, else None.
CppStoreCollectives = loader.StoreCollectives if loader.backend() == "cpp" else None

OPS = ("barrier", "broadcast", "gather", "scatter", "all_gather", "all_sum")  # the nine methods, as six ops
METHOD_OPS = {f"{o}_{s}": o for o in ("broadcast", "gather", "scatter") for s in ("send", "recv")}
CONTENDERS = ("torch", "cpp", "cpp-hb", "python", "elastic", "native", "floor")
COUNTED = ("torch", "cpp", "python")  # the full-API contenders
SUPPORTS = {"elastic": ("barrier", "all_gather"), "native": ("barrier",)}  # others: every op
BASELINE = "torch"
_NAMES = ("torch._StoreCollectives", "torch_ctrl C++", "torch_ctrl C++ hb=1s", "torch_ctrl Python")
LABELS = dict(zip(CONTENDERS, (*_NAMES, "elastic.utils.store", "store.barrier", "floor (1 add)")))
HEARTBEAT = 1.0  # cpp-hb: torch_ctrl C++ with liveness on (heartbeat_interval, seconds)
# Threads mode with --contenders left out: the Python twin runs up to this N. Above it, N
# PyStoreCollectives and their N watcher threads share one interpreter and one GIL: one run of
# N=512 took 13 minutes for one store kind (docs/benchmarks.md). Named in --contenders, it runs.
PYTHON_THREADS_MAX = 128
# The kinds of store every contender can be run over (--store), and what each rank holds.
STORES = ("raw", "prefix", "file", "hash")
STORE_TEXT = {
    "raw": "one TCPStore client per rank",
    "prefix": "a PrefixStore over a TCPStore client per rank",
    "file": "a FileStore in a temp dir, one handle per rank",
    "hash": "one HashStore shared by every rank, threads only",
}
STORE_CLASSES = {"raw": dist.TCPStore, "prefix": dist.PrefixStore, "file": dist.FileStore, "hash": dist.HashStore}
PREFIX = "bench"  # the PrefixStore's prefix of --store prefix (threads and processes)
MAX_SPAWNED = 16  # world sizes of --mode processes and torchrun: what a 2-core machine can spawn
# World sizes of --mode threads and of the store-call counts (always threads): N threads, each with
# a store client per contender, in one process (N=512 takes minutes already, docs/benchmarks.md).
MAX_THREADS = 4096
MAX_PAYLOAD = 256 << 20  # --payload, bytes: one copy is shared, but each gather/all_gather holds N of them
MAX_ROUNDS = 100_000  # --rounds: the schedule and every sample are kept in memory
MAX_TIMEOUT = 7 * 86400.0  # --timeout, seconds (a week): torch's stores overflow on much longer timeouts
Task = tuple[str, int, str]  # (op, round, contender); round -1 is the warm-up
Timing = tuple[float, float, str]  # (start, end, error or "")
Make = Callable[[str, dist.Store, int, int], Any]  # (contender, store, rank, world) -> instance


@dataclass
class World:
    """What every rank of one world size and store kind needs (picklable, for ``--mode processes``,
    except ``shared``, the HashStore of ``store="hash"``, which only threads use)."""

    size: int
    port: int
    contenders: Sequence[str]
    tasks: Sequence[Task]
    payload: bytes
    secs: float
    tag: str
    store: str = "raw"
    host: str = "127.0.0.1"
    prefix: str = PREFIX
    file_dir: str = ""
    shared: Any = None


def supports(contender: str, op: str, store: str = "raw") -> bool:
    """Whether ``contender`` implements ``op`` over a ``store`` kind (the floor stands in for any op;
    ``native`` is the store's own ``barrier``, where that store class has one)."""
    if contender == "native" and not hasattr(STORE_CLASSES[store], "barrier"):
        return False
    return op in SUPPORTS.get(contender, OPS)


def unavailable() -> dict[str, str]:
    """Contenders this installation cannot run, with the reason (printed, and left out)."""
    out = {}
    if capabilities.private_store_collectives() is None:
        out["torch"] = f"absent: torch {torch.__version__} has no torch.distributed._StoreCollectives"
    if CppStoreCollectives is None:
        why = f"not in use: {loader.reason()}"
        out.update({"cpp": why, "cpp-hb": why})
    if not capabilities.BARRIER:
        out["native"] = f"absent: torch {torch.__version__}'s TCPStore has no server-side barrier"
    return out


def rounds_for(world: int, rounds: int) -> int:
    """Timed rounds at world size ``world``: all of them below 256 ranks, half (at least 3) from 256 on."""
    return rounds if world < 256 else max(3, rounds // 2)


def open_store(w: World, contender: str) -> dist.Store:
    """This rank's store for ``contender``, of kind ``w.store``."""
    timeout = timedelta(seconds=w.secs)
    if w.store == "hash":
        return w.shared
    if w.store == "file":  # one file per contender: none grows another's file; -1: never deleted by torch
        store = dist.FileStore(os.path.join(w.file_dir, f"w{w.size}-{contender}"), -1)
        store.set_timeout(timeout)
        return store
    client = dist.TCPStore(w.host, w.port, None, False, timeout, wait_for_workers=False)
    return client if w.store == "raw" else dist.PrefixStore(w.prefix, client)


def make_instance(contender: str, store: dist.Store, rank: int, world: int) -> Any:
    """What a contender's ops are called on (the store itself for the store-only contenders)."""
    if contender == "cpp-hb":
        return CppStoreCollectives(store, rank, world, heartbeat_interval=HEARTBEAT)
    theirs = capabilities.private_store_collectives()
    cls = {"torch": theirs, "cpp": CppStoreCollectives, "python": PyStoreCollectives}.get(contender)
    return cls(store, rank, world) if cls is not None else store


def call_op(contender: str, inst: Any, op: str, key: str, rank: int, world: int, payload: bytes, secs: float) -> None:
    """Run ``op`` once on this rank (rank 0 is the root of rooted ops) and check its result."""
    if contender == "floor":
        inst.add(f"floor/{key}/{rank}", 1)
        return
    if contender == "native":
        inst.barrier(key, world, timedelta(seconds=secs))
        return
    if contender == "elastic":
        if op == "barrier":
            elastic_store.barrier(inst, world, key_prefix=key, barrier_timeout=secs)
        else:
            _expect(len(elastic_store.synchronize(inst, payload, rank, world, key + "/", secs)) == world, op)
        return
    t = timedelta(seconds=secs)  # torch's class needs a timedelta (and takes bytes for its `str` data)
    if op == "barrier":
        inst.barrier(key, t)
    elif op == "all_gather":
        _expect(len(inst.all_gather(key, payload, t)) == world, op)
    elif op == "all_sum":
        _expect(inst.all_sum(key, rank + 1, t) == world * (world + 1) // 2, op)
    elif rank == 0:
        if op == "broadcast":
            inst.broadcast_send(key, payload, t)
        elif op == "gather":
            _expect(len(inst.gather_recv(key, payload, t)) == world, op)
        else:
            inst.scatter_send(key, [payload] * world, t)
    elif op == "gather":
        inst.gather_send(key, payload, t)
    else:
        _expect((inst.broadcast_recv if op == "broadcast" else inst.scatter_recv)(key, t) == payload, op)


def _expect(ok: bool, op: str) -> None:
    if not ok:
        raise AssertionError(f"{op}: wrong result")


# ------------------------------------------------------------------------------------ latency


def schedule(
    ops: Sequence[str], contenders: Sequence[str], rounds: int, store: str = "raw", order: str = "interleaved"
) -> list[Task]:
    """Run order: per op, a warm-up round then the timed ones. ``interleaved``: every round runs each
    contender once, their order rotating each round. ``blocks``: each contender runs its warm-up and
    all its rounds back to back, then the next contender."""
    out: list[Task] = []
    for op in ops:
        present = [c for c in contenders if supports(c, op, store)]
        if order == "blocks":
            out += [(op, rnd, c) for c in present for rnd in range(-1, rounds)]
            continue
        for rnd in range(-1, rounds):
            shift = rnd % len(present) if present else 0
            out += [(op, rnd, c) for c in present[shift:] + present[:shift]]
    return out


def rank_main(w: World, rank: int, sync: Any, make: Make = make_instance) -> list[Timing]:
    """One rank: a store and an instance per contender, then every task, each started on the shared barrier.

    ``sync.wait(seconds)`` is the shared barrier (threading's, multiprocessing's, or a store barrier
    under torchrun); ``make`` builds each contender's instance over its store.
    """
    secs = w.secs
    # The ranks are threads: on torch 2.6-2.7 they make and free their stores and instances in
    # turns (lanes.turn), or the process may abort ("Tried to deallocate unregistered instance").
    with lanes.turn():
        insts = {c: make(c, open_store(w, c), rank, w.size) for c in w.contenders}
    try:
        out: list[Timing] = []
        sync.wait(secs)
        for op, rnd, c in w.tasks:
            key, err = f"{w.tag}/{w.store}/{c}/w{w.size}/{op}/{rnd}", ""
            sync.wait(secs)
            start = time.perf_counter()
            try:
                call_op(c, insts[c], op, key, rank, w.size, w.payload, secs)
            except Exception as exc:  # noqa: BLE001 - recorded and reported; the run goes on
                err = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
            out.append((start, time.perf_counter(), err))
        sync.wait(secs)
        _close_all(insts.values())
        return out
    finally:  # the instances' last references: the stores and instances are freed here
        with lanes.turn():
            insts.clear()


def _close_all(insts: Iterable[Any]) -> None:
    """``close()`` each instance that has one (a function of its own: no reference is left behind
    in :func:`rank_main`'s frame, whose ``insts`` hold the last ones)."""
    for inst in insts:
        if hasattr(inst, "close"):
            inst.close()


def _process_rank(w: World, rank: int, sync: Any, queue: Any) -> None:
    """``--mode processes``: run one rank in this process and send its timings back."""
    try:
        queue.put((rank, rank_main(w, rank, sync)))
    except Exception as exc:  # noqa: BLE001 - the parent reports it
        queue.put((rank, f"{type(exc).__name__}: {exc}"))


def contenders_at(world: int, opts: argparse.Namespace) -> list[str]:
    """The contenders that run at world size ``world`` (see ``PYTHON_THREADS_MAX``)."""
    most = opts.python_max
    return [c for c in opts.contenders if not (c == "python" and most is not None and world > most)]


def world_for(world: int, store: str, port: int, opts: argparse.Namespace, tag: str) -> World:
    """The plan of one world size over one store kind."""
    contenders = contenders_at(world, opts)
    tasks = schedule(opts.ops, contenders, rounds_for(world, opts.rounds), store, opts.order)
    shared = None
    if store == "hash":
        shared = dist.HashStore()
        shared.set_timeout(timedelta(seconds=opts.timeout))
    return World(
        world, port, contenders, tasks, opts.data, opts.timeout, tag, store, file_dir=opts.file_dir, shared=shared
    )


def run_world(world: int, store: str, port: int, opts: argparse.Namespace, tag: str) -> list[dict[str, Any]]:
    """Every round at one world size over one store kind, ranks as threads or processes: one record
    per (op, contender)."""
    w = world_for(world, store, port, opts, tag)
    results: dict[int, Any] = {}
    if opts.mode == "threads":
        sync: Any = threading.Barrier(world)

        def body(rank: int) -> None:
            try:
                results[rank] = rank_main(w, rank, sync)
            except Exception as exc:  # noqa: BLE001 - reported below
                results[rank] = f"{type(exc).__name__}: {exc}"
                sync.abort()

        _run_threads(body, world)
    else:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        sync, queue = ctx.Barrier(world), ctx.Queue()
        procs = [ctx.Process(target=_process_rank, args=(w, r, sync, queue), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        while len(results) < world:
            try:
                results.update([queue.get(timeout=1.0)])
            except Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"world size {world}: a rank died: {[p.exitcode for p in procs]}") from None
        for p in procs:
            p.join()
    return summarize(w, results, opts)


def summarize(w: World, results: dict[int, Any], opts: argparse.Namespace) -> list[dict[str, Any]]:
    """Per (op, contender): the samples (``max(end) - min(start)`` over the ranks, per timed round),
    their median, min and max, the errors, and the ratio of the median to torch's class over the same
    store. ``results`` maps each rank to its timings in task order, or to why that rank failed."""
    world, tasks = w.size, w.tasks
    failed = {r: v for r, v in results.items() if isinstance(v, str)}
    if failed:
        raise RuntimeError(f"world size {world}, {w.store} store: rank(s) failed: {failed}")
    samples: dict[tuple[str, str], list[float]] = {}
    errors: dict[tuple[str, str], list[str]] = {}
    for i, (op, rnd, c) in enumerate(tasks):
        rows = [results[r][i] for r in range(world)]
        errs = [e for _, _, e in rows if e]
        if errs:
            errors.setdefault((op, c), []).append(errs[0])
        elif rnd >= 0:
            samples.setdefault((op, c), []).append(1e3 * (max(r[1] for r in rows) - min(r[0] for r in rows)))
    records = []
    rounds = rounds_for(world, opts.rounds)
    for op, c in ((op, c) for op in opts.ops for c in w.contenders if supports(c, op, w.store)):
        ms = samples.get((op, c), [])
        stats = (statistics.median(ms), min(ms), max(ms)) if ms else (None, None, None)
        records.append({"store": w.store, "mode": opts.mode, "world_size": world, "op": op, "contender": c})
        records[-1].update(rounds=rounds, samples_ms=ms)
        records[-1].update(zip(("median_ms", "min_ms", "max_ms"), stats), errors=errors.get((op, c), []))
    base = {r["op"]: r["median_ms"] for r in records if r["contender"] == BASELINE}
    for r in records:
        r["ratio"] = r["median_ms"] / base[r["op"]] if base.get(r["op"]) and r["median_ms"] is not None else None
    return records


def _run_threads(body: Callable[[int], None], world: int) -> None:
    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# ---------------------------------------------------------------------------------- op counts


def count_ops(
    world: int, ops: Sequence[str], payload: bytes, secs: float, kind: str, port: int, file_dir: str = ""
) -> list[dict[str, Any]]:
    """Each op once per full-API contender, every rank (a thread) on its own CountingStore.

    The CountingStores wrap a store of kind ``kind`` (:data:`STORES`; ``"tcp"`` is ``"raw"``): one
    shared HashStore, or per rank a TCPStore client on the server at ``port`` (a client cannot be
    shared by threads that block in it), a PrefixStore over one, or a FileStore handle in ``file_dir``.
    A CountingStore is a Python store, so torch_ctrl takes its generic (shared-store) path over it
    whatever it wraps. Per rank: ``critical`` = the calls made on the rank's own thread (its critical
    path); ``at_return`` = all calls counted once every rank has returned, before ``close()``;
    ``total`` = all calls after ``close()`` flushed the background cleanup.
    """
    kind = "raw" if kind == "tcp" else kind
    timeout = timedelta(seconds=secs)
    shared = dist.HashStore()
    shared.set_timeout(timeout)
    w = World(world, port, (), (), payload, secs, "", kind, file_dir=file_dir, shared=shared)
    counted = [c for c in COUNTED if c not in unavailable()]
    return [
        count_one(world, op, c, partial(open_store, w, f"count-{c}"), payload, secs, kind)
        for op in ops
        for c in counted
    ]


def count_one(
    world: int, op: str, c: str, inner: Callable[[], dist.Store], payload: bytes, secs: float, kind: str
) -> dict[str, Any]:
    """One op of one contender for :func:`count_ops`."""
    with lanes.turn():  # see rank_main
        stores = [CountingStore(inner()) for _ in range(world)]
        insts = [make_instance(c, s, r, world) for r, s in enumerate(stores)]
    sync, per_rank = threading.Barrier(world), [dict[str, Any]() for _ in range(world)]

    def body(rank: int) -> None:
        sync.wait(secs)
        try:
            call_op(c, insts[rank], op, f"count{os.getpid()}/{c}/w{world}/{op}", rank, world, payload, secs)
        except Exception as exc:  # noqa: BLE001 - reported
            per_rank[rank]["error"] = repr(exc)
        sync.wait(secs)
        per_rank[rank].update(critical=stores[rank].counts(threading.get_ident()), at_return=stores[rank].counts())
        sync.wait(secs)
        if hasattr(insts[rank], "close"):
            insts[rank].close()
        per_rank[rank]["total"] = stores[rank].counts()

    _run_threads(body, world)
    with lanes.turn():
        insts.clear()
        stores.clear()
    crit = [sum(p.get("critical", {}).values()) for p in per_rank]
    rec = {"store": kind, "inner_store": kind, "world_size": world, "op": op, "contender": c, "critical_root": crit[0]}
    rec["critical_other_mean"] = statistics.mean(crit[1:]) if world > 1 else None
    rec["total_mean"] = statistics.mean(sum(p.get("total", {}).values()) for p in per_rank)
    return {**rec, "errors": [p["error"] for p in per_rank if "error" in p], "per_rank": per_rank}


# ------------------------------------------------------------------------------------ machine


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor()
    from . import __version__

    return dict(
        nproc=os.cpu_count(),
        cpu=cpu,
        torch=torch.__version__,
        torch_ctrl=__version__,
        backend=loader.backend(),
        python=platform.python_version(),
    )


def timeout_error(name: str, seconds: float) -> str | None:
    """Why ``seconds`` is no valid value of the timeout option ``name``, or None if it is."""
    if math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT:
        return None
    return f"{name} must be a finite number of seconds > 0 and <= {MAX_TIMEOUT:.0f} (a week), not {seconds:g}"


def out_dir(path: str, prog: str) -> Path | None:
    """``--out``, created if need be and checked writable (a temporary file made and removed there)
    before anything runs; None, after one line on stderr naming the path and the OS error, if not."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        why = (
            "not a directory"
            if out.exists() and not out.is_dir()
            else f"cannot create or write there: {exc.strerror or exc}"
        )
        print(f"{prog}: error: --out {path}: {why}", file=sys.stderr)
        return None
    return out


def raise_open_files() -> int:
    """Raise the soft open-files limit to the hard one (each rank holds several connections); the new limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# ---------------------------------------------------------------------------------------- CLI


def _names(text: str, allowed: Sequence[str], aliases: dict[str, str]) -> list[str]:
    out: list[str] = []
    for name in (aliases.get(t.strip(), t.strip()) for t in text.split(",") if t.strip()):
        if name not in allowed:
            raise ValueError(f"unknown name {name!r}; choose from {', '.join(allowed)}")
        out += [] if name in out else [name]
    return out


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Options of ``python -m torch_ctrl bench``."""
    p = argparse.ArgumentParser(
        prog="torch-ctrl bench",
        description=(__doc__ or "").splitlines()[0].replace("``", ""),
        epilog="The ctrl rendezvous against torch's c10d: python -m torch_ctrl bench rendezvous --help",
    )
    add = p.add_argument
    add(
        "--world-sizes",
        default=None,
        help=f"comma-separated world sizes (default: 2,8,32,128,512 with threads, which accept N <= {MAX_THREADS}; "
        f"2,8,16 with processes or torchrun, which spawn a process per rank and accept N <= {MAX_SPAWNED}; "
        "--smoke: 2)",
    )
    add("--ops", default=None, help="ops; a rooted op's send/recv method names select it too (default: all)")
    add(
        "--payload",
        type=int,
        default=64,
        help=f"payload bytes, 0 to {MAX_PAYLOAD} (256 MiB) (default: %(default)s; e.g. 65536)",
    )
    add(
        "--rounds",
        type=int,
        default=None,
        help=f"timed rounds per op, up to {MAX_ROUNDS} (default: 20, --smoke: 3; half, >= 3, for N >= 256)",
    )
    add(
        "--store",
        default="raw,prefix",
        help="comma-separated store kinds every contender runs over, one after the other: raw (a TCPStore "
        "client per rank), prefix (a PrefixStore over a TCPStore client per rank, what torchrun, "
        "init_process_group and from_env() hand out; under torchrun, from_env()'s own namespace), file "
        "(a FileStore in a temp dir, a handle per rank), hash (one shared HashStore; threads only) "
        "(default: %(default)s)",
    )
    add(
        "--mode",
        choices=("threads", "processes", "torchrun"),
        default="threads",
        help="ranks are threads of this process, spawned processes, or the workers of a real "
        "'python -m torch_ctrl.run --standalone --nproc-per-node=N' job, taking torch_ctrl.from_env() "
        f"(threads: N <= {MAX_THREADS}; processes and torchrun: N <= {MAX_SPAWNED}, what a 2-core machine can "
        "spawn; default: %(default)s)",
    )
    add(
        "--contenders",
        default=None,
        help=f"subset of {','.join(CONTENDERS)} (default: all; with --mode threads, python only up to "
        f"N={PYTHON_THREADS_MAX} unless named here)",
    )
    add(
        "--order",
        choices=("interleaved", "blocks"),
        default="interleaved",
        help="interleaved: each round runs every contender once, in an order that rotates; blocks: each "
        "contender runs all its rounds back to back, as an application using one of them does "
        "(default: %(default)s)",
    )
    add("--out", default="./bench-out", help="output directory, created if need be (default: %(default)s)")
    add(
        "--timeout",
        type=float,
        default=120.0,
        help=f"per-op and store timeout, seconds, > 0 and <= {MAX_TIMEOUT:.0f} (a week) (default: %(default)s)",
    )
    add(
        "--count-world-sizes",
        default=None,
        help=f"world sizes of the store-call counts (threads, N <= {MAX_THREADS}), '' to skip "
        "(default: 2,8; --smoke: 2)",
    )
    add(
        "--count-store",
        default="hash",
        help="comma-separated store kinds under the CountingStores, as --store ('tcp' is raw) (default: %(default)s)",
    )
    add(
        "--smoke",
        action="store_true",
        help="quick check for CI: N=2, 3 rounds, every op and contender, counts at N=2; --world-sizes, "
        "--rounds, --ops, --contenders and --count-world-sizes given as well override these",
    )
    opts = p.parse_args(list(argv))
    # Left out: the defaults, those of --smoke with it (an option given explicitly wins over --smoke).
    if opts.world_sizes is None:
        opts.world_sizes = "2" if opts.smoke else "2,8,32,128,512" if opts.mode == "threads" else "2,8,16"
    if opts.rounds is None:
        opts.rounds = 3 if opts.smoke else 20
    if opts.count_world_sizes is None:
        opts.count_world_sizes = "2" if opts.smoke else "2,8"
    opts.ops = ",".join(OPS) if opts.ops is None else opts.ops
    named = opts.contenders is not None
    opts.contenders = opts.contenders if named else ",".join(CONTENDERS)
    opts.python_max = PYTHON_THREADS_MAX if opts.mode == "threads" and not named else None
    try:
        opts.worlds = [int(x) for x in opts.world_sizes.split(",") if x.strip()]
        opts.count_worlds = [int(x) for x in opts.count_world_sizes.split(",") if x.strip()]
        opts.ops = _names(opts.ops, OPS, METHOD_OPS)
        opts.contenders = _names(opts.contenders, CONTENDERS, {})
        opts.stores = _names(opts.store, STORES, {})
        opts.count_stores = _names(opts.count_store, STORES, {"tcp": "raw"})
    except ValueError as exc:
        p.error(str(exc))
    for option, given in (("--world-sizes", opts.worlds), ("--ops", opts.ops), ("--contenders", opts.contenders)):
        if not given:
            p.error(f"{option}: no {option[2:].replace('-', ' ')} given")
    if min(opts.worlds + opts.count_worlds) < 1 or opts.rounds < 1 or opts.payload < 0:
        p.error("world sizes and --rounds must be >= 1, --payload >= 0")
    if opts.rounds > MAX_ROUNDS:
        p.error(f"--rounds must be at most {MAX_ROUNDS}, not {opts.rounds}")
    if opts.payload > MAX_PAYLOAD:
        p.error(f"--payload must be at most {MAX_PAYLOAD} bytes (256 MiB), not {opts.payload}")
    why = timeout_error("--timeout", opts.timeout)
    if why:
        p.error(why)
    if not opts.stores or (opts.count_worlds and not opts.count_stores):
        p.error("--store and --count-store need at least one store kind")
    most = MAX_SPAWNED if opts.mode != "threads" else MAX_THREADS
    if max(opts.worlds) > most:
        p.error(f"--mode {opts.mode} supports world sizes up to {most}")
    if opts.count_worlds and max(opts.count_worlds) > MAX_THREADS:
        p.error(f"--count-world-sizes: the counts run a thread per rank, up to {MAX_THREADS}")
    if opts.mode != "threads" and "hash" in opts.stores:
        p.error(f"--store hash needs --mode threads (a HashStore lives in one process), not {opts.mode}")
    opts.data = b"x" * opts.payload
    opts.absent = {c: why for c, why in unavailable().items() if c in opts.contenders}
    opts.contenders = [c for c in opts.contenders if c not in opts.absent]
    if not opts.contenders:
        p.error("--contenders: none can run here: " + "; ".join(f"{c}: {why}" for c, why in opts.absent.items()))
    return opts


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark: print the tables, write ``results.json``, ``results.md`` and the plots."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["rendezvous"]:  # `bench rendezvous`: the ctrl rendezvous against c10d
        from .bench_rendezvous import main as rendezvous_main

        return rendezvous_main(args[1:])
    opts = parse_args(args)
    out = out_dir(opts.out, "python -m torch_ctrl bench")
    if out is None:
        return 2
    # torch's TCPStore looks up every peer's host name, on the server's event loop too: where DNS drops such
    # queries, each one stalls the whole server for the resolver timeout (5 s). Only connection setup does it.
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    meta = {**machine(), "command": "python -m torch_ctrl bench " + shlex.join(args), "open_files": raise_open_files()}
    meta.update(mode=opts.mode, stores=opts.stores, payload=opts.payload, rounds=opts.rounds, timeout_s=opts.timeout)
    meta.update(order=opts.order, world_sizes=opts.worlds, ops=opts.ops, contenders=opts.contenders)
    meta.update(count_world_sizes=opts.count_worlds, started=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    meta.update(count_stores=opts.count_stores if opts.count_worlds else [])
    print(
        f"# {meta['command']}\n# {meta['cpu']} x{meta['nproc']}, torch {meta['torch']}, mode={opts.mode}, "
        f"store={','.join(opts.stores)}, order={opts.order}, payload={opts.payload} B, open files {meta['open_files']}",
        flush=True,
    )
    if opts.mode == "torchrun":
        print("# ranks: the workers of python -m torch_ctrl.run --standalone; prefix = from_env()'s namespace")
    for c, why in opts.absent.items():
        print(f"# {LABELS[c]}: {why}; not measured", flush=True)
    meta["absent"] = {LABELS[c]: why for c, why in opts.absent.items()}
    if opts.python_max is not None and "python" in opts.contenders and max(opts.worlds) > opts.python_max:
        left_out = f"left out above N={opts.python_max} (threads; name it in --contenders to run it)"
        print(f"# {LABELS['python']}: {left_out}", flush=True)
        meta["absent"][LABELS["python"]] = left_out
    server = dist.TCPStore(
        "127.0.0.1", 0, None, True, timedelta(seconds=opts.timeout), wait_for_workers=False, use_libuv=True
    )
    tag, begin = f"bench{os.getpid()}", time.perf_counter()
    latency: list[dict[str, Any]] = []
    counts: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="torch_ctrl_bench_") as scratch:  # FileStores, torchrun plans
        opts.file_dir = scratch
        for world in opts.worlds:
            if opts.mode == "torchrun":
                from .bench_worker import run_job

                t0 = time.perf_counter()
                latency += run_job(world, opts.stores, opts, tag)
                print(f"# N={world}: {rounds_for(world, opts.rounds)} rounds in {time.perf_counter() - t0:.1f} s")
                continue
            for kind in opts.stores:
                t0 = time.perf_counter()
                latency += run_world(world, kind, server.port, opts, tag)
                took = time.perf_counter() - t0
                print(f"# N={world}, {kind}: {rounds_for(world, opts.rounds)} rounds in {took:.1f} s", flush=True)
        for kind in opts.count_stores:
            for n in opts.count_worlds:
                counts += count_ops(n, opts.ops, opts.data, opts.timeout, kind, server.port, scratch)
    meta["seconds"] = round(time.perf_counter() - begin, 1)
    return report(meta, latency, counts, opts, out)


def report(
    meta: dict[str, Any], latency: list[dict[str, Any]], counts: list[dict[str, Any]], opts: Any, out: Path
) -> int:
    """Print the tables, write ``results.json``, ``results.md`` and the plots; 1 if any op failed."""
    from . import bench_report

    text, liveness = bench_report.latency_report(latency, opts.contenders)
    if counts:
        text += "\n\n" + bench_report.count_tables(counts)
    print("\n" + text + "\n")
    (out / "results.json").write_text(
        json.dumps(dict(meta=meta, latency=latency, liveness_barrier_on_off=liveness, op_counts=counts), indent=1)
    )
    (out / "results.md").write_text(bench_report.header(meta) + "\n\n" + text + "\n")
    for note in bench_report.plots(latency, opts.ops, opts.contenders, out, f"mode={opts.mode}"):
        print(note)
    failures = sum(len(r["errors"]) for r in latency + counts)
    print(f"# wrote {out}/results.json, results.md; {failures} failed op(s); {meta['seconds']} s")
    return 1 if failures else 0
