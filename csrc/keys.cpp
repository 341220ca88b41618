// C++ twin of torch_ctrl/keys.py.
#include "keys.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <stdexcept>

namespace torch_ctrl::keys {

std::string group_root(int world_size) {
  return kProtocol + "/w" + std::to_string(world_size);
}

static bool is_safe(unsigned char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' ||
      c == '_' || c == '-';
}

std::string escape(const std::string& key) {
  static const char* hex = "0123456789ABCDEF";
  std::string out;
  out.reserve(key.size());
  for (unsigned char c : key) {
    if (is_safe(c)) {
      out.push_back(static_cast<char>(c));
    } else {
      out.push_back('%');
      out.push_back(hex[c >> 4]);
      out.push_back(hex[c & 15]);
    }
  }
  return out;
}

// Compact SHA-256 (FIPS 180-4), used only to shorten very long user keys.
std::string sha256_hex(const std::string& data) {
  static const uint32_t k[64] = {
      0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
      0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
      0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
      0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
      0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
      0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
      0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
      0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};
  uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  std::string msg = data;
  uint64_t bits = static_cast<uint64_t>(data.size()) * 8;
  msg.push_back(static_cast<char>(0x80));
  while (msg.size() % 64 != 56) {
    msg.push_back('\0');
  }
  for (int i = 7; i >= 0; --i) {
    msg.push_back(static_cast<char>((bits >> (i * 8)) & 0xff));
  }
  auto rotr = [](uint32_t x, int n) { return (x >> n) | (x << (32 - n)); };
  for (size_t off = 0; off < msg.size(); off += 64) {
    uint32_t w[64];
    for (int i = 0; i < 16; ++i) {
      const auto* p = reinterpret_cast<const unsigned char*>(msg.data() + off + 4 * i);
      w[i] = (uint32_t(p[0]) << 24) | (uint32_t(p[1]) << 16) | (uint32_t(p[2]) << 8) | uint32_t(p[3]);
    }
    for (int i = 16; i < 64; ++i) {
      uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
    for (int i = 0; i < 64; ++i) {
      uint32_t t1 = hh + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + k[i] + w[i];
      uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      hh = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
    }
    h[0] += a; h[1] += b; h[2] += c; h[3] += d; h[4] += e; h[5] += f; h[6] += g; h[7] += hh;
  }
  char out[65];
  for (int i = 0; i < 8; ++i) {
    std::snprintf(out + 8 * i, 9, "%08x", h[i]);
  }
  return std::string(out, 64);
}

std::string token(const std::optional<std::string>& key, int64_t seq) {
  if (!key) {
    return "s" + std::to_string(seq);
  }
  std::string enc = escape(*key);
  if (enc.size() > kMaxToken) {
    return "h" + sha256_hex(*key);
  }
  return "k" + enc;
}

std::string op_prefix(int world_size, const std::optional<std::string>& key, int64_t seq) {
  return group_root(world_size) + "/" + token(key, seq);
}

std::string field(const std::string& prefix, const std::string& name) {
  std::string key;  // one allocation (several keys per op)
  key.reserve(prefix.size() + 1 + name.size());
  key.append(prefix).append(1, '/').append(name);
  return key;
}

std::string rank_slot(const std::string& prefix, int rank) {
  std::array<char, 12> digits{};
  auto end = std::to_chars(digits.data(), digits.data() + digits.size(), rank).ptr;
  std::string key;
  key.reserve(prefix.size() + 2 + (end - digits.data()));
  key.append(prefix).append("/r").append(digits.data(), end);
  return key;  // not the reference append returns: that would be a copy
}

std::vector<std::string> rank_slots(const std::string& prefix, int world_size, int skip) {
  // N keys per rank and op (N^2 over the group): built in place, not from temporaries.
  std::vector<std::string> out;
  out.reserve(world_size);
  for (int r = 0; r < world_size; ++r) {
    if (r != skip) {
      out.push_back(rank_slot(prefix, r));
    }
  }
  return out;
}

std::string group_key(int world_size, const std::string& name) {
  return group_root(world_size) + "/_/" + name;
}

std::string abort_key(int world_size) {
  return group_key(world_size, "abort");
}

std::string reader_key(int world_size) {
  return group_key(world_size, "reader");
}

std::string entry_count(const std::string& key) {
  return key + "/e";
}

std::string entry(const std::string& key, int64_t index) {
  return key + "/e" + std::to_string(index);
}

std::string chunk_key(const std::string& key, size_t index) {
  return key + "/c" + std::to_string(index);
}

std::string frame_key(const std::string& log_key, int rank) {
  return log_key + "/" + std::to_string(rank);
}

std::pair<std::string, std::vector<std::pair<std::string, std::string>>> pack(
    const std::string& key,
    const std::string& payload) {
  std::vector<std::pair<std::string, std::string>> chunks;
  if (payload.size() <= kChunk) {
    return {kTagData + payload, chunks};
  }
  for (size_t i = 0, off = 0; off < payload.size(); ++i, off += kChunk) {
    chunks.emplace_back(chunk_key(key, i), payload.substr(off, kChunk));
  }
  return {kTagChunks + std::to_string(chunks.size()), chunks};
}

std::string frame(int rank, const std::string& payload) {
  return std::to_string(rank) + ":" + std::to_string(payload.size()) + ":" + payload;
}

namespace {
bool all_digits(const char* begin, const char* end) {
  for (const char* p = begin; p != end; ++p) {
    if (*p < '0' || *p > '9') {
      return false;
    }
  }
  return true;
}

// -?[0-9]{1,19} within int64 (keys.py's _int64).
std::optional<int64_t> int64_of(const char* begin, const char* end) {
  const char* digits = begin != end && *begin == '-' ? begin + 1 : begin;
  if (digits == end || end - digits > 19 || !all_digits(digits, end)) {
    return std::nullopt;
  }
  int64_t value = 0;
  auto [ptr, ec] = std::from_chars(begin, end, value);
  if (ec != std::errc() || ptr != end) {
    return std::nullopt;
  }
  return value;
}

// [0-9]{1,20} (keys.py's _SIZE); nullopt past size_t.
std::optional<size_t> size_of(const char* begin, const char* end) {
  if (begin == end || end - begin > 20 || !all_digits(begin, end)) {
    return std::nullopt;
  }
  size_t value = 0;
  auto [ptr, ec] = std::from_chars(begin, end, value);
  if (ec != std::errc() || ptr != end) {
    return std::nullopt;
  }
  return value;
}
} // namespace

size_t chunk_count(const std::string& value) {
  const char* begin = value.data() + std::min<size_t>(1, value.size());
  const char* end = value.data() + value.size();
  auto n = end - begin <= 5 ? size_of(begin, end) : std::nullopt;
  if (!n || *n < 2 || *n > kMaxChunks) {
    throw DecodeError("bad chunk count");
  }
  return *n;
}

std::string join_chunks(const std::vector<std::string>& parts) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) {
    bool last = i + 1 == parts.size();
    if (last ? (parts[i].empty() || parts[i].size() > kChunk) : parts[i].size() != kChunk) {
      throw DecodeError("bad chunk size");
    }
    out += parts[i];
  }
  return out;
}

