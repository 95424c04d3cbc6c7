// dtk::nn: every layer and both models against central finite differences in f64 on the CPU;
// activation checkpointing (none, full, selective: bit-identical, and what each keeps), the
// grad-ready hook, init, presets, configs, batch checks and buffer reuse.
#include <gtest/gtest.h>

#include <cctype>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <map>
#include <string>
#include <vector>

#include "dtk/core/error.h"
#include "dtk/core/philox.h"
#include "dtk/core/tensor.h"
#include "dtk/nn/layers.h"
#include "dtk/nn/model.h"
#include "dtk/ops/ops.h"
#include "../common/nn_util.h"
#include "../common/test_util.h"

namespace dtk::nn {
namespace {

using test_util::from_json;
using test_util::randn;
using test_util::Vec;
using namespace test_models;

constexpr double kFdStep = 1e-6;
constexpr double kFdTol = 1e-6;  // relative, with a floor of 1e-3 on the gradient's size



// Records the block hooks as "<event><block>": f/F before/after a training forward, e/E of an
// evaluation, r/R of a recomputation, b/B before/after backward; on_after_backward runs at B.
struct HookLog final : BlockHooks {
  std::vector<std::string> events;
  std::function<void(int)> on_after_backward;
  static char tag(Pass p) { return p == Pass::train ? 'f' : p == Pass::evaluate ? 'e' : 'r'; }
  void before_forward(int b, Pass p) override { events.push_back(std::string(1, tag(p)) + std::to_string(b)); }
  void after_forward(int b, Pass p) override {
    events.push_back(std::string(1, static_cast<char>(std::toupper(tag(p)))) + std::to_string(b));
  }
  void before_backward(int b) override { events.push_back("b" + std::to_string(b)); }
  void after_backward(int b) override {
    events.push_back("B" + std::to_string(b));
    if (on_after_backward) on_after_backward(b);
  }
  std::vector<int> ready_order() const {
    std::vector<int> out;
    for (const auto& e : events)
      if (e[0] == 'B') out.push_back(std::stoi(e.substr(1)));
    return out;
  }
};

// A parameter outside a model (layer tests): f64 value, zero grad.
Param make_param(const std::string& name, const Shape& s, uint64_t seed, double scale = 0.5, double mean = 0.0) {
  Param p;
  p.name = name;
  p.value = rand_tensor(s, seed, scale, mean);
  p.grad = Tensor::zeros(s, DType::f64);
  p.shape = s;
  return p;
}

// sum(y * r): the scalar whose gradient with respect to y is r.
double weighted_sum(const Tensor& y, const Tensor& r) { return ops::dot(y, r); }

struct Checked {
  std::string name;
  Tensor value;  // f64 on the CPU, perturbed in place
  Tensor grad;   // the analytic gradient of loss() with respect to value
};

// Central differences of loss() at up to max_coords coordinates of each tensor (all when the
// tensor is small), against the analytic gradients.
void check_gradients(const std::function<double()>& loss, const std::vector<Checked>& tensors, int max_coords = 12,
                     uint64_t seed = 99) {
  for (const Checked& c : tensors) {
    ASSERT_EQ(c.value.dtype(), DType::f64) << c.name;
    ASSERT_EQ(c.value.numel(), c.grad.numel()) << c.name;
    const Vec analytic = c.grad.to_doubles();
    double* x = c.value.ptr<double>();
    const int64_t n = c.value.numel();
    std::vector<int64_t> coords;
    if (n <= max_coords) {
      for (int64_t i = 0; i < n; ++i) coords.push_back(i);
    } else {
      for (int k = 0; k < max_coords; ++k)
        coords.push_back(static_cast<int64_t>(philox::uniform(seed, static_cast<uint64_t>(k) + 1000 * coords.size()) *
                                              static_cast<double>(n)) %
                         n);
    }
    int bad = 0;
    double worst = 0;
    for (int64_t i : coords) {
      const double x0 = x[i];
      x[i] = x0 + kFdStep;
      const double lp = loss();
      x[i] = x0 - kFdStep;
      const double lm = loss();
      x[i] = x0;
      const double numeric = (lp - lm) / (2 * kFdStep);
      const double a = analytic[static_cast<size_t>(i)];
      const double err = std::fabs(a - numeric) / std::max({std::fabs(a), std::fabs(numeric), 1e-3});
      worst = std::max(worst, err);
      if (!(err <= kFdTol)) {
        if (bad < 5) ADD_FAILURE() << c.name << "[" << i << "]: analytic " << a << ", numeric " << numeric;
        ++bad;
      }
    }
    EXPECT_EQ(bad, 0) << c.name << " worst relative error " << worst;
  }
}

// ---------------------------------------------------------------------------- layers

TEST(NnLayers, LinearWithAndWithoutBias) {
  for (bool bias : {true, false}) {
    Param w = make_param("w", {4, 5}, 1);
    Param b = make_param("b", {4}, 2);
    Tensor x = rand_tensor({2, 3, 5}, 3);
    Tensor r = rand_tensor({2, 3, 4}, 4);
    Tensor y = Tensor::empty({2, 3, 4}, DType::f64);
    Linear lin;
    lin.bind(&w, bias ? &b : nullptr);
    const auto loss = [&] {
      lin.forward(x, y);
      return weighted_sum(y, r);
    };
    loss();
    // Forward against a plain reference.
    const Vec xv = x.to_doubles(), wv = w.value.to_doubles(), bv = b.value.to_doubles(), yv = y.to_doubles();
    for (int64_t n = 0; n < 6; ++n)
      for (int64_t o = 0; o < 4; ++o) {
        double s = bias ? bv[o] : 0.0;
        for (int64_t i = 0; i < 5; ++i) s += xv[n * 5 + i] * wv[o * 5 + i];
        EXPECT_NEAR(yv[n * 4 + o], s, 1e-12);
      }
    Tensor dx = Tensor::empty(x.shape(), DType::f64);
    lin.backward(r, &dx);
    std::vector<Checked> checked{{"w", w.value, w.grad}, {"x", x, dx}};
    if (bias) checked.push_back({"b", b.value, b.grad});
    check_gradients(loss, checked);
    if (!bias) {
      EXPECT_EQ(ops::reduce_all(ops::Reduce::absmax, b.grad), 0.0);
    }
    // Grads accumulate, and dx accumulates on request.
    const Vec g1 = w.grad.to_doubles(), dx1 = dx.to_doubles();
    loss();
    lin.backward(r, &dx, true);
    const Vec g2 = w.grad.to_doubles(), dx2 = dx.to_doubles();
    for (size_t i = 0; i < g1.size(); ++i) EXPECT_NEAR(g2[i], 2 * g1[i], 1e-12);
    for (size_t i = 0; i < dx1.size(); ++i) EXPECT_NEAR(dx2[i], 2 * dx1[i], 1e-12);
  }
}

// Inside a ComputeScope(tf32), Linear's three weight products are gemm's tf32 ones (x W^T,
// dy^T x, dy W), bit for bit; outside it, exact again.
TEST(NnLayers, LinearTf32Products) {
  const auto f32 = [](const Tensor& t) {
    Tensor o = Tensor::empty(t.shape(), DType::f32);
    ops::cast(t, o);
    return o;
  };
  Param w;
  w.value = f32(rand_tensor({4, 5}, 1));
  w.grad = Tensor::zeros({4, 5}, DType::f32);
  w.shape = {4, 5};
  const Tensor x = f32(rand_tensor({6, 5}, 3)), dy = f32(rand_tensor({6, 4}, 4));
  Tensor y = Tensor::empty({6, 4}, DType::f32), dx = Tensor::empty({6, 5}, DType::f32);
  Tensor want_y = y.clone(), want_dx = dx.clone(), want_dw = Tensor::zeros({4, 5}, DType::f32);
  ops::gemm(false, true, 1.0, x, w.value, 0.0, want_y, ops::Math::tf32);
  ops::gemm(true, false, 1.0, dy, x, 1.0, want_dw, ops::Math::tf32);
  ops::gemm(false, false, 1.0, dy, w.value, 0.0, want_dx, ops::Math::tf32);
  Linear lin;
  lin.bind(&w);
  {
    ComputeScope scope(ops::Math::tf32, false);
    EXPECT_EQ(gemm_math(), ops::Math::tf32);
    lin.forward(x, y);
    lin.backward(dy, &dx);
  }
  EXPECT_EQ(gemm_math(), ops::Math::exact);
  EXPECT_EQ(y.to_doubles(), want_y.to_doubles());
  EXPECT_EQ(dx.to_doubles(), want_dx.to_doubles());
  EXPECT_EQ(w.grad.to_doubles(), want_dw.to_doubles());
  Tensor exact_y = y.clone();
  ops::gemm(false, true, 1.0, x, w.value, 0.0, exact_y);
  EXPECT_NE(exact_y.to_doubles(), want_y.to_doubles());
}

// Conv2d: the ops' convolution through the layer; gradients by central differences.
TEST(NnLayers, Conv2dStrideAndPadding) {
  Param w = make_param("w", {3, 2, 3, 3}, 11);
  Tensor x = rand_tensor({2, 2, 5, 6}, 12);
  Conv2d conv;
  conv.bind(&w, ops::Window{3, 3, 2, 2, 1, 1});
  const Shape out = conv.out_shape(x.shape());
  EXPECT_EQ(out, (Shape{2, 3, 3, 3}));
  Tensor y = Tensor::empty(out, DType::f64), r = rand_tensor(out, 13), dx = Tensor::empty(x.shape(), DType::f64);
  const auto loss = [&] {
    conv.forward(x, y);
    return weighted_sum(y, r);
  };
  loss();
  conv.backward(r, &dx);
  check_gradients(loss, {{"w", w.value, w.grad}, {"x", x, dx}});
  Param bad = make_param("bad", {3, 2, 2, 2}, 14);
  EXPECT_THROW(conv.bind(&bad, ops::Window{3, 3, 1, 1, 1, 1}), UsageError);
}

// BatchNorm2d in training: batch statistics (biased variance), running statistics moved by the
// momentum (unbiased variance), gradients of x, gamma and beta by central differences; in
// evaluation the running statistics, left unchanged.
TEST(NnLayers, BatchNorm2dTrainingAndEvaluation) {
  const int64_t N = 3, C = 2, H = 2, W = 3, L = H * W;
  Param g = make_param("g", {C}, 21, 0.5, 1.0), b = make_param("b", {C}, 22);
  Tensor rm = rand_tensor({C}, 23), rv = Tensor::from_doubles({0.5, 2.0}, {C}, DType::f64);
  const Vec rm0 = rm.to_doubles(), rv0 = rv.to_doubles();
  Tensor x = rand_tensor({N, C, H, W}, 24, 2.0, 0.5), r = rand_tensor({N, C, H, W}, 25);
  Tensor y = Tensor::empty(x.shape(), DType::f64), dx = Tensor::empty(x.shape(), DType::f64);
  BatchNorm2d bn;
  bn.bind(&g, &b, rm, rv, 1e-5, 0.1);
  bn.forward(x, y, Pass::train);
  const Vec xv = x.to_doubles(), yv = y.to_doubles(), gv = g.value.to_doubles(), bv = b.value.to_doubles();
  const Vec rm1 = rm.to_doubles(), rv1 = rv.to_doubles();
  for (int64_t c = 0; c < C; ++c) {
    double m = 0, v = 0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t l = 0; l < L; ++l) m += xv[(n * C + c) * L + l];
    m /= N * L;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t l = 0; l < L; ++l) v += std::pow(xv[(n * C + c) * L + l] - m, 2);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t l = 0; l < L; ++l) {
        const size_t i = static_cast<size_t>((n * C + c) * L + l);
        EXPECT_NEAR(yv[i], (xv[i] - m) / std::sqrt(v / (N * L) + 1e-5) * gv[c] + bv[c], 1e-12);
      }
    EXPECT_NEAR(rm1[c], 0.9 * rm0[c] + 0.1 * m, 1e-12);
    EXPECT_NEAR(rv1[c], 0.9 * rv0[c] + 0.1 * v / (N * L - 1), 1e-12);
  }
  bn.backward(r, dx);
  const auto loss = [&] {
    bn.forward(x, y, Pass::recompute);  // batch statistics, running statistics untouched
    return weighted_sum(y, r);
  };
  check_gradients(loss, {{"x", x, dx}, {"gamma", g.value, g.grad}, {"beta", b.value, b.grad}});
  EXPECT_EQ(rm.to_doubles(), rm1);  // recompute did not move them
  // Evaluation: the running statistics.
  bn.forward(x, y, Pass::evaluate);
  const Vec ye = y.to_doubles();
  for (int64_t i = 0; i < N * C * L; ++i) {
    const int64_t c = i / L % C;
    EXPECT_NEAR(ye[i], (xv[i] - rm1[c]) / std::sqrt(rv1[c] + 1e-5) * gv[c] + bv[c], 1e-12);
  }
  EXPECT_EQ(rm.to_doubles(), rm1);
  Tensor one = rand_tensor({1, C, 1, 1}, 26), yo = Tensor::empty({1, C, 1, 1}, DType::f64);
  EXPECT_THROW(bn.forward(one, yo, Pass::train), UsageError);  // one value per channel
}

