// Argument checks for the public ops (internal to ops): each throws a UsageError that names the
// op, what was expected and what it got.
#pragma once
#include <initializer_list>
#include <string>

#include "dtk/core/error.h"
#include "dtk/core/tensor.h"

namespace dtk::ops::detail {

inline void check_defined(const char* op, const Tensor& t, const char* name) {
  if (!t.defined()) fail_usage(std::string(op) + ": " + name + " is an undefined tensor");
}

inline void check_float(const char* op, const Tensor& t, const char* name) {
  check_defined(op, t, name);
  if (t.dtype() != DType::f32 && t.dtype() != DType::f64)
    fail_usage(std::string(op) + ": " + name + " must be f32 or f64, got " + t.str());
}

// `t` has the dtype, device and number of elements of `ref`.
inline void check_like(const char* op, const Tensor& ref, const Tensor& t, const char* name) {
  check_defined(op, t, name);
  if (t.dtype() != ref.dtype() || t.device() != ref.device() || t.numel() != ref.numel())
    fail_usage(std::string(op) + ": " + name + " must match " + ref.str() + ", got " + t.str());
}

// `t` has the dtype and device of `ref` (any shape).
inline void check_kind(const char* op, const Tensor& ref, const Tensor& t, const char* name) {
  check_defined(op, t, name);
  if (t.dtype() != ref.dtype() || t.device() != ref.device())
    fail_usage(std::string(op) + ": " + name + " must be " + std::string(dtype_name(ref.dtype())) + " on " +
               ref.device().str() + ", got " + t.str());
}

inline void check_shape(const char* op, const Tensor& t, const Shape& want, const char* name) {
  check_defined(op, t, name);
  if (t.shape() != want)
    fail_usage(std::string(op) + ": " + name + " must have shape " + shape_str(want) + ", got " + t.str());
}

inline void check_on(const char* op, const Tensor& ref, const Tensor& t, const char* name) {
  check_defined(op, t, name);
  if (t.device() != ref.device())
    fail_usage(std::string(op) + ": " + name + " is on " + t.device().str() + ", the other tensors on " +
               ref.device().str());
}

inline void check_type(const char* op, const Tensor& t, DType want, const char* name) {
  check_defined(op, t, name);
  if (t.dtype() != want)
    fail_usage(std::string(op) + ": " + name + " must be " + std::string(dtype_name(want)) + ", got " + t.str());
}

}  // namespace dtk::ops::detail
