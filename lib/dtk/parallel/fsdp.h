// dtk::parallel — fully sharded data parallelism after SimpleFSDP (Zhang et al., 2024): the
// sharded placement of parallelism.h.
//
// Storage. Every rank of a shard group keeps, in f32, rows [r * ceil(rows / S), ...) of dim 0 of
// every parameter (the last ranks' shards padded with zero rows to the same length, as FSDP2
// pads): the master weights, their gradients and the optimizer's state live only there. Shards
// are laid out in the model's parameter order in one flat buffer, so any bucket's shards are one
// contiguous chunk: the all-gather's send buffer (f32) or the source of one cast (bf16), and the
// destination of the reduce-scatter's result. The model has external storage: a parameter's
// value and gradient exist only while its bucket is gathered (Param::value and grad point into
// arena buffers then, and are undefined otherwise).
//
// Buckets. Parameters are gathered and reduce-scattered in buckets: contiguous runs of
// parameters, each inside one block or made of whole blocks (BucketPlan). A gathered bucket is
// rank-major on the wire ([rank 0: p1 | p2 ...][rank 1: p1 | p2 ...]); copy-out casts it to
// param-major f32 for compute. Gradients go the other way: copy-in from param-major f32 to
// rank-major in the reduce dtype, one reduce-scatter, and the result added to the shard's
// gradient (every micro-batch: gradient accumulation happens on the shards; with
// keep_unsharded_grad the whole gradients accumulate instead, reduce-scattered once a step).
//
// The schedule is static, as SimpleFSDP's compiler passes make it: at start-up the plan is
// turned into a list of operations attached to the block hooks (gather, wait, release, open the
// gradient, reduce, wait), for a training micro-batch and for an evaluation forward. Forward:
// once the current bucket's all-gather is waited (and copied out), those of the next
// `prefetch` buckets are issued, so they travel while it computes; backward: the same in
// reverse, and bucket i's reduce-scatter is waited only after bucket i-1's has been issued. With overlap off every collective is waited as soon as it is
// issued (the baseline). Reshard after forward frees a bucket's gathered parameters after its
// forward and gathers them again in backward (ZeRO-3); kept, they stay until their backward
// (ZeRO-2); by default every bucket but the last (norm + output, the first needed in backward)
// is resharded. The same list drives the dry run that sizes the arenas (every buffer is
// allocated at start-up and reused: nothing is allocated per step; a gathered bucket's f32
// buffer, once its backward is done, carries its reduce-scatter's send) and the simulation that
// predicts exposed communication from measured costs (plan_auto, print_plan).
//
// HSDP: with replicate R, the world's ranks form R groups of S = N / R consecutive ranks; each
// group shards the model, and after the last micro-batch's reduce-scatter each bucket's shard
// gradient is all-reduced across the groups (the ranks with the same shard rank). With a
// compressor (fsdp-train --compressor) that all-reduce, the slow hop, is compressed instead,
// bucket by bucket as the same reduce-scatters complete (compress::Topology: the compressor's
// buckets are the plan's, last first; the shard group is its shard communicator, so PowerSGD
// compresses whole matrices and gives psgd-train's result on any R x S); finish() completes it.
// Its error buffers live on the shards; checkpoints save their mean over the replicas, by rows.
// --compressor auto decides per bucket of the plan (compress/auto.h): its metrics add
// compress_ranks, --print-plan its first decisions, and a save calls its before_save().
#pragma once
#include <optional>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dtk/comm/comm.h"
#include "dtk/comm/cost.h"
#include "dtk/compress/compressor.h"
#include "dtk/core/enums.h"
#include "dtk/nn/model.h"
#include "dtk/parallel/parallelism.h"