int notice_rank(const std::string& text) {
  auto n = int64_of(text.data(), text.data() + text.size());
  return n && *n >= -1 && *n < (int64_t{1} << 31) ? static_cast<int>(*n) : -1;
}

std::optional<int> parse_reader(const std::string& value, int world_size) {
  size_t colon = value.find(':');
  if (colon == std::string::npos) {
    return std::nullopt;
  }
  auto rank = int64_of(value.data(), value.data() + colon);
  auto count = int64_of(value.data() + colon + 1, value.data() + value.size());
  if (!rank || !count || *rank < 0 || *rank >= world_size) {
    return std::nullopt;
  }
  return static_cast<int>(*rank);
}

std::optional<int64_t> counter_value(const std::string& value) {
  return int64_of(value.data(), value.data() + value.size());
}

int64_t parse_counter(const std::string& value) {
  auto n = counter_value(value);
  if (!n) {
    throw DecodeError("bad counter");
  }
  return *n;
}

int64_t first_beat(double interval) {
  double ms = std::ceil(interval * 1000.0);
  return kBeat + static_cast<int64_t>(std::min(static_cast<double>(kBeat - 1), std::max(1.0, ms)));
}

std::optional<double> beat_interval(const std::string& value) {
  auto n = int64_of(value.data(), value.data() + value.size());
  if (!n || *n < 0 || *n % kBeat == 0) {
    return std::nullopt;
  }
  return static_cast<double>(*n % kBeat) / 1000.0;
}

