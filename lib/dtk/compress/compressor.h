// dtk::compress — gradient aggregation across data-parallel ranks, compressed or not:
// PowerSGD (Vogels et al., 2019) and the paper's baselines (none, topk, randomk, signum).
//
// Convention: on entry each rank's grads hold its *contribution*, scaled so that the sum over
// ranks is the global-batch mean gradient (a rank holding n of the global batch's B samples has
// scaled its mean-loss gradient by n / B). On return every rank's grads hold the same aggregated
// gradient: the exact sum for `none`, its compressed approximation otherwise. Compressors that
// keep per-rank state (error feedback) work with M_r = W * contribution_r + error_r, the rank's
// estimate of the mean gradient, so their state does not depend on how the batch was split.
//
// The kinds (M_r is per tensor; error_r is 0 without error feedback; n the tensor's elements):
//   none      one all-reduce (sum) of every grad, in place when the grads are one contiguous
//             run (nn::Model's flat buffer), else packed. Sent: n * 4 per tensor.
//   powersgd  each gradient viewed as [shape[0], rest] = [n, m] is compressed at rank
//             r = min(rank, n, m) when (n + m) r * min_compression_rate < n m; 1-D tensors and
//             the rest are summed exactly, in the same collective as P (f32) or beside it (bf16
//             P). Same-shape matrices are batched. Q starts from the shared Philox stream and is
//             checked to agree on every rank at the first call; a column of Q that becomes
//             exactly zero (a zero gradient) is redrawn, so warm start never stalls.
//             Sent: sum of r (n + m) * sizeof(comm_dtype) + uncompressed elements * 4.
//   topk      each rank sends its own k = ceil(ratio * n) largest-magnitude entries of M_r
//             (all-gather of values, f32, and indices, i32 while every tensor has < 2^31
//             elements); aggregate = sum over ranks of the scattered values / W; error_r = M_r
//             with the sent entries zeroed. Sent: sum of k * (4 + 4).
//   randomk   the same k = ceil(ratio * n) coordinates on every rank, drawn from the shared seed
//             and the step; one all-reduce of their values; aggregate = the mean of M_r there,
//             0 elsewhere (no n / k rescaling: error feedback carries the rest); error_r = M_r
//             with those entries zeroed. Sent: sum of k * 4.
//   signum    majority vote: each rank sends sign(M_r) (as sign + 1, one byte per element for
//             W <= 127, f16 up to 1024, f32 above) and ||M_r||_1 (f32); aggregate =
//             sign(sum_r sign(M_r)) * (sum_r ||M_r||_1 / W) / n (0 where the vote ties); with error
//             feedback (EF-signSGD) error_r = M_r - (||M_r||_1 / n) sign(M_r), the rank's own
//             compression error. Sent: sum of n * (1, 2 or 4) + 4.
//   auto      per bucket, none or powersgd at a rank it chooses and changes as the run goes
//             (compress/auto.h): from the measured cost of the collectives, of compressing and
//             of backward, and Accordion's detection of critical regimes. Sent: its buckets'.
//             With a Topology, per given bucket, PowerSGD over the bucket's rows (as below).
// Steps before start_iter are plain all-reduces (every kind), and error buffers are zero when
// compression begins.
// Resuming on another number of ranks (ckpt::load_state, Resize in core/placed.h): every new
// rank's error buffer is the mean of the old ranks'. For powersgd and randomk that continues the
// run exactly, as if it had had the new number of ranks throughout (up to f32 summation order):
// their aggregate depends on the buffers only through mean_r(M_r) = g + mean_r(error_r) (g the
// global-batch mean gradient, the same on any world size), and so does the next mean error
// (powersgd projection: mean_r(M_r - P^ P^T M_r) = (I - P^ P^T) mean M; full: mean M - P^ Q^T;
// randomk: mean M with the sent coordinates zeroed), so by induction every later step depends
// on the buffers only through their mean. Each rank's own buffer then differs from what an
// uninterrupted run's would hold, but no later result depends on that. topk and signum compress
// each rank's own M_r (its largest entries, its signs), so their aggregate depends on every
// rank's buffer and on the world size itself: the mean is the best carry-over, not an exact one,
// and a resume on another number of ranks says so in a warning. Every kind gives the same result however the grads are bucketed.
// Bytes::sent counts payload put into collectives, not the algorithm's internal traffic (a ring
// all-reduce moves about 2 (W - 1) / W of it each way).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "dtk/comm/comm.h"
#include "dtk/core/component.h"
#include "dtk/core/enums.h"
#include "dtk/core/json_config.h"
#include "dtk/core/placed.h"
#include "dtk/nn/model.h"

