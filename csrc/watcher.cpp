// C++ twin of torch_ctrl/watcher.py.
#include "watcher.h"

#include <algorithm>
#include <vector>

namespace torch_ctrl {

double grace_period(double timeout) {
  return std::min(1.0, std::max(0.02, timeout / 4));
}

struct Watcher::State {
  std::shared_ptr<Lanes> lanes;
  std::mutex mutex;
  std::condition_variable cv;
  std::deque<Task> tasks;
  std::map<uint64_t, Entry> blocked;
  uint64_t next_id = 0;
  bool closed = false;
  bool busy = false;
  bool running = false;
  std::thread thread;
};

Watcher::Watcher(std::shared_ptr<Lanes> lanes, int rank) : state_(std::make_shared<State>()), rank_(rank) {
  state_->lanes = std::move(lanes);
}

Watcher::~Watcher() {
  std::unique_lock<std::mutex> lock(state_->mutex);
  state_->closed = true;
  state_->cv.notify_all();
  if (state_->thread.joinable()) {
    // Never join here: the destructor may run with the GIL held while the thread
    // waits for it inside a Python store. The thread owns a reference to State.
    state_->thread.detach();
  }
}

void Watcher::start_locked() {
  if (!state_->running) {
    if (state_->thread.joinable()) {
      state_->thread.join();
    }
    state_->running = true;
    state_->thread = std::thread(&Watcher::run, state_, rank_);
  }
}

void Watcher::submit(Task task) {
  std::unique_lock<std::mutex> lock(state_->mutex);
  start_locked();
  // Back-pressure: a tight loop of collectives must not outrun its cleanup.
  while (state_->tasks.size() >= kMaxPending && state_->running) {
    state_->cv.wait_for(lock, std::chrono::milliseconds(100));
  }
  state_->tasks.push_back(std::move(task));
  start_locked();
  state_->cv.notify_all();
}

bool Watcher::flush(double timeout) {
  auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout);
  std::unique_lock<std::mutex> lock(state_->mutex);
  while (!state_->tasks.empty() || state_->busy) {
    if (!state_->running || state_->cv.wait_until(lock, end) == std::cv_status::timeout) {
      return state_->tasks.empty();
    }
  }
  return true;
}

void Watcher::close(double flush_timeout) {
  std::thread thread;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->closed = true;
    state_->cv.notify_all();
  }
  // Wait (bounded) for the queue to drain, then join or leave the thread to finish.
  auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(flush_timeout);
  std::unique_lock<std::mutex> lock(state_->mutex);
  state_->cv.wait_until(lock, end, [&] { return !state_->running; });
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

Watcher::Blocked::Blocked(Watcher& w, const std::string& names_key, double timeout) : w_(w) {
  auto due = std::chrono::steady_clock::now() +
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                 std::chrono::duration<double>(grace_period(timeout)));
  std::lock_guard<std::mutex> lock(w_.state_->mutex);
  id_ = w_.state_->next_id++;
  w_.state_->blocked[id_] = Entry{names_key, due, false};
  w_.start_locked();
  w_.state_->cv.notify_all();
}

Watcher::Blocked::~Blocked() {
  std::lock_guard<std::mutex> lock(w_.state_->mutex);
  w_.state_->blocked.erase(id_);
}

void Watcher::run(std::shared_ptr<State> st, int rank) {
  std::unique_ptr<Lane> lane;
  try {
    lane = st->lanes->acquire();
  } catch (const std::exception&) {
    std::lock_guard<std::mutex> lock(st->mutex);
    st->tasks.clear();
    st->running = false;
    st->cv.notify_all();
    return;
  }
  std::unique_lock<std::mutex> lock(st->mutex);
  while (true) {
    auto now = std::chrono::steady_clock::now();
    std::vector<std::string> names;
    std::optional<std::chrono::steady_clock::time_point> next;
    for (auto& [id, e] : st->blocked) {
      if (e.named) {
        continue;
      }
      if (e.due <= now) {
        e.named = true;
        names.push_back(e.names_key);
      } else if (!next || e.due < *next) {
        next = e.due;
      }
    }
    if (st->tasks.empty() && names.empty()) {
      if (st->closed) {
        break;
      }
      if (next) {
        st->cv.wait_until(lock, *next);
      } else {
        st->cv.wait(lock);
      }
      continue;
    }
    std::deque<Task> tasks;
    if (!st->tasks.empty()) {
      tasks.push_back(std::move(st->tasks.front()));
      st->tasks.pop_front();
    }
    st->busy = !tasks.empty();
    st->cv.notify_all();
    lock.unlock();
    for (const auto& key : names) {
      try {
        lane->append(key, std::to_string(rank) + ",");
      } catch (const std::exception&) {
      }
    }
    for (auto& task : tasks) {
      try {
        task(*lane);
      } catch (const std::exception&) {
        // cleanup is best effort
      }
    }
    lock.lock();
    st->busy = false;
    st->cv.notify_all();
  }
  st->running = false;
  st->cv.notify_all();
  lock.unlock();
  lane.reset();
}

} // namespace torch_ctrl
