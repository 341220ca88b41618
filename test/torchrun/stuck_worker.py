"""Worker script for the inspect test: every rank but 1 waits in a from_env() barrier
``stuck``; rank 1 says so and never arrives (it waits until the test kills the job)."""

import os
import sys

import torch_ctrl

coll = torch_ctrl.from_env(timeout=60)
if os.environ["RANK"] == "1":
    print("RANK 1 STALLING", flush=True)
    sys.stdin.read()  # blocks until the job is killed (stdin is never closed by the test)
else:
    coll.barrier("stuck", timeout=170)