namespace dtk::compress {

enum class Kind { powersgd, none, topk, randomk, signum, auto_ };
DTK_ENUM_NAMES(Kind, {Kind::powersgd, "powersgd"}, {Kind::none, "none"}, {Kind::topk, "topk"},
               {Kind::randomk, "randomk"}, {Kind::signum, "signum"}, {Kind::auto_, "auto"})
// Error feedback's buffer: "full" M - P Q^T, "projection" M - P (P^T M) (see Config::error_mode).
enum class ErrorMode { projection, full };
DTK_ENUM_NAMES(ErrorMode, {ErrorMode::projection, "projection"}, {ErrorMode::full, "full"})
// P's orthogonalisation: auto (mgs for r <= 2, qr above), modified Gram-Schmidt, Householder QR.
enum class Orthogonalize { auto_, mgs, qr };
DTK_ENUM_NAMES(Orthogonalize, {Orthogonalize::auto_, "auto"}, {Orthogonalize::mgs, "mgs"}, {Orthogonalize::qr, "qr"})

struct Config {
  Kind kind = Kind::powersgd;
  int rank = 2;                    // powersgd: rank r of the approximation
  int64_t start_iter = 10;         // plain all-reduce for steps < start_iter
  double min_compression_rate = 2; // compress a matrix only when (n + m) r * rate < n m
  bool warm_start = true;          // reuse Q from the previous step
  bool error_feedback = true;
  // Error mode, "projection" by default. Both modes give every rank the same update, and in
  // exact arithmetic the same sequence of updates: P = mean_r(M_r) Q and Q = mean_r(M_r)^T P^
  // depend on the errors only through their mean over ranks, and that mean is the same in both,
  //   mean_r (M_r - P^ P^T M_r) = mean M - P^ (P^T mean M) = mean M - P^ Q^T.
  // They differ in what each rank keeps, which is the mean error plus the rank's deviation
  // from it. "full" (the paper's e_r = M_r - P^ Q^T) keeps the whole deviation M_r - mean M and
  // adds the next step's to it: the deviations cancel over ranks, so nothing ever removes them,
  // and each rank's buffer performs an undamped random walk that grows like sqrt(steps) (and with
  // W and the gradient noise). "projection" (e_r = M_r - P^ (P^T M_r), the part of the rank's own
  // M_r outside span(P^); ||e_r|| <= ||M_r||) drops the deviation inside span(P^) every step; as
  // that span follows the mean gradient and error, it sweeps the directions, and the deviation
  // settles at a steady level. In a simulation (W = 4, a 64 x 48 matrix, r = 2, per-rank noise)
  // the deviation grew from 1530 to 3350 between steps 1000 and 5000 in full mode and stayed at
  // 290 in projection mode, with updates equal up to rounding. Bounded buffers keep the checkpointed state
  // small, f32 sums well conditioned and bf16 P on the wire from being swamped by large per-rank
  // terms that cancel. The projection needs only the rank's local Q_r = M_r^T P^, so it is
  // computed while Q's all-reduce is in flight. In a world of one the two modes are identical.
  ErrorMode error_mode = ErrorMode::projection;
  Orthogonalize orthogonalize = Orthogonalize::auto_;
  DType comm_dtype = DType::f32;   // P and Q on the wire: f32 | bf16
  double ratio = 0.01;             // topk / randomk: fraction of coordinates kept per tensor
  uint64_t seed = 0;               // Q initialisation and randomk selection (shared by all ranks)
  // auto (compress/auto.h): the PowerSGD ranks it chooses between, {low, high} (Accordion: low in
  // regular regimes, high in critical ones); Accordion's threshold eta on the relative change of
  // a bucket's mean gradient norm between intervals, and the interval (steps) at which it
  // decides; the steps between measurements of the link (0: once).
  std::vector<int> auto_ranks = {1, 4};
  double accordion_eta = 0.5;
  int64_t auto_interval = 20;
  int64_t auto_refresh = 1000;
  void validate() const;  // UsageError naming the field: rank < 1, ratio not in (0, 1], ...
};
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(Config, kind, rank, start_iter, min_compression_rate, warm_start,
                                                error_feedback, error_mode, orthogonalize, comm_dtype, ratio, seed, auto_ranks,
                                                accordion_eta, auto_interval, auto_refresh)

struct Bytes {
  int64_t sent = 0;          // payload bytes this rank contributed to collectives in the last step
  int64_t uncompressed = 0;  // what plain all-reduce of the same gradients sends (f32)
};

// Parameters [first, last) of the list a compressor was built for.
struct ParamRange {
  size_t first = 0, last = 0;
};

// A component of the run (core/component.h): its restore note says what a resume on another
// number of ranks did to its error feedback; auto's plan is its decisions.
class Compressor : public Component {
 public:
  std::string_view component_name() const override { return "compressor"; }
  // One step's aggregation of params' grads over the communicator (see the convention above),
  // in three parts so that it overlaps backward: begin() before the backward that makes the
  // grads final; bucket_ready(k) once bucket k's grads are final, for k = 0, 1, ... in order and
  // at the same points on every rank (collectives are issued there); finish() after backward
  // (it starts the buckets not yet started); the grads hold the aggregate when it returns.
  // progress() may be called in between: it advances in-flight collectives, issuing none.
  // step is the training step (0-based), for start_iter and the shared random streams.
  // Plain steps (kind none, steps before start_iter) all-reduce bucket by bucket; PowerSGD
  // compresses bucket by bucket (P's all-reduce in flight while backward goes on, then Q's);
  // the other kinds compress every grad at once in finish().
  virtual void begin(std::vector<nn::Param>& params, int64_t step) = 0;
  virtual void bucket_ready(size_t k) = 0;
  virtual void progress() = 0;
  virtual void finish() = 0;
  // The three at once.
  void aggregate(std::vector<nn::Param>& params, int64_t step) {
    begin(params, step);
    finish();
  }
  // The buckets: ranges of the parameters from the last one backwards (the order in which
  // backward makes them final), each closed once its f32 grads reach the bucket size.
  virtual const std::vector<ParamRange>& buckets() const = 0;
  virtual Bytes last_bytes() const = 0;
  // The state for checkpoints ("q/<param>" and "step" replicated, "error/<param>" per rank:
  // each rank's own): allocated at construction; restoring is copy_from into them.
  virtual std::vector<PlacedTensor> state() = 0;
  // auto: its decisions (JSON, compress/auto.h: "ranks" per bucket, 0 for none; the whole plan
  // with its costs once made, which plan_final() waits for); null for the other kinds.
  nlohmann::json plan() const override { return nullptr; }
  // Collective over every rank (both communicators when sharded), right before a checkpoint that
  // one shard group writes (fsdp-train's HSDP): state that differs between ranks but is saved as
  // one copy made identical (auto: its per-rank sums, their maximum). Nothing by default.
  virtual void before_save() {}
};

// Where the gradients are, beyond the default (whole tensors on every rank of `comm`, bucketed by
// size). fsdp-train's HSDP gives both:
//  - buckets: the buckets themselves, in the order they become ready (contiguous ranges of the
//    parameters covering them all, from the last backwards); empty: by bucket_bytes.
//  - shard, rows: the grads are rows of dim 0 of whole tensors, split over the shard group
//    `shard` as rows[i] says (core/placed.h; every rank of it holds the same number of padded
//    rows, rows[i].lengths's largest), and `comm` connects the ranks that hold the same rows
//    (HSDP's replicas): W is comm's size, the contributions are the replicas'. PowerSGD then
//    compresses each whole [n, m] matrix (rank and min_compression_rate judged on the whole
//    shape), as it would unsharded: P_s = M_s Q (this shard's rows) is summed over comm; the
//    shards' P are all-gathered over `shard` (padding rows dropped) and the whole P
//    orthonormalised alike on every rank; Q_g = sum over shards of M_s^T P^_s (an all-reduce over
//    `shard`) gives the projection error e_s = M_s - P^_s Q_g^T, and Q = mean over comm of Q_g.
//    The result does not depend on the shard count: it is the unsharded PowerSGD's, over comm's
//    ranks, up to f32 summation order. topk, randomk and signum act on each rank's shard as its
//    own tensors (their k and ||M||_1 / n per shard; the result depends on the shard count).
//    The error buffers stay sharded: state() places them by rows (Placement::sharded), so that a
//    checkpoint reshards them on another shard count; as one shard group writes, the caller saves
//    their mean over comm (see the resume argument above).
struct Topology {
  std::vector<ParamRange> buckets;
  comm::Communicator* shard = nullptr;
  std::vector<Rows> rows;  // per parameter, with shard
};

// bucket_bytes: the bucket size (the default: one bucket of everything).
std::unique_ptr<Compressor> make_compressor(const Config& cfg, comm::Communicator& comm,
                                            const std::vector<nn::Param>& params,
                                            size_t bucket_bytes = SIZE_MAX, const Topology& topology = {});

}  // namespace dtk::compress
