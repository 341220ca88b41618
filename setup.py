"""Build torch_ctrl: the Python package plus the C++ extension ``torch_ctrl._C``.

Install with ``pip install --no-build-isolation .`` so the extension is built against
the torch already installed (pip's build isolation hides it, and the result is then a
pure-Python install). Switches (environment):

* ``TORCH_CTRL_BUILD_EXT=0``: do not compile; a deliberate pure-Python install.
* ``TORCH_CTRL_DEBUG=1``: keep symbols and build with ``-O0 -g``.

What happened to the extension is recorded in ``torch_ctrl/_build_info.py`` (generated,
not in version control); ``import torch_ctrl`` reads it to say why the extension is not in
use, and ``python -m torch_ctrl info`` prints it.
"""

import os
import sys

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
INFO = os.path.join("torch_ctrl", "_build_info.py")
FIX = "reinstall from source with: pip install --no-build-isolation --force-reinstall --no-deps <torch_ctrl source>"


def write_build_info(status, reason, torch_version, root=HERE):
    """Record the extension's fate in ``{root}/torch_ctrl/_build_info.py``."""
    path = os.path.join(root, INFO)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(
            '"""Written by setup.py when the package was built: what became of the C++ extension."""\n\n'
            f"STATUS = {status!r}  # built, disabled, no-torch or failed\n"
            f"REASON = {reason!r}\n"
            f"TORCH_VERSION = {torch_version!r}  # the torch it was built against\n"
        )


def say(line):
    """One line on stderr (pip shows it with -v, and in the log of a failed install)."""
    print(line, file=sys.stderr, flush=True)


def torch_version():
    try:
        import torch
    except ImportError:
        return None
    return torch.__version__


def get_extensions():
    """The C++ extension, or nothing when disabled or torch is missing."""
    version = torch_version()
    if os.environ.get("TORCH_CTRL_BUILD_EXT", "1") == "0":
        write_build_info("disabled", "built with TORCH_CTRL_BUILD_EXT=0", version)
        return []
    if version is None:
        reason = "torch was not importable at build time (pip's build isolation?)"
        write_build_info("no-torch", reason, None)
        say(f"torch_ctrl: C++ extension not built: {reason}; {FIX}")
        return []
    from torch.utils.cpp_extension import CppExtension

    debug = os.environ.get("TORCH_CTRL_DEBUG", "0") == "1"
    sources = sorted(os.path.join("csrc", f) for f in os.listdir(os.path.join(HERE, "csrc")) if f.endswith(".cpp"))
    # The C++ standard is left to torch's build helpers: each torch release picks the one its
    # headers need (C++17 up to 2.13, C++20 from 2.14).
    write_build_info("failed", "the build did not finish", version)
    return [
        CppExtension(
            "torch_ctrl._C",
            sources,
            extra_compile_args=["-O0", "-g"] if debug else ["-O2"],
            extra_link_args=[] if debug else ["-s"],
            define_macros=[("TORCH_CTRL_TORCH_VERSION", version)],
        )
    ]


def get_cmdclass():
    """BuildExtension that degrades to a pure-Python install, saying so, if compiling fails."""
    try:
        from torch.utils.cpp_extension import BuildExtension
    except ImportError:
        return {}

    class OptionalBuildExtension(BuildExtension):
        def run(self):
            try:
                super().run()
            except Exception as exc:  # noqa: BLE001 - any compiler failure
                self._record("failed", f"compiling failed: {_one_line(exc)}")
            else:
                if self.extensions:
                    self._record("built", "", torch_version())

        def _record(self, status, reason, version=None):
            version = version or torch_version()
            for root in {HERE, os.path.abspath(self.build_lib)}:
                write_build_info(status, reason, version, root)
            if status != "built":
                say(
                    f"torch_ctrl: C++ extension not built: {reason}; installing the pure-Python implementation "
                    "(the compiler's output: pip install -v; a pure-Python install on purpose: TORCH_CTRL_BUILD_EXT=0)"
                )

    return {"build_ext": OptionalBuildExtension.with_options(use_ninja=True)}


def _one_line(exc):
    text = " ".join(str(exc).split()).rstrip(".")  # the caller goes on after a ";"
    return text[:300] + ("..." if len(text) > 300 else "")


setup(ext_modules=get_extensions(), cmdclass=get_cmdclass())
