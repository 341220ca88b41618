// Store capabilities that differ between torch releases, detected from the headers the
// extension is compiled against (never from a version number). C++ twin of
// torch_ctrl/capabilities.py: both must answer alike for one torch, since the path an op
// takes (server-side barrier or not) is part of the protocol.
//
//   clone      Store::clone()                  torch >= 2.8 (older: a new client, see lanes.cpp)
//   barrier    Store::barrier(key, n, t)       TCPStore's server-side barrier (older: the generic one)
//   list_keys  Store::listKeys()               (older: one probe per rank to name the missing)
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace torch_ctrl::compat {

template <typename S, typename = void>
struct has_clone : std::false_type {};
template <typename S>
struct has_clone<S, std::void_t<decltype(std::declval<S&>().clone())>> : std::true_type {};

template <typename S, typename = void>
struct has_barrier : std::false_type {};
template <typename S>
struct has_barrier<
    S,
    std::void_t<decltype(std::declval<S&>().barrier(
        std::declval<const std::string&>(),
        int64_t{},
        std::declval<const std::chrono::milliseconds&>()))>> : std::true_type {};

template <typename S, typename = void>
struct has_list_keys : std::false_type {};
template <typename S>
struct has_list_keys<S, std::void_t<decltype(std::declval<S&>().listKeys())>> : std::true_type {};

inline constexpr bool kClone = has_clone<c10d::Store>::value;
inline constexpr bool kBarrier = has_barrier<c10d::Store>::value;
inline constexpr bool kListKeys = has_list_keys<c10d::Store>::value;

// Test hook (_C._emulate_no_server_barrier): instances made while it is set take the generic
// path over a TCPStore even where kBarrier holds, as a build against torch 2.6-2.11 does, so
// a test can run the C++ twin on both sides of the paths' boundary in one process.
inline std::atomic<bool> emulate_no_server_barrier{false};

// Whether an instance made now may take the TCPStore path (server-side barrier).
inline bool server_barrier() {
  return kBarrier && !emulate_no_server_barrier.load();
}

// store.clone(); only called where kClone holds.
template <typename S>
c10::intrusive_ptr<c10d::Store> clone(S& store) {
  if constexpr (has_clone<S>::value) {
    return store.clone();
  } else {
    throw std::logic_error("this torch's Store has no clone()");
  }
}

// TCPStore's server-side barrier; only called where kBarrier holds.
template <typename S>
void barrier(S& store, const std::string& key, int64_t world_size, std::chrono::milliseconds timeout) {
  if constexpr (has_barrier<S>::value) {
    store.barrier(key, world_size, timeout);
  } else {
    throw std::logic_error("this torch's TCPStore has no server-side barrier");
  }
}

// store.listKeys(), or nothing where this torch's stores cannot list their keys.
template <typename S>
std::optional<std::vector<std::string>> list_keys(S& store) {
  if constexpr (has_list_keys<S>::value) {
    return store.listKeys();
  } else {
    return std::nullopt;
  }
}

} // namespace torch_ctrl::compat
