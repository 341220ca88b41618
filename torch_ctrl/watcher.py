"""The watcher: one background thread per instance, on its own lane.

It does the work that must not sit on a collective's critical path:

* **cleanup**: deleting a finished collective's keys, so ops return as soon as
  their result is known (with back-pressure, see ``MAX_PENDING``); cleanup that waits
  on other ranks runs as a ``retry`` task, so that the thread serves everything else
  in between;
* **names**: a rank blocked past a grace period appends its rank to the
  collective's NAMES log, so a timeout can list the missing ranks with one read;
* **abort**: while a caller is blocked, it polls the group's abort notice every
  ``POLL`` seconds; on an abort it wakes every blocked caller by writing an abort
  marker into the key that caller waits on (each blocking call registers how);
* **liveness** (opt in): heartbeats every ``heartbeat_interval``, and, while a
  caller is blocked, a rank whose heartbeat stops for ``DEAD_AFTER`` intervals is
  declared dead: the watcher writes the abort notice on its behalf. One blocked rank
  at a time, the *reader*, reads every rank's counter; the other blocked ranks read
  only the reader's (see ``_turn``).

The thread starts on first use and stops on ``close()`` after draining its
queue; unclosed watchers are stopped at interpreter exit.
"""

from __future__ import annotations

import atexit
import heapq
import itertools
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from . import keys as K
from .lanes import BACKGROUND_TURN, Lane, Lanes, connection_lost, retire

log = logging.getLogger(__name__)

Task = Callable[[Lane], None]
# A task to run again: returns the seconds to wait before its next run, or None when done.
Retry = Callable[[Lane], "float | None"]
Wake = Callable[[Lane, bytes], None]

# Most cleanup tasks queued per instance: a caller that would exceed it waits, so a
# tight loop of collectives cannot outrun its cleanup and grow the store.
MAX_PENDING = 8
# A submit that makes the queue this long wakes the thread at once; shorter queues wait
# for its next tick, so back-to-back collectives share one thread switch.
BATCH = 4
# While active (a collective in the last LINGER seconds), the thread wakes at least every
# TICK seconds: callers then never need to wake it, and cleanup lags by at most TICK.
# With more than TICK_WATCHERS live instances in the process the period grows with their
# number, so a process's watchers wake at most TICK_WATCHERS / TICK times per second.
TICK = 0.1
TICK_WATCHERS = 16
LINGER = 1.0
# Abort poll period while a caller is blocked: wakes peers within 1 s at under
# 2 store operations per second per blocked rank.
POLL = 0.7
# A rank whose heartbeat counter has not moved for this many intervals is dead.
DEAD_AFTER = 2.5
# The heartbeat counters are read on a poll at most once per this many intervals (from an
# interval of 2 * POLL, not on every poll): the reader's read returns all N counters (the
# other blocked ranks read two keys, see the reader below), so a group of blocked ranks costs
# the server O(N) per read period, and a longer interval is how a large job lowers that.
# Counters move once per interval, so reading them more often than every half interval adds
# nothing but load.
HB_READ = 0.5
# A blocked rank that finds the reader key unchanged on this many reads in a row takes the
# reading over: the reader renews the key after each of its reads, so it loses it only by
# missing two reads in a row (hung, or gone without handing over).
STALE_READS = 3
# A counter read unchanged for more than this many intervals makes its rank a suspect: the
# watcher goes on reading (and stays the reader) after its last caller returns, until that
# rank beats again or is declared dead. Handing the reading over then would restart the count
# from the next reader's first read (up to DEAD_AFTER more intervals). A live rank's counter
# moves at least once per interval, and reads are half an interval or more apart.
SUSPECT_AFTER = 1.0

_LIVE: weakref.WeakSet[Watcher] = weakref.WeakSet()
# Set once the interpreter exits: watchers then only drain their cleanup and stop, even with
# callers still blocked (see _stop_all).
_LEAVING = False


