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
  std::string error_mode = "projection";  // "full": M - P Q^T; "projection": M - P (P^T M)
  std::string orthogonalize = "auto";     // "auto" (mgs for r <= 2, qr above) | "mgs" | "qr"
  DType comm_dtype = DType::f32;   // P and Q on the wire: f32 | bf16
  double ratio = 0.01;             // topk / randomk: fraction of coordinates kept per tensor
  uint64_t seed = 0;               // Q initialisation and randomk selection (shared by all ranks)
  nlohmann::json to_json() const;
};

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
