// StoreCollectives: the C++ implementation of the protocol (docs/protocol.md).
// Twin of torch_ctrl/store_collectives.py: same structure, same names.
#pragma once

#include "lanes.h"
#include "keys.h"
#include "watcher.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <functional>
#include <list>
#include <set>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include <unistd.h>

namespace torch_ctrl {

using Key = std::optional<std::string>;

// One collective call: its name, the user's key, its key prefix and deadline.
struct Op {
  std::string name;
  std::string label;
  std::string prefix;
  double seconds;
  std::chrono::steady_clock::time_point deadline;
  std::string key(const std::string& field) const;
  double left() const;
};

// Every rank's payload of an all_gather/all_sum, by rank, without a copy per rank: views into
// the log read once (or into payloads fetched on their own: chunked, or one slot per rank).
struct Gathered {
  // What the views point into: a list (stable addresses, and unlike a deque no allocation while
  // empty, as it is on the generic path's common case).
  std::list<std::string> storage;
  std::vector<std::vector<uint8_t>> raw;  // values as the store returned them, viewed past their tag
  std::vector<std::string_view> values;
};

class StoreCollectives {
 public:
  StoreCollectives(
      c10::intrusive_ptr<c10d::Store> store,
      int rank,
      int world_size,
      std::optional<double> heartbeat_interval = std::nullopt,
      bool cas = true,
      bool deletes = true);
  ~StoreCollectives();

  void barrier(const Key& key, double timeout, bool block);
  void broadcast_send(const Key& key, const std::string& data, double timeout);
  std::string broadcast_recv(const Key& key, double timeout);
  void gather_send(const Key& key, const std::string& data, double timeout);
  std::vector<std::string> gather_recv(const Key& key, const std::string& data, double timeout);
  std::string scatter_send(const Key& key, const std::vector<std::string>& data, double timeout);
  std::string scatter_recv(const Key& key, double timeout);
  Gathered all_gather(const Key& key, const std::string& data, double timeout);
  int64_t all_sum(const Key& key, int64_t data, double timeout);
  void close(double flush_timeout);
  void abort(const std::string& reason);
  // The group's abort notice ("{rank}:{reason}") once this instance knows of it.
  std::optional<std::string> notice();
  // Another instance of this group in this process learned of the group's abort: fail every
  // later op at once and wake blocked callers (twin of PyStoreCollectives._learn_abort).
  void learn_abort(const std::string& notice);

  int rank() const { return rank_; }
  int world_size() const { return world_; }
  // The process that made this instance (a forked child must not use it).
  pid_t owner_pid() const { return owner_pid_; }

 private:
  Op begin(const std::string& name, const Key& key, double timeout);
  std::unique_ptr<Lane> open_lane(const Op& op);
  using Keys = std::shared_ptr<const std::vector<std::string>>;
  // Wakes a blocked read of `keys` on abort: writes the abort notice to each of them.
  static Wake wake_set(Keys keys);
  static Wake wake_set(std::string key);
  // Releases a caller in TCPStore's server-side barrier on abort: raises the counter by
  // kAbortBias (after an abort frame in the op's log, if it has one).
  static Wake wake_native(const Op& op, const std::string& counter);
  // The barrier op on a TCPStore: the server-side barrier, then the counter (until_counted),
  // read in the same blocked scope (see the definition).
  std::optional<std::string> meet(const Op& op, Lane& lane);
  // Arrive at the op's barrier and wait for every rank; on the add/done barrier the last
  // arriver writes publish() (or nothing) as the done flag's payload, and every rank returns it.
  std::string arrive(const Op& op, Lane& lane, const std::function<std::string()>& publish = nullptr);
  // all_sum on the generic path: O(1) store work per rank.
  int64_t sum_counted(const Op& op, int64_t value);
  // Every rank's payload, indexed by rank.
  Gathered exchange(const Op& op, const std::string& payload);
  Gathered exchange_slots(const Op& op, const std::string& payload);
  // Write the chunks of `payload` (if any); return the tagged value to store at `key`.
  std::string stage(Lane& lane, const std::string& key, const std::string& payload);
  void put(Lane& lane, const std::string& key, const std::string& payload);
  // The writes of a send (broadcast_send, gather_send, scatter_send) on a lane of its own: a
  // store error is the op's one-line CollectiveError (or timeout), as in every other op.
  void send(const Op& op, const std::function<void(Lane&)>& write);
  // Blocking read of several tagged values: (payloads, chunk keys to delete).
  std::pair<std::vector<std::string>, std::vector<std::string>> read_many(
      const Op& op,
      Lane& lane,
      Keys keys);
  // The blocking read of read_many, values still tagged and as the store returned them.
  std::vector<std::vector<uint8_t>> fetch_many(const Op& op, Lane& lane, Keys keys);
  // (payload, chunk keys to delete)
  std::pair<std::string, std::vector<std::string>> read(const Op& op, Lane& lane, const std::string& key);
  std::pair<std::string, std::vector<std::string>> untag(
      const Op& op,
      Lane& lane,
      const std::string& key,
      std::string value);
  std::optional<std::string> until_counted(const Op& op, Lane& lane);
  void check_counter(const Op& op, const std::optional<std::string>& counter);
  [[noreturn]] void raise_abort(const Op& op, const std::string& notice);

  [[noreturn]] void failure(const Op& op, const std::exception& exc);
  std::optional<std::string> bad_counter(const Op& op);
  [[noreturn]] void timeout(const Op& op, Lane& lane);
  // The store's key names (nullopt where it cannot list them), read at most once per timeout.
  using Listing = std::function<const std::optional<std::vector<std::string>>&()>;
  std::set<int> present_slots(const Op& op, Lane& lane, const Listing& names);
  bool other_path(const Op& op, Lane& lane, const Listing& names);
  std::string other_world_sizes(const Op& op, const Listing& names);

  // An op's cleanup: handed to the watcher, or made at once on an in-process store (twin of
  // _cleanup).
  void cleanup(Task task);
  void delete_later(std::vector<std::string> keys);
  void exit_later(
      const Op& op,
      int64_t expected,
      const std::vector<std::string>& fields,
      std::vector<std::string> extra = {},
      const std::string& counter = keys::kExit,
      bool slots = false);
  void delete_when_full(const Op& op);

  c10::intrusive_ptr<c10d::Store> store_;
  int rank_;
  int world_;
  pid_t owner_pid_ = getpid();
  std::shared_ptr<Lanes> lanes_;
  std::unique_ptr<Watcher> watcher_;
  std::mutex mutex_;
  int64_t seq_ = 0;
  std::unordered_set<std::string> used_;
};

} // namespace torch_ctrl
