// comm/cost.h: the alpha-beta fit recovers a line exactly, fits noisy data within the noise,
// keeps both coefficients non-negative, and handles one size and bad samples; a sweep of two
// regimes (a token bucket's burst) gets two lines and its knee.
#include <gtest/gtest.h>

#include <cmath>

#include "dtk/comm/cost.h"
#include "dtk/core/error.h"

namespace dtk::comm {
namespace {

std::vector<Sample> line_of(double alpha, double beta, double noise = 0) {
  std::vector<Sample> s;
  int k = 0;
  for (double b = 8; b <= (1 << 26); b *= 4, ++k) {
    const double wobble = 1 + noise * ((k % 3) - 1);  // -noise, 0, +noise
    s.push_back({b, (alpha + beta * b) * wobble});
  }
  return s;
}

TEST(CommCost, RecoversALine) {
  const CostModel m = fit_cost(line_of(5e-6, 1e-10));
  EXPECT_NEAR(m.alpha_s, 5e-6, 1e-12);
  EXPECT_NEAR(m.beta_s_per_byte, 1e-10, 1e-16);
  EXPECT_LT(max_relative_error(m, line_of(5e-6, 1e-10)), 1e-9);
  EXPECT_NEAR(m.seconds(1e9), 5e-6 + 0.1, 1e-9);
}

TEST(CommCost, NoisyDataWithinTheNoise) {
  const auto s = line_of(2e-6, 4e-10, 0.05);
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

// A token bucket (netlab: 256 KB of burst at the line's speed, then 100 Mbit/s) behind a latency
// floor: one line is off by far more than 20%, the two regimes recover the rate within 3% and
// put the knee at the burst. A line, a noisy line and too few sizes keep one line.
TEST(CommCost, TwoRegimes) {
  std::vector<Sample> s;
  const double floor = 8e-3, burst = 256 * 1024, line = 2.6e9, rate = 12.5e6;
  for (double b = 4096; b <= 4 * 1024 * 1024; b *= 2)
    s.push_back({b, b <= burst ? floor + b / line : floor + burst / line + (b - burst) / rate});
  EXPECT_GT(max_relative_error(fit_cost(s), s), 0.2);
  const CostFit f = fit_cost_regimes(s);
  EXPECT_GE(f.knee_bytes, burst);
  EXPECT_LE(f.knee_bytes, 2 * burst);
  EXPECT_NEAR(f.model.gbps() / (rate * 1e-9), 1, 0.03);
  EXPECT_NEAR(f.below.seconds(4096), floor, 1e-4);
  EXPECT_LT(f.max_relative_error(s), 0.1);
  for (const auto& one : {line_of(5e-6, 1e-10), line_of(2e-6, 4e-10, 0.08)}) EXPECT_EQ(fit_cost_regimes(one).knee_bytes, 0);
  EXPECT_EQ(fit_cost_regimes({s[0], s[1], s[8], s[9]}).knee_bytes, 0);  // 4 sizes: no split of 2 + 3
}

}  // namespace
}  // namespace dtk::comm
