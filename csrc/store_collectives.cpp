// C++ twin of torch_ctrl/store_collectives.py; docs/protocol.md is the contract.
#include "store_collectives.h"
#include "errors.h"
#include "exit_gate.h"
#include "keys.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <tuple>

namespace torch_ctrl {

namespace K = keys;

namespace {
std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

std::string error_text(const std::exception& exc) {
  if (const auto* c10err = dynamic_cast<const c10::Error*>(&exc)) {
    return one_line(c10err->what_without_backtrace());
  }
  return one_line(exc.what());
}

// decoder() on what was read from `key`; a value torch_ctrl could not have written there is a
// one-line CollectiveError naming the key and what was wrong (twin of _decode in Python).
template <typename F>
auto decode(const Op& op, const std::string& key, F decoder) -> decltype(decoder()) {
  try {
    return decoder();
  } catch (const keys::DecodeError& exc) {
    throw CollectiveError(op.name, op.label, key + ": " + exc.what());
  }
}

// Naming the missing ranks happens at the deadline: a new connection for it gets this long.
constexpr double kDiagnosticsConnect = 2.0;
// An op's new connection gets at least this long, even with (almost) no time left: a timeout
// of 0 still reads a result that is there, and a connection slower than a millisecond is no
// sign of a server that is gone (see open_lane).
constexpr double kMinConnect = 0.1;
// Twin of AT_DEADLINE: a return from TCPStore's barrier with less time left than this is taken
// for the deadline (several waiters that time out together may return normally): the counter
// is then read quietly and trusted over the return.
constexpr double kAtDeadline = 0.05;
// Twins of POLL_CAP, POLL_CAP_MAX, POLL_BUDGET: after an early release from TCPStore's barrier
// every rank released polls the counter (see until_counted), pausing from 1 ms, doubling, up to
// kPollCap; in a large group up to world / kPollBudget seconds (at most kPollCapMax), so that
// the group's polls together stay near kPollBudget per second instead of growing with the
// world size.
constexpr double kPollCap = 0.05;
constexpr double kPollCapMax = 0.5;
constexpr double kPollBudget = 4000.0;

// Twin of poll_cap: the longest pause between a released rank's polls of its barrier's counter.
double poll_cap(int64_t world) {
  return std::min(kPollCapMax, std::max(kPollCap, static_cast<double>(world) / kPollBudget));
}

int64_t wrap_sum(const std::vector<int64_t>& values) {
  uint64_t total = 0;
  for (auto v : values) {
    total += static_cast<uint64_t>(v);
  }
  return static_cast<int64_t>(total);
}
} // namespace

std::string one_line(const std::string& text) {
  size_t start = text.find_first_not_of(" \t\r\n");
  if (start == std::string::npos) {
    return "";
  }
  std::string line = text.substr(start, text.find('\n', start) - start);
  size_t cut = line.find(" Exception raised from ");
  if (cut != std::string::npos) {
    line = line.substr(0, cut);
  }
  while (!line.empty() && std::isspace(static_cast<unsigned char>(line.back()))) {
    line.pop_back();
  }
  return line;
}

std::string Op::key(const std::string& field) const {
  return K::field(prefix, field);
}

double Op::left() const {
  return std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count();
}

StoreCollectives::StoreCollectives(
    c10::intrusive_ptr<c10d::Store> store,
    int rank,
    int world_size,
    std::optional<double> heartbeat_interval,
    bool cas,
    bool deletes)
    : store_(std::move(store)), rank_(rank), world_(world_size) {
  lanes_ = std::make_shared<Lanes>(store_, cas, deletes);
  watcher_ = std::make_unique<Watcher>(lanes_, rank_, world_, heartbeat_interval);
  // One read at construction: a group aborted earlier fails every op at once.
  std::optional<std::string> notice;
  {
    LaneGuard lane(*lanes_);
    notice = lane->peek(watcher_->abort_key());
    if (heartbeat_interval) {
      lane->add(K::group_key(world_, "hb/" + std::to_string(rank_)), K::first_beat(*heartbeat_interval));
    }
  }
  if (notice) {
    watcher_->aborted(*notice);
  }
}

void StoreCollectives::abort(const std::string& reason) {
  std::string mine = std::to_string(rank_) + ":" + reason;
  std::string stored;
  {
    auto wait = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
        std::chrono::duration<double>(reaper::kAbortWait));
    // A new connection is bounded as long (see reaper::opened).
    LaneGuard lane(*lanes_, lanes_->acquire(reaper::kAbortWait), std::chrono::steady_clock::now() + wait);
    try {
      stored = lane->claim(watcher_->abort_key(), mine);
    } catch (const std::exception&) {
      if (reaper::fired()) {  // twin: StoreCollectives.abort
        throw c10::DistNetworkError(reaper::no_answer(lanes_->server(), reaper::kAbortWait + reaper::kGrace));
      }
      throw;
    }
  }
  watcher_->aborted(stored);
}

