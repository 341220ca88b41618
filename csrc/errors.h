// Exceptions thrown by the C++ implementation. bindings.cpp turns each into the
// matching Python exception of torch_ctrl/errors.py, which also formats the
// message, so both implementations report failures with identical text.
#pragma once

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace torch_ctrl {

// How every store-unreachable detail starts: torch_ctrl/errors.py's UNREACHABLE, from which
// the Python error's class (StoreUnreachableError) follows.
inline const std::string kUnreachable = "store unreachable: ";

struct CollectiveError : std::runtime_error {
  CollectiveError(std::string op, std::string label, std::string detail)
      : std::runtime_error(op + ": " + detail), op(std::move(op)), label(std::move(label)), detail(std::move(detail)) {}
  std::string op, label, detail;
};

struct KeyReusedError : std::runtime_error {
  KeyReusedError(std::string op, std::string key)
      : std::runtime_error(op + ": key already used"), op(std::move(op)), key(std::move(key)) {}
  std::string op, key;
};

struct CollectiveTimeout : std::runtime_error {
  CollectiveTimeout(
      std::string op,
      std::string label,
      double seconds,
      int world_size,
      std::optional<int> arrived,
      std::vector<int> missing,
      std::string detail)
      : std::runtime_error(op + " timed out"),
        op(std::move(op)),
        label(std::move(label)),
        seconds(seconds),
        world_size(world_size),
        arrived(arrived),
        missing(std::move(missing)),
        detail(std::move(detail)) {}
  std::string op, label;
  double seconds;
  int world_size;
  std::optional<int> arrived;
  std::vector<int> missing;
  std::string detail;
};

struct CollectiveAborted : std::runtime_error {
  CollectiveAborted(std::string op, std::string label, int rank, std::string reason)
      : std::runtime_error(op + " aborted"),
        op(std::move(op)),
        label(std::move(label)),
        rank(rank),
        reason(std::move(reason)) {}
  std::string op, label;
  int rank;
  std::string reason;
};

// First line of a store error, without C++ frames (twin of errors.one_line).
std::string one_line(const std::string& text);

} // namespace torch_ctrl
