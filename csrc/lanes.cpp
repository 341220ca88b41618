// C++ twin of torch_ctrl/lanes.py.
#include "lanes.h"
#include "compat.h"
#include "exit_gate.h"
#include "keys.h"

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <exception>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <mutex>
#include <sstream>
#include <thread>

namespace torch_ctrl {

namespace {
using Clock = std::chrono::steady_clock;
constexpr double kTick = 0.001;  // smallest timeout handed to a store
// Twins of lanes.FILE_POLL_FIRST and FILE_POLL: a FileStore's own blocking reads look every
// 10 ms, so lanes over one poll check() from 0.1 ms, doubling up to 10 ms.
constexpr double kFilePollFirst = 0.0001;
constexpr double kFilePoll = 0.01;
// Twin of lanes.CLAIM_WAIT: without compare_set, how long a later claimer waits for the
// first one's write.
constexpr double kClaimWait = 1.0;
// Twin of lanes.QUIET_WAIT: how long peek_quietly's get waits (for a key that vanished after
// its check, it waits this long for nothing).
constexpr double kQuietWait = 0.25;
// Twin of lanes.QUIET_RECONNECT: how long peek_quietly's new connection may take to open (a
// server is gone when it refuses, at once; one that is busy or stalls in a reverse lookup
// needs seconds).
constexpr double kQuietReconnect = 5.0;

// Twin of lanes._ForkGate: no fork() while one of our threads opens a connection. Name
// resolution takes glibc's resolver lock; a child forked while another thread held it
// deadlocks as soon as one of its own threads ends. fork() waits for connections in progress
// (at most kForkWait seconds) and holds new ones off until it is done.
constexpr double kForkWait = 2.0;
struct ForkGate {
  std::mutex mutex;
  int connecting = 0;

  ForkGate() {
    pthread_atfork(
        [] {
          auto& g = gate();
          g.mutex.lock();  // held across fork(): no connection starts meanwhile
          auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(kForkWait);
          while (g.connecting > 0 && std::chrono::steady_clock::now() < end) {
            g.mutex.unlock();
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
            g.mutex.lock();
          }
        },
        [] { gate().mutex.unlock(); },
        [] {
          auto& g = gate();
          g.connecting = 0;  // the connecting threads were not copied
          g.mutex.unlock();  // locked by this same thread before the fork
        });
  }
  static ForkGate& gate() {
    static ForkGate* g = new ForkGate();  // never destroyed: fork handlers refer to it
    return *g;
  }
};

// RAII: one connection being opened.
struct Connecting {
  Connecting() {
    auto& g = ForkGate::gate();
    std::lock_guard<std::mutex> lock(g.mutex);
    ++g.connecting;
  }
  ~Connecting() {
    auto& g = ForkGate::gate();
    std::lock_guard<std::mutex> lock(g.mutex);
    --g.connecting;
  }
  Connecting(const Connecting&) = delete;
  Connecting& operator=(const Connecting&) = delete;
};

// One memcpy each way (the iterator-pair constructors copy byte by byte; a log read by
// every rank is O(N) bytes).
std::vector<uint8_t> bytes(const std::string& s) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  return std::vector<uint8_t>(p, p + s.size());
}
std::string str(const std::vector<uint8_t>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size());
}
std::chrono::milliseconds millis(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(std::max(seconds, kTick) * 1000.0 + 0.5));
}

// PrefixStore::joinKey is protected; a derived type may name it (never instantiated).
// PrefixStore::joinKey and prefix_ are protected; a derived type may name them (never instantiated).
struct PrefixAccess : c10d::PrefixStore {
  static std::string join(c10d::PrefixStore& store, const std::string& key) {
    return (store.*(&PrefixAccess::joinKey))(key);
  }
  static const std::string& prefix(c10d::PrefixStore& store) {
    return store.*(&PrefixAccess::prefix_);
  }
};

