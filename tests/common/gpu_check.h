// What the GPU op tests share: the skip without a GPU, random inputs, the relative error of a
// GPU result against the CPU's, and the "gpu-check:" line each comparison prints for
// scripts/gpu-check's log ("gpu-check: <op> <dtype> max_rel_err=<x> tol=<y> PASS|FAIL").
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "dtk/core/device.h"
#include "dtk/core/dtype.h"

#define SKIP_WITHOUT_GPU() \
  if (dtk::cuda::device_count() == 0) GTEST_SKIP() << "no GPU"

namespace dtk::gpu_test {

using Vec = std::vector<double>;

inline const DType kFloatTypes[] = {DType::f32, DType::f64};
inline const Device kGpu = Device::cuda(0);

// Reductions and gemms, which run in another order on the GPU.
inline double tol_for(DType t) { return t == DType::f64 ? 1e-10 : 1e-4; }

inline Vec random_values(size_t n, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> dist(0.0, 1.0);
  Vec v(n);
  for (double& x : v) x = dist(gen);
  return v;
}

// max |x - y| / max(1e-30, max |y|); infinite when the sizes differ or x holds a NaN.
inline double max_rel_err(const Vec& x, const Vec& y) {
  double e = 0, s = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    e = std::max(e, std::isnan(x[i]) ? INFINITY : std::fabs(x[i] - y[i]));
    s = std::max(s, std::fabs(y[i]));
  }
  return x.size() != y.size() ? INFINITY : e / std::max(s, 1e-30);
}

inline void report(const std::string& op, const std::string& dtype, double err, double tol) {
  const bool pass = err < tol;
  std::printf("gpu-check: %s %s max_rel_err=%.3g tol=%.3g %s\n", op.c_str(), dtype.c_str(), err, tol,
              pass ? "PASS" : "FAIL");
  std::fflush(stdout);
  EXPECT_TRUE(pass) << op << " " << dtype << ": " << err << " >= " << tol;
}

}  // namespace dtk::gpu_test
