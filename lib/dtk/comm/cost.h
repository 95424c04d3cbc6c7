// dtk::comm cost model: a collective's time as latency + bytes / bandwidth (the alpha-beta
// model), fitted to measured (bytes, seconds) pairs. comm-bench --fit prints it per collective;
// fsdp-train's automatic bucketing (issue 12) is to plan with it.
#pragma once
#include <vector>

namespace dtk::comm {

struct CostModel {
  double alpha_s = 0;          // latency: the time of an empty operation
  double beta_s_per_byte = 0;  // inverse bandwidth
  double seconds(double bytes) const { return alpha_s + beta_s_per_byte * bytes; }
  double gbps() const { return beta_s_per_byte > 0 ? 1e-9 / beta_s_per_byte : 0; }  // bandwidth, 0: unbounded
};

struct Sample {
  double bytes = 0, seconds = 0;
};

// Least squares in relative error (sum of ((alpha + beta b - t) / t)^2), so that microsecond
// latencies and second-long transfers weigh alike. alpha and beta are kept >= 0: when either
// comes out negative, or the sizes do not determine both (one size only), the result is the
// better (by the largest relative error) of the pure-latency and the pure-bandwidth fit.
// Samples with t <= 0 are ignored; UsageError when none is left.
CostModel fit_cost(const std::vector<Sample>& samples);

// The largest |model - measured| / measured over the samples (how well the line fits).
double max_relative_error(const CostModel& m, const std::vector<Sample>& samples);

// A sweep of two regimes: a token bucket's burst (small transfers at the line's speed, large
// ones at its rate), a latency floor (TCP's acknowledgements on a shaped link), a protocol
// switch. model is the line of the sizes from knee_bytes up (what large transfers cost; its
// latency may be negative there, a burst's head start), below the line under it; knee_bytes 0:
// one line fits (model, every size).
struct CostFit {
  CostModel model, below;
  double knee_bytes = 0;
  double seconds(double bytes) const { return bytes < knee_bytes ? below.seconds(bytes) : model.seconds(bytes); }
  double max_relative_error(const std::vector<Sample>& samples) const;
};
// fit_cost over every sample, unless one line's relative error is above kKneeMinError (root mean
// square) and splitting the sizes in two (at least 2 sizes below, 3 from the knee up) brings it
// to kKneeGain of that or less: then the split that fits best, each side its own line. Measured
// on netlab (comm-bench -b 4K -e 16M, 2 hosts): at 1 Gbit/s one line read 0.079 GB/s (rms 0.33;
// small transfers wait 4-8 ms on TCP's acknowledgements), the knee at 256 KiB 0.112 (rms 0.21;
// the link: 0.125); at 100 Mbit/s one line read 0.0122 (rms 0.21, no split did better than 0.20).
constexpr double kKneeMinError = 0.1, kKneeGain = 2.0 / 3.0;
CostFit fit_cost_regimes(const std::vector<Sample>& samples);

}  // namespace dtk::comm
