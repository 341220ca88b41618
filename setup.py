"""Build torch_ctrl: the Python package plus the C++ extension ``torch_ctrl._C``.

Install with ``pip install --no-build-isolation .`` so the extension is built
against the torch already installed. Switches (environment):

* ``TORCH_CTRL_BUILD_EXT=0``: do not compile; a pure-Python install.
* A failed compile also leaves a pure-Python install, with a warning.
"""

import os
import sys
import warnings

from setuptools import setup


def get_extensions():
    """The C++ extension, or nothing when disabled or torch is missing."""
    if os.environ.get("TORCH_CTRL_BUILD_EXT", "1") == "0":
        return []
    try:
        from torch.utils.cpp_extension import CppExtension
    except ImportError:
        warnings.warn(
            "torch_ctrl: torch is not importable at build time; building without the C++ extension", stacklevel=1
        )
        return []
    here = os.path.dirname(os.path.abspath(__file__))
    sources = sorted(os.path.join("csrc", f) for f in os.listdir(os.path.join(here, "csrc")) if f.endswith(".cpp"))
    return [
        CppExtension(
            "torch_ctrl._C",
            sources,
            extra_compile_args=["-O2", "-std=c++17"],
        )
    ]


def get_cmdclass():
    """BuildExtension that degrades to a pure-Python install if compiling fails."""
    try:
        from torch.utils.cpp_extension import BuildExtension
    except ImportError:
        return {}

    class OptionalBuildExtension(BuildExtension):
        def run(self):
            try:
                super().run()
            except Exception as exc:  # noqa: BLE001 - any compiler failure
                self._fail(exc)

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as exc:  # noqa: BLE001
                self._fail(exc)

        @staticmethod
        def _fail(exc):
            msg = f"torch_ctrl: building the C++ extension failed ({exc}); installing the pure-Python implementation"
            warnings.warn(msg, stacklevel=1)
            print(msg, file=sys.stderr)

    return {"build_ext": OptionalBuildExtension.with_options(use_ninja=True)}


setup(ext_modules=get_extensions(), cmdclass=get_cmdclass())