std::optional<std::string> StoreCollectives::notice() {
  return watcher_->notice();
}

void StoreCollectives::learn_abort(const std::string& notice) {
  watcher_->aborted(notice);
}

Wake StoreCollectives::wake_set(Keys keys) {
  // Shares the caller's keys (no copy per blocked read: an all_gather blocks on N of them).
  return [keys = std::move(keys)](Lane& lane, const std::string& notice) {
    lane.multi_set(*keys, std::vector<std::string>(keys->size(), K::kTagAbort + notice));
  };
}

Wake StoreCollectives::wake_set(std::string key) {
  return wake_set(std::make_shared<const std::vector<std::string>>(1, std::move(key)));
}

StoreCollectives::~StoreCollectives() = default;

// ------------------------------------------------------------------------ public

void StoreCollectives::barrier(const Key& key, double timeout, bool block) {
  Op op = begin("barrier", key, timeout);
  if (world_ == 1) {
    return;
  }
  LaneGuard lane(*lanes_, open_lane(op), op.deadline);
  if (block) {
    if (lane->native_barrier) {
      check_counter(op, meet(op, *lane));
      if (rank_ == 0) {
        delete_later({op.key(K::kBarrier)});
      }
    } else {
      arrive(op, *lane);
      exit_later(op, world_, {K::kArrive, K::kDone});
    }
    return;
  }
  int64_t count = 0;
  try {  // a non-blocking arrival's store errors are the op's one line too, as a send's
    count = lane->add(op.key(K::counter(lane->native_barrier)), 1);
    if (!lane->native_barrier && count == world_) {
      lane->set(op.key(K::kDone), std::string(1, K::kTagData));
    }
  } catch (const std::exception& exc) {
    failure(op, exc);  // the lane is dropped as this unwinds
  }
  if (lane->native_barrier) {
    if (count == world_ || rank_ == 0) {
      delete_when_full(op);
    }
    return;
  }
  exit_later(op, world_, {K::kArrive, K::kDone});
}

void StoreCollectives::broadcast_send(const Key& key, const std::string& data, double timeout) {
  Op op = begin("broadcast_send", key, timeout);
  if (world_ == 1) {
    return;
  }
  send(op, [&](Lane& lane) { put(lane, op.key(K::kDone), data); });
}

std::string StoreCollectives::broadcast_recv(const Key& key, double timeout) {
  Op op = begin("broadcast_recv", key, timeout);
  std::pair<std::string, std::vector<std::string>> got;
  {
    LaneGuard lane(*lanes_, open_lane(op), op.deadline);
    got = read(op, *lane, op.key(K::kDone));
  }
  exit_later(op, world_ - 1, {K::kDone}, std::move(got.second));
  return std::move(got.first);
}

void StoreCollectives::gather_send(const Key& key, const std::string& data, double timeout) {
  Op op = begin("gather_send", key, timeout);
  if (world_ == 1) {
    return;  // the only rank is the root: nobody would ever read the slot
  }
  send(op, [&](Lane& lane) { put(lane, K::rank_slot(op.prefix, rank_), data); });
}

std::vector<std::string> StoreCollectives::gather_recv(const Key& key, const std::string& data, double timeout) {
  Op op = begin("gather_recv", key, timeout);
  auto slots = std::make_shared<const std::vector<std::string>>(K::rank_slots(op.prefix, world_, rank_));
  std::vector<std::string> values;
  if (!slots->empty()) {
    std::vector<std::string> chunks;
    {
      LaneGuard lane(*lanes_, open_lane(op), op.deadline);
      std::tie(values, chunks) = read_many(op, *lane, slots);
    }
    chunks.insert(chunks.end(), slots->begin(), slots->end());
    delete_later(std::move(chunks));
  }
  values.insert(values.begin() + rank_, data);
  return values;
}

std::string StoreCollectives::scatter_send(const Key& key, const std::vector<std::string>& data, double timeout) {
  Op op = begin("scatter_send", key, timeout);
  std::vector<std::string> slots, values;
  if (world_ > 1) {
    send(op, [&](Lane& lane) {
      for (int r = 0; r < world_; ++r) {
        if (r != rank_) {
          slots.push_back(K::rank_slot(op.prefix, r));
          values.push_back(stage(lane, slots.back(), data.at(r)));
        }
      }
      lane.multi_set(slots, values);
    });
  }
  return data.at(rank_);
}

std::string StoreCollectives::scatter_recv(const Key& key, double timeout) {
  Op op = begin("scatter_recv", key, timeout);
  std::string slot = K::rank_slot(op.prefix, rank_);
  std::pair<std::string, std::vector<std::string>> got;
  {
    LaneGuard lane(*lanes_, open_lane(op), op.deadline);
    got = read(op, *lane, slot);
  }
  got.second.push_back(slot);
  delete_later(got.second);
  return std::move(got.first);
}

