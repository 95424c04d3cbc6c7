// Element conversions between dtypes, identical on host and device (internal to ops): integers
// from floats truncate toward zero and saturate (NaN becomes 0); 16-bit floats go through f32
// with round to nearest even, the same two roundings on CPU and GPU.
#pragma once
#include <cstdint>
#include <limits>
#include <type_traits>

#include "dtk/core/dtype.h"

#include "dtk/core/half.h"

namespace dtk::ops::detail {

struct bf16_t {
  uint16_t bits;
};
struct f16_t {
  uint16_t bits;
};

template <typename T>
DTK_HD double to_double(T v) {
  return static_cast<double>(v);
}
template <>
DTK_HD double to_double(bf16_t v) {
  return bf16_to_float(v.bits);
}
template <>
DTK_HD double to_double(f16_t v) {
  return f16_to_float(v.bits);
}

template <typename I>
DTK_HD I saturate(double v) {
  if (!(v == v)) return 0;
  const double lo = static_cast<double>(std::numeric_limits<I>::lowest());
  const double hi = static_cast<double>(std::numeric_limits<I>::max());
  if (v <= lo) return std::numeric_limits<I>::lowest();
  if (v >= hi) return std::numeric_limits<I>::max();
  return static_cast<I>(v);
}

template <typename T>
DTK_HD T from_double(double v) {
  if constexpr (std::is_floating_point_v<T>) {
    return static_cast<T>(v);
  } else {
    return saturate<T>(v);
  }
}
template <>
DTK_HD bf16_t from_double(double v) {
  return bf16_t{float_to_bf16(static_cast<float>(v))};
}
template <>
DTK_HD f16_t from_double(double v) {
  return f16_t{float_to_f16(static_cast<float>(v))};
}

// Conversion S -> D, with the float <-> 16-bit paths that need no double.
template <typename D, typename S>
DTK_HD D convert(S v) {
  if constexpr (std::is_same_v<S, D>) {
    return v;
  } else if constexpr (std::is_same_v<S, float> && std::is_same_v<D, bf16_t>) {
    return bf16_t{float_to_bf16(v)};
  } else if constexpr (std::is_same_v<S, float> && std::is_same_v<D, f16_t>) {
    return f16_t{float_to_f16(v)};
  } else if constexpr (std::is_same_v<S, bf16_t> && std::is_same_v<D, float>) {
    return bf16_to_float(v.bits);
  } else if constexpr (std::is_same_v<S, f16_t> && std::is_same_v<D, float>) {
    return f16_to_float(v.bits);
  } else {
    return from_double<D>(to_double(v));
  }
}

// Calls f(T{}) with T the C++ type of dtype t.
template <typename F>
decltype(auto) visit_dtype(DType t, F&& f) {
  switch (t) {
    case DType::f32: return f(float{});
    case DType::f64: return f(double{});
    case DType::bf16: return f(bf16_t{});
    case DType::f16: return f(f16_t{});
    case DType::i32: return f(int32_t{});
    case DType::i64: return f(int64_t{});
    case DType::u8: return f(uint8_t{});
    case DType::u16: return f(uint16_t{});
  }
  return f(float{});
}

}  // namespace dtk::ops::detail
