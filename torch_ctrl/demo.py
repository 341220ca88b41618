"""``python -m torch_ctrl demo``: run every collective across local processes, check it, time it.

The parent hosts a ``TCPStore``; ``--world-size`` spawned ranks connect to it, run the nine
collectives ``--rounds`` times per implementation (plus one mixed C++/Python round), check
the results and send their latencies back. The parent prints a summary and the number of
keys left in the store once every rank has closed its instances.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import statistics
import time
from datetime import timedelta
from typing import Any, Callable

OPS = (
    "barrier",
    "broadcast_send",
    "broadcast_recv",
    "gather_send",
    "gather_recv",
    "scatter_send",
    "scatter_recv",
    "all_gather",
    "all_sum",
)
TIMEOUT = 30.0  # seconds, for every collective
RESULT_WAIT = 120.0  # seconds the parent waits for all ranks


def _make(impl: str, store: Any, rank: int, world: int) -> Any:
    """An instance of implementation ``impl`` ("cpp" or "python")."""
    if impl == "cpp":
        from .cpp import CppStoreCollectives

        return CppStoreCollectives(store, rank, world)
    from .store_collectives import PyStoreCollectives

    return PyStoreCollectives(store, rank, world)


def _round(coll: Any, prefix: str, rank: int, world: int, lat: dict[str, list[float]]) -> None:
    """Run the nine collectives once under keys ``prefix/<collective>``; raise AssertionError on a wrong result."""
    names = [f"rank{i}".encode() for i in range(world)]
    parts = [f"{prefix}/part{i}".encode() for i in range(world)]

    def timed(op: str, fn: Callable[..., Any], *args: Any) -> Any:
        start = time.perf_counter()
        out = fn(f"{prefix}/{op.removesuffix('_send').removesuffix('_recv')}", *args, TIMEOUT)
        lat[op].append(time.perf_counter() - start)
        return out

    timed("barrier", coll.barrier)
    if rank == 0:
        timed("broadcast_send", coll.broadcast_send, prefix)
        gathered = timed("gather_recv", coll.gather_recv, names[0])
        assert gathered == names, f"gather_recv returned {gathered!r}"
        mine = timed("scatter_send", coll.scatter_send, parts)
    else:
        got = timed("broadcast_recv", coll.broadcast_recv)
        assert got == prefix.encode(), f"broadcast_recv returned {got!r}"
        timed("gather_send", coll.gather_send, names[rank])
        mine = timed("scatter_recv", coll.scatter_recv)
    assert mine == parts[rank], f"scatter returned {mine!r}"
    everyone = timed("all_gather", coll.all_gather, names[rank])
    assert everyone == names, f"all_gather returned {everyone!r}"
    total = timed("all_sum", coll.all_sum, rank + 1)
    assert total == world * (world + 1) // 2, f"all_sum returned {total}"


def _worker(rank: int, world: int, port: int, impls: list[str], rounds: int, mixed: bool, out: Any) -> None:
    """One rank: run every implementation's rounds, then the mixed round; report to ``out``."""
    lat: dict[str, dict[str, list[float]]] = {}
    errors: dict[str, str] = {}
    instances: list[Any] = []
    plan = [(impl, rounds) for impl in impls] + ([("mixed", 1)] if mixed else [])
    try:
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=TIMEOUT))
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        out.put({"rank": rank, "lat": lat, "errors": {name: f"rank {rank}: store: {exc}" for name, _ in plan}})
        return
    for name, count in plan:
        lat[name] = {op: [] for op in OPS}
        try:
            impl = name if name != "mixed" else ("cpp" if rank % 2 == 0 else "python")
            coll = _make(impl, store, rank, world)
            instances.append(coll)
            coll.barrier(f"demo/{name}/warmup", TIMEOUT)  # untimed: absorbs the ranks' start-up skew
            for r in range(count):
                _round(coll, f"demo/{name}/{r}", rank, world, lat[name])
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            errors[name] = f"rank {rank}: {type(exc).__name__}: {exc}"
    for coll in instances:
        coll.close()
    out.put({"rank": rank, "lat": lat, "errors": errors})