std::optional<int64_t> parse_total(std::string_view value) {
  return int64_of(value.data(), value.data() + value.size());
}

std::vector<FrameSpan> frame_spans(const std::string& log, int world_size) {
  std::vector<FrameSpan> out;
  std::vector<bool> seen(world_size > 0 ? world_size : 0, false);
  std::set<int64_t> seen_any;  // without a world size
  const char* data = log.data();
  size_t pos = 0;
  while (pos < log.size()) {
    size_t c1 = log.find(':', pos);
    size_t c2 = c1 == std::string::npos ? c1 : log.find(':', c1 + 1);
    std::optional<int64_t> rank;
    std::optional<size_t> size;
    if (c2 != std::string::npos) {
      rank = int64_of(data + pos, data + c1);
      size = size_of(data + c1 + 1, data + c2);
    }
    if (!rank || !size || *size > log.size() - (c2 + 1)) {
      throw DecodeError("malformed log entry");
    }
    if (*rank != -1 && (*rank < 0 || (world_size >= 0 && *rank >= world_size))) {
      throw DecodeError(
          "frame of rank " + std::to_string(*rank) + " in a group of " +
          (world_size >= 0 ? std::to_string(world_size) : std::string("None")));
    }
    if (*rank >= 0) {
      bool dup = world_size >= 0 ? seen[*rank] : !seen_any.insert(*rank).second;
      if (dup) {
        throw DecodeError("two frames of rank " + std::to_string(*rank) + ": " + kCollision);
      }
      if (world_size >= 0) {
        seen[*rank] = true;
      }
    }
    out.push_back(FrameSpan{static_cast<int>(*rank), c2 + 1, *size});
    pos = c2 + 1 + *size;
  }
  return out;
}

std::vector<std::pair<int, std::string>> parse_frames(const std::string& log, int world_size) {
  std::vector<std::pair<int, std::string>> out;
  for (const auto& f : frame_spans(log, world_size)) {
    out.emplace_back(f.rank, log.substr(f.start, f.size));
  }
  return out;
}

std::set<int> parse_names(const std::string& log, int world_size) {
  // Entries that are not a rank of the group are ignored (the log only names missing ranks).
  std::set<int> out;
  size_t pos = 0;
  while (pos <= log.size()) {
    size_t comma = log.find(',', pos);
    if (comma == std::string::npos) {
      comma = log.size();
    }
    auto rank = int64_of(log.data() + pos, log.data() + comma);
    if (rank && *rank >= 0 && (world_size < 0 || *rank < world_size)) {
      out.insert(static_cast<int>(*rank));
    }
    pos = comma + 1;
  }
  return out;
}

std::set<int> other_world_sizes(const std::vector<std::string>& names, int world_size, const std::string& token) {
  const std::string head = kProtocol + "/w";
  std::set<int> found;
  for (const auto& name : names) {
    if (name.compare(0, head.size(), head) != 0) {
      continue;
    }
    size_t slash = name.find('/', head.size());
    if (slash == std::string::npos || name.compare(slash + 1, token.size() + 1, token + "/") != 0) {
      continue;
    }
    const char* begin = name.data() + head.size();
    const char* end = name.data() + slash;
    auto size = begin != end && all_digits(begin, end) ? int64_of(begin, end) : std::nullopt;
    if (size && *size >= 1 && *size < (int64_t{1} << 31) && *size != world_size) {
      found.insert(static_cast<int>(*size));
    }
  }
  return found;
}

} // namespace torch_ctrl::keys
