// The FSDP schedule (fsdp_schedule.h): made from a plan, counted, and simulated (predict).
#include "dtk/parallel/fsdp_schedule.h"

#include <algorithm>

#include "dtk/core/error.h"

namespace dtk::parallel {
namespace fsdp {

bool reshards(const FsdpConfig& cfg, size_t k, size_t K) {
  switch (cfg.reshard_after_forward) {
    case Reshard::always: return true;
    case Reshard::never: return false;
    case Reshard::default_: return k + 1 < K;
  }
  return true;
}

Schedule make_schedule(const BucketPlan& plan, int B, const FsdpConfig& cfg, bool train) {
  const size_t K = plan.size(), P = cfg.overlap ? static_cast<size_t>(cfg.prefetch) : 0;
  std::vector<size_t> kf(static_cast<size_t>(B)), kl(static_cast<size_t>(B));  // buckets touching each block
  for (size_t k = K; k-- > 0;)
    for (int b = plan[k].first_block; b <= plan[k].last_block; ++b) kf[static_cast<size_t>(b)] = k;
  for (size_t k = 0; k < K; ++k)
    for (int b = plan[k].first_block; b <= plan[k].last_block; ++b) kl[static_cast<size_t>(b)] = k;
  Schedule s;
  for (auto& v : s.at) v.resize(static_cast<size_t>(B));
  std::vector<bool> live(K, false), waited(K, false);
  auto gather = [&](std::vector<Op>& ops, size_t k) {
    if (live[k]) return;
    ops.push_back({OpKind::gather, k});
    live[k] = true;
    if (!cfg.overlap) {
      ops.push_back({OpKind::wait_gather, k});
      waited[k] = true;
    }
  };
  auto wait = [&](std::vector<Op>& ops, size_t k) {
    if (waited[k]) return;
    ops.push_back({OpKind::wait_gather, k});
    waited[k] = true;
  };
  auto release = [&](std::vector<Op>& ops, size_t k) {
    ops.push_back({OpKind::release, k});
    live[k] = waited[k] = false;
  };
  for (int b = 0; b < B; ++b) {
    const size_t ub = static_cast<size_t>(b);
    auto& before = s.at[kBeforeForward][ub];
    // The block's own buckets, then the next P: on one in-order channel a prefetch issued
    // before the wait would gain only the copy-out's time, and hold one more wire buffer.
    for (size_t k = kf[ub]; k <= kl[ub]; ++k) gather(before, k);
    for (size_t k = kf[ub]; k <= kl[ub]; ++k) wait(before, k);
    for (size_t k = kl[ub] + 1; k < K && k <= kl[ub] + P; ++k) gather(before, k);
    for (size_t k = kf[ub]; k <= kl[ub]; ++k)
      if (plan[k].last_block == b && (!train || reshards(cfg, k, K))) release(s.at[kAfterForward][ub], k);
  }
  if (!train) return s;
  std::vector<size_t> outstanding;  // reduce-scatters issued, not yet waited
  for (int b = B - 1; b >= 0; --b) {
    const size_t ub = static_cast<size_t>(b);
    auto& before = s.at[kBeforeBackward][ub];
    for (size_t k = kl[ub] + 1; k-- > kf[ub];) gather(before, k);
    for (size_t k = kl[ub] + 1; k-- > kf[ub];) wait(before, k);
    for (size_t k = kf[ub], n = 0; k-- > 0 && n < P; ++n) gather(before, k);
    for (size_t k = kl[ub] + 1; k-- > kf[ub];)
      if (plan[k].last_block == b) before.push_back({OpKind::open_grad, k});
    auto& after = s.at[kAfterBackward][ub];
    std::vector<size_t> issued;
    for (size_t k = kl[ub] + 1; k-- > kf[ub];)
      if (plan[k].first_block == b) {
        release(after, k);
        after.push_back({OpKind::reduce, k});
        issued.push_back(k);
      }
    // Overlap: the reduce-scatters issued at earlier blocks are waited now that these are out.
    if (cfg.overlap) {
      for (size_t k : outstanding) after.push_back({OpKind::wait_reduce, k});
      outstanding = issued;
    } else {
      for (size_t k : issued) after.push_back({OpKind::wait_reduce, k});
    }
    if (b == 0)
      for (size_t k : outstanding) after.push_back({OpKind::wait_reduce, k});
  }
  return s;
}

Counts count(const Schedule& s, int B, bool train) {
  Counts peak, now;
  auto run = [&](const std::vector<Op>& ops) {
    for (const Op& op : ops) {
      switch (op.kind) {
        case OpKind::gather: ++now.values, ++now.wires; break;
        case OpKind::wait_gather: --now.wires; break;
        case OpKind::release: --now.values; break;
        case OpKind::open_grad: ++now.grads; break;
        case OpKind::reduce: --now.grads, ++now.values, ++now.reducing; break;
        case OpKind::wait_reduce: --now.values, --now.reducing; break;
      }
      peak.values = std::max(peak.values, now.values);
      peak.wires = std::max(peak.wires, now.wires);
      peak.grads = std::max(peak.grads, now.grads);
      peak.reducing = std::max(peak.reducing, now.reducing);
    }
  };
  for (int b = 0; b < B; ++b) {
    run(s.at[kBeforeForward][static_cast<size_t>(b)]);
    run(s.at[kAfterForward][static_cast<size_t>(b)]);
  }
  if (train)
    for (int b = B - 1; b >= 0; --b) {
      run(s.at[kBeforeBackward][static_cast<size_t>(b)]);
      run(s.at[kAfterBackward][static_cast<size_t>(b)]);
    }
  if (now.values || now.wires || now.grads || now.reducing)
    fail("fsdp schedule: buffers left in use after a pass (a bug)");
  return peak;
}

}  // namespace fsdp

using namespace fsdp;

Prediction predict(const BucketPlan& plan, const WireBytes& bytes, const Costs& costs, const FsdpConfig& cfg, int B) {
  const Schedule s = make_schedule(plan, B, cfg, true);
  std::vector<double> gather_bytes, reduce_bytes;
  for (const Bucket& b : plan)
    gather_bytes.push_back(bucket_sum(bytes.gather, b)), reduce_bytes.push_back(bucket_sum(bytes.reduce, b));
  // One communication channel that runs collectives in issue order (the communication thread
  // or NCCL stream), and the compute timeline that waits on it.
  double now = 0, channel = 0, exposed = 0;
  std::vector<double> done(plan.size(), 0);
  auto run = [&](const std::vector<Op>& ops) {
    for (const Op& op : ops) {
      const size_t k = op.bucket;
      switch (op.kind) {
        case OpKind::gather:
          channel = std::max(channel, now) + costs.all_gather.seconds(gather_bytes[k]);
          done[k] = channel;
          break;
        case OpKind::reduce:
          channel = std::max(channel, now) + costs.reduce_scatter.seconds(reduce_bytes[k]);
          done[k] = channel;
          break;
        case OpKind::wait_gather:
        case OpKind::wait_reduce:
          if (done[k] > now) exposed += done[k] - now, now = done[k];
          break;
        default: break;
      }
    }
  };
  auto at = [](const std::vector<double>& v, int b) { return b < static_cast<int>(v.size()) ? v[static_cast<size_t>(b)] : 0.0; };
  for (int b = 0; b < B; ++b) {
    run(s.at[kBeforeForward][static_cast<size_t>(b)]);
    now += at(costs.forward_s, b);
    run(s.at[kAfterForward][static_cast<size_t>(b)]);
  }
  for (int b = B - 1; b >= 0; --b) {
    run(s.at[kBeforeBackward][static_cast<size_t>(b)]);
    now += at(costs.backward_s, b);
    run(s.at[kAfterBackward][static_cast<size_t>(b)]);
  }
  return {exposed, now};
}

}  // namespace dtk::parallel
