// Arguments of the Python methods, checked in C++ (twin of the check helpers in
// torch_ctrl/base.py). The types almost every caller passes (a str or None key, bytes data,
// a timedelta or a non-negative number of seconds) are converted here without running any
// Python code; anything else goes through the Python helper itself, so unusual input is
// accepted, converted or refused exactly as the pure-Python implementation does, with the
// same message, and always before anything is written to the store.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <datetime.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

namespace torch_ctrl::arguments {

namespace py = pybind11;

// torch_ctrl.base, imported on first use (it imports this extension's loader) and kept for
// the life of the process: never released, so no Python object is freed at exit from here.
inline py::handle base() {
  static py::handle module = py::module_::import("torch_ctrl.base").release();
  return module;
}

inline std::string from_bytes(py::handle value) {
  char* data = nullptr;
  Py_ssize_t size = 0;
  if (PyBytes_AsStringAndSize(value.ptr(), &data, &size) != 0) {
    throw py::error_already_set();
  }
  return std::string(data, static_cast<size_t>(size));
}

inline std::string from_str(py::handle value) {
  Py_ssize_t size = 0;
  const char* data = PyUnicode_AsUTF8AndSize(value.ptr(), &size);
  if (data == nullptr) {
    throw py::error_already_set();  // e.g. a lone surrogate: UnicodeEncodeError, as in Python
  }
  return std::string(data, static_cast<size_t>(size));
}

// base.check_key
inline std::optional<std::string> key(py::handle value) {
  if (value.is_none()) {
    return std::nullopt;
  }
  if (PyUnicode_CheckExact(value.ptr())) {
    return from_str(value);
  }
  py::object checked = base().attr("check_key")(value);
  if (checked.is_none()) {
    return std::nullopt;
  }
  return from_str(checked);
}

// base.to_seconds (with clamping to MAX_TIMEOUT)
inline double seconds(py::handle value) {
  static const double max_timeout = base().attr("MAX_TIMEOUT").cast<double>();
  double secs = -1.0;
  PyObject* obj = value.ptr();
  if (PyDelta_CheckExact(obj)) {
    long long days = PyDateTime_DELTA_GET_DAYS(obj);
    if (days >= 0 && days < 100000000) {  // no int64 overflow in microseconds below
      long long micros = (days * 86400 + PyDateTime_DELTA_GET_SECONDS(obj)) * 1000000LL +
          PyDateTime_DELTA_GET_MICROSECONDS(obj);
      // Exact in a double below 2**53 us, and one correctly rounded division: the same
      // float as timedelta.total_seconds() for every timeout not clamped below.
      secs = static_cast<double>(micros) / 1e6;
    }
  } else if (PyFloat_CheckExact(obj)) {
    secs = PyFloat_AS_DOUBLE(obj);
  } else if (PyLong_CheckExact(obj)) {
    secs = PyLong_AsDouble(obj);
    if (secs == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();  // too large for a float: the helper raises the same OverflowError
    }
  }
  if (secs >= 0) {  // false for NaN and negatives: the helper raises with Python's message
    return std::min(secs, max_timeout);
  }
  return base().attr("to_seconds")(value).cast<double>();
}

// base.to_bytes
inline std::string data(py::handle value) {
  if (PyBytes_CheckExact(value.ptr())) {
    return from_bytes(value);
  }
  return from_bytes(base().attr("to_bytes")(value));
}

// base.to_bytes_list
inline std::vector<std::string> data_list(py::handle value, int world_size) {
  std::vector<std::string> out;
  PyObject* obj = value.ptr();
  if (PyList_CheckExact(obj) && PyList_GET_SIZE(obj) == world_size) {
    out.reserve(world_size);
    for (Py_ssize_t i = 0; i < world_size; ++i) {
      PyObject* item = PyList_GET_ITEM(obj, i);
      if (!PyBytes_CheckExact(item)) {
        out.clear();
        break;
      }
      out.push_back(from_bytes(item));
    }
    if (static_cast<int>(out.size()) == world_size) {
      return out;
    }
  }
  py::object checked = base().attr("to_bytes_list")(value, world_size);
  for (py::handle item : checked) {
    out.push_back(from_bytes(item));
  }
  return out;
}

// base.to_int64
inline int64_t int64(py::handle value) {
  if (PyLong_CheckExact(value.ptr())) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
    if (overflow == 0 && !(v == -1 && PyErr_Occurred())) {
      return static_cast<int64_t>(v);
    }
    PyErr_Clear();
  }
  return base().attr("to_int64")(value).cast<int64_t>();
}

// base.check_block: barrier's block, a bool (or an integer such as NumPy's bool_).
inline bool truth(py::handle value) {
  if (PyBool_Check(value.ptr())) {
    return value.ptr() == Py_True;
  }
  return base().attr("check_block")(value).cast<bool>();
}

} // namespace torch_ctrl::arguments
