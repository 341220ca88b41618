// C++ twin of torch_ctrl/reaper.py.
#include "reaper.h"

#include <dirent.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

namespace torch_ctrl::reaper {

// A registered call: on `sock`, or (no sock) a client connecting to `port` since the sockets
// `before`.
struct Call {
  std::optional<Socket> sock;
  std::chrono::steady_clock::time_point until;
  bool fired = false;  // written under the reaper's mutex, read by the registering thread after
  int port = 0;
  std::unordered_set<ino_t> before;
};

namespace {
using Clock = std::chrono::steady_clock;
// Twins of reaper._TICK and reaper._IDLE: how often the thread looks for calls past their
// time, and after how long without any registered it sleeps until the next registration.
constexpr auto kTick = std::chrono::milliseconds(250);
constexpr auto kIdle = std::chrono::seconds(10);

thread_local std::optional<Socket> opened_socket;
thread_local std::vector<std::shared_ptr<Call>> active;

// Every socket's {inode, fd}; nullopt where /proc/self/fd is missing.
std::optional<std::vector<std::pair<ino_t, int>>> socket_fds() {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) {
    return std::nullopt;
  }
  std::vector<std::pair<ino_t, int>> found;
  int own = dirfd(dir);
  while (auto* entry = readdir(dir)) {
    if (entry->d_name[0] < '0' || entry->d_name[0] > '9') {
      continue;
    }
    int fd = std::atoi(entry->d_name);
    struct stat st {};
    if (fd == own || fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) {
      continue;  // closed meanwhile, the listing's own descriptor, or not a socket
    }
    found.emplace_back(st.st_ino, fd);
  }
  closedir(dir);
  return found;
}

int peer_port(int fd) {
  sockaddr_storage peer{};
  socklen_t len = sizeof(peer);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &len) != 0) {
    return -1;
  }
  if (peer.ss_family == AF_INET) {
    return ntohs(reinterpret_cast<sockaddr_in*>(&peer)->sin_port);
  }
  if (peer.ss_family == AF_INET6) {
    return ntohs(reinterpret_cast<sockaddr_in6*>(&peer)->sin6_port);
  }
  return -1;
}

// End the connection on `sock` if its descriptor still holds it.
void shut(const Socket& sock) {
  struct stat st {};
  if (fstat(sock.fd, &st) != 0 || st.st_ino != sock.inode) {
    return;  // closed and the number reused: not ours to touch
  }
  shutdown(sock.fd, SHUT_RDWR);  // acts on the connection; the descriptor stays torch's
}

// The registered calls and the thread that ends those past their time. The thread looks every
// kTick and is never woken for a registration (that would cost every op a thread switch),
// except after kIdle without any, when it sleeps until one.
// End every connection to `port` opened since `before` (a client still connecting), but those
// in `known`: other clients' (opened by them meanwhile).
void shut_new(int port, const std::unordered_set<ino_t>& before, const std::unordered_set<ino_t>& known) {
  if (auto fds = socket_fds()) {
    for (const auto& [inode, fd] : *fds) {
      if (before.count(inode) == 0 && known.count(inode) == 0 && peer_port(fd) == port) {
        shut(Socket{fd, inode});
      }
    }
  }
}

class Reaper {
 public:
  void add(const std::shared_ptr<Call>& call) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!started_) {
      started_ = true;
      std::thread([this] { run(); }).detach();
    }
    calls_.insert(call);
    if (idle_) {
      idle_ = false;
      cv_.notify_one();
    }
  }

  void remove(const std::shared_ptr<Call>& call) {
    std::lock_guard<std::mutex> lock(mutex_);
    calls_.erase(call);
  }

  bool fired(const Call& call) {
    std::lock_guard<std::mutex> lock(mutex_);
    return call.fired;
  }

  // The sockets opened() found, while open (twin of reaper._KNOWN): `open` are this process's
  // sockets now, `found` the new client's.
  void know(const std::unordered_set<ino_t>& open, const std::vector<ino_t>& found) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = known_.begin(); it != known_.end();) {
      it = open.count(*it) ? std::next(it) : known_.erase(it);
    }
    known_.insert(found.begin(), found.end());
  }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mutex_);
    auto last = Clock::now();  // when a call was last registered, as far as the thread knows
    while (true) {
      auto now = Clock::now();
      if (!calls_.empty()) {
        last = now;
        for (const auto& call : calls_) {
          if (!call->fired && call->until <= now) {
            call->fired = true;
            if (call->sock) {
              shut(*call->sock);
            } else {
              shut_new(call->port, call->before, known_);
            }
          }
        }
      } else if (now - last > kIdle) {
        idle_ = true;
        cv_.wait(lock, [this] { return !idle_; });
        last = Clock::now();
      }
      cv_.wait_for(lock, kTick);
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::set<std::shared_ptr<Call>> calls_;
  std::unordered_set<ino_t> known_;
  bool started_ = false;
  bool idle_ = false;
};

