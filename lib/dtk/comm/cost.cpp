#include "dtk/comm/cost.h"

#include <algorithm>
#include <cmath>

#include "dtk/core/error.h"

namespace dtk::comm {

CostModel fit_cost(const std::vector<Sample>& samples) {
  // Rows u_i = (1 / t_i, b_i / t_i), target 1: normal equations of the 2x2 system.
  double s11 = 0, s12 = 0, s22 = 0, r1 = 0, r2 = 0;
  int used = 0;
  for (const Sample& s : samples) {
    if (!(s.seconds > 0) || !(s.bytes >= 0) || !std::isfinite(s.seconds) || !std::isfinite(s.bytes)) continue;
    const double u1 = 1 / s.seconds, u2 = s.bytes / s.seconds;
    s11 += u1 * u1;
    s12 += u1 * u2;
    s22 += u2 * u2;
    r1 += u1;
    r2 += u2;
    ++used;
  }
  if (used == 0) fail_usage("fit_cost: no sample with a positive time");
  CostModel m;
  const double det = s11 * s22 - s12 * s12;
  if (det > 1e-12 * s11 * s22) {
    m.alpha_s = (r1 * s22 - r2 * s12) / det;
    m.beta_s_per_byte = (r2 * s11 - r1 * s12) / det;
  }
  // Degenerate (one size) or a negative coefficient: the best one-parameter model instead.
  if (!(det > 1e-12 * s11 * s22) || m.alpha_s < 0 || m.beta_s_per_byte < 0) {
    const CostModel latency{r1 / s11, 0};
    const CostModel bandwidth{0, s22 > 0 ? r2 / s22 : 0};
    m = (s22 > 0 && max_relative_error(bandwidth, samples) < max_relative_error(latency, samples)) ? bandwidth : latency;
  }
  return m;
}

double max_relative_error(const CostModel& m, const std::vector<Sample>& samples) {
  double e = 0;
  for (const Sample& s : samples)
    if (s.seconds > 0 && std::isfinite(s.seconds)) e = std::max(e, std::abs(m.seconds(s.bytes) - s.seconds) / s.seconds);
  return e;
}

}  // namespace dtk::comm