// SyncBatchNorm: a half batch whose Sync adds the other half's sums normalises and
// differentiates exactly as the whole batch does.
TEST(NnLayers, BatchNorm2dSyncMatchesTheWholeBatch) {
  const int64_t N = 4, C = 3, H = 2, W = 2;
  Param g = make_param("g", {C}, 31, 0.5, 1.0), b = make_param("b", {C}, 32);
  Param g2 = g, b2 = b;
  g2.grad = Tensor::zeros({C}, DType::f64);
  b2.grad = Tensor::zeros({C}, DType::f64);
  Tensor x = rand_tensor({N, C, H, W}, 33, 1.5, 0.3), r = rand_tensor({N, C, H, W}, 34);
  BatchNorm2d whole, half;
  whole.bind(&g, &b, Tensor::zeros({C}, DType::f64), Tensor::from_doubles(Vec(C, 1.0), {C}, DType::f64));
  half.bind(&g2, &b2, Tensor::zeros({C}, DType::f64), Tensor::from_doubles(Vec(C, 1.0), {C}, DType::f64));
  Tensor y = Tensor::empty(x.shape(), DType::f64), dx = Tensor::empty(x.shape(), DType::f64);
  whole.forward(x, y, Pass::train);
  whole.backward(r, dx);
  // The other half's contributions, as another rank would all-reduce them.
  const Tensor xa = x.slice(0, 2), xb = x.slice(2, 4), ra = r.slice(0, 2), rb = r.slice(2, 4);
  Tensor fwd_b = Tensor::empty({2, C}, DType::f64), bwd_b = Tensor::empty({2, C}, DType::f64);
  ops::batchnorm_reduce(xb, fwd_b);
  bool backward_pass = false;
  half.set_sync([&](Tensor& sums, double& count) {
    ops::add(sums, backward_pass ? bwd_b : fwd_b, sums);
    count *= 2;
  });
  Tensor ya = Tensor::empty(xa.shape(), DType::f64), dxa = Tensor::empty(xa.shape(), DType::f64);
  half.forward(xa, ya, Pass::train);
  // The whole batch's statistics, which the sync gave the half too, for the other half's backward sums.
  Tensor mean = Tensor::empty({C}, DType::f64), invstd = Tensor::empty({C}, DType::f64);
  {
    Tensor sums = Tensor::empty({2, C}, DType::f64);
    ops::batchnorm_reduce(x, sums);
    const Vec s = sums.to_doubles();
    Vec m(C), is(C);
    const double n = static_cast<double>(N * H * W);
    for (int64_t c = 0; c < C; ++c) {
      m[c] = s[c] / n;
      is[c] = 1 / std::sqrt(s[C + c] / n - m[c] * m[c] + 1e-5);
    }
    mean = Tensor::from_doubles(m, {C}, DType::f64);
    invstd = Tensor::from_doubles(is, {C}, DType::f64);
  }
  ops::batchnorm_backward_reduce(rb, xb, mean, invstd, bwd_b);
  backward_pass = true;
  half.backward(ra, dxa);
  const Vec yw = y.to_doubles(), dxw = dx.to_doubles(), yh = ya.to_doubles(), dxh = dxa.to_doubles();
  for (size_t i = 0; i < yh.size(); ++i) {
    EXPECT_NEAR(yh[i], yw[i], 1e-12) << i;
    EXPECT_NEAR(dxh[i], dxw[i], 1e-12) << i;
  }
  // gamma and beta: this half's share only (the data-parallel gradient sum adds the other's).
  Tensor own = Tensor::empty({2, C}, DType::f64);
  ops::batchnorm_backward_reduce(ra, xa, mean, invstd, own);
  const Vec o = own.to_doubles(), gb = b2.grad.to_doubles(), gg = g2.grad.to_doubles();
  for (int64_t c = 0; c < C; ++c) {
    EXPECT_NEAR(gb[c], o[c], 1e-12);
    EXPECT_NEAR(gg[c], o[C + c], 1e-12);
  }
}

TEST(NnLayers, GlobalAvgPool) {
  Tensor x = rand_tensor({2, 3, 2, 4}, 41), r = rand_tensor({2, 3}, 42);
  Tensor y = Tensor::empty({2, 3}, DType::f64), dx = Tensor::empty(x.shape(), DType::f64);
  GlobalAvgPool pool;
  const auto loss = [&] {
    pool.forward(x, y);
    return weighted_sum(y, r);
  };
  loss();
  const Vec xv = x.to_doubles(), yv = y.to_doubles();
  for (int64_t i = 0; i < 6; ++i) {
    double s = 0;
    for (int64_t j = 0; j < 8; ++j) s += xv[i * 8 + j];
    EXPECT_NEAR(yv[i], s / 8, 1e-14);
  }
  pool.backward(r, dx);
  check_gradients(loss, {{"x", x, dx}});
}

TEST(NnLayers, Embedding) {
  Param table = make_param("table", {7, 3}, 5);
  Tensor ids = ids_tensor({1, 4, 1, 6, 0, 4, 4, 2}, {2, 4});
  Tensor r = rand_tensor({2, 4, 3}, 6);
  Tensor out = Tensor::empty({2, 4, 3}, DType::f64);
  Embedding emb;
  emb.bind(&table);
  const auto loss = [&] {
    emb.forward(ids, out);
    return weighted_sum(out, r);
  };
  loss();
  EXPECT_EQ(out.to_doubles()[3], table.value.to_doubles()[4 * 3]);
  emb.backward(r);
  check_gradients(loss, {{"table", table.value, table.grad}}, 100);
}

TEST(NnLayers, RMSNorm) {
  Param w = make_param("w", {8}, 7, 0.3, 1.0);
  Tensor x = rand_tensor({2, 3, 8}, 8);
  Tensor r = rand_tensor({2, 3, 8}, 9);
  Tensor y = Tensor::empty(x.shape(), DType::f64);
  RMSNorm norm;
  norm.bind(&w, 1e-5);
  const auto loss = [&] {
    norm.forward(x, y);
    return weighted_sum(y, r);
  };
  loss();
  const Vec xv = x.to_doubles(), wv = w.value.to_doubles(), yv = y.to_doubles();
  for (int row = 0; row < 6; ++row) {
    double ms = 0;
    for (int d = 0; d < 8; ++d) ms += xv[row * 8 + d] * xv[row * 8 + d];
    const double rstd = 1 / std::sqrt(ms / 8 + 1e-5);
    for (int d = 0; d < 8; ++d) EXPECT_NEAR(yv[row * 8 + d], xv[row * 8 + d] * rstd * wv[d], 1e-12);
  }
  Tensor dx = Tensor::empty(x.shape(), DType::f64);
  norm.backward(r, dx);
  check_gradients(loss, {{"w", w.value, w.grad}, {"x", x, dx}}, 48);
}