@atexit.register
def _stop_all() -> None:
    """Stop every watcher before the interpreter finalizes.

    A thread that is inside a store call when finalization starts is killed by the
    interpreter as the call returns, and that kills the process (SIGABRT). So at exit the
    watchers stop polling, waking callers and beating, drain their cleanup and end, even
    while another thread is still blocked in a collective: nothing of ours then makes a
    blocked call return during finalization (a watcher would otherwise see the closed ranks'
    heartbeats stop, abort the group and wake the blocked callers)."""
    global _LEAVING
    _LEAVING = True
    watchers = list(_LIVE)
    for watcher in watchers:
        watcher.close(flush_timeout=2.0)
    # A thread still inside a store call (one background connection attempt to a server that
    # went away during it takes up to two turns plus torch's back-off) must return before
    # finalization starts: waiting a little longer here is better than the abort.
    end = time.monotonic() + EXIT_GRACE
    for watcher in watchers:
        watcher.join(max(0.0, end - time.monotonic()))


def leaving() -> bool:
    """Whether the interpreter is exiting: background work then stops at its next step."""
    return _LEAVING


def tick() -> float:
    """The active watcher's wake-up period in this process."""
    return TICK * max(1.0, len(_LIVE) / TICK_WATCHERS)


def grace_period(timeout: float) -> float:
    """How long a rank waits before naming itself: a quarter of the timeout, at most 1 s."""
    return min(1.0, max(0.02, timeout / 4))


@dataclass
class _Blocked:
    names_key: str
    due: float
    wake: Wake | None
    named: bool = False
    woken: bool = False


class _BlockedScope:
    """``with watcher.blocked(...)``: registers on entry, unregisters on exit (a class, not a
    generator: it is entered on every blocking call)."""

    __slots__ = ("_watcher", "_args", "_ident")

    def __init__(self, watcher: Watcher, names_key: str, timeout: float, wake: Wake | None) -> None:
        self._watcher = watcher
        self._args = (names_key, timeout, wake)

    def __enter__(self) -> None:
        self._ident = self._watcher._enter_blocked(*self._args)

    def __exit__(self, exc_type: object, *rest: object) -> None:
        self._watcher._exit_blocked(self._ident, exc_type is None)


@dataclass
class _Beat:
    value: bytes | None = None
    since: float = field(default_factory=time.monotonic)
    read_at: float = 0.0  # when this counter was last read


HEAL_CONNECT = 1.0  # seconds the watcher waits to open a new connection (tried again on its next wake)
# At exit, how much longer than the drain the watchers' threads get to leave a store call.
EXIT_GRACE = 2 * BACKGROUND_TURN + 1.0