// Twin of lanes.BACKGROUND_TURN: how long one attempt of a background connection may spend in
// torch (its connect loop retries a server that is gone for the whole attempt, plus back-off).
constexpr double kBackgroundTurn = 2.0;

// Twin of lanes._attempt: one plain TCP connection to each address of host:port in turn, each
// within `seconds` and closed at once: 0 when one accepts, else an errno, ECONNREFUSED only
// when every address refused; a name that does not resolve gives getaddrinfo's (negative)
// EAI_* code, as Python's socket.gaierror carries it.
int connects(const std::string& host, int port, double seconds) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found); rc != 0) {
    return rc == EAI_SYSTEM ? errno : rc;  // EAI_SYSTEM: Python raises the OSError of errno
  }
  int other = 0; // the last error other than a refusal
  for (addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
    int error = 0;
    int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      other = errno;
      continue;
    }
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
      if (errno != EINPROGRESS) {
        error = errno;
      } else {
        pollfd p{fd, POLLOUT, 0};
        socklen_t len = sizeof(error);
        if (::poll(&p, 1, static_cast<int>(std::max(seconds, kTick) * 1000.0)) != 1) {
          error = ETIMEDOUT;
        } else if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len) != 0) {
          error = errno;
        }
      }
    }
    if (error == 0 && connected_to_itself(fd)) {
      error = ECONNREFUSED;
    }
    ::close(fd);
    if (error == 0) {
      freeaddrinfo(found);
      return 0;
    }
    if (error != ECONNREFUSED) {
      other = error;
    }
  }
  freeaddrinfo(found);
  return other != 0 ? other : ECONNREFUSED;
}

