"""``python -m torch_ctrl info``: what this installation uses, and why.

Prints the torch and torch_ctrl versions, the active implementation (``cpp`` or
``python``) and, when it is not ``cpp``, why; what ``setup.py`` recorded about the
extension; the store capabilities this torch has (and those the extension was compiled
with); whether torch's private ``_StoreCollectives`` exists; how torchrun finds the ``ctrl``
backend; and which torch internals the agent hooks can use. ``--json`` prints the same as
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Sequence
from typing import Any


def collect() -> dict[str, Any]:
    """Everything ``info`` reports, as plain data."""
    import torch

    import torch_ctrl

    from . import capabilities, loader
    from . import keys as K

    out: dict[str, Any] = {
        "torch_ctrl": torch_ctrl.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "backend": loader.backend(),
        "why_not_cpp": loader.reason() or None,
        "build": loader.build_info(),
        "store_capabilities": capabilities.detected(),
        "protocol": K.PROTOCOL,
        # Which path barrier/all_gather/all_sum take over a TCPStore (docs/protocol.md, "The ops").
        "tcpstore_path": {"raw": capabilities.tcpstore_path(False), "prefix": capabilities.tcpstore_path(True)},
        "extension_capabilities": None,
        # The torch the loaded extension was compiled against (its own record, which the
        # loader checks; build["torch_version"] is what setup.py wrote next to it).
        "extension_torch_version": None,
        "torch_private_store_collectives": capabilities.private_store_collectives() is not None,
        "ctrl_rendezvous": _ctrl_backend(),
        "agent_internals": None,
    }
    if loader.backend() == "cpp":
        from . import _C  # type: ignore[attr-defined]

        out["extension_capabilities"] = dict(_C._capabilities)
        out["extension_torch_version"] = getattr(_C, "_torch_version", None)
    try:
        from .elastic import internals

        report = internals.check()
        out["agent_internals"] = {"present": report.present, "missing": report.missing, "summary": report.line()}
    except Exception as exc:  # noqa: BLE001 - report, never fail
        out["agent_internals"] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def _ctrl_backend() -> str:
    """How torchrun finds the ``ctrl`` rendezvous backend."""
    try:
        from importlib.metadata import entry_points

        eps = entry_points(group="torchrun.handlers")
        if any(ep.name == "ctrl" for ep in eps):
            return "registered with torchrun (torchrun.handlers entry point)"
    except Exception:  # noqa: BLE001 - metadata may be missing in a source checkout
        pass
    return "not found by torchrun; use python -m torch_ctrl.run (it registers the backend itself)"


def _yes(value: bool) -> str:
    return "yes" if value else "no"


def render(data: dict[str, Any]) -> str:
    """``collect()`` as the lines ``info`` prints."""
    caps = data["store_capabilities"]
    build = data["build"]
    built_for = data.get("extension_torch_version") or build.get("torch_version")
    lines = [
        f"torch_ctrl {data['torch_ctrl']} on torch {data['torch']}, Python {data['python']}",
        f"backend: {data['backend']}" + (f" ({data['why_not_cpp']})" if data["why_not_cpp"] else ""),
        f"extension: {build['status']}"
        + (f", built against torch {built_for}" if built_for else "")
        + (f" ({build['reason']})" if build.get("reason") else ""),
        "store capabilities of this torch: "
        + ", ".join(f"{name} {_yes(ok)}" for name, ok in caps.items())
        + "  (clone: own connections per caller; barrier: TCPStore's server-side barrier; "
        "list_keys: missing ranks named in one call)",
    ]
    path = data["tcpstore_path"]
    lines.append(
        f"protocol: {data['protocol']}; TCPStore path for barrier, all_gather, all_sum: raw {_yes(path['raw'])}, "
        f"under PrefixStores {_yes(path['prefix'])}  (every rank of a group must print the same line)"
    )
    if data["extension_capabilities"] is not None:
        ext = data["extension_capabilities"]
        lines.append("extension compiled with: " + ", ".join(f"{name} {_yes(ok)}" for name, ok in ext.items()))
    lines.append(
        "torch's private _StoreCollectives: "
        + ("present" if data["torch_private_store_collectives"] else "absent (removed from this torch)")
    )
    lines.append(f"ctrl rendezvous backend: {data['ctrl_rendezvous']}")
    agent = data["agent_internals"] or {}
    lines.append(f"agent hooks: {agent.get('summary') or agent.get('error')}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the report; 0 on success."""
    parser = argparse.ArgumentParser(
        prog="torch-ctrl info",
        description="Show the torch and torch_ctrl versions, the active implementation and why, "
        "and the store capabilities detected.",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    data = collect()
    print(json.dumps(data, indent=2) if args.json else render(data))
    return 0


if __name__ == "__main__":
    from .broken_pipe import run

    sys.exit(run(main))
