"""``python -m torch_ctrl.run``: torchrun with torch_ctrl.

Accepts every torchrun argument. Installs the elastic adapter and agent hooks in this
process, and uses the ``ctrl`` rendezvous backend unless ``--rdzv-backend`` is given
(``--standalone`` becomes a single-node ``ctrl`` rendezvous on ``localhost:0``).
"""

from __future__ import annotations

import sys
import uuid


def torchrun_args(argv: list[str]) -> list[str]:
    """torchrun's arguments with the ``ctrl`` defaults applied (parsed by torchrun's own
    parser, so options after the training script are left alone)."""
    from torch.distributed import run as torchrun

    parser = torchrun.get_args_parser()
    unset = object()
    parser.set_defaults(rdzv_backend=unset)
    parsed = parser.parse_args(argv)
    if parsed.rdzv_backend is not unset:
        return list(argv)
    extra = ["--rdzv-backend=ctrl"]
    args = list(argv)
    if parsed.standalone:
        script_at = len(argv) - len(parsed.training_script_args) - 1
        args = [a for i, a in enumerate(argv) if not (a == "--standalone" and i < script_at)]
        extra += ["--rdzv-endpoint=localhost:0", f"--rdzv-id={uuid.uuid4()}"]
    return extra + args


def register_backend() -> None:
    """Register the ``ctrl`` rendezvous backend with torch in this process, where torch did
    not already find it through the ``torchrun.handlers`` entry point (e.g. a package run from
    a source checkout without metadata)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    from .elastic.rendezvous import BACKEND, create_handler

    try:
        rendezvous_handler_registry.register(BACKEND, create_handler)
    except ValueError:
        pass  # registered already (the entry point): same backend


def main(argv: list[str] | None = None) -> None:
    """Run torchrun with the ctrl defaults."""
    from torch.distributed import run as torchrun

    from .elastic import install

    install()
    register_backend()
    torchrun.main(torchrun_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