Clock::time_point deadline_in(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

double seconds_until(Clock::time_point deadline) {
  return std::chrono::duration<double>(deadline - Clock::now()).count();
}

// What an error of connects() reads as, in the words of the Python exception its twin gives:
// "[Errno 111] Connection refused", "[Errno -2] Name or service not known".
std::string describe_connect_error(int error) {
  return "[Errno " + std::to_string(error) + "] " + (error < 0 ? gai_strerror(error) : std::strerror(error));
}

// Twin of lanes._reach: return once host:port accepts a TCP connection, or throw
// DistNetworkError at the deadline, once it failed when stop() is true, or at once when every
// address refused and refusal_ends. Plain sockets and sleeps: a thread waiting here is not
// inside torch when the process exits.
void reach(
    const std::string& host,
    int port,
    Clock::time_point deadline,
    const std::function<bool()>& stop,
    bool refusal_ends = false) {
  double pause = 0.01;
  while (true) {
    int error = connects(host, port, std::min(seconds_until(deadline), 1.0));
    if (error == 0) {
      return;
    }
    double left = seconds_until(deadline);
    if (left <= 0 || (stop && stop()) || (refusal_ends && error == ECONNREFUSED)) {
      // The same words as the Python twin's (which shows Python's OSError).
      throw c10::DistNetworkError(
          "the store's server " + host + ":" + std::to_string(port) + " is unreachable: " +
          describe_connect_error(error));
    }
    std::this_thread::sleep_for(std::chrono::duration<double>(std::min(pause, left)));
    pause = std::min(pause * 2, 0.5);
  }
}

// Twin of lanes._tcp_client: torch's client of tcp's server (same host, port, backend and
// timeout), its connect given up after `seconds` when that is shorter than the timeout.
c10::intrusive_ptr<c10d::Store> tcp_client(c10d::TCPStore& tcp, double seconds) {
  c10d::TCPStoreOptions opts;
  opts.port = tcp.getPort();
  opts.isServer = false;
  opts.waitWorkers = false;
  opts.timeout = tcp.getTimeout();
  if (millis(seconds) < opts.timeout) {
    opts.timeout = millis(seconds); // connecting gives up then; the lane sets its own later
  }
  opts.useLibUV = tcp.isLibUvBackend();
  auto client = reaper::opened(
      [&] { return c10::make_intrusive<c10d::TCPStore>(tcp.getHost(), opts); },
      tcp.getHost() + ":" + std::to_string(opts.port),
      opts.port,
      std::chrono::duration<double>(opts.timeout).count());
  client->setTimeout(tcp.getTimeout());
  return client;
}

// Twin of lanes.new_client: a new client of a TCPStore's server within connect_timeout
// seconds (the store's timeout when <= 0), the server reached with plain sockets first:
// torch's connect loop retries a server that is gone for its whole timeout and logs each
// failed attempt with a C++ stack trace.
// - A caller's connection (no stop) fails at once when every address refuses: the server was
//   up when the instance was made, so it is gone.
// - A background connection (stop given) retries a refusal (the server may come back), gives
//   torch kBackgroundTurn seconds per attempt, and ends once stop() after a failed attempt.
c10::intrusive_ptr<c10d::Store> tcp_new_client(
    c10d::TCPStore& tcp,
    double connect_timeout,
    const std::function<bool()>& stop) {
  double seconds = connect_timeout > 0 ? connect_timeout : std::chrono::duration<double>(tcp.getTimeout()).count();
  auto deadline = deadline_in(seconds);
  if (!stop) {
    reach(tcp.getHost(), tcp.getPort(), deadline, nullptr, /*refusal_ends=*/true);
    return tcp_client(tcp, std::max(seconds_until(deadline), kTick));
  }
  double pause = 0.01;
  while (true) {
    reach(tcp.getHost(), tcp.getPort(), deadline, stop);
    try {
      return tcp_client(tcp, std::max(std::min(seconds_until(deadline), kBackgroundTurn), kTick));
    } catch (const std::exception&) {
      double left = seconds_until(deadline);
      if (left <= 0 || stop()) {
        throw;
      }
      // The server went away after the check, or did not answer within one turn: check again.
      std::this_thread::sleep_for(std::chrono::duration<double>(std::min(pause, left)));
      pause = std::min(pause * 2, 0.5);
    }
  }
}

// A new connection to the same store: a TCPStore client to the same host and port (same
// backend and timeout), under the same PrefixStores, opened within connect_timeout seconds
// when > 0 (clone() would take the store's whole timeout to fail on a server that is gone).
// Only called for TCPStore-backed chains (see Lanes::Lanes).
c10::intrusive_ptr<c10d::Store> new_client(
    const c10::intrusive_ptr<c10d::Store>& store,
    double connect_timeout,
    const std::function<bool()>& stop) {
  if (auto* prefix = dynamic_cast<c10d::PrefixStore*>(store.get())) {
    return c10::make_intrusive<c10d::PrefixStore>(
        PrefixAccess::prefix(*prefix), new_client(prefix->getUnderlyingStore(), connect_timeout, stop));
  }
  auto* tcp = dynamic_cast<c10d::TCPStore*>(store.get());
  if (tcp == nullptr) {
    throw std::logic_error("new_client: not a TCPStore");
  }
  return tcp_new_client(*tcp, connect_timeout, stop);
}
} // namespace

std::string lost_text(const std::string& server, const std::string& text) {
  // Twin of lanes.lost_text.
  if (server.empty() || text.find(server) != std::string::npos) {
    return text;
  }
  return "the connection to the store's server " + server + " was lost: " + text;
}

std::function<std::optional<PythonError>(const std::exception&)> python_error;

bool connection_lost(const std::exception& exc) {
  // Twin of lanes.connection_lost: by type first (torch's C++ DistNetworkError, or a
  // Python-written store's DistNetworkError / ConnectionError), then by text: a Python
  // exception's str(), as the Python twin reads it.
  if (dynamic_cast<const c10::DistNetworkError*>(&exc) != nullptr) {
    return true;
  }
  std::optional<PythonError> py = python_error ? python_error(exc) : std::nullopt;
  if (py && py->network) {
    return true;
  }
  std::string text = py ? py->text : exc.what();
  std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return std::tolower(c); });
  for (const char* t : {"connection", "broken pipe", "failed to recv", "socket"}) {
    if (text.find(t) != std::string::npos) {
      return true;
    }
  }
  return false;
}