void attention_case(int64_t H, int64_t Hkv, int64_t hd, int64_t B, int64_t T) {
  const int64_t D = 8;
  Param wq = make_param("wq", {H * hd, D}, 10), wk = make_param("wk", {Hkv * hd, D}, 11);
  Param wv = make_param("wv", {Hkv * hd, D}, 12), wo = make_param("wo", {D, H * hd}, 13);
  Tensor x = rand_tensor({B, T, D}, 14);
  Tensor r = rand_tensor({B, T, D}, 15);
  Tensor y = Tensor::empty(x.shape(), DType::f64);
  Attention attn;
  attn.bind(&wq, &wk, &wv, &wo, {H, Hkv, hd, 10000.0});
  const auto loss = [&] {
    attn.forward(x, y);
    return weighted_sum(y, r);
  };
  loss();
  Workspace ws;
  Tensor dx = Tensor::empty(x.shape(), DType::f64);
  attn.backward(r, dx, ws, 1);
  check_gradients(loss, {{"wq", wq.value, wq.grad},
                         {"wk", wk.value, wk.grad},
                         {"wv", wv.value, wv.grad},
                         {"wo", wo.value, wo.grad},
                         {"x", x, dx}},
                  24);
}

TEST(NnLayers, AttentionGqaRope) {
  attention_case(2, 1, 4, 2, 5);  // grouped-query, 2 query heads per kv head
  attention_case(4, 2, 2, 1, 6);
  attention_case(2, 2, 4, 2, 3);  // multi-head
}

TEST(NnLayers, AttentionIsCausal) {
  // The output at position t does not depend on the inputs after t.
  const int64_t D = 8, T = 5;
  Param wq = make_param("wq", {8, D}, 20), wk = make_param("wk", {4, D}, 21);
  Param wv = make_param("wv", {4, D}, 22), wo = make_param("wo", {D, 8}, 23);
  Attention attn;
  attn.bind(&wq, &wk, &wv, &wo, {2, 1, 4, 10000.0});
  Tensor x = rand_tensor({1, T, D}, 24);
  Tensor y1 = Tensor::empty(x.shape(), DType::f64), y2 = Tensor::empty(x.shape(), DType::f64);
  attn.forward(x, y1);
  x.ptr<double>()[4 * D + 3] += 1.0;  // change the last position only
  attn.forward(x, y2);
  const Vec a = y1.to_doubles(), b = y2.to_doubles();
  for (int64_t i = 0; i < 4 * D; ++i) EXPECT_EQ(a[i], b[i]);
  EXPECT_NE(a[4 * D], b[4 * D]);
}

TEST(NnLayers, FeedForwardSwiGLU) {
  Param w1 = make_param("w1", {6, 8}, 30), w2 = make_param("w2", {8, 6}, 31), w3 = make_param("w3", {6, 8}, 32);
  Tensor x = rand_tensor({2, 5, 8}, 33);
  Tensor r = rand_tensor({2, 5, 8}, 34);
  Tensor y = Tensor::empty(x.shape(), DType::f64);
  FeedForward ffn;
  ffn.bind(&w1, &w2, &w3);
  const auto loss = [&] {
    ffn.forward(x, y);
    return weighted_sum(y, r);
  };
  loss();
  Workspace ws;
  Tensor dx = Tensor::empty(x.shape(), DType::f64);
  ffn.backward(r, dx, ws);
  check_gradients(loss, {{"w1", w1.value, w1.grad}, {"w2", w2.value, w2.grad}, {"w3", w3.value, w3.grad}, {"x", x, dx}},
                  24);
}

TEST(NnLayers, CrossEntropyMeanOverCountedTargets) {
  Tensor logits = rand_tensor({6, 5}, 40, 2.0);
  Tensor targets = ids_tensor({0, 4, -1, 2, 2, 1}, {2, 3});
  CrossEntropy ce;
  const double scale = 1.7;
  const auto loss = [&] { return scale * ce.forward(logits, targets); };
  const double l = ce.forward(logits, targets);
  EXPECT_EQ(ce.count(), 5);
  // Reference: mean over the 5 counted rows.
  const Vec x = logits.to_doubles();
  const int t[] = {0, 4, -1, 2, 2, 1};
  double ref = 0;
  for (int row = 0; row < 6; ++row) {
    if (t[row] < 0) continue;
    double m = -1e300, s = 0;
    for (int v = 0; v < 5; ++v) m = std::max(m, x[row * 5 + v]);
    for (int v = 0; v < 5; ++v) s += std::exp(x[row * 5 + v] - m);
    ref += m + std::log(s) - x[row * 5 + t[row]];
  }
  EXPECT_NEAR(l, ref / 5, 1e-12);
  // Top-1: rows whose target holds the largest logit, ignored rows not counted.
  int64_t correct = 0;
  for (int row = 0; row < 6; ++row) {
    if (t[row] < 0) continue;
    int best = 0;
    for (int v = 1; v < 5; ++v)
      if (x[row * 5 + v] > x[row * 5 + best]) best = v;
    correct += best == t[row];
  }
  EXPECT_EQ(ce.correct(), correct);
  // Ties go to the first index; every row right, then every row wrong.
  CrossEntropy tie;
  tie.forward(Tensor::from_doubles({1, 3, 3, 0, 2, 2}, {2, 3}, DType::f32), ids_tensor({1, 1}, {2}));
  EXPECT_EQ(tie.correct(), 2);
  tie.forward(Tensor::from_doubles({1, 3, 3, 0, 2, 2}, {2, 3}, DType::f32), ids_tensor({2, 2}, {2}));
  EXPECT_EQ(tie.correct(), 0);
  Tensor d = Tensor::empty(logits.shape(), DType::f64);
  ce.backward(scale, d);
  check_gradients(loss, {{"logits", logits, d}}, 30);
  // Every target ignored: loss 0, gradient 0.
  Tensor none = ids_tensor({-1, -1, -1, -1, -1, -1}, {6});
  EXPECT_EQ(ce.forward(logits, none), 0.0);
  ce.backward(1.0, d);
  EXPECT_EQ(ops::reduce_all(ops::Reduce::absmax, d), 0.0);
  // Out-of-range targets are a usage error.
  EXPECT_THROW(ce.forward(logits, ids_tensor({0, 5, 0, 0, 0, 0}, {6})), UsageError);
}

TEST(NnLayers, LinearLoss) {
  Param w = make_param("w", {5, 6}, 50), b = make_param("b", {5}, 51);
  LinearLoss head;
  head.bind(&w, &b);
  Tensor x = rand_tensor({4, 6}, 56);
  const Tensor y = ids_tensor({0, 4, -1, 2}, {4});
  const auto loss = [&] { return 3.0 * head.forward(x, y); };
  loss();
  Tensor dx = Tensor::empty(x.shape(), DType::f64);
  head.backward(3.0, &dx);
  check_gradients(loss, {{"w", w.value, w.grad}, {"b", b.value, b.grad}, {"x", x, dx}}, 24);
}

// ---------------------------------------------------------------------------- models



// Random values of a useful size (init's 0.02 would make every gradient tiny).
void randomize(Model& m, uint64_t seed) {
  Tensor v = rand_tensor({m.values().numel()}, seed, 0.4);
  ops::cast(v, m.values());
  for (Param& p : m.params())
    if (p.name.find("norm") != std::string::npos) ops::add_scalar(p.value, 1.0, p.value);
}

std::vector<Checked> all_params(Model& m) {
  std::vector<Checked> out;
  for (Param& p : m.params()) out.push_back({p.name, p.value, p.grad});
  return out;
}

TEST(NnLlama, ParameterNamesOrderAndBlocks) {
  auto m = make_model(tiny_llama(), Device::cpu());
  std::vector<std::string> want{"tok_embeddings.weight"};
  for (int l = 0; l < 2; ++l)
    for (const char* s : {"attention_norm.weight", "attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
                          "attention.wo.weight", "ffn_norm.weight", "feed_forward.w1.weight", "feed_forward.w2.weight",
                          "feed_forward.w3.weight"})
      want.push_back("layers." + std::to_string(l) + "." + s);
  want.push_back("norm.weight");
  want.push_back("output.weight");
  ASSERT_EQ(m->params().size(), want.size());
  int64_t off = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const Param& p = m->params()[i];
    EXPECT_EQ(p.name, want[i]);
    EXPECT_EQ(p.value.dtype(), DType::f32);
    EXPECT_TRUE(p.value.shares_storage(m->values()));
    EXPECT_TRUE(p.grad.shares_storage(m->grads()));
    EXPECT_EQ(static_cast<const char*>(p.value.data()) - static_cast<const char*>(m->values().data()), off * 4);
    off += p.value.numel();
  }
  EXPECT_EQ(off, m->values().numel());
  EXPECT_EQ(off, tiny_llama().num_params());
  EXPECT_EQ(m->param("layers.1.attention.wk.weight").value.shape(), (Shape{4, 8}));
  EXPECT_EQ(m->param("layers.1.attention.wo.weight").value.shape(), (Shape{8, 8}));
  EXPECT_EQ(m->param("layers.0.feed_forward.w2.weight").value.shape(), (Shape{8, 12}));
  EXPECT_EQ(m->param("output.weight").value.shape(), (Shape{11, 8}));
  EXPECT_THROW(m->param("layers.2.attention.wq.weight"), UsageError);
  ASSERT_EQ(m->num_blocks(), 4);
  EXPECT_EQ(m->block_params(0), (std::vector<int>{0}));
  EXPECT_EQ(m->block_params(1).size(), 9u);
  EXPECT_EQ(m->block_params(3), (std::vector<int>{19, 20}));
  for (int b = 0; b < 4; ++b)
    for (int i : m->block_params(b)) EXPECT_EQ(m->params()[static_cast<size_t>(i)].block, b);
}

TEST(NnLlama, GradientsMatchFiniteDifferences) {
  auto m = make_model(tiny_llama(), Device::cpu(), DType::f64);
  EXPECT_EQ(m->dtype(), DType::f64);
  m->init(1);
  randomize(*m, 2);
  const Batch batch = tiny_batch(2, 5, 11, 3, /*with_ignored=*/true);  // T = 5 < seq_len
  const double scale = 0.75;
  m->zero_grad();
  const double loss0 = m->forward(batch);
  EXPECT_TRUE(std::isfinite(loss0));
  EXPECT_GT(loss0, 0.5);
  m->backward(scale);
  const auto loss = [&] { return scale * m->evaluate(batch); };
  EXPECT_EQ(m->evaluate(batch), loss0);
  check_gradients(loss, all_params(*m), 6);
}

