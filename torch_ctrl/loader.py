"""Decides which implementation ``torch_ctrl.StoreCollectives`` is.

``TORCH_CTRL_IMPL`` = ``auto`` (default: the C++ extension when it imports, else
Python), ``cpp`` (the extension or ImportError naming why), or ``python``.
The import error is kept (:func:`import_error`) and warned about once.
"""

from __future__ import annotations

import os
import warnings

from .store_collectives import PyStoreCollectives

_IMPORT_ERROR: BaseException | None = None
_BACKEND = "python"


def _load_cpp() -> type | None:
    global _IMPORT_ERROR
    try:
        from .cpp import CppStoreCollectives
    except Exception as exc:  # noqa: BLE001 - any failure means "fall back"
        _IMPORT_ERROR = exc
        return None
    return CppStoreCollectives


def _choose() -> type:
    global _BACKEND
    mode = os.environ.get("TORCH_CTRL_IMPL", "auto").strip().lower() or "auto"
    if mode not in ("auto", "cpp", "python"):
        raise ImportError(f"TORCH_CTRL_IMPL must be auto, cpp or python, got {mode!r}")
    if mode == "python":
        return PyStoreCollectives
    cls = _load_cpp()
    if cls is not None:
        _BACKEND = "cpp"
        return cls
    reason = f"{type(_IMPORT_ERROR).__name__}: {_IMPORT_ERROR}"
    if mode == "cpp":
        raise ImportError(f"TORCH_CTRL_IMPL=cpp but the C++ extension torch_ctrl._C is unusable: {reason}")
    warnings.warn(
        f"torch_ctrl: C++ extension unavailable ({reason}); using the pure-Python implementation",
        RuntimeWarning,
        stacklevel=3,
    )
    return PyStoreCollectives


StoreCollectives: type = _choose()


def backend() -> str:
    """``"cpp"`` or ``"python"``: which implementation ``StoreCollectives`` is."""
    return _BACKEND


def import_error() -> BaseException | None:
    """Why the C++ extension did not load (None when it did, or was not tried)."""
    return _IMPORT_ERROR
