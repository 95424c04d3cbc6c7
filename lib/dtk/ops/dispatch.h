// What both backends (ops/cpu/, ops/cuda/) share to turn a runtime choice into a compile-time one
// (internal to ops): the type a kernel computes in for a dtype, the reduction kinds, and each
// kind's policy (map, combine, finish), so that both backends reduce by the same rules.
#pragma once
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "dtk/core/dtype.h"
#include "dtk/core/error.h"
#include "dtk/core/half.h"
#include "dtk/ops/ops.h"

namespace dtk::ops::detail {

// f(T{}) for a tensor of dtype t: double for f64, float for f32. The public ops admit no other
// dtype where this is called (ops/check.h; bf16 goes to the mixed-precision paths first), so any
// other is a bug in dtk, and it is said so instead of read as float.
template <typename F>
void visit_float(DType t, F&& f) {
  if (t == DType::f64) return f(double{});
  if (t == DType::f32) return f(float{});
  fail(std::string("internal: an f32/f64 kernel was handed a ") + std::string(dtype_name(t)) + " tensor");
}

// f(std::integral_constant<Reduce, K>{}) for the reduction kind k.
template <typename F>
void visit_reduce(Reduce k, F&& f) {
  switch (k) {
    case Reduce::sum: return f(std::integral_constant<Reduce, Reduce::sum>{});
    case Reduce::mean: return f(std::integral_constant<Reduce, Reduce::mean>{});
    case Reduce::max: return f(std::integral_constant<Reduce, Reduce::max>{});
    case Reduce::min: return f(std::integral_constant<Reduce, Reduce::min>{});
    case Reduce::norm2: return f(std::integral_constant<Reduce, Reduce::norm2>{});
    case Reduce::absmax: return f(std::integral_constant<Reduce, Reduce::absmax>{});
  }
}

// max and min that propagate NaN as PyTorch does: an accumulator a that is NaN stays NaN, a NaN
// b wins.
template <typename T>
DTK_HD T max_nan(T a, T b) {
  return (a > b || a != a) ? a : b;
}
template <typename T>
DTK_HD T min_nan(T a, T b) {
  return (a < b || a != a) ? a : b;
}

// A reduction kind as a policy over double accumulators: map each element, combine two partial
// results (in any tree: the backends fix the tree), finish with the element count; max and min
// propagate NaN (max_nan, min_nan).
template <Reduce K>
struct ReducePolicy {
  static constexpr bool additive = K == Reduce::sum || K == Reduce::mean || K == Reduce::norm2;
  DTK_HD static double identity() {
    if constexpr (additive || K == Reduce::absmax) return 0.0;
    else if constexpr (K == Reduce::max) return -HUGE_VAL;
    else return HUGE_VAL;
  }
  DTK_HD static double map(double x) {
    if constexpr (K == Reduce::norm2) return x * x;
    else if constexpr (K == Reduce::absmax) return ::fabs(x);
    else return x;
  }
  DTK_HD static double combine(double acc, double x) {
    if constexpr (additive) return acc + x;
    else if constexpr (K == Reduce::min) return min_nan(acc, x);
    else return max_nan(acc, x);
  }
  DTK_HD static double finish(double acc, int64_t count) {
    if constexpr (K == Reduce::mean) return acc / static_cast<double>(count);  // 0 / 0 = NaN when empty
    else if constexpr (K == Reduce::norm2) return ::sqrt(acc);
    else return acc;
  }
};

// The exponent bits of a 16-bit float dtype: a value is NaN or Inf exactly when all are set.
inline uint16_t exponent_mask16(DType t) { return t == DType::bf16 ? 0x7f80 : 0x7c00; }

}  // namespace dtk::ops::detail