def _stats(samples: list[float]) -> str:
    """``median / max`` in microseconds, or a dash when there are no samples."""
    if not samples:
        return f"{'-':>10} {'-':>10}"
    return f"{statistics.median(samples) * 1e6:10.0f} {max(samples) * 1e6:10.0f}"


def main(argv: list[str] | None = None) -> int:
    """Run the demo; 0 when every collective returned the right result, else 1."""
    parser = argparse.ArgumentParser(
        prog="python -m torch_ctrl demo", description="Run every collective across local processes, check it, time it."
    )
    parser.add_argument("--world-size", type=int, default=4, help="number of rank processes (default 4)")
    parser.add_argument("--rounds", type=int, default=20, help="rounds per implementation (default 20)")
    parser.add_argument(
        "--impl", choices=("both", "cpp", "python"), default="both", help="implementation(s) to run (default both)"
    )
    args = parser.parse_args(argv)
    if args.world_size < 1 or args.rounds < 1:
        parser.error("--world-size and --rounds must be >= 1")

    import torch.distributed as dist

    import torch_ctrl

    impls = ["cpp", "python"] if args.impl == "both" else [args.impl]
    if "cpp" in impls:
        try:
            from . import cpp  # noqa: F401
        except Exception as exc:  # noqa: BLE001
            print(f"note: C++ extension unavailable ({type(exc).__name__}: {exc}); skipping the C++ runs")
            impls.remove("cpp")
    if not impls:
        return 1
    mixed = len(impls) == 2 and args.world_size > 1
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    print(
        f"torch_ctrl {torch_ctrl.__version__}: backend={torch_ctrl.backend()} world_size={args.world_size} "
        f"rounds={args.rounds} impls={','.join(impls)} store=127.0.0.1:{store.port}"
    )

    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(r, args.world_size, store.port, impls, args.rounds, mixed, results))
        for r in range(args.world_size)
    ]
    start = time.monotonic()
    for p in procs:
        p.start()
    reports: list[dict[str, Any]] = []
    deadline = start + RESULT_WAIT
    while len(reports) < len(procs) and time.monotonic() < deadline:
        try:
            reports.append(results.get(timeout=0.5))
        except queue.Empty:
            if not any(p.is_alive() for p in procs) and results.empty():
                break  # a rank died without reporting
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
    ok = len(reports) == len(procs)
    if not ok:
        missing = sorted(set(range(args.world_size)) - {rep["rank"] for rep in reports})
        print(f"FAILED: no result from rank(s) {missing} (crashed, or stuck for {RESULT_WAIT:.0f} s)")

    print(f"\n{'impl':<8} {'op':<16} {'n':>5} {'median_us':>10} {'max_us':>10}  result")
    for name in impls + (["mixed"] if mixed else []):
        errors = [rep["errors"][name] for rep in reports if name in rep["errors"]]
        ok = ok and not errors
        status = "ok" if not errors and len(reports) == len(procs) else "FAILED"
        lats = [rep["lat"].get(name, {}) for rep in reports]
        rows = {"all 9 ops": OPS} if name == "mixed" else {op: (op,) for op in OPS}
        note = "  (even ranks C++, odd ranks Python)" if name == "mixed" else ""
        for label, ops in rows.items():
            samples = [s for lat in lats for op in ops for s in lat.get(op, [])]
            print(f"{name:<8} {label:<16} {len(samples):>5} {_stats(samples)}  {status}{note}")
        for err in errors:
            print(f"  {err}")

    time.sleep(0.5)  # let the last background deletions land
    print(f"\nkeys left in the store: {store.num_keys()}   (elapsed {time.monotonic() - start:.1f} s)")
    print("all results correct" if ok else "FAILED: some collectives raised or returned wrong results")
    return 0 if ok else 1
