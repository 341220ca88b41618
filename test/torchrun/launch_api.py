"""Runs a job through torch's launcher API (``elastic_launch``), as a library would:
``launch_api.py BACKEND``. Each of the 2 workers runs a barrier, an all_gather and an all_sum
through ``torch_ctrl.from_env()`` and returns what its all_gather got and the round it saw; the
launcher prints the results."""

import os
import sys
import uuid


def work() -> tuple[list[str], str]:
    import torch_ctrl

    rank = int(os.environ["RANK"])
    with torch_ctrl.from_env(timeout=60) as coll:
        coll.barrier(timeout=60)
        got = coll.all_gather(data=str(rank), timeout=60)
        assert coll.all_sum(data=rank + 1, timeout=60) == 3
    return [bytes(g).decode() for g in got], os.environ.get("TORCH_CTRL_ROUND", "unset")


if __name__ == "__main__":
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=2,
        run_id=str(uuid.uuid4()),
        rdzv_backend=sys.argv[1],
        rdzv_endpoint="127.0.0.1:0",
        rdzv_configs={"join_timeout": 60},
        max_restarts=0,
        monitor_interval=0.1,
    )
    results = elastic_launch(config, work)()
    print("RESULTS", sorted(results.items()), flush=True)
