// SGD and AdamW over the fused ops (ops::sgd_step, ops::adamw_step), learning-rate schedules and
// global-norm gradient clipping.
//
// State is allocated at construction, zero, on the parameters' device; the step counter is an
// i64 [1] tensor on the host (it is read on the host every step to form AdamW's bias
// corrections, so keeping it there costs no device synchronisation; checkpoints save and
// restore it like any other state tensor).
#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>
#include <vector>

#include "dtk/core/error.h"
#include "dtk/ops/ops.h"
#include "dtk/optim/optimizer.h"

namespace dtk::optim {

// ------------------------------------------------------------------------------ OptimConfig

void OptimConfig::validate() const {
  if (name == Kind::shampoo) fail_usage("optimizer shampoo: built by optim::make_shampoo, not make_optimizer");
  if (!(momentum >= 0 && momentum < 1)) fail_usage("optimizer: momentum must be in [0, 1), got {}", momentum);
  if (name == Kind::sgd && nesterov && momentum == 0) fail_usage("optimizer: nesterov needs a momentum above 0");
  if (!(beta1 >= 0 && beta1 < 1)) fail_usage("optimizer: beta1 must be in [0, 1), got {}", beta1);
  if (!(beta2 >= 0 && beta2 < 1)) fail_usage("optimizer: beta2 must be in [0, 1), got {}", beta2);
  if (!(eps > 0) || !std::isfinite(eps)) fail_usage("optimizer: eps must be finite and > 0, got {}", eps);
  if (!(weight_decay >= 0) || !std::isfinite(weight_decay))
    fail_usage("optimizer: weight_decay must be finite and >= 0, got {}", weight_decay);
}



// ------------------------------------------------------------------------------ SGD, AdamW

namespace {

// The parameters a step is given must be the ones the optimizer was built for.
void check_params(const char* who, const std::vector<Shape>& shapes, const std::vector<nn::Param>& params) {
  if (params.size() != shapes.size())
    fail_usage("{}: step got {} parameters, the optimizer was built for {}", who, params.size(), shapes.size());
  for (size_t i = 0; i < params.size(); ++i)
    if (params[i].value.shape() != shapes[i] || params[i].grad.shape() != shapes[i])
      fail_usage(std::string(who) + ": parameter " + params[i].name + " is " + params[i].value.str() + ", the optimizer was built for " +
                 shape_str(shapes[i]));
}

class BaseOptimizer : public Optimizer {
 public:
  BaseOptimizer(OptimConfig cfg, const std::vector<nn::Param>& params, const std::vector<Rows>& rows)
      : cfg_(std::move(cfg)) {
    cfg_.validate();
    if (!rows.empty() && rows.size() != params.size())
      fail("optimizer: {} parameters, {} placements", params.size(), rows.size());
    rows_ = rows;
    rows_.resize(params.size());
    for (const auto& p : params) {
      if (!p.value.defined()) fail_usage("optimizer: parameter " + p.name + " has no value");
      if (p.value.dtype() != DType::f32 && p.value.dtype() != DType::f64)
        fail_usage("optimizer: parameter " + p.name + " must be f32 or f64, got " + p.value.str());
      names_.push_back(p.name);
      shapes_.push_back(p.value.shape());
    }
    step_ = Tensor::zeros({1}, DType::i64);
  }
  nlohmann::json config() const override { return cfg_; }

 protected:
  // Advances the counter; returns the new step (counting from 1).
  int64_t next_step() {
    int64_t& s = *step_.ptr<int64_t>();
    return ++s;
  }
  Tensor zeros_like(const nn::Param& p) { return Tensor::zeros(p.value.shape(), p.value.dtype(), p.value.device()); }
  // State of parameter i's shape: placed like the parameter.
  PlacedTensor like_param(const std::string& kind, size_t i, const Tensor& t) const {
    if (rows_[i].offsets.empty()) return {kind + "/" + names_[i], t};
    return {kind + "/" + names_[i], t, Placement::sharded, -1, false, rows_[i]};
  }
  PlacedTensor step_state() const { return {"step", step_}; }

  OptimConfig cfg_;
  std::vector<std::string> names_;
  std::vector<Shape> shapes_;
  std::vector<Rows> rows_;
  Tensor step_;  // i64 [1] on the host
};

class Sgd final : public BaseOptimizer {
 public:
  Sgd(const OptimConfig& cfg, const std::vector<nn::Param>& params, const std::vector<Rows>& rows)
      : BaseOptimizer(cfg, params, rows) {
    if (cfg_.momentum != 0)
      for (const auto& p : params) buf_.push_back(zeros_like(p));
  }
  void step(std::vector<nn::Param>& params, double lr) override {
    check_params("sgd", shapes_, params);
    next_step();
    Tensor none;
    for (size_t i = 0; i < params.size(); ++i)
      ops::sgd_step(params[i].value, params[i].grad, buf_.empty() ? none : buf_[i], lr, cfg_.momentum, cfg_.weight_decay,
                    cfg_.nesterov);
  }
  std::vector<PlacedTensor> state() override {
    std::vector<PlacedTensor> s;
    for (size_t i = 0; i < buf_.size(); ++i) s.push_back(like_param("momentum", i, buf_[i]));
    s.push_back(step_state());
    return s;
  }

