// pybind11 bindings: module torch_ctrl._C. Every call releases the GIL while it
// talks to the store; C++ exceptions become torch_ctrl.errors exceptions, built by
// the same Python functions the pure-Python implementation uses.
#include "arguments.h"
#include "compat.h"
#include "errors.h"
#include "exit_gate.h"
#include "keys.h"
#include "store_collectives.h"

#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <sstream>
#include <thread>
#include <type_traits>

#include <unistd.h>

// setup.py defines TORCH_CTRL_TORCH_VERSION as the bare version (2.13.0+cpu): a string
// literal would not survive every build tool's quoting.
#ifndef TORCH_CTRL_TORCH_VERSION
#define TORCH_CTRL_TORCH_VERSION unknown
#endif
#define TORCH_CTRL_STR(x) #x
#define TORCH_CTRL_XSTR(x) TORCH_CTRL_STR(x)

namespace py = pybind11;
using torch_ctrl::Key;
using torch_ctrl::StoreCollectives;
namespace arguments = torch_ctrl::arguments;

namespace {

// The thread that runs the interpreter's finalization: set at import, and again in a forked
// child (whose main thread is the one that forked).
std::atomic<unsigned long> main_thread_ident{0};

bool finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// Takes the GIL back after a store call. A call that returns while the interpreter finalizes
// (a daemon thread blocked in a collective when the script exits) parks its thread instead, as
// CPython 3.14 does itself; the main thread (which runs the finalization) never parks. When
// finalization begins while the thread already waits for the GIL, CPython ends the thread with
// pthread_exit from inside PyEval_RestoreThread: this is therefore never called from a
// destructor (implicitly noexcept: that unwinding would abort the process), so it unwinds
// through pybind11 and CPython like any daemon thread's end.
void take_gil_back(PyThreadState* state) {
  while (finalizing() && PyThread_get_thread_ident() != main_thread_ident) {
    std::this_thread::sleep_for(std::chrono::hours(1));
  }
  PyEval_RestoreThread(state);
}

// f() with the GIL released.
template <typename F>
auto nogil(F&& f) -> decltype(f()) {
  PyThreadState* state = PyEval_SaveThread();
  if constexpr (std::is_void_v<decltype(f())>) {
    try {
      f();
    } catch (...) {
      take_gil_back(state);
      throw;
    }
    take_gil_back(state);
  } else {
    decltype(f()) out{};
    try {
      out = f();
    } catch (...) {
      take_gil_back(state);
      throw;
    }
    take_gil_back(state);
    return out;
  }
}

// str, bytes or bytearray, as torch's binding takes a value.
std::vector<uint8_t> bytes_of(const py::handle& h) {
  auto raw = h.cast<std::string>();
  return std::vector<uint8_t>(raw.begin(), raw.end());
}

py::object bytes_out(const std::vector<uint8_t>& v) {
  return py::bytes(reinterpret_cast<const char*>(v.data()), v.size());
}

// The store calls of `_parked_call` (see there), by torch's Python names and arguments.
py::object parked_call(const c10::intrusive_ptr<c10d::Store>& store, const std::string& op, const py::args& args) {
  auto text = [&](size_t i) { return args[i].cast<std::string>(); };
  auto keys = [&](size_t i) { return args[i].cast<std::vector<std::string>>(); };
  if (op == "add" && args.size() == 2) {
    auto key = text(0);
    auto by = args[1].cast<int64_t>();
    return py::int_(nogil([&] { return store->add(key, by); }));
  }
  if (op == "compare_set" && args.size() == 3) {
    auto key = text(0);
    auto expected = bytes_of(args[1]), desired = bytes_of(args[2]);
    return bytes_out(nogil([&] { return store->compareSet(key, expected, desired); }));
  }
  if (op == "get" && args.size() == 1) {
    auto key = text(0);
    return bytes_out(nogil([&] { return store->get(key); }));
  }
  if (op == "multi_get" && args.size() == 1) {
    auto names = keys(0);
    auto values = nogil([&] { return store->multiGet(names); });
    py::list got;
    for (const auto& v : values) {
      got.append(bytes_out(v));
    }
    return std::move(got);
  }
  if (op == "num_keys" && args.empty()) {
    return py::int_(nogil([&] { return store->getNumKeys(); }));
  }
  if (op == "list_keys" && args.empty()) {
    auto names = nogil([&] { return torch_ctrl::compat::list_keys(*store); });
    if (!names) {
      throw py::type_error("torch_ctrl._C._parked_call: this torch's stores cannot list their keys");
    }
    return py::cast(*names);
  }
  if (op == "set" && args.size() == 2) {
    auto key = text(0);
    auto value = bytes_of(args[1]);
    nogil([&] { store->set(key, value); });
    return py::none();
  }
  if (op == "check" && args.size() == 1) {
    auto names = keys(0);
    return py::bool_(nogil([&] { return store->check(names); }));
  }
  if (op == "multi_set" && args.size() == 2) {
    auto names = keys(0);
    if (!py::isinstance<py::list>(args[1]) && !py::isinstance<py::tuple>(args[1])) {
      throw py::type_error("torch_ctrl._C._parked_call: multi_set: values must be a list");
    }
    std::vector<std::vector<uint8_t>> values;
    for (const auto& item : args[1]) {
      values.push_back(bytes_of(item));
    }
    nogil([&] { store->multiSet(names, values); });
    return py::none();
  }
  throw py::value_error(
      "torch_ctrl._C._parked_call: no store call '" + op + "' with " + std::to_string(args.size()) + " arguments");
}

py::object build(const char* builder, const py::tuple& args) {
  return py::module_::import("torch_ctrl.errors").attr(builder)(*args);
}

void raise_object(const py::object& exc) {
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
}

void raise_from(const char* builder, const py::tuple& args) {
  raise_object(build(builder, args));
}

py::object timeout_exception(const torch_ctrl::CollectiveTimeout& e) {
  py::object arrived = e.arrived ? py::object(py::int_(*e.arrived)) : py::object(py::none());
  return build(
      "timeout_error", py::make_tuple(e.op, e.label, e.seconds, e.world_size, arrived, py::cast(e.missing), e.detail));
}

py::object aborted_exception(const torch_ctrl::CollectiveAborted& e) {
  return build("aborted_error", py::make_tuple(e.op, e.label, e.rank, e.reason));
}

void translate(std::exception_ptr p) {
  try {
    if (p) {
      std::rethrow_exception(p);
    }
  } catch (const torch_ctrl::CollectiveTimeout& e) {
    raise_object(timeout_exception(e));
  } catch (const torch_ctrl::CollectiveAborted& e) {
    raise_object(aborted_exception(e));
  } catch (const torch_ctrl::CollectiveError& e) {
    raise_from("collective_error", py::make_tuple(e.op, e.label, e.detail));
  } catch (const torch_ctrl::KeyReusedError& e) {
    raise_from("key_reused_error", py::make_tuple(e.op, e.key));
  }
}

// A timeout or abort error of instance `s`, passed through its `_namer` when it has one
// (naming.py sets it to add the hosts of the ranks an error names), then raised.
[[noreturn]] void raise_named(StoreCollectives& s, py::object exc) {
  py::object namer = py::getattr(py::cast(&s), "_namer", py::none());
  if (!namer.is_none()) {
    exc = namer(exc);
  }
  raise_object(exc);
  throw py::error_already_set();
}

// Instance `s` raises an abort error: its group's other instances in this process learn of
// the abort now (base.spread_native), so their next op fails at once rather than at a poll.
// The caller's own error is what matters: a failure here is not raised over it, but a pending
// Ctrl-C that surfaces here (KeyboardInterrupt, not an Exception) is, as it would be anyway.
void spread(StoreCollectives& s) {
  try {
    arguments::base().attr("spread_native")(py::cast(&s));
  } catch (py::error_already_set& e) {
    if (!e.matches(PyExc_Exception)) {
      throw;
    }
    e.discard_as_unraisable("torch_ctrl: telling this process's instances of the group of its abort");
  }
}

// f() (a collective, which releases the GIL itself), its timeout and abort errors named.
// Only the error path runs Python code: a call that succeeds costs nothing here.
template <typename F>
auto named(StoreCollectives& s, F&& f) -> decltype(f()) {
  torch_ctrl::exit_gate::Inside inside;  // a collective: its polls park at exit
  try {
    return f();
  } catch (const torch_ctrl::CollectiveTimeout& e) {
    raise_named(s, timeout_exception(e));
  } catch (const torch_ctrl::CollectiveAborted& e) {
    spread(s);
    raise_named(s, aborted_exception(e));
  }
}

// An instance used in a process forked from the one that made it: one error line (its
// connections and watcher thread belong to the parent).
void check_owner(const StoreCollectives& s, const char* op) {
  pid_t pid = getpid();
  if (pid != s.owner_pid()) {
    raise_from("forked_error", py::make_tuple(op, s.owner_pid(), pid));
    throw py::error_already_set();
  }
}

py::list to_list(const std::vector<std::string>& values) {
  py::list out;
  for (const auto& v : values) {
    out.append(py::bytes(v));
  }
  return out;
}

} // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_ctrl C++ implementation of StoreCollectives";
  py::register_exception_translator(&translate);
  PyDateTime_IMPORT;
  torch_ctrl::python_delete_key = [](c10d::Store& store, const std::string& key) {
    py::gil_scoped_acquire gil;
    py::object obj = py::cast(c10::intrusive_ptr<c10d::Store>::reclaim_copy(&store));
    obj.attr("delete_key")(key);
  };
  torch_ctrl::python_interrupt = [](const std::exception& exc) {
    const auto* err = dynamic_cast<const py::error_already_set*>(&exc);
    if (err == nullptr) {
      return false;
    }
    py::gil_scoped_acquire gil;
    return err->matches(PyExc_KeyboardInterrupt) || err->matches(PyExc_SystemExit);
  };
  // A Python-written store's exception arrives as error_already_set, whose text alone cannot
  // tell a lost connection: its type does, as lanes.connection_lost reads it in the Python
  // twin (torch's DistNetworkError, or a ConnectionError). The classes are looked up here, at
  // import, with the GIL held, and kept for the life of the process.
  static py::handle dist_network_error =
      py::object(py::module_::import("torch.distributed").attr("DistNetworkError")).release();
  torch_ctrl::python_error = [](const std::exception& exc) -> std::optional<torch_ctrl::PythonError> {
    const auto* err = dynamic_cast<const py::error_already_set*>(&exc);
    if (err == nullptr || finalizing()) {
      return std::nullopt;  // not a Python exception (or no Python left to ask): what() decides
    }
    py::gil_scoped_acquire gil;
    bool network = err->matches(dist_network_error) || err->matches(PyExc_ConnectionError);
    std::string text;
    try {
      text = py::str(err->value());
    } catch (const py::error_already_set&) {
      text = "";  // a __str__ that raises: the type alone decides, as it did
    }
    return torch_ctrl::PythonError{network, std::move(text)};
  };
  torch_ctrl::python_list_keys = [](c10d::Store& store) -> std::optional<std::vector<std::string>> {
    if (finalizing()) {
      return std::nullopt;  // diagnostics only: no Python left to ask
    }
    py::gil_scoped_acquire gil;
    try {
      py::object obj = py::cast(c10::intrusive_ptr<c10d::Store>::reclaim_copy(&store));
      py::object names = py::module_::import("torch_ctrl.lanes").attr("python_list_keys")(obj);
      if (names.is_none()) {
        return std::nullopt;
      }
      return names.cast<std::vector<std::string>>();
    } catch (const std::exception&) {  // py::error_already_set or a cast: as a store that cannot list
      return std::nullopt;
    }
  };
  torch_ctrl::python_read_counter = [](c10d::Store& store, const std::string& key) -> int64_t {
    py::gil_scoped_acquire gil;
    py::object obj = py::cast(c10::intrusive_ptr<c10d::Store>::reclaim_copy(&store));
    py::object value = obj.attr("add")(key, 0);
    // The low 64 bits, as two's complement: what int64 arithmetic would have kept.
    auto low = PyLong_AsUnsignedLongLongMask(value.ptr());
    if (low == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
      throw py::error_already_set();
    }
    return static_cast<int64_t>(low);
  };
  // What this build was compiled against, checked at import (torch_ctrl/loader.py).
  m.attr("_torch_version") = TORCH_CTRL_XSTR(TORCH_CTRL_TORCH_VERSION);
  py::dict caps;
  caps["clone"] = torch_ctrl::compat::kClone;
  caps["barrier"] = torch_ctrl::compat::kBarrier;
  caps["list_keys"] = torch_ctrl::compat::kListKeys;
  m.attr("_capabilities") = caps;
  // Test hook: instances made while set take the generic path over a TCPStore, as a build
  // against a torch without TCPStore.barrier does (twin of patching capabilities.BARRIER).
  // Returns the previous setting.
  m.def("_emulate_no_server_barrier", [](bool on) {
    return torch_ctrl::compat::emulate_no_server_barrier.exchange(on);
  });
  // Test hook: one decoder of csrc/keys.cpp by name, twin of torch_ctrl.keys.decode (fuzzed
  // against it); a DecodeError becomes ValueError with the same message.
  m.def("_decode", [](const std::string& kind, const py::bytes& raw, int world) -> py::object {
    namespace K = torch_ctrl::keys;
    std::string data = raw;
    try {
      if (kind == "chunks") {
        return py::int_(K::chunk_count(data));
      }
      if (kind == "counter") {
        return py::int_(K::parse_counter(data));
      }
      if (kind == "total") {
        auto total = K::parse_total(data);
        if (!total) {
          throw K::DecodeError(K::kBadValue);
        }
        return py::int_(*total);
      }
      if (kind == "frames") {
        py::list out;
        for (const auto& [rank, payload] : K::parse_frames(data, world)) {
          out.append(py::make_tuple(rank, py::bytes(payload)));
        }
        return out;
      }
      if (kind == "names") {
        py::list out;
        for (int rank : K::parse_names(data, world)) {
          out.append(rank);
        }
        return out;
      }
      if (kind == "reader") {
        auto rank = K::parse_reader(data, world);
        return rank ? py::object(py::int_(*rank)) : py::object(py::none());
      }
      if (kind == "beat") {
        auto interval = K::beat_interval(data);
        return interval ? py::object(py::float_(*interval)) : py::object(py::none());
      }
      if (kind == "world_sizes") {  // data: the token, then one key name per line
        std::vector<std::string> lines;
        size_t pos = 0;
        for (size_t nl; (nl = data.find('\n', pos)) != std::string::npos; pos = nl + 1) {
          lines.push_back(data.substr(pos, nl - pos));
        }
        lines.push_back(data.substr(pos));
        std::string token = lines.front();
        lines.erase(lines.begin());
        py::list out;
        for (int size : K::other_world_sizes(lines, world, token)) {
          out.append(size);
        }
        return out;
      }
      if (kind == "chunk_sizes") {
        std::vector<std::string> parts;
        std::istringstream in(data);
        for (size_t n; in >> n;) {
          parts.emplace_back(n, 'x');
        }
        return py::int_(K::join_chunks(parts).size());
      }
    } catch (const K::DecodeError& exc) {
      throw py::value_error(exc.what());
    }
    throw py::value_error("unknown decoder '" + kind + "'");
  });
  // Test hook: Lane::peek_quietly on one new lane of `store`, again and again for `seconds`
  // (twin of a loop over lanes.Lane.peek_quietly): what each read returned, None for absent.
  m.def("_quiet_reads", [](c10::intrusive_ptr<c10d::Store> store, const std::string& key, double seconds) {
    std::vector<std::optional<std::string>> reads;
    {
      py::gil_scoped_release nogil;
      torch_ctrl::Lanes lanes(std::move(store));
      auto lane = lanes.open(5.0);
      auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
      while (std::chrono::steady_clock::now() < end) {
        reads.push_back(lane->peek_quietly(key));
      }
    }
    py::list out;
    for (const auto& value : reads) {
      out.append(value ? py::object(py::bytes(*value)) : py::object(py::none()));
    }
    return out;
  });
  // One store call for a caller that may give up on it (torch_ctrl/bounded.py, `parked`): the
  // call runs with the GIL released and takes it back through take_gil_back, so that a call
  // answered while the interpreter finalizes parks its thread. torch's own binding takes the
  // GIL back in a destructor, and a daemon thread ended there aborts the process.
  m.def("_parked_call", [](c10::intrusive_ptr<c10d::Store> store, const std::string& op, const py::args& args) {
    try {
      return parked_call(store, op, args);
    } catch (const py::cast_error& exc) {
      throw py::type_error("torch_ctrl._C._parked_call: " + op + ": " + exc.what());
    }
  });
  main_thread_ident = py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>();
  m.def("_set_main_thread", [](unsigned long ident) { main_thread_ident = ident; });
  torch_ctrl::exit_gate::runs_the_exit = [] { return PyThread_get_thread_ident() == main_thread_ident; };
  m.def("_leave_process", &torch_ctrl::leave_process,
        "The process exits: watchers drain their cleanup and stop, even with callers blocked.");
  m.def("_parked_threads", &torch_ctrl::exit_gate::parked_threads,
        "How many threads this process parked at its exit (csrc/exit_gate.h).");
  m.def("_settle_exit", &torch_ctrl::exit_gate::settle, py::call_guard<py::gil_scoped_release>(),
        "At exit: wait until the threads polling inside collectives are parked (csrc/exit_gate.h).");
  m.def("_op_prefix", &torch_ctrl::keys::op_prefix, "Key prefix of one collective (for layout tests).");
  m.def("_base_key", &torch_ctrl::base_key, "The store under any PrefixStores, and the key as it sees it.");
  m.def("_connected_to_itself", &torch_ctrl::connected_to_itself,
        "Whether the TCP connection on a socket's file descriptor is connected to itself.");
  m.def("_attempt", &torch_ctrl::attempt, py::call_guard<py::gil_scoped_release>(),
        "One plain connection to each address of host:port: '' when one accepts, else the error.");

  // The collective methods take the Python arguments as they come (csrc/arguments.h converts
  // them, as torch_ctrl/base.py's helpers do), with the Python signatures and defaults: the
  // Python class binds them to its instances directly, so a call runs no Python code of ours.
  // Each checks its arguments in the order of its parameters (key, data, timeout, block), as
  // the Python twin does: with two bad arguments, both raise about the same one.
  py::object no_key = py::none();
  py::object default_timeout = arguments::base().attr("DEFAULT_TIMEOUT");
  // Each method's docstring is ControlCollectives' (what help(coll.barrier) shows), kept for
  // the life of the process as pybind11 requires.
  static std::deque<std::string> docs;
  auto doc = [&](const char* name) {
    py::object text = arguments::base().attr("ControlCollectives").attr(name).attr("__doc__");
    return py::doc(docs.emplace_back(text.is_none() ? "" : text.cast<std::string>()).c_str());
  };
  auto cls = py::class_<StoreCollectives, std::shared_ptr<StoreCollectives>>(m, "StoreCollectives", py::dynamic_attr())
      .def(py::init([](c10::intrusive_ptr<c10d::Store> store, int rank, int world, std::optional<double> hb,
                       bool cas, bool deletes) {
             return nogil(
                 [&] { return std::make_shared<StoreCollectives>(std::move(store), rank, world, hb, cas, deletes); });
           }),
           py::arg("store"), py::arg("rank"), py::arg("world_size"), py::arg("heartbeat_interval") = py::none(),
           py::arg("cas") = true, py::arg("deletes") = true)
      .def("abort",
           [](StoreCollectives& s, const std::string& reason) {
             check_owner(s, "abort");
             nogil([&] { s.abort(reason); });
           })
      .def("_notice",
           [](StoreCollectives& s) -> py::object {
             std::optional<std::string> notice = nogil([&] { return s.notice(); });
             return notice ? py::object(py::bytes(*notice)) : py::object(py::none());
           })
      .def("_learn_abort",
           [](StoreCollectives& s, const std::string& notice) {
             if (getpid() == s.owner_pid()) {  // a forked child's copy: the parent's thread and locks
               nogil([&] { s.learn_abort(notice); });
             }
           })
      .def(
          "barrier",
          [](StoreCollectives& s, py::handle key, py::handle timeout, py::handle block) {
            check_owner(s, "barrier");
            Key k = arguments::key(key);
            double t = arguments::seconds(timeout);
            bool b = arguments::truth(block);
            named(s, [&] { return nogil([&] { s.barrier(k, t, b); }); });
          },
          doc("barrier"),
          py::arg("key") = no_key, py::arg("timeout") = default_timeout, py::arg("block") = true)
      .def(
          "broadcast_send",
          [](StoreCollectives& s, py::handle key, py::handle data, py::handle timeout) {
            check_owner(s, "broadcast_send");
            Key k = arguments::key(key);
            std::string d = arguments::data(data);
            double t = arguments::seconds(timeout);
            named(s, [&] { return nogil([&] { s.broadcast_send(k, d, t); }); });
          },
          doc("broadcast_send"),
          py::arg("key") = no_key, py::arg("data") = no_key, py::arg("timeout") = default_timeout)
      .def(
          "broadcast_recv",
          [](StoreCollectives& s, py::handle key, py::handle timeout) {
            check_owner(s, "broadcast_recv");
            Key k = arguments::key(key);
            double t = arguments::seconds(timeout);
            std::string out = named(s, [&] { return nogil([&] { return s.broadcast_recv(k, t); }); });
            return py::bytes(out);
          },
          doc("broadcast_recv"),
          py::arg("key") = no_key, py::arg("timeout") = default_timeout)
      .def(
          "gather_send",
          [](StoreCollectives& s, py::handle key, py::handle data, py::handle timeout) {
            check_owner(s, "gather_send");
            Key k = arguments::key(key);
            std::string d = arguments::data(data);
            double t = arguments::seconds(timeout);
            named(s, [&] { return nogil([&] { s.gather_send(k, d, t); }); });
          },
          doc("gather_send"),
          py::arg("key") = no_key, py::arg("data") = no_key, py::arg("timeout") = default_timeout)
      .def(
          "gather_recv",
          [](StoreCollectives& s, py::handle key, py::handle data, py::handle timeout) {
            check_owner(s, "gather_recv");
            Key k = arguments::key(key);
            std::string d = arguments::data(data);
            double t = arguments::seconds(timeout);
            std::vector<std::string> out = named(s, [&] { return nogil([&] { return s.gather_recv(k, d, t); }); });
            return to_list(out);
          },
          doc("gather_recv"),
          py::arg("key") = no_key, py::arg("data") = no_key, py::arg("timeout") = default_timeout)
      .def(
          "scatter_send",
          [](StoreCollectives& s, py::handle key, py::handle data, py::handle timeout) {
            check_owner(s, "scatter_send");
            Key k = arguments::key(key);
            std::vector<std::string> d = arguments::data_list(data, s.world_size());
            double t = arguments::seconds(timeout);
            std::string out = named(s, [&] { return nogil([&] { return s.scatter_send(k, d, t); }); });
            return py::bytes(out);
          },
          doc("scatter_send"),
          py::arg("key") = no_key, py::arg("data") = no_key, py::arg("timeout") = default_timeout)
      .def(
          "scatter_recv",
          [](StoreCollectives& s, py::handle key, py::handle timeout) {
            check_owner(s, "scatter_recv");
            Key k = arguments::key(key);
            double t = arguments::seconds(timeout);
            std::string out = named(s, [&] { return nogil([&] { return s.scatter_recv(k, t); }); });
            return py::bytes(out);
          },
          doc("scatter_recv"),
          py::arg("key") = no_key, py::arg("timeout") = default_timeout)
      .def(
          "all_gather",
          [](StoreCollectives& s, py::handle key, py::handle data, py::handle timeout) {
            check_owner(s, "all_gather");
            Key k = arguments::key(key);
            std::string d = arguments::data(data);
            double t = arguments::seconds(timeout);
            torch_ctrl::Gathered out = named(s, [&] { return nogil([&] { return s.all_gather(k, d, t); }); });
            py::list values(out.values.size());  // one bytes object per rank, copied from the log
            for (size_t i = 0; i < out.values.size(); ++i) {
              values[i] = py::bytes(out.values[i].data(), out.values[i].size());
            }
            return values;
          },
          doc("all_gather"),
          py::arg("key") = no_key, py::arg("data") = no_key, py::arg("timeout") = default_timeout)
      .def(
          "all_sum",
          [](StoreCollectives& s, py::handle key, py::handle data, py::handle timeout) {
            check_owner(s, "all_sum");
            Key k = arguments::key(key);
            int64_t d = arguments::int64(data);
            double t = arguments::seconds(timeout);
            return named(s, [&] { return nogil([&] { return s.all_sum(k, d, t); }); });
          },
          doc("all_sum"),
          py::arg("key") = no_key, py::arg("data") = no_key, py::arg("timeout") = default_timeout)
      .def(
          "close", [](StoreCollectives& s, double flush_timeout) { nogil([&] { s.close(flush_timeout); }); },
          py::arg("flush_timeout"))
      .def_property_readonly("rank", &StoreCollectives::rank)
      .def_property_readonly("world_size", &StoreCollectives::world_size);
  // Arguments that fit no signature (an unknown keyword, too many): the Python twin's one-line
  // TypeError, not pybind11's list of signatures. An overload tried only after the method's own.
  for (const auto& method : arguments::base().attr("METHODS")) {  // the nine collectives
    std::string name = method.cast<std::string>();
    cls.def(name.c_str(), [name](StoreCollectives&, const py::args& args, const py::kwargs& kwargs) {
      arguments::base().attr("call_error")("CppStoreCollectives", name, args, kwargs);
    });
  }
}
