#include "dtk/comm/cost.h"

#include <algorithm>
#include <cmath>
#include <iterator>

#include "dtk/core/error.h"

namespace dtk::comm {
namespace {

bool usable(const Sample& s) {
  return s.seconds > 0 && s.bytes >= 0 && std::isfinite(s.seconds) && std::isfinite(s.bytes);
}

// Least squares in relative error: rows u_i = (1 / t_i, b_i / t_i), target 1; the normal
// equations of the 2x2 system over the usable samples.
struct Normal {
  double s11 = 0, s12 = 0, s22 = 0, r1 = 0, r2 = 0;
  int used = 0;
  explicit Normal(const std::vector<Sample>& samples) {
    for (const Sample& s : samples) {
      if (!usable(s)) continue;
      const double u1 = 1 / s.seconds, u2 = s.bytes / s.seconds;
      s11 += u1 * u1, s12 += u1 * u2, s22 += u2 * u2, r1 += u1, r2 += u2;
      ++used;
    }
  }
  // The unconstrained line; false when the sizes do not determine it.
  bool solve(CostModel& m) const {
    const double det = s11 * s22 - s12 * s12;
    if (!(det > 1e-12 * s11 * s22)) return false;
    m = {(r1 * s22 - r2 * s12) / det, (r2 * s11 - r1 * s12) / det};
    return true;
  }
};

// The root mean square of the relative errors (the fits' own measure).
double rms_relative_error(const CostFit& f, const std::vector<Sample>& samples) {
  double e = 0;
  for (const Sample& s : samples) e += std::pow((f.seconds(s.bytes) - s.seconds) / s.seconds, 2);
  return std::sqrt(e / static_cast<double>(samples.size()));
}

}  // namespace

CostModel fit_cost(const std::vector<Sample>& samples) {
  const Normal n(samples);
  if (n.used == 0) fail_usage("fit_cost: no sample with a positive time");
  CostModel m;
  // Degenerate (one size) or a negative coefficient: the best one-parameter model instead.
  if (!n.solve(m) || m.alpha_s < 0 || m.beta_s_per_byte < 0) {
    const CostModel latency{n.r1 / n.s11, 0};
    const CostModel bandwidth{0, n.s22 > 0 ? n.r2 / n.s22 : 0};
    m = (n.s22 > 0 && max_relative_error(bandwidth, samples) < max_relative_error(latency, samples)) ? bandwidth : latency;
  }
  return m;
}

double max_relative_error(const CostModel& m, const std::vector<Sample>& samples) {
  return CostFit{m, {}, 0}.max_relative_error(samples);
}

double CostFit::max_relative_error(const std::vector<Sample>& samples) const {
  double e = 0;
  for (const Sample& s : samples)
    if (s.seconds > 0 && std::isfinite(s.seconds)) e = std::max(e, std::abs(seconds(s.bytes) - s.seconds) / s.seconds);
  return e;
}

CostFit fit_cost_regimes(const std::vector<Sample>& samples) {
  CostFit best{fit_cost(samples), {}, 0};
  std::vector<Sample> s;
  std::copy_if(samples.begin(), samples.end(), std::back_inserter(s), usable);
  std::sort(s.begin(), s.end(), [](const Sample& a, const Sample& b) { return a.bytes < b.bytes; });
  const double one_line = rms_relative_error(best, s);
  if (one_line <= kKneeMinError) return best;
  double err = one_line;
  for (size_t i = 2; i + 3 <= s.size(); ++i) {
    if (s[i].bytes == s[i - 1].bytes) continue;  // a knee between two sizes
    const std::vector<Sample> lo(s.begin(), s.begin() + static_cast<std::ptrdiff_t>(i)), hi(s.begin() + static_cast<std::ptrdiff_t>(i), s.end());
    // From the knee up the line may start below zero (a burst's head start); not below the knee.
    CostFit split{fit_cost(hi), fit_cost(lo), s[i].bytes};
    if (CostModel m; Normal(hi).solve(m) && m.beta_s_per_byte > 0 && m.seconds(s[i].bytes) > 0) split.model = m;
    const double e = rms_relative_error(split, s);
    if (e < err) err = e, best = split;
  }
  return err <= kKneeGain * one_line ? best : CostFit{fit_cost(samples), {}, 0};
}

}  // namespace dtk::comm
