"""Command line: ``python -m torch_ctrl demo`` / ``python -m torch_ctrl bench`` (also ``torch-ctrl``)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Dispatch to a subcommand."""
    args = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: python -m torch_ctrl {demo,bench} [options]   (add --help to a subcommand)"
    if not args or args[0] in ("-h", "--help"):
        print(usage)
        return 0 if args else 2
    cmd, rest = args[0], args[1:]
    if cmd == "demo":
        from .demo import main as run
    elif cmd == "bench":
        from .bench import main as run
    else:
        print(f"unknown command {cmd!r}\n{usage}", file=sys.stderr)
        return 2
    return int(run(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
