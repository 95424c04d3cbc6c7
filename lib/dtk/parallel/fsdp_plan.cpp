// FSDP's bucket plans (fsdp.h): fixed forms, plan files, --buckets, and the automatic planner.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>

#include "dtk/core/error.h"
#include "dtk/parallel/fsdp.h"
#include "dtk/parallel/fsdp_schedule.h"

namespace dtk::parallel {

BucketPlan plan_per_param(const nn::Model& m) {
  BucketPlan p;
  for (size_t i = 0; i < m.params().size(); ++i) p.push_back({i, i + 1, m.params()[i].block, m.params()[i].block});
  return p;
}

BucketPlan plan_blocks(const nn::Model& m, int n) {
  if (n < 1) fail_usage("--buckets: blocks per bucket must be positive, got {}", n);
  BucketPlan p;
  for (int b = 0; b < m.num_blocks(); b += n) {
    const int last = std::min(m.num_blocks() - 1, b + n - 1);
    p.push_back({static_cast<size_t>(m.block_params(b).front()), static_cast<size_t>(m.block_params(last).back()) + 1,
                 b, last});
  }
  return p;
}

namespace {
void check_plan(const BucketPlan& plan, const nn::Model& m) {
  const auto& ps = m.params();
  size_t next = 0;
  for (size_t k = 0; k < plan.size(); ++k) {
    const Bucket& b = plan[k];
    const std::string where = fmt::format("bucket plan: bucket {}", k);
    if (b.first != next || b.end <= b.first || b.end > ps.size())
      fail_usage("{} holds parameters [{}, {}); the buckets must cover the {} parameters in order, from {}", where,
                 b.first, b.end, ps.size(), next);
    const int fb = ps[b.first].block, lb = ps[b.end - 1].block;
    const bool whole = static_cast<size_t>(m.block_params(fb).front()) == b.first &&
                       static_cast<size_t>(m.block_params(lb).back()) + 1 == b.end;
    if (fb != lb && !whole)
      fail_usage(where + " splits a block: a bucket is part of one block or whole blocks");
    next = b.end;
  }
  if (next != ps.size()) fail_usage("bucket plan: the buckets cover {} of the {} parameters", next, ps.size());
}

Bucket bucket_of_params(const nn::Model& m, size_t first, size_t end) {
  if (end <= first || end > m.params().size())
    fail_usage("bucket plan: bad parameter range [{}, {})", first, end);
  return {first, end, m.params()[first].block, m.params()[end - 1].block};
}
}  // namespace

BucketPlan plan_from_json(const nlohmann::json& j, const nn::Model& m) {
  if (!j.is_object() || !j.contains("buckets") || !j["buckets"].is_array() || j["buckets"].empty())
    fail_usage("bucket plan: expected {\"buckets\": [...]}, as fsdp-train --print-plan writes");
  BucketPlan p;
  for (const auto& e : j["buckets"]) {
    auto pair = [&](const char* key) -> std::pair<int64_t, int64_t> {
      const auto& v = e[key];
      if (!v.is_array() || v.size() != 2 || !v[0].is_number_integer() || !v[1].is_number_integer())
        fail_usage(std::string("bucket plan: \"") + key + "\" must be two integers, got " + v.dump());
      return {v[0].get<int64_t>(), v[1].get<int64_t>()};
    };
    if (!e.is_object()) fail_usage("bucket plan: a bucket must be an object, got " + e.dump());
    if (e.contains("params")) {
      const auto [a, z] = pair("params");
      if (a < 0 || z < 0) fail_usage("bucket plan: negative parameter index in " + e.dump());
      p.push_back(bucket_of_params(m, static_cast<size_t>(a), static_cast<size_t>(z)));
    } else if (e.contains("blocks")) {
      const auto [a, z] = pair("blocks");
      if (a < 0 || z < a || z >= m.num_blocks())
        fail_usage("bucket plan: blocks {} are not a range of the model's {} blocks", e["blocks"].dump(), m.num_blocks());
      p.push_back(bucket_of_params(m, static_cast<size_t>(m.block_params(static_cast<int>(a)).front()),
                                   static_cast<size_t>(m.block_params(static_cast<int>(z)).back()) + 1));
    } else {
      fail_usage("bucket plan: a bucket needs \"blocks\" or \"params\", got " + e.dump());
    }
  }
  check_plan(p, m);
  return p;
}

namespace {
// --buckets N: a number of blocks per bucket.
bool is_count(const std::string& spec) {
  return !spec.empty() && spec.find_first_not_of("0123456789") == std::string::npos;
}
}  // namespace

BucketPlan plan_from_spec(const nn::Model& m, const std::string& spec) {
  if (spec == "param") return plan_per_param(m);
  if (spec == "block" || spec == "auto") return plan_blocks(m, 1);
  if (is_count(spec)) return plan_blocks(m, std::stoi(spec));
  std::ifstream f(spec);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    fail_usage("--buckets " + spec + ": not JSON (" + e.what() + ")");
  }
  return plan_from_json(j, m);
}

void validate(const FsdpConfig& cfg, int world_size) {
  if (cfg.replicate < 1 || world_size % cfg.replicate != 0)
    fail_usage("--replicate {} does not divide the {} ranks", cfg.replicate, world_size);
  if (cfg.prefetch < 0) fail_usage("--prefetch must be >= 0, got {}", cfg.prefetch);
  const std::string& b = cfg.buckets;
  if (is_count(b) && std::stoll(b) < 1) fail_usage("--buckets " + b + ": blocks per bucket must be positive");
  if (b != "param" && b != "block" && b != "auto" && !is_count(b) && !std::ifstream(b))
    fail_usage("--buckets " + b + ": expected param, block, a number of blocks, auto or a readable plan file");
  if (cfg.bucket_memory > 0 && b != "auto") fail_usage("--bucket-memory applies to --buckets auto");
}

BucketPlan plan_auto(const nn::Model& m, const WireBytes& bytes, const Costs& costs, const FsdpConfig& cfg) {
  auto cost = [&](const BucketPlan& p) { return predict(p, bytes, costs, cfg, m.num_blocks()).step_s; };
  auto gathered = [&](const Bucket& b) { return fsdp::bucket_sum(bytes.gather, b); };
  BucketPlan plan = plan_blocks(m, 1);
  // The memory cap: --bucket-memory, or twice the largest block's gathered bytes, so that auto
  // at most doubles the gather arena of one bucket per block. (Uncapped, the greedy on a fast
  // link grew the last, never-resharded bucket over most of the model: ZeRO-2's memory, and a
  // gather that the calibration, timed on idle cores, predicted hidden but was not.)
  double cap = cfg.bucket_memory;
  if (cap <= 0)
    for (const Bucket& b : plan) cap = std::max(cap, 2 * gathered(b));
  // Greedy over the block boundaries: merge block b into the bucket before it while the step
  // gets no slower (latency saved against overlap lost) and the bucket fits the memory cap.
  double best = cost(plan);
  for (size_t k = 0; k + 1 < plan.size();) {
    BucketPlan merged = plan;
    merged[k].end = merged[k + 1].end;
    merged[k].last_block = merged[k + 1].last_block;
    merged.erase(merged.begin() + static_cast<std::ptrdiff_t>(k) + 1);
    const double t = gathered(merged[k]) <= cap ? cost(merged) : INFINITY;
    if (t <= best) plan = std::move(merged), best = t;
    else ++k;
  }
  return plan;
}

}  // namespace dtk::parallel