TEST(NnLlama, GradientsWithMultiHeadKv) {
  ModelConfig c = tiny_llama();
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.n_layers = 1;
  auto m = make_model(c, Device::cpu(), DType::f64);
  randomize(*m, 5);
  const Batch batch = tiny_batch(1, 8, 11, 6);  // T = seq_len
  m->zero_grad();
  m->forward(batch);
  m->backward(1.0);
  check_gradients([&] { return m->evaluate(batch); }, all_params(*m), 6);
}

std::vector<float> grads_f32(Model& m) {
  std::vector<float> g(static_cast<size_t>(m.grads().numel()));
  std::memcpy(g.data(), m.grads().data(), g.size() * sizeof(float));
  return g;
}




TEST(NnLlama, CheckpointingNames) {
  for (Checkpointing c : kModes) EXPECT_EQ(parse_enum<Checkpointing>(name_of(c), "checkpointing"), c);
  EXPECT_EQ(name_of(Checkpointing::selective), "selective");
  try {
    parse_enum<Checkpointing>("partial", "checkpointing");
    ADD_FAILURE() << "no UsageError";
  } catch (const UsageError& e) {
    const std::string what = e.what();
    for (const char* word : {"partial", "none", "full", "selective"})
      EXPECT_NE(what.find(word), std::string::npos) << what;
  }
  auto m = make_model(tiny_llama(), Device::cpu());
  EXPECT_EQ(m->activation_checkpointing(), Checkpointing::none);
  m->set_activation_checkpointing(Checkpointing::selective);
  EXPECT_EQ(m->activation_checkpointing(), Checkpointing::selective);
}

// Loss and gradients of two accumulated micro-batches (of different shapes) in each mode, one
// model switching modes between steps, are the same bits; so are those of a model that only
// ever ran in one mode.
TEST(NnLlama, ActivationCheckpointingIsBitIdentical) {
  auto m = make_model(small_llama(), Device::cpu());
  m->init(7);
  const Batch b1 = tiny_batch(3, 12, 13, 8), b2 = tiny_batch(2, 9, 13, 9);
  const auto step = [&](Model& model, Checkpointing mode, std::vector<double>& losses) {
    model.set_activation_checkpointing(mode);
    model.zero_grad();
    losses.push_back(model.forward(b1));
    model.backward(0.5);
    losses.push_back(model.forward(b2));  // another shape: accumulates
    model.backward(0.5);
    return grads_f32(model);
  };
  std::vector<double> want_losses;
  const std::vector<float> want = step(*m, Checkpointing::none, want_losses);
  // none -> full -> selective -> none -> selective -> full: every transition of the layout.
  for (Checkpointing mode : {Checkpointing::full, Checkpointing::selective, Checkpointing::none, Checkpointing::selective,
                             Checkpointing::full}) {
    std::vector<double> losses;
    const std::vector<float> got = step(*m, mode, losses);
    EXPECT_EQ(losses, want_losses) << mode_str(mode);
    ASSERT_EQ(got.size(), want.size());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0) << mode_str(mode);
  }
  for (Checkpointing mode : {Checkpointing::full, Checkpointing::selective}) {
    auto m2 = make_model(small_llama(), Device::cpu());
    m2->init(7);
    std::vector<double> losses;
    const std::vector<float> got = step(*m2, mode, losses);
    EXPECT_EQ(losses, want_losses) << "fresh model, " << mode_str(mode);
    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0) << "fresh model, " << mode_str(mode);
  }
}

// The activation bytes a forward keeps, per mode, on a fresh model: the residual stream, the head
// and the per-layer activations of none; selective keeps per layer only the matmul and attention
// outputs, plus one layer's cheap activations shared by all; full one layer's of everything. The
// same differences hold in a later step (backward's buffers are the same in every mode).
TEST(NnLlama, ActivationMemoryByMode) {
  const ModelConfig c = small_llama();
  const int64_t B = 2, T = 12, N = B * T, D = c.dim, L = c.n_layers, F = c.ffn_hidden;
  const int64_t Q = c.n_heads * c.head_dim(), KV = c.n_kv_heads * c.head_dim();
  const Batch b = tiny_batch(B, T, c.vocab, 51);
  std::map<Checkpointing, size_t> after_forward, peak, later;
  for (Checkpointing mode : kModes) {
    auto m = make_model(c, Device::cpu());
    m->init(3);
    m->set_activation_checkpointing(mode);
    const size_t base = memory_stats(Device::cpu()).current;
    reset_peak_memory(Device::cpu());
    m->forward(b);
    after_forward[mode] = memory_stats(Device::cpu()).current - base;
    peak[mode] = memory_stats(Device::cpu()).peak - base;
    m->backward(1.0);
    m->forward(b);
    later[mode] = memory_stats(Device::cpu()).current - base;
    std::printf("[ llama    ] %-9s activations after forward %zu bytes (peak %zu), after a step %zu\n",
                std::string(name_of(mode)).c_str(), after_forward[mode], peak[mode], later[mode]);
  }
  const auto none = Checkpointing::none, full = Checkpointing::full, sel = Checkpointing::selective;
  for (const auto* bytes : {&after_forward, &peak, &later}) {
    EXPECT_LT(bytes->at(full), bytes->at(sel));
    EXPECT_LT(bytes->at(sel), bytes->at(none));
  }
  // Per layer, one f32 buffer each (host allocations are rounded up to 64 bytes): kept by
  // selective q, k, v, out, lse, a, b; recomputed xn1, h_mid, xn2, g and the two norms' rstd.
  const auto f32 = [](std::initializer_list<int64_t> sizes) {
    size_t bytes = 0;
    for (int64_t n : sizes) bytes += (static_cast<size_t>(n) * 4 + 63) / 64 * 64;
    return bytes;
  };
  const size_t kept = f32({N * Q, N * KV, N * KV, N * Q, N * c.n_heads, N * F, N * F});
  const size_t cheap = f32({N * D, N * D, N * D, N * F, N, N});
  EXPECT_EQ(after_forward[none] - after_forward[sel], static_cast<size_t>(L - 1) * cheap);
  EXPECT_EQ(after_forward[sel] - after_forward[full], static_cast<size_t>(L - 1) * kept);
  EXPECT_EQ(later[none] - later[sel], static_cast<size_t>(L - 1) * cheap);
  EXPECT_EQ(later[sel] - later[full], static_cast<size_t>(L - 1) * kept);
}

// Every block boundary reaches the hooks, in order: forward (embedding, layers, head), backward
// in reverse with the recomputation of checkpointing inside the block's backward hooks, and
// evaluation.
TEST(NnLlama, BlockHooksAtEveryBoundary) {
  for (Checkpointing mode : kModes) {
    const bool ckpt = mode != Checkpointing::none;  // full and selective recompute alike
    auto m = make_model(small_llama(), Device::cpu());
    m->init(11);
    m->set_activation_checkpointing(mode);
    HookLog hooks;
    m->set_hooks(&hooks);
    const Batch b = tiny_batch(2, 10, 13, 12);
    m->forward(b);
    std::vector<std::string> want = {"f0", "F0", "f1", "F1", "f2", "F2", "f3", "F3", "f4", "F4"};
    EXPECT_EQ(hooks.events, want) << mode_str(mode);
    hooks.events.clear();
    m->backward(1.0);
    want = {"b4", "B4"};
    for (int l = 3; l >= 1; --l) {
      want.push_back("b" + std::to_string(l));
      if (ckpt) {
        want.push_back("r" + std::to_string(l));
        want.push_back("R" + std::to_string(l));
      }
      want.push_back("B" + std::to_string(l));
    }
    want.insert(want.end(), {"b0", "B0"});
    EXPECT_EQ(hooks.events, want) << mode_str(mode);
    hooks.events.clear();
    m->evaluate(b);
    EXPECT_EQ(hooks.events, (std::vector<std::string>{"e0", "E0", "e1", "E1", "e2", "E2", "e3", "E3", "e4", "E4"}))
        << mode_str(mode);
    m->set_hooks(nullptr);
  }
}

TEST(NnLlama, GradReadyHookOrderAndFinality) {
  for (Checkpointing mode : kModes) {
    auto m = make_model(small_llama(), Device::cpu());
    m->init(11);
    m->set_activation_checkpointing(mode);
    const Batch b = tiny_batch(2, 10, 13, 12);
    m->zero_grad();
    m->forward(b);
    std::map<int, std::vector<std::vector<double>>> at_fire;
    HookLog hooks;
    hooks.on_after_backward = [&](int block) {
      for (int i : m->block_params(block)) at_fire[block].push_back(m->params()[static_cast<size_t>(i)].grad.to_doubles());
    };
    m->set_hooks(&hooks);
    m->backward(1.0);
    m->set_hooks(nullptr);
    EXPECT_EQ(hooks.ready_order(), (std::vector<int>{4, 3, 2, 1, 0})) << mode_str(mode);
    for (const auto& [block, snaps] : at_fire) {
      const auto& idx = m->block_params(block);
      for (size_t k = 0; k < idx.size(); ++k) {
        const Param& p = m->params()[static_cast<size_t>(idx[k])];
        EXPECT_EQ(snaps[k], p.grad.to_doubles()) << p.name << " changed after its block was reported ready";
        EXPECT_GT(ops::reduce_all(ops::Reduce::absmax, p.grad), 0.0) << p.name;
      }
    }
  }
}