// Twin of lanes._self_connected: whether the connection on `fd` is a TCP self-connect. With
// nothing listening on a local port of the ephemeral range, a connect to it now and then gets
// that very port as its source, and the kernel connects the socket to itself (a simultaneous
// open): that is a refusal, not a server.
bool connected_to_itself(int fd) {
  sockaddr_storage mine{};
  sockaddr_storage peer{};
  socklen_t mine_len = sizeof(mine);
  socklen_t peer_len = sizeof(peer);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&mine), &mine_len) != 0 ||
      getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_len) != 0) {
    return false;
  }
  return mine_len == peer_len && std::memcmp(&mine, &peer, mine_len) == 0;
}

std::string attempt(const std::string& host, int port, double seconds) {
  int error = connects(host, port, seconds);
  return error == 0 ? "" : describe_connect_error(error);
}

std::pair<c10::intrusive_ptr<c10d::Store>, std::string> base_key(
    c10::intrusive_ptr<c10d::Store> store,
    std::string key) {
  while (auto* prefix = dynamic_cast<c10d::PrefixStore*>(store.get())) {
    key = PrefixAccess::join(*prefix, key);
    store = prefix->getUnderlyingStore();
  }
  return {store, key};
}

c10::intrusive_ptr<c10d::Store> base_store(c10::intrusive_ptr<c10d::Store> store) {
  while (auto* prefix = dynamic_cast<c10d::PrefixStore*>(store.get())) {
    store = prefix->getUnderlyingStore();
  }
  return store;
}

void Lane::set(const std::string& key, const std::string& value) {
  store->set(key, bytes(value));
}

std::function<int64_t(c10d::Store&, const std::string&)> python_read_counter;
std::function<bool(const std::exception&)> python_interrupt;

int64_t Lane::add(const std::string& key, int64_t value) {
  try {
    return store->add(key, value);
  } catch (const std::exception& exc) {
    if (!python_read_counter || std::string(exc.what()).find("Unable to cast Python instance") == std::string::npos) {
      throw;
    }
    // A Python-written store (torch's EtcdStore) keeps an unbounded int: the add was made,
    // but torch's binding cannot hand back a result past int64. Read the value again, wrapped
    // at 64 bits as the Python twin wraps it. Only running totals get there (their adds'
    // results are not used, or read after every rank has added), never counters.
    auto [base, full] = base_key(store, key);
    return python_read_counter(*base, full);
  }
}

std::function<void(c10d::Store&, const std::string&)> python_delete_key;

void Lane::remove(const std::string& key) {
  if (!deletes) {
    return;
  }
  try {
    store->deleteKey(key);
  } catch (const std::exception& exc) {
    if (!python_delete_key || std::string(exc.what()).find("pure virtual") == std::string::npos) {
      throw;
    }
    // Under PrefixStores too: join their prefixes and delete from the Python store itself.
    auto [base, full] = base_key(store, key);
    python_delete_key(*base, full);
  }
}

void Lane::drop_counter(const std::string& key) {
  if (deletes) {
    remove(key);
  } else {
    add(key, -add(key, 0));
  }
}

std::optional<std::string> Lane::peek(const std::string& key) {
  if (!cas) {
    if (!store->check({key})) {
      return std::nullopt;
    }
    return str(store->get(key));
  }
  std::string value = str(store->compareSet(key, bytes(keys::kMissing), bytes(keys::kNever)));
  if (value == keys::kMissing) {
    return std::nullopt;
  }
  return value;
}

