// C++ twin of torch_ctrl/exit_gate.py.
#include "exit_gate.h"
#include "watcher.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

namespace torch_ctrl::exit_gate {

bool (*runs_the_exit)() = nullptr;

namespace {
// Trivially destructible state only: parked and polling threads may outlive static destructors.
thread_local int depth = 0;
std::atomic<int64_t> inside{0};
std::atomic<int64_t> parked{0};
std::atomic<uint64_t> events{0};

constexpr double kStep = 0.01;

[[noreturn]] void park() {
  parked.fetch_add(1);
  events.fetch_add(1);
  while (true) {
    std::this_thread::sleep_for(std::chrono::hours(1));
  }
}

// A forked child has only the thread that forked: none of the others is inside or parked.
[[maybe_unused]] const int forked = pthread_atfork(nullptr, nullptr, [] {
  inside.store(depth > 0 ? 1 : 0);
  parked.store(0);
});

bool may_park() {
  return depth > 0 && leaving() && !(runs_the_exit != nullptr && runs_the_exit());
}
} // namespace

Inside::Inside() {
  if (depth++ == 0) {
    inside.fetch_add(1);
  }
}

Inside::~Inside() {
  if (--depth == 0) {
    inside.fetch_sub(1);
  }
}

void checkpoint() {
  // Only a thread inside a collective counts as activity for settle() (as in the Python twin):
  // a watcher polling at exit must not hold settle() to its bound.
  if (depth > 0) {
    events.fetch_add(1);
  }
  if (may_park()) {
    park();
  }
}

void pause(double seconds) {
  checkpoint();
  std::this_thread::sleep_for(std::chrono::duration<double>(std::max(seconds, 0.0)));
  checkpoint();
}

int64_t parked_threads() {
  return parked.load();
}

void settle(double quiet, double bound) {
  auto start = std::chrono::steady_clock::now();
  auto since = start;
  uint64_t last = events.load();
  while (inside.load() > parked.load()) {
    auto now = std::chrono::steady_clock::now();
    if (events.load() != last) {
      last = events.load();
      since = now;
    }
    if (now - since >= std::chrono::duration<double>(quiet) || now - start >= std::chrono::duration<double>(bound)) {
      return;
    }
    std::this_thread::sleep_for(std::chrono::duration<double>(kStep));
  }
}

} // namespace torch_ctrl::exit_gate