// --precision tf32: the weight products round their operands to TF32 (ops::Math::tf32), which
// moves the loss and the gradients by about TF32's 2^-11 and no more; the same run twice is
// bit-identical; a pending backward keeps its forward's precision; f64 models multiply exactly.
TEST(NnLlama, PrecisionTf32) {
  const Batch b = tiny_batch(3, 12, 13, 8);
  const auto run = [&](Model& m, Precision fwd, Precision bwd) {
    m.set_precision(fwd);
    m.zero_grad();
    const double loss = m.forward(b);
    m.set_precision(bwd);
    m.backward(1.0);
    return std::make_pair(loss, grads_f32(m));
  };
  auto m = make_model(small_llama(), Device::cpu());
  m->init(7);
  const auto [l32, g32] = run(*m, Precision::f32, Precision::f32);
  const auto [lt, gt] = run(*m, Precision::tf32, Precision::tf32);
  EXPECT_NE(lt, l32);
  EXPECT_LT(std::fabs(lt - l32), 1e-3 * std::fabs(l32));
  double diff = 0, norm = 0;
  for (size_t i = 0; i < g32.size(); ++i) {
    diff += (double(gt[i]) - g32[i]) * (double(gt[i]) - g32[i]);
    norm += double(g32[i]) * g32[i];
  }
  EXPECT_GT(diff, 0);
  EXPECT_LT(std::sqrt(diff / norm), 1e-2);
  const auto [lt2, gt2] = run(*m, Precision::tf32, Precision::f32);  // the backward keeps tf32
  EXPECT_EQ(lt2, lt);
  EXPECT_EQ(std::memcmp(gt2.data(), gt.data(), gt.size() * sizeof(float)), 0);
  const auto [l32b, g32b] = run(*m, Precision::f32, Precision::tf32);  // ... and f32
  EXPECT_EQ(l32b, l32);
  EXPECT_EQ(std::memcmp(g32b.data(), g32.data(), g32.size() * sizeof(float)), 0);

  auto m64 = make_model(small_llama(), Device::cpu(), DType::f64);
  m64->init(7);
  m64->set_precision(Precision::f32);
  const double e64 = m64->evaluate(b);
  m64->set_precision(Precision::tf32);
  EXPECT_EQ(m64->evaluate(b), e64);
}

// The relative distance between two gradient vectors (L2).
double rel_dist(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    norm += double(b[i]) * b[i];
  }
  return std::sqrt(diff / norm);
}

// --precision bf16 (Model::set_precision): loss and gradients within bf16's reach of f32's and
// not equal to them; gradients bit-identical in every checkpointing mode; the backward keeps its
// forward's precision; evaluate gives the forward's loss; the bf16 copy follows the f32 values
// (a changed value changes the next forward); bf16 needs an f32 model. Head dim 64 runs the bf16
// attention, head dim 4 the f32 attention on widened copies.
TEST(NnLlama, PrecisionBf16) {
  for (const int64_t hd : {4, 64}) {
    ModelConfig c = small_llama();
    if (hd == 64) c.dim = 128, c.n_heads = 2, c.n_kv_heads = 1, c.ffn_hidden = 96;
    const std::string what = "head dim " + std::to_string(hd);
    const Batch b = tiny_batch(3, 12, 13, 8);
    auto m = make_model(c, Device::cpu());
    m->init(7);
    const auto run = [&](Precision fwd, Precision bwd, Checkpointing mode = Checkpointing::none) {
      m->set_activation_checkpointing(mode);
      m->set_precision(fwd);
      m->zero_grad();
      const double loss = m->forward(b);
      m->set_precision(bwd);
      m->backward(1.0);
      return std::make_pair(loss, grads_f32(*m));
    };
    const auto [l32, g32] = run(Precision::f32, Precision::f32);
    const auto [lb, gb] = run(Precision::bf16, Precision::bf16);
    EXPECT_NE(lb, l32) << what;
    EXPECT_LT(std::fabs(lb - l32), 1e-2 * std::fabs(l32)) << what;
    EXPECT_GT(rel_dist(gb, g32), 0) << what;
    EXPECT_LT(rel_dist(gb, g32), 5e-2) << what;
    for (Checkpointing mode : kModes) {
      const auto [lm, gm] = run(Precision::bf16, Precision::f32, mode);  // the backward keeps bf16
      EXPECT_EQ(lm, lb) << what << ", " << mode_str(mode);
      EXPECT_EQ(std::memcmp(gm.data(), gb.data(), gb.size() * sizeof(float)), 0) << what << ", " << mode_str(mode);
    }
    m->set_activation_checkpointing(Checkpointing::none);
    m->set_precision(Precision::bf16);
    EXPECT_EQ(m->evaluate(b), lb) << what;
    m->set_precision(Precision::f32);
    EXPECT_EQ(m->evaluate(b), l32) << what;  // the bf16 copy is not read in f32
    // An optimizer's step between passes: the next bf16 forward reads the new values.
    Tensor v = m->values();
    ops::scale(v, 1.5, v);
    auto m2 = make_model(c, Device::cpu());
    m2->values().copy_from(m->values());
    m->set_precision(Precision::bf16);
    m2->set_precision(Precision::bf16);
    const double moved = m->evaluate(b);
    EXPECT_NE(moved, lb) << what;
    EXPECT_EQ(moved, m2->evaluate(b)) << what;
  }
  auto m64 = make_model(small_llama(), Device::cpu(), DType::f64);
  EXPECT_THROW(m64->set_precision(Precision::bf16), UsageError);
}

TEST(NnLlama, EvaluateMatchesForwardAndKeepsThePendingBackward) {
  auto m = make_model(small_llama(), Device::cpu());
  m->init(3);
  const Batch b1 = tiny_batch(2, 12, 13, 21), b2 = tiny_batch(4, 7, 13, 22);
  m->zero_grad();
  const double l1 = m->forward(b1);
  m->backward(1.0);
  const std::vector<float> want = grads_f32(*m);
  for (Checkpointing mode : kModes) {
    m->set_activation_checkpointing(mode);
    m->zero_grad();
    EXPECT_EQ(m->forward(b1), l1);
    const double e2 = m->evaluate(b2);  // between forward and backward
    EXPECT_EQ(m->evaluate(b1), l1);
    m->backward(1.0);
    const std::vector<float> got = grads_f32(*m);
    EXPECT_EQ(std::memcmp(want.data(), got.data(), got.size() * sizeof(float)), 0) << mode_str(mode);
    EXPECT_EQ(m->evaluate(b2), e2);
  }
  EXPECT_THROW(m->backward(1.0), Error);  // each backward needs its own forward
}

// The trainer's form of the forward leaves the loss on the device: acc += weight * mean loss
// (f64), the same loss and the same gradients as the forward that returns it. A batch's host
// copies (a GPU batch's, Batch::to) are what the model checks and counts.
TEST(NnLlama, LossAccumulatesOnTheDevice) {
  auto m = make_model(small_llama(), Device::cpu());
  m->init(3);
  const Batch b1 = tiny_batch(2, 12, 13, 21, /*with_ignored=*/true), b2 = tiny_batch(4, 7, 13, 22);
  m->zero_grad();
  const double l1 = m->forward(b1);
  m->backward(0.25);
  const double l2 = m->forward(b2);
  m->backward(0.5);
  const std::vector<float> want = grads_f32(*m);
  Tensor acc = Tensor::zeros({1}, DType::f64);
  m->zero_grad();
  m->forward(b1, acc, 2.0);
  m->backward(0.25);
  m->forward(b2, acc, 3.0);
  m->backward(0.5);
  const std::vector<float> got = grads_f32(*m);
  EXPECT_EQ(std::memcmp(want.data(), got.data(), got.size() * sizeof(float)), 0);
  EXPECT_NEAR(acc.item(), 2 * l1 + 3 * l2, 1e-15 * (2 * l1 + 3 * l2));
  EXPECT_EQ(m->forward(b1), l1);  // the returning form again: the sink is gone
  m->backward(1.0);
  Tensor f32acc = Tensor::zeros({1}, DType::f32);
  EXPECT_THROW(m->forward(b1, f32acc, 1.0), UsageError);
  // Host copies: a bad id there is refused although the tensors themselves are fine.
  Batch mirrored = tiny_batch(2, 5, 13, 1);
  mirrored.host_inputs = mirrored.inputs.clone();
  mirrored.host_targets = mirrored.targets.clone();
  mirrored.host_inputs.ptr<int32_t>()[3] = 13;
  EXPECT_THROW(m->forward(mirrored, acc, 1.0), UsageError);
  mirrored.host_inputs = mirrored.inputs.clone();
  mirrored.host_targets.ptr<int32_t>()[2] = 13;
  EXPECT_THROW(m->forward(mirrored, acc, 1.0), UsageError);
}

TEST(NnLlama, BatchChecks) {
  auto m = make_model(tiny_llama(), Device::cpu());
  m->init(1);
  EXPECT_THROW(m->forward(tiny_batch(2, 9, 11, 1)), UsageError);  // T > seq_len
  Batch bad = tiny_batch(2, 5, 11, 1);
  bad.inputs.ptr<int32_t>()[3] = 11;  // id == vocab
  EXPECT_THROW(m->forward(bad), UsageError);
  bad = tiny_batch(2, 5, 11, 1);
  bad.targets.ptr<int32_t>()[3] = 11;
  EXPECT_THROW(m->forward(bad), UsageError);
  bad = tiny_batch(2, 5, 11, 1);
  bad.targets = bad.targets.reshape({10});
  EXPECT_THROW(m->forward(bad), UsageError);
  bad = tiny_batch(2, 5, 11, 1);
  bad.inputs = Tensor::zeros({2, 5}, DType::f32);
  EXPECT_THROW(m->forward(bad), UsageError);
  EXPECT_THROW(m->backward(1.0), Error);
  // A loss near log(vocab) at init.
  EXPECT_NEAR(m->forward(tiny_batch(2, 5, 11, 1)), std::log(11.0), 0.1);
}

