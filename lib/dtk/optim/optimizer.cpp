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
    find_runs(params);
  }
  nlohmann::json config() const override { return cfg_; }

 protected:
  // Advances the counter; returns the new step (counting from 1).
  int64_t next_step() {
    int64_t& s = *step_.ptr<int64_t>();
    return ++s;
  }
  // State of parameter i's shape: placed like the parameter.
  PlacedTensor like_param(const std::string& kind, size_t i, const Tensor& t) const {
    if (rows_[i].offsets.empty()) return {kind + "/" + names_[i], t};
    return {kind + "/" + names_[i], t, Placement::sharded, -1, false, rows_[i]};
  }
  PlacedTensor step_state() const { return {"step", step_}; }

  // Multi-tensor steps. The parameters fall into runs of neighbours whose values and gradients
  // each lie end to end in one buffer (flat storage, FSDP's shards); a state tensor per parameter
  // is a view into one buffer per run (state_like), and an elementwise update runs once over each
  // run (for_runs): one launch for a whole model instead of one per tensor, the same arithmetic.
  // The runs are found at construction (find_runs).
  struct State {
    std::vector<Tensor> runs;    // per run: its buffer
    std::vector<Tensor> params;  // per parameter: its view
  };
  State state_like(const std::vector<nn::Param>& params) const {
    State st;
    for (const auto& [b, e] : runs_) {
      int64_t n = 0;
      for (size_t i = b; i < e; ++i) n += params[i].value.numel();
      const Tensor& v0 = params[b].value;
      st.runs.push_back(Tensor::zeros({n}, v0.dtype(), v0.device()));
      int64_t at = 0;
      for (size_t i = b; i < e; ++i) {
        const int64_t k = params[i].value.numel();
        st.params.push_back(st.runs.back().slice(at, at + k).reshape(params[i].value.shape()));
        at += k;
      }
    }
    return st;
  }
  // f(value, grad, states' tensors) once per run, over the run joined; per parameter where this
  // step's values or gradients do not join (tensors other than those the optimizer was built for).
  template <typename F>
  void for_runs(std::vector<nn::Param>& params, const std::vector<State*>& states, F f) {
    std::vector<Tensor> st;
    for (size_t r = 0; r < runs_.size(); ++r) {
      const auto [b, e] = runs_[r];
      std::vector<Tensor> values, grads;
      for (size_t i = b; i < e; ++i) values.push_back(params[i].value), grads.push_back(params[i].grad);
      Tensor v = Tensor::joined(values), g = Tensor::joined(grads);
      if (v.defined() && g.defined()) {
        st.clear();
        for (State* s : states) st.push_back(s->runs[r]);
        f(v, g, st);
        continue;
      }
      for (size_t i = b; i < e; ++i) {
        st.clear();
        for (State* s : states) st.push_back(s->params[i]);
        f(params[i].value, params[i].grad, st);
      }
    }
  }

  OptimConfig cfg_;
  std::vector<std::string> names_;
  std::vector<Shape> shapes_;
  std::vector<Rows> rows_;
  Tensor step_;  // i64 [1] on the host

 private:
  std::vector<std::pair<size_t, size_t>> runs_;  // [begin, end) of parameters laid end to end
  void find_runs(const std::vector<nn::Param>& params) {
    for (size_t i = 0; i < params.size();) {
      size_t j = i + 1;
      while (j < params.size() && adjacent(params[j - 1], params[j])) ++j;
      runs_.emplace_back(i, j);
      i = j;
    }
  }
  static bool adjacent(const nn::Param& a, const nn::Param& b) {
    return a.value.device() == b.value.device() && Tensor::joined({a.value, b.value}).defined() &&
           Tensor::joined({a.grad, b.grad}).defined();
  }
};

class Sgd final : public BaseOptimizer {
 public:
  Sgd(const OptimConfig& cfg, const std::vector<nn::Param>& params, const std::vector<Rows>& rows)
      : BaseOptimizer(cfg, params, rows) {
    if (cfg_.momentum != 0) buf_ = state_like(params);
  }
  void step(std::vector<nn::Param>& params, double lr) override {
    check_params("sgd", shapes_, params);
    next_step();
    Tensor none;
    for_runs(params, buf_.runs.empty() ? std::vector<State*>{} : std::vector<State*>{&buf_},
             [&](Tensor& p, const Tensor& g, std::vector<Tensor>& st) {
               ops::sgd_step(p, g, st.empty() ? none : st[0], lr, cfg_.momentum, cfg_.weight_decay, cfg_.nesterov);
             });
  }
  std::vector<PlacedTensor> state() override {
    std::vector<PlacedTensor> s;
    for (size_t i = 0; i < buf_.params.size(); ++i) s.push_back(like_param("momentum", i, buf_.params[i]));
    s.push_back(step_state());
    return s;
  }