namespace dtk::parallel {

// Parameters [first, end) of the model, in blocks [first_block, last_block].
struct Bucket {
  size_t first = 0, end = 0;
  int first_block = 0, last_block = 0;
};
using BucketPlan = std::vector<Bucket>;

// One bucket per parameter (no bucketing), or groups of n consecutive blocks (n = 1: one per block).
BucketPlan plan_per_param(const nn::Model& m);
BucketPlan plan_blocks(const nn::Model& m, int blocks_per_bucket);
// A plan as plan_json writes it: {"buckets": [{"blocks": [first, last]} or {"params": [first,
// end]}, ...]}; UsageError naming the problem when it does not cover the model's parameters in
// order, each bucket inside one block or of whole blocks.
BucketPlan plan_from_json(const nlohmann::json& j, const nn::Model& m);
// --buckets as a plan: param, block (and auto, which starts as block), N blocks per bucket, or
// a plan file (plan_from_json).
BucketPlan plan_from_spec(const nn::Model& m, const std::string& buckets);

// What the planner and the simulation know: collective costs (bytes: the whole gathered bucket
// on the wire, and the whole reduce-scatter input) and each block's forward and backward time.
struct Costs {
  comm::CostModel all_gather, reduce_scatter;
  std::vector<double> forward_s, backward_s;
};

// Reshard after forward: every bucket but the last (default), every bucket, none.
enum class Reshard { default_, always, never };
DTK_ENUM_NAMES(Reshard, {Reshard::default_, "default"}, {Reshard::always, "always"}, {Reshard::never, "never"})

struct FsdpConfig {
  DType param_dtype = DType::bf16;   // all-gather dtype (compute upcasts to f32 after it)
  DType reduce_dtype = DType::f32;   // reduce-scatter dtype
  Reshard reshard_after_forward = Reshard::default_;
  int prefetch = 1;                  // buckets gathered ahead of the one computing
  bool overlap = true;               // false: every collective waited as soon as it is issued
  int replicate = 1;                 // HSDP groups
  std::string buckets = "block";     // param | block | N | auto | a plan file (JSON)
  double bucket_memory = 0;          // auto: the largest gathered bucket in bytes (0: twice the largest block's)
  bool print_plan = false;           // print the plan (JSON) once it is final, then stop
  // Keep every bucket's whole f32 gradient across the step's micro-batches and reduce-scatter it
  // once, after the last (DDP's gradient memory on every rank); off: each micro-batch's
  // gradients are reduce-scattered and added to the shard gradient.
  bool keep_unsharded_grad = false;
};
// As saved in checkpoints (the run's options; bucket_memory and print_plan are not kept).
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(FsdpConfig, param_dtype, reduce_dtype, reshard_after_forward, prefetch, buckets,
                                   replicate, overlap, keep_unsharded_grad)
// UsageError naming the option: --replicate that does not divide the ranks, --prefetch < 0,
// --buckets none of its forms (a plan file is read when the model is known), --bucket-memory
// without auto.
void validate(const FsdpConfig& cfg, int world_size);
// A compressor (of HSDP's all-reduce across the replica groups) needs replicate > 1, and auto
// (which decides per bucket of the plan) a plan that stays: not --buckets auto. UsageError naming
// the options otherwise.
void validate_compressor(const compress::Config& compressor, int replicate, const std::string& buckets);

class Fsdp final : public Parallelism {
 public:
  // model: external storage. world, host: the job's device and host world communicators.
  // compressor: HSDP's all-reduce across the replica groups compressed (cfg.replicate > 1).
  // local: per parameter, 1 where the optimizer aggregates the gradient across the replica
  // groups itself (Dion's factors): HSDP's all-reduce and clipping leave it out.
  Fsdp(nn::Model& model, comm::Communicator& world, comm::Communicator& host, FsdpConfig cfg,
       std::optional<compress::Config> compressor = std::nullopt, std::vector<char> local = {});
  ~Fsdp() override;

  std::vector<nn::Param>& params() override { return params_; }
  comm::Communicator& optimizer_comm() override;
  comm::Communicator* replica_comm() override;
  bool sharded() const override { return true; }
  const Rows* rows(size_t i) const override { return &rows_.at(i); }
  std::vector<PlacedTensor> state() override;  // the parameters' shards and the model's buffers
  // The compressor's ("compress/...": Q and step replicated, the error buffers by rows); saved:
  // the error buffers' mean over the replicas (PowerSGD, randomk: in place, as every later step
  // depends on them only through it; topk, signum: a copy, each replica keeps its own).
  std::vector<PlacedTensor> sync_state() override;
  std::vector<PlacedTensor> saved_sync_state() override;
  void init(uint64_t seed) override;
  void loaded() override {}
  void zero_grad() override;
  void begin(int64_t step) override;
  void finish() override;
  void clip_grad_norm(double max_norm, Tensor& norm) override;
  void collect_timings() override;
  // all_gather_bytes, reduce_scatter_bytes, all_reduce_bytes (HSDP: the replica hop's bytes
  // sent, compressed or not), exposed_comm_ms, arena_bytes, shard_bytes; comm_bytes = their sum;
  // with a compressor also comm_bytes_uncompressed and compression_ratio (of the replica hop).
  void metrics(nlohmann::ordered_json& m) const override;
  comm::Communicator* checkpoint_comm() override;
  // Settles the automatic bucket plan once the first steps are timed (cfg.buckets auto, or
  // print_plan, which reports the measured costs).
  void before_step(int64_t step) override;

  void before_forward(int block, nn::Pass pass) override;
  void after_forward(int block, nn::Pass pass) override;
  void before_backward(int block) override;
  void after_backward(int block) override;

  const BucketPlan& bucket_plan() const { return plan_; }
  // The component (core/component.h): the bucket plan with its buckets' sizes and the predicted
  // exposed communication per step (fsdp_schedule.h, plan_report), final once measured and, with
  // --compressor auto, once its first decisions (under "compressor") are made. A resume's note on
  // the synchronisation state is the compressor's.
  std::string_view component_name() const override { return "fsdp"; }
  nlohmann::json plan() const override;
  bool plan_final() const override;
  std::string restore_note(Restored outcome, const RestoreSource& from) const override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::vector<nn::Param> params_;
  std::vector<Rows> rows_;
  BucketPlan plan_;
};

// Bytes on the wire per parameter, padded as the shards are: gathered (param dtype) and
// reduce-scatter input (reduce dtype).
struct WireBytes {
  std::vector<double> gather, reduce;
};

// The schedule's prediction for one training micro-batch: exposed communication (time compute
// waits on a collective) and the step time (compute + exposed), in seconds.
struct Prediction {
  double exposed_s = 0, step_s = 0;
};
Prediction predict(const BucketPlan& plan, const WireBytes& bytes, const Costs& costs, const FsdpConfig& cfg,
                   int num_blocks);
// SimpleFSDP's greedy automatic bucketing: walking the blocks in order, a block joins the
// current bucket while the predicted step time does not grow and the merged bucket's gathered
// bytes stay within cfg.bucket_memory (0: twice the largest block's).
BucketPlan plan_auto(const nn::Model& m, const WireBytes& bytes, const Costs& costs, const FsdpConfig& cfg);

}  // namespace dtk::parallel
