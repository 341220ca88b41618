"""Command line: ``torch-ctrl COMMAND`` or ``python -m torch_ctrl COMMAND``.

Commands: ``inspect`` (see a live job's collectives), ``info`` (this installation),
``demo`` (a torchrun job running every collective), ``bench`` (latency next to torch's
classes). ``--help`` after a command describes its options.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence

# One line each, shown by --help; every command parses its own options.
COMMANDS = {
    "inspect": "show the collectives in flight, heartbeats, aborts and torchrun rounds of a live store (read-only)",
    "info": "torch version, implementation in use (C++ or Python, and why), store capabilities",
    "demo": "run a torchrun job on 127.0.0.1 that runs and checks every collective",
    "bench": "latency and store traffic of every collective next to torch's; 'bench rendezvous': the rendezvous",
}
PROG = "torch-ctrl"


def _top_parser() -> argparse.ArgumentParser:
    from . import __version__

    epilog = "commands:\n" + "\n".join(f"  {name:<9} {text}" for name, text in COMMANDS.items())
    epilog += f"\n\nRun '{PROG} COMMAND --help' for a command's options. Also: python -m torch_ctrl COMMAND."
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} [--version] [--help] {{{','.join(COMMANDS)}}} ...",
        description="torch_ctrl: control-plane collectives over torch.distributed stores.",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"torch_ctrl {__version__}")
    parser.add_argument("command", choices=list(COMMANDS), metavar="COMMAND", help=argparse.SUPPRESS)
    parser.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to a command; returns the exit status (1, without a traceback, when stdout is a pipe
    whose reader has gone, as in ``torch-ctrl info | head -1``)."""
    from .broken_pipe import run

    args = list(sys.argv[1:] if argv is None else argv)
    return run(lambda: _dispatch(args))


def _dispatch(args: list[str]) -> int:
    parser = _top_parser()
    if not args:
        parser.print_help(sys.stderr)
        return 2
    if args[0] not in COMMANDS:
        parser.parse_args(args[:1])  # --help, --version, or exit 2 naming the choices
        return 0
    cmd, rest = args[0], args[1:]
    if cmd == "inspect":
        return inspect_main(rest)
    if cmd == "info":
        try:
            from .info import main as info_main
        except ImportError as exc:
            print(f"{PROG} info: not available in this installation ({exc})", file=sys.stderr)
            return 1
        return int(info_main(rest) or 0)
    if cmd == "demo":
        from .demo import main as run
    else:
        from .bench import main as run
    return int(run(rest) or 0)


# ---------------------------------------------------------------------------- inspect


def inspect_parser() -> argparse.ArgumentParser:
    """Options of ``torch-ctrl inspect``."""
    parser = argparse.ArgumentParser(
        prog=f"{PROG} inspect",
        description=(
            "Show what every torch_ctrl group on a TCPStore is doing: each collective in flight (op, key, "
            "k/N arrived, blocked and missing ranks, how long it has been seen pending), heartbeat ages and "
            "stopped ranks, the abort notice, and under torchrun's ctrl backend the run, its rounds, nodes and "
            "failure notice (the workers' store is inspected too). Joins as a plain client and writes nothing."
        ),
        epilog="A job hangs? Run this against its store (torchrun: the --rdzv-endpoint). See docs/inspect.md.",
    )
    add = parser.add_argument
    add(
        "address", metavar="HOST:PORT", help="the TCPStore server (e.g. torchrun's --rdzv-endpoint or MASTER_ADDR:PORT)"
    )
    add("--json", action="store_true", help="print one JSON document (schema torch_ctrl.inspect/1) instead of text")
    add("--watch", action="store_true", help="refresh every --interval seconds until interrupted (Ctrl-C)")
    add(
        "--prefix",
        default=None,
        help="only groups whose keys start with PREFIX (e.g. a from_env() round namespace), "
        "also on the workers' store followed",
    )
    add(
        "--interval",
        type=float,
        default=1.0,
        help="seconds between the samples that show which heartbeats move and which ops progress "
        "(default: %(default)s; 0: one sample)",
    )
    add(
        "--timeout",
        type=float,
        default=5.0,
        help="seconds for connecting and each read (default: %(default)s); a server that does not answer "
        "within it (plus 1 s) is reported",
    )
    add("--no-follow", action="store_true", help="do not inspect the workers' store a torchrun round names")
    return parser


WEEK = 7 * 86400.0  # the longest --interval and --timeout of inspect, seconds


def inspect_main(argv: Sequence[str]) -> int:
    """``torch-ctrl inspect``: print one report, or refresh it in place with ``--watch``."""
    opts = inspect_parser().parse_args(list(argv))
    if not (0 <= opts.interval <= WEEK and 0 < opts.timeout <= WEEK):  # NaN fails both
        print(
            f"{PROG} inspect: --interval must be 0 to {WEEK:.0f} s and --timeout over 0, to {WEEK:.0f} s",
            file=sys.stderr,
        )
        return 2
    # torch's TCPStore resolves host names on connect; where DNS drops such queries each try
    # stalls for the resolver timeout (5 s). Only this process's lookups are affected.
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    with _native_stderr_quiet():
        return _inspect(opts)


@contextlib.contextmanager
def _native_stderr_quiet() -> Iterator[None]:
    """Send what native code writes to file descriptor 2 (torch's C++ warnings with their
    stack traces: a read from a server that went away logs ~15 lines before the error comes
    back to Python) to /dev/null, while Python's ``sys.stderr`` (this command's one-line
    errors, warnings, tracebacks) keeps writing to the real stderr."""
    try:
        sys.stderr.flush()
        real = os.dup(2)
    except (OSError, ValueError):  # no usable fd 2: nothing to quiet
        yield
        return
    previous = sys.stderr
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        sys.stderr = open(real, "w", buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115
        os.dup2(devnull, 2)
        yield
    finally:
        try:
            sys.stderr.flush()
        finally:
            os.dup2(real, 2)
            sys.stderr.close()
            sys.stderr = previous
            os.close(devnull)
            os.close(real)


def _inspect(opts: argparse.Namespace) -> int:
    from .inspect_text import render
    from .inspection import Inspector, NoAnswerError, inspect

    try:
        if not opts.watch:
            report = inspect(
                opts.address,
                interval=opts.interval,
                prefix=opts.prefix,
                follow=not opts.no_follow,
                timeout=opts.timeout,
            )
            print(json.dumps(report, indent=1) if opts.json else render(report))
            return 0
        insp = Inspector(opts.address, prefix=opts.prefix, follow=not opts.no_follow, timeout=opts.timeout)
        tty = sys.stdout.isatty() and not opts.json
        while True:
            report = insp.sample()
            if opts.json:
                print(json.dumps(report), flush=True)  # one document per line
            else:
                text = render(report) + f"\n\n(refreshing every {max(opts.interval, 0.1):g}s; Ctrl-C to stop)"
                sys.stdout.write(("\x1b[H\x1b[2J" if tty else "\n") + text + "\n")
                sys.stdout.flush()
            time.sleep(max(opts.interval, 0.1))  # the refresh period itself: nothing to wait on
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # stdout's reader has gone (`--watch | head`): main() leaves quietly
        raise
    except ValueError as exc:
        print(f"{PROG} inspect: {exc}", file=sys.stderr)
        return 2
    except NoAnswerError as exc:  # names the address itself
        print(f"{PROG} inspect: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - one line, no stack trace
        from .errors import one_line

        print(f"{PROG} inspect: cannot read {opts.address}: {one_line(str(exc))}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
