"""The watcher: one background thread per instance, on its own lane.

It does the work that must not sit on a collective's critical path:

* **cleanup**: deleting a finished collective's keys (exit counters, deletes),
  so ops return as soon as their result is known;
* **names**: a rank blocked past a grace period appends its rank to the
  collective's NAMES log, so that a timeout can list the missing ranks with
  one read instead of one probe per rank.

The thread starts on first use and stops on ``close()`` after draining its
queue (bounded by ``flush_timeout``).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from .lanes import Lane, Lanes

log = logging.getLogger(__name__)

Task = Callable[[Lane], None]

# Most cleanup tasks queued per instance: a caller that would exceed it waits, so a
# tight loop of collectives cannot outrun its cleanup and grow the store.
MAX_PENDING = 4


_LIVE: weakref.WeakSet[Watcher] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """Stop every watcher before the interpreter finalizes: a daemon thread caught
    inside a store call at shutdown would abort the process."""
    for watcher in list(_LIVE):
        watcher.close(flush_timeout=2.0)


def grace_period(timeout: float) -> float:
    """How long a rank waits before naming itself: a quarter of the timeout, at most 1 s."""
    return min(1.0, max(0.02, timeout / 4))


@dataclass
class _Blocked:
    names_key: str
    due: float
    named: bool = False


class Watcher:
    """Background cleanup and naming for one collectives instance."""

    def __init__(self, lanes: Lanes, rank: int) -> None:
        self._lanes = lanes
        self._rank = rank
        self._cv = threading.Condition()
        self._tasks: deque[Task] = deque()
        self._blocked: dict[int, _Blocked] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._busy = False
        _LIVE.add(self)

    # -- API used by the collectives -------------------------------------------
    def submit(self, task: Task) -> None:
        """Run ``task(lane)`` in the background, in submission order (waits while
        ``MAX_PENDING`` tasks are queued)."""
        with self._cv:
            self._start()
            while len(self._tasks) >= MAX_PENDING and self._thread is not None and self._thread.is_alive():
                self._cv.wait(0.1)
            self._tasks.append(task)
            self._start()
            self._cv.notify_all()

    @contextmanager
    def blocked(self, names_key: str, timeout: float) -> Iterator[None]:
        """Mark the caller as blocked in a collective whose NAMES log is ``names_key``."""
        ident = next(self._ids)
        with self._cv:
            self._blocked[ident] = _Blocked(names_key, time.monotonic() + grace_period(timeout))
            self._start()
            self._cv.notify()
        try:
            yield
        finally:
            with self._cv:
                self._blocked.pop(ident, None)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every submitted task has run; False on timeout."""
        end = time.monotonic() + timeout
        with self._cv:
            while self._tasks or self._busy:
                left = end - time.monotonic()
                if left <= 0 or self._thread is None:
                    return not self._tasks
                self._cv.wait(left)
        return True

    def close(self, flush_timeout: float = 5.0) -> None:
        """Stop taking tasks; the thread drains its queue, then exits (joined up to ``flush_timeout``)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(flush_timeout)

    # -- the thread --------------------------------------------------------------
    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="torch_ctrl-watcher", daemon=True)
            self._thread.start()

    def _next_work(self) -> tuple[list[Task], list[str]]:
        with self._cv:
            while True:
                now = time.monotonic()
                names = [b.names_key for b in self._blocked.values() if not b.named and b.due <= now]
                for b in self._blocked.values():
                    if b.due <= now:
                        b.named = True
                if self._tasks or names or self._closed:
                    tasks = [self._tasks.popleft()] if self._tasks else []
                    self._busy = bool(tasks)
                    self._cv.notify_all()
                    return tasks, names
                pending = [b.due for b in self._blocked.values() if not b.named]
                self._cv.wait(max(0.0, min(pending) - now) if pending else None)

    def _run(self) -> None:
        try:
            lane = self._lanes.acquire()
        except Exception as exc:  # noqa: BLE001 - store gone: nothing left to clean
            log.debug("torch_ctrl watcher cannot open a lane: %s", exc)
            with self._cv:
                self._tasks.clear()
                self._busy = False
                self._cv.notify_all()
            return
        while True:
            tasks, names = self._next_work()
            for key in names:
                self._safely(lambda ln, k=key: ln.append(k, b"%d," % self._rank), lane)
            for task in tasks:
                self._safely(task, lane)
            with self._cv:
                self._busy = False
                self._cv.notify_all()
                if self._closed and not self._tasks:
                    return

    @staticmethod
    def _safely(task: Task, lane: Lane) -> None:
        try:
            task(lane)
        except Exception as exc:  # noqa: BLE001 - cleanup is best effort
            log.debug("torch_ctrl watcher task failed: %s", exc)
