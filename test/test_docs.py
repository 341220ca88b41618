"""The documentation site builds without a warning (``sphinx-build -W``, every reference
resolved), and its API reference covers every public name, each with an example."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

import torch_ctrl
import torch_ctrl.elastic

pytest.importorskip("sphinx")
pytest.importorskip("myst_parser")

ROOT = Path(__file__).resolve().parent.parent
PAGES = (
    "index",
    "quickstart",
    "inspect",
    "troubleshooting",
    "torchrun",
    "migration",
    "api",
    "protocol",
    "benchmarks",
    "benchmarks-history",
)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("html")
    # Pure Python, as a docs build without the C++ extension would run.
    env = {**os.environ, "TORCH_CTRL_IMPL": "python"}
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(ROOT / "docs"), str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    assert "WARNING" not in result.stderr, result.stderr[-5000:]
    return out


@pytest.mark.timeout(240)
def test_every_page_builds(site: Path) -> None:
    for page in PAGES:
        assert (site / f"{page}.html").is_file(), page
    assert "torch-ctrl inspect" in (site / "troubleshooting.html").read_text()


@pytest.mark.timeout(240)
def test_api_reference_covers_every_public_name(site: Path) -> None:
    html = (site / "api.html").read_text()
    names = [f"torch_ctrl.{n}" for n in torch_ctrl.__all__]
    names += [f"torch_ctrl.elastic.{n}" for n in torch_ctrl.elastic.__all__ if n != "store"]
    names += [f"torch_ctrl.elastic.store.{n}" for n in torch_ctrl.elastic.store.__all__]
    missing = [n for n in names if f'id="{n}"' not in html]
    assert 'id="module-torch_ctrl.elastic.store"' in html
    assert not missing, missing
    for method in ("barrier", "broadcast_send", "gather_recv", "scatter_send", "all_gather", "all_sum", "abort"):
        assert f'id="torch_ctrl.ControlCollectives.{method}"' in html, method


def test_every_public_callable_has_an_example() -> None:
    objects = [getattr(torch_ctrl, n) for n in torch_ctrl.__all__]
    objects += [getattr(torch_ctrl.elastic, n) for n in torch_ctrl.elastic.__all__ if n != "store"]
    objects += [getattr(torch_ctrl.elastic.store, n) for n in torch_ctrl.elastic.store.__all__]
    objects += [getattr(torch_ctrl.ControlCollectives, m) for m in ("barrier", "all_gather", "abort", "close")]
    lacking = [getattr(o, "__qualname__", repr(o)) for o in objects if "Example" not in (inspect.getdoc(o) or "")]
    assert not lacking, lacking
