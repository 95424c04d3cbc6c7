// FSDP's static schedule as pure functions of a bucket plan (parallel/fsdp_schedule.h):
// make_schedule's operations per hook, count's buffer peaks, predict's simulation. The runtime
// that executes the schedule is tested end to end in tests/mpi/test_parallel.cpp and fsdp_train.
#include <gtest/gtest.h>

#include <map>
#include <numeric>
#include <vector>

#include "dtk/parallel/fsdp.h"
#include "dtk/parallel/fsdp_schedule.h"

namespace dtk::parallel {
namespace {

using namespace fsdp;

// One bucket per block, one parameter per block.
BucketPlan per_block(int B) {
  BucketPlan p;
  for (int b = 0; b < B; ++b) p.push_back({static_cast<size_t>(b), static_cast<size_t>(b) + 1, b, b});
  return p;
}

FsdpConfig config(bool overlap, int prefetch, Reshard reshard = Reshard::default_) {
  FsdpConfig c;
  c.overlap = overlap;
  c.prefetch = prefetch;
  c.reshard_after_forward = reshard;
  return c;
}

// How many operations of each kind each bucket gets over a pass.
std::map<OpKind, std::vector<int>> tally(const Schedule& s, int B, size_t K) {
  std::map<OpKind, std::vector<int>> n;
  for (OpKind k : {OpKind::gather, OpKind::wait_gather, OpKind::release, OpKind::open_grad, OpKind::reduce,
                   OpKind::wait_reduce})
    n[k].assign(K, 0);
  for (const auto& hook : s.at)
    for (int b = 0; b < B; ++b)
      for (const Op& op : hook[static_cast<size_t>(b)]) ++n[op.kind][op.bucket];
  return n;
}

TEST(FsdpSchedule, EveryBucketGatheredReducedAndReleasedAsItsReshardSays) {
  const int B = 5;
  const BucketPlan plan = per_block(B);
  for (Reshard r : {Reshard::default_, Reshard::always, Reshard::never})
    for (bool overlap : {false, true}) {
      const FsdpConfig cfg = config(overlap, 1, r);
      auto n = tally(make_schedule(plan, B, cfg, true), B, plan.size());
      for (size_t k = 0; k < plan.size(); ++k) {
        const int gathers = reshards(cfg, k, plan.size()) ? 2 : 1;  // again for backward when freed
        EXPECT_EQ(n[OpKind::gather][k], gathers) << k;
        EXPECT_EQ(n[OpKind::wait_gather][k], gathers) << k;
        EXPECT_EQ(n[OpKind::release][k], gathers) << k;
        EXPECT_EQ(n[OpKind::open_grad][k], 1) << k;
        EXPECT_EQ(n[OpKind::reduce][k], 1) << k;
        EXPECT_EQ(n[OpKind::wait_reduce][k], 1) << k;
      }
      // Evaluation: each bucket once, released after its forward, nothing reduced.
      n = tally(make_schedule(plan, B, cfg, false), B, plan.size());
      for (size_t k = 0; k < plan.size(); ++k) {
        EXPECT_EQ(n[OpKind::gather][k], 1);
        EXPECT_EQ(n[OpKind::release][k], 1);
        EXPECT_EQ(n[OpKind::reduce][k], 0);
      }
    }
  // The default reshards every bucket but the last (norm + output, the first needed in backward).
  const FsdpConfig d = config(true, 1);
  EXPECT_TRUE(reshards(d, 0, 5));
  EXPECT_FALSE(reshards(d, 4, 5));
}

TEST(FsdpSchedule, CountsBoundTheBuffersInFlight) {
  const int B = 6;
  const BucketPlan plan = per_block(B);
  // No overlap: one collective at a time, each waited as soon as issued.
  Counts c = count(make_schedule(plan, B, config(false, 1), true), B, true);
  EXPECT_EQ(c.wires, 1u);
  EXPECT_EQ(c.reducing, 1u);
  EXPECT_EQ(c.grads, 1u);
  // Overlap with prefetch P: the next P buckets travel while a block computes (its own bucket's
  // gather is waited before they are issued).
  for (int P : {1, 2, 3}) {
    c = count(make_schedule(plan, B, config(true, P), true), B, true);
    EXPECT_EQ(c.wires, static_cast<size_t>(P)) << P;
    EXPECT_EQ(c.reducing, 2u) << P;  // bucket k's reduce-scatter waited after bucket k-1's is issued
  }
  // Reshard never (ZeRO-2): every bucket's values stay gathered from forward to backward.
  c = count(make_schedule(plan, B, config(false, 0, Reshard::never), true), B, true);
  EXPECT_GE(c.values, static_cast<size_t>(B));
  // Evaluation holds fewer buffers than training.
  const Counts e = count(make_schedule(plan, B, config(true, 1), false), B, false);
  EXPECT_LE(e.values, count(make_schedule(plan, B, config(true, 1), true), B, true).values);
  EXPECT_EQ(e.reducing, 0u);
}

TEST(FsdpSchedule, BucketsOfSeveralBlocksAndOfPartsOfOne) {
  // Bucket 0: blocks 0-1 (params 0-1); buckets 1 and 2: block 2's two parameters; bucket 3: block 3.
  const BucketPlan plan = {{0, 2, 0, 1}, {2, 3, 2, 2}, {3, 4, 2, 2}, {4, 5, 3, 3}};
  const int B = 4;
  const Schedule s = make_schedule(plan, B, config(true, 1), true);
  // Block 1 needs no gather of its own: bucket 0, gathered at block 0, holds it.
  for (const Op& op : s.at[kBeforeForward][1]) EXPECT_NE(op.kind, OpKind::gather) << op.bucket;
  // Block 2's forward waits for both of its buckets.
  int waited = 0;
  for (const Op& op : s.at[kBeforeForward][2]) waited += op.kind == OpKind::wait_gather;
  EXPECT_EQ(waited, 2);
  // Bucket 0's gradients are reduce-scattered once block 0's backward is done, not at block 1.
  for (const Op& op : s.at[kAfterBackward][1]) EXPECT_NE(op.kind, OpKind::reduce);
  bool reduced = false;
  for (const Op& op : s.at[kAfterBackward][0]) reduced |= op.kind == OpKind::reduce && op.bucket == 0;
  EXPECT_TRUE(reduced);
  EXPECT_NO_THROW(count(s, B, true));
}

TEST(FsdpSchedule, PredictionOverlapsWhatTheChannelAllows) {
  const int B = 4;
  const BucketPlan plan = per_block(B);
  WireBytes bytes{std::vector<double>(B, 1e6), std::vector<double>(B, 2e6)};
  Costs costs;
  costs.all_gather = {1e-4, 1e-9};      // 0.1 ms + 1 ms per MB
  costs.reduce_scatter = {1e-4, 1e-9};  // 0.1 ms + 2 ms for 2 MB
  costs.forward_s.assign(B, 2e-3);
  costs.backward_s.assign(B, 4e-3);
  const double compute = 4 * 2e-3 + 4 * 4e-3;
  const Prediction serial = predict(plan, bytes, costs, config(false, 1), B);
  const Prediction overlapped = predict(plan, bytes, costs, config(true, 1), B);
  EXPECT_NEAR(serial.step_s, compute + serial.exposed_s, 1e-12);
  EXPECT_NEAR(overlapped.step_s, compute + overlapped.exposed_s, 1e-12);
  // Without overlap every collective is exposed: 7 gathers (one bucket kept) and 4 reduces.
  EXPECT_NEAR(serial.exposed_s, 7 * 1.1e-3 + 4 * 2.1e-3, 1e-9);
  // With overlap the first gather and the last reduce-scatter cannot hide; the rest does here.
  EXPECT_LT(overlapped.exposed_s, serial.exposed_s);
  EXPECT_GE(overlapped.exposed_s, 1.1e-3 + 2.1e-3 - 1e-12);
  // Free collectives: nothing exposed, the step is the compute.
  Costs free = costs;
  free.all_gather = free.reduce_scatter = {};
  EXPECT_EQ(predict(plan, bytes, free, config(true, 1), B).exposed_s, 0.0);
}

}  // namespace
}  // namespace dtk::parallel
