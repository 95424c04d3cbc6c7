// dtk::compress auto — the compressor that decides for itself, bucket by bucket, whether
// PowerSGD pays and at what rank (--compressor auto; docs/DESIGN.md, "compress: auto").
//
// It owns one sub-compressor per bucket (none, or PowerSGD over that bucket's parameters, made by
// make_compressor) and forwards the bucket protocol to them: begin() begins them all, bucket k
// ready is its sub-compressor's bucket_ready(0), finish() finishes them in order. Its steps
// before start_iter are plain; meanwhile it measures. At step start_iter, then every
// auto_interval steps, it decides:
//  - Accordion (Agarwal et al., MLSys 2021): each bucket's gradient norm before compression (of
//    W grad_r, the rank's estimate of the mean gradient: the aggregate's own norm would move
//    with the rank it was compressed at), averaged over the interval and taken at its largest
//    over ranks, is compared with the previous interval's; a relative change of at least
//    accordion_eta marks a critical regime (the first interval is one), where PowerSGD runs at
//    the high rank of auto_ranks, else at the low one.
//  - The cost model (predict_step below) chooses, per bucket, none or PowerSGD at Accordion's
//    rank, whichever makes the predicted step shorter (a change needs kSwitchMargin of gain):
//    from the alpha-beta model of the all-reduce (timed all-reduces at the first decision and
//    every auto_refresh steps: the latency of 4 KiB, the bandwidth fitted on 512 KiB to 2 MiB),
//    the measured compute of compressing
//    each bucket at each rank (timed on the bucket's shapes, when the link is), and the time at which
//    backward makes each bucket ready (the last step's, compression excluded). Compression's
//    compute is not hidden (on the CPU it takes the cores backward runs on; on a GPU, its
//    stream); a collective hides behind the backward that follows its start.
//  - Measured, not predicted, once it can be: the time aggregation adds to backward (compute and
//    exposed communication) is averaged over each interval; once an interval under none and one
//    under compression have been measured since the link was, compression stays only where it
//    measured faster by kSwitchMargin of the step (a shaped link defeated the model: netlab's
//    token bucket passes a 312 KB all-reduce in 5 ms where its rate predicts 26). With
//    DTK_AUTO_LINK the model alone decides (that link is not the one measured).
// Every input is the maximum over ranks, so every rank decides alike. A bucket whose rank
// changes gets a new PowerSGD that carries the old one's error buffers and the common columns
// of Q; a matrix that leaves compression (none, or no longer compressed at the new rank) adds
// its error buffer (divided by the world size: the sum over ranks is the mean error) to the next
// step's gradient contribution, so error feedback loses nothing.
// The state (checkpoints): "auto/choice" (the rank per bucket, 0 none), "auto/accordion" (per
// rank and bucket: the previous interval's mean norm, the current sums, the regime), "auto/costs" (the
// last decision's inputs and measurements), "auto/overhead" (per rank: this interval's sums), and per compressible matrix "error/<param>" (per rank, zero where
// the bucket runs none) and "q/<param>" (its Q at the high rank's width): a resume continues
// the choices, the Accordion history and the sub-compressors exactly.
// With a Topology (fsdp-train's HSDP, compressor.h): the buckets are the topology's, and each
// sub-compressor gets the topology restricted to its bucket (the shard group, its parameters'
// rows), so a compressed bucket is PowerSGD over whole matrices; the link timed is `comm`, the
// replica hop; every input is the maximum over both communicators (the sub-compressors'
// collectives run in both); Accordion's norm is the whole tensors' (squares summed over the shard
// group each step), so the choices do not depend on the shard count; bytes and compute are this
// rank's on its shard shapes, the compute timed with the shard group's own collectives (P's
// all-gather, Q's sum: synchronous, so compute-side). State: the errors by rows
// (Placement::sharded), "auto/accordion" and "auto/overhead" replicated: before_save() (one shard
// group writes) makes them their maximum over every rank, in place.
// Testing aid: DTK_AUTO_LINK="ALPHA_US,GBYTES_PER_S" replaces the measured link model (a slow
// link in a test without one); the plan says "source": "DTK_AUTO_LINK".
#pragma once
#include <cstdint>
#include <vector>

#include "dtk/comm/comm.h"
#include "dtk/comm/cost.h"

namespace dtk::compress {

inline constexpr const char* kAutoLinkEnv = "DTK_AUTO_LINK";
// DTK_AUTO_LINK's link model into `out` when the variable is set and not empty (UsageError naming
// it when malformed); false when unset. psgd-train checks it at start.
bool auto_link_from_env(comm::CostModel& out);
// The link of comm's ranks, timed: all-reduces (the median of three after a warm-up, the slowest
// rank's), the bandwidth fitted (comm::fit_cost) on 512 KiB, 1 and 2 MiB, the latency the time of
// 4 KiB. Not one fit over all sizes: a shaped link lets a burst through at full speed (netlab's
// token bucket: 256 KB), and a fit from 4 KiB to 4 MiB on a 100 Mbit/s link came out at 2.6 GB/s,
// its small sizes weighing as much as its large ones. Collective over comm (auto's, and DiLoCo's
// --sync-every auto).
comm::CostModel measure_link(comm::Communicator& comm, Device device);
// A change of a bucket's choice must shorten the predicted step by this fraction.
inline constexpr double kSwitchMargin = 0.02;

// PowerSGD at one rank over one bucket: what it sends and what it computes.
struct RankCost {
  int rank = 0;
  double p_bytes = 0;  // P and the uncompressed grads (the first collective)
  double q_bytes = 0;  // Q (the second)
  double send_s = 0;   // compute at bucket_ready: M = W grad + error, P = M Q
  double finish_s = 0; // compute in finish(): orthonormalise, Q_r = M^T P, error, P Q^T
};

struct BucketCost {
  double ready_s = 0;     // from begin() to the bucket's grads final, compression excluded
  double none_bytes = 0;  // the plain all-reduce
  std::vector<RankCost> ranks;  // one per candidate rank (Config::auto_ranks' order)
};

struct StepCosts {
  comm::CostModel link;
  double backward_s = 0;  // begin() to finish(), compression excluded
  std::vector<BucketCost> buckets;
};

// The predicted time from begin() to the end of finish() for one choice per bucket (0: none, else
// a rank of its RankCost list). Backward runs from 0 and is delayed by compression's compute;
// collectives run one at a time on the link, in issue order: a bucket's plain all-reduce or P at
// its ready time (after send_s), and in finish(), bucket by bucket, after its P has arrived,
// finish_s and its Q.
double predict_step(const StepCosts& c, const std::vector<int>& choice);

// Per bucket, none or want[k] (a rank; 0: none only), starting from current (where a bucket
// compressing at another rank counts as at want[k]): coordinate descent, each change taken only
// when it shortens the predicted step by kSwitchMargin.
std::vector<int> choose(const StepCosts& c, const std::vector<int>& want, const std::vector<int>& current);

// Accordion's detector for one bucket.
struct Accordion {
  double prev = 0;      // the previous interval's mean gradient norm (0: none yet)
  double sum = 0;       // this interval's sum of norms
  double count = 0;     // and its steps
  bool critical = true; // the regime decided at the last interval's end (the first is critical)
  void add(double norm) {
    sum += norm;
    count += 1;
  }
  // Ends the interval: critical when |prev - mean| / prev >= eta, or when there is no prev.
  void end_interval(double eta);
};
bool accordion_critical(double prev, double cur, double eta);

}  // namespace dtk::compress
