// C++ twin of torch_ctrl/watcher.py.
#include "watcher.h"
#include "keys.h"

#include <algorithm>
#include <atomic>
#include <cstdio>

namespace torch_ctrl {

double grace_period(double timeout) {
  return std::min(1.0, std::max(0.02, timeout / 4));
}

namespace {
std::atomic<int64_t> live_watchers{0};
std::atomic<bool> process_leaving{false};

std::chrono::steady_clock::duration secs(double s) {
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(s));
}
} // namespace

void leave_process() {
  process_leaving.store(true);
}

bool leaving() {
  return process_leaving.load();
}

double tick() {
  return kTick * std::max(1.0, static_cast<double>(live_watchers.load()) / kTickWatchers);
}

struct Watcher::State {
  std::shared_ptr<Lanes> lanes;
  int rank = 0;
  std::optional<double> heartbeat;
  std::string abort_key;
  int world = 0;
  std::string hb_key;  // this rank's
  std::vector<std::string> hb_keys;
  std::vector<Beat> beats;
  Clock::time_point next_read{};  // the earliest next heartbeat read (see kHbRead)
  Clock::time_point last_read{};  // when the counters were last read (some or all)
  // One reader for the group's blocked ranks (see Watcher::turn): the value this rank wrote to
  // the reader key while it is the reader (set under the mutex: callers look at it), else the
  // value it last read there and on how many reads in a row.
  std::string reader_key;
  std::optional<std::string> reading;
  std::optional<std::string> seen;
  int seen_times = 0;
  int64_t turns = 0;
  bool suspect = false;  // a counter this watcher reads is silent (see kSuspectAfter)
  std::mutex mutex;
  std::condition_variable cv;
  std::deque<Task> tasks;
  // Retry tasks waiting for their next run, earliest first.
  std::multimap<Clock::time_point, Task> later;
  std::map<uint64_t, Entry> blocked;
  uint64_t next_id = 0;
  bool closed = false;
  bool busy = false;
  bool running = false;
  Clock::time_point next_poll{};
  Clock::time_point next_beat{};
  // Active (a collective in the last kLinger s): the thread wakes at least every kTick,
  // so callers need not wake it and back-to-back collectives share one thread switch.
  Clock::time_point active_until{};
  // While the thread sleeps: until when (nullopt: until notified). Lets callers skip
  // waking it, so back-to-back collectives do not cost a thread switch each.
  bool sleeping = false;
  std::optional<Clock::time_point> wake_at;
  std::optional<std::string> notice;
  std::thread thread;
};

Watcher::Watcher(std::shared_ptr<Lanes> lanes, int rank, int world_size, std::optional<double> heartbeat)
    : state_(std::make_shared<State>()), abort_key_(keys::abort_key(world_size)) {
  ++live_watchers;
  state_->lanes = std::move(lanes);
  state_->rank = rank;
  state_->heartbeat = heartbeat;
  state_->abort_key = abort_key_;
  // Every rank's heartbeat key and last reading are made on the first liveness check (on the
  // watcher thread), so a large world costs nothing until heartbeats are read.
  state_->world = world_size;
  state_->hb_key = keys::group_key(world_size, "hb/" + std::to_string(rank));
  state_->reader_key = keys::reader_key(world_size);
  if (heartbeat) {
    // The constructor writes the first heartbeat (it declares the interval, keys::first_beat);
    // the thread's first is one interval later, never racing it.
    state_->next_beat = Clock::now() + secs(*heartbeat);
    std::lock_guard<std::mutex> lock(state_->mutex);
    start_locked();
  }
}

Watcher::~Watcher() {
  --live_watchers;
  std::unique_lock<std::mutex> lock(state_->mutex);
  close_locked(*state_);
  if (state_->thread.joinable()) {
    // Never join here: the destructor may run with the GIL held while the thread
    // waits for it inside a Python store. The thread owns a reference to State.
    state_->thread.detach();
  }
}

void Watcher::start_locked() {
  if (!state_->running && !leaving()) {
    if (state_->thread.joinable()) {
      state_->thread.join();
    }
    state_->running = true;
    state_->thread = std::thread(&Watcher::run, state_);
  }
}

