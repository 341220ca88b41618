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
    # torch's own private classes are left alone (torch 2.14 removed them)
    theirs = getattr(dist, "_StoreCollectives", None)
    assert theirs is None or theirs.__module__.startswith("torch")


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
    if torch_ctrl.loader.build_info()["status"] == "disabled":
        pytest.skip("a deliberate pure-Python install does not warn")
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
    assert first == "python 1 ExtensionUnavailable 3"
    assert message.startswith("torch_ctrl: using the pure-Python implementation: the C++ extension was not built")
    assert "--no-build-isolation" in message and "\n" not in message


def test_impl_cpp_without_extension_raises() -> None:
    out = _python(BREAK_EXTENSION + "import torch_ctrl\n", {"TORCH_CTRL_IMPL": "cpp"})
    assert out.returncode != 0
    assert "ImportError: TORCH_CTRL_IMPL=cpp but the C++ extension torch_ctrl._C is unusable" in out.stderr


def test_bad_impl_value() -> None:
    out = _python("import torch_ctrl\n", {"TORCH_CTRL_IMPL": "fortran"})
    assert out.returncode != 0 and "TORCH_CTRL_IMPL must be auto, cpp or python" in out.stderr


@pytest.mark.timeout(300)
def test_install_without_compiling(tmp_path: Path) -> None:
    """TORCH_CTRL_BUILD_EXT=0 installs a working pure-Python package that does not warn."""
    target = tmp_path / "site"
    res = _pip_install(_copy_source(tmp_path), target, {"TORCH_CTRL_BUILD_EXT": "0"})
    assert res.returncode == 0, res.stderr
    assert not list(target.glob("torch_ctrl/_C*"))
    out = _import_from(target, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["python 2"]  # and no warning


def test_extension_built_for_another_torch_falls_back_with_one_warning() -> None:
    """An extension built against one torch and run on another is not used: one warning names
    both versions and the rebuild command, and everything works in Python."""
    if torch_ctrl.loader.build_info()["status"] != "built":
        pytest.skip("needs the C++ extension")
    out = _python(
        """
        import warnings
        import torch
        built = torch.__version__
        torch.__version__ = "9.99.0"  # what an upgrade of torch under a built extension looks like
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import torch_ctrl
        msgs = [str(w.message) for w in caught if "torch_ctrl" in str(w.message)]
        import torch.distributed as dist
        coll = torch_ctrl.StoreCollectives(dist.HashStore(), 0, 1)
        print(torch_ctrl.backend(), len(msgs), coll.all_sum("k", 3), built)
        print(msgs[0])
        """,
        {"TORCH_CTRL_IMPL": "auto"},
    )
    assert out.returncode == 0, out.stderr
    first, message = out.stdout.splitlines()[:2]
    backend, count, total, built = first.split()
    assert (backend, count, total) == ("python", "1", "3")
    assert f"built for torch {built} but torch 9.99.0 is running" in message
    assert "pip install --no-build-isolation" in message


def test_extension_that_cannot_take_torchs_store_falls_back() -> None:
    """The smoke construction catches an extension whose store type does not match torch's
    (what an ABI mismatch looks like: 'incompatible constructor arguments')."""
    if torch_ctrl.loader.build_info()["status"] != "built":
        pytest.skip("needs the C++ extension")
    out = _python(
        """
        import warnings
        import torch.distributed as dist
        dist.HashStore = lambda: object()  # a store the extension cannot take
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import torch_ctrl
        print(torch_ctrl.backend(), [str(w.message) for w in caught if "torch_ctrl" in str(w.message)][0])
        """,
        {"TORCH_CTRL_IMPL": "auto"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("python torch_ctrl: using the pure-Python implementation: ")
    assert "does not work with this torch" in out.stdout


def _pip_install(src: Path, target: Path, env: dict[str, str], isolated: bool = False) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "pip", "install", "-v", "--no-deps", "--target", str(target), str(src)]
    if not isolated:
        args.insert(4, "--no-build-isolation")
    return subprocess.run(args, capture_output=True, text=True, env={**os.environ, **env}, timeout=280)


def _copy_source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("*.so", "build", ".git", "*.egg-info", "__pycache__", "_build_info.py", "docs")
    shutil.copytree(ROOT, src, ignore=ignore)
    return src


def _import_from(target: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    site = os.path.dirname(os.path.dirname(os.path.dirname(dist.__file__)))
    return _python(
        """
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import torch_ctrl
        import torch.distributed as dist
        coll = torch_ctrl.StoreCollectives(dist.HashStore(), 0, 1)
        print(torch_ctrl.backend(), coll.all_sum("k", 2))
        for w in caught:
            if "torch_ctrl" in str(w.message):  # not torch's own (e.g. "Failed to initialize NumPy")
                print("WARNING", w.message)
        """,
        # -S: no .pth files, so an editable install of the source tree cannot leak in
        {"PYTHONPATH": os.pathsep.join([str(target), site]), "TORCH_CTRL_IMPL": "auto"},
        cwd=tmp_path,
        flags=("-S",),
    )


@pytest.mark.timeout(300)
def test_failed_compile_says_so_at_install_and_at_import(tmp_path: Path) -> None:
    """A compiler that fails leaves a working pure-Python install; the install log has one
    line saying so, and the import warns once with the reason and the fix."""
    target = tmp_path / "site"
    res = _pip_install(_copy_source(tmp_path), target, {"CXX": "/bin/false", "CC": "/bin/false"})
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in (res.stdout + res.stderr).splitlines() if "torch_ctrl: C++ extension not built" in ln]
    assert lines and "compiling failed" in lines[0], res.stdout[-3000:]
    out = _import_from(target, tmp_path)
    assert out.returncode == 0, out.stderr
    first, *warns = out.stdout.splitlines()
    assert first == "python 2"
    assert len(warns) == 1 and "compiling failed" in warns[0] and "--no-build-isolation" in warns[0]


@pytest.mark.timeout(300)
def test_isolated_build_says_how_to_build_the_extension(tmp_path: Path) -> None:
    """``pip install .`` with build isolation cannot see torch: the result is a pure-Python
    install whose import says why, in one line, with the fix (not a circular-import error)."""
    target = tmp_path / "site"
    res = _pip_install(_copy_source(tmp_path), target, {}, isolated=True)
    assert res.returncode == 0, res.stderr
    assert not list(target.glob("torch_ctrl/_C*"))
    out = _import_from(target, tmp_path)
    assert out.returncode == 0, out.stderr
    first, *warns = out.stdout.splitlines()
    assert first == "python 2"
    assert len(warns) == 1, warns
    assert "torch was not importable at build time" in warns[0] and "--no-build-isolation" in warns[0]
    assert "circular import" not in warns[0]


@pytest.mark.parametrize(
    ("status", "reason", "warns"),
    [
        ("disabled", "built with TORCH_CTRL_BUILD_EXT=0", False),
        ("no-torch", "torch was not importable at build time (pip's build isolation?)", True),
    ],
)
def test_extension_left_from_an_earlier_build_is_not_used(
    tmp_path: Path, status: str, reason: str, warns: bool
) -> None:
    """A reinstall that did not build the extension (``TORCH_CTRL_BUILD_EXT=0``, or pip's build
    isolation) over a tree that holds one from an earlier build (an editable install) uses
    Python, as its install said; only the deliberate pure-Python install is silent."""
    if torch_ctrl.loader.build_info()["status"] != "built":
        pytest.skip("needs the C++ extension")
    target = tmp_path / "site"
    package = Path(torch_ctrl.__file__).parent
    shutil.copytree(package, target / "torch_ctrl", ignore=shutil.ignore_patterns("__pycache__"))
    assert list((target / "torch_ctrl").glob("_C*.so"))
    (target / "torch_ctrl" / "_build_info.py").write_text(
        f"STATUS = {status!r}\nREASON = {reason!r}\nTORCH_VERSION = None\n"
    )
    out = _import_from(target, tmp_path)
    assert out.returncode == 0, out.stderr
    first, *warnings = out.stdout.splitlines()
    assert first == "python 2"
    if warns:
        assert len(warnings) == 1 and "was not rebuilt" in warnings[0] and reason in warnings[0], warnings
    else:
        assert warnings == []


@pytest.mark.timeout(300)
def test_sdist_carries_every_source_the_extension_needs(tmp_path: Path) -> None:
    """An sdist made where torch is absent (pip's isolated ``build``) still builds the extension
    where it is installed: every C++ source and header, the license, and no build record of the
    machine that made it."""
    import tarfile

    src = _copy_source(tmp_path)
    env = {**os.environ, "TORCH_CTRL_BUILD_EXT": "0"}
    res = subprocess.run(
        [sys.executable, "setup.py", "-q", "sdist", "--dist-dir", str(tmp_path / "out")],
        cwd=src,
        capture_output=True,
        text=True,
        env=env,
        timeout=280,
    )
    assert res.returncode == 0, res.stderr
    (sdist,) = (tmp_path / "out").glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    needed = {f"csrc/{f.name}" for f in (ROOT / "csrc").iterdir() if f.suffix in (".cpp", ".h")}
    assert needed and needed <= names, sorted(needed - names)
    assert "LICENSE" in names and "torch_ctrl/_build_info.py" not in names


def test_both_twins_detect_the_same_store_capabilities() -> None:
    """The path an op takes depends on them, so C++ (from torch's headers) and Python (from
    torch's classes) must agree on every torch."""
    from torch_ctrl import capabilities

    if torch_ctrl.backend() != "cpp":
        pytest.skip("needs the C++ extension")
    from torch_ctrl import _C

    assert dict(_C._capabilities) == capabilities.detected()