// Token ids above 65535 (Llama 3's vocabulary has 128256): a 70000-token llama reads embedding
// rows past 2^16, its loss covers all 70000 logits, gradients reach exactly the rows of the ids
// given, and AdamW learns the batch.
TEST(NnLlama, TokenIdsAbove65535) {
  auto m = make_model(llama_config(16, 1, 2, 1, 32, 70000, 8), Device::cpu());
  m->init(3);
  const std::vector<int32_t> seq = {65535, 65536, 69999, 3, 65537, 0, 69998, 65536, 69999};
  const std::vector<int32_t> in(seq.begin(), seq.end() - 1), tg(seq.begin() + 1, seq.end());
  const Batch b{ids_tensor(in, {1, 8}), ids_tensor(tg, {1, 8})};
  m->zero_grad();
  const double first = m->forward(b);
  EXPECT_TRUE(std::isfinite(first));
  EXPECT_NEAR(first, std::log(70000.0), 0.1);
  m->backward(1.0);
  const Tensor& emb = m->param("tok_embeddings.weight").grad;
  const auto row_norm = [](const Tensor& g, int64_t r) {
    const Vec v = g.to_doubles();
    const int64_t D = g.dim(1);
    double s = 0;
    for (int64_t d = 0; d < D; ++d) s += v[static_cast<size_t>(r * D + d)] * v[static_cast<size_t>(r * D + d)];
    return std::sqrt(s);
  };
  for (int64_t r : {0, 3, 65535, 65536, 65537, 69998, 69999}) EXPECT_GT(row_norm(emb, r), 0.0) << "row " << r;
  for (int64_t r : {1, 2, 65534, 65538, 69997}) EXPECT_EQ(row_norm(emb, r), 0.0) << "row " << r;
  // The output head: a target's row takes -(1 - p) h, any other row p h with p ~ 1 / 70000.
  const Tensor& out = m->param("output.weight").grad;
  EXPECT_GT(row_norm(out, 69999), 1000 * row_norm(out, 100));
  EXPECT_GT(row_norm(out, 65537), 1000 * row_norm(out, 65538));
  Tensor mom = Tensor::zeros({m->values().numel()}, DType::f32), var = Tensor::zeros({m->values().numel()}, DType::f32);
  double last = first;
  for (int step = 1; step <= 20; ++step) {
    if (step > 1) {
      m->zero_grad();
      last = m->forward(b);
      m->backward(1.0);
    }
    ops::adamw_step(m->values(), m->grads(), mom, var, 1e-2, 0.9, 0.95, 1e-8, 0.0, step);
  }
  std::printf("[ llama    ] vocab 70000, ids above 65535: loss %.4f -> %.4f after 20 AdamW steps\n", first, last);
  EXPECT_TRUE(std::isfinite(last));
  EXPECT_LT(last, 0.5 * first);
}

TEST(NnLlama, InitIsDeterministic) {
  const ModelConfig c = small_llama();
  auto a = make_model(c, Device::cpu()), b = make_model(c, Device::cpu()), d = make_model(c, Device::cpu());
  auto f64 = make_model(c, Device::cpu(), DType::f64);
  a->init(42);
  b->init(42);
  d->init(43);
  f64->init(42);
  const Vec va = a->values().to_doubles(), vb = b->values().to_doubles(), vd = d->values().to_doubles();
  const Vec v64 = f64->values().to_doubles();
  EXPECT_EQ(va, vb);
  EXPECT_NE(va, vd);
  for (size_t i = 0; i < va.size(); ++i) ASSERT_EQ(va[i], static_cast<double>(static_cast<float>(v64[i]))) << i;
  // Each parameter its own stream: a parameter's values do not depend on the others' sizes.
  ModelConfig c2 = c;
  c2.vocab = 29;  // changes tok_embeddings only
  auto e = make_model(c2, Device::cpu());
  e->init(42);
  EXPECT_EQ(e->param("layers.1.attention.wq.weight").value.to_doubles(),
            a->param("layers.1.attention.wq.weight").value.to_doubles());
  // Norm weights 1; std 0.02, scaled for the output projections.
  EXPECT_EQ(ops::reduce_all(ops::Reduce::min, a->param("norm.weight").value), 1.0);
  EXPECT_EQ(ops::reduce_all(ops::Reduce::max, a->param("layers.0.ffn_norm.weight").value), 1.0);
  const auto rms = [](const Tensor& t) { return ops::reduce_all(ops::Reduce::norm2, t) / std::sqrt(t.numel()); };
  EXPECT_NEAR(rms(a->param("tok_embeddings.weight").value), 0.02, 0.004);
  EXPECT_NEAR(rms(a->param("layers.0.attention.wo.weight").value), 0.02 / std::sqrt(6.0), 0.002);
}

TEST(NnLlama, NoAllocationPerStepForAFixedShape) {
  auto m = make_model(small_llama(), Device::cpu());
  m->init(5);
  const Batch b = tiny_batch(2, 12, 13, 31), small = tiny_batch(1, 6, 13, 32);
  for (Checkpointing mode : kModes) {
    m->set_activation_checkpointing(mode);
    for (int i = 0; i < 1; ++i) {  // warm up: buffers for this shape and mode
      m->zero_grad();
      m->forward(b);
      m->backward(1.0);
      m->evaluate(b);
    }
    const size_t before = memory_stats(Device::cpu()).allocations;
    for (int i = 0; i < 2; ++i) {
      m->zero_grad();
      m->forward(b);
      m->backward(1.0);
      m->evaluate(b);
      m->forward(small);  // a smaller batch reuses the allocations
      m->backward(1.0);
    }
    EXPECT_EQ(memory_stats(Device::cpu()).allocations, before) << mode_str(mode);
  }
}

TEST(NnLlama, AdamWLearnsAFixedBatch) {
  auto m = make_model(small_llama(), Device::cpu());
  m->init(1);
  const Batch b = tiny_batch(2, 12, 13, 41);
  Tensor mom = Tensor::zeros({m->values().numel()}, DType::f32), var = Tensor::zeros({m->values().numel()}, DType::f32);
  double first = 0, last = 0;
  for (int step = 1; step <= 40; ++step) {
    m->zero_grad();
    last = m->forward(b);
    if (step == 1) first = last;
    m->backward(1.0);
    ops::adamw_step(m->values(), m->grads(), mom, var, 1e-2, 0.9, 0.95, 1e-8, 0.0, step);
  }
  std::printf("[ llama    ] fixed-batch loss %.4f -> %.4f after 40 AdamW steps\n", first, last);
  EXPECT_LT(last, 0.5 * first);
}

// ---------------------------------------------------------------------------- mlp



TEST(NnMlp, ParametersAndGradients) {
  auto m = make_model(tiny_mlp(), Device::cpu(), DType::f64);
  ASSERT_EQ(m->params().size(), 6u);
  EXPECT_EQ(m->params()[0].name, "layers.0.weight");
  EXPECT_EQ(m->params()[0].value.shape(), (Shape{7, 6}));
  EXPECT_EQ(m->params()[1].name, "layers.0.bias");
  EXPECT_EQ(m->params()[5].name, "layers.2.bias");
  EXPECT_EQ(m->params()[5].value.shape(), (Shape{4}));
  EXPECT_EQ(m->num_blocks(), 3);
  EXPECT_EQ(m->block_params(2), (std::vector<int>{4, 5}));
  EXPECT_EQ(m->values().numel(), tiny_mlp().num_params());
  m->init(3);
  EXPECT_EQ(ops::reduce_all(ops::Reduce::absmax, m->param("layers.1.bias").value), 0.0);
  randomize(*m, 4);
  const Batch b = mlp_batch(5, DType::f64, 5);
  m->zero_grad();
  const double l = m->forward(b);
  HookLog hooks;
  m->set_hooks(&hooks);
  m->backward(2.0);
  EXPECT_EQ(hooks.ready_order(), (std::vector<int>{2, 1, 0}));
  hooks.events.clear();
  EXPECT_EQ(m->evaluate(b), l);
  EXPECT_EQ(hooks.events, (std::vector<std::string>{"e0", "E0", "e1", "E1", "e2", "E2"}));
  m->set_hooks(nullptr);
  check_gradients([&] { return 2.0 * m->evaluate(b); }, all_params(*m), 40);
  // f32 inputs into the f64 model are cast.
  const Batch b32 = mlp_batch(5, DType::f32, 5);
  EXPECT_NEAR(m->forward(b32), l, 1e-6);
}

// bf16 in the classifiers: the mlp's Linear layers take bf16 operands (inputs cast, as autocast)
// into f32 activations; resnet keeps f32 weights and activations with bf16-rounded operands in
// its convolutions and fc. Losses and gradients within bf16's reach of f32's, not equal.
TEST(NnMlp, PrecisionBf16InTheClassifiers) {
  struct Case {
    ModelConfig cfg;
    Batch batch;
  };
  const ModelConfig rn = tiny_resnet();
  for (const Case& k : {Case{tiny_mlp(), mlp_batch(5, DType::f32, 5)}, Case{rn, image_batch(rn, 4, 9, DType::f32)}}) {
    const std::string what(name_of(k.cfg.arch));
    auto m = make_model(k.cfg, Device::cpu());
    m->init(3);
    const auto run = [&](Precision p) {
      m->set_precision(p);
      m->zero_grad();
      const double loss = m->forward(k.batch);
      m->backward(1.0);
      return std::make_pair(loss, grads_f32(*m));
    };
    const auto [l32, g32] = run(Precision::f32);
    const auto [lb, gb] = run(Precision::bf16);
    EXPECT_NE(lb, l32) << what;
    EXPECT_LT(std::fabs(lb - l32), 1e-2 * std::fabs(l32)) << what;
    EXPECT_GT(rel_dist(gb, g32), 0) << what;
    EXPECT_LT(rel_dist(gb, g32), 5e-2) << what;
    const auto [lb2, gb2] = run(Precision::bf16);
    EXPECT_EQ(lb2, lb) << what;
    EXPECT_EQ(std::memcmp(gb2.data(), gb.data(), gb.size() * sizeof(float)), 0) << what;
  }
}

TEST(NnMlp, BatchChecksAndF32Training) {
  auto m = make_model(preset("mlp-small"), Device::cpu());
  m->init(1);
  EXPECT_NEAR(m->forward(Batch{Tensor::zeros({3, 32}, DType::f32), ids_tensor({1, 2, 9}, {3})}), std::log(10.0), 1e-6);
  m->backward(1.0);
  EXPECT_THROW(m->forward(Batch{Tensor::zeros({3, 31}, DType::f32), ids_tensor({1, 2, 9}, {3})}), UsageError);
  EXPECT_THROW(m->forward(Batch{Tensor::zeros({3, 32}, DType::f32), ids_tensor({1, 2, 10}, {3})}), UsageError);
  EXPECT_THROW(m->forward(Batch{Tensor::zeros({3, 32}, DType::f32), ids_tensor({1, 2}, {2})}), UsageError);
  EXPECT_THROW(m->backward(1.0), Error);
}