void Watcher::submit(Task task) {
  std::unique_lock<std::mutex> lock(state_->mutex);
  start_locked();
  // Back-pressure: a tight loop of collectives must not outrun its cleanup.
  while (state_->tasks.size() >= kMaxPending && state_->running) {
    state_->cv.notify_all();
    state_->cv.wait_for(lock, std::chrono::milliseconds(100));
  }
  state_->tasks.push_back(std::move(task));
  start_locked();
  auto now = Clock::now();
  state_->active_until = now + secs(kLinger);
  if (state_->sleeping &&
      (state_->tasks.size() >= kBatch || !state_->wake_at || *state_->wake_at > now + secs(tick()))) {
    state_->cv.notify_all();
  }
}

void Watcher::retry(Retry task) {
  submit(retrying(state_, std::make_shared<Retry>(std::move(task))));
}

Task Watcher::retrying(std::weak_ptr<State> state, std::shared_ptr<Retry> task) {
  return [state, task](Lane& lane) {
    auto delay = (*task)(lane);
    auto st = state.lock();
    if (delay && st) {
      std::lock_guard<std::mutex> lock(st->mutex);
      st->later.emplace(Clock::now() + secs(*delay), retrying(state, task));
    }
  };
}

void Watcher::aborted(const std::string& notice) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (!state_->notice) {
    state_->notice = notice;
  }
  start_locked();
  state_->cv.notify_all();
}

std::optional<std::string> Watcher::notice() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->notice;
}

std::optional<std::string> Watcher::pause(double seconds) {
  std::unique_lock<std::mutex> lock(state_->mutex);
  state_->cv.wait_for(lock, secs(seconds), [this] { return state_->notice.has_value(); });
  return state_->notice;
}

bool Watcher::flush(double timeout) {
  auto end = Clock::now() + secs(timeout);
  std::unique_lock<std::mutex> lock(state_->mutex);
  state_->cv.notify_all();
  while (!state_->tasks.empty() || state_->busy || !state_->later.empty()) {
    if (!state_->running || state_->cv.wait_until(lock, end) == std::cv_status::timeout) {
      return state_->tasks.empty() && state_->later.empty();
    }
  }
  return true;
}

void Watcher::close_locked(State& st) {
  if (!st.closed && st.heartbeat) {
    // A closed rank is not dead: its heartbeat goes first (peers skip missing ones), not after
    // the cleanup, which may wait on other ranks for long (Watcher::retry).
    st.tasks.push_front([key = st.hb_key](Lane& lane) { lane.drop_counter(key); });
  }
  st.closed = true;
  st.cv.notify_all();
}

void Watcher::close(double flush_timeout) {
  std::thread thread;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    close_locked(*state_);
  }
  auto end = Clock::now() + secs(flush_timeout);
  std::unique_lock<std::mutex> lock(state_->mutex);
  // Callers still blocked on other threads keep the thread serving them (naming, abort
  // notices, liveness) until they return: close() waits only for the cleanup queued so far.
  // Not at exit: the thread then stops serving them and must end before finalization.
  state_->cv.wait_until(lock, end, [&] {
    const State& st = *state_;
    bool flushed = st.tasks.empty() && !st.busy && st.later.empty();
    return !st.running || (!leaving() && !st.blocked.empty() && flushed);
  });
  if (state_->thread.joinable()) {
    if (!state_->running) {
      thread = std::move(state_->thread);
    } else {
      state_->thread.detach();
    }
  }
  lock.unlock();
  if (thread.joinable()) {
    thread.join();
  }
}

Watcher::Blocked::Blocked(Watcher& w, const std::string& names_key, double timeout, Wake wake)
    : w_(w), exceptions_(std::uncaught_exceptions()) {
  auto now = Clock::now();
  std::lock_guard<std::mutex> lock(w_.state_->mutex);
  if (w_.state_->blocked.empty()) {
    w_.state_->next_poll = now + secs(kPoll);
  }
  id_ = w_.state_->next_id++;
  auto due = now + secs(grace_period(timeout));
  w_.state_->blocked[id_] = Entry{names_key, due, std::move(wake), false, false};
  w_.state_->active_until = now + secs(kLinger);
  w_.start_locked();
  auto first = std::min(due, w_.state_->next_poll);
  // Already aborted (the notice came after this op's check, from another thread or another
  // instance of the group): this caller is woken now, not at the watcher's next wake.
  bool wake_now = w_.state_->notice.has_value();
  if (w_.state_->sleeping && (wake_now || !w_.state_->wake_at || *w_.state_->wake_at > first)) {
    w_.state_->cv.notify_all();
  }
}