Gathered StoreCollectives::all_gather(const Key& key, const std::string& data, double timeout) {
  Op op = begin("all_gather", key, timeout);
  if (world_ == 1) {
    Gathered out;
    out.values.emplace_back(out.storage.emplace_back(data));
    return out;
  }
  return exchange(op, data);
}

int64_t StoreCollectives::all_sum(const Key& key, int64_t data, double timeout) {
  Op op = begin("all_sum", key, timeout);
  if (world_ == 1) {
    return data;
  }
  if (!lanes_->native_barrier()) {
    return sum_counted(op, data);
  }
  auto gathered = exchange(op, std::to_string(data));
  std::vector<int64_t> values;
  values.reserve(world_);
  for (const auto& v : gathered.values) {
    auto value = K::parse_total(v);  // a decimal int64, as keys.py reads it (twin: all_sum)
    if (!value) {
      throw CollectiveError(op.name, op.label, op.key(K::kLog) + ": " + K::kBadValue);
    }
    values.push_back(*value);
  }
  return wrap_sum(values);
}

void StoreCollectives::close(double flush_timeout) {
  watcher_->close(flush_timeout);
  lanes_->close();
}

// --------------------------------------------------------------------- internals

std::unique_ptr<Lane> StoreCollectives::open_lane(const Op& op) {
  // Half the time left: torch's connect loop may wait up to its timeout once more before it
  // gives up, and the op must still end by its deadline.
  double budget = op.left() / 2;
  try {
    return lanes_->acquire(std::max(budget, kMinConnect));
  } catch (const std::exception& exc) {
    if (budget < kMinConnect) {
      // Too little time to tell a slow connection from a server that is gone: the op ran out
      // of time, which is what it reports.
      throw CollectiveTimeout(
          op.name,
          op.label,
          op.seconds,
          world_,
          std::nullopt,
          {},
          "no new connection to the store opened in the time left (" + error_text(exc) + ")");
    }
    throw CollectiveError(op.name, op.label, kUnreachable + error_text(exc));
  }
}

Op StoreCollectives::begin(const std::string& name, const Key& key, double timeout) {
  int64_t seq = -1;
  if (auto notice = watcher_->notice()) {
    raise_abort(Op{name, key ? *key : "#next", "", timeout, {}}, *notice);
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!key) {
      seq = seq_++;
    } else {
      if (used_.count(*key)) {
        throw KeyReusedError(name, *key);
      }
      used_.insert(*key);
    }
  }
  std::string label = key ? *key : "#" + std::to_string(seq);
  auto deadline = std::chrono::steady_clock::now() +
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(timeout));
  return Op{name, label, K::op_prefix(world_, key, seq), timeout, deadline};
}

int64_t StoreCollectives::sum_counted(const Op& op, int64_t value) {
  // Add to one running total, then arrive at the add/done barrier, whose last arriver reads the
  // total and publishes it in the done flag: 3 calls per rank (add, add, get), 4 for the last.
  std::string total_key = op.key(K::kSum);
  std::string done;
  {
    LaneGuard lane(*lanes_, open_lane(op), op.deadline);
    try {
      lane->add(total_key, value);
    } catch (const std::exception& exc) {
      failure(op, exc);
    }
    Lane& ln = *lane;
    done = arrive(op, ln, [&ln, &total_key]() { return std::to_string(ln.add(total_key, 0)); });
  }
  exit_later(op, world_, {K::kArrive, K::kSum, K::kDone});
  auto total = K::parse_total(done);
  if (!total) {
    throw CollectiveError(op.name, op.label, op.key(K::kDone) + ": " + K::kBadValue);
  }
  return *total;
}

Wake StoreCollectives::wake_native(const Op& op, const std::string& counter) {
  std::optional<std::string> log_key;
  if (op.name == "all_gather" || op.name == "all_sum") {
    log_key = op.key(K::kLog);
  }
  return [counter, log_key](Lane& ln, const std::string& notice) {
    if (log_key) {
      ln.append(*log_key, K::frame(-1, notice));
    }
    ln.add(counter, K::kAbortBias);
  };
}

std::optional<std::string> StoreCollectives::meet(const Op& op, Lane& lane) {
  // A return from the server's barrier proves nothing alone: the server wakes its waiters on
  // any write to the counter (a block=false arrival, or any compare_set of it). A rank
  // released so must not leave the scope as if the op had completed: that deletes the NAMES
  // log the others read to name the missing ranks.
  std::string counter = op.key(K::kBarrier);
  try {
    Watcher::Blocked blocked(*watcher_, op.key(K::kNames), op.seconds, wake_native(op, counter));
    lane.barrier(counter, world_, op.left());
    return until_counted(op, lane);
  } catch (const std::exception& exc) {
    failure(op, exc);
  }
}