std::vector<std::optional<std::string>> Lane::peek_many(const std::vector<std::string>& keys) {
  std::vector<std::optional<std::string>> out;
  if (!deletes) {  // keys never vanish
    if (store->check(keys)) {
      for (const auto& v : store->multiGet(keys)) {
        out.emplace_back(str(v));
      }
      return out;
    }
  } else if (owned && !polled && store->check(keys)) {
    try {
      for (auto& v : multi_get(keys, kQuietWait)) {
        out.emplace_back(std::move(v));
      }
      return out;
    } catch (const std::exception&) {
      out.clear();  // deleted after the check (a lost connection: peek throws)
    }
  }
  for (const auto& k : keys) {
    out.push_back(peek(k));
  }
  return out;
}

std::optional<std::string> Lane::peek_log(const std::string& key, int64_t most) {
  if (extended || cas) {
    return peek(key);
  }
  auto count = peek(keys::entry_count(key));
  if (!count) {
    return std::nullopt;
  }
  std::vector<std::string> entries;
  for (int64_t i = 1, n = std::min(keys::parse_counter(*count), most); i <= n; ++i) {
    entries.push_back(keys::entry(key, i));
  }
  // An entry is written just after its number is taken: one not there yet is left out.
  std::string log;
  for (const auto& value : peek_many(entries)) {
    if (value) {
      log += *value;
    }
  }
  return log;
}

std::string Lane::swap(const std::string& key, const std::string& expected, const std::string& desired) {
  return str(store->compareSet(key, bytes(expected), bytes(desired)));
}

std::string Lane::claim(const std::string& key, const std::string& value) {
  if (cas) {
    return str(store->compareSet(key, {}, bytes(value)));
  }
  // Without compare_set the first to take the ticket writes (right after); a later caller
  // waits up to kClaimWait for that write, and gets its own value back only if none came.
  if (add(keys::entry_count(key), 1) == 1) {
    set(key, value);
    return value;
  }
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(kClaimWait);
  double pause = 0.001;
  auto stands = peek(key);
  while (!stands && std::chrono::steady_clock::now() < deadline) {
    exit_gate::pause(pause);
    pause = std::min(pause * 2, 0.05);
    stands = peek(key);
  }
  return stands.value_or(value);
}

void Lane::append(const std::string& key, const std::string& value) {
  if (extended) {
    store->append(key, bytes(value));
    return;
  }
  if (!cas) {
    set(keys::entry(key, add(keys::entry_count(key), 1)), value);
    return;
  }
  std::string expected, desired = value;
  while (true) {
    std::string current = str(store->compareSet(key, bytes(expected), bytes(desired)));
    if (current == desired) {
      return;
    }
    expected = current;
    desired = current + value;
  }
}

void Lane::multi_set(const std::vector<std::string>& keys, const std::vector<std::string>& values) {
  // One call; stores without it get torch's default (one set per key).
  std::vector<std::vector<uint8_t>> vals;
  vals.reserve(values.size());
  for (const auto& v : values) {
    vals.push_back(bytes(v));
  }
  store->multiSet(keys, vals);
}

void Lane::arm(double seconds) {
  // Twin of Lane._arm: reset only when off by more than the slack (0.1% + 1 ms), to half the
  // slack past `seconds`; a blocking call may time out up to the slack late, never early.
  seconds = std::max(seconds, kTick);
  double slack = 0.001 * seconds + 0.001;
  if (timeout < 0 || timeout - seconds < 0 || timeout - seconds > slack) {
    timeout = seconds + slack / 2;
    store->setTimeout(millis(timeout));
  }
}

void Lane::wait(const std::vector<std::string>& keys, double seconds) {
  if (polled) {
    wait_polled(keys, seconds);
    return;
  }
  try {
    store->wait(keys, millis(seconds));
  } catch (const std::exception& exc) {
    // A Python store whose wait() takes no timeout: its own timeout applies.
    if (std::string(exc.what()).find("TypeError") == std::string::npos) {
      throw;
    }
    store->wait(keys);
  }
}

