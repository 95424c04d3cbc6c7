// dtk::parallel — low-communication data parallelism: DiLoCo (Douillard et al., arXiv
// 2311.08105) and Streaming DiLoCo (arXiv 2501.18512), psgd-train's and fsdp-train's --sync
// diloco|streaming.
//
// The ranks form replicas (sync groups of consecutive ranks: psgd-train's --sync-groups, which
// all-reduce their gradients every step as plain data parallelism does, or fsdp-train's
// --replicate groups, which shard the model within as FSDP does: the inner placement is the
// caller's). Each replica trains alone for H inner
// steps with the run's optimizer (its state is the replica's own, never averaged); then the
// replicas average their pseudo-gradients Delta = outer - local, and every rank applies the
// outer optimizer, Nesterov SGD (PyTorch's, dampening 0):
//     b <- mu b + mean Delta;   outer <- outer - eta (mean Delta + mu b)     (mu = 0: outer - eta mean Delta)
// and the local weights restart from the outer ones. With H = 1, eta = 1, mu = 0 and SGD inner
// steps this is every-step data parallelism (tests/tools/psgd_diloco.sh: within 1e-6).
// Streaming (F fragments): the parameters in F fragments of nearly equal size
// (balanced_fragments); each has its own outer weights and momentum, and is synchronised every H
// steps at offset (p + 1) H / F, so one fragment travels every H / F steps. Its pseudo-gradient
// is sent after step n - tau and applied after step n (tau = --sync-delay inner steps overlap
// the exchange), merged as
//     local_p <- alpha local_p + (1 - alpha) outer_p          (alpha = --outer-mix)
// so that the tau steps taken meanwhile survive in proportion alpha (torchft's and the paper's
// rule; alpha = 0 discards them). DiLoCo is the case F = 1 (tau allowed).
// The exchange: a compressor's aggregation (compress/compressor.h: PowerSGD over the fragment's
// matrices with its error feedback across rounds, run whole at the send step), or the mean in
// --outer-dtype (compress/quantize.h: f32 all-reduce, or bf16/int8/e3m0 with error feedback).
// Without a compressor the replicas' exchange is split over the ranks of a sync group (member j
// sends slice j of the fragment over the slow link, then the group all-gathers the slices); a
// sharded group's members each send their own rows (and a compressor compresses whole matrices
// over the shards: compress::Topology).
// Where the state lives: the outer weights, their momentum and the exchange's buffers on the host
// (as prime keeps them), in fragment order, of the parameters as the inner placement holds them
// (whole, or this rank's rows); the local weights are the inner placement's. Evaluation and the
// checkpoint's model are the outer weights (begin_evaluation); the local weights, the inner
// optimizer's state and the error buffers are each rank's own (per_rank). Sharded, every rank
// writes the checkpoint: the outer weights and momentum by rows (Rows::replicas: the first
// replica's), the per-rank state in each rank's own file.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

#include "dtk/comm/comm.h"
#include "dtk/compress/compressor.h"
#include "dtk/compress/quantize.h"
#include "dtk/core/enums.h"
#include "dtk/nn/model.h"
#include "dtk/parallel/parallelism.h"