// Never destroyed (its thread outlives static destruction). A forked child gets a new one:
// the parent's thread is not in it, and its mutex may be held.
Reaper* reaper_ = [] {
  pthread_atfork(nullptr, nullptr, [] { reaper_ = new Reaper(); });
  return new Reaper();
}();
} // namespace

namespace {
std::optional<std::unordered_set<ino_t>> sockets() {
  auto fds = socket_fds();
  if (!fds) {
    return std::nullopt;
  }
  std::unordered_set<ino_t> inodes;
  for (const auto& [inode, fd] : *fds) {
    inodes.insert(inode);
  }
  return inodes;
}

std::chrono::steady_clock::duration in_seconds(double seconds) {
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(seconds));
}
} // namespace

c10::intrusive_ptr<c10d::Store> opened(
    const std::function<c10::intrusive_ptr<c10d::Store>()>& connect,
    const std::string& server,
    int port,
    double seconds) {
  opened_socket.reset();
  auto before = sockets();
  std::shared_ptr<Call> call;
  if (before) {
    call = std::make_shared<Call>();
    call->until = Clock::now() + in_seconds(seconds + kGrace);
    call->port = port;
    call->before = *before;
    reaper_->add(call);
  }
  c10::intrusive_ptr<c10d::Store> client;
  try {
    client = connect();
  } catch (const std::exception&) {
    if (call) {
      reaper_->remove(call);
      if (reaper_->fired(*call)) {
        throw c10::DistNetworkError(no_answer(server, seconds + kGrace));
      }
    }
    throw;
  }
  if (!call) {
    return client;
  }
  reaper_->remove(call);
  auto after = socket_fds();
  if (!after) {
    return client;
  }
  std::optional<Socket> found;
  std::vector<ino_t> inodes;
  std::unordered_set<ino_t> open;
  for (const auto& [inode, fd] : *after) {
    open.insert(inode);
    if (before->count(inode) == 0 && peer_port(fd) == port) {
      found = Socket{fd, inode};
      inodes.push_back(inode);
    }
  }
  reaper_->know(open, inodes);
  if (inodes.size() == 1) {
    opened_socket = found;
  }
  return client;
}

std::optional<Socket> take_opened() {
  auto sock = opened_socket;
  opened_socket.reset();
  return sock;
}

Bound::Bound(const std::optional<Socket>& sock, Clock::time_point deadline) {
  if (!sock) {
    return;
  }
  call_ = std::make_shared<Call>();
  call_->sock = *sock;
  call_->until = deadline + in_seconds(kGrace);
  reaper_->add(call_);
  active.push_back(call_);
}

Bound::~Bound() {
  if (!call_) {
    return;
  }
  reaper_->remove(call_);
  // The last, unless guards ended out of order.
  auto it = std::find(active.rbegin(), active.rend(), call_);
  if (it != active.rend()) {
    active.erase(std::next(it).base());
  }
}

bool fired() {
  return std::any_of(active.begin(), active.end(), [](const auto& call) { return reaper_->fired(*call); });
}

std::string no_answer(const std::string& server, std::optional<double> within) {
  std::ostringstream text;
  text << "the store's server " << server << " did not answer ";
  if (within) {
    text << "within " << std::round(*within * 10) / 10 << "s";  // as Python's f"{round(within, 1):g}"
  } else {
    text << "for " << kGrace << "s past the op's deadline";
  }
  text << " (its host frozen or unreachable over the network?)";
  return text.str();
}

} // namespace torch_ctrl::reaper
