// comm/cost.h: the alpha-beta fit recovers a line exactly, fits noisy data within the noise,
// keeps both coefficients non-negative, and handles one size and bad samples.
#include <gtest/gtest.h>

#include <cmath>

#include "dtk/comm/cost.h"
#include "dtk/core/error.h"

namespace dtk::comm {
namespace {

std::vector<Sample> line(double alpha, double beta, double noise = 0) {
  std::vector<Sample> s;
  int k = 0;
  for (double b = 8; b <= (1 << 26); b *= 4, ++k) {
    const double wobble = 1 + noise * ((k % 3) - 1);  // -noise, 0, +noise
    s.push_back({b, (alpha + beta * b) * wobble});
  }
  return s;
}

TEST(CommCost, RecoversALine) {
  const CostModel m = fit_cost(line(5e-6, 1e-10));
  EXPECT_NEAR(m.alpha_s, 5e-6, 1e-12);
  EXPECT_NEAR(m.beta_s_per_byte, 1e-10, 1e-16);
  EXPECT_LT(max_relative_error(m, line(5e-6, 1e-10)), 1e-9);
  EXPECT_NEAR(m.seconds(1e9), 5e-6 + 0.1, 1e-9);
}

TEST(CommCost, NoisyDataWithinTheNoise) {
  const auto s = line(2e-6, 4e-10, 0.05);
  const CostModel m = fit_cost(s);
  EXPECT_NEAR(m.alpha_s / 2e-6, 1, 0.1);
  EXPECT_NEAR(m.beta_s_per_byte / 4e-10, 1, 0.1);
  EXPECT_LT(max_relative_error(m, s), 0.11);
}

TEST(CommCost, NonNegativeAndDegenerate) {
  // Times that fall with size would need a negative coefficient: pinned at 0.
  const CostModel falling = fit_cost({{8, 3e-6}, {1024, 2e-6}, {65536, 1e-6}});
  EXPECT_GE(falling.alpha_s, 0);
  EXPECT_GE(falling.beta_s_per_byte, 0);
  // Constant time: pure latency.
  const CostModel flat = fit_cost({{8, 1e-5}, {1 << 20, 1e-5}});
  EXPECT_NEAR(flat.alpha_s, 1e-5, 1e-12);
  EXPECT_NEAR(flat.beta_s_per_byte, 0, 1e-20);
  // One size: a one-parameter model through it.
  const CostModel one = fit_cost({{1 << 20, 1e-3}});
  EXPECT_NEAR(one.seconds(1 << 20), 1e-3, 1e-12);
  // Unusable samples are skipped; none left is an error.
  EXPECT_NEAR(fit_cost({{8, 0}, {8, -1}, {16, 2e-6}}).seconds(16), 2e-6, 1e-12);
  EXPECT_THROW(fit_cost({}), UsageError);
  EXPECT_THROW(fit_cost({{8, 0}}), UsageError);
}

}  // namespace
}  // namespace dtk::comm