 private:
  State buf_;  // momentum != 0
};

class AdamW final : public BaseOptimizer {
 public:
  AdamW(const OptimConfig& cfg, const std::vector<nn::Param>& params, const std::vector<Rows>& rows)
      : BaseOptimizer(cfg, params, rows) {
    m_ = state_like(params);
    v_ = state_like(params);
  }
  void step(std::vector<nn::Param>& params, double lr) override {
    check_params("adamw", shapes_, params);
    const int64_t t = next_step();
    for_runs(params, {&m_, &v_}, [&](Tensor& p, const Tensor& g, std::vector<Tensor>& st) {
      ops::adamw_step(p, g, st[0], st[1], lr, cfg_.beta1, cfg_.beta2, cfg_.eps, cfg_.weight_decay, t);
    });
  }
  std::vector<PlacedTensor> state() override {
    std::vector<PlacedTensor> s;
    for (size_t i = 0; i < m_.params.size(); ++i) s.push_back(like_param("exp_avg", i, m_.params[i]));
    for (size_t i = 0; i < v_.params.size(); ++i) s.push_back(like_param("exp_avg_sq", i, v_.params[i]));
    s.push_back(step_state());
    return s;
  }

 private:
  State m_, v_;
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

namespace {

// The gradients as runs: neighbours laid end to end in one buffer joined (flat storage: the
// whole model is one run).
std::vector<Tensor> gradient_runs(const std::vector<nn::Param>& params) {
  std::vector<Tensor> runs;
  for (const auto& p : params) {
    if (!p.grad.defined()) fail_usage("clip_grad_norm: parameter " + p.name + " has no gradient");
    const Tensor g = p.grad.flatten();
    if (!runs.empty())
      if (Tensor j = Tensor::joined({runs.back(), g}); j.defined()) {
        runs.back() = j;
        continue;
      }
    runs.push_back(g);
  }
  return runs;
}

}  // namespace

// The norm of tensors together into norm (f64 [1] on their device), nothing read by the host:
// each tensor's norm from the backend's reduction (accumulated in f64 on CPU and GPU) into a
// vector of its dtype, cast to f64, whose own norm is the whole's.
void global_norm(const std::vector<Tensor>& parts, Tensor& norm) {
  Tensor norms = Tensor::zeros({static_cast<int64_t>(parts.size())}, DType::f64, norm.device());
  for (size_t k = 0; k < parts.size(); ++k) {
    const Tensor& p = parts[k];
    if (p.device() != norm.device())
      fail_usage("clip_grad_norm: gradients on {} and {}", p.device().str(), norm.device().str());
    Tensor one = norms.slice(static_cast<int64_t>(k), static_cast<int64_t>(k) + 1);
    if (p.dtype() == DType::f64) {
      ops::reduce(ops::Reduce::norm2, ops::Axis::all, p, one);
      continue;
    }
    Tensor n = Tensor::empty({1}, p.dtype(), p.device());
    ops::reduce(ops::Reduce::norm2, ops::Axis::all, p, n);
    ops::cast(n, one);
  }
  ops::reduce(ops::Reduce::norm2, ops::Axis::all, norms, norm);
}

void clip_grad_norm(std::vector<nn::Param>& params, double max_norm, Tensor& norm) {
  if (!(max_norm >= 0) || std::isnan(max_norm)) fail_usage("clip_grad_norm: max_norm must be >= 0, got {}", max_norm);
  if (!norm.defined() || norm.dtype() != DType::f64 || norm.numel() != 1)
    fail_usage("clip_grad_norm: norm must be f64 [1], got " + (norm.defined() ? norm.str() : std::string("none")));
  std::vector<Tensor> runs = gradient_runs(params);
  global_norm(runs, norm);
  if (max_norm > 0)
    for (Tensor& g : runs) ops::clip_scale(g, norm, max_norm);
}

double clip_grad_norm(std::vector<nn::Param>& params, double max_norm) {
  Tensor norm = Tensor::zeros({1}, DType::f64, params.empty() ? Device::cpu() : params[0].grad.device());
  clip_grad_norm(params, max_norm, norm);
  return norm.item();
}

}  // namespace dtk::optim
