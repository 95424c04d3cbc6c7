// CPU fill, cast and Philox fills. Element i of a Philox fill is a pure function of
// (seed, offset + i), so the loops split across threads freely and match the GPU bit for bit.
#include <cmath>
#include <cstring>

#include "dtk/core/philox.h"
#include "dtk/ops/backend.h"
#include "dtk/ops/convert.h"

namespace dtk::ops::cpu {
using namespace dtk::ops::detail;

void fill(Tensor& out, double v) {
  visit_dtype(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T x = from_double<T>(v);
    T* p = out.ptr<T>();
    const int64_t n = out.numel();
#pragma omp parallel for if (n > (1 << 16))
    for (int64_t i = 0; i < n; ++i) p[i] = x;
  });
}

void cast(const Tensor& src, Tensor& dst) {
  visit_dtype(src.dtype(), [&](auto stag) {
    using S = decltype(stag);
    visit_dtype(dst.dtype(), [&](auto dtag) {
      using D = decltype(dtag);
      const S* s = src.ptr<S>();
      D* d = dst.ptr<D>();
      const int64_t n = src.numel();
#pragma omp parallel for if (n > (1 << 16))
      for (int64_t i = 0; i < n; ++i) d[i] = convert<D>(s[i]);
    });
  });
}

namespace {
template <typename Draw>
void philox_fill(Tensor& out, Draw draw) {
  visit_dtype(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, bf16_t> ||
                  std::is_same_v<T, f16_t>) {
      T* p = out.ptr<T>();
      const int64_t n = out.numel();
#pragma omp parallel for if (n > (1 << 14))
      for (int64_t i = 0; i < n; ++i) p[i] = from_double<T>(draw(static_cast<uint64_t>(i)));
    }
  });
}
}  // namespace

void uniform_(Tensor& out, uint64_t seed, uint64_t offset, double lo, double hi) {
  const double w = hi - lo;
  philox_fill(out, [=](uint64_t i) { return std::fma(philox::uniform(seed, offset + i), w, lo); });
}

void normal_(Tensor& out, uint64_t seed, uint64_t offset, double mean, double std) {
  philox_fill(out, [=](uint64_t i) { return std::fma(philox::normal(seed, offset + i), std, mean); });
}

}  // namespace dtk::ops::cpu