// ---------------------------------------------------------------------------- resnet



// torchvision's names in its state_dict order, the blocks, the buffers and their initial values.
TEST(NnResNet, PresetsNamesAndBuffers) {
  auto m = make_model(preset("resnet-8"), Device::cpu());
  std::vector<std::string> want{"conv1.weight", "bn1.weight", "bn1.bias"};
  std::vector<std::string> bufs{"bn1.running_mean", "bn1.running_var"};
  for (int s = 1; s <= 3; ++s) {
    const std::string p = "layer" + std::to_string(s) + ".0.";
    for (const char* n : {"conv1.weight", "bn1.weight", "bn1.bias", "conv2.weight", "bn2.weight", "bn2.bias"})
      want.push_back(p + n);
    for (const char* n : {"bn1", "bn2"})
      for (const char* r : {".running_mean", ".running_var"}) bufs.push_back(p + n + r);
    if (s > 1) {
      for (const char* n : {"downsample.0.weight", "downsample.1.weight", "downsample.1.bias"}) want.push_back(p + n);
      for (const char* r : {".running_mean", ".running_var"}) bufs.push_back(p + "downsample.1" + r);
    }
  }
  want.insert(want.end(), {"fc.weight", "fc.bias"});
  ASSERT_EQ(m->params().size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(m->params()[i].name, want[i]);
  ASSERT_EQ(m->buffers().size(), bufs.size());
  for (size_t i = 0; i < bufs.size(); ++i) {
    const NamedTensor& b = m->buffers()[i];
    EXPECT_EQ(b.name, bufs[i]);
    EXPECT_TRUE(b.value.shares_storage(m->buffer_values()));
    for (double v : b.value.to_doubles()) EXPECT_EQ(v, b.name.ends_with("var") ? 1.0 : 0.0) << b.name;
  }
  EXPECT_EQ(m->param("conv1.weight").shape, (Shape{16, 3, 3, 3}));
  EXPECT_EQ(m->param("layer2.0.conv1.weight").shape, (Shape{32, 16, 3, 3}));
  EXPECT_EQ(m->param("layer3.0.downsample.0.weight").shape, (Shape{64, 32, 1, 1}));
  EXPECT_EQ(m->param("fc.weight").shape, (Shape{10, 64}));
  // Blocks: the stem, each residual block, the head. resnet-20 by hand: stem 3*16*9 + 2*16;
  // stage 1: 3 x (2*16*16*9 + 4*16); stage 2: (16*32*9 + 32*32*9 + 4*32 + 16*32 + 2*32) +
  // 2 x (2*32*32*9 + 4*32); stage 3 likewise with 32 -> 64; fc 64*10 + 10.
  ASSERT_EQ(m->num_blocks(), 5);
  EXPECT_EQ(m->block_params(0), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(m->block_params(4), (std::vector<int>{static_cast<int>(want.size()) - 2, static_cast<int>(want.size()) - 1}));
  EXPECT_EQ(preset("resnet-20").num_params(), 464 + 3 * 4672 + 14528 + 2 * 18560 + 57728 + 2 * 73984 + 650);
  EXPECT_EQ(make_model(preset("resnet-20"), Device::cpu())->num_blocks(), 11);
  // init: convolutions normal(0, sqrt(2 / fan_out)), batch norm 1 and 0, fc 1/sqrt(3 fan_in).
  m->init(4);
  const auto stdev = [](const Tensor& t) {
    double s = 0;
    for (double v : t.to_doubles()) s += v * v;
    return std::sqrt(s / static_cast<double>(t.numel()));
  };
  EXPECT_NEAR(stdev(m->param("layer3.0.conv2.weight").value), std::sqrt(2.0 / (64 * 9)), 0.005);
  EXPECT_NEAR(stdev(m->param("fc.weight").value), 1 / std::sqrt(3.0 * 64), 0.01);
  EXPECT_EQ(m->param("layer2.0.bn2.weight").value.to_doubles(), Vec(32, 1.0));
  EXPECT_EQ(m->param("layer2.0.downsample.1.bias").value.to_doubles(), Vec(32, 0.0));
}

// Every parameter's gradient in f64 against central differences of the training loss (batch
// statistics), for both stems.
TEST(NnResNet, GradientsMatchFiniteDifferences) {
  for (const char* stem : {"cifar", "imagenet"}) {
    const ModelConfig c = tiny_resnet(stem);
    auto m = make_model(c, Device::cpu(), DType::f64);
    m->init(3);
    for (Param& p : m->params())  // batch norm's affine parameters away from 1 and 0
      if (p.init != Init::normal) {
        Tensor r = rand_tensor(p.shape, 40 + p.block, 0.3, p.init == Init::ones ? 1.0 : 0.0);
        ops::cast(r, p.value);
      }
    const Batch b = image_batch(c, 4, 9);
    const double scale = 0.5;
    m->zero_grad();
    const double l = m->forward(b);
    EXPECT_TRUE(std::isfinite(l));
    m->backward(scale);
    check_gradients([&] { return scale * m->forward(b); }, all_params(*m), 10);
  }
}

// Training forwards move the running statistics, evaluation reads them and leaves them, and
// evaluating between a forward and its backward changes nothing; the recomputation of
// checkpointing leaves them too: losses, gradients and buffers are the same bits in every mode.
TEST(NnResNet, CheckpointingEvaluationAndRunningStatistics) {
  const ModelConfig c = tiny_resnet();
  const Batch b1 = image_batch(c, 5, 1, DType::f32), b2 = image_batch(c, 3, 2, DType::f32);
  std::vector<double> want_losses;
  Vec want_grads, want_buffers;
  for (Checkpointing mode : kModes) {
    auto m = make_model(c, Device::cpu());
    m->init(5);
    m->set_activation_checkpointing(mode);
    const Vec buffers0 = m->buffer_values().to_doubles();
    const double e0 = m->evaluate(b2);
    EXPECT_EQ(m->buffer_values().to_doubles(), buffers0) << "evaluation moved the running statistics";
    std::vector<double> losses;
    m->zero_grad();
    losses.push_back(m->forward(b1));
    EXPECT_NE(m->buffer_values().to_doubles(), buffers0) << "a training forward left the running statistics";
    const Vec moved = m->buffer_values().to_doubles();
    losses.push_back(m->evaluate(b2));  // with the moved statistics, between forward and backward
    EXPECT_NE(losses.back(), e0);
    m->backward(0.5);
    EXPECT_EQ(m->buffer_values().to_doubles(), moved) << mode_str(mode) << ": backward moved the running statistics";
    losses.push_back(m->forward(b2));
    m->backward(0.5);
    if (mode == Checkpointing::none) {
      want_losses = losses;
      want_grads = m->grads().to_doubles();
      want_buffers = m->buffer_values().to_doubles();
      EXPECT_GT(m->correct(), -1);
      continue;
    }
    EXPECT_EQ(losses, want_losses) << mode_str(mode);
    EXPECT_EQ(m->grads().to_doubles(), want_grads) << mode_str(mode);
    EXPECT_EQ(m->buffer_values().to_doubles(), want_buffers) << mode_str(mode);
  }
}

TEST(NnResNet, HooksAndBatchChecks) {
  const ModelConfig c = tiny_resnet();
  for (Checkpointing mode : kModes) {
    auto m = make_model(c, Device::cpu());
    m->init(2);
    m->set_activation_checkpointing(mode);
    HookLog hooks;
    m->set_hooks(&hooks);
    m->zero_grad();
    m->forward(image_batch(c, 2, 3, DType::f32));
    m->backward(1.0);
    std::vector<std::string> want;
    for (int b = 0; b < 5; ++b) want.insert(want.end(), {"f" + std::to_string(b), "F" + std::to_string(b)});
    for (int b = 4; b >= 0; --b) {
      want.push_back("b" + std::to_string(b));
      if (mode != Checkpointing::none && b >= 1 && b <= 3) want.insert(want.end(), {"r" + std::to_string(b), "R" + std::to_string(b)});
      want.push_back("B" + std::to_string(b));
    }
    EXPECT_EQ(hooks.events, want) << mode_str(mode);
    m->set_hooks(nullptr);
  }
  auto m = make_model(c, Device::cpu());
  const Tensor y = ids_tensor({0, 1}, {2});
  EXPECT_THROW(m->forward(Batch{Tensor::zeros({2, 2, 6, 5}, DType::f32), y}), UsageError);  // 60 values, not 72
  EXPECT_THROW(m->forward(Batch{Tensor::zeros({2, 72}, DType::i32), y}), UsageError);
  EXPECT_THROW(m->forward(Batch{Tensor::zeros({2, 72}, DType::f32), ids_tensor({0, 3}, {2})}), UsageError);  // class 3 of 3
  EXPECT_THROW(m->backward(1.0), Error);
  EXPECT_NEAR(m->forward(Batch{Tensor::zeros({2, 72}, DType::f32), y}), std::log(3.0), 1e-6);  // flat images work
  // One value per channel at the last stage cannot give batch statistics.
  ModelConfig one = c;
  one.input_shape = {2, 2, 2};
  auto m1 = make_model(one, Device::cpu());
  EXPECT_THROW(m1->forward(Batch{Tensor::zeros({1, 2, 2, 2}, DType::f32), ids_tensor({0}, {1})}), UsageError);
}

// ---------------------------------------------------------------------------- configs

TEST(NnConfig, PresetParameterCounts) {
  // resnet-18: 11,173,962 as the PowerSGD paper's (kuangliu's) CIFAR ResNet-18; resnet-20 and
  // resnet-8 by hand in NnResNet.PresetsNamesAndBuffers.
  // llama3-8b: Meta's Llama 3 8B (8,030,261,248); llama3-1b: Llama 3.2 1B's 1,235,814,400 plus
  // the output matrix that Meta ties to the embedding and dtk does not (128256 x 2048).
  const std::map<std::string, int64_t> want = {{"llama-tiny", 853120},      {"llama-small", 27795968},
                                               {"llama-1b", 1104218112},    {"llama3-1b", 1235814400 + 128256 * 2048},
                                               {"llama3-8b", 8030261248LL}, {"mlp-small", 6922},
                                               {"mlp-mnist", 235146},       {"resnet-8", 78042},
                                               {"resnet-20", 272474},       {"resnet-18", 11173962}};
  EXPECT_EQ(preset_names().size(), want.size());
  for (const std::string& name : preset_names()) {
    const ModelConfig c = preset(name);
    EXPECT_EQ(c.preset, name);
    c.validate();
    std::printf("[ preset   ] %-12s %14lld params, %.4g train FLOPs per %s\n", name.c_str(),
                static_cast<long long>(c.num_params()), c.train_flops_per_item(), c.arch == Arch::llama ? "token" : "sample");
    ASSERT_TRUE(want.count(name)) << name;
    EXPECT_EQ(c.num_params(), want.at(name)) << name;
    EXPECT_GT(c.train_flops_per_item(), 6.0 * static_cast<double>(c.num_params()) * 0.5) << name;
  }
  for (const char* name : {"llama-tiny", "mlp-small", "mlp-mnist", "resnet-8", "resnet-20"}) {
    auto m = make_model(preset(name), Device::cpu());
    EXPECT_EQ(m->values().numel(), preset(name).num_params()) << name;
  }
  // Llama 3's vocabulary, RoPE base and heads; the sequence lengths the presets train at (Llama
  // 3 8B's 8192; 2048 for llama3-1b, one GPU's batch, where Meta's model reaches 128K with the
  // RoPE scaling dtk does not have).
  for (const char* name : {"llama3-1b", "llama3-8b"}) {
    const ModelConfig c = preset(name);
    EXPECT_EQ(c.vocab, 128256) << name;
    EXPECT_EQ(c.rope_theta, 500000.0) << name;
    EXPECT_EQ(c.n_heads, 32) << name;
    EXPECT_EQ(c.n_kv_heads, 8) << name;
    EXPECT_EQ(c.norm_eps, 1e-5) << name;
  }
  EXPECT_EQ(preset("llama3-1b").seq_len, 2048);
  EXPECT_EQ(preset("llama3-8b").seq_len, 8192);
  // PaLM's accounting, as bench/pytorch_llama.py computes it for the same shapes: 6 x (the
  // layers' matmul weights + the output head) + 12 x layers x dim x seq_len per token.
  EXPECT_DOUBLE_EQ(preset("llama3-1b").train_flops_per_item(),
                   6.0 * (16.0 * (2 * 2048.0 * 2048 + 2 * 2048.0 * 512 + 3 * 2048.0 * 8192) + 128256.0 * 2048) +
                       12.0 * 16 * 2048 * 2048);
  try {
    preset("llama-huge");
    ADD_FAILURE() << "no error for an unknown preset";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("llama-small"), std::string::npos) << e.what();
  }
}

TEST(NnConfig, JsonRoundTripAndOverrides) {
  for (const std::string& name : preset_names()) {
    const ModelConfig c = preset(name);
    EXPECT_EQ(from_json<ModelConfig>(nlohmann::json(c)), c) << name;
    EXPECT_EQ(from_json<ModelConfig>(nlohmann::json::parse(nlohmann::json(c).dump())), c) << name;
  }
  ModelConfig c = preset("llama-tiny");
  c.dim = 96;
  c.n_layers = 3;
  c.n_heads = 6;
  c.n_kv_heads = 3;
  c.ffn_hidden = 200;
  c.vocab = 300;
  c.seq_len = 32;
  c.rope_theta = 5e5;
  c.norm_eps = 1e-6;
  EXPECT_EQ(from_json<ModelConfig>(nlohmann::json(c)), c);
  auto m = make_model(c, Device::cpu());
  EXPECT_EQ(m->values().numel(), c.num_params());
  EXPECT_EQ(m->config(), c);
  ModelConfig h = preset("mlp-mnist");
  h.hidden = {100, 50, 25};
  EXPECT_EQ(from_json<ModelConfig>(nlohmann::json(h)), h);
  EXPECT_EQ(make_model(h, Device::cpu())->num_blocks(), 4);
}

void expect_usage_error(const std::function<void()>& f, const std::string& field) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one naming " << field;
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
  }
}

