// dtk::compress — gradient aggregation across data-parallel ranks, compressed or not:
// PowerSGD (Vogels et al., 2019) and the paper's baselines (none, topk, randomk, signum).
//
// Convention: on entry each rank's grads hold its *contribution*, scaled so that the sum over
// ranks is the global-batch mean gradient (a rank holding n of the global batch's B samples has
// scaled its mean-loss gradient by n / B). On return every rank's grads hold the same aggregated
// gradient: the exact sum for `none`, its compressed approximation otherwise. Compressors that
// keep per-rank state (error feedback) work with M_r = W * contribution_r + error_r, the rank's
// estimate of the mean gradient, so their state does not depend on how the batch was split.
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "dtk/comm/comm.h"
#include "dtk/nn/model.h"

namespace dtk::compress {

struct Config {
  std::string kind = "powersgd";   // "none" | "powersgd" | "topk" | "randomk" | "signum"
  int rank = 2;                    // powersgd: rank r of the approximation
  int64_t start_iter = 10;         // plain all-reduce for steps < start_iter
  double min_compression_rate = 2; // compress a matrix only when (n + m) r * rate < n m
  bool warm_start = true;          // reuse Q from the previous step
  bool error_feedback = true;
  // Error mode, "projection" by default. Both modes give every rank the same update, and in
  // exact arithmetic the same sequence of updates: P = mean_r(M_r) Q and Q = mean_r(M_r)^T P^
  // depend on the errors only through their mean over ranks, and that mean is the same in both,
  //   mean_r (M_r - P^ P^T M_r) = mean M - P^ (P^T mean M) = mean M - P^ Q^T.
  // They differ in what each rank keeps. "full" (the paper's e_r = M_r - P^ Q^T) leaves in e_r
  // the rank's deviation from the mean, M_r - mean M, in every direction, and adds the next
  // step's deviation to it: the deviations sum to zero over ranks but each rank's buffer
  // accumulates them without damping, a random walk that grows with the steps (and with W and
  // the gradient noise), while the updates stay the same. "projection" (e_r = M_r - P^ (P^T M_r),
  // the part of the rank's own M_r outside span(P^)) never exceeds ||M_r|| and drops the
  // deviation inside span(P^) every step, so each rank's buffer stays bounded: the checkpointed
  // state stays small, f32 sums stay well conditioned, and bf16 P on the wire is not swamped by
  // large per-rank terms that cancel. It also needs only the rank's local Q_r = M_r^T P^, so it is
  // computed while Q's all-reduce is in flight. In a world of one the two modes are identical.
  std::string error_mode = "projection";  // "full": M - P Q^T; "projection": M - P (P^T M)
  std::string orthogonalize = "auto";     // "auto" (mgs for r <= 2, qr above) | "mgs" | "qr"
  DType comm_dtype = DType::f32;   // P and Q on the wire: f32 | bf16
  double ratio = 0.01;             // topk / randomk: fraction of coordinates kept per tensor
  uint64_t seed = 0;               // Q initialisation and randomk selection (shared by all ranks)
  nlohmann::json to_json() const;
  static Config from_json(const nlohmann::json& j);  // missing keys keep their defaults
  void validate() const;  // UsageError naming the field: unknown kind, rank < 1, ratio not in (0, 1], ...
};

// The kinds, for option help and errors.
std::vector<std::string> kinds();

struct Bytes {
  int64_t sent = 0;          // payload bytes this rank contributed to collectives in the last step
  int64_t uncompressed = 0;  // what plain all-reduce of the same gradients sends (f32)
};

class Compressor {
 public:
  virtual ~Compressor() = default;
  // Aggregates params' grads over the communicator (see the convention above). step is the
  // training step (0-based), for start_iter and the shared random streams.
  virtual void aggregate(std::vector<nn::Param>& params, int64_t step) = 0;
  virtual Bytes last_bytes() const = 0;
  // Named state tensors for checkpoints ("q/<param>", "error/<param>" (per rank), "step"):
  // allocated at construction; restoring is copy_from into them.
  virtual std::vector<std::pair<std::string, Tensor>> state() = 0;
  // Which names of state() differ between ranks (saved under ranks/<r>/ in checkpoints).
  virtual bool per_rank(const std::string& state_name) const = 0;
};

std::unique_ptr<Compressor> make_compressor(const Config& cfg, comm::Communicator& comm,
                                            const std::vector<nn::Param>& params);

}  // namespace dtk::compress
