// Lanes: the store handles a collective talks through. C++ twin of torch_ctrl/lanes.py.
// Owned lanes are clones (new connections) of TCPStore/FileStore-backed stores, so a
// blocking call may set the lane's timeout; other stores are shared and must be
// thread safe, and their blocking reads are wait(keys, timeout) + read.
#pragma once

#include "reaper.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace torch_ctrl {

c10::intrusive_ptr<c10d::Store> base_store(c10::intrusive_ptr<c10d::Store> store);
// The store under any PrefixStores, and `key` as that store sees it.
std::pair<c10::intrusive_ptr<c10d::Store>, std::string> base_key(
    c10::intrusive_ptr<c10d::Store> store,
    std::string key);

// One plain TCP connection to each address of host:port (twin of lanes._attempt): "" when one
// accepts, else the error in the words of the Python twin's exception.
std::string attempt(const std::string& host, int port, double seconds);
// Whether the TCP connection on `fd` is connected to itself (twin of lanes._self_connected).
bool connected_to_itself(int fd);

// torch's trampoline for Python-written stores does not forward delete_key to
// Python; the bindings install this hook to call the Python method directly.
extern std::function<void(c10d::Store&, const std::string&)> python_delete_key;
// A Python-written store's add() may return an int past int64, which the trampoline cannot
// convert; the bindings install this hook to read such a value (add 0) wrapped at 64 bits.
extern std::function<int64_t(c10d::Store&, const std::string&)> python_read_counter;
// torch's PrefixStore and its trampoline for Python-written stores do not forward list_keys to
// Python; the bindings install this hook, which lists such a store (when its class defines
// list_keys) relative to the PrefixStores over it, as the Python twin does
// (lanes.python_list_keys), and gives nullopt for every other store.
extern std::function<std::optional<std::vector<std::string>>(c10d::Store&)> python_list_keys;
// Whether a store call's exception is an interruption raised in a Python-written store
// (KeyboardInterrupt, SystemExit): it goes to the caller as it is, not as a store error.
extern std::function<bool(const std::exception&)> python_interrupt;

// A Python-written store's exception, as the Python twin sees it: whether its type is
// DistNetworkError or ConnectionError, and its str() (never pybind11's what(), which appends
// the traceback: file and function names there must not decide anything).
struct PythonError {
  bool network;
  std::string text;
};
// The PythonError of a store call's exception, or nullopt when it is not a Python exception.
extern std::function<std::optional<PythonError>(const std::exception&)> python_error;

// Whether a store error means the connection is gone (the server died or restarted, or it
// dropped this connection).
bool connection_lost(const std::exception& exc);

// A lost connection's error text, naming the store's server ("host:port"; "" when the store
// has none) unless the text already does: that host is the one to look at.
std::string lost_text(const std::string& server, const std::string& text);

struct Lane {
  c10::intrusive_ptr<c10d::Store> store;
  bool owned = false;
  bool native_barrier = false;
  bool extended = false;
  bool polled = false;  // a FileStore (under any PrefixStores): waits poll check() faster than it
  bool cas = true;  // compare_set may be called (see store_api in torch_ctrl/lanes.py)
  bool deletes = true;  // delete_key may be called
  double timeout = -1.0;
  // On the TCPStore path under PrefixStores: what they put before a key, and the TCPStore
  // under them (PrefixStore does not forward barrier(), so it is called there, with the full key).
  std::string prefix;
  c10::intrusive_ptr<c10d::Store> base;
  std::optional<reaper::Socket> socket;  // a TCPStore connection of its own (see reaper.h)

  void set(const std::string& key, const std::string& value);
  int64_t add(const std::string& key, int64_t value);
  void remove(const std::string& key);  // delete_key
  // Delete a counter of this rank's own; where keys cannot be deleted, bring it back to 0,
  // which its readers take for absent (a heartbeat).
  void drop_counter(const std::string& key);
  // Read without waiting or writing (without compare_set: check, then get; keys never vanish
  // on such a store); nullopt when the key does not exist.
  std::optional<std::string> peek(const std::string& key);
  // peek for a counter that ranks may be waiting on in TCPStore's server-side barrier: the
  // server takes compare_set for a write and releases them, so check, then get (3 round trips
  // where peek takes one: for timeouts and polls, never the success path). Elsewhere peek.
  // A key deleted between the get's wait and its read (a barrier's counter, deleted by rank 0
  // once the barrier completed) reads as absent: the libuv server answers that read with no
  // bytes, the legacy server drops the connection (a new one, opened within kQuietReconnect
  // seconds, then checks the key; if none opens, the lost connection's error is raised).
  std::optional<std::string> peek_quietly(const std::string& key);
  // Read what was appended to `key`, at most `most` entries where entries are separate keys.
  std::optional<std::string> peek_log(const std::string& key, int64_t most);
  // Write `value` unless a value was written first; return the value that stands (without
  // compare_set: a later caller waits up to 1 s for the first caller's write).
  std::string claim(const std::string& key, const std::string& value);
  // compare_set: write `desired` if `key` holds `expected` (or is absent and `expected` is
  // empty); what then stands. Absent with `expected` not empty: every torch store returns
  // `expected` and writes nothing. Only where `cas`.
  std::string swap(const std::string& key, const std::string& expected, const std::string& desired);
  // peek several keys: one check and one multi_get when all exist; where keys can vanish, the
  // multi_get waits kQuietWait on the lane's own connection, then one peek per key (as on
  // shared clients and polled stores): a key deleted after the check would hold it otherwise.
  std::vector<std::optional<std::string>> peek_many(const std::vector<std::string>& keys);
  void append(const std::string& key, const std::string& value);
  void multi_set(const std::vector<std::string>& keys, const std::vector<std::string>& values);

