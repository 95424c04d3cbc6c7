// Internal to dtk::parallel's FSDP (and its unit tests): the static schedule that fsdp.h
// describes, as pure functions of a bucket plan. make_schedule turns a plan into the operations
// each block hook runs; count sizes the buffers from it; predict (fsdp.h) simulates it.
#pragma once
#include <cstddef>
#include <vector>

#include "dtk/parallel/fsdp.h"

namespace dtk::parallel::fsdp {

enum class OpKind { gather, wait_gather, release, open_grad, reduce, wait_reduce };
struct Op {
  OpKind kind;
  size_t bucket;
};
enum Hook { kBeforeForward, kAfterForward, kBeforeBackward, kAfterBackward, kHooks };

// The operations each hook runs, per block: a training micro-batch (forward and backward) or an
// evaluation forward.
struct Schedule {
  std::vector<std::vector<Op>> at[kHooks];
};

// Whether bucket k of K is freed after its forward (and gathered again for its backward).
bool reshards(const FsdpConfig& cfg, size_t k, size_t K);

// The operations of every hook of every block (B blocks) for a training micro-batch (train) or
// an evaluation forward.
Schedule make_schedule(const BucketPlan& plan, int B, const FsdpConfig& cfg, bool train);

// The most buffers of each kind in use at once over a schedule: f32 bucket buffers (a gathered
// bucket's values from its gather to its release, then a reduce-scatter's send from its issue to
// its wait), wire buffers (a gather in flight, until its copy-out), open gradients and
// reduce-scatters in flight (their results).
struct Counts {
  size_t values = 0, wires = 0, grads = 0, reducing = 0;
};
Counts count(const Schedule& s, int B, bool train);

// A bucket's total of a per-parameter quantity (wire bytes, shard elements).
template <typename T>
T bucket_sum(const std::vector<T>& per_param, const Bucket& b) {
  T n = 0;
  for (size_t i = b.first; i < b.end; ++i) n += per_param[i];
  return n;
}

// All-gather and reduce-scatter timed over sizes from lo_bytes to hi_bytes on the shard group
// and fitted (comm/cost.h), the slowest rank's time at each size (host: every rank of the job,
// for the barriers and the maximum). Zero costs on a shard group of one.
Costs calibrate(comm::Communicator& shard, comm::Communicator& host, const FsdpConfig& cfg, double lo_bytes,
                double hi_bytes, Device dev);
// The plan as --print-plan prints it: each bucket's blocks, parameters and bytes, the shard group
// and the options; the compressor's plan when not null; with measured costs (forward_s set), the
// predicted step and the costs themselves.
nlohmann::json plan_report(const BucketPlan& plan, const nn::Model& model, const WireBytes& wire, const Costs& costs,
                           const FsdpConfig& cfg, int shard_group, nlohmann::json compressor);

}  // namespace dtk::parallel::fsdp