void Lane::wait_polled(const std::vector<std::string>& keys, double seconds) {
  auto start = std::chrono::steady_clock::now();
  auto deadline = start + std::chrono::duration<double>(seconds);
  double pause = kFilePollFirst;
  while (!store->check(keys)) {
    auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      // Twin of Lane._wait_sliced's text.
      std::ostringstream msg;
      msg << "wait timeout after " << seconds << "s, keys: [";
      for (size_t i = 0; i < keys.size(); ++i) {
        msg << (i ? ", '" : "'") << keys[i] << "'";
      }
      msg << "]";
      throw c10::DistStoreError(msg.str());
    }
    // where the thread parks when the process exits
    exit_gate::pause(std::min(pause, std::chrono::duration<double>(deadline - now).count()));
    pause = std::min(pause * 2, kFilePoll);
  }
}

bool Lane::fits(double seconds) {
  if (polled) {
    return false;  // its waits are polled
  }
  if (owned) {
    arm(seconds);
    return true;
  }
  double own = std::chrono::duration<double>(store->getTimeout()).count();
  return std::abs(own - seconds) <= 0.01 * seconds + 0.01;
}

std::optional<std::string> Lane::peek_quietly(const std::string& key) {
  if (!native_barrier) {
    return peek(key);
  }
  if (!store->check({key})) {
    return std::nullopt;
  }
  std::string value;
  try {
    value = get(key, kQuietWait);
  } catch (const std::exception&) {
    if (!still_there(key)) {
      return std::nullopt;  // deleted after the check: only once its barrier has completed
    }
    // The key is there and the get timed out: a server slower than kQuietWait. Read it the
    // usual way (at worst one early release) rather than report a timeout early.
    return peek(key);
  }
  // No counter is empty: the key was deleted between the get's wait and its read, which the
  // libuv server answers with no bytes.
  if (value.empty()) {
    return std::nullopt;
  }
  return value;
}

bool Lane::still_there(const std::string& key) {
  try {
    return store->check({key});
  } catch (const std::exception& lost) {
    if (!owned || !connection_lost(lost)) {
      throw;
    }
    auto gone = std::current_exception();
    try {
      reconnect(kQuietReconnect);
    } catch (const std::exception&) {
      std::rethrow_exception(gone);  // the server is gone: the lost connection is what to report
    }
    return store->check({key});
  }
}

void Lane::reconnect(double connect_timeout) {
  // The new client connects within the old one's timeout at most, and this lane's last get
  // armed that to kQuietWait: a server busy for that long is not gone.
  base_store(store)->setTimeout(millis(connect_timeout));
  Connecting connecting;
  reaper::take_opened();
  store = new_client(store, connect_timeout, nullptr);
  socket = reaper::take_opened();  // a Bound already made keeps the old one
  base.reset();
  timeout = -1.0;
}

std::string Lane::get(const std::string& key, double seconds) {
  if (polled) {
    return get_polled(key, seconds);
  }
  if (!fits(seconds)) {
    wait({key}, seconds);
  }
  return str(store->get(key));
}

std::string Lane::get_polled(const std::string& key, double seconds) {
  // Twin of Lane._get_polled: the look that finds the value also reads it.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  double pause = kFilePollFirst;
  while (true) {
    if (auto value = peek(key)) {
      return std::move(*value);
    }
    auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      std::ostringstream msg;
      msg << "wait timeout after " << seconds << "s, keys: ['" << key << "']";
      throw c10::DistStoreError(msg.str());
    }
    // where the thread parks when the process exits
    exit_gate::pause(std::min(pause, std::chrono::duration<double>(deadline - now).count()));
    pause = std::min(pause * 2, kFilePoll);
  }
}

std::vector<std::string> Lane::multi_get(const std::vector<std::string>& keys, double seconds) {
  if (polled && keys.size() == 1) {
    return {get_polled(keys[0], seconds)};
  }
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const auto& v : multi_get_raw(keys, seconds)) {
    out.push_back(str(v));
  }
  return out;
}

