"""The command line's exits when stdout's reader has gone (``torch-ctrl info | head -1``).

Python ignores SIGPIPE, so a write to a closed pipe raises ``BrokenPipeError``, and a buffered
one does at the interpreter's last flush, too late to catch. :func:`run` follows the recipe of the
Python docs ("Note on SIGPIPE", in the :mod:`signal` module's page): flush inside the ``try``,
and on ``BrokenPipeError`` point stdout at ``/dev/null`` and exit 1, without a traceback.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable


def silence_stdout() -> None:
    """Point file descriptor 1 at ``/dev/null``: what is left in stdout's buffer, and the
    interpreter's flush at exit, then have nowhere to fail."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def run(main: Callable[[], int | None]) -> int:
    """``main()``'s exit status (``None`` is 0); 1, quietly, if stdout's reader has gone. A
    ``SystemExit`` (argparse's ``--help`` and errors) passes through once stdout is flushed."""
    try:
        try:
            return int(main() or 0)
        finally:
            sys.stdout.flush()  # inside the try: a broken pipe shows here, not at the exit
    except BrokenPipeError:
        silence_stdout()
        return 1