Watcher::Blocked::~Blocked() {
  std::string names;
  {
    std::lock_guard<std::mutex> lock(w_.state_->mutex);
    auto it = w_.state_->blocked.find(id_);
    if (it != w_.state_->blocked.end()) {
      // This rank appended its name: once the op has succeeded nobody reads the NAMES log,
      // and the rank deletes it after its own append (the watcher keeps the order). On a
      // timeout (an exception unwinding) it stays: the other ranks read it to name the missing.
      if (it->second.named && std::uncaught_exceptions() == exceptions_) {
        names = it->second.names_key;
      }
      w_.state_->blocked.erase(it);
      if (w_.state_->blocked.empty() && w_.state_->reading && w_.state_->sleeping) {
        w_.state_->cv.notify_all();  // hand the reading over now (see Watcher::release)
      }
    }
  }
  if (!names.empty()) {
    try {
      w_.submit([names](Lane& lane) { lane.remove(names); });
    } catch (const std::exception&) {
      // best effort, like all cleanup
    }
  }
}

// The longest the watcher waits to open a new connection (it tries again on its next wake).
constexpr double kHealConnect = 1.0;

void Watcher::poll(State& st, Lane& lane) {
  auto notice = lane.peek(st.abort_key);
  if (!notice && st.heartbeat) {
    if (auto dead = find_dead(st, lane)) {
      char reason[96];
      std::snprintf(reason, sizeof(reason), "%d:no heartbeat for %.1fs (process died or hung)", dead->first, dead->second);
      std::string mine(reason);
      notice = lane.claim(st.abort_key, mine);
    }
  }
  if (notice) {
    std::lock_guard<std::mutex> lock(st.mutex);
    if (!st.notice) {
      st.notice = notice;
    }
    st.cv.notify_all();
  }
}

std::optional<std::pair<int, double>> Watcher::find_dead(State& st, Lane& lane) {
  auto now = Clock::now();
  if (now < st.next_read) {
    return std::nullopt;
  }
  st.next_read = now + secs(kHbRead * *st.heartbeat);
  if (st.hb_keys.empty()) {
    for (int r = 0; r < st.world; ++r) {
      st.hb_keys.push_back(keys::group_key(st.world, "hb/" + std::to_string(r)));
    }
    st.beats.resize(st.world);
  }
  // One reader needs compare_set, and delete_key to hand over; elsewhere everyone reads.
  bool shared = lane.cas && lane.deletes;
  std::optional<std::vector<int>> ranks;
  bool renew_after = false;
  if (shared) {
    std::tie(ranks, renew_after) = turn(st, lane);
  }
  std::vector<std::optional<std::string>> values;
  if (!ranks) {
    values = lane.peek_many(st.hb_keys);
    ranks.emplace(st.world);
    for (int r = 0; r < st.world; ++r) {
      (*ranks)[r] = r;
    }
  } else {
    for (int r : *ranks) {
      values.push_back(lane.peek(st.hb_keys[r]));
    }
  }
  auto last = st.last_read;
  st.last_read = now;
  std::optional<std::pair<int, double>> dead;
  bool suspect = false;
  for (size_t i = 0; i < ranks->size() && i < values.size(); ++i) {
    int r = (*ranks)[i];
    auto& value = values[i];
    if (value == "0") {  // dropped where keys cannot be deleted (Lane::drop_counter)
      value.reset();
    }
    Beat& beat = st.beats[r];
    double silent = std::chrono::duration<double>(now - beat.since).count();
    // A counter not read on the previous read (this rank read only the reader's then) counts
    // from now: silence is only ever measured between reads in a row.
    if (value != beat.value || beat.read_at != last) {
      beat.value = value;
      beat.since = now;
    } else if (value && r != st.rank) {
      // The rank's own interval when it beats slower than this one: silence is its to judge.
      double interval = std::max(*st.heartbeat, keys::beat_interval(*value).value_or(0.0));
      if (!dead && silent > kDeadAfter * interval) {
        dead = std::make_pair(r, silent);
      }
      suspect = suspect || silent > kSuspectAfter * interval;
    }
    beat.read_at = now;
  }
  st.suspect = suspect && !dead;  // this thread's only: no lock
  if (renew_after && !dead) {  // a reader that found a dead rank aborts the group instead
    renew(st, lane);
  }
  return dead;
}