namespace dtk::parallel {

enum class Sync { every_step, diloco, streaming };
DTK_ENUM_NAMES(Sync, {Sync::every_step, "every-step"}, {Sync::diloco, "diloco"}, {Sync::streaming, "streaming"})

// --sync-every auto: the steps timed before H is chosen (the first a warm-up), the most of a step
// the outer exchange may hold, and the largest H.
inline constexpr int64_t kAutoEverySteps = 5;
inline constexpr double kAutoEveryOverhead = 0.05;
inline constexpr int64_t kAutoEveryMax = 1024;
// ... and with --sync streaming but no --fragments, the largest F it weighs (2, 4, ..., this).
inline constexpr int kAutoFragmentsMax = 64;

struct OuterConfig {
  Sync sync = Sync::every_step;
  int64_t every = 64;         // H: inner steps between a fragment's synchronisations; 0: auto
  double lr = 0.7;            // eta
  double momentum = 0.9;      // mu (Nesterov)
  int fragments = 1;          // F (streaming: >= 2; 0: chosen with H by --sync-every auto)
  int64_t delay = 0;          // tau: inner steps between a fragment's send and its application
  double mix = 0;             // alpha
  compress::Wire wire = compress::Wire::f32;
  int group = 1;              // ranks per sync group
  // UsageError naming the option for what does not fit (world: the job's ranks).
  void validate(int world) const;
};
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(OuterConfig, sync, every, lr, momentum, fragments, delay, mix, wire, group)

// The schedule: which fragment is sent, or applied, after step n (the count of steps done, from
// 1); -1: none. Pure, for the tests.
struct OuterSchedule {
  int64_t every = 1, delay = 0;
  int fragments = 1;
  int sent_after(int64_t n) const;
  int applied_after(int64_t n) const;
  // The fragment in flight after step n (sent at or before n, applied after it), and when it
  // is applied; {-1, 0}: none.
  std::pair<int, int64_t> in_flight(int64_t n) const;
  // Of fragment p's synchronisations, the one applied after step n_applied (0, 1, ...).
  int64_t round(int p, int64_t n_applied) const;
};

// The parameters (indices) in F fragments of nearly equal elements, so that each fragment's
// exchange, the peak, is about 1/F of the model's: largest first, each to the lightest fragment
// so far (ties: the lower index); each fragment in model order. Whole blocks would not do: a
// llama's embedding and output are not the size of a layer (llama-tiny's blocks make fragments
// of 0.27, 0.27, 0.23 and 0.23 of the model at F = 4).
std::vector<std::vector<size_t>> balanced_fragments(const std::vector<nn::Param>& params, int fragments);

// The placement within a replica, over its ranks (device and host communicators): GradSync
// (psgd-train) or Fsdp without replicas (fsdp-train).
using InnerPlacement = std::function<std::unique_ptr<Parallelism>(comm::Communicator& group, comm::Communicator& group_host)>;

// The misfits of --sync with the rest of a run, one UsageError naming the options: a Shampoo inner
// optimizer, --compressor auto, a narrow --outer-dtype with a compressor, --sync-every auto with
// one, and cfg.validate's.
void validate_sync(const OuterConfig& cfg, compress::Kind compressor, bool shampoo, int world);

class DiLoCo final : public Parallelism {
 public:
  // world and host: the job's communicators (device and host); inner: the placement within each
  // replica of cfg.group ranks. outer_compressor: aggregate the pseudo-gradients with it (its
  // kind not none or auto) instead of cfg.wire's mean.
  DiLoCo(nn::Model& model, const OuterConfig& cfg, const std::optional<compress::Config>& outer_compressor,
         comm::Communicator& world, comm::Communicator& host, const InnerPlacement& inner);
  ~DiLoCo() override;

  std::vector<nn::Param>& params() override { return inner_->params(); }
  comm::Communicator& optimizer_comm() override { return inner_->optimizer_comm(); }
  comm::Communicator* replica_comm() override { return inner_->replica_comm(); }
  bool sharded() const override { return sharded_; }
  const Rows* rows(size_t i) const override { return inner_->rows(i); }
  // Sharded: every rank (each its own per-rank state; the first replica the rows).
  comm::Communicator* checkpoint_comm() override { return sharded_ ? &host_ : nullptr; }
  // The outer weights as "model/<param>" (and the model's buffers).
  std::vector<PlacedTensor> state() override;
  // "diloco/local/<param>" and "diloco/restored" (per rank), "diloco/momentum/<param>",
  // "diloco/error/<param>" (per rank, narrow --outer-dtype), "diloco/every" (auto's H),
  // "diloco/pending" and "diloco/pending_mean" (a fragment in flight, --sync-delay), the
  // compressors' state as "diloco/compress/<fragment>/...".
  std::vector<PlacedTensor> sync_state() override;
  // Completes an exchange in flight first (its mean is saved and applied when due): collective.
  std::vector<PlacedTensor> saved_sync_state() override;
  // The world's: the local weights are each rank's.
  std::pair<int, int> state_rank() override { return {world_rank_, world_size_}; }
  // The inner optimizer's state is each replica's: per rank, afresh on another world size.
  std::vector<PlacedTensor> optimizer_state(std::vector<PlacedTensor> s) override;
  void init(uint64_t seed) override;
  void loaded() override;
  void zero_grad() override { inner_->zero_grad(); }
  void begin(int64_t step) override { inner_->begin(step); }
  void finish() override;
  void clip_grad_norm(double max_norm, Tensor& norm) override { inner_->clip_grad_norm(max_norm, norm); }
  void metrics(nlohmann::ordered_json& m) const override;
  void before_step(int64_t step) override;
  void after_step(int64_t step) override;
  void collect_timings() override { inner_->collect_timings(); }
  void begin_evaluation() override;
  void end_evaluation() override;
  std::vector<Component*> components() override;
  std::string_view component_name() const override { return "diloco"; }
  std::string restore_note(Restored outcome, const RestoreSource& from) const override;
  nlohmann::json plan() const override;
  bool plan_final() const override { return schedule_.every > 0; }