  // Blocking calls: `seconds` is the time left until the op's deadline.
  void wait(const std::vector<std::string>& keys, double seconds);
  std::string get(const std::string& key, double seconds);
  std::vector<std::string> multi_get(const std::vector<std::string>& keys, double seconds);
  // multi_get as the store returns it: no copy into strings (views of N values per rank).
  std::vector<std::vector<uint8_t>> multi_get_raw(const std::vector<std::string>& keys, double seconds);
  void barrier(const std::string& key, int world_size, double seconds);
  std::optional<std::vector<std::string>> list_keys();

 private:
  // check after a failed read; on a connection the legacy server dropped (a get that found
  // the key gone), on a new one.
  bool still_there(const std::string& key);
  // A new connection for this owned lane, under the same PrefixStores.
  void reconnect(double connect_timeout);
  void arm(double seconds);
  bool fits(double seconds);
  void wait_polled(const std::vector<std::string>& keys, double seconds);
  std::string get_polled(const std::string& key, double seconds);
};

class Lanes {
 public:
  // cas, deletes: whether the store's compare_set and delete_key may be called, as
  // torch_ctrl.lanes.store_api answers for it (the bindings pass its answer).
  explicit Lanes(c10::intrusive_ptr<c10d::Store> store, bool cas = true, bool deletes = true);
  // connect_timeout (seconds, > 0): the longest a new connection may take to open (an op's
  // time left), so that a server that is gone cannot hold an op past its deadline.
  // Every new TCPStore connection reaches the server with plain sockets before torch's connect
  // (twin of lanes.new_client): a caller's fails at once when every address refuses.
  // stop (set): a background connection (the watcher's, twin of lanes.new_client's stop): a
  // refusal is retried, torch gets kBackgroundTurn seconds per attempt, and the attempt ends
  // once stop() is true after a failed one.
  std::unique_ptr<Lane> acquire(double connect_timeout = -1.0, const std::function<bool()>& stop = nullptr);
  // A new lane (a new connection where lanes are owned), never one from the pool.
  std::unique_ptr<Lane> open(double connect_timeout = -1.0, const std::function<bool()>& stop = nullptr);
  void release(std::unique_ptr<Lane> lane);
  void close();
  bool owned() const { return owned_; }
  bool native_barrier() const { return native_barrier_; }
  bool deletes() const { return deletes_; }
  bool tcp() const { return tcp_; }  // a TCPStore under any PrefixStores (either path)
  // Its server ("host:port"), named when a connection to it is lost; "" for other stores.
  const std::string& server() const { return server_; }
  // An in-process store (a HashStore under any PrefixStores): its calls never wait on I/O, so
  // an op's cleanup costs less made by the caller than handed to the watcher thread.
  bool local() const { return local_; }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  bool owned_;
  bool native_barrier_;
  bool extended_;
  bool polled_;  // a FileStore under any PrefixStores
  bool cas_;
  bool deletes_;
  std::string prefix_;
  bool tcp_ = false;  // a TCPStore under the PrefixStores: new lanes are new clients
  std::string server_;
  bool local_ = false;  // a HashStore under the PrefixStores
  std::mutex mutex_;
  std::vector<std::unique_ptr<Lane>> free_;
};

// Borrow a lane; one that saw an error is dropped, not reused.
class LaneGuard {
 public:
  explicit LaneGuard(Lanes& lanes) : lanes_(lanes), lane_(lanes.acquire()) {}
  LaneGuard(Lanes& lanes, std::unique_ptr<Lane> lane) : lanes_(lanes), lane_(std::move(lane)) {}
  // `deadline`: the lane's connection is shut down if the guard is still alive
  // reaper::kGrace seconds later (a server that stopped answering; twin of Borrowed).
  LaneGuard(Lanes& lanes, std::unique_ptr<Lane> lane, std::chrono::steady_clock::time_point deadline)
      : lanes_(lanes), lane_(std::move(lane)) {
    if (lane_->socket) {
      bound_ = std::make_unique<reaper::Bound>(lane_->socket, deadline);
    }
  }
  ~LaneGuard() {
    bound_.reset();  // before the lane can go to another caller
    if (std::uncaught_exceptions() == 0) {
      lanes_.release(std::move(lane_));
    }
  }
  Lane& operator*() { return *lane_; }
  Lane* operator->() { return lane_.get(); }

 private:
  Lanes& lanes_;
  std::unique_ptr<Lane> lane_;
  std::unique_ptr<reaper::Bound> bound_;
};

} // namespace torch_ctrl
