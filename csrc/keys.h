// The protocol's key layout and value encodings: C++ twin of torch_ctrl/keys.py.
// Keep the two identical; docs/protocol.md is the contract.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <stdexcept>
#include <vector>

namespace torch_ctrl::keys {

inline const std::string kProtocol = "torch_ctrl/3";
constexpr size_t kMaxToken = 160;

// Fields of one collective.
inline const std::string kArrive = "n";  // arrival counter of the generic path (add)
inline const std::string kBarrier = "b";  // counter of the TCPStore path's server-side barrier
inline const std::string kDone = "d";  // done flag / broadcast payload (tagged)
inline const std::string kLog = "g";  // append-only log of frames
inline const std::string kNames = "a";  // "rank," of ranks blocked past the grace period
inline const std::string kExit = "x";  // exit counter
inline const std::string kSum = "s";  // running total of a generic-path all_sum (add)

// The arrival counter of a barrier, all_gather or all_sum (twin of keys.counter): never the
// same key on the two paths, so ranks on torch releases either side of 2.12 time out saying
// so (kOtherPath) instead of passing each other's barriers.
inline const std::string& counter(bool native_barrier) {
  return native_barrier ? kBarrier : kArrive;
}
inline const std::string kOtherPath =
    "ranks arrived on the other store path: every rank of a group needs a torch with "
    "TCPStore.barrier (2.12 or newer), or every rank one without";
// The detail of a timeout when keys of the same op exist under other world sizes (twin of
// keys.OTHER_WORLD_SIZES; "{sizes}" is replaced by "3" or "3, 4").
inline const std::string kOtherWorldSizes =
    "this op's key is also in use by ranks given world_size {sizes}: every rank of a group "
    "must pass the same world_size";

// Value tags: first byte of every single-value key (and of every log frame's payload).
constexpr char kTagData = 'D';  // "D" + payload
constexpr char kTagChunks = 'C';  // "C{n}": payload in n chunk keys "{key}/c{i}", written first
constexpr char kTagAbort = 'A';  // "A{rank}:{reason}"

// Largest payload stored inline (TCPStore's libuv server rejects values over 8 MiB).
constexpr size_t kChunk = size_t{4} << 20;

// Added to a barrier counter to release native-barrier waiters on abort.
constexpr int64_t kAbortBias = int64_t{1} << 40;

// Heartbeat counters: every beat adds kBeat, the first one also the rank's interval in ms (at
// most kBeat - 1), so a reader gives each rank the silence its own interval allows.
constexpr int64_t kBeat = int64_t{1} << 22;

// compare_set(key, kMissing, kNever) reads without writing.
inline const std::string kMissing = "\x01";
inline const std::string kNever = "\x02";

std::string group_root(int world_size);
std::string escape(const std::string& key);
std::string sha256_hex(const std::string& data);
std::string token(const std::optional<std::string>& key, int64_t seq);
std::string op_prefix(int world_size, const std::optional<std::string>& key, int64_t seq);
std::string field(const std::string& prefix, const std::string& name);
std::string rank_slot(const std::string& prefix, int rank);
// The slots of every rank but `skip` (-1: of all), in rank order: one allocation per key.
std::vector<std::string> rank_slots(const std::string& prefix, int world_size, int skip = -1);
std::string group_key(int world_size, const std::string& name);
// The group's abort notice "{rank}:{reason}", written once (compare_set from empty).
std::string abort_key(int world_size);
// Which rank reads the group's heartbeat counters for everyone blocked: "{rank}:{n}".
std::string reader_key(int world_size);
std::string chunk_key(const std::string& key, size_t index);
// On a store without compare_set: the counter (add) of the entries appended to `key` (or the
// ticket of a write-once `key`), "{key}/e", and entry `index` (from 1), "{key}/e{index}".
std::string entry_count(const std::string& key);
std::string entry(const std::string& key, int64_t index);
std::string frame_key(const std::string& log_key, int rank);
// Tagged value for `payload` at `key`, and the chunk (key, value) pairs to write first.
std::pair<std::string, std::vector<std::pair<std::string, std::string>>> pack(
    const std::string& key,
    const std::string& payload);
std::string frame(int rank, const std::string& payload);

// ---- decoding: twin of the decoding section of torch_ctrl/keys.py (same rules, same messages;
// test/test_decode.py fuzzes the two against each other through _C._decode).
constexpr size_t kMaxChunks = 4096;  // a chunked payload is at most kMaxChunks * kChunk bytes
inline const std::string kBadValue = "unexpected value in the store (not written by torch_ctrl?)";
inline const std::string kCollision =
    "another group uses the same store and keys, or two processes were given the same rank "
    "(give each group its own PrefixStore, and each process its own rank)";

// A value read from the store that torch_ctrl could not have written; what() says what.
struct DecodeError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Number of chunks of a "C{n}" value: 2 <= n <= kMaxChunks.
size_t chunk_count(const std::string& value);
// A chunked payload from its chunks: all but the last exactly kChunk bytes, the last at most that.
std::string join_chunks(const std::vector<std::string>& parts);
// The rank of an abort notice "{rank}:{reason}": -1 unless a decimal in [-1, 2^31).
int notice_rank(const std::string& text);
// The rank named by a reader_key value "{rank}:{n}" (two decimal int64s, the rank in
// [0, world_size)); nullopt for anything else (the value is then only compared).
std::optional<int> parse_reader(const std::string& value, int world_size);
// A counter written by add(): a decimal int64.
int64_t parse_counter(const std::string& value);
// A counter's value, or nullopt when it is not a decimal int64 (what parse_counter refuses).
std::optional<int64_t> counter_value(const std::string& value);
// What a rank's first heartbeat adds to its counter: one kBeat and its interval (ms).
int64_t first_beat(double interval);
// The interval (seconds) a heartbeat counter's rank declared; nullopt when the value is not a
// non-negative decimal int64 or declares none.
std::optional<double> beat_interval(const std::string& value);
// Where one frame's payload lies in a log: no copies, so reading N frames allocates once.
struct FrameSpan {
  int rank;
  size_t start;
  size_t size;
};
// world_size < 0: no range check on ranks.
std::vector<FrameSpan> frame_spans(const std::string& log, int world_size = -1);
std::vector<std::pair<int, std::string>> parse_frames(const std::string& log, int world_size = -1);
std::set<int> parse_names(const std::string& log, int world_size = -1);
// The world sizes, other than world_size, of groups with keys of the collective `token` among
// `names` (a store's listKeys, relative to the group's namespace): "torch_ctrl/3/w{M}/{token}/...",
// M a decimal in 1 <= M < 2^31. Other names are ignored (the store may hold anything).
std::set<int> other_world_sizes(const std::vector<std::string>& names, int world_size, const std::string& token);
// A published all_sum total, or an all_sum log entry: a decimal int64; nullopt otherwise.
std::optional<int64_t> parse_total(std::string_view value);

} // namespace torch_ctrl::keys
