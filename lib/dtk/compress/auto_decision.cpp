// --compressor auto's decision (auto.h): the predicted step of a choice (predict_step), the choice
// (choose), Accordion's detector, and the link given by the environment (a testing aid).
#include <cmath>
#include <cstdlib>
#include <vector>

#include "dtk/compress/auto.h"
#include "dtk/core/error.h"

namespace dtk::compress {

namespace {
double link_s(const comm::CostModel& m, double bytes) { return bytes > 0 ? m.seconds(bytes) : 0; }

const RankCost* rank_cost(const BucketCost& b, int rank) {
  for (const RankCost& r : b.ranks)
    if (r.rank == rank) return &r;
  fail_usage("auto: no cost for PowerSGD at rank {}", rank);
}
}  // namespace

double predict_step(const StepCosts& c, const std::vector<int>& choice) {
  const size_t K = c.buckets.size();
  if (choice.size() != K) fail_usage("auto: {} choices for {} buckets", choice.size(), K);
  std::vector<const RankCost*> rc(K, nullptr);
  std::vector<double> arrived(K, 0);  // the plain all-reduce's or P's
  double delay = 0, link_free = 0;
  for (size_t k = 0; k < K; ++k) {
    const BucketCost& b = c.buckets[k];
    double ready = b.ready_s + delay;
    double bytes = b.none_bytes;
    if (choice[k] > 0) {
      rc[k] = rank_cost(b, choice[k]);
      delay += rc[k]->send_s;
      ready += rc[k]->send_s;
      bytes = rc[k]->p_bytes;
    }
    link_free = std::max(ready, link_free) + link_s(c.link, bytes);
    arrived[k] = link_free;
  }
  double t = c.backward_s + delay;
  for (size_t k = 0; k < K; ++k) {
    t = std::max(t, arrived[k]);
    if (!rc[k]) continue;
    t += rc[k]->finish_s;
    link_free = std::max(t, link_free) + link_s(c.link, rc[k]->q_bytes);
    t = link_free;
  }
  return t;
}

std::vector<int> choose(const StepCosts& c, const std::vector<int>& want, const std::vector<int>& current) {
  const size_t K = c.buckets.size();
  if (want.size() != K || current.size() != K) fail_usage("auto: choices for {} buckets expected", K);
  std::vector<int> ch(K), none(K, 0);
  for (size_t k = 0; k < K; ++k) ch[k] = current[k] > 0 ? want[k] : 0;
  double best = predict_step(c, ch);
  auto consider = [&](const std::vector<int>& trial) {
    const double t = predict_step(c, trial);
    if (t < best * (1 - kSwitchMargin)) {
      ch = trial;
      best = t;
    }
  };
  consider(none);  // the uniform choices first: one bucket alone may not move a clogged link
  consider(want);
  for (int pass = 0; pass < 2; ++pass)
    for (size_t k = 0; k < K; ++k) {
      if (want[k] == 0 && ch[k] == 0) continue;
      std::vector<int> trial = ch;
      trial[k] = ch[k] > 0 ? 0 : want[k];
      consider(trial);
    }
  return ch;
}

bool accordion_critical(double prev, double cur, double eta) {
  if (!(prev > 0)) return true;
  return std::abs(prev - cur) / prev >= eta;
}

void Accordion::end_interval(double eta) {
  if (count <= 0) return;
  const double cur = sum / count;
  critical = accordion_critical(prev, cur, eta);
  prev = cur;
  sum = count = 0;
}

bool auto_link_from_env(comm::CostModel& out) {
  const char* env = std::getenv(kAutoLinkEnv);
  if (!env || !*env) return false;
  char* end = nullptr;
  const double alpha_us = std::strtod(env, &end);
  double gbps = 0;
  if (end != env && *end == ',') gbps = std::strtod(end + 1, &end);
  if (*end != '\0' || !(alpha_us >= 0) || !(gbps > 0) || !std::isfinite(alpha_us) || !std::isfinite(gbps))
    fail_usage("{}='{}': expected ALPHA_US,GBYTES_PER_S (the link's latency in microseconds and bandwidth in GB/s, "
               "both > 0 but the latency >= 0)",
               kAutoLinkEnv, env);
  out = {alpha_us * 1e-6, 1e-9 / gbps};
  return true;
}

}  // namespace dtk::compress
