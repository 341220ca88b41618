// Bounds on an op's calls over torch_ctrl's own TCPStore connections (twin of
// torch_ctrl/reaper.py, which says why).
#pragma once

#include <sys/types.h>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_set>

namespace torch_ctrl::reaper {

// Twin of reaper.GRACE: how long past its deadline an op may stay in a store call before its
// connection is shut down.
constexpr double kGrace = 2.0;
// Twin of reaper.ABORT_WAIT: abort() has no timeout; its one store call is given this long
// before its kGrace.
constexpr double kAbortWait = 3.0;

// A connection's socket: its descriptor, and its inode (the number may be reused once torch
// closes it; the inode tells).
struct Socket {
  int fd = -1;
  ino_t inode = 0;
};

// connect(), a new TCPStore client of `server` (on `port`), which torch gives `seconds` to
// connect. Bounded too: torch's client reads the server's first answer with no time limit, so
// a new socket to that port still connecting kGrace seconds after that is shut down
// (DistNetworkError naming the server). The new client's socket, the one socket to that port
// that was not there before, is what take_opened() returns next on this thread (nullopt when
// there is not exactly one). Twin of reaper.opened.
c10::intrusive_ptr<c10d::Store> opened(
    const std::function<c10::intrusive_ptr<c10d::Store>()>& connect,
    const std::string& server,
    int port,
    double seconds);
// The socket of the connection recorded last on this thread (once).
std::optional<Socket> take_opened();

struct Call;

// While alive: the connection on `sock` is shut down if this is still alive kGrace seconds
// after `deadline`. A no-op without a socket. Twin of reaper.Bound.
class Bound {
 public:
  Bound(const std::optional<Socket>& sock, std::chrono::steady_clock::time_point deadline);
  ~Bound();
  Bound(const Bound&) = delete;
  Bound& operator=(const Bound&) = delete;

 private:
  std::shared_ptr<Call> call_;
};

// Whether a connection this thread is using was shut down for not answering in time.
bool fired();
// The error text for a connection shut down so: an op's (kGrace past its deadline), or a
// call given `within` seconds in all (abort).
std::string no_answer(const std::string& server, std::optional<double> within = std::nullopt);

} // namespace torch_ctrl::reaper