std::string StoreCollectives::arrive(const Op& op, Lane& lane, const std::function<std::string()>& publish) {
  std::string counter = op.key(K::counter(lane.native_barrier));
  std::string done;
  try {
    if (lane.native_barrier) {
      Watcher::Blocked blocked(*watcher_, op.key(K::kNames), op.seconds, wake_native(op, counter));
      lane.barrier(counter, world_, op.left());
      if (op.left() < kAtDeadline) {
        // TCPStore's native barrier can return normally when several waiters time out
        // together: trust the counter, not the return (and throw while still blocked, so
        // this rank's NAMES entry stays for the others). Read quietly: a compare_set would
        // release ranks with later deadlines.
        auto value = lane.peek_quietly(counter);
        if (value && decode(op, counter, [&] { return K::parse_counter(*value); }) < world_) {
          throw std::runtime_error("barrier timeout");
        }
      }
      return "";
    }
    int64_t count = lane.add(counter, 1);
    if (count > world_) {
      throw CollectiveError(
          op.name,
          op.label,
          std::to_string(count) + " arrivals in a group of " + std::to_string(world_) + ": " + K::kCollision);
    }
    if (count == world_) {
      std::string payload = publish ? publish() : "";
      lane.set(op.key(K::kDone), std::string(1, K::kTagData) + payload);
      return payload;
    }
    Watcher::Blocked blocked(*watcher_, op.key(K::kNames), op.seconds, wake_set(op.key(K::kDone)));
    done = lane.get(op.key(K::kDone), op.left());
  } catch (const std::exception& exc) {
    failure(op, exc);
  }
  return untag(op, lane, op.key(K::kDone), std::move(done)).first;
}

Gathered StoreCollectives::exchange(const Op& op, const std::string& payload) {
  // On a TCPStore: one log, the server-side barrier, one read (O(N) server work).
  // Elsewhere: one slot per rank and one multi_get (fewest calls without a native barrier).
  if (!lanes_->native_barrier()) {
    return exchange_slots(op, payload);
  }
  std::string log_key = op.key(K::kLog);
  Gathered out;
  out.values.resize(world_);
  std::vector<char> seen(world_, 0);
  int found = 0;
  std::vector<std::string> garbage;
  {
    LaneGuard lane(*lanes_, open_lane(op), op.deadline);
    lane->append(log_key, K::frame(rank_, stage(*lane, K::frame_key(log_key, rank_), payload)));
    arrive(op, *lane);
    const std::string& log = out.storage.emplace_back(lane->peek(log_key).value_or(""));
    // N frames per rank, so N^2 per op over the group: views into the log, no copy per frame.
    auto spans = decode(op, log_key, [&] { return K::frame_spans(log, world_); });
    for (const auto& f : spans) {
      if (f.rank < 0) {
        raise_abort(op, log.substr(f.start, f.size));
      }
      if (f.size > 0 && log[f.start] == K::kTagData) {  // the common case: no chunk key to build
        out.values[f.rank] = std::string_view(log).substr(f.start + 1, f.size - 1);
      } else {
        auto got = untag(op, *lane, K::frame_key(log_key, f.rank), log.substr(f.start, f.size));
        out.values[f.rank] = out.storage.emplace_back(std::move(got.first));
        garbage.insert(garbage.end(), got.second.begin(), got.second.end());
      }
      seen[f.rank] = 1;
      ++found;
    }
  }
  // Every rank has arrived (the counter reads N): its exits take it to 2N.
  exit_later(op, 2 * world_, {K::kLog}, std::move(garbage), K::kBarrier);
  if (found != world_) {
    std::string ranks = "[";
    for (int r = 0; r < world_; ++r) {
      if (seen[r]) {
        ranks += (ranks.size() > 1 ? ", " : "") + std::to_string(r);
      }
    }
    throw CollectiveError(
        op.name,
        op.label,
        "expected " + std::to_string(world_) + " entries, found ranks " + ranks +
            "] (is the key used by another group?)");
  }
  return out;
}

Gathered StoreCollectives::exchange_slots(const Op& op, const std::string& payload) {
  auto slots = std::make_shared<const std::vector<std::string>>(K::rank_slots(op.prefix, world_));
  Gathered out;
  std::vector<std::string> chunks;
  {
    LaneGuard lane(*lanes_, open_lane(op), op.deadline);
    try {
      put(*lane, (*slots)[rank_], payload);
    } catch (const std::exception& exc) {
      failure(op, exc);
    }
    out.raw = fetch_many(op, *lane, slots);
    out.values.reserve(world_);
    for (size_t i = 0; i < out.raw.size(); ++i) {
      const auto& head = out.raw[i];
      if (!head.empty() && head[0] == static_cast<uint8_t>(K::kTagData)) {  // the common case: no copy
        out.values.emplace_back(reinterpret_cast<const char*>(head.data()) + 1, head.size() - 1);
      } else {
        auto got = untag(op, *lane, (*slots)[i], std::string(reinterpret_cast<const char*>(head.data()), head.size()));
        out.values.emplace_back(out.storage.emplace_back(std::move(got.first)));
        chunks.insert(chunks.end(), got.second.begin(), got.second.end());
      }
    }
  }
  // The slot keys are rebuilt by the rank that deletes them, not copied by every rank.
  exit_later(op, world_, {}, std::move(chunks), K::kExit, /*slots=*/true);
  return out;
}

