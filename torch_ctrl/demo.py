"""``python -m torch_ctrl demo``: a real torchrun job on 127.0.0.1 that runs every collective,
checks it and times it.

The command launches ``python -m torch_ctrl.run --standalone`` (torchrun with the ``ctrl``
rendezvous backend; the agent hosts the TCPStore) with ``--world-size`` workers. Each worker
takes ``torch_ctrl.from_env()`` and runs the nine collectives ``--rounds`` times per
implementation (plus one mixed C++/Python round) on the same store, checking results.
Rank 0 gathers everyone's latencies with a ``gather`` and prints the table, then the number
of the demo's keys left in the store once every rank has closed its instances.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

from .base import METHODS

OPS = METHODS
TIMEOUT = 30.0  # seconds, for every collective
JOB_WAIT = 300.0  # seconds the command waits for the torchrun job


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


def _worker(impls: list[str], rounds: int) -> int:
    """One torchrun worker: every implementation's rounds, then the mixed round; rank 0 reports."""
    import torch.distributed as dist

    import torch_ctrl

    from .workers import worker_namespace

    ctrl = torch_ctrl.from_env(timeout=TIMEOUT)
    rank, world = ctrl.rank, ctrl.world_size  # type: ignore[attr-defined]
    store = dist.PrefixStore(
        worker_namespace(os.environ) + "/demo",
        dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, wait_for_workers=False
        ),
    )
    mixed = len(impls) == 2 and world > 1
    lat: dict[str, dict[str, list[float]]] = {}
    errors: dict[str, str] = {}
    for name, count in [(impl, rounds) for impl in impls] + ([("mixed", 1)] if mixed else []):
        lat[name] = {op: [] for op in OPS}
        impl = name if name != "mixed" else ("cpp" if rank % 2 == 0 else "python")
        try:
            with _make(impl, store, rank, world) as coll:
                # One untimed round first: its barrier absorbs the ranks' start-up skew, and the
                # connections the instance opens on first use (its lane, the background cleanup's
                # own) are made before the clock runs. A new TCPStore connection costs the server
                # a reverse lookup, which a slow resolver stretches to a second.
                _round(coll, f"{name}/warmup", rank, world, {op: [] for op in OPS})
                for r in range(count):
                    _round(coll, f"{name}/{r}", rank, world, lat[name])
        except Exception as exc:  # noqa: BLE001 - reported by rank 0
            errors[name] = f"rank {rank}: {type(exc).__name__}: {exc}"
    mine = json.dumps({"rank": rank, "lat": lat, "errors": errors})
    with ctrl:
        if rank != 0:
            ctrl.gather_send("demo/report", mine, TIMEOUT)
            return 0
        reports = [json.loads(r) for r in ctrl.gather_recv("demo/report", mine, TIMEOUT)]
    return _print(reports, impls + (["mixed"] if mixed else []), store)


def _stats(samples: list[float]) -> str:
    """``median / max`` in microseconds, or a dash when there are no samples."""
    if not samples:
        return f"{'-':>10} {'-':>10}"
    return f"{statistics.median(samples) * 1e6:10.0f} {max(samples) * 1e6:10.0f}"


def _print(reports: list[dict[str, Any]], names: list[str], store: Any) -> int:
    """Rank 0's table; 0 when every collective returned the right result."""
    ok = True
    print(f"\n{'impl':<8} {'op':<16} {'n':>5} {'median_us':>10} {'max_us':>10}  result")
    for name in names:
        errors = [rep["errors"][name] for rep in reports if name in rep["errors"]]
        ok = ok and not errors
        status = "ok" if not errors else "FAILED"
        lats = [rep["lat"].get(name, {}) for rep in reports]
        rows = {"all 9 ops": OPS} if name == "mixed" else {op: (op,) for op in OPS}
        note = "  (even ranks C++, odd ranks Python)" if name == "mixed" else ""
        for label, ops in rows.items():
            samples = [s for lat in lats for op in ops for s in lat.get(op, [])]
            print(f"{name:<8} {label:<16} {len(samples):>5} {_stats(samples)}  {status}{note}")
        for err in errors:
            print(f"  {err}")
    # Every rank closed its instances (flushing their cleanup) before the report gather.
    print(f"\nkeys the demo left in the store: {store.num_keys()}")
    print("all results correct" if ok else "FAILED: some collectives raised or returned wrong results", flush=True)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """Run the demo job; 0 when every collective returned the right result, else 1."""
    parser = argparse.ArgumentParser(
        prog="torch-ctrl demo",
        description="A torchrun job on 127.0.0.1 that runs every collective, checks it and times it.",
    )
    parser.add_argument("--world-size", type=int, default=4, help="number of worker processes (default 4)")
    parser.add_argument("--rounds", type=int, default=20, help="rounds per implementation (default 20)")
    parser.add_argument(
        "--impl", choices=("both", "cpp", "python"), default="both", help="implementation(s) to run (default both)"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.world_size < 1 or args.rounds < 1:
        parser.error("--world-size and --rounds must be >= 1")

    import torch_ctrl

    impls = ["cpp", "python"] if args.impl == "both" else [args.impl]
    if "cpp" in impls and torch_ctrl.import_error() is not None:
        print(f"note: C++ extension unavailable ({torch_ctrl.import_error()}); skipping the C++ runs")
        impls.remove("cpp")
    if not impls:
        return 1
    if args.worker:
        return _worker(impls, args.rounds)
    print(
        f"torch_ctrl {torch_ctrl.__version__}: backend={torch_ctrl.backend()} world_size={args.world_size} "
        f"rounds={args.rounds} impls={','.join(impls)}: torchrun --rdzv-backend=ctrl on 127.0.0.1",
        flush=True,
    )
    cmd = [
        sys.executable,
        "-m",
        "torch_ctrl.run",
        "--standalone",
        f"--nproc-per-node={args.world_size}",
        "--monitor-interval=0.1",
        "-m",
        "torch_ctrl.demo",
        "--worker",
        f"--rounds={args.rounds}",
        f"--impl={'both' if len(impls) == 2 else impls[0]}",
    ]
    print("$ python " + " ".join(cmd[1:]), flush=True)
    start = time.monotonic()
    try:
        # torch's TCPStore resolves each connecting peer's name, on the agent's server thread
        # too; where DNS drops such queries each one stalls for the resolver's timeout (5 s),
        # which would show as a 5 s collective. Unless set, the job's processes wait 1 s at most.
        env = {**os.environ, "RES_OPTIONS": os.environ.get("RES_OPTIONS", "timeout:1 attempts:1")}
        # torchrun makes a log directory under TMPDIR for every run and never removes it: a
        # demo leaves nothing behind.
        with tempfile.TemporaryDirectory(prefix="torch_ctrl_demo_") as tmp:
            code = subprocess.run(cmd, timeout=JOB_WAIT, env={**env, "TMPDIR": tmp}).returncode
    except subprocess.TimeoutExpired:
        print(f"FAILED: the torchrun job did not finish within {JOB_WAIT:.0f} s")
        return 1
    print(f"torchrun exited {code} after {time.monotonic() - start:.1f} s")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    from .broken_pipe import run

    sys.exit(run(main))
