// The watcher: one background thread per instance, on its own lane. C++ twin of
// torch_ctrl/watcher.py: cleanup off the critical path, naming of ranks blocked past
// the grace period, abort polling and waking of blocked callers, and (opt in)
// heartbeats with dead-rank detection.
#pragma once

#include "lanes.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace torch_ctrl {


using Task = std::function<void(Lane&)>;
// A task to run again (twin of watcher.Retry): the seconds to wait before its next run, or
// nullopt when done.
using Retry = std::function<std::optional<double>(Lane&)>;
using Wake = std::function<void(Lane&, const std::string&)>;

double grace_period(double timeout);

// Twins of watcher.MAX_PENDING, BATCH, TICK, LINGER, POLL and DEAD_AFTER.
constexpr size_t kMaxPending = 8;
constexpr size_t kBatch = 4;
constexpr double kTick = 0.1;
constexpr double kTickWatchers = 16;
// The active watcher's wake-up period in this process (kTick, longer past kTickWatchers).
double tick();
// The process exits (twin of watcher._stop_all's flag): from now on watchers only drain their
// cleanup and stop, even with callers still blocked, so nothing of ours makes a blocked call
// return while the interpreter finalizes.
void leave_process();
// Whether the process exits (twin of watcher.leaving): background work stops at its next step.
bool leaving();
constexpr double kLinger = 1.0;
constexpr double kPoll = 0.7;
constexpr double kDeadAfter = 2.5;
// The heartbeat counters are read on a poll at most once per this many intervals (from an
// interval of 2 * kPoll, not on every poll): the reader's read returns all N counters (the
// other blocked ranks read two keys, see the reader below), so a group of blocked ranks costs
// the server O(N) per read period, and a longer interval is how a large job lowers that.
// Counters move once per interval, so reading them more often than every half interval adds
// nothing but load.
constexpr double kHbRead = 0.5;
// A blocked rank that finds the reader key unchanged on this many reads in a row takes the
// reading over: the reader renews the key after each of its reads, so it loses it only by
// missing two reads in a row (hung, or gone without handing over).
constexpr int kStaleReads = 3;
// A counter read unchanged for more than this many intervals makes its rank a suspect: the
// watcher goes on reading (and stays the reader) after its last caller returns, until that
// rank beats again or is declared dead. Handing the reading over then would restart the count
// from the next reader's first read (up to kDeadAfter more intervals). A live rank's counter
// moves at least once per interval, and reads are half an interval or more apart.
constexpr double kSuspectAfter = 1.0;

class Watcher {
 public:
  Watcher(std::shared_ptr<Lanes> lanes, int rank, int world_size, std::optional<double> heartbeat);
  ~Watcher();

  void submit(Task task);
  // Run `task(lane)` in the background, and again after the delay it returns, until it returns
  // nullopt. For cleanup that waits on other ranks: the thread beats, polls, names and cleans
  // in between. Waiting runs do not count towards kMaxPending.
  void retry(Retry task);
  bool flush(double timeout);
  void close(double flush_timeout);
  // The group is aborted: remember the first notice and wake every blocked caller.
  void aborted(const std::string& notice);
  std::optional<std::string> notice();
  // Sleep up to `seconds`, less if the group is aborted meanwhile; the abort notice, if any.
  std::optional<std::string> pause(double seconds);
  const std::string& abort_key() const { return abort_key_; }

  // RAII: marks the caller as blocked in a collective whose NAMES log is
  // `names_key`; `wake(lane, notice)` releases it on abort. A caller that named
  // itself deletes the log when the scope exits normally.
  class Blocked {
   public:
    Blocked(Watcher& w, const std::string& names_key, double timeout, Wake wake = nullptr);
    ~Blocked();

   private:
    Watcher& w_;
    uint64_t id_;
    int exceptions_;  // std::uncaught_exceptions() at construction
  };

 private:
  using Clock = std::chrono::steady_clock;
  struct Entry {
    std::string names_key;
    Clock::time_point due;
    Wake wake;
    bool named = false;
    bool woken = false;
  };
  struct Beat {
    std::optional<std::string> value;
    Clock::time_point since = Clock::now();
    Clock::time_point read_at{};  // when this counter was last read
  };
  struct State;  // shared with the thread, so a detached thread stays valid
  void start_locked();
  static void run(std::shared_ptr<State> state);
  // Mark the watcher closed, its heartbeat's drop first in the queue (called with the lock held).
  static void close_locked(State& st);
  // The queued form of a retry task: runs it, and files itself in State::later if it asks to run
  // again (a weak reference: a task left behind never keeps the watcher's state alive).
  static Task retrying(std::weak_ptr<State> state, std::shared_ptr<Retry> task);
  static void poll(State& st, Lane& lane);
  // A rank whose heartbeat has not moved for kDeadAfter intervals, and for how long (seconds).
  static std::optional<std::pair<int, double>> find_dead(State& st, Lane& lane);
  // Whose counters this read covers (nullopt: all ranks), and whether to renew the reader key
  // after it (twin of Watcher._turn, which says why).
  static std::pair<std::optional<std::vector<int>>, bool> turn(State& st, Lane& lane);
  static void renew(State& st, Lane& lane);
  static void set_reading(State& st, std::optional<std::string> value);
  // Whether the thread polls (called with the lock held): a caller is blocked, or a counter it
  // reads is silent (kSuspectAfter) and nothing ended the group yet. Not once the process exits.
  static bool reads(const State& st);
  // No caller blocked any more: hand the reading over (delete the reader key).
  static void release(State& st, Lane& lane);

  std::shared_ptr<State> state_;
  std::string abort_key_;
};

} // namespace torch_ctrl