std::string StoreCollectives::stage(Lane& lane, const std::string& key, const std::string& payload) {
  auto packed = K::pack(key, payload);
  for (const auto& [ck, cv] : packed.second) {
    lane.set(ck, cv);
  }
  return std::move(packed.first);
}

void StoreCollectives::put(Lane& lane, const std::string& key, const std::string& payload) {
  lane.set(key, stage(lane, key, payload));
}

void StoreCollectives::send(const Op& op, const std::function<void(Lane&)>& write) {
  LaneGuard lane(*lanes_, open_lane(op), op.deadline);  // failing to open one is already one line
  try {
    write(*lane);
  } catch (const std::exception& exc) {
    failure(op, exc);  // the lane is dropped as this unwinds
  }
}

std::pair<std::vector<std::string>, std::vector<std::string>> StoreCollectives::read_many(
    const Op& op,
    Lane& lane,
    Keys shared) {
  const std::vector<std::string>& keys = *shared;  // shared: stays valid below
  std::vector<std::string> heads;
  heads.reserve(keys.size());
  std::vector<std::string> chunks;
  auto raw = fetch_many(op, lane, shared);
  for (size_t i = 0; i < keys.size(); ++i) {
    auto got = untag(op, lane, keys[i], std::string(reinterpret_cast<const char*>(raw[i].data()), raw[i].size()));
    std::vector<uint8_t>().swap(raw[i]);  // freed as it is copied: the values are held once
    heads.push_back(std::move(got.first));
    chunks.insert(chunks.end(), got.second.begin(), got.second.end());
  }
  return {std::move(heads), std::move(chunks)};
}

std::vector<std::vector<uint8_t>> StoreCollectives::fetch_many(const Op& op, Lane& lane, Keys shared) {
  try {
    Watcher::Blocked blocked(*watcher_, op.key(K::kNames), op.seconds, wake_set(shared));
    return lane.multi_get_raw(*shared, op.left());
  } catch (const std::exception& exc) {
    failure(op, exc);
  }
}

std::pair<std::string, std::vector<std::string>> StoreCollectives::read(
    const Op& op,
    Lane& lane,
    const std::string& key) {
  std::string value;
  try {
    Watcher::Blocked blocked(*watcher_, op.key(K::kNames), op.seconds, wake_set(key));
    value = lane.get(key, op.left());
  } catch (const std::exception& exc) {
    failure(op, exc);
  }
  return untag(op, lane, key, std::move(value));
}

std::pair<std::string, std::vector<std::string>> StoreCollectives::untag(
    const Op& op,
    Lane& lane,
    const std::string& key,
    std::string value) {
  if (!value.empty() && value[0] == K::kTagData) {
    value.erase(0, 1);  // in place: no copy of the payload
    return {std::move(value), {}};
  }
  if (!value.empty() && value[0] == K::kTagChunks) {
    std::vector<std::string> names;
    for (size_t i = 0, n = decode(op, key, [&] { return K::chunk_count(value); }); i < n; ++i) {
      names.push_back(K::chunk_key(key, i));
    }
    // Chunks are written before the value that names them: one missing now never comes, and
    // the value was not written by torch_ctrl. One check says so at once, where waiting for the
    // chunks would hold the caller until its deadline (twin: _untag).
    // One chunk per read: a reply of several 4 MiB chunks breaks the connection on some torch
    // releases' TCPStore servers (torch 2.7: "Broken pipe" at 16 MiB).
    std::vector<std::string> parts;
    bool there = false;
    try {
      there = lane.store->check(names);
      for (size_t i = 0; there && i < names.size(); ++i) {
        parts.push_back(lane.multi_get({names[i]}, std::max(op.left(), 1.0)).at(0));
      }
    } catch (const std::exception& exc) {
      if (connection_lost(exc) || watcher_->notice()) {
        failure(op, exc);
      }
      there = false;
    }
    if (!there) {
      throw CollectiveError(op.name, op.label, key + ": " + K::kBadValue);
    }
    return {decode(op, key, [&] { return K::join_chunks(parts); }), names};
  }
  if (!value.empty() && value[0] == K::kTagAbort) {
    raise_abort(op, value.substr(1));
  }
  throw CollectiveError(op.name, op.label, key + ": " + K::kBadValue);
}