std::pair<std::optional<std::vector<int>>, bool> Watcher::turn(State& st, Lane& lane) {
  if (st.reading) {  // written only by this thread (under the mutex, for callers' reads)
    return {std::nullopt, true};
  }
  auto seen = lane.peek(st.reader_key);
  if (seen && seen == st.seen) {
    ++st.seen_times;
  } else {
    st.seen = seen;
    st.seen_times = 1;
  }
  if (!seen || st.seen_times >= kStaleReads) {
    std::string expected = seen.value_or("");
    std::string mine = std::to_string(st.rank) + ":" + std::to_string(++st.turns);
    std::string stands = lane.swap(st.reader_key, expected, mine);
    if (stands == mine) {
      set_reading(st, mine);
      return {std::nullopt, false};
    }
    if (stands == expected) {  // the stale key went away meanwhile: read everyone this time
      st.seen.reset();
      st.seen_times = 0;
      return {std::nullopt, false};
    }
    st.seen = stands;  // another rank took it first
    st.seen_times = 1;
  }
  std::optional<int> reader = st.seen ? keys::parse_reader(*st.seen, st.world) : std::nullopt;
  std::vector<int> out;
  if (reader && *reader != st.rank) {
    out.push_back(*reader);
  }
  return {out, false};
}

void Watcher::renew(State& st, Lane& lane) {
  std::string held = *st.reading;
  std::string mine = std::to_string(st.rank) + ":" + std::to_string(++st.turns);
  std::string stands = lane.swap(st.reader_key, held, mine);
  set_reading(st, stands == mine ? std::optional<std::string>(mine) : std::nullopt);
  if (stands != mine) {
    if (stands == held) {
      st.seen.reset();
      st.seen_times = 0;
    } else {
      st.seen = stands;
      st.seen_times = 1;
    }
  }
}

void Watcher::set_reading(State& st, std::optional<std::string> value) {
  std::lock_guard<std::mutex> lock(st.mutex);
  st.reading = std::move(value);
}

bool Watcher::reads(const State& st) {
  if (leaving()) {
    return false;
  }
  return !st.blocked.empty() || (st.suspect && !st.notice && !st.closed);
}

void Watcher::release(State& st, Lane& lane) {
  {
    std::lock_guard<std::mutex> lock(st.mutex);
    if (reads(st)) {  // blocked again meanwhile, or a suspect to declare
      return;
    }
    st.reading.reset();
  }
  st.seen.reset();
  st.seen_times = 0;
  lane.remove(st.reader_key);
}