std::vector<std::vector<uint8_t>> Lane::multi_get_raw(const std::vector<std::string>& keys, double seconds) {
  if (polled && keys.size() == 1) {
    return {bytes(get_polled(keys[0], seconds))};
  }
  if (!fits(seconds)) {
    wait(keys, seconds);
  }
  return store->multiGet(keys);
}

void Lane::barrier(const std::string& key, int world_size, double seconds) {
  if (prefix.empty()) {
    compat::barrier(*store, key, world_size, millis(seconds));
    return;
  }
  if (!base) {
    base = base_store(store);
  }
  compat::barrier(*base, prefix + key, world_size, millis(seconds));
}

std::function<std::optional<std::vector<std::string>>(c10d::Store&)> python_list_keys;

std::optional<std::vector<std::string>> Lane::list_keys() {
  try {
    if (auto names = compat::list_keys(*store)) {
      return names;
    }
  } catch (const std::exception&) { // a Python-written store's, or no listKeys in this store
  }
  return python_list_keys ? python_list_keys(*store) : std::nullopt;
}

Lanes::Lanes(c10::intrusive_ptr<c10d::Store> store, bool cas, bool deletes)
    : store_(std::move(store)), cas_(cas), deletes_(deletes) {
  auto base = base_store(store_);
  bool tcp = dynamic_cast<c10d::TCPStore*>(base.get()) != nullptr;
  bool file = dynamic_cast<c10d::FileStore*>(base.get()) != nullptr;
  polled_ = file;
  local_ = dynamic_cast<c10d::HashStore*>(base.get()) != nullptr;
  // Own connections: clones where this torch has clone(), else new TCPStore clients (a
  // FileStore without clone() is shared: its calls never hold a lock while they wait).
  owned_ = compat::kClone ? (tcp || file) : tcp;
  // The TCPStore path: a TCPStore under any number of PrefixStores, where this torch's
  // TCPStore has a server-side barrier (and, under PrefixStores, list_keys: the Python twin
  // learns their prefix with it). Both implementations apply this same rule to a given store.
  tcp_ = tcp;
  if (auto* server = dynamic_cast<c10d::TCPStore*>(base.get())) {
    server_ = server->getHost() + ":" + std::to_string(server->getPort());
  }
  bool chain = base.get() != store_.get();
  native_barrier_ = compat::server_barrier() && tcp && (!chain || compat::kListKeys);
  if (native_barrier_ && chain) {
    prefix_ = base_key(store_, "").second;
  }
  try {
    extended_ = store_->hasExtendedApi();
  } catch (const std::exception&) {
    extended_ = false;
  }
}

std::unique_ptr<Lane> Lanes::acquire(double connect_timeout, const std::function<bool()>& stop) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!free_.empty()) {
      auto lane = std::move(free_.back());
      free_.pop_back();
      return lane;
    }
  }
  return open(connect_timeout, stop);
}

std::unique_ptr<Lane> Lanes::open(double connect_timeout, const std::function<bool()>& stop) {
  auto lane = std::make_unique<Lane>();
  if (!owned_) {
    lane->store = store_;
  } else if (tcp_ || !compat::kClone) {
    Connecting connecting;
    reaper::take_opened();
    lane->store = new_client(store_, connect_timeout, stop);
    lane->socket = reaper::take_opened();
  } else {
    Connecting connecting;
    lane->store = compat::clone(*store_);
  }
  lane->owned = owned_;
  lane->native_barrier = native_barrier_;
  lane->prefix = prefix_;
  lane->extended = extended_;
  lane->polled = polled_;
  lane->cas = cas_;
  lane->deletes = deletes_;
  return lane;
}

void Lanes::release(std::unique_ptr<Lane> lane) {
  std::lock_guard<std::mutex> lock(mutex_);
  free_.push_back(std::move(lane));
}

void Lanes::close() {
  std::lock_guard<std::mutex> lock(mutex_);
  free_.clear();
}

} // namespace torch_ctrl
