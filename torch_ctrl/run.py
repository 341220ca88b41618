"""``python -m torch_ctrl.run``: torchrun with torch_ctrl.

Accepts every torchrun argument. Installs the elastic adapter and agent hooks in this
process, and uses the ``ctrl`` rendezvous backend unless ``--rdzv-backend`` is given
(``--standalone``, and a one-node command line without an endpoint or ``--master-port``,
become a single-node ``ctrl`` rendezvous on ``localhost:0``; a ``static``-style command
line meets at ``--master-addr``). ``--help`` says so, above torchrun's own options.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import uuid

BACKEND = "ctrl"
DEFAULT_PORT = 29400  # the ctrl rendezvous's default port (torch_ctrl.elastic.ctrl_rendezvous)
PROG = "python -m torch_ctrl.run"
DESCRIPTION = (
    "torchrun with torch_ctrl: takes every torchrun option and runs torchrun with the 'ctrl' rendezvous "
    "backend as the default (pass --rdzv-backend to choose another) and torch_ctrl's elastic store "
    "adapter and agent hooks installed: a node that fails tells the others why, every node sees one "
    "round number, and workers can take torch_ctrl.from_env(). --standalone starts a single-node job "
    "with a 'ctrl' rendezvous on localhost, on a free port, under a fresh run id (torchrun's own "
    "--standalone does the same with 'c10d'); so does a one-node command line without "
    "--rdzv-endpoint and --master-port, as in torchrun. Without --rdzv-endpoint, a multi-node "
    "command line meets at --master-addr:--master-port (default port 29400)."
)
EPILOG = (
    "A job hangs? 'torch-ctrl inspect HOST:PORT' on the --rdzv-endpoint shows the rounds, nodes, "
    "failure notice and every collective in flight, read-only. See docs/torchrun.md."
)


def parser() -> argparse.ArgumentParser:
    """torchrun's own parser, with this launcher's name, description and defaults in its help."""
    from torch.distributed import run as torchrun

    out = torchrun.get_args_parser()
    out.prog, out.description, out.epilog = PROG, DESCRIPTION, EPILOG
    for action in out._actions:
        if action.dest == "rdzv_backend":
            action.help = "Rendezvous backend (default here: ctrl, torch_ctrl's; torchrun's: static)."
        elif action.dest == "standalone":
            action.help = (
                "Single-node job: a 'ctrl' rendezvous on localhost on a free port with a fresh run id "
                "(with another --rdzv-backend: torchrun's own --standalone, which uses c10d)."
            )
    return out


def torchrun_args(argv: list[str]) -> list[str]:
    """torchrun's arguments with the ``ctrl`` defaults applied (parsed by torchrun's own
    parser, so options after the training script are left alone; ``--help`` prints this
    launcher's help and exits).

    * no ``--rdzv-backend``: ``ctrl``;
    * ``--standalone`` (with ``ctrl``, given or by default): a ``ctrl`` rendezvous on
      ``localhost:0`` under a fresh run id, where torchrun's own would use ``c10d``;
    * ``ctrl`` by default and no ``--rdzv-endpoint``, as torchrun's own default (``static``)
      decides it: at most one node and no ``--master-port`` is a standalone job as above (so
      two such jobs on one machine stay apart); otherwise the rendezvous is at
      ``--master-addr:--master-port`` (port 29400 when not given), where the nodes of a
      ``static`` command line meet.
    """
    parser_ = parser()
    unset = object()
    parser_.set_defaults(rdzv_backend=unset)
    if "PET_MASTER_PORT" not in os.environ:  # torch <= 2.6 defaults it to 29500: given or not?
        parser_.set_defaults(master_port=None)
    parsed = parser_.parse_args(argv)
    explicit = parsed.rdzv_backend is not unset
    if explicit and parsed.rdzv_backend != BACKEND:
        return list(argv)
    extra = [] if explicit else [f"--rdzv-backend={BACKEND}"]
    args = list(argv)
    standalone = ["--rdzv-endpoint=localhost:0", f"--rdzv-id={uuid.uuid4()}"]
    if parsed.standalone:
        script_at = len(argv) - len(parsed.training_script_args) - 1
        args = [a for i, a in enumerate(argv) if not (a == "--standalone" and i < script_at)]
        extra += standalone
    elif not explicit and not parsed.rdzv_endpoint:
        if parsed.master_port is None and _max_nodes(parsed.nnodes) == 1:
            extra += standalone
        else:
            host = parsed.master_addr
            host = f"[{host}]" if ":" in host and not host.startswith("[") else host
            extra.append(f"--rdzv-endpoint={host}:{parsed.master_port or DEFAULT_PORT}")
    return extra + args


def _max_nodes(nnodes: str) -> int:
    """The most nodes ``--nnodes`` (``N`` or ``MIN:MAX``) allows; torchrun checks the syntax."""
    try:
        return int(str(nnodes).rpartition(":")[2])
    except ValueError:
        return 0  # torchrun's own parser reports it


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


def log_like_torchrun() -> None:
    """Under ``LOGLEVEL`` (torchrun's switch for its own INFO lines), print torch_ctrl's log
    lines at that level too (which process hosts the rendezvous store, on which port; rounds),
    unless the program configured logging itself. Only here, in a process this command owns."""
    level = os.environ.get("LOGLEVEL", "").strip().upper()
    logger = logging.getLogger("torch_ctrl")
    if not level or logger.handlers or logging.getLogger().handlers:
        return
    try:
        logger.setLevel(level)
    except ValueError:
        return  # not a level name: torch's own loggers refuse it too
    handler = logging.StreamHandler()
    layout = "%(levelname).1s%(asctime)s %(process)d %(name)s] %(message)s"  # as torch's own lines
    handler.setFormatter(logging.Formatter(layout, "%m%d %H:%M:%S"))
    logger.addHandler(handler)


def main(argv: list[str] | None = None) -> None:
    """Run torchrun with the ctrl defaults."""
    from torch.distributed import run as torchrun

    from .elastic import install

    log_like_torchrun()
    install()
    register_backend()
    torchrun.main(torchrun_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