 private:
  std::vector<Tensor> buf_;
};

class AdamW final : public BaseOptimizer {
 public:
  AdamW(const OptimConfig& cfg, const std::vector<nn::Param>& params, const std::vector<Rows>& rows)
      : BaseOptimizer(cfg, params, rows) {
    for (const auto& p : params) {
      m_.push_back(zeros_like(p));
      v_.push_back(zeros_like(p));
    }
  }
  void step(std::vector<nn::Param>& params, double lr) override {
    check_params("adamw", shapes_, params);
    const int64_t t = next_step();
    for (size_t i = 0; i < params.size(); ++i)
      ops::adamw_step(params[i].value, params[i].grad, m_[i], v_[i], lr, cfg_.beta1, cfg_.beta2, cfg_.eps,
                      cfg_.weight_decay, t);
  }
  std::vector<PlacedTensor> state() override {
    std::vector<PlacedTensor> s;
    for (size_t i = 0; i < m_.size(); ++i) s.push_back(like_param("exp_avg", i, m_[i]));
    for (size_t i = 0; i < v_.size(); ++i) s.push_back(like_param("exp_avg_sq", i, v_[i]));
    s.push_back(step_state());
    return s;
  }

 private:
  std::vector<Tensor> m_, v_;
};

}  // namespace

std::unique_ptr<Optimizer> make_optimizer(const OptimConfig& cfg, const std::vector<nn::Param>& params,
                                          const std::vector<Rows>& rows) {
  cfg.validate();
  if (cfg.name == Kind::sgd) return std::make_unique<Sgd>(cfg, params, rows);
  return std::make_unique<AdamW>(cfg, params, rows);
}

// ------------------------------------------------------------------------------ Schedule

// Warm-up: step s < warmup gives lr * (s + 1) / warmup (lr / warmup at step 0, lr at step
// warmup - 1). Decay runs over steps [warmup, total]: progress q = (s - warmup) / (total - warmup)
// clamped to [0, 1]; linear lr * (1 - (1 - min_ratio) q), cosine lr * (min_ratio + (1 - min_ratio)
// (1 + cos(pi q)) / 2); from `total` on the rate stays at lr * min_ratio. When total <= warmup
// the decay has no length: the rate is lr * min_ratio from step `warmup` on.
// Step decay: lr decay_factor^k from step `warmup` on, k the number of decay steps <= step (a
// decay step within the warm-up takes effect at its end).
double Schedule::at(int64_t step) const {
  if (!(lr >= 0) || !std::isfinite(lr)) fail_usage("schedule: lr must be finite and >= 0, got {}", lr);
  if (warmup < 0) fail_usage("schedule: warmup must be >= 0, got {}", warmup);
  if (!(min_ratio >= 0 && min_ratio <= 1)) fail_usage("schedule: min_ratio must be in [0, 1], got {}", min_ratio);
  if (step < 0) fail_usage("schedule: step must be >= 0, got {}", step);
  if (step < warmup) return lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
  if (kind == ScheduleKind::constant) return lr;
  if (kind == ScheduleKind::step) {
    double r = lr;
    for (size_t i = 0; i < decay_steps.size(); ++i) {
      if (decay_steps[i] < 1 || (i > 0 && decay_steps[i] <= decay_steps[i - 1]))
        fail_usage("schedule: decay steps must be at least 1 and strictly increasing");
      if (decay_steps[i] <= step) r *= decay_factor;
    }
    return r;
  }
  const int64_t span = total - warmup;
  const double q = span <= 0 ? 1.0 : std::min(1.0, static_cast<double>(step - warmup) / static_cast<double>(span));
  if (kind == ScheduleKind::linear) return lr * (1.0 - (1.0 - min_ratio) * q);
  return lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + std::cos(std::numbers::pi * q)));
}

// ------------------------------------------------------------------------------ clipping

// Each gradient's norm comes from the backend's reduction (accumulated in f64 on CPU and GPU);
// the squares are summed over parameters in f64. The per-parameter norms go to one device
// vector, read back once. A norm that is NaN or Inf is returned and nothing is scaled (the
// caller decides whether to skip the step).
double clip_grad_norm(std::vector<nn::Param>& params, double max_norm) {
  if (!(max_norm >= 0) || std::isnan(max_norm)) fail_usage("clip_grad_norm: max_norm must be >= 0, got {}", max_norm);
  if (params.empty()) return 0.0;
  for (const auto& p : params)
    if (!p.grad.defined()) fail_usage("clip_grad_norm: parameter " + p.name + " has no gradient");
  // Grouped by (device, dtype): one vector of norms per group, read once.
  double sumsq = 0;
  std::vector<bool> done(params.size(), false);
  for (size_t i = 0; i < params.size(); ++i) {
    if (done[i]) continue;
    const Tensor& g0 = params[i].grad;
    std::vector<size_t> group;
    for (size_t j = i; j < params.size(); ++j)
      if (!done[j] && params[j].grad.device() == g0.device() && params[j].grad.dtype() == g0.dtype()) group.push_back(j);
    Tensor out = Tensor::zeros({static_cast<int64_t>(group.size())}, g0.dtype(), g0.device());
    for (size_t k = 0; k < group.size(); ++k) {
      Tensor slot = out.slice(static_cast<int64_t>(k), static_cast<int64_t>(k) + 1);
      ops::reduce(ops::Reduce::norm2, ops::Axis::all, params[group[k]].grad.flatten(), slot);
      done[group[k]] = true;
    }
    for (double n : out.to_doubles()) sumsq += n * n;
  }
  const double norm = std::sqrt(sumsq);
  if (max_norm > 0 && std::isfinite(norm) && norm > max_norm) {
    const double c = max_norm / norm;
    for (auto& p : params) ops::scale(p.grad, c, p.grad);
  }
  return norm;
}

}  // namespace dtk::optim
