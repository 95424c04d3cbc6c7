// dtk::optim — optimizers over a model's parameters, learning-rate schedules, gradient clipping.
// An optimizer updates every Param from its grad; its state is a list of placed tensors
// (core/placed.h) that checkpoints save and restore (copy_from into them), so a resumed run
// continues exactly.
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "dtk/core/component.h"
#include "dtk/core/enums.h"
#include "dtk/core/json_config.h"
#include "dtk/core/placed.h"
#include "dtk/nn/model.h"

namespace dtk::optim {

// The optimizers: make_optimizer builds sgd and adamw, make_shampoo (optim/shampoo.h) shampoo.
enum class Kind { adamw, sgd, shampoo };
DTK_ENUM_NAMES(Kind, {Kind::adamw, "adamw"}, {Kind::sgd, "sgd"}, {Kind::shampoo, "shampoo"})

struct OptimConfig {
  Kind name = Kind::adamw;     // sgd | adamw
  double momentum = 0.9;       // sgd
  bool nesterov = false;       // sgd
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;  // adamw
  double weight_decay = 0.0;   // sgd: L2 added to the gradient (PyTorch's); adamw: decoupled
  void validate() const;       // UsageError naming the field
};
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(OptimConfig, name, momentum, nesterov, beta1, beta2, eps, weight_decay)


// A component of the run (core/component.h): named "optimizer" in --print-plan's output.
class Optimizer : public Component {
 public:
  std::string_view component_name() const override { return "optimizer"; }
  // One update of every parameter from its gradient at learning rate lr.
  virtual void step(std::vector<nn::Param>& params, double lr) = 0;
  // The state as this rank holds it ("exp_avg/<param>", "exp_avg_sq/<param>", "momentum/<param>",
  // "step" as an i64 [1] tensor), all allocated at construction on the parameters' device, each
  // with its placement: state shaped like a parameter is placed like it (sharded with its rows,
  // else replicated), "step" is replicated; Shampoo places its blocks (optim/shampoo.h).
  virtual std::vector<PlacedTensor> state() = 0;
  // The state as a checkpoint saves it; collective over the world, on every rank, right before
  // a save (Shampoo: Dion's per-replica buffers of sharded parameters as their mean).
  virtual std::vector<PlacedTensor> saved_state() { return state(); }
  virtual nlohmann::json config() const = 0;
  // What the last step adds to the metrics line (Shampoo: optim_comm_bytes); nothing by default.
  virtual void metrics(nlohmann::ordered_json& m) const { (void)m; }
  // After state() was restored from a checkpoint whose optimizer config is `saved`: state that an
  // older dtk laid out otherwise is brought up to date; returns what was done, for rank 0's log
  // ("" when nothing was).
  virtual std::string restored(const nlohmann::json& saved) {
    (void)saved;
    return "";
  }
};

// rows: where each parameter lies over a shard group (Parallelism::param_rows()); empty, or a
// Rows without offsets: whole on every rank.
std::unique_ptr<Optimizer> make_optimizer(const OptimConfig& cfg, const std::vector<nn::Param>& params,
                                          const std::vector<Rows>& rows = {});

// Learning rate at a step (0-based): linear warm-up from lr/warmup to lr over `warmup` steps,
// then constant, linear decay, or cosine decay to lr * min_ratio at `total` steps, or step decay
// (the papers' ResNet schedules, PyTorch's MultiStepLR): lr times decay_factor^k, k the number
// of decay_steps at or before the step (strictly increasing, each at least 1).
enum class ScheduleKind { constant, linear, cosine, step };
DTK_ENUM_NAMES(ScheduleKind, {ScheduleKind::constant, "constant"}, {ScheduleKind::linear, "linear"},
               {ScheduleKind::cosine, "cosine"}, {ScheduleKind::step, "step"})

struct Schedule {
  ScheduleKind kind = ScheduleKind::cosine;
  double lr = 1e-3;
  int64_t warmup = 0;
  int64_t total = 1;
  double min_ratio = 0.1;
  std::vector<int64_t> decay_steps{};  // step
  double decay_factor = 0.1;           // step
  double at(int64_t step) const;
};
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(Schedule, kind, lr, warmup, total, min_ratio, decay_steps, decay_factor)

// The L2 norm of all gradients together; when max_norm > 0 and the norm exceeds it, every
// gradient is scaled by max_norm / norm. Returns the norm before clipping. A norm that is NaN or
// Inf is returned and nothing is scaled (the caller decides what to do).
double clip_grad_norm(std::vector<nn::Param>& params, double max_norm);
// The same on the gradients' device without the host waiting: norm (f64 [1] there) receives the
// norm and the scaling reads it there (ops::clip_scale). Gradients laid end to end in one buffer
// are reduced and scaled as one tensor (one launch each for a flat model).
void clip_grad_norm(std::vector<nn::Param>& params, double max_norm, Tensor& norm);
// The norm of parts together into norm (f64 [1] on their device): each part's norm, then the norm
// of those, on the device.
void global_norm(const std::vector<Tensor>& parts, Tensor& norm);

}  // namespace dtk::optim
