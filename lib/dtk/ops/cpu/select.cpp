// CPU selection ops: top-k by magnitude, gather and scatter-add with i64 indices. Indices are
// validated in a serial pass first (a UsageError must not be thrown inside an OpenMP region).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "dtk/core/error.h"
#include "dtk/ops/backend.h"
#include "dtk/ops/cpu/internal.h"

namespace dtk::ops::cpu {

namespace {


void check_indices(const char* op, const int64_t* idx, int64_t n, int64_t limit) {
  for (int64_t j = 0; j < n; ++j)
    if (idx[j] < 0 || idx[j] >= limit)
      fail_usage("{}: index {} at position {} is outside [0, {})", op, idx[j], j, limit);
}

}  // namespace

// Order: NaN first (the largest magnitude there is), then by decreasing |x|, ties by lower index.
// A strict weak order even with NaN, which std::nth_element and std::sort need.
void topk_abs(const Tensor& x, int64_t k, Tensor& values, Tensor& indices) {
  const int64_t n = x.numel();
  visit_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.ptr<T>();
    auto before = [xp](int64_t a, int64_t b) {
      const T ma = std::abs(xp[a]), mb = std::abs(xp[b]);
      const bool na = std::isnan(ma), nb = std::isnan(mb);
      if (na != nb) return na;
      if (!na && ma != mb) return ma > mb;
      return a < b;
    };
    std::vector<int64_t> order(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) order[i] = i;
    if (k < n) std::nth_element(order.begin(), order.begin() + k, order.end(), before);
    std::sort(order.begin(), order.begin() + k, before);
    T* vp = values.ptr<T>();
    int64_t* ip = indices.ptr<int64_t>();
    for (int64_t j = 0; j < k; ++j) {
      ip[j] = order[j];
      vp[j] = xp[order[j]];
    }
  });
}

void gather(const Tensor& x, const Tensor& indices, Tensor& out) {
  const int64_t m = indices.numel();
  const int64_t* idx = indices.ptr<int64_t>();
  check_indices("gather", idx, m, x.numel());
  visit_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.ptr<T>();
    T* op = out.ptr<T>();
#pragma omp parallel for if (m > kParallelMin)
    for (int64_t j = 0; j < m; ++j) op[j] = xp[idx[j]];
  });
}

// Serial: indices may repeat, and the sum order stays fixed.
void scatter_add(const Tensor& indices, const Tensor& values, Tensor& out) {
  const int64_t m = indices.numel();
  const int64_t* idx = indices.ptr<int64_t>();
  check_indices("scatter_add", idx, m, out.numel());
  visit_float(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* vp = values.ptr<T>();
    T* op = out.ptr<T>();
    for (int64_t j = 0; j < m; ++j) op[idx[j]] += vp[j];
  });
}

}  // namespace dtk::ops::cpu
