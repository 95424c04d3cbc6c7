// CPU reductions, accumulated in double for f32 as well. Deterministic whatever the number of
// threads: the whole-tensor reduction splits the input into fixed chunks (a function of the size
// only), reduces each chunk serially and combines the partials serially in chunk order; per-row
// and per-column results are each a serial loop owned by one thread.
#include <cmath>
#include <cstdint>
#include <vector>

#include "dtk/core/error.h"
#include "dtk/ops/backend.h"
#include "dtk/ops/cpu/internal.h"

namespace dtk::ops::cpu {

namespace {

constexpr int64_t kChunk = 1 << 14;  // elements per partial of the whole-tensor reduction
constexpr int64_t kColBlock = 64;    // columns per task of the per-column reduction

template <Reduce K, typename T>
void reduce_typed(Axis axis, const Tensor& a, Tensor& out) {
  using P = detail::ReducePolicy<K>;
  const T* x = a.ptr<T>();
  T* o = out.ptr<T>();
  if (axis == Axis::all) {
    const int64_t n = a.numel();
    const int64_t nchunks = (n + kChunk - 1) / kChunk;
    std::vector<double> partial(static_cast<size_t>(nchunks));
#pragma omp parallel for schedule(static) if (nchunks > 1)
    for (int64_t c = 0; c < nchunks; ++c) {
      const int64_t end = (c + 1) * kChunk < n ? (c + 1) * kChunk : n;
      double acc = P::identity();
      for (int64_t i = c * kChunk; i < end; ++i) acc = P::combine(acc, P::map(static_cast<double>(x[i])));
      partial[c] = acc;
    }
    double acc = P::identity();
    for (int64_t c = 0; c < nchunks; ++c) acc = P::combine(acc, partial[c]);
    o[0] = static_cast<T>(P::finish(acc, n));
    return;
  }
  const int64_t R = a.dim(0), C = a.dim(1);
  if (axis == Axis::rows) {
#pragma omp parallel for schedule(static) if (R * C > kChunk)
    for (int64_t r = 0; r < R; ++r) {
      const T* xr = x + r * C;
      double acc = P::identity();
      for (int64_t c = 0; c < C; ++c) acc = P::combine(acc, P::map(static_cast<double>(xr[c])));
      o[r] = static_cast<T>(P::finish(acc, C));
    }
    return;
  }
  // Columns: each task owns a block of columns and walks the rows in order (row-major reads).
  const int64_t nblocks = (C + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static) if (R * C > kChunk)
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const int64_t c0 = blk * kColBlock;
    const int64_t c1 = c0 + kColBlock < C ? c0 + kColBlock : C;
    double acc[kColBlock];
    for (int64_t c = c0; c < c1; ++c) acc[c - c0] = P::identity();
    for (int64_t r = 0; r < R; ++r) {
      const T* xr = x + r * C;
      for (int64_t c = c0; c < c1; ++c) acc[c - c0] = P::combine(acc[c - c0], P::map(static_cast<double>(xr[c])));
    }
    for (int64_t c = c0; c < c1; ++c) o[c] = static_cast<T>(P::finish(acc[c - c0], R));
  }
}

}  // namespace

void reduce(Reduce kind, Axis axis, const Tensor& a, Tensor& out) {
  detail::visit_reduce(kind, [&](auto k) {
    visit_float(a.dtype(), [&](auto tag) { reduce_typed<decltype(k)::value, decltype(tag)>(axis, a, out); });
  });
}

int64_t count_nonfinite(const Tensor& a) {
  const int64_t n = a.numel();
  int64_t count = 0;  // an integer sum: exact in any order
  switch (a.dtype()) {
    case DType::f32: {
      const float* x = a.ptr<float>();
#pragma omp parallel for reduction(+ : count) if (n > kChunk)
      for (int64_t i = 0; i < n; ++i) count += std::isfinite(x[i]) ? 0 : 1;
      break;
    }
    case DType::f64: {
      const double* x = a.ptr<double>();
#pragma omp parallel for reduction(+ : count) if (n > kChunk)
      for (int64_t i = 0; i < n; ++i) count += std::isfinite(x[i]) ? 0 : 1;
      break;
    }
    case DType::bf16:
    case DType::f16: {
      const uint16_t mask = detail::exponent_mask16(a.dtype());
      const uint16_t* x = a.ptr<uint16_t>();
#pragma omp parallel for reduction(+ : count) if (n > kChunk)
      for (int64_t i = 0; i < n; ++i) count += (x[i] & mask) == mask ? 1 : 0;
      break;
    }
    default: fail_usage("count_nonfinite: expected a float tensor, got " + a.str());
  }
  return count;
}

}  // namespace dtk::ops::cpu
