// The watcher: one background thread per instance, on its own lane. C++ twin of
// torch_ctrl/watcher.py: cleanup off the critical path, and naming of ranks that
// stay blocked past the grace period (so timeouts can list missing ranks).
#pragma once

#include "lanes.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace torch_ctrl {

using Task = std::function<void(Lane&)>;

double grace_period(double timeout);

// Most cleanup tasks queued per instance (twin of watcher.MAX_PENDING).
constexpr size_t kMaxPending = 4;

class Watcher {
 public:
  Watcher(std::shared_ptr<Lanes> lanes, int rank);
  ~Watcher();

  void submit(Task task);
  bool flush(double timeout);
  void close(double flush_timeout);

  // RAII: marks the caller as blocked in a collective whose NAMES log is `names_key`.
  class Blocked {
   public:
    Blocked(Watcher& w, const std::string& names_key, double timeout);
    ~Blocked();

   private:
    Watcher& w_;
    uint64_t id_;
  };

 private:
  struct Entry {
    std::string names_key;
    std::chrono::steady_clock::time_point due;
    bool named = false;
  };
  struct State;  // shared with the thread, so a detached thread stays valid
  void start_locked();
  static void run(std::shared_ptr<State> state, int rank);

  std::shared_ptr<State> state_;
  int rank_;
};

} // namespace torch_ctrl
