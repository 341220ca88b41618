"""Decides which implementation ``torch_ctrl.StoreCollectives`` is.

``TORCH_CTRL_IMPL`` = ``auto`` (default: the C++ extension when it is usable, else
Python), ``cpp`` (the extension or ImportError naming why), or ``python``.

The extension is usable when it imports, was built against the running torch (its
recorded version equals ``torch.__version__``) and passes a smoke construction over a
HashStore. Otherwise the reason is kept (:func:`import_error`, :func:`reason`) and warned
about once, with the fix, unless the package was deliberately built without it
(``TORCH_CTRL_BUILD_EXT=0``).
"""

from __future__ import annotations

import importlib.util
import os
import warnings

import torch
import torch.distributed as dist

from .store_collectives import PyStoreCollectives

_IMPORT_ERROR: BaseException | None = None
_BACKEND = "python"
_REASON = ""
REBUILD = "pip install --no-build-isolation --force-reinstall --no-deps <torch_ctrl source>"


class ExtensionUnavailable(ImportError):
    """Why the C++ extension is not in use (one line)."""


def build_info() -> dict[str, str | None]:
    """What ``setup.py`` recorded about the extension: ``status`` (built, disabled, no-torch,
    failed or unknown), ``reason`` and ``torch_version`` (the torch it was built against)."""
    try:
        from . import _build_info as info  # type: ignore[attr-defined]
    except ImportError:
        return {"status": "unknown", "reason": "no build record (an unbuilt checkout?)", "torch_version": None}
    return {"status": info.STATUS, "reason": info.REASON, "torch_version": info.TORCH_VERSION}


def _check_extension() -> type:
    """The C++ class, or ExtensionUnavailable saying why it cannot be used."""
    if importlib.util.find_spec("torch_ctrl._C") is None:
        info = build_info()
        why = info["reason"] if info["status"] not in ("built", "unknown") else "torch_ctrl._C is not built"
        raise ExtensionUnavailable(f"the C++ extension was not built: {why}")
    info = build_info()
    # The last build did not make the extension, so one found in the tree (an editable
    # install) is left from an earlier build: stale, or not wanted.
    if info["status"] in ("failed", "no-torch"):
        raise ExtensionUnavailable(f"the C++ extension was not rebuilt: {info['reason']}")
    if info["status"] == "disabled":
        left = "a torch_ctrl._C left from an earlier build is ignored"
        raise ExtensionUnavailable(f"the package was {info['reason']} ({left})")
    from . import _C  # type: ignore[attr-defined]

    built_for = getattr(_C, "_torch_version", "unknown")
    if built_for != torch.__version__:
        raise ExtensionUnavailable(
            f"the C++ extension was built for torch {built_for} but torch {torch.__version__} is running"
        )
    from .cpp import CppStoreCollectives

    try:  # the store type must cross from torch's bindings to ours
        _C.StoreCollectives(dist.HashStore(), 0, 1, None).close(0.0)
    except Exception as exc:  # noqa: BLE001 - any failure means "unusable"
        msg = " ".join(str(exc).split())[:200]
        raise ExtensionUnavailable(f"the C++ extension does not work with this torch: {msg}") from exc
    return CppStoreCollectives


def _choose() -> type:
    global _BACKEND, _IMPORT_ERROR, _REASON
    mode = os.environ.get("TORCH_CTRL_IMPL", "auto").strip().lower() or "auto"
    if mode not in ("auto", "cpp", "python"):
        raise ImportError(f"TORCH_CTRL_IMPL must be auto, cpp or python, got {mode!r}")
    if mode == "python":
        _REASON = "TORCH_CTRL_IMPL=python"
        return PyStoreCollectives
    try:
        cls = _check_extension()
    except Exception as exc:  # noqa: BLE001 - any failure means "fall back"
        _IMPORT_ERROR = exc
    else:
        _BACKEND = "cpp"
        return cls
    reason = str(_IMPORT_ERROR) if isinstance(_IMPORT_ERROR, ExtensionUnavailable) else _describe(_IMPORT_ERROR)
    _REASON = reason
    if mode == "cpp":
        raise ImportError(f"TORCH_CTRL_IMPL=cpp but the C++ extension torch_ctrl._C is unusable: {reason}")
    if build_info()["status"] == "disabled":
        return PyStoreCollectives  # a deliberate pure-Python install: nothing to warn about
    # stacklevel 4: the line that imported torch_ctrl (warnings skips importlib's frames).
    warnings.warn(
        f"torch_ctrl: using the pure-Python implementation: {reason}; to build the extension for this torch: {REBUILD}",
        RuntimeWarning,
        stacklevel=4,
    )
    return PyStoreCollectives


def _describe(exc: BaseException | None) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


StoreCollectives: type = _choose()


def backend() -> str:
    """``"cpp"`` or ``"python"``: which implementation ``StoreCollectives`` is.

    Example::

        if torch_ctrl.backend() != "cpp":
            print("pure Python:", torch_ctrl.import_error())
    """
    return _BACKEND


def import_error() -> BaseException | None:
    """Why the C++ extension is not in use (None when it is, or was not tried).

    Example::

        err = torch_ctrl.import_error()
        if err is not None:
            print(f"C++ extension unavailable: {err}")
    """
    return _IMPORT_ERROR


def reason() -> str:
    """One line: why the backend is not ``cpp`` (empty when it is)."""
    return _REASON