std::optional<std::string> StoreCollectives::until_counted(const Op& op, Lane& lane) {
  // Called while blocked, after the server-side barrier returned. TCPStore wakes its
  // waiters on any write to the counter, compare_set included: a rank arriving with
  // block=false (a plain add) releases them early. Then poll the counter until the count is
  // complete, the group is aborted, or the deadline passes. Polls read it quietly, and so
  // does the first read at the deadline: a compare_set would release the ranks still
  // waiting, and they would poll too (a storm of requests at scale). The pauses grow to
  // poll_cap(world): in a large group, every rank released polls.
  std::string key = op.key(K::kBarrier);
  auto counter = op.left() >= kAtDeadline ? lane.peek(key) : lane.peek_quietly(key);
  auto short_of = [this, &op, &key](const std::optional<std::string>& value) {
    return value && decode(op, key, [&] { return K::parse_counter(*value); }) < world_;
  };
  double pause = 0.001;
  const double cap = poll_cap(world_);
  while (short_of(counter)) {
    if (auto notice = watcher_->notice()) {
      raise_abort(op, *notice);
    }
    if (op.left() <= 0) {
      throw std::runtime_error("barrier timeout");
    }
    exit_gate::checkpoint();  // the process exits: park here, between two calls into torch
    watcher_->pause(std::min(pause, op.left()));  // an abort ends the pause
    exit_gate::checkpoint();
    pause = std::min(pause * 2, cap);
    counter = lane.peek_quietly(key);
  }
  return counter;
}

void StoreCollectives::check_counter(const Op& op, const std::optional<std::string>& counter) {
  if (!counter) {
    return;  // rank 0 deleted it: every rank had arrived
  }
  int64_t count = decode(op, op.key(K::kBarrier), [&] { return K::parse_counter(*counter); });
  if (count >= K::kAbortBias) {
    std::optional<std::string> notice;
    {
      LaneGuard lane(*lanes_);
      notice = lane->peek(watcher_->abort_key());
    }
    raise_abort(op, notice.value_or(watcher_->notice().value_or("-1:")));
  }
  if (count > world_) {
    // Another group on the same keys: it would pass without waiting.
    throw CollectiveError(
        op.name, op.label,
        std::to_string(count) + " arrivals in a group of " + std::to_string(world_) + ": " + K::kCollision);
  }
}

void StoreCollectives::raise_abort(const Op& op, const std::string& notice) {
  watcher_->aborted(notice);
  size_t colon = notice.find(':');
  std::string rank = notice.substr(0, colon);
  std::string reason = colon == std::string::npos ? "" : notice.substr(colon + 1);
  throw CollectiveAborted(op.name, op.label, K::notice_rank(rank), reason);
}

// ------------------------------------------------------------------- diagnostics

void StoreCollectives::failure(const Op& op, const std::exception& exc) {
  if (python_interrupt && python_interrupt(exc)) {
    throw;  // Ctrl-C (or sys.exit) inside a Python-written store: the caller's, as it is
  }
  if (const auto* already = dynamic_cast<const CollectiveError*>(&exc)) {
    throw *already;  // already says what happened (e.g. a value torch_ctrl could not have written)
  }
  if (auto notice = watcher_->notice()) {
    raise_abort(op, *notice);
  }
  if (reaper::fired()) {  // the server held a call kGrace seconds past the deadline
    throw CollectiveError(op.name, op.label, kUnreachable + reaper::no_answer(lanes_->server()));
  }
  std::string text = error_text(exc);
  bool timed_out = op.left() <= 0.01 || lower(text).find("timeout") != std::string::npos;
  if (!timed_out && (op.name == "barrier" || op.name == "all_gather" || op.name == "all_sum")) {
    if (auto bad = bad_counter(op)) {  // the store refused to add to it (a TCPStore server drops the connection)
      throw CollectiveError(op.name, op.label, *bad + ": " + K::kBadValue);
    }
  }
  if (connection_lost(exc)) {
    throw CollectiveError(op.name, op.label, kUnreachable + lost_text(lanes_->server(), text));
  }
  if (!timed_out) {
    throw CollectiveError(op.name, op.label, "store error: " + text);
  }
  if (op.name.size() > 5 && op.name.compare(op.name.size() - 5, 5, "_send") == 0) {
    // A send waits for nobody: nothing to count or name.
    throw CollectiveTimeout(
        op.name, op.label, op.seconds, world_, std::nullopt, {}, "the store did not take the value (" + text + ")");
  }
  std::string detail;
  try {
    auto diagnostics = lanes_->acquire(kDiagnosticsConnect);  // past the deadline: a budget of its own
    auto until = std::chrono::steady_clock::now() +
        std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(kDiagnosticsConnect));
    LaneGuard lane(*lanes_, std::move(diagnostics), until);
    timeout(op, *lane);
  } catch (const CollectiveTimeout&) {
    throw;
  } catch (const std::exception& diag) {
    detail = "who arrived could not be read (" + error_text(diag) + ")";
  }
  throw CollectiveTimeout(op.name, op.label, op.seconds, world_, std::nullopt, {}, detail);
}

