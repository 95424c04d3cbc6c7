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

// The mixed-precision ops (ops.h): f32 and bf16 mix, f64 stays with f64.
inline bool dtypes_mix(DType a, DType b) {
  const auto f32ish = [](DType t) { return t == DType::f32 || t == DType::bf16; };
  return a == b || (f32ish(a) && f32ish(b));
}

inline void check_float_or_bf16(const char* op, const Tensor& t, const char* name) {
  check_defined(op, t, name);
  if (t.dtype() != DType::f32 && t.dtype() != DType::f64 && t.dtype() != DType::bf16)
    fail_usage(std::string(op) + ": " + name + " must be f32, f64 or bf16, got " + t.str());
}

// `t` has the device and number of elements of `ref`, and a dtype that mixes with ref's.
inline void check_like_mixed(const char* op, const Tensor& ref, const Tensor& t, const char* name) {
  check_defined(op, t, name);
  if (!dtypes_mix(t.dtype(), ref.dtype()) || t.device() != ref.device() || t.numel() != ref.numel())
    fail_usage(std::string(op) + ": " + name + " must match " + ref.str() + " (f32 and bf16 mix), got " + t.str());
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

inline void check_matrix_rank(const char* op, const Tensor& t, const char* name) {
  check_defined(op, t, name);
  if (t.ndim() != 2 && t.ndim() != 3)
    fail_usage(std::string(op) + ": " + name + " must be a matrix [m, n] or a batch [B, m, n], got " + t.str());
}

// Do the byte ranges of two tensors overlap? Views of one storage that do not overlap (two
// slices of a batch) are fine as gemm's inputs and output; overlapping ones are not.
inline bool overlaps(const Tensor& x, const Tensor& y) {
  if (!x.shares_storage(y) || x.bytes() == 0 || y.bytes() == 0) return false;
  const auto* x0 = static_cast<const char*>(x.data());
  const auto* y0 = static_cast<const char*>(y.data());
  return x0 < y0 + y.bytes() && y0 < x0 + x.bytes();
}

// Square matrix or batch of square matrices.
inline void check_square(const char* op, const Tensor& a, const char* name) {
  check_matrix_rank(op, a, name);
  if (a.dim(-1) != a.dim(-2))
    fail_usage(std::string(op) + ": " + name + " must be square ([n, n] or [B, n, n]), got " + a.str());
}

}  // namespace dtk::ops::detail
