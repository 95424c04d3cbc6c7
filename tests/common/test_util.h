// What the unit tests share: random inputs (Philox normals, and std::mt19937_64 normals where a
// test's expected values were chosen on those), the values a tensor of a dtype holds, tolerances
// by dtype, element-by-element comparison with a relative tolerance, and configs read from JSON
// as every reader takes them. tests/common/gpu_check.h builds on it for the GPU tests.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dtk/core/dtype.h"
#include "dtk/core/half.h"
#include "dtk/core/json_config.h"
#include "dtk/core/philox.h"

namespace dtk::test_util {

using Vec = std::vector<double>;

// n normals, mean + scale * philox::normal(seed, i): the same values on every machine and in
// every test that asks for the same seed.
inline Vec randn(int64_t n, uint64_t seed, double scale = 1.0, double mean = 0.0) {
  Vec v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = mean + scale * philox::normal(seed, static_cast<uint64_t>(i));
  return v;
}

// n standard normals from std::mt19937_64(seed) (the older tests' inputs: their tolerances and
// expectations were set on these values).
inline Vec random_values(size_t n, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> dist(0.0, 1.0);
  Vec v(n);
  for (double& x : v) x = dist(gen);
  return v;
}

// The values a tensor of dtype t (f32, bf16 or f64) holds when given v: f32 and bf16 round each
// once (bf16 to nearest even). The f64 references start from these, so that only the operation's
// own error is measured.
inline Vec rounded(const Vec& v, DType t) {
  if (t == DType::f64) return v;
  Vec r(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const float f = static_cast<float>(v[i]);
    r[i] = t == DType::bf16 ? static_cast<double>(round_bf16(f)) : static_cast<double>(f);
  }
  return r;
}

// A tolerance by dtype: f64_tol for f64, f32_tol for f32. Each test names its own f32 figure
// (and says why); 1e-12 is a few roundings of values of order 1 in double precision.
inline double tol_of(DType t, double f32_tol, double f64_tol = 1e-12) { return t == DType::f64 ? f64_tol : f32_tol; }

// |got - want| <= tol * max(1, |want|) for every element (NaN matches NaN); the first five
// differences are reported with `what`, then their count.
inline void expect_close(const Vec& got, const Vec& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(want[i]) && std::isnan(got[i])) continue;
    if (!(std::fabs(got[i] - want[i]) <= tol * std::fmax(1.0, std::fabs(want[i])))) {
      if (bad < 5) ADD_FAILURE() << what << ": element " << i << " got " << got[i] << ", want " << want[i];
      ++bad;
    }
  }
  EXPECT_EQ(bad, 0) << what;
}

// A config from JSON as every reader takes it (core/json_config.h).
template <class T>
T from_json(const nlohmann::json& j) {
  return read_config<T>(j, "config");
}

}  // namespace dtk::test_util
