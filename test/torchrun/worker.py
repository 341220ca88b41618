"""Worker script for the torchrun tests: ``worker.py MODE [ARG]``.

Modes:
  collectives        every collective through torch_ctrl.from_env(), results checked
  fail-after SECS    on the node started with CTRL_TEST_FAIL=1, local rank 1 exits 3 after
                     SECS seconds (a workload, not synchronization); other workers exit 0
  fail-blocked       as fail-after 0, but the other workers block in a from_env() barrier
  fail-running SECS  as fail-after 0, but the other workers work (sleep) SECS seconds
  node-works SECS    the workers of the CTRL_TEST_FAIL=1 node print WORKING and work SECS
                     seconds; the other node's workers exit 0 at once
  lost-node SECS     as node-works, but the other node's workers block in a from_env()
                     barrier (timeout SECS) that the working node's never join
  fail-working SECS  the workers of the CTRL_TEST_FAIL=1 node print WORKING; there local rank
                     1 exits 3 after SECS seconds; every other worker works (sleeps) 120 s
  flaky-ctrl MARKER  rank 1 exits 3 on the first attempt (no MARKER file yet); then collectives
  flaky-gloo MARKER  the same, then init_process_group("gloo") and an all_reduce
"""

import os
import sys
import time


def collectives() -> None:
    import torch_ctrl

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with torch_ctrl.from_env(timeout=60) as coll:
        coll.barrier(timeout=60)
        if rank == 0:
            coll.broadcast_send(data=b"hello", timeout=60)
        else:
            assert coll.broadcast_recv(timeout=60) == b"hello"
        if rank == 0:
            assert coll.gather_recv(data=b"0", timeout=60) == [str(r).encode() for r in range(world)]
        else:
            coll.gather_send(data=str(rank), timeout=60)
        if rank == 0:
            assert coll.scatter_send(data=[b"s%d" % r for r in range(world)], timeout=60) == b"s0"
        else:
            assert coll.scatter_recv(timeout=60) == b"s%d" % rank
        assert coll.all_gather(data=str(rank), timeout=60) == [str(r).encode() for r in range(world)]
        assert coll.all_sum(data=rank, timeout=60) == world * (world - 1) // 2
    count = os.environ["TORCHELASTIC_RESTART_COUNT"]
    print(f"WORKER OK rank={rank} round={os.environ.get('TORCH_CTRL_ROUND')} restart_count={count}", flush=True)


def gloo() -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    world = dist.get_world_size()
    assert t.item() == world * (world + 1) / 2, t
    dist.destroy_process_group()
    count = os.environ["TORCHELASTIC_RESTART_COUNT"]
    print(f"WORKER OK gloo rank={os.environ['RANK']} restart_count={count}", flush=True)


def main() -> None:
    mode = sys.argv[1]
    failing = os.environ.get("CTRL_TEST_FAIL") == "1" and os.environ["LOCAL_RANK"] == "1"
    if mode == "collectives":
        collectives()
    elif mode in ("fail-after", "fail-blocked", "fail-running"):
        if failing:
            time.sleep(float(sys.argv[2]) if mode == "fail-after" else 0.0)
            sys.exit(3)
        if mode == "fail-running":
            time.sleep(float(sys.argv[2]))
        if mode == "fail-blocked":
            import torch_ctrl

            torch_ctrl.from_env(timeout=60).barrier(timeout=120)
    elif mode in ("node-works", "lost-node"):
        if os.environ.get("CTRL_TEST_FAIL") == "1":
            print("WORKING", flush=True)
            time.sleep(float(sys.argv[2]))
        elif mode == "lost-node":
            import torch_ctrl

            print(f"BACKEND {torch_ctrl.backend()}", flush=True)
            try:
                torch_ctrl.from_env(timeout=60).barrier(key="never", timeout=float(sys.argv[2]))
            except Exception as exc:
                # One write of one line: the two workers' tracebacks share the job's stderr and
                # interleave character by character; a pipe keeps a write under 4 KiB whole.
                os.write(2, f"WORKER ERROR {type(exc).__name__}: {exc}\n".encode()[:4000])
                sys.exit(1)
    elif mode == "fail-working":
        if os.environ.get("CTRL_TEST_FAIL") == "1":
            print("WORKING", flush=True)
            if failing:
                time.sleep(float(sys.argv[2]))
                sys.exit(3)
        time.sleep(120)
    elif mode in ("flaky-ctrl", "flaky-gloo"):
        marker = sys.argv[2]
        if os.environ["RANK"] == "1" and not os.path.exists(marker):
            open(marker, "w").close()
            sys.exit(3)
        collectives() if mode == "flaky-ctrl" else gloo()
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
