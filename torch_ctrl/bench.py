"""``python -m torch_ctrl bench``: latency and store traffic of the collectives, next to torch's.

One run uses one TCPStore server (libuv backend). A world of N ranks is N threads (or N
processes, ``--mode processes``); every rank has its own TCPStore client per contender, and
the instances are made once per N and reused across rounds, with a unique key per round.
Rounds interleave the contenders (their order rotates each round, so that none always runs
right after another one's background cleanup). All ranks start each op on a shared barrier;
an op's time is ``max(end) - min(start)`` over the ranks. See ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from queue import Empty
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.elastic.utils import store as elastic_store

from . import capabilities, loader
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
LABELS = dict(zip(CONTENDERS, (*_NAMES, "elastic.utils.store", "TCPStore.barrier", "floor (1 add)")))
HEARTBEAT = 1.0  # cpp-hb: torch_ctrl C++ with liveness on (heartbeat_interval, seconds)
Task = tuple[str, int, str]  # (op, round, contender); round -1 is the warm-up
Timing = tuple[float, float, str]  # (start, end, error or "")


@dataclass
class World:
    """What every rank of one world size needs (picklable, for ``--mode processes``)."""

    size: int
    port: int
    contenders: Sequence[str]
    tasks: Sequence[Task]
    payload: bytes
    secs: float
    tag: str


def supports(contender: str, op: str) -> bool:
    """Whether ``contender`` implements ``op`` (the floor stands in for any op)."""
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


def schedule(ops: Sequence[str], contenders: Sequence[str], rounds: int) -> list[Task]:
    """Run order: per op, a warm-up round then the timed ones, the contenders' order rotating each round."""
    out: list[Task] = []
    for op in ops:
        present = [c for c in contenders if supports(c, op)]
        for rnd in range(-1, rounds):
            shift = rnd % len(present) if present else 0
            out += [(op, rnd, c) for c in present[shift:] + present[:shift]]
    return out


def rank_main(w: World, rank: int, sync: Any) -> list[Timing]:
    """One rank: a client and an instance per contender, then every task, each started on the shared barrier."""
    secs, timeout = w.secs, timedelta(seconds=w.secs)
    clients = {
        c: dist.TCPStore("127.0.0.1", w.port, None, False, timeout, wait_for_workers=False) for c in w.contenders
    }
    insts = {c: make_instance(c, store, rank, w.size) for c, store in clients.items()}
    out: list[Timing] = []
    sync.wait(secs)
    for op, rnd, c in w.tasks:
        key, err = f"{w.tag}/{c}/w{w.size}/{op}/{rnd}", ""
        sync.wait(secs)
        start = time.perf_counter()
        try:
            call_op(c, insts[c], op, key, rank, w.size, w.payload, secs)
        except Exception as exc:  # noqa: BLE001 - recorded and reported; the run goes on
            err = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
        out.append((start, time.perf_counter(), err))
    sync.wait(secs)
    for inst in insts.values():
        if hasattr(inst, "close"):
            inst.close()
    return out


def _process_rank(w: World, rank: int, sync: Any, queue: Any) -> None:
    """``--mode processes``: run one rank in this process and send its timings back."""
    try:
        queue.put((rank, rank_main(w, rank, sync)))
    except Exception as exc:  # noqa: BLE001 - the parent reports it
        queue.put((rank, f"{type(exc).__name__}: {exc}"))