TEST(NnConfig, ValidateRejectsInconsistentConfigs) {
  const auto with = [](const std::function<void(ModelConfig&)>& edit, const char* base = "llama-tiny") {
    ModelConfig c = preset(base);
    edit(c);
    return c;
  };
  const std::vector<std::pair<ModelConfig, std::string>> cases = {
      {with([](ModelConfig& c) { c.dim = 130; }), "n_heads"},       // 130 % 4
      {with([](ModelConfig& c) { c.n_kv_heads = 3; }), "n_kv_heads"},  // 4 % 3
      {with([](ModelConfig& c) { c.n_heads = 8, c.dim = 120; }), "head dim"},  // 15, odd
      {with([](ModelConfig& c) { c.vocab = 0; }), "vocab"},
      {with([](ModelConfig& c) { c.seq_len = -1; }), "seq_len"},
      {with([](ModelConfig& c) { c.n_layers = 0; }), "n_layers"},
      {with([](ModelConfig& c) { c.ffn_hidden = 0; }), "ffn_hidden"},
      {with([](ModelConfig& c) { c.rope_theta = 0; }), "rope_theta"},
      {with([](ModelConfig& c) { c.norm_eps = -1; }), "norm_eps"},
      {with([](ModelConfig& c) { c.hidden = {64, 0}; }, "mlp-small"), "hidden[1]"},
      {with([](ModelConfig& c) { c.classes = 0; }, "mlp-small"), "classes"},
      {with([](ModelConfig& c) { c.input_dim = -3; }, "mlp-small"), "input_dim"},
      {with([](ModelConfig& c) { c.input_shape = {3, 32}; }, "resnet-8"), "input_shape"},
      {with([](ModelConfig& c) { c.input_shape = {3, 0, 32}; }, "resnet-8"), "input_shape[1]"},
      {with([](ModelConfig& c) { c.stage_blocks = {1, 1}; }, "resnet-8"), "stage_blocks"},
      {with([](ModelConfig& c) { c.stage_widths = {16, -2, 64}; }, "resnet-8"), "stage_widths[1]"},
      {with([](ModelConfig& c) { c.stem = "mnist"; }, "resnet-8"), "stem"},
      {with([](ModelConfig& c) { c.classes = 0; }, "resnet-8"), "classes"},
      {with([](ModelConfig& c) { c.input_shape = {3, 32, 32, 1}; }, "resnet-8"), "input_shape"},
  };
  for (const auto& [cfg, field] : cases) {
    expect_usage_error([&] { cfg.validate(); }, field);
    expect_usage_error([&] { make_model(cfg, Device::cpu()); }, field);
    expect_usage_error([&] { from_json<ModelConfig>(nlohmann::json(cfg)); }, field);
  }
  nlohmann::json j = nlohmann::json(preset("llama-tiny"));
  j["n_head"] = 4;
  expect_usage_error([&] { from_json<ModelConfig>(j); }, "n_head");
  j = nlohmann::json(preset("llama-tiny"));
  j["dim"] = "128";
  expect_usage_error([&] { from_json<ModelConfig>(j); }, "dim");
  j = nlohmann::json(preset("llama-tiny"));
  j["arch"] = "gpt";
  expect_usage_error([&] { from_json<ModelConfig>(j); }, "arch");
  j = nlohmann::json(preset("mlp-small"));
  j["hidden"] = {64, 1.5};
  expect_usage_error([&] { from_json<ModelConfig>(j); }, "hidden");
  expect_usage_error([&] { make_model(preset("llama-tiny"), Device::cpu(), DType::bf16); }, "dtype");
}

}  // namespace
}  // namespace dtk::nn

namespace dtk::nn {
namespace {

// The sizes a user gives, applied by each architecture's rules (the programs' --dim, --layers...).
TEST(NnConfig, SizesGivenFollowTheArchitecture) {
  SizeOptions s;
  s.dim = 64, s.layers = 3, s.seq_len = 32;
  ModelConfig c = with_sizes(preset("llama-tiny"), s);
  EXPECT_EQ(c.dim, 64);
  EXPECT_EQ(c.n_layers, 3);
  EXPECT_EQ(c.seq_len, 32);
  // mlp: --dim and --layers make the hidden layers.
  SizeOptions m;
  m.dim = 32, m.layers = 2, m.input_dim = 10;
  c = with_sizes(preset("mlp-small"), m);
  EXPECT_EQ(c.hidden, (std::vector<int64_t>{32, 32}));
  EXPECT_EQ(c.input_dim, 10);
  // resnet: only --input-shape and --classes.
  SizeOptions r;
  r.input_shape = {3, 16, 16}, r.classes = 5;
  c = with_sizes(preset("resnet-8"), r);
  EXPECT_EQ(c.input_shape, (std::vector<int64_t>{3, 16, 16}));
  EXPECT_EQ(c.classes, 5);
  r.dim = 8;
  EXPECT_THROW(with_sizes(preset("resnet-8"), r), UsageError);
  SizeOptions bad;
  bad.classes = 3;
  EXPECT_THROW(with_sizes(preset("llama-tiny"), bad), UsageError);
  bad = {};
  bad.vocab = 100;
  EXPECT_THROW(with_sizes(preset("mlp-small"), bad), UsageError);
  bad = {};
  bad.input_shape = {1, 28, 28};
  EXPECT_THROW(with_sizes(preset("mlp-small"), bad), UsageError);
}

TEST(NnConfig, RestatedSizesMustMatchTheCheckpoint) {
  const ModelConfig ck = preset("llama-tiny");
  SizeOptions same;
  same.dim = ck.dim, same.layers = ck.n_layers;
  EXPECT_EQ(restated(ck, same), ck);
  SizeOptions longer;
  longer.seq_len = ck.seq_len * 2;  // a llama's sequence length may change
  EXPECT_EQ(restated(ck, longer).seq_len, ck.seq_len * 2);
  SizeOptions other;
  other.dim = ck.dim * 2;
  EXPECT_THROW(restated(ck, other), UsageError);
  other = {};
  other.layers = ck.n_layers + 1;
  EXPECT_THROW(restated(ck, other), UsageError);
}

}  // namespace
}  // namespace dtk::nn