  void before_forward(int block, nn::Pass pass) override { inner_->before_forward(block, pass); }
  void after_forward(int block, nn::Pass pass) override { inner_->after_forward(block, pass); }
  void before_backward(int block) override { inner_->before_backward(block); }
  void after_backward(int block) override;

 private:
  struct Fragment {
    std::vector<size_t> params;  // in model order
    int64_t begin = 0, end = 0;  // its range of the host buffers
    std::vector<nn::Param> shadows;  // compressor: the params with grads on delta_
    std::unique_ptr<compress::Compressor> compressor;
  };
  void to_host(int p, Tensor& dst);      // the local weights of fragment p into dst's range
  void from_host(int p, const Tensor& src);
  void send(int p, int64_t n);
  void apply(int p);
  void complete();                        // the exchange in flight: its mean into mean_
  void poll();                            // advances the exchange in flight, waiting for nothing
  // --sync-every auto: the link between replicas (measured, or DTK_AUTO_LINK) and the timed
  // steps, the slowest rank's, give the smallest H (F times a power of 2, above tau F) whose
  // exchanges, less what tau steps hide, hold the steps at most kAutoEveryOverhead; with
  // fragments 0 also F, the one whose H is smallest (ties: the larger F).
  void choose_every();
  std::vector<std::vector<size_t>> parts(int fragments) const;  // balanced_fragments of the model's
  // The F --sync-every auto weighs: --fragments, or 2, 4, ... up to kAutoFragmentsMax and the
  // model's parameters.
  std::vector<int> candidates() const;
  // The fragments, their ranges of the host buffers and the schedule's F; the state in the host
  // buffers so far moves with its parameters.
  void layout(int fragments);
  Tensor view(const Tensor& t, size_t i) const;  // parameter i's part of a host buffer, in its shape
  // Parameter i's part of a host buffer, placed as the parameter is (whole and replicated, or
  // this rank's rows of the replicas' shards).
  PlacedTensor placed(std::string name, const Tensor& t, size_t i) const;
  int64_t exchanged(int64_t len) const;  // the elements this rank sends of a fragment it holds len of

  nn::Model& model_;
  OuterConfig cfg_;
  OuterSchedule schedule_;
  int world_rank_ = 0, world_size_ = 1;
  std::shared_ptr<comm::Communicator> group_, group_host_, cross_;  // cross_: the same member of every group (host)
  comm::Communicator& host_;
  std::unique_ptr<Parallelism> inner_;
  bool sharded_ = false;  // the inner placement holds rows (each member of a group its own)
  bool split_ = false;    // the group's members hold the same fragment and split its exchange
  std::vector<Fragment> frags_;
  std::vector<int64_t> pos_;  // per parameter: its offset in the host buffers
  // Host f32 [N] in fragment order: outer weights, momentum, pseudo-gradient (then its
  // compressed or mean form), error feedback, the mean of the fragment in flight, local scratch.
  Tensor outer_, momentum_, delta_, error_, mean_, local_;
  Tensor restored_;  // i64 [1], per rank: 1 once the local weights hold a run's (0: from the outer ones)
  Tensor every_;  // i64 [1], --sync-every auto: the H chosen (0: not yet)
  Tensor fragments_;  // i64 [1], F: --fragments, or as chosen with H (fragments 0)
  std::vector<double> step_s_;  // auto: the steps timed so far
  std::chrono::steady_clock::time_point step_start_;
  nlohmann::json auto_plan_;
  Tensor pending_info_;  // i64 [2]: the fragment in flight when saved (-1: none) and its step of application
  std::unique_ptr<compress::QuantizedMean> exchange_;
  int pending_ = -1;          // the fragment in flight
  int64_t pending_at_ = 0;    // applied after this step
  bool completed_ = false;    // its mean is in mean_
  int64_t slice_lo_ = 0, slice_hi_ = 0;  // this rank's slice of the pending fragment
  // the last step's
  int64_t outer_bytes_ = 0, gather_bytes_ = 0;
  double outer_comm_s_ = 0, outer_norm_ = -1;
  int outer_fragment_ = -1;
};

}  // namespace dtk::parallel
