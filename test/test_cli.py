"""The shipped commands run: the demo and a smoke benchmark (no timing assertions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(180)
def test_demo_runs_and_checks_results() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "torch_ctrl", "demo", "--rounds", "2"], capture_output=True, text=True, timeout=170
    )
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "torch_ctrl.run --standalone" in out.stdout  # a real torchrun job, ctrl backend
    assert "all results correct" in out.stdout
    assert "keys the demo left in the store: 0" in out.stdout
    assert "torchrun exited 0" in out.stdout
    for op in ("barrier", "broadcast_recv", "gather_recv", "scatter_recv", "all_gather", "all_sum"):
        assert op in out.stdout


@pytest.mark.timeout(240)
def test_bench_smoke(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "torch_ctrl", "bench", "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=230,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    data = json.loads((tmp_path / "results.json").read_text())
    assert data  # figures for every contender
    assert (tmp_path / "results.md").exists()


def test_cli_usage() -> None:
    out = subprocess.run([sys.executable, "-m", "torch_ctrl", "nope"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "usage" in out.stderr
