// optim: SGD (momentum, Nesterov, weight decay) and AdamW (decoupled weight decay, bias
// correction) against f64 references written here over several steps; schedules at their key
// steps and edge cases; global-norm clipping; configs; state saved and restored into a fresh
// optimizer continuing bit-identically.
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <random>
#include <vector>

#include "dtk/core/error.h"
#include "dtk/ops/ops.h"
#include "dtk/optim/optimizer.h"
#include "../common/test_util.h"

namespace dtk::optim {
namespace {

using test_util::from_json;
using test_util::random_values;
using test_util::Vec;

// Two parameters of awkward sizes, values from fixed seeds.
std::vector<nn::Param> make_params(DType t) {
  std::vector<nn::Param> ps;
  const std::vector<std::pair<std::string, Shape>> specs = {{"a.weight", {3, 5}}, {"b.bias", {7}}};
  uint64_t seed = 1;
  for (const auto& [name, shape] : specs) {
    const Vec v = random_values(static_cast<size_t>(shape_numel(shape)), seed++);
    ps.push_back({name, Tensor::from_doubles(v, shape, t), Tensor::zeros(shape, t), 0});
  }
  return ps;
}

// The gradient at a step: a function of the parameter and the step, g = 0.5 p + noise(step),
// so that the trajectory depends on the updates.
Vec grad_of(const Vec& p, int step, size_t which) {
  const Vec noise = random_values(p.size(), 1000 + 10 * static_cast<uint64_t>(step) + which);
  Vec g(p.size());
  for (size_t i = 0; i < p.size(); ++i) g[i] = 0.5 * p[i] + noise[i];
  return g;
}

void set_grads(std::vector<nn::Param>& ps, int step) {
  for (size_t i = 0; i < ps.size(); ++i) {
    const Vec g = grad_of(ps[i].value.to_doubles(), step, i);
    ps[i].grad.copy_from(Tensor::from_doubles(g, ps[i].grad.shape(), ps[i].grad.dtype()));
  }
}

// f64 reference of PyTorch's SGD for one tensor over `steps` steps from p0.
Vec ref_sgd(Vec p, size_t which, int steps, double lr, double mom, double wd, bool nesterov) {
  Vec buf(p.size(), 0.0);
  for (int s = 0; s < steps; ++s) {
    const Vec g0 = grad_of(p, s, which);
    for (size_t i = 0; i < p.size(); ++i) {
      double d = g0[i] + wd * p[i];
      if (mom != 0) {
        buf[i] = (s == 0 ? 0.0 : mom * buf[i]) + d;  // PyTorch starts the buffer at the first gradient
        d = nesterov ? d + mom * buf[i] : buf[i];
      }
      p[i] -= lr * d;
    }
  }
  return p;
}

Vec ref_adamw(Vec p, size_t which, int steps, double lr, double b1, double b2, double eps, double wd) {
  Vec m(p.size(), 0.0), v(p.size(), 0.0);
  for (int s = 0; s < steps; ++s) {
    const Vec g = grad_of(p, s, which);
    const int t = s + 1;
    for (size_t i = 0; i < p.size(); ++i) {
      p[i] -= lr * wd * p[i];
      m[i] = b1 * m[i] + (1 - b1) * g[i];
      v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
      const double mh = m[i] / (1 - std::pow(b1, t)), vh = v[i] / (1 - std::pow(b2, t));
      p[i] -= lr * mh / (std::sqrt(vh) + eps);
    }
  }
  return p;
}

double max_rel_diff(const Vec& x, const Vec& ref) {
  EXPECT_EQ(x.size(), ref.size());
  double m = 0;
  for (size_t i = 0; i < x.size(); ++i) m = std::max(m, std::fabs(x[i] - ref[i]) / std::max(1.0, std::fabs(ref[i])));
  return m;
}

void run_steps(Optimizer& opt, std::vector<nn::Param>& ps, int from, int to, double lr) {
  for (int s = from; s < to; ++s) {
    set_grads(ps, s);
    opt.step(ps, lr);
  }
}

struct SgdCase {
  double momentum, wd;
  bool nesterov;
};

TEST(Optim, SgdMatchesReference) {
  const int steps = 5;
  const double lr = 0.05;
  for (const SgdCase c : {SgdCase{0.0, 0.0, false}, SgdCase{0.0, 0.1, false}, SgdCase{0.9, 0.0, false},
                          SgdCase{0.9, 0.01, false}, SgdCase{0.8, 0.0, true}, SgdCase{0.9, 0.05, true}}) {
    for (DType t : {DType::f64, DType::f32}) {
      auto ps = make_params(t);
      std::vector<Vec> p0;
      for (auto& p : ps) p0.push_back(p.value.to_doubles());
      OptimConfig cfg;
      cfg.name = Kind::sgd;
      cfg.momentum = c.momentum;
      cfg.nesterov = c.nesterov;
      cfg.weight_decay = c.wd;
      auto opt = make_optimizer(cfg, ps);
      run_steps(*opt, ps, 0, steps, lr);
      for (size_t i = 0; i < ps.size(); ++i) {
        const Vec ref = ref_sgd(p0[i], i, steps, lr, c.momentum, c.wd, c.nesterov);
        EXPECT_LT(max_rel_diff(ps[i].value.to_doubles(), ref), t == DType::f64 ? 1e-13 : 2e-6)
            << "momentum " << c.momentum << " wd " << c.wd << " nesterov " << c.nesterov << " " << dtype_name(t);
      }
      const auto st = opt->state();
      ASSERT_EQ(st.back().name, "step");
      EXPECT_EQ(st.back().value.dtype(), DType::i64);
      EXPECT_EQ(st.back().value.item(), steps);
      EXPECT_EQ(st.size(), c.momentum != 0 ? ps.size() + 1 : 1u);
      if (c.momentum != 0) {
        EXPECT_EQ(st[0].name, "momentum/a.weight");
      }
    }
  }
}

TEST(Optim, AdamWMatchesReferenceWithBiasCorrection) {
  const int steps = 6;
  for (double wd : {0.0, 0.1}) {
    for (DType t : {DType::f64, DType::f32}) {
      auto ps = make_params(t);
      std::vector<Vec> p0;
      for (auto& p : ps) p0.push_back(p.value.to_doubles());
      OptimConfig cfg;
      cfg.name = Kind::adamw;
      cfg.beta1 = 0.9;
      cfg.beta2 = 0.95;
      cfg.eps = 1e-8;
      cfg.weight_decay = wd;
      auto opt = make_optimizer(cfg, ps);
      run_steps(*opt, ps, 0, steps, 0.01);
      for (size_t i = 0; i < ps.size(); ++i) {
        const Vec ref = ref_adamw(p0[i], i, steps, 0.01, 0.9, 0.95, 1e-8, wd);
        EXPECT_LT(max_rel_diff(ps[i].value.to_doubles(), ref), t == DType::f64 ? 1e-12 : 2e-6) << dtype_name(t);
      }
      // The first step of Adam moves every element by about lr (bias correction at work): checked
      // through the reference, and here directly for one step.
      auto q = make_params(t);
      const Vec before = q[1].value.to_doubles();
      auto opt1 = make_optimizer(cfg, q);
      run_steps(*opt1, q, 0, 1, 0.01);
      const Vec after = q[1].value.to_doubles();
      for (size_t k = 0; k < before.size(); ++k)
        EXPECT_NEAR(std::fabs(after[k] - before[k] * (1 - 0.01 * wd)), 0.01, 1e-6);
      const auto st = opt->state();
      ASSERT_EQ(st.size(), 2 * ps.size() + 1);
      EXPECT_EQ(st[0].name, "exp_avg/a.weight");
      EXPECT_EQ(st[2].name, "exp_avg_sq/a.weight");
      EXPECT_EQ(st.back().name, "step");
      EXPECT_EQ(st.back().value.item(), steps);
    }
  }
}

// Save the state after k steps, build a fresh optimizer, copy the state in, continue: the same
// bits as the run that never stopped.
TEST(Optim, StateRoundTripIsBitIdentical) {
  for (const std::string name : {"sgd", "adamw"}) {
    OptimConfig cfg;
    cfg.name = parse_enum<Kind>(name, "name");
    cfg.momentum = 0.9;
    cfg.nesterov = true;
    cfg.weight_decay = 0.01;
    auto ps_a = make_params(DType::f32);
    auto opt_a = make_optimizer(cfg, ps_a);
    run_steps(*opt_a, ps_a, 0, 7, 0.02);

    auto ps_b = make_params(DType::f32);
    auto opt_b = make_optimizer(cfg, ps_b);
    run_steps(*opt_b, ps_b, 0, 4, 0.02);
    std::vector<std::pair<std::string, Tensor>> saved;
    for (const PlacedTensor& t : opt_b->state()) saved.emplace_back(t.name, t.value.clone());
    std::vector<Tensor> values;
    for (auto& p : ps_b) values.push_back(p.value.clone());
    opt_b.reset();

    auto ps_c = make_params(DType::f32);
    for (size_t i = 0; i < ps_c.size(); ++i) ps_c[i].value.copy_from(values[i]);
    auto opt_c = make_optimizer(cfg, ps_c);
    auto st = opt_c->state();
    ASSERT_EQ(st.size(), saved.size());
    for (size_t i = 0; i < st.size(); ++i) {
      EXPECT_EQ(st[i].name, saved[i].first);
      EXPECT_EQ(st[i].placement, Placement::replicated);
      st[i].value.copy_from(saved[i].second);
    }
    run_steps(*opt_c, ps_c, 4, 7, 0.02);
    for (size_t i = 0; i < ps_a.size(); ++i) EXPECT_EQ(ps_c[i].value.to_doubles(), ps_a[i].value.to_doubles()) << name;
  }
}

// make_params' parameters as views into one flat value buffer and one flat gradient buffer, as
// flat storage and FSDP's shards lay them out.
std::vector<nn::Param> make_flat_params(DType t) {
  std::vector<nn::Param> ps = make_params(t);
  int64_t n = 0;
  for (const auto& p : ps) n += p.value.numel();
  Tensor values = Tensor::empty({n}, t), grads = Tensor::zeros({n}, t);
  int64_t at = 0;
  for (auto& p : ps) {
    const int64_t k = p.value.numel();
    Tensor v = values.slice(at, at + k).reshape(p.value.shape());
    v.copy_from(p.value);
    p.value = v;
    p.grad = grads.slice(at, at + k).reshape(p.grad.shape());
    at += k;
  }
  return ps;
}

// Over parameters laid end to end the optimizers step once over the joined run (one launch for a
// model), with state views into one buffer: bit-identical to the step per tensor, and the state
// restores through its views.
TEST(Optim, MultiTensorStepEqualsPerTensorStep) {
  for (const std::string name : {"sgd", "adamw"}) {
    OptimConfig cfg;
    cfg.name = parse_enum<Kind>(name, "name");
    cfg.momentum = 0.9;
    cfg.weight_decay = 0.01;
    auto ps = make_params(DType::f32), flat = make_flat_params(DType::f32);
    ASSERT_TRUE(Tensor::joined({flat[0].value, flat[1].value}).defined());
    ASSERT_FALSE(Tensor::joined({ps[0].value, ps[1].value}).defined());
    auto a = make_optimizer(cfg, ps), b = make_optimizer(cfg, flat);
    run_steps(*a, ps, 0, 5, 0.03);
    run_steps(*b, flat, 0, 5, 0.03);
    for (size_t i = 0; i < ps.size(); ++i) EXPECT_EQ(flat[i].value.to_doubles(), ps[i].value.to_doubles()) << name;
    auto sa = a->state(), sb = b->state();
    ASSERT_EQ(sa.size(), sb.size());
    for (size_t i = 0; i < sa.size(); ++i) {
      EXPECT_EQ(sb[i].name, sa[i].name);
      EXPECT_EQ(sb[i].value.shape(), sa[i].value.shape());
      EXPECT_EQ(sb[i].value.to_doubles(), sa[i].value.to_doubles()) << sa[i].name;
    }
    // Restored into a fresh optimizer's views, it continues bit for bit.
    auto flat2 = make_flat_params(DType::f32);
    for (size_t i = 0; i < flat2.size(); ++i) flat2[i].value.copy_from(flat[i].value);
    auto c = make_optimizer(cfg, flat2);
    auto sc = c->state();
    for (size_t i = 0; i < sc.size(); ++i) sc[i].value.copy_from(sb[i].value);
    run_steps(*b, flat, 5, 8, 0.03);
    run_steps(*c, flat2, 5, 8, 0.03);
    for (size_t i = 0; i < flat.size(); ++i) EXPECT_EQ(flat2[i].value.to_doubles(), flat[i].value.to_doubles()) << name;
  }
}

// State shaped like a parameter is placed like it: sharded with the parameter's rows when the
// parameters are shards (Parallelism::param_rows()), else replicated; the step is replicated.
TEST(Optim, StateIsPlacedLikeItsParameter) {
  for (Kind k : {Kind::adamw, Kind::sgd}) {
    OptimConfig cfg;
    cfg.name = k;
    auto ps = make_params(DType::f32);
    for (const PlacedTensor& t : make_optimizer(cfg, ps)->state()) EXPECT_EQ(t.placement, Placement::replicated) << t.name;
    // a.weight is rows [2, 5) of a [6, 5] tensor over 2 ranks; b.bias is whole.
    std::vector<Rows> rows(2);
    rows[0] = {{6, 5}, {0, 3}, {3, 3}, 1};
    size_t sharded = 0;
    for (const PlacedTensor& t : make_optimizer(cfg, ps, rows)->state()) {
      const bool a = t.name.find("/a.weight") != std::string::npos;
      EXPECT_EQ(t.placement, a ? Placement::sharded : Placement::replicated) << t.name;
      EXPECT_FALSE(t.symmetric);
      if (!a) continue;
      ++sharded;
      EXPECT_EQ(t.rows.shape, (Shape{6, 5}));
      EXPECT_EQ(t.rows.offsets, (std::vector<int64_t>{0, 3}));
      EXPECT_EQ(t.rows.rank, 1);
    }
    EXPECT_EQ(sharded, k == Kind::adamw ? 2u : 1u);
    EXPECT_THROW(make_optimizer(cfg, ps, std::vector<Rows>(3)), Error);
  }
}

TEST(Optim, ConfigJsonAndValidation) {
  OptimConfig c;
  c.name = Kind::sgd;
  c.momentum = 0.5;
  c.nesterov = true;
  c.weight_decay = 0.25;
  const OptimConfig d = from_json<OptimConfig>(nlohmann::json(c));
  EXPECT_EQ(d.name, Kind::sgd);
  EXPECT_EQ(d.momentum, 0.5);
  EXPECT_TRUE(d.nesterov);
  EXPECT_EQ(d.weight_decay, 0.25);
  EXPECT_EQ(from_json<OptimConfig>({{"name", "adamw"}}).beta2, 0.95);  // defaults for missing keys
  auto expect_usage = [](const nlohmann::json& j, const std::string& word) {
    try {
      from_json<OptimConfig>(j);
      ADD_FAILURE() << "no error for " << j.dump();
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(word), std::string::npos) << e.what();
    }
  };
  expect_usage({{"name", "lamb"}}, "lamb");
  expect_usage({{"name", "sgd"}, {"momentum", "high"}}, "momentum");
  expect_usage({{"name", "sgd"}, {"momentum", 1.5}}, "momentum");
  expect_usage({{"name", "sgd"}, {"momentum", 0.0}, {"nesterov", true}}, "nesterov");
  expect_usage({{"name", "adamw"}, {"beta2", 1.0}}, "beta2");
  expect_usage({{"name", "adamw"}, {"eps", 0.0}}, "eps");
  expect_usage({{"name", "adamw"}, {"weight_decay", -1.0}}, "weight_decay");
  expect_usage({{"name", "adamw"}, {"betas", 1}}, "betas");
  expect_usage(nlohmann::json::array(), "object");
  // A step with other parameters than the optimizer was built for.
  auto ps = make_params(DType::f32);
  auto opt = make_optimizer({}, ps);
  std::vector<nn::Param> fewer(ps.begin(), ps.begin() + 1);
  EXPECT_THROW(opt->step(fewer, 0.1), UsageError);
}

TEST(Optim, ScheduleKeySteps) {
  const double lr = 0.1;
  Schedule s{ScheduleKind::cosine, lr, 10, 110, 0.1};
  EXPECT_DOUBLE_EQ(s.at(0), lr / 10);
  EXPECT_DOUBLE_EQ(s.at(4), lr * 5 / 10);
  EXPECT_DOUBLE_EQ(s.at(9), lr);
  EXPECT_DOUBLE_EQ(s.at(10), lr);                       // decay starts at lr
  EXPECT_NEAR(s.at(60), lr * (0.1 + 0.9 * 0.5), 1e-15);  // halfway: the mean of lr and the floor
  EXPECT_NEAR(s.at(35), lr * (0.1 + 0.9 * 0.5 * (1 + std::cos(std::numbers::pi * 0.25))), 1e-15);
  EXPECT_DOUBLE_EQ(s.at(110), lr * 0.1);
  EXPECT_DOUBLE_EQ(s.at(1000), lr * 0.1);
  for (int64_t k = 10; k < 110; ++k) EXPECT_GE(s.at(k), s.at(k + 1));  // monotone decay

  Schedule l{ScheduleKind::linear, lr, 0, 100, 0.0};
  EXPECT_DOUBLE_EQ(l.at(0), lr);  // warmup 0: no warm-up
  EXPECT_DOUBLE_EQ(l.at(25), lr * 0.75);
  EXPECT_DOUBLE_EQ(l.at(50), lr * 0.5);
  EXPECT_DOUBLE_EQ(l.at(100), 0.0);
  EXPECT_DOUBLE_EQ(l.at(150), 0.0);

  Schedule c{ScheduleKind::constant, lr, 4, 10, 0.1};
  EXPECT_DOUBLE_EQ(c.at(0), lr / 4);
  EXPECT_DOUBLE_EQ(c.at(3), lr);
  EXPECT_DOUBLE_EQ(c.at(4), lr);
  EXPECT_DOUBLE_EQ(c.at(1000), lr);
  Schedule c0{ScheduleKind::constant, lr, 0, 1, 0.1};
  EXPECT_DOUBLE_EQ(c0.at(0), lr);

  // total <= warmup: the warm-up still reaches lr, then the rate is at its floor.
  Schedule t{ScheduleKind::cosine, lr, 10, 5, 0.2};
  EXPECT_DOUBLE_EQ(t.at(9), lr);
  EXPECT_DOUBLE_EQ(t.at(10), lr * 0.2);
  Schedule t2{ScheduleKind::linear, lr, 10, 10, 0.2};
  EXPECT_DOUBLE_EQ(t2.at(10), lr * 0.2);
  // warmup 1: full rate from the first step.
  Schedule w1{ScheduleKind::cosine, lr, 1, 3, 0.0};
  EXPECT_DOUBLE_EQ(w1.at(0), lr);
  EXPECT_DOUBLE_EQ(w1.at(1), lr);
  EXPECT_NEAR(w1.at(2), lr * 0.5, 1e-15);
  EXPECT_DOUBLE_EQ(w1.at(3), 0.0);

  // Step decay (MultiStepLR): the factor once more at each decay step, after the warm-up.
  Schedule st{ScheduleKind::step, lr, 5, 100, 0.0, {30, 60, 90}, 0.1};
  EXPECT_DOUBLE_EQ(st.at(0), lr / 5);
  EXPECT_DOUBLE_EQ(st.at(5), lr);
  EXPECT_DOUBLE_EQ(st.at(29), lr);
  EXPECT_DOUBLE_EQ(st.at(30), lr * 0.1);
  EXPECT_DOUBLE_EQ(st.at(59), lr * 0.1);
  EXPECT_DOUBLE_EQ(st.at(60), lr * 0.1 * 0.1);
  EXPECT_DOUBLE_EQ(st.at(99), lr * 0.1 * 0.1 * 0.1);
  Schedule early{ScheduleKind::step, lr, 10, 100, 0.0, {3}, 0.5};  // a decay within the warm-up: at its end
  EXPECT_DOUBLE_EQ(early.at(9), lr);
  EXPECT_DOUBLE_EQ(early.at(10), lr * 0.5);
  Schedule bad{ScheduleKind::step, lr, 0, 100, 0.0, {30, 30}, 0.1};
  EXPECT_THROW(bad.at(40), UsageError);

  EXPECT_THROW((Schedule{ScheduleKind::cosine, lr, 0, 10, 1.5}.at(0)), UsageError);
  EXPECT_THROW((Schedule{ScheduleKind::cosine, lr, -1, 10, 0.1}.at(0)), UsageError);
  EXPECT_THROW(s.at(-1), UsageError);
}

TEST(Optim, ClipGradNorm) {
  auto ps = make_params(DType::f32);
  set_grads(ps, 0);
  double sq = 0;
  std::vector<Vec> g0;
  for (auto& p : ps) {
    g0.push_back(p.grad.to_doubles());
    for (double x : g0.back()) sq += x * x;
  }
  const double norm = std::sqrt(sq);
  // Above the norm: nothing changes, the norm is returned.
  EXPECT_NEAR(clip_grad_norm(ps, norm * 2), norm, 1e-6 * norm);
  for (size_t i = 0; i < ps.size(); ++i) EXPECT_EQ(ps[i].grad.to_doubles(), g0[i]);
  // max_norm 0: no clipping.
  EXPECT_NEAR(clip_grad_norm(ps, 0), norm, 1e-6 * norm);
  for (size_t i = 0; i < ps.size(); ++i) EXPECT_EQ(ps[i].grad.to_doubles(), g0[i]);
  // Below: every gradient scaled by max_norm / norm, the new global norm is max_norm.
  const double max_norm = norm / 3;
  EXPECT_NEAR(clip_grad_norm(ps, max_norm), norm, 1e-6 * norm);
  for (size_t i = 0; i < ps.size(); ++i) {
    const Vec g = ps[i].grad.to_doubles();
    for (size_t k = 0; k < g.size(); ++k) EXPECT_NEAR(g[k], g0[i][k] / 3, 1e-6);
  }
  EXPECT_NEAR(clip_grad_norm(ps, 0), max_norm, 1e-6 * norm);
  // f64 accumulation: a norm whose squares overflow f32's range is still finite and exact.
  std::vector<nn::Param> big{{"x", Tensor::zeros({4}, DType::f32), Tensor::from_doubles({3e20, 4e20, 0, 0}, {4}, DType::f32), 0},
                             {"y", Tensor::zeros({1}, DType::f32), Tensor::from_doubles({12e20}, {1}, DType::f32), 0}};
  EXPECT_NEAR(clip_grad_norm(big, 0), 13e20, 1e14);
  // A non-finite norm is returned and nothing is scaled.
  std::vector<nn::Param> bad{{"z", Tensor::zeros({2}, DType::f32), Tensor::from_doubles({NAN, 1}, {2}, DType::f32), 0}};
  EXPECT_TRUE(std::isnan(clip_grad_norm(bad, 1.0)));
  EXPECT_EQ(bad[0].grad.to_doubles()[1], 1.0);
  std::vector<nn::Param> none;
  EXPECT_EQ(clip_grad_norm(none, 1.0), 0.0);
  // Gradients laid end to end: one reduction over the run, the same norm and scaling.
  auto sep = make_params(DType::f32), flat = make_flat_params(DType::f32);
  set_grads(sep, 3);
  set_grads(flat, 3);
  const double n_sep = clip_grad_norm(sep, 0.5), n_flat = clip_grad_norm(flat, 0.5);
  EXPECT_NEAR(n_flat, n_sep, 1e-6 * n_sep);
  for (size_t i = 0; i < sep.size(); ++i) {
    const Vec a = sep[i].grad.to_doubles(), b = flat[i].grad.to_doubles();
    for (size_t k = 0; k < a.size(); ++k) EXPECT_NEAR(b[k], a[k], 1e-6);
  }
}

}  // namespace
}  // namespace dtk::optim