def run_world(world: int, port: int, opts: argparse.Namespace, tag: str) -> list[dict[str, Any]]:
    """Every round at one world size: one record per (op, contender)."""
    rounds = rounds_for(world, opts.rounds)
    tasks = schedule(opts.ops, opts.contenders, rounds)
    w = World(world, port, opts.contenders, tasks, opts.data, opts.timeout, tag)
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
    failed = {r: v for r, v in results.items() if isinstance(v, str)}
    if failed:
        raise RuntimeError(f"world size {world}: rank(s) failed: {failed}")
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
    for op, c in ((op, c) for op in opts.ops for c in opts.contenders if supports(c, op)):
        ms = samples.get((op, c), [])
        stats = (statistics.median(ms), min(ms), max(ms)) if ms else (None, None, None)
        records.append({"world_size": world, "op": op, "contender": c, "rounds": rounds, "samples_ms": ms})
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
    world: int, ops: Sequence[str], payload: bytes, secs: float, kind: str, port: int
) -> list[dict[str, Any]]:
    """Each op once per full-API contender, every rank (a thread) on its own CountingStore.

    The CountingStores wrap one shared HashStore (``kind="hash"``) or one TCPStore client each, on the
    server at ``port`` (``"tcp"``; a TCPStore client cannot be shared by threads that block in it).
    Per rank: ``critical`` = the calls made on the rank's own thread (its critical path); ``at_return`` =
    all calls counted once every rank has returned, before ``close()``; ``total`` = all calls after
    ``close()`` flushed the background cleanup.
    """
    shared = dist.HashStore()
    timeout = timedelta(seconds=secs)

    def inner() -> dist.Store:
        return (
            shared if kind == "hash" else dist.TCPStore("127.0.0.1", port, None, False, timeout, wait_for_workers=False)
        )

    counted = [c for c in COUNTED if c not in unavailable()]
    return [count_one(world, op, c, inner, payload, secs, kind) for op in ops for c in counted]


def count_one(
    world: int, op: str, c: str, inner: Callable[[], dist.Store], payload: bytes, secs: float, kind: str
) -> dict[str, Any]:
    """One op of one contender for :func:`count_ops`."""
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
    crit = [sum(p.get("critical", {}).values()) for p in per_rank]
    rec = {"world_size": world, "op": op, "contender": c, "inner_store": kind, "critical_root": crit[0]}
    rec["critical_other_mean"] = statistics.mean(crit[1:]) if world > 1 else None
    rec["total_mean"] = statistics.mean(sum(p.get("total", {}).values()) for p in per_rank)
    return {**rec, "errors": [p["error"] for p in per_rank if "error" in p], "per_rank": per_rank}


# ------------------------------------------------------------------------------------- output


