"""``python -m torch_ctrl bench --mode torchrun``: every rank is a worker of a real torchrun job.

For each world size N the parent (:func:`run_job`) writes the plan (the tasks per store kind) to
``plan.json`` in a fresh directory and launches
``python -m torch_ctrl.run --standalone --nproc-per-node=N -m torch_ctrl.bench_worker`` with
``TORCH_CTRL_BENCH_DIR`` naming that directory. Each worker (:func:`worker`) runs the threads
mode's rank loop (:func:`torch_ctrl.bench.rank_main`) on the job's own store (``MASTER_ADDR``,
``MASTER_PORT``: the workers' TCPStore the agent hosts):

* ``prefix``: each contender over ``PrefixStore(<from_env() namespace>, TCPStore client)``, and the
  C++ contenders *are* ``torch_ctrl.from_env(store=client)``, i.e. what a user's worker runs;
* ``raw``: each contender over a TCPStore client of its own; ``file``: a FileStore in that directory.

The shared start barrier before every op is TCPStore's server-side ``barrier`` on a client of its
own (where this torch has none: ``add`` + ``wait``). Each rank writes its ``(start, end, error)``
per task to ``rank<r>.json``; once the job has exited the parent reads them and computes
``max(end) - min(start)`` per op over the ranks, as for threads (``perf_counter`` is the machine's
monotonic clock, common to all processes).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from . import capabilities
from .bench import HEARTBEAT, Make, World, make_instance, rank_main, summarize, world_for

ENV_DIR = "TORCH_CTRL_BENCH_DIR"  # the directory with plan.json, where ranks write rank<r>.json
LOG_TAIL = 3000  # characters of the job's output shown when it fails


class StoreSync:
    """The workers' shared start barrier: one server-side TCPStore barrier per call, under ``prefix``."""

    def __init__(self, store: dist.TCPStore, world: int, prefix: str) -> None:
        self.store, self.world, self.prefix, self.calls = store, world, prefix, 0

    def wait(self, secs: float) -> None:
        """Return once every rank has called this the same number of times (or raise after ``secs``)."""
        key, timeout = f"{self.prefix}/{self.calls}", timedelta(seconds=secs)
        self.calls += 1
        if capabilities.BARRIER:
            self.store.barrier(key, self.world, timeout)
            return
        if self.store.add(key, 1) == self.world:
            self.store.set(key + "/done", b"1")
        self.store.wait([key + "/done"], timeout)


def from_env_maker(kind: str) -> Make:
    """Instances as in threads mode, except that over ``prefix`` the C++ contenders are ``from_env()``."""

    def make(contender: str, store: dist.Store, rank: int, world: int) -> Any:
        if kind == "prefix" and contender in ("cpp", "cpp-hb"):
            import torch_ctrl

            coll = torch_ctrl.from_env(
                store=store.underlying_store,  # type: ignore[attr-defined]
                heartbeat_interval=HEARTBEAT if contender == "cpp-hb" else None,
            )
            if (coll.rank, coll.world_size) != (rank, world):  # type: ignore[attr-defined]
                raise RuntimeError(f"from_env() is rank {coll.rank} of {coll.world_size}, not {rank} of {world}")  # type: ignore[attr-defined]
            return coll
        return make_instance(contender, store, rank, world)

    return make


def worker(env: dict[str, str] | None = None) -> int:
    """One torchrun worker: every store kind of the plan in turn; writes ``rank<r>.json``; 0 on success."""
    from .workers import worker_namespace

    env = dict(os.environ if env is None else env)
    folder = Path(env[ENV_DIR])
    plan = json.loads((folder / "plan.json").read_text())
    rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
    host, port, namespace = env["MASTER_ADDR"], int(env["MASTER_PORT"]), worker_namespace(env)
    timeout = timedelta(seconds=plan["secs"])
    sync = StoreSync(
        dist.TCPStore(host, port, None, False, timeout, wait_for_workers=False), size, f"{namespace}/bench-sync"
    )
    out: dict[str, Any] = {}
    code = 0
    for kind in plan["stores"]:
        w = World(
            size,
            port,
            plan["contenders"],
            [tuple(t) for t in plan["tasks"][kind]],
            b"x" * plan["payload"],
            plan["secs"],
            plan["tag"],
            kind,
            host=host,
            prefix=namespace,
            file_dir=str(folder),
        )
        try:
            out[kind] = rank_main(w, rank, sync, make=from_env_maker(kind))
        except Exception as exc:  # noqa: BLE001 - reported by the parent; exiting non-zero ends the job
            out[kind], code = f"rank {rank}: {type(exc).__name__}: {exc}", 1
            break
    (folder / f"rank{rank}.json").write_text(json.dumps(out))
    return code


def run_job(world: int, stores: list[str], opts: argparse.Namespace, tag: str) -> list[dict[str, Any]]:
    """Run one torchrun job of ``world`` workers over every kind in ``stores``; the records, as
    :func:`torch_ctrl.bench.run_world` returns them. RuntimeError (with the job's output) if it fails."""
    folder = Path(tempfile.mkdtemp(prefix=f"torchrun-w{world}-", dir=opts.file_dir))
    plans = {kind: world_for(world, kind, 0, opts, tag) for kind in stores}
    plan = dict(stores=stores, contenders=opts.contenders, payload=opts.payload, secs=opts.timeout, tag=tag)
    plan["tasks"] = {kind: [list(t) for t in w.tasks] for kind, w in plans.items()}
    (folder / "plan.json").write_text(json.dumps(plan))
    cmd = [sys.executable, "-m", "torch_ctrl.run", "--standalone", f"--nproc-per-node={world}"]
    cmd += ["--monitor-interval=0.1", "-m", "torch_ctrl.bench_worker"]
    env = {**os.environ, ENV_DIR: str(folder), "RES_OPTIONS": os.environ.get("RES_OPTIONS", "timeout:1 attempts:1")}
    env["TMPDIR"] = str(folder)  # torchrun's log directory too: the run's scratch is removed after it
    wait = max(300.0, 3 * opts.timeout)  # an op that hangs fails after --timeout; this bounds a stuck job
    log = folder / "job.log"
    with log.open("w") as sink:
        job = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = job.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)  # the agent and its workers: the job's own session
            job.wait()
            code = None
    ranks = {r: json.loads(p.read_text()) for r in range(world) if (p := folder / f"rank{r}.json").exists()}
    failed = {r: v for r, data in ranks.items() for v in data.values() if isinstance(v, str)}
    if code != 0 or len(ranks) < world or failed:
        why = f"exited {code}" if code is not None else f"did not finish within {wait:.0f} s"
        tail = log.read_text()[-LOG_TAIL:]
        raise RuntimeError(f"torchrun job of {world} workers {why}; rank errors: {failed}; output:\n{tail}")
    records: list[dict[str, Any]] = []
    for kind, w in plans.items():
        records += summarize(w, {r: data[kind] for r, data in ranks.items()}, opts)
    return records


if __name__ == "__main__":
    sys.exit(worker())