std::optional<std::string> StoreCollectives::bad_counter(const Op& op) {
  // After a store error in a counting op: the first of its counters that holds something other
  // than a decimal int64 (the store cannot add to it). One read per counter on a new connection
  // (the failed one may be gone); nullopt when that fails too.
  std::vector<std::string> keys{op.key(K::counter(lanes_->native_barrier()))};
  if (op.name == "all_sum" && !lanes_->native_barrier()) {
    keys.push_back(op.key(K::kSum));
  }
  try {
    // within the op's deadline: a host that went down must not hold the error past it
    LaneGuard lane(*lanes_, lanes_->acquire(std::min(kDiagnosticsConnect, op.left())), op.deadline);
    for (const auto& key : keys) {
      auto value = lane->peek(key);
      if (value && !K::counter_value(*value)) {
        return key;
      }
    }
  } catch (const std::exception&) {  // the store error is the one to report then
  }
  return std::nullopt;
}

void StoreCollectives::timeout(const Op& op, Lane& lane) {
  // The store's key names, read at most once however many checks below need them.
  std::optional<std::optional<std::vector<std::string>>> listed;
  Listing names = [&]() -> const std::optional<std::vector<std::string>>& {
    if (!listed) {
      listed = lane.list_keys();
    }
    return *listed;
  };
  if (op.name == "broadcast_recv" || op.name == "scatter_recv") {
    std::string sizes = rank_ <= 1 ? other_world_sizes(op, names) : "";  // the lowest receiver
    std::string detail = "nothing was sent" + (sizes.empty() ? "" : "; " + sizes);
    throw CollectiveTimeout(op.name, op.label, op.seconds, world_, std::nullopt, {}, detail);
  }
  std::set<int> present;
  std::optional<int> arrived;
  bool exchange = op.name == "all_gather" || op.name == "all_sum";
  if (op.name == "gather_recv" || (op.name == "all_gather" && !lane.native_barrier)) {
    present = present_slots(op, lane, names);
  } else if (exchange && lane.native_barrier) {
    for (const auto& [r, v] : K::parse_frames(lane.peek(op.key(K::kLog)).value_or(""), world_)) {
      if (r >= 0) {
        present.insert(r);
      }
    }
  } else {  // barrier
    lane.append(op.key(K::kNames), std::to_string(rank_) + ",");
    // Each rank appends at most twice (past the grace period, at its timeout).
    present = K::parse_names(lane.peek_log(op.key(K::kNames), 2 * int64_t{world_}).value_or(""), world_);
    // Quietly: ranks with later deadlines may still be in TCPStore's barrier on it.
    auto counter = lane.peek_quietly(op.key(K::counter(lane.native_barrier)));
    arrived = counter ? static_cast<int>(std::min<int64_t>(K::parse_counter(*counter), world_))
                      : static_cast<int>(present.size());
  }
  present.insert(rank_);
  if (!arrived) {
    arrived = static_cast<int>(present.size());
  }
  std::vector<int> missing;
  for (int r = 0; r < world_; ++r) {
    if (!present.count(r)) {
      missing.push_back(r);
    }
  }
  std::string detail = other_path(op, lane, names) ? K::kOtherPath : "";
  bool lister = op.name == "gather_recv" || *present.begin() == rank_;  // a gather's root waits alone
  std::string sizes = lister ? other_world_sizes(op, names) : "";
  detail += (detail.empty() || sizes.empty() ? "" : "; ") + sizes;
  throw CollectiveTimeout(op.name, op.label, op.seconds, world_, arrived, missing, detail);
}

std::string StoreCollectives::other_world_sizes(const Op& op, const Listing& names) {
  // Name the world sizes of ranks that used this op's key in a group of another size (a rank
  // given the wrong world_size waits in a group of its own): one listKeys, where the store has
  // it; nothing elsewhere. Called by one rank per group and op (the lowest that arrived; the
  // lowest receiver), so that a timeout on thousands of ranks does not send the store's whole
  // key list to each of them.
  std::string token = op.prefix.substr(op.prefix.rfind('/') + 1);
  auto sizes = K::other_world_sizes(names().value_or(std::vector<std::string>{}), world_, token);
  if (sizes.empty()) {
    return "";
  }
  std::string joined;
  for (int size : sizes) {
    joined += (joined.empty() ? "" : ", ") + std::to_string(size);
  }
  std::string text = K::kOtherWorldSizes;
  return text.replace(text.find("{sizes}"), 7, joined);
}