void Watcher::run(std::shared_ptr<State> st) {
  std::unique_ptr<Lane> lane;
  bool dead = false;  // the lane's connection was lost and no new one could be opened yet
  try {
    // A background connection (twin of Watcher._run): the thread may start after the server
    // went away, and must not spend seconds per attempt in torch's connect loop; once closed, a
    // server that refuses ends it too (its queued cleanup is dropped, as after a crash).
    lane = st->lanes->acquire(-1.0, [&st] {
      std::lock_guard<std::mutex> relock(st->mutex);
      return leaving() || st->closed;
    });
  } catch (const std::exception&) {
    std::lock_guard<std::mutex> lock(st->mutex);
    st->tasks.clear();
    st->running = false;
    st->cv.notify_all();
    return;
  }
  std::unique_lock<std::mutex> lock(st->mutex);
  while (true) {
    auto now = Clock::now();
    // Blocked callers are served (named, woken, polled for) until the process exits.
    bool serve = !leaving();
    if (!serve) {  // at exit, cleanup that waits on other ranks stays undone
      st->later.clear();
    }
    while (!st->later.empty() && st->later.begin()->first <= now) {
      st->tasks.push_back(std::move(st->later.begin()->second));
      st->later.erase(st->later.begin());
    }
    std::vector<std::string> names;
    std::vector<Wake> wakes;
    std::optional<Clock::time_point> next;
    auto consider = [&](Clock::time_point t) {
      if (!next || t < *next) {
        next = t;
      }
    };
    for (auto& [id, e] : st->blocked) {
      if (!serve) {
        break;
      }
      if (!e.named && e.due <= now) {
        e.named = true;
        names.push_back(e.names_key);
      } else if (!e.named) {
        consider(e.due);
      }
      if (st->notice && !e.woken) {
        e.woken = true;
        if (e.wake) {
          wakes.push_back(e.wake);
        }
      }
    }
    bool waiting = serve && !st->blocked.empty();
    bool polling = reads(*st);
    bool do_poll = polling && !st->notice && now >= st->next_poll;
    if (do_poll) {
      st->next_poll = now + secs(st->heartbeat ? std::min(kPoll, *st->heartbeat) : kPoll);
    } else if (polling && !st->notice) {
      consider(st->next_poll);
    }
    bool do_beat = st->heartbeat && !st->closed && now >= st->next_beat;
    if (do_beat) {
      st->next_beat = now + secs(*st->heartbeat);
    } else if (st->heartbeat && !st->closed) {
      consider(st->next_beat);
    }
    if (now < st->active_until && !st->closed) {
      consider(now + secs(tick()));
    }
    if (!st->later.empty()) {
      consider(st->later.begin()->first);
    }
    bool do_release = st->reading && !polling;
    std::deque<Task> tasks;
    if (!st->tasks.empty()) {
      tasks.push_back(std::move(st->tasks.front()));
      st->tasks.pop_front();
    }
    if (tasks.empty() && names.empty() && wakes.empty() && !do_poll && !do_beat && !do_release) {
      if (st->closed && !waiting && st->later.empty()) {
        break;
      }
      st->wake_at = next;
      st->sleeping = true;
      if (next) {
        st->cv.wait_until(lock, *next);
      } else {
        st->cv.wait(lock);
      }
      st->sleeping = false;
      continue;
    }
    st->busy = !tasks.empty();
    std::string notice = st->notice.value_or("");
    int rank = st->rank;
    bool closing = st->closed;
    st->cv.notify_all();
    lock.unlock();
    auto reopen = [&]() {
      // A new connection (not a pooled lane: those may be as dead as ours); none once the
      // process exits or the instance is closed. False while the server is still gone.
      if (leaving() || closing) {
        return false;
      }
      try {
        lane = st->lanes->open(kHealConnect, [&st] {
          std::lock_guard<std::mutex> relock(st->mutex);
          return leaving() || st->closed;
        });
        return true;
      } catch (const std::exception&) {
        return false;
      }
    };
    if (dead) {
      dead = !reopen();  // the last wake found the server gone: try again first
    }
    bool broken = false;
    if (!dead) {
      auto safely = [&](const std::function<void()>& fn) {
        try {
          fn();
        } catch (const std::exception& exc) {
          // background work is best effort; a lost connection is replaced below
          broken = broken || (lane->owned && connection_lost(exc));
        }
      };
      if (do_beat) {
        safely([&] {
          // A counter that holds no interval was lost (a restarted server): declare it again.
          if (lane->add(st->hb_key, keys::kBeat) % keys::kBeat == 0) {
            lane->add(st->hb_key, keys::first_beat(*st->heartbeat) - keys::kBeat);
          }
        });
      }
      if (do_poll) {
        safely([&] { poll(*st, *lane); });
      }
      if (do_release) {
        safely([&] { release(*st, *lane); });
      }
      for (const auto& key : names) {
        safely([&] { lane->append(key, std::to_string(rank) + ","); });
      }
      for (const auto& wake : wakes) {
        safely([&] { wake(*lane, notice); });
      }
      for (auto& task : tasks) {
        safely([&] { task(*lane); });
      }
      if (broken) {
        // close() may have come while the tasks ran: read it again (twin of Watcher._healed),
        // so that a closing watcher does not first wait out a reconnect (about 2 s).
        {
          std::lock_guard<std::mutex> relock(st->mutex);
          closing = st->closed;
        }
        // The server restarted or dropped us: go on with a new connection; while none can be
        // opened, the next wakes try again before touching the store.
        dead = !reopen();
      }
    }
    // While dead, a wake's work is dropped rather than sent on the dead connection (torch logs
    // a C++ trace for each such call, a beat a second when idle); a server that comes back is
    // a new one, without the keys it would touch (twin of Watcher._run).
    lock.lock();
    if (dead && closing) {
      // Closing, and the connection is lost: what is left to clean stays (as after a crash)
      // rather than close() waiting out a reconnect per task.
      st->tasks.clear();
      st->later.clear();
    }
    st->busy = false;
    st->cv.notify_all();
  }
  st->running = false;
  st->cv.notify_all();
  lock.unlock();
  lane.reset();
}

} // namespace torch_ctrl