def _md(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _cells(records: list[dict[str, Any]]) -> tuple[list[tuple[str, int]], dict[tuple[str, int, str], dict[str, Any]]]:
    keys = sorted({(r["op"], r["world_size"]) for r in records}, key=lambda k: (OPS.index(k[0]), k[1]))
    return keys, {(r["op"], r["world_size"], r["contender"]): r for r in records}


def latency_tables(records: list[dict[str, Any]], contenders: Sequence[str]) -> str:
    """Markdown: the medians with their ratio to torch's class, then the min-max spread."""
    keys, cell = _cells(records)

    def fmt(r: dict[str, Any] | None, spread: bool) -> str:
        if r is None:
            return ""
        if r["median_ms"] is None:
            return f"failed ({len(r['errors'])})"
        text = f"{r['min_ms']:.2f}-{r['max_ms']:.2f}" if spread else f"{r['median_ms']:.2f}"
        if not spread and r["ratio"] is not None and r["contender"] != BASELINE:
            text += f" ({r['ratio']:.2f}x)"
        return text + (f" ({len(r['errors'])} failed)" if r["errors"] else "")

    head = ["op", "N"] + [LABELS[c] for c in contenders]
    out = []
    for spread, title in ((False, "median, ms (ratio to torch._StoreCollectives)"), (True, "min-max, ms")):
        rows = [[op, str(n)] + [fmt(cell.get((op, n, c)), spread) for c in contenders] for op, n in keys]
        out.append(f"**Latency over rounds: {title}**\n\n" + _md(head, rows))
    return "\n\n".join(out)


def liveness_ratios(records: list[dict[str, Any]]) -> dict[int, float]:
    """Barrier median of ``cpp-hb`` (liveness on) over ``cpp`` (off), per N where both ran."""
    _, cell = _cells(records)
    out = {}
    for (op, n, c), r in sorted(cell.items(), key=lambda kv: kv[0][1]):
        off = cell.get((op, n, "cpp"), {}).get("median_ms")
        if op == "barrier" and c == "cpp-hb" and off and r["median_ms"] is not None:
            out[n] = r["median_ms"] / off
    return out


def liveness_line(ratios: dict[int, float]) -> str:
    """One line: the barrier's latency with liveness on over off, per N."""
    cells = ", ".join(f"N={n} {x:.2f}x" for n, x in ratios.items())
    return f"liveness on/off (barrier, heartbeat_interval={HEARTBEAT:g} s): {cells}"


def count_tables(records: list[dict[str, Any]]) -> str:
    """Markdown: store operations per op per rank, and the critical path by method at the largest N."""
    keys, cell = _cells(records)

    def fmt(r: dict[str, Any]) -> str:
        other = "-" if r["critical_other_mean"] is None else f"{r['critical_other_mean']:.3g}"
        return f"{r['critical_root']} / {other}" + ("" if r["contender"] == BASELINE else f" ({r['total_mean']:.3g})")

    counted = [c for c in COUNTED if any(r["contender"] == c for r in records)]
    rows = [[op, str(n)] + [fmt(cell[(op, n, c)]) for c in counted] for op, n in keys]
    top = max(n for _, n in keys)
    detail = []
    for op, c in ((op, c) for op, n in keys if n == top for c in counted):
        ranks = cell[(op, top, c)]["per_rank"][:2]
        detail.append(
            [op, LABELS[c]] + [", ".join(f"{m} {k}" for m, k in p.get("critical", {}).items()) for p in ranks]
        )
    return (
        "**Store calls per rank: critical path, rank 0 (root) / other ranks (mean); (total incl. cleanup, mean)**\n\n"
        + _md(["op", "N"] + [LABELS[c] for c in counted], rows)
        + f"\n\n**Critical-path store calls by method, N={top}**\n\n"
        + _md(["op", "implementation", "rank 0 (root)", "rank 1"], detail)
    )


def plot(records: list[dict[str, Any]], ops: Sequence[str], contenders: Sequence[str], path: Path) -> str:
    """Latency vs world size, log-log, a subplot per op, a line per contender; returns a note to print."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install 'torch-ctrl[plot]')"
    cols, rows = min(3, len(ops)), (len(ops) + 2) // 3
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4 * rows), squeeze=False)
    for ax, op in zip(axes.flat, ops):
        for c in contenders:
            rs = [r for r in records if (r["op"], r["contender"]) == (op, c) and r["median_ms"]]
            if rs:
                xs, med = [r["world_size"] for r in rs], [r["median_ms"] for r in rs]
                err = [[m - r["min_ms"] for m, r in zip(med, rs)], [r["max_ms"] - m for m, r in zip(med, rs)]]
                ax.errorbar(xs, med, yerr=err, marker="o", capsize=2, label=LABELS[c], color=f"C{CONTENDERS.index(c)}")
        ax.set(xscale="log", yscale="log", title=op, xlabel="world size (ranks)", ylabel="median latency (ms)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(ops) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor()
    return dict(nproc=os.cpu_count(), cpu=cpu, torch=torch.__version__, python=platform.python_version())


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
    p = argparse.ArgumentParser(prog="python -m torch_ctrl bench", description=(__doc__ or "").splitlines()[0])
    add = p.add_argument
    add("--world-sizes", default="2,8,32,128,512", help="comma-separated world sizes (default: %(default)s)")
    add("--ops", default=",".join(OPS), help="ops; a rooted op's send/recv method names select it too (default: all)")
    add("--payload", type=int, default=64, help="payload bytes (default: %(default)s; e.g. 65536)")
    add("--rounds", type=int, default=20, help="timed rounds per op (default: %(default)s; half, >= 3, for N >= 256)")
    add("--mode", choices=("threads", "processes"), default="threads", help="ranks are threads or processes (N <= 16)")
    add("--contenders", default=",".join(CONTENDERS), help="subset of %(default)s")
    add("--out", default="./bench-out", help="output directory (default: %(default)s)")
    add("--timeout", type=float, default=120.0, help="per-op and store timeout, seconds (default: %(default)s)")
    add("--count-world-sizes", default="2,8", help="world sizes of the store-call counts, '' to skip (default: 2,8)")
    add(
        "--count-store",
        choices=("hash", "tcp"),
        default="hash",
        help="store(s) under the CountingStores (default: hash)",
    )
    add("--smoke", action="store_true", help="quick check for CI: N=2, 3 rounds, every op and contender")
    opts = p.parse_args(list(argv))
    if opts.smoke:
        opts.world_sizes, opts.rounds, opts.ops, opts.contenders = "2", 3, ",".join(OPS), ",".join(CONTENDERS)
        opts.count_world_sizes = "2"
    try:
        opts.worlds = [int(x) for x in opts.world_sizes.split(",") if x.strip()]
        opts.count_worlds = [int(x) for x in opts.count_world_sizes.split(",") if x.strip()]
        opts.ops = _names(opts.ops, OPS, METHOD_OPS)
        opts.contenders = _names(opts.contenders, CONTENDERS, {})
    except ValueError as exc:
        p.error(str(exc))
    if not opts.worlds or min(opts.worlds + opts.count_worlds) < 1 or opts.rounds < 1 or opts.payload < 0:
        p.error("world sizes and --rounds must be >= 1, --payload >= 0")
    if opts.mode == "processes" and max(opts.worlds) > 16:
        p.error("--mode processes supports world sizes up to 16")
    opts.data = b"x" * opts.payload
    opts.absent = {c: why for c, why in unavailable().items() if c in opts.contenders}
    opts.contenders = [c for c in opts.contenders if c not in opts.absent]
    return opts


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark: print the tables, write ``results.json``, ``results.md`` and ``latency.png``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["rendezvous"]:  # `bench rendezvous`: the ctrl rendezvous against c10d
        from .bench_rendezvous import main as rendezvous_main

        return rendezvous_main(args[1:])
    opts = parse_args(args)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    # torch's TCPStore looks up every peer's host name, on the server's event loop too: where DNS drops such
    # queries, each one stalls the whole server for the resolver timeout (5 s). Only connection setup does it.
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    meta = {**machine(), "command": "python -m torch_ctrl bench " + shlex.join(args), "open_files": raise_open_files()}
    meta.update(mode=opts.mode, payload=opts.payload, rounds=opts.rounds, timeout_s=opts.timeout)
    print(
        f"# {meta['command']}\n# {meta['cpu']} x{meta['nproc']}, torch {meta['torch']}, mode={opts.mode}, "
        f"payload={opts.payload} B, open files {meta['open_files']}",
        flush=True,
    )
    for c, why in opts.absent.items():
        print(f"# {LABELS[c]}: {why}; not measured", flush=True)
    meta["absent"] = {LABELS[c]: why for c, why in opts.absent.items()}
    server = dist.TCPStore(
        "127.0.0.1", 0, None, True, timedelta(seconds=opts.timeout), wait_for_workers=False, use_libuv=True
    )
    tag, begin = f"bench{os.getpid()}", time.perf_counter()
    latency: list[dict[str, Any]] = []
    for world in opts.worlds:
        t0 = time.perf_counter()
        latency += run_world(world, server.port, opts, tag)
        print(f"# N={world}: {rounds_for(world, opts.rounds)} rounds in {time.perf_counter() - t0:.1f} s", flush=True)
    counts = []
    for n in opts.count_worlds:
        counts += count_ops(n, opts.ops, opts.data, opts.timeout, opts.count_store, server.port)
    meta["seconds"] = round(time.perf_counter() - begin, 1)
    text = latency_tables(latency, opts.contenders)
    liveness = liveness_ratios(latency)
    if liveness:
        text += "\n\n" + liveness_line(liveness)
    if counts:
        text += f"\n\n{count_tables(counts)}\n\n(CountingStore over a {opts.count_store} store)"
    print("\n" + text + "\n")
    (out / "results.json").write_text(
        json.dumps(dict(meta=meta, latency=latency, liveness_barrier_on_off=liveness, op_counts=counts), indent=1)
    )
    (out / "results.md").write_text(text + "\n")
    print(plot(latency, opts.ops, opts.contenders, out / "latency.png"))
    failures = sum(len(r["errors"]) for r in latency + counts)
    print(f"# wrote {out}/results.json, results.md; {failures} failed op(s); {meta['seconds']} s")
    return 1 if failures else 0
