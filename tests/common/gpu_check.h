// What the GPU op tests share: the skip without a GPU, random inputs, the relative error of a
// GPU result against the CPU's, and the "gpu-check:" line each comparison prints for
// scripts/gpu-check's log ("gpu-check: <op> <dtype> max_rel_err=<x> tol=<y> PASS|FAIL"). A
// comparison passes when err <= tol: tol 0 asks for the same values (exact_err below).
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "dtk/core/device.h"
#include "dtk/core/dtype.h"
#include "dtk/core/tensor.h"
#include "test_util.h"

#define SKIP_WITHOUT_GPU() \
  if (dtk::cuda::device_count() == 0) GTEST_SKIP() << "no GPU"

namespace dtk::gpu_test {

using test_util::random_values;
using test_util::Vec;

inline const DType kFloatTypes[] = {DType::f32, DType::f64};
inline const Device kGpu = Device::cuda(0);

// Reductions and gemms, which run in another order on the GPU.
inline double tol_for(DType t) { return t == DType::f64 ? 1e-10 : 1e-4; }

// max |x - y| / max(1e-30, max |y|); infinite when the sizes differ or x holds a NaN.
inline double max_rel_err(const Vec& x, const Vec& y) {
  double e = 0, s = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    e = std::max(e, std::isnan(x[i]) ? INFINITY : std::fabs(x[i] - y[i]));
    s = std::max(s, std::fabs(y[i]));
  }
  return x.size() != y.size() ? INFINITY : e / std::max(s, 1e-30);
}

// For results that must be exact (copies, conversions, one correctly rounded operation on both
// sides): 0 when every element of got has the bits of want's, or both are NaN (IEEE 754 leaves
// NaN payloads to the implementation, and CPU and GPU propagate different ones); otherwise the
// largest |got - want| / max(|want|, 1) over the elements that differ, at least the smallest
// normal double (so that +0 against -0 counts), infinite where one is NaN or infinite. The first
// difference goes to *first (index, both values), for a log read without a rerun.
inline double exact_err(const Tensor& got, const Tensor& want, std::string* first = nullptr) {
  if (got.dtype() != want.dtype() || got.numel() != want.numel()) return INFINITY;
  const Tensor g = got.to(Device::cpu()), w = want.to(Device::cpu());
  const size_t size = dtype_size(g.dtype());
  const auto* gb = static_cast<const unsigned char*>(g.data());
  const auto* wb = static_cast<const unsigned char*>(w.data());
  double err = 0;
  for (size_t i = 0; i < static_cast<size_t>(g.numel()); ++i) {
    if (std::memcmp(gb + i * size, wb + i * size, size) == 0) continue;
    const double x = load_as_double(g.dtype(), gb, i), y = load_as_double(w.dtype(), wb, i);
    if (std::isnan(x) && std::isnan(y)) continue;
    const double d = std::fabs(x - y) / std::max(std::fabs(y), 1.0);
    const double e = std::isfinite(d) ? std::max(d, std::numeric_limits<double>::min()) : INFINITY;
    if (first && first->empty()) {
      char buf[128];
      std::snprintf(buf, sizeof buf, "element %zu: %.17g against %.17g", i, x, y);
      *first = buf;
    }
    err = std::max(err, e);
  }
  return err;
}

inline void report(const std::string& op, const std::string& dtype, double err, double tol) {
  const bool pass = err <= tol;
  std::printf("gpu-check: %s %s max_rel_err=%.3g tol=%.3g %s\n", op.c_str(), dtype.c_str(), err, tol,
              pass ? "PASS" : "FAIL");
  std::fflush(stdout);
  EXPECT_TRUE(pass) << op << " " << dtype << ": " << err << " > " << tol;
}

}  // namespace dtk::gpu_test
