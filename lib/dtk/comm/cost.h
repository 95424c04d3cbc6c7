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

}  // namespace dtk::comm
