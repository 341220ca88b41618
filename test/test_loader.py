"""Choosing the implementation, the pure-Python fallback, registration in torch.distributed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.distributed as dist

import torch_ctrl

ROOT = Path(__file__).resolve().parents[1]


def _python(
    code: str, env: dict[str, str] | None = None, cwd: Path | None = None, flags: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    full = dict(os.environ)
    full.update(env or {})
    return subprocess.run(
        [sys.executable, *flags, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full,
        cwd=cwd,
        timeout=120,
    )


def test_registers_in_torch_distributed() -> None:
    assert dist.StoreCollectives is torch_ctrl.StoreCollectives
    assert dist.ControlCollectives is torch_ctrl.ControlCollectives
    torch_ctrl.register()  # idempotent
    assert dist.StoreCollectives is torch_ctrl.StoreCollectives
    # torch's own private classes are left alone
    assert dist._StoreCollectives.__module__.startswith("torch")


def test_both_implementations_are_control_collectives() -> None:
    store = dist.HashStore()
    assert isinstance(torch_ctrl.PyStoreCollectives(store, 0, 1), torch_ctrl.ControlCollectives)
    assert isinstance(torch_ctrl.StoreCollectives(store, 0, 1), torch_ctrl.ControlCollectives)


def test_cpp_backend_when_required() -> None:
    if os.environ.get("TORCH_CTRL_REQUIRE_CPP") != "1":
        pytest.skip("set TORCH_CTRL_REQUIRE_CPP=1 to require the C++ extension (CI does)")
    assert torch_ctrl.backend() == "cpp", torch_ctrl.import_error()
    assert torch_ctrl.import_error() is None


def test_impl_python_forced() -> None:
    out = _python(
        """
        import torch_ctrl
        print(torch_ctrl.backend(), torch_ctrl.StoreCollectives is torch_ctrl.PyStoreCollectives)
        """,
        {"TORCH_CTRL_IMPL": "python"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["python", "True"]


BREAK_EXTENSION = """
import sys
sys.modules["torch_ctrl._C"] = None  # the extension fails to import
"""


def test_fallback_warns_once_and_works() -> None:
    out = _python(
        BREAK_EXTENSION
        + """
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch_ctrl
    import importlib
msgs = [str(w.message) for w in caught if "torch_ctrl" in str(w.message)]
import torch.distributed as dist
coll = torch_ctrl.StoreCollectives(dist.HashStore(), 0, 1)
print(torch_ctrl.backend(), len(msgs), type(torch_ctrl.import_error()).__name__, coll.all_sum("k", 3))
print(msgs[0])
""",
        {"TORCH_CTRL_IMPL": "auto"},
    )
    assert out.returncode == 0, out.stderr
    first, message = out.stdout.splitlines()[:2]
    assert first in ("python 1 ImportError 3", "python 1 ModuleNotFoundError 3")
    assert "C++ extension unavailable" in message and "torch_ctrl._C" in message


def test_impl_cpp_without_extension_raises() -> None:
    out = _python(BREAK_EXTENSION + "import torch_ctrl\n", {"TORCH_CTRL_IMPL": "cpp"})
    assert out.returncode != 0
    assert "ImportError: TORCH_CTRL_IMPL=cpp but the C++ extension torch_ctrl._C is unusable" in out.stderr


def test_bad_impl_value() -> None:
    out = _python("import torch_ctrl\n", {"TORCH_CTRL_IMPL": "fortran"})
    assert out.returncode != 0 and "TORCH_CTRL_IMPL must be auto, cpp or python" in out.stderr


@pytest.mark.timeout(300)
def test_install_without_compiling(tmp_path: Path) -> None:
    """TORCH_CTRL_BUILD_EXT=0 installs a working pure-Python package."""
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns("*.so", "build", ".git", "*.egg-info", "__pycache__"))
    target = tmp_path / "site"
    env = dict(os.environ, TORCH_CTRL_BUILD_EXT="0")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-build-isolation",
            "--no-deps",
            "-q",
            "--target",
            str(target),
            str(src),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=280,
    )
    assert res.returncode == 0, res.stderr
    assert not list(target.glob("torch_ctrl/_C*"))
    out = _python(
        f"""
        import warnings
        warnings.simplefilter("ignore")
        import torch_ctrl, torch.distributed as dist
        coll = torch_ctrl.StoreCollectives(dist.HashStore(), 0, 1)
        print(torch_ctrl.__file__.startswith({str(target)!r}), torch_ctrl.backend(), coll.all_gather("k", b"x"))
        """,
        # -S: no .pth files, so an editable install of the source tree cannot leak in
        {
            "PYTHONPATH": os.pathsep.join(
                [str(target), os.path.dirname(os.path.dirname(os.path.dirname(dist.__file__)))]
            ),
            "TORCH_CTRL_IMPL": "auto",
        },
        cwd=tmp_path,
        flags=("-S",),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "python", "[b'x']"]
