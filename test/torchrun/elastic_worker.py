"""Worker script for the elastic torchrun tests: ``elastic_worker.py MODE FINAL_WORLD``.

Every mode joins gloo through torchrun's environment (MASTER_ADDR/MASTER_PORT of the round).
While WORLD_SIZE differs from FINAL_WORLD the group is the one to be replaced:
  scale-up     print RUNNING and idle until the agent stops the workers (a node joins)
  scale-down   print LOOPING and all_reduce in a loop until a peer dies and the op fails
  replace      (whatever the world) in round 0: print IDLE and idle until the agent stops the
               workers (a spare takes a dead node's place); later rounds run as below
Once WORLD_SIZE == FINAL_WORLD: 20 all_reduces, checked, then "WORKER OK ..." and exit 0.
"""

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    mode, final = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    expected = world * (world + 1) / 2
    if mode == "replace" and os.environ.get("TORCH_CTRL_ROUND") == "0":
        print(f"IDLE rank={rank} world={world}", flush=True)
        while True:
            time.sleep(1.0)  # healthy, and no collective to fail: only the rendezvous can restart us
    if world != final:
        print(f"{'RUNNING' if mode == 'scale-up' else 'LOOPING'} rank={rank} world={world}", flush=True)
        while True:
            if mode == "scale-up":
                time.sleep(1.0)  # idle work: the agent stops us when a node joins
                continue
            t = torch.ones(1) * (rank + 1)
            dist.all_reduce(t)  # raises once a peer is gone; the agent then restarts the group
            assert t.item() == expected, t
            time.sleep(0.05)
    for _ in range(20):
        t = torch.ones(1) * (rank + 1)
        dist.all_reduce(t)
        assert t.item() == expected, t
    dist.destroy_process_group()
    print(
        f"WORKER OK rank={rank} world={world} round={os.environ.get('TORCH_CTRL_ROUND')} "
        f"restart_count={os.environ['TORCHELASTIC_RESTART_COUNT']}",
        flush=True,
    )


if __name__ == "__main__":
    main()