class Watcher:
    """Background cleanup, naming, abort polling and liveness for one collectives instance."""

    def __init__(self, lanes: Lanes, rank: int, world_size: int, heartbeat: float | None = None) -> None:
        self._lanes = lanes
        self._rank = rank
        self._world = world_size
        self._heartbeat = heartbeat
        self.abort_key = K.abort_key(world_size)
        self._hb_key = K.group_key(world_size, f"hb/{rank}")
        # Every rank's heartbeat key and last reading: made on the first liveness check, so a
        # large world costs nothing until heartbeats are read (O(1) memory in the constructor).
        self._hb_keys: list[str] = []
        self._beats: list[_Beat] = []
        self._next_read = 0.0  # the earliest next heartbeat read (see HB_READ)
        self._last_read = 0.0  # when the counters were last read (some or all)
        # One reader for the group's blocked ranks (see _turn): the value this rank wrote to the
        # reader key while it is the reader (set under the lock: callers look at it), else the
        # value it last read there and on how many reads in a row.
        self._reader_key = K.reader_key(world_size)
        self._reading: bytes | None = None
        self._seen: bytes | None = None
        self._seen_times = 0
        self._turns = itertools.count(1)
        self._suspect = False  # a counter this watcher reads is silent (see SUSPECT_AFTER)
        self._cv = threading.Condition()
        self._tasks: deque[Task] = deque()
        # Retry tasks waiting for their next run: (when, tie-breaker, task), earliest first.
        self._later: list[tuple[float, int, Task]] = []
        self._blocked: dict[int, _Blocked] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._running = False  # the thread is alive (set under the lock, by _start and _run)
        self._closed = False
        self._busy = False
        self._broken = False  # the watcher's connection was lost: reconnect
        self._next_poll = 0.0
        # The constructor writes the first heartbeat (it declares the interval, K.first_beat);
        # the thread's first is one interval later, never racing it.
        self._next_beat = time.monotonic() + heartbeat if heartbeat is not None else 0.0
        self._active_until = 0.0
        # While the thread sleeps: until when (None: until notified). Lets callers skip
        # waking it, so back-to-back collectives do not cost a thread switch each.
        self._sleeping = False
        self._wake_at: float | None = None
        self.notice: bytes | None = None  # b"{rank}:{reason}" once the group is aborted
        _LIVE.add(self)
        if heartbeat is not None:
            with self._cv:
                self._start()

    # -- API used by the collectives -------------------------------------------
    def submit(self, task: Task) -> None:
        """Run ``task(lane)`` in the background, in submission order (waits while
        ``MAX_PENDING`` tasks are queued)."""
        with self._cv:
            self._start()
            while len(self._tasks) >= MAX_PENDING and self._running:
                self._cv.notify_all()
                self._cv.wait(0.1)
            self._tasks.append(task)
            self._start()  # the thread may have exited while we waited (like the C++ twin)
            now = time.monotonic()
            self._active_until = now + LINGER
            if self._sleeping and (len(self._tasks) >= BATCH or self._wake_at is None or self._wake_at > now + tick()):
                self._cv.notify_all()

    def retry(self, task: Retry) -> None:
        """Run ``task(lane)`` in the background, and again after the delay it returns, until it
        returns None. For cleanup that waits on other ranks: the thread beats, polls, names and
        cleans in between, where a task that slept would hold all of that up (a live rank's
        heartbeat would stop). Waiting runs do not count towards ``MAX_PENDING``."""

        def run(lane: Lane) -> None:
            delay = task(lane)
            if delay is not None:
                with self._cv:
                    heapq.heappush(self._later, (time.monotonic() + delay, next(self._ids), run))

        self.submit(run)

    def blocked(self, names_key: str, timeout: float, wake: Wake | None = None) -> _BlockedScope:
        """Context manager: the caller is blocked in a collective whose NAMES log is
        ``names_key``; ``wake(lane, notice)`` releases it on abort. A caller that named itself
        deletes the log when the block exits normally."""
        return _BlockedScope(self, names_key, timeout, wake)

    def _enter_blocked(self, names_key: str, timeout: float, wake: Wake | None) -> int:
        with self._cv:
            ident = next(self._ids)
            now = time.monotonic()
            if not self._blocked:
                self._next_poll = now + POLL
            entry = _Blocked(names_key, now + grace_period(timeout), wake)
            self._blocked[ident] = entry
            self._active_until = now + LINGER
            self._start()
            first = min(entry.due, self._next_poll)
            # Already aborted (the notice came after this op's check, from another thread or
            # another instance of the group): this caller is woken now, not at the next wake.
            wake_now = self.notice is not None
            if self._sleeping and (wake_now or self._wake_at is None or self._wake_at > first):
                self._cv.notify_all()
        return ident

    def _exit_blocked(self, ident: int, ok: bool) -> None:
        with self._cv:
            entry = self._blocked.pop(ident, None)
            if not self._blocked and self._reading is not None and self._sleeping:
                self._cv.notify_all()  # hand the reading over now (see _release)
        if ok and entry is not None and entry.named:
            # This rank appended its name: once the op has succeeded nobody reads the NAMES
            # log, and the rank deletes it after its own append (the watcher keeps the order).
            # On a timeout it stays: the other ranks read it to name the missing ones.
            names_key = entry.names_key
            self.submit(lambda lane: lane.delete(names_key))

    def aborted(self, notice: bytes) -> None:
        """The group is aborted: remember the first notice and wake every blocked caller."""
        with self._cv:
            if self.notice is None:
                self.notice = notice
            self._start()
            self._cv.notify_all()

    def pause(self, seconds: float) -> bytes | None:
        """Sleep up to ``seconds``, less if the group is aborted meanwhile; the abort notice, if any."""
        end = time.monotonic() + seconds
        with self._cv:
            while self.notice is None and (left := end - time.monotonic()) > 0:
                self._cv.wait(left)
            return self.notice

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every submitted task has run, retries included; False on timeout."""
        end = time.monotonic() + timeout
        with self._cv:
            self._cv.notify_all()
            while self._tasks or self._busy or self._later:
                left = end - time.monotonic()
                if left <= 0 or not self._running:
                    return not self._tasks and not self._later
                self._cv.wait(left)
        return True

    def close(self, flush_timeout: float = 5.0) -> None:
        """Stop heartbeats; wait up to ``flush_timeout`` for the queue to drain. The thread
        exits once nothing is queued and no caller is blocked (it serves those until they return)."""
        with self._cv:
            if not self._closed and self._heartbeat is not None:
                # A closed rank is not dead: its heartbeat goes first (peers skip missing ones),
                # not after the cleanup, which may wait on other ranks for long (Watcher.retry).
                self._tasks.appendleft(lambda lane: lane.drop_counter(self._hb_key))
            self._closed = True
            self._cv.notify_all()
            # Callers still blocked on other threads keep the thread serving them (naming, abort
            # notices, liveness) until they return: close() waits only for the cleanup queued so far.
            # Not at exit: the thread then stops serving them and must end before finalization.
            self._cv.wait_for(
                lambda: (
                    not self._running
                    or (not _LEAVING and self._blocked and not (self._tasks or self._busy or self._later))
                ),
                flush_timeout,
            )
            if self._running:
                return
        self.join(flush_timeout)

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the thread to end (after ``close``)."""
        with self._cv:
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    # -- the thread --------------------------------------------------------------
    def _start(self) -> None:
        """Start the thread unless it runs, or the process exits (called with the lock held)."""
        if not self._running and not _LEAVING:
            self._running = True
            self._thread = threading.Thread(target=self._run, name="torch_ctrl-watcher", daemon=True)
            self._thread.start()

    def _next_work(self) -> tuple[list[Task], list[str], list[_Blocked], bool, bool, bool]:
        """Wait for something to do: (tasks, names to publish, callers to wake, poll?, beat?,
        release the reading?)."""
        with self._cv:
            while True:
                now = time.monotonic()
                if _LEAVING:  # at exit, cleanup that waits on other ranks stays undone
                    self._later.clear()
                while self._later and self._later[0][0] <= now:
                    self._tasks.append(heapq.heappop(self._later)[2])
                # Blocked callers are served (named, woken, polled for) until the process exits.
                blocked = [] if _LEAVING else list(self._blocked.values())
                polling = self._reads()
                names = [b.names_key for b in blocked if not b.named and b.due <= now]
                for b in blocked:
                    if b.due <= now:
                        b.named = True
                wake = [b for b in blocked if self.notice is not None and not b.woken]
                for b in wake:
                    b.woken = True
                poll = polling and self.notice is None and now >= self._next_poll
                if poll:
                    self._next_poll = now + (min(POLL, self._heartbeat) if self._heartbeat else POLL)
                beat = self._heartbeat is not None and not self._closed and now >= self._next_beat
                if beat:
                    self._next_beat = now + self._heartbeat  # type: ignore[operator]
                release = self._reading is not None and not polling
                if self._tasks or names or wake or poll or beat or release or self._done():
                    tasks = [self._tasks.popleft()] if self._tasks else []
                    self._busy = bool(tasks)
                    self._cv.notify_all()
                    return tasks, names, wake, poll, beat, release
                due = [b.due for b in blocked if not b.named]
                if polling and self.notice is None:
                    due.append(self._next_poll)
                if self._heartbeat is not None and not self._closed:
                    due.append(self._next_beat)
                if now < self._active_until and not self._closed:
                    due.append(now + tick())
                if self._later:
                    due.append(self._later[0][0])
                self._wake_at = min(due) if due else None
                self._sleeping = True
                self._cv.wait(max(0.0, self._wake_at - now) if self._wake_at is not None else None)
                self._sleeping = False

    def _reads(self) -> bool:
        """Whether the watcher polls (called with the lock held): a caller is blocked, or a
        counter it reads is silent (see SUSPECT_AFTER) and nothing ended the group yet. Not
        once the process exits."""
        if _LEAVING:
            return False
        return bool(self._blocked) or (self._suspect and self.notice is None and not self._closed)

    def _done(self) -> bool:
        """Closed, and no caller or retry left to serve (called with the lock held)."""
        return self._closed and (not self._blocked or _LEAVING) and not self._later

    def _run(self) -> None:
        try:
            # A background connection (plain-socket check first, short attempts in torch): the
            # thread may start after the server went away, and must not be inside torch's
            # connect loop (seconds per attempt there) when the process exits; once closed, a
            # server that refuses ends it too (its queued cleanup is dropped, as after a crash).
            lane = self._lanes.acquire(stop=lambda: _LEAVING or self._closed)
        except Exception as exc:  # noqa: BLE001 - store gone: nothing left to clean
            log.debug("torch_ctrl watcher cannot open a lane: %s", exc)
            with self._cv:
                self._tasks.clear()
                self._busy = False
                self._running = False
                self._cv.notify_all()
            return
        while True:
            tasks, names, wake, poll, beat, release = self._next_work()
            if self._broken:
                lane = self._healed(lane)  # the last wake found the server gone: try again first
            if not self._broken:
                lane = self._serve(lane, tasks, names, wake, poll, beat, release)
            # else the server is still gone: this wake's work is dropped rather than sent on the
            # dead connection (torch logs a C++ trace for each such call, a beat a second when
            # idle); a server that comes back is a new one, without the keys it would touch.
            with self._cv:
                if self._broken and self._closed:
                    # Closing, and the connection is lost: what is left to clean stays (as after
                    # a crash) rather than close() waiting out a reconnect per task.
                    self._tasks.clear()
                    self._later.clear()
                self._busy = False
                self._cv.notify_all()
                if not self._tasks and self._done():
                    break
        if lane.owned:
            retire(lane)
        with self._cv:
            self._running = False
            self._cv.notify_all()

    def _serve(
        self,
        lane: Lane,
        tasks: list[Task],
        names: list[str],
        wake: list[_Blocked],
        poll: bool,
        beat: bool,
        release: bool,
    ) -> Lane:
        """One wake's store work, in order; the lane to go on with (a new one if this one was lost)."""
        if beat:
            self._safely(self._beat, lane)
        if poll:
            self._safely(self._poll, lane)
        if release:
            self._safely(self._release, lane)
        for key in names:
            self._safely(lambda ln, k=key: ln.append(k, b"%d," % self._rank), lane)
        for blocked in wake:
            if blocked.wake is not None:
                notice = self.notice or b""
                self._safely(lambda ln, b=blocked, n=notice: b.wake(ln, n), lane)  # type: ignore[misc]
        for task in tasks:
            self._safely(task, lane)
        return self._healed(lane)

    def _beat(self, lane: Lane) -> None:
        """One heartbeat: ``K.BEAT`` added to this rank's counter."""
        assert self._heartbeat is not None
        # A counter that holds no interval was lost (a restarted server): declare it again.
        if lane.add(self._hb_key, K.BEAT) % K.BEAT == 0:
            lane.add(self._hb_key, K.first_beat(self._heartbeat) - K.BEAT)

    def _poll(self, lane: Lane) -> None:
        """One abort check (and, with liveness, one heartbeat read) for blocked callers."""
        notice = lane.peek(self.abort_key)
        if notice is None and self._heartbeat is not None:
            dead = self._find_dead(lane)
            if dead is not None:
                rank, silent = dead
                mine = b"%d:no heartbeat for %.1fs (process died or hung)" % (rank, silent)
                notice = lane.claim(self.abort_key, mine)
        if notice is not None:
            self.aborted(notice)

    def _find_dead(self, lane: Lane) -> tuple[int, float] | None:
        """A rank whose heartbeat has not moved for DEAD_AFTER intervals, if any."""
        assert self._heartbeat is not None
        now = time.monotonic()
        if now < self._next_read:
            return None
        self._next_read = now + HB_READ * self._heartbeat
        if not self._hb_keys:
            self._hb_keys = [K.group_key(self._world, f"hb/{r}") for r in range(self._world)]
            self._beats = [_Beat() for _ in range(self._world)]
        # One reader needs compare_set, and delete_key to hand over; elsewhere everyone reads.
        shared = lane.cas and lane.deletes
        ranks, renew = self._turn(lane) if shared else (None, False)
        if ranks is None:
            values = lane.peek_many(self._hb_keys)
            ranks = list(range(self._world))
        else:
            values = [lane.peek(self._hb_keys[r]) for r in ranks]
        last, self._last_read = self._last_read, now
        dead = None
        suspect = False
        for rank, value in zip(ranks, values):
            if value == b"0":  # dropped where keys cannot be deleted (Lane.drop_counter)
                value = None
            beat = self._beats[rank]
            # A counter not read on the previous read (this rank read only the reader's then)
            # counts from now: silence is only ever measured between reads in a row.
            if value != beat.value or beat.read_at != last:
                beat.value, beat.since = value, now
            elif value is not None and rank != self._rank:
                silent = now - beat.since
                # The rank's own interval when it beats slower than this one: silence is its to judge.
                interval = max(self._heartbeat, K.beat_interval(value) or 0.0)
                if dead is None and silent > DEAD_AFTER * interval:
                    dead = rank, silent
                suspect = suspect or silent > SUSPECT_AFTER * interval
            beat.read_at = now
        self._suspect = suspect and dead is None  # this thread's only: no lock
        if renew and dead is None:  # a reader that found a dead rank aborts the group instead
            self._renew(lane)
        return dead

    def _turn(self, lane: Lane) -> tuple[list[int] | None, bool]:
        """Whose counters this read covers, and whether to renew the reader key after it.

        One blocked rank, the reader, reads all N counters and renews the reader key
        (``b"{rank}:{n}"``) after each read; every other blocked rank reads the key and the
        reader's counter only, so a group of blocked ranks costs the server O(N) per read
        period instead of O(N^2). A rank takes the reading over (``compare_set``) when the key
        is absent (nobody reads, or the reader's op ended and it handed over) or unchanged on
        STALE_READS reads in a row; a reader whose heartbeat stops is declared dead by the
        others, who read its counter. ``None``: all ranks."""
        if self._reading is not None:
            return None, True
        seen = lane.peek(self._reader_key)
        if seen is not None and seen == self._seen:
            self._seen_times += 1
        else:
            self._seen, self._seen_times = seen, 1
        if seen is None or self._seen_times >= STALE_READS:
            expected = seen or b""
            mine = b"%d:%d" % (self._rank, next(self._turns))
            stands = lane.swap(self._reader_key, expected, mine)
            if stands == mine:
                self._set_reading(mine)
                return None, False
            if stands == expected:  # the stale key went away meanwhile: read everyone this time
                self._seen, self._seen_times = None, 0
                return None, False
            self._seen, self._seen_times = stands, 1  # another rank took it first
        reader = K.parse_reader(self._seen, self._world) if self._seen is not None else None
        return ([reader] if reader is not None and reader != self._rank else []), False

    def _renew(self, lane: Lane) -> None:
        """After a read as the reader: a new value in the reader key, unless another rank took
        it over meanwhile (or it went away): then follow that rank (or take it again)."""
        held = self._reading
        assert held is not None
        mine = b"%d:%d" % (self._rank, next(self._turns))
        stands = lane.swap(self._reader_key, held, mine)
        self._set_reading(mine if stands == mine else None)
        if stands != mine:
            self._seen, self._seen_times = (None, 0) if stands == held else (stands, 1)

    def _set_reading(self, value: bytes | None) -> None:
        with self._cv:
            self._reading = value

    def _release(self, lane: Lane) -> None:
        """No caller blocked any more: hand the reading over (delete the reader key), so that
        a rank still blocked takes it on its next read rather than after STALE_READS."""
        with self._cv:
            if self._reads():  # blocked again meanwhile, or a suspect to declare
                return
            self._reading = None
        self._seen, self._seen_times = None, 0
        lane.delete(self._reader_key)

    def _safely(self, task: Task, lane: Lane) -> None:
        try:
            task(lane)
        except Exception as exc:  # noqa: BLE001 - background work is best effort
            log.debug("torch_ctrl watcher task failed: %s", exc)
            if lane.owned and connection_lost(exc):
                self._broken = True

    def _healed(self, lane: Lane) -> Lane:
        """The lane to go on with: a new connection when the last one was lost (the server
        restarted, or dropped us); the old one while no new one can be opened (tried again
        on the next wake)."""
        if not self._broken or _LEAVING or self._closed:  # no new connection once exiting or closed
            return lane
        try:
            # Not a pooled lane (those may be as dead as ours); a background connection.
            fresh = self._lanes.open(HEAL_CONNECT, stop=lambda: _LEAVING or self._closed)
        except Exception as exc:  # noqa: BLE001 - the server is still gone
            log.debug("torch_ctrl watcher cannot reconnect yet: %s", exc)
            return lane
        self._broken = False
        retire(lane)  # owned: only a lost connection is replaced
        return fresh