bool StoreCollectives::other_path(const Op& op, Lane& lane, const Listing& names) {
  // Ranks on a torch without TCPStore.barrier take the generic path where this one takes the
  // TCPStore path (or the reverse): their keys, not this path's, show that they came.
  if (!lanes_->tcp() || op.name == "gather_recv") {
    return false;  // only a TCPStore has two paths, and gather has one
  }
  if (!lane.native_barrier) {
    return lane.store->check({op.key(K::kBarrier)});
  }
  if (op.name == "all_gather") {
    return !present_slots(op, lane, names).empty();
  }
  return lane.store->check({op.key(K::kArrive)});
}

std::set<int> StoreCollectives::present_slots(const Op& op, Lane& lane, const Listing& names) {
  std::set<int> found;
  std::string prefix = op.prefix + "/r";
  if (const auto& listed = names()) {
    for (const auto& name : *listed) {
      size_t at = name.find(prefix);
      if (at == std::string::npos) {
        continue;
      }
      std::string tail = name.substr(at + prefix.size());
      auto rank = K::parse_total(tail);  // a decimal int64; only ranks of the group count
      if (rank && *rank < world_ && tail[0] != '-') {
        found.insert(static_cast<int>(*rank));
      }
    }
    return found;
  }
  for (int r = 0; r < world_; ++r) {
    if (r != rank_ && lane.store->check({K::rank_slot(op.prefix, r)})) {
      found.insert(r);
    }
  }
  return found;
}

// ----------------------------------------------------------------------- cleanup

void StoreCollectives::cleanup(Task task) {
  if (!lanes_->local()) {
    watcher_->submit(std::move(task));  // a round trip or a file lock each: off the critical path
    return;
  }
  // A HashStore's calls never wait: handing them to the watcher thread (a wake-up, a lock
  // shared with it) would cost the caller more than the calls (docs/benchmarks.md).
  try {
    LaneGuard lane(*lanes_);
    task(*lane);
  } catch (const std::exception&) {
    // best effort, as on the watcher (a value torch_ctrl could not have written stays)
  }
}

void StoreCollectives::delete_later(std::vector<std::string> keys) {
  if (!lanes_->deletes()) {  // a store whose keys stay (see store_api in torch_ctrl/lanes.py)
    return;
  }
  cleanup([keys = std::move(keys)](Lane& lane) {
    for (const auto& key : keys) {
      lane.remove(key);
    }
  });
}

void StoreCollectives::exit_later(
    const Op& op,
    int64_t expected,
    const std::vector<std::string>& fields,
    std::vector<std::string> extra,
    const std::string& counter,
    bool slots) {
  if (!lanes_->deletes()) {  // nothing to delete: no exit count either
    return;
  }
  // NAMES logs are deleted by the ranks that wrote them (see Watcher::Blocked). Built on
  // `extra` (chunk keys, rarely any): no second vector.
  std::vector<std::string> keys = std::move(extra);
  keys.reserve(keys.size() + fields.size() + 1);
  for (const auto& f : fields) {
    keys.push_back(op.key(f));
  }
  if (expected == 1) {  // the only participant (a broadcast's one receiver): nothing to count
    delete_later(std::move(keys));
    return;
  }
  std::string exit_key = op.key(counter);
  keys.push_back(exit_key);
  std::string prefix = slots ? op.prefix : std::string();
  int world = world_;
  cleanup([exit_key, expected, keys = std::move(keys), prefix, world](Lane& lane) {
    // At or past kAbortBias the op was aborted: its keys stay (like a timed-out op's).
    int64_t count = lane.add(exit_key, 1);
    if (count >= expected && count < K::kAbortBias) {
      if (!prefix.empty()) {
        for (const auto& key : K::rank_slots(prefix, world)) {
          lane.remove(key);
        }
      }
      for (const auto& key : keys) {
        lane.remove(key);
      }
    }
  });
}

void StoreCollectives::delete_when_full(const Op& op) {
  std::string counter = op.key(K::kBarrier);
  auto deadline = op.deadline;
  int world = world_;
  watcher_->retry([counter, deadline, world, pause = 0.01](Lane& lane) mutable -> std::optional<double> {
    // One look per run: between runs the watcher beats, polls and cleans (Watcher::retry).
    auto value = lane.peek_quietly(counter);  // the blocking ranks wait on it in the server
    if (!value || K::parse_counter(*value) >= world) {  // garbage: DecodeError ends the task
      lane.remove(counter);
      return std::nullopt;
    }
    if (std::chrono::steady_clock::now() > deadline || leaving()) {  // at exit the counter stays
      return std::nullopt;
    }
    double wait = pause;
    pause = std::min(pause * 2, 1.0);
    return wait;
  });
}

} // namespace torch_ctrl
