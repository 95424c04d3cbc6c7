// Neural-network ops (CPU): forwards against plain f64 references written here (f32 and f64),
// every backward against central finite differences in f64, and usage errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "dtk/core/error.h"
#include "dtk/core/philox.h"
#include "dtk/core/tensor.h"
#include "dtk/ops/ops.h"
#include "../common/mixed_ops.h"
#include "../common/test_util.h"

namespace dtk {
namespace {

using test_util::expect_close;
using test_util::randn;
using test_util::rounded;
using test_util::Vec;

const DType kFloats[] = {DType::f32, DType::f64};

// Forwards: f32 computes in double and rounds once (activations compute in f32: a few ulps).
double tol_of(DType t) { return test_util::tol_of(t, 1e-5); }
// Central differences with h = 1e-6 in f64: truncation ~h^2, cancellation ~1e-16 / h.
constexpr double kFdStep = 1e-6;
constexpr double kFdTol = 1e-6;

Tensor make(const Vec& v, const Shape& s, DType t = DType::f64) { return Tensor::from_doubles(v, s, t); }

double dotv(const Vec& a, const Vec& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// The gradient of loss(x) by central differences, element by element.
Vec numeric_grad(Vec x, const std::function<double(const Vec&)>& loss) {
  Vec g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + kFdStep;
    const double lp = loss(x);
    x[i] = x0 - kFdStep;
    const double lm = loss(x);
    x[i] = x0;
    g[i] = (lp - lm) / (2 * kFdStep);
  }
  return g;
}

// ---------------------------------------------------------------------------- references

Vec ref_softmax(const Vec& x, int64_t n, bool log) {
  Vec y(x.size());
  for (size_t r = 0; r < x.size() / n; ++r) {
    double m = -INFINITY, s = 0;
    for (int64_t i = 0; i < n; ++i) m = std::fmax(m, x[r * n + i]);
    for (int64_t i = 0; i < n; ++i) s += std::exp(x[r * n + i] - m);
    for (int64_t i = 0; i < n; ++i)
      y[r * n + i] = log ? x[r * n + i] - m - std::log(s) : std::exp(x[r * n + i] - m) / s;
  }
  return y;
}

// out [B,T,H,hd], lse [B,H,T]: causal, scale 1/sqrt(hd), query head h reads kv head h / (H / Hkv).
void ref_attention(const Vec& q, const Vec& k, const Vec& v, int64_t B, int64_t T, int64_t H, int64_t Hkv,
                   int64_t hd, Vec& out, Vec& lse) {
  out.assign(static_cast<size_t>(B * T * H * hd), 0.0);
  lse.assign(static_cast<size_t>(B * H * T), 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t g = h / (H / Hkv);
        Vec s(static_cast<size_t>(t + 1));
        double m = -INFINITY;
        for (int64_t j = 0; j <= t; ++j) {
          double d = 0;
          for (int64_t c = 0; c < hd; ++c) d += q[((b * T + t) * H + h) * hd + c] * k[((b * T + j) * Hkv + g) * hd + c];
          s[j] = d * scale;
          m = std::fmax(m, s[j]);
        }
        double l = 0;
        for (int64_t j = 0; j <= t; ++j) l += std::exp(s[j] - m);
        for (int64_t j = 0; j <= t; ++j) {
          const double p = std::exp(s[j] - m) / l;
          for (int64_t c = 0; c < hd; ++c)
            out[((b * T + t) * H + h) * hd + c] += p * v[((b * T + j) * Hkv + g) * hd + c];
        }
        lse[(b * H + h) * T + t] = m + std::log(l);
      }
}

Vec ref_rope(const Vec& x, int64_t B, int64_t T, int64_t H, int64_t hd, double theta, int64_t pos0, bool inverse) {
  Vec y(x.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < hd / 2; ++i) {
          const double angle = (inverse ? -1.0 : 1.0) * static_cast<double>(pos0 + t) * std::pow(theta, -2.0 * i / hd);
          const int64_t at = ((b * T + t) * H + h) * hd + 2 * i;
          y[at] = x[at] * std::cos(angle) - x[at + 1] * std::sin(angle);
          y[at + 1] = x[at] * std::sin(angle) + x[at + 1] * std::cos(angle);
        }
  return y;
}

// ---------------------------------------------------------------------------- softmax

struct RowShape {
  int64_t rows, n;
};
const RowShape kRowShapes[] = {{1, 1}, {1, 7}, {7, 13}, {3, 1003}, {40, 1000}};

TEST(OpsNN, SoftmaxAndLogSoftmaxForward) {
  for (DType t : kFloats)
    for (const RowShape& s : kRowShapes)
      for (bool log : {false, true}) {
        Vec x = randn(s.rows * s.n, 3 + s.n, 3.0);
        x[0] += 1000;  // a huge logit: needs the max shift
        x = rounded(x, t);
        Tensor y = Tensor::empty({s.rows, s.n}, t);
        if (log) ops::log_softmax_forward(make(x, {s.rows, s.n}, t), y);
        else ops::softmax_forward(make(x, {s.rows, s.n}, t), y);
        expect_close(y.to_doubles(), ref_softmax(x, s.n, log), tol_of(t),
                     std::string(log ? "log_softmax " : "softmax ") + std::string(dtype_name(t)) + " " +
                         std::to_string(s.rows) + "x" + std::to_string(s.n));
      }
}

TEST(OpsNN, SoftmaxBackwardFiniteDifferences) {
  for (bool log : {false, true})
    for (const RowShape& s : {RowShape{1, 1}, RowShape{3, 7}, RowShape{2, 13}}) {
      const Shape shape{s.rows, s.n};
      const Vec x = randn(s.rows * s.n, 5), r = randn(s.rows * s.n, 6);
      auto loss = [&](const Vec& xv) { return dotv(ref_softmax(xv, s.n, log), r); };
      Tensor y = Tensor::empty(shape, DType::f64), dx = Tensor::empty(shape, DType::f64);
      if (log) {
        ops::log_softmax_forward(make(x, shape), y);
        ops::log_softmax_backward(y, make(r, shape), dx);
      } else {
        ops::softmax_forward(make(x, shape), y);
        ops::softmax_backward(y, make(r, shape), dx);
      }
      expect_close(dx.to_doubles(), numeric_grad(x, loss), kFdTol,
                   std::string(log ? "log_softmax" : "softmax") + " backward " + std::to_string(s.n));
    }
}

// ---------------------------------------------------------------------------- cross entropy

TEST(OpsNN, CrossEntropyForwardWithIgnoredTargets) {
  for (DType t : kFloats)
    for (const RowShape& s : {RowShape{1, 1}, RowShape{7, 13}, RowShape{5, 1003}, RowShape{40, 1000}}) {
      const int64_t N = s.rows, V = s.n;
      const Vec x = rounded(randn(N * V, 9 + V, 2.0), t);
      Vec tg(static_cast<size_t>(N));
      for (int64_t i = 0; i < N; ++i) tg[i] = (i % 3 == 1) ? -1 : static_cast<double>((i * 7919) % V);
      Tensor losses = Tensor::empty({N}, t), lse = Tensor::empty({N}, t);
      ops::cross_entropy_forward(make(x, {N, V}, t), make(tg, {N}, DType::i32), losses, lse);
      const Vec ls = ref_softmax(x, V, true);
      Vec want(static_cast<size_t>(N)), want_lse(static_cast<size_t>(N));
      for (int64_t i = 0; i < N; ++i) {
        want[i] = tg[i] < 0 ? 0.0 : -ls[i * V + static_cast<int64_t>(tg[i])];
        want_lse[i] = tg[i] < 0 ? 0.0 : x[i * V] - ls[i * V];  // logsumexp = x - log_softmax(x)
      }
      expect_close(losses.to_doubles(), want, tol_of(t), "cross_entropy " + std::to_string(V));
      expect_close(lse.to_doubles(), want_lse, tol_of(t), "cross_entropy lse " + std::to_string(V));
    }
}

TEST(OpsNN, CrossEntropyBackwardFiniteDifferences) {
  const int64_t N = 5, V = 7;
  const Vec x = randn(N * V, 13, 2.0);
  const Vec tg = {3, -1, 0, 6, 3};  // row 1 ignored, target 3 repeated
  const double scale = 1.0 / 4;     // one over the counted targets
  auto loss = [&](const Vec& xv) {
    const Vec ls = ref_softmax(xv, V, true);
    double l = 0;
    for (int64_t i = 0; i < N; ++i)
      if (tg[i] >= 0) l -= ls[i * V + static_cast<int64_t>(tg[i])];
    return l * scale;
  };
  Tensor dx = Tensor::empty({N, V}, DType::f64), losses = Tensor::empty({N}, DType::f64);
  Tensor lse = Tensor::empty({N}, DType::f64);
  ops::cross_entropy_forward(make(x, {N, V}), make(tg, {N}, DType::i32), losses, lse);
  ops::cross_entropy_backward(make(x, {N, V}), make(tg, {N}, DType::i32), lse, scale, dx);
  const Vec got = dx.to_doubles();
  expect_close(got, numeric_grad(x, loss), kFdTol, "cross_entropy backward");
  for (int64_t i = 0; i < V; ++i) EXPECT_EQ(got[V + i], 0.0) << "ignored row";
  // In place (LinearLoss's use): the same values, f64, f32 and bf16.
  for (DType t : {DType::f64, DType::f32, DType::bf16}) {
    Tensor logits = make(rounded(x, t), {N, V}, t), sep = Tensor::empty({N, V}, t);
    const DType lt = t == DType::bf16 ? DType::f32 : t;
    Tensor l = Tensor::empty({N}, lt), s = Tensor::empty({N}, lt);
    ops::cross_entropy_forward(logits, make(tg, {N}, DType::i32), l, s);
    ops::cross_entropy_backward(logits, make(tg, {N}, DType::i32), s, scale, sep);
    ops::cross_entropy_backward(logits, make(tg, {N}, DType::i32), s, scale, logits);
    EXPECT_EQ(logits.to_doubles(), sep.to_doubles()) << dtype_name(t);
  }
}

TEST(OpsNN, CrossEntropyRejectsBadTargets) {
  Tensor logits = Tensor::zeros({2, 3}, DType::f32), losses = Tensor::empty({2}, DType::f32);
  Tensor lse = Tensor::empty({2}, DType::f32);
  EXPECT_THROW(ops::cross_entropy_forward(logits, make({0, 3}, {2}, DType::i32), losses, lse), UsageError);
  EXPECT_THROW(ops::cross_entropy_forward(logits, make({0, -2}, {2}, DType::i32), losses, lse), UsageError);
  EXPECT_THROW(ops::cross_entropy_forward(logits, make({0, 1}, {2}, DType::i64), losses, lse), UsageError);
  EXPECT_THROW(ops::cross_entropy_forward(logits, make({0, 1, 2}, {3}, DType::i32), losses, lse), UsageError);
  Tensor losses64 = Tensor::empty({2}, DType::f64), lse3 = Tensor::empty({3}, DType::f32);
  EXPECT_THROW(ops::cross_entropy_forward(logits, make({0, 1}, {2}, DType::i32), losses64, lse), UsageError);
  EXPECT_THROW(ops::cross_entropy_forward(logits, make({0, 1}, {2}, DType::i32), losses, lse3), UsageError);
  Tensor d = Tensor::empty({2, 3}, DType::f32);
  EXPECT_THROW(ops::cross_entropy_backward(logits, make({0, 1}, {2}, DType::i32), lse3, 1.0, d), UsageError);
  EXPECT_THROW(ops::cross_entropy_backward(logits, make({0, 1}, {2}, DType::i32), losses64, 1.0, d), UsageError);
}

// ---------------------------------------------------------------------------- rmsnorm

Vec ref_rmsnorm(const Vec& x, const Vec& w, int64_t D, double eps, Vec* rstd = nullptr) {
  Vec y(x.size());
  const size_t rows = x.size() / D;
  if (rstd) rstd->resize(rows);
  for (size_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < D; ++i) ss += x[r * D + i] * x[r * D + i];
    const double rs = 1 / std::sqrt(ss / D + eps);
    for (int64_t i = 0; i < D; ++i) y[r * D + i] = x[r * D + i] * rs * w[i];
    if (rstd) (*rstd)[r] = rs;
  }
  return y;
}

TEST(OpsNN, RmsnormForward) {
  for (DType t : kFloats)
    for (const RowShape& s : kRowShapes) {
      const Vec x = rounded(randn(s.rows * s.n, 17 + s.n), t), w = rounded(randn(s.n, 18), t);
      Tensor y = Tensor::empty({s.rows, s.n}, t), rstd = Tensor::empty({s.rows}, t);
      ops::rmsnorm_forward(make(x, {s.rows, s.n}, t), make(w, {s.n}, t), 1e-5, y, rstd);
      Vec rs;
      const Vec want = ref_rmsnorm(x, w, s.n, 1e-5, &rs);
      const std::string what = "rmsnorm " + std::string(dtype_name(t)) + " " + std::to_string(s.n);
      expect_close(y.to_doubles(), want, tol_of(t), what);
      expect_close(rstd.to_doubles(), rs, tol_of(t), what + " rstd");
    }
}

TEST(OpsNN, RmsnormBackwardFiniteDifferences) {
  for (const RowShape& s : {RowShape{1, 1}, RowShape{3, 7}, RowShape{4, 13}, RowShape{2, 70}}) {
    const int64_t R = s.rows, D = s.n;
    const Shape shape{R, D};
    const Vec x = randn(R * D, 21), w = randn(D, 22), r = randn(R * D, 23), dw0 = randn(D, 24);
    const double eps = 1e-5;
    Tensor y = Tensor::empty(shape, DType::f64), rstd = Tensor::empty({R}, DType::f64);
    const Tensor xt = make(x, shape), wt = make(w, {D});
    ops::rmsnorm_forward(xt, wt, eps, y, rstd);
    Tensor dx = Tensor::empty(shape, DType::f64), dw = make(dw0, {D});
    ops::rmsnorm_backward(xt, wt, rstd, make(r, shape), dx, dw);
    const std::string what = "rmsnorm backward " + std::to_string(R) + "x" + std::to_string(D);
    expect_close(dx.to_doubles(), numeric_grad(x, [&](const Vec& xv) { return dotv(ref_rmsnorm(xv, w, D, eps), r); }),
                 kFdTol, what + " dx");
    Vec dw_num = numeric_grad(w, [&](const Vec& wv) { return dotv(ref_rmsnorm(x, wv, D, eps), r); });
    for (int64_t i = 0; i < D; ++i) dw_num[i] += dw0[i];  // dw accumulates
    expect_close(dw.to_doubles(), dw_num, kFdTol, what + " dw");
  }
}

// The fused residual add gives what add + rmsnorm give, bit for bit (x in place of a too), and
// accumulate adds to dx what the plain backward writes.
TEST(OpsNN, RmsnormFusedResidual) {
  for (DType t : kFloats)
    for (const RowShape& s : kRowShapes) {
      const Shape shape{s.rows, s.n};
      const std::string what = "add_rmsnorm " + std::string(dtype_name(t)) + " " + std::to_string(s.n);
      const Tensor a = make(rounded(randn(s.rows * s.n, 31), t), shape, t), b = make(rounded(randn(s.rows * s.n, 32), t), shape, t);
      const Tensor w = make(rounded(randn(s.n, 33), t), {s.n}, t);
      Tensor x = Tensor::empty(shape, t), y = Tensor::empty(shape, t), rstd = Tensor::empty({s.rows}, t);
      ops::add(a, b, x);
      ops::rmsnorm_forward(x, w, 1e-5, y, rstd);
      Tensor x2 = Tensor::empty(shape, t), y2 = Tensor::empty(shape, t), rstd2 = Tensor::empty({s.rows}, t);
      ops::add_rmsnorm_forward(a, b, w, 1e-5, x2, y2, rstd2);
      EXPECT_EQ(x2.to_doubles(), x.to_doubles()) << what;
      EXPECT_EQ(y2.to_doubles(), y.to_doubles()) << what;
      EXPECT_EQ(rstd2.to_doubles(), rstd.to_doubles()) << what;
      Tensor inplace = a.clone();
      ops::add_rmsnorm_forward(inplace, b, w, 1e-5, inplace, y2, rstd2);
      EXPECT_EQ(inplace.to_doubles(), x.to_doubles()) << what << " in place";
      EXPECT_EQ(y2.to_doubles(), y.to_doubles()) << what << " in place";

      const Tensor dy = make(rounded(randn(s.rows * s.n, 34), t), shape, t);
      const Vec base = rounded(randn(s.rows * s.n, 35), t);
      Tensor dx = Tensor::empty(shape, t), dw = Tensor::zeros({s.n}, t), dacc = make(base, shape, t), dw2 = Tensor::zeros({s.n}, t);
      ops::rmsnorm_backward(x, w, rstd, dy, dx, dw);
      ops::rmsnorm_backward(x, w, rstd, dy, dacc, dw2, /*accumulate=*/true);
      Vec want = dx.to_doubles();
      for (size_t i = 0; i < want.size(); ++i) want[i] += base[i];
      expect_close(dacc.to_doubles(), want, tol_of(t), what + " accumulate");
      EXPECT_EQ(dw2.to_doubles(), dw.to_doubles()) << what;
    }
  Tensor a = Tensor::zeros({3, 4}, DType::f32), x = Tensor::empty({3, 4}, DType::f32), y = Tensor::empty({3, 4}, DType::f32);
  Tensor rstd = Tensor::empty({3}, DType::f32);
  EXPECT_THROW(ops::add_rmsnorm_forward(a, Tensor::zeros({4, 3}, DType::f32), Tensor::zeros({4}, DType::f32), 1e-5, x, y, rstd),
               UsageError);
  Tensor y64 = Tensor::empty({3, 4}, DType::f64);
  EXPECT_THROW(ops::add_rmsnorm_forward(a, a, Tensor::zeros({4}, DType::f32), 1e-5, x, y64, rstd), UsageError);
}

TEST(OpsNN, RmsnormUsageErrors) {
  Tensor x = Tensor::zeros({3, 4}, DType::f32), y = Tensor::empty({3, 4}, DType::f32);
  Tensor rstd = Tensor::empty({3}, DType::f32);
  EXPECT_THROW(ops::rmsnorm_forward(x, Tensor::zeros({5}, DType::f32), 1e-5, y, rstd), UsageError);
  EXPECT_THROW(ops::rmsnorm_forward(x, Tensor::zeros({4}, DType::f64), 1e-5, y, rstd), UsageError);
  Tensor rstd4 = Tensor::empty({4}, DType::f32);
  EXPECT_THROW(ops::rmsnorm_forward(x, Tensor::zeros({4}, DType::f32), 1e-5, y, rstd4), UsageError);
  Tensor y2 = Tensor::empty({4, 3}, DType::f32);
  EXPECT_THROW(ops::rmsnorm_forward(x, Tensor::zeros({4}, DType::f32), 1e-5, y2, rstd), UsageError);
}

// ---------------------------------------------------------------------------- activations

double sigmoid(double x) { return 1 / (1 + std::exp(-x)); }
double silu(double x) { return x * sigmoid(x); }
double gelu(double x) {
  return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
}

using ActFwd = void (*)(const Tensor&, Tensor&);
using ActBwd = void (*)(const Tensor&, const Tensor&, Tensor&);
struct Activation {
  const char* name;
  ActFwd fwd;
  ActBwd bwd;
  double (*ref)(double);
};
const Activation kActivations[] = {
    {"silu", ops::silu_forward, ops::silu_backward, silu},
    {"gelu", ops::gelu_forward, ops::gelu_backward, gelu},
    {"relu", ops::relu_forward, ops::relu_backward, [](double x) { return x > 0 ? x : 0.0; }},
};

TEST(OpsNN, ActivationsForward) {
  for (const Activation& a : kActivations)
    for (DType t : kFloats)
      for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1003}, int64_t{40009}}) {
        const Vec x = rounded(randn(n, 31 + n, 3.0), t);
        Tensor y = Tensor::empty({n}, t);
        a.fwd(make(x, {n}, t), y);
        Vec want(x.size());
        for (size_t i = 0; i < x.size(); ++i) want[i] = a.ref(x[i]);
        expect_close(y.to_doubles(), want, tol_of(t), std::string(a.name) + " " + std::string(dtype_name(t)));
        // in place
        Tensor z = make(x, {n}, t);
        a.fwd(z, z);
        expect_close(z.to_doubles(), want, tol_of(t), std::string(a.name) + " in place");
      }
}

TEST(OpsNN, ActivationsBackwardFiniteDifferences) {
  for (const Activation& a : kActivations) {
    const int64_t n = 101;
    const Vec x = randn(n, 41, 3.0), r = randn(n, 42);
    Tensor dx = Tensor::empty({n}, DType::f64);
    a.bwd(make(x, {n}), make(r, {n}), dx);
    auto loss = [&](const Vec& xv) {
      double s = 0;
      for (size_t i = 0; i < xv.size(); ++i) s += a.ref(xv[i]) * r[i];
      return s;
    };
    expect_close(dx.to_doubles(), numeric_grad(x, loss), kFdTol, std::string(a.name) + " backward");
  }
}

TEST(OpsNN, SwigluForwardAndBackward) {
  for (DType t : kFloats)
    for (int64_t n : {int64_t{1}, int64_t{1003}, int64_t{40009}}) {
      const Vec a = rounded(randn(n, 51, 2.0), t), b = rounded(randn(n, 52), t);
      Tensor y = Tensor::empty({n}, t);
      ops::swiglu_forward(make(a, {n}, t), make(b, {n}, t), y);
      Vec want(a.size());
      for (size_t i = 0; i < a.size(); ++i) want[i] = silu(a[i]) * b[i];
      expect_close(y.to_doubles(), want, tol_of(t), "swiglu " + std::string(dtype_name(t)));
    }
  const int64_t n = 37;
  const Vec a = randn(n, 53, 2.0), b = randn(n, 54), r = randn(n, 55);
  auto loss = [&](const Vec& av, const Vec& bv) {
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += silu(av[i]) * bv[i] * r[i];
    return s;
  };
  Tensor da = Tensor::empty({n}, DType::f64), db = Tensor::empty({n}, DType::f64);
  ops::swiglu_backward(make(a, {n}), make(b, {n}), make(r, {n}), da, db);
  expect_close(da.to_doubles(), numeric_grad(a, [&](const Vec& av) { return loss(av, b); }), kFdTol, "swiglu da");
  expect_close(db.to_doubles(), numeric_grad(b, [&](const Vec& bv) { return loss(a, bv); }), kFdTol, "swiglu db");
  // in place: da over a, db over b
  Tensor a2 = make(a, {n}), b2 = make(b, {n});
  ops::swiglu_backward(a2, b2, make(r, {n}), a2, b2);
  expect_close(a2.to_doubles(), da.to_doubles(), 0, "swiglu da in place");
  expect_close(b2.to_doubles(), db.to_doubles(), 0, "swiglu db in place");
}

// ---------------------------------------------------------------------------- rope

TEST(OpsNN, RopeForwardInverseAndBackward) {
  struct Case {
    int64_t B, T, H, hd, pos0;
  };
  for (const Case& c : {Case{1, 1, 1, 2, 0}, Case{2, 7, 3, 8, 5}, Case{1, 13, 2, 6, 1000}})
    for (DType t : kFloats) {
      const Shape shape{c.B, c.T, c.H, c.hd};
      const int64_t n = shape_numel(shape);
      const Vec x = rounded(randn(n, 61), t);
      const Tensor xt = make(x, shape, t);
      Tensor y = Tensor::empty(shape, t), back = Tensor::empty(shape, t);
      ops::rope(xt, 10000, c.pos0, false, y);
      const std::string what = "rope " + std::string(dtype_name(t)) + " hd=" + std::to_string(c.hd);
      expect_close(y.to_doubles(), ref_rope(x, c.B, c.T, c.H, c.hd, 10000, c.pos0, false), tol_of(t), what);
      ops::rope(y, 10000, c.pos0, true, back);
      expect_close(back.to_doubles(), x, tol_of(t), what + " inverse");
      Tensor inplace = xt.clone();
      ops::rope(inplace, 10000, c.pos0, false, inplace);
      expect_close(inplace.to_doubles(), y.to_doubles(), 0, what + " in place");
    }
  // the backward of a rotation is the inverse rotation
  const int64_t B = 2, T = 5, H = 2, hd = 4, pos0 = 3;
  const Shape shape{B, T, H, hd};
  const Vec x = randn(B * T * H * hd, 62), r = randn(B * T * H * hd, 63);
  Tensor dx = Tensor::empty(shape, DType::f64);
  ops::rope(make(r, shape), 500, pos0, true, dx);
  auto loss = [&](const Vec& xv) { return dotv(ref_rope(xv, B, T, H, hd, 500, pos0, false), r); };
  expect_close(dx.to_doubles(), numeric_grad(x, loss), kFdTol, "rope backward");
}

// q and k in one call: what two rope calls give, bit for bit (GQA: k with fewer heads).
TEST(OpsNN, RopeQkIsTwoRopes) {
  for (DType t : kFloats)
    for (bool inverse : {false, true}) {
      const Shape qs{2, 7, 4, 8}, ks{2, 7, 2, 8};
      const Tensor q0 = make(rounded(randn(shape_numel(qs), 64), t), qs, t);
      const Tensor k0 = make(rounded(randn(shape_numel(ks), 65), t), ks, t);
      Tensor q = q0.clone(), k = k0.clone(), qw = Tensor::empty(qs, t), kw = Tensor::empty(ks, t);
      ops::rope_qk(q, k, 500000, 3, inverse);
      ops::rope(q0, 500000, 3, inverse, qw);
      ops::rope(k0, 500000, 3, inverse, kw);
      expect_close(q.to_doubles(), qw.to_doubles(), 0, "rope_qk q");
      expect_close(k.to_doubles(), kw.to_doubles(), 0, "rope_qk k");
    }
  Tensor q = Tensor::zeros({1, 2, 2, 4}, DType::f32);
  for (const Shape& bad : std::vector<Shape>{{1, 3, 1, 4}, {2, 2, 1, 4}, {1, 2, 1, 6}, {1, 2, 4}}) {
    Tensor k = Tensor::zeros(bad, DType::f32);
    EXPECT_THROW(ops::rope_qk(q, k, 10000, 0, false), UsageError) << shape_str(bad);
  }
  Tensor k64 = Tensor::zeros({1, 2, 1, 4}, DType::f64);
  EXPECT_THROW(ops::rope_qk(q, k64, 10000, 0, false), UsageError);
}

TEST(OpsNN, RopeUsageErrors) {
  Tensor odd = Tensor::zeros({1, 2, 1, 5}, DType::f32), y = Tensor::empty({1, 2, 1, 5}, DType::f32);
  EXPECT_THROW(ops::rope(odd, 10000, 0, false, y), UsageError);
  Tensor three = Tensor::zeros({2, 1, 4}, DType::f32), y3 = Tensor::empty({2, 1, 4}, DType::f32);
  EXPECT_THROW(ops::rope(three, 10000, 0, false, y3), UsageError);
  Tensor x = Tensor::zeros({1, 2, 1, 4}, DType::f32), y64 = Tensor::empty({1, 2, 1, 4}, DType::f64);
  EXPECT_THROW(ops::rope(x, 10000, 0, false, y64), UsageError);
}

// ---------------------------------------------------------------------------- embedding

TEST(OpsNN, EmbeddingForwardAndBackwardWithRepeatedIds) {
  for (DType t : kFloats) {
    const int64_t V = 11, D = 130;
    const Vec ids = {3, 0, 10, 3, 3, 7, 0};  // repeated ids
    const int64_t N = static_cast<int64_t>(ids.size());
    const Vec table = rounded(randn(V * D, 71), t);
    Tensor out = Tensor::empty({N, D}, t);
    ops::embedding_forward(make(table, {V, D}, t), make(ids, {N}, DType::i32), out);
    Vec want(static_cast<size_t>(N * D));
    for (int64_t i = 0; i < N; ++i)
      for (int64_t d = 0; d < D; ++d) want[i * D + d] = table[static_cast<int64_t>(ids[i]) * D + d];
    expect_close(out.to_doubles(), want, 0, "embedding forward");

    const Vec dout = rounded(randn(N * D, 72), t), dt0 = rounded(randn(V * D, 73), t);
    Tensor dtable = make(dt0, {V, D}, t);
    ops::embedding_backward(make(ids, {N}, DType::i32), make(dout, {N, D}, t), dtable);
    Vec dwant = dt0;  // accumulates
    for (int64_t i = 0; i < N; ++i)
      for (int64_t d = 0; d < D; ++d) dwant[static_cast<int64_t>(ids[i]) * D + d] += dout[i * D + d];
    expect_close(dtable.to_doubles(), dwant, tol_of(t), "embedding backward " + std::string(dtype_name(t)));
  }
  // ids of any shape, flattened
  const Vec table = randn(4 * 3, 74);
  Tensor out = Tensor::empty({2, 2, 3}, DType::f64);
  ops::embedding_forward(make(table, {4, 3}), make({1, 2, 3, 0}, {2, 2}, DType::i32), out);
  EXPECT_EQ(out.to_doubles()[3 * 3], table[0]);
  // the backward of the forward, by finite differences
  const int64_t V = 5, D = 3;
  const Vec ids = {4, 1, 4, 4, 0};
  const Vec tb = randn(V * D, 75), r = randn(ids.size() * D, 76);
  auto loss = [&](const Vec& tv) {
    double s = 0;
    for (size_t i = 0; i < ids.size(); ++i)
      for (int64_t d = 0; d < D; ++d) s += tv[static_cast<int64_t>(ids[i]) * D + d] * r[i * D + d];
    return s;
  };
  Tensor dtable = Tensor::zeros({V, D}, DType::f64);
  ops::embedding_backward(make(ids, {5}, DType::i32), make(r, {5, D}), dtable);
  expect_close(dtable.to_doubles(), numeric_grad(tb, loss), kFdTol, "embedding backward fd");
}

TEST(OpsNN, EmbeddingUsageErrors) {
  Tensor table = Tensor::zeros({4, 3}, DType::f32), out = Tensor::empty({2, 3}, DType::f32);
  EXPECT_THROW(ops::embedding_forward(table, make({1, 4}, {2}, DType::i32), out), UsageError);  // id out of range
  EXPECT_THROW(ops::embedding_forward(table, make({1, 2}, {2}, DType::i64), out), UsageError);
  Tensor out_small = Tensor::empty({2, 2}, DType::f32);
  EXPECT_THROW(ops::embedding_forward(table, make({1, 2}, {2}, DType::i32), out_small), UsageError);
  Tensor dtable = Tensor::zeros({4, 3}, DType::f32);
  EXPECT_THROW(ops::embedding_backward(make({1, -1}, {2}, DType::i32), out, dtable), UsageError);
}

// ---------------------------------------------------------------------------- attention

struct AttnCase {
  int64_t B, T, H, Hkv, hd;
};
const AttnCase kAttnCases[] = {{2, 7, 4, 2, 4}, {1, 7, 2, 2, 8}, {2, 1, 4, 2, 4}, {1, 1, 2, 2, 8},
                               {1, 7, 3, 1, 8}, {2, 13, 4, 4, 6},
                               {1, 150, 2, 1, 2}};  // three 64-row query tiles, the last partial

TEST(OpsNN, AttentionForward) {
  for (const AttnCase& c : kAttnCases)
    for (DType t : kFloats)
      for (DType lse_t : {DType::f32, t}) {
        const Shape qs{c.B, c.T, c.H, c.hd}, ks{c.B, c.T, c.Hkv, c.hd};
        const Vec q = rounded(randn(shape_numel(qs), 81, 1.5), t), k = rounded(randn(shape_numel(ks), 82, 1.5), t),
                  v = rounded(randn(shape_numel(ks), 83), t);
        Tensor out = Tensor::empty(qs, t), lse = Tensor::empty({c.B, c.H, c.T}, lse_t);
        ops::attention_forward(make(q, qs, t), make(k, ks, t), make(v, ks, t), out, lse);
        Vec want, want_lse;
        ref_attention(q, k, v, c.B, c.T, c.H, c.Hkv, c.hd, want, want_lse);
        const std::string what = "attention T=" + std::to_string(c.T) + " H=" + std::to_string(c.H) +
                                 " Hkv=" + std::to_string(c.Hkv) + " " + std::string(dtype_name(t));
        expect_close(out.to_doubles(), want, tol_of(t), what);
        expect_close(lse.to_doubles(), want_lse, tol_of(lse_t), what + " lse");
      }
}

TEST(OpsNN, AttentionBackwardFiniteDifferences) {
  for (const AttnCase& c : kAttnCases) {
    const Shape qs{c.B, c.T, c.H, c.hd}, ks{c.B, c.T, c.Hkv, c.hd};
    const Vec q = randn(shape_numel(qs), 91, 1.5), k = randn(shape_numel(ks), 92, 1.5), v = randn(shape_numel(ks), 93),
              r = randn(shape_numel(qs), 94);
    const Tensor qt = make(q, qs), kt = make(k, ks), vt = make(v, ks), rt = make(r, qs);
    Tensor out = Tensor::empty(qs, DType::f64), lse = Tensor::empty({c.B, c.H, c.T}, DType::f64);
    ops::attention_forward(qt, kt, vt, out, lse);
    Tensor dq = Tensor::empty(qs, DType::f64), dk = Tensor::empty(ks, DType::f64), dv = Tensor::empty(ks, DType::f64);
    ops::attention_backward(qt, kt, vt, out, lse, rt, dq, dk, dv);
    auto loss = [&](const Vec& qv, const Vec& kv, const Vec& vv) {
      Vec o, l;
      ref_attention(qv, kv, vv, c.B, c.T, c.H, c.Hkv, c.hd, o, l);
      return dotv(o, r);
    };
    const std::string what = "attention backward B=" + std::to_string(c.B) + " T=" + std::to_string(c.T) +
                             " H=" + std::to_string(c.H) + " Hkv=" + std::to_string(c.Hkv) +
                             " hd=" + std::to_string(c.hd);
    expect_close(dq.to_doubles(), numeric_grad(q, [&](const Vec& x) { return loss(x, k, v); }), kFdTol, what + " dq");
    expect_close(dk.to_doubles(), numeric_grad(k, [&](const Vec& x) { return loss(q, x, v); }), kFdTol, what + " dk");
    expect_close(dv.to_doubles(), numeric_grad(v, [&](const Vec& x) { return loss(q, k, x); }), kFdTol, what + " dv");
  }
}

TEST(OpsNN, AttentionUsageErrors) {
  Tensor q = Tensor::zeros({1, 3, 4, 8}, DType::f32), out = Tensor::empty({1, 3, 4, 8}, DType::f32);
  Tensor lse = Tensor::empty({1, 4, 3}, DType::f32);
  Tensor k3 = Tensor::zeros({1, 3, 3, 8}, DType::f32);  // 4 % 3 != 0
  EXPECT_THROW(ops::attention_forward(q, k3, k3, out, lse), UsageError);
  Tensor k = Tensor::zeros({1, 3, 2, 8}, DType::f32), vbad = Tensor::zeros({1, 3, 2, 4}, DType::f32);
  EXPECT_THROW(ops::attention_forward(q, k, vbad, out, lse), UsageError);
  Tensor lse_bad = Tensor::empty({1, 3, 4}, DType::f32);
  EXPECT_THROW(ops::attention_forward(q, k, k, out, lse_bad), UsageError);
  Tensor k64 = Tensor::zeros({1, 3, 2, 8}, DType::f64);
  EXPECT_THROW(ops::attention_forward(q, k64, k64, out, lse), UsageError);
  Tensor lse_i = Tensor::empty({1, 4, 3}, DType::i32);
  EXPECT_THROW(ops::attention_forward(q, k, k, out, lse_i), UsageError);
  EXPECT_NO_THROW(ops::attention_forward(q, k, k, out, lse));
}

// ---------------------------------------------------------------------------- attention in bf16
// The bf16 contract (ops.h) against f64 references computed from the same bf16 inputs. Each
// rounding to bf16 (8 significant bits, to nearest) moves a value by at most 2^-8 of itself, and
// the contract rounds P before P V and dS before dS K, dS^T Q, then each result once. So with P the
// exact softmax, the references bound how far each element may be from the exact value:
//   out = sum_j P_j v_j                 by 2^-8 (sum_j P_j |v_j| + |out|)
//   dv  = sum_{h,t} P_t dout_t          by 2^-8 (sum P_t |dout_t| + |dv|)
//   dq  = scale sum_j dS_j k_j          by 2^-8 (scale sum_j |dS_j| |k_j| + |dq|)
//   dk  = scale sum_{h,t} dS_t q_t      by 2^-8 (scale sum |dS_t| |q_t| + |dk|)
// (1% over it for the second-order terms), plus 2e-4 for the f32 arithmetic: sums of up to a few
// hundred products, relative 2^-24 each, and exp to 2 ulp. lse is f32 throughout: 1e-4.
constexpr double kBf16Step = 1.0 / 256;

struct AttnRef {
  Vec out, lse, out_bound;
  Vec dq, dk, dv, dq_bound, dk_bound, dv_bound;
};

// The exact forward, and the backward given dout and the forward's stored out (bf16 values, as the
// op's D = rowsum(dout * out) reads them).
AttnRef ref_attention_bf16(const Vec& q, const Vec& k, const Vec& v, const Vec& out_given, const Vec& dout,
                           const AttnCase& c) {
  const int64_t B = c.B, T = c.T, H = c.H, Hkv = c.Hkv, hd = c.hd, G = H / Hkv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  AttnRef r;
  const size_t nq = static_cast<size_t>(B * T * H * hd), nk = static_cast<size_t>(B * T * Hkv * hd);
  r.out.assign(nq, 0.0), r.out_bound.assign(nq, 0.0), r.dq.assign(nq, 0.0), r.dq_bound.assign(nq, 0.0);
  r.dk.assign(nk, 0.0), r.dv.assign(nk, 0.0), r.dk_bound.assign(nk, 0.0), r.dv_bound.assign(nk, 0.0);
  r.lse.assign(static_cast<size_t>(B * H * T), 0.0);
  auto qi = [&](int64_t b, int64_t t, int64_t h) { return static_cast<size_t>(((b * T + t) * H + h) * hd); };
  auto ki = [&](int64_t b, int64_t t, int64_t g) { return static_cast<size_t>(((b * T + t) * Hkv + g) * hd); };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t g = h / G;
        Vec p(static_cast<size_t>(t + 1)), dp(static_cast<size_t>(t + 1));
        double m = -INFINITY;
        for (int64_t j = 0; j <= t; ++j) {
          double s = 0, e = 0;
          for (int64_t x = 0; x < hd; ++x) {
            s += q[qi(b, t, h) + x] * k[ki(b, j, g) + x];
            e += dout[qi(b, t, h) + x] * v[ki(b, j, g) + x];
          }
          p[j] = s * scale, dp[j] = e;
          m = std::fmax(m, p[j]);
        }
        double l = 0, D = 0;
        for (int64_t j = 0; j <= t; ++j) l += std::exp(p[j] - m);
        for (int64_t j = 0; j <= t; ++j) p[j] = std::exp(p[j] - m) / l;
        r.lse[static_cast<size_t>((b * H + h) * T + t)] = m + std::log(l);
        for (int64_t x = 0; x < hd; ++x) D += dout[qi(b, t, h) + x] * out_given[qi(b, t, h) + x];
        for (int64_t j = 0; j <= t; ++j) {
          const double ds = p[j] * (dp[j] - D);
          for (int64_t x = 0; x < hd; ++x) {
            const size_t at = qi(b, t, h) + x, kat = ki(b, j, g) + x;
            r.out[at] += p[j] * v[kat];
            r.out_bound[at] += p[j] * std::fabs(v[kat]);
            r.dq[at] += scale * ds * k[kat];
            r.dq_bound[at] += scale * std::fabs(ds * k[kat]);
            r.dk[kat] += scale * ds * q[at];
            r.dk_bound[kat] += scale * std::fabs(ds * q[at]);
            r.dv[kat] += p[j] * dout[at];
            r.dv_bound[kat] += p[j] * std::fabs(dout[at]);
          }
        }
      }
  return r;
}

// |got - want| <= 1.01 * 2^-8 * (bound + |want|) + 2e-4 for every element.
void expect_within_bf16(const Vec& got, const Vec& want, const Vec& bound, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double tol = 1.01 * kBf16Step * (bound[i] + std::fabs(want[i])) + 2e-4;
    if (!(std::fabs(got[i] - want[i]) <= tol)) {
      if (bad < 5)
        ADD_FAILURE() << what << ": element " << i << " got " << got[i] << ", want " << want[i] << " +- " << tol;
      ++bad;
    }
  }
  EXPECT_EQ(bad, 0) << what;
}

// GQA groups of 1, 2 and 4; T below, at and across the 64-row tiles (130, 250: a partial last
// tile); both head dims.
const AttnCase kAttnBf16Cases[] = {{2, 100, 4, 2, 64}, {1, 130, 4, 1, 128}, {2, 64, 2, 2, 64},
                                   {1, 1, 2, 1, 128},  {1, 250, 4, 4, 128}, {1, 63, 4, 1, 64}};

TEST(OpsNN, AttentionBf16AgainstF64) {
  for (const AttnCase& c : kAttnBf16Cases) {
    const Shape qs{c.B, c.T, c.H, c.hd}, ks{c.B, c.T, c.Hkv, c.hd};
    const Tensor q = make(randn(shape_numel(qs), 181, 1.5), qs, DType::bf16);
    const Tensor k = make(randn(shape_numel(ks), 182, 1.5), ks, DType::bf16);
    const Tensor v = make(randn(shape_numel(ks), 183), ks, DType::bf16);
    const Tensor dout = make(randn(shape_numel(qs), 184), qs, DType::bf16);
    Tensor out = Tensor::empty(qs, DType::bf16), lse = Tensor::empty({c.B, c.H, c.T}, DType::f32);
    ops::attention_forward(q, k, v, out, lse);
    Tensor dq = Tensor::empty(qs, DType::bf16), dk = Tensor::empty(ks, DType::bf16);
    Tensor dv = Tensor::empty(ks, DType::bf16);
    ops::attention_backward(q, k, v, out, lse, dout, dq, dk, dv);
    const AttnRef r = ref_attention_bf16(q.to_doubles(), k.to_doubles(), v.to_doubles(), out.to_doubles(),
                                         dout.to_doubles(), c);
    const std::string what = "bf16 attention B=" + std::to_string(c.B) + " T=" + std::to_string(c.T) +
                             " H=" + std::to_string(c.H) + " Hkv=" + std::to_string(c.Hkv) +
                             " hd=" + std::to_string(c.hd);
    expect_within_bf16(out.to_doubles(), r.out, r.out_bound, what + " out");
    expect_close(lse.to_doubles(), r.lse, 1e-4, what + " lse");
    expect_within_bf16(dq.to_doubles(), r.dq, r.dq_bound, what + " dq");
    expect_within_bf16(dk.to_doubles(), r.dk, r.dk_bound, what + " dk");
    expect_within_bf16(dv.to_doubles(), r.dv, r.dv_bound, what + " dv");
  }
}

// What the element bounds leave room for, pinned down: the first row sees key 0 alone, so P = 1
// exactly, out = v_0 exactly and lse is the scaled score; and the error over all rows is that of
// independent roundings, whose norm (about 2^-9.5 of the result's) stays below 2^-8 of it, where
// an error of a whole bf16 step in every element, which the element bounds can admit, would not.
TEST(OpsNN, AttentionBf16ExactCases) {
  const AttnCase c{1, 96, 2, 1, 64};
  const Shape qs{c.B, c.T, c.H, c.hd}, ks{c.B, c.T, c.Hkv, c.hd};
  const Tensor q = make(randn(shape_numel(qs), 191, 1.5), qs, DType::bf16);
  const Tensor k = make(randn(shape_numel(ks), 192, 1.5), ks, DType::bf16);
  const Tensor v = make(randn(shape_numel(ks), 193), ks, DType::bf16);
  Tensor out = Tensor::empty(qs, DType::bf16), lse = Tensor::empty({c.B, c.H, c.T}, DType::f32);
  ops::attention_forward(q, k, v, out, lse);
  const Vec got = out.to_doubles(), vv = v.to_doubles(), qq = q.to_doubles(), kk = k.to_doubles();
  const AttnRef r = ref_attention_bf16(qq, kk, vv, got, Vec(got.size(), 0.0), c);
  double err2 = 0, want2 = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    err2 += (got[i] - r.out[i]) * (got[i] - r.out[i]);
    want2 += r.out[i] * r.out[i];
  }
  EXPECT_LT(std::sqrt(err2 / want2), kBf16Step);
  double s0 = 0;
  for (size_t x = 0; x < 64; ++x) {
    EXPECT_EQ(got[x], vv[x]) << "out[0, 0, 0, " << x << "]";
    s0 += qq[x] * kk[x];
  }
  EXPECT_NEAR(lse.to_doubles()[0], s0 / 8.0, 1e-5);  // hd 64: scale 1/8
}

TEST(OpsNN, AttentionBf16UsageErrors) {
  const Shape qs{1, 3, 4, 64}, ks{1, 3, 2, 64};
  Tensor q = Tensor::zeros(qs, DType::bf16), k = Tensor::zeros(ks, DType::bf16), v = Tensor::zeros(ks, DType::bf16);
  Tensor out = Tensor::empty(qs, DType::bf16), lse = Tensor::empty({1, 4, 3}, DType::f32);
  EXPECT_NO_THROW(ops::attention_forward(q, k, v, out, lse));
  // mixed dtypes: k, v or out f32 with q bf16
  Tensor k32 = Tensor::zeros(ks, DType::f32), out32 = Tensor::empty(qs, DType::f32);
  EXPECT_THROW(ops::attention_forward(q, k32, k32, out, lse), UsageError);
  EXPECT_THROW(ops::attention_forward(q, k, k32, out, lse), UsageError);
  EXPECT_THROW(ops::attention_forward(q, k, v, out32, lse), UsageError);
  // lse must be f32 (not bf16, not f64)
  Tensor lse16 = Tensor::empty({1, 4, 3}, DType::bf16), lse64 = Tensor::empty({1, 4, 3}, DType::f64);
  EXPECT_THROW(ops::attention_forward(q, k, v, out, lse16), UsageError);
  EXPECT_THROW(ops::attention_forward(q, k, v, out, lse64), UsageError);
  // head dims other than 64 and 128; the message names the supported ones
  const Shape q32{1, 3, 4, 32}, k32s{1, 3, 2, 32};
  Tensor qh = Tensor::zeros(q32, DType::bf16), kh = Tensor::zeros(k32s, DType::bf16);
  Tensor oh = Tensor::empty(q32, DType::bf16);
  try {
    ops::attention_forward(qh, kh, kh, oh, lse);
    ADD_FAILURE() << "hd 32 in bf16 accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("64 and 128"), std::string::npos) << e.what();
  }
  // f16 is not an attention dtype
  Tensor q16 = Tensor::zeros(qs, DType::f16), k16 = Tensor::zeros(ks, DType::f16), o16 = Tensor::empty(qs, DType::f16);
  EXPECT_THROW(ops::attention_forward(q16, k16, k16, o16, lse), UsageError);
  // the backward checks the same, and its outputs' dtypes
  Tensor dq = Tensor::empty(qs, DType::bf16), dk = Tensor::empty(ks, DType::bf16), dv = Tensor::empty(ks, DType::bf16);
  Tensor dk32 = Tensor::empty(ks, DType::f32);
  EXPECT_NO_THROW(ops::attention_backward(q, k, v, out, lse, out, dq, dk, dv));
  EXPECT_THROW(ops::attention_backward(q, k, v, out, lse16, out, dq, dk, dv), UsageError);
  EXPECT_THROW(ops::attention_backward(q, k, v, out, lse, out, dq, dk32, dv), UsageError);
  EXPECT_THROW(ops::attention_backward(q, k, v, out, lse, out32, dq, dk, dv), UsageError);
  EXPECT_THROW(ops::attention_backward(qh, kh, kh, oh, lse, oh, oh, kh, kh), UsageError);
}

// The mixed-precision ops (ops.h) on the CPU: with bf16 tensors each op is its f32 self on the
// widened values, every bf16 output rounded once to nearest even and every f32 output unchanged:
// bit for bit (the contract the GPU test holds CUDA to, within its f32 arithmetic's ulps).
TEST(OpsNN, MixedPrecisionRoundsOnceWhereItStores) {
  for (const test_util::MixedCase& c : test_util::mixed_cases()) {
    const std::vector<Tensor> got = c.run(DType::bf16, Device::cpu()), f32 = c.run(DType::f32, Device::cpu());
    ASSERT_EQ(got.size(), f32.size()) << c.name;
    for (size_t i = 0; i < got.size(); ++i) {
      const Vec want = got[i].dtype() == DType::bf16 ? rounded(f32[i].to_doubles(), DType::bf16) : f32[i].to_doubles();
      EXPECT_EQ(got[i].to_doubles(), want) << c.name << ", output " << i;
      EXPECT_NE(std::count(want.begin(), want.end(), 0.0), static_cast<long>(want.size())) << c.name;
    }
  }
}

TEST(OpsNN, MixedPrecisionUsageErrors) {
  Tensor x64 = Tensor::zeros({2, 4}, DType::f64), w16 = Tensor::zeros({4}, DType::bf16);
  Tensor y64 = Tensor::zeros({2, 4}, DType::f64), r64 = Tensor::zeros({2}, DType::f64);
  EXPECT_THROW(ops::rmsnorm_forward(x64, w16, 1e-5, y64, r64), UsageError);  // f64 never mixes
  Tensor x16 = Tensor::zeros({2, 4}, DType::bf16), y16 = Tensor::zeros({2, 4}, DType::bf16);
  Tensor r16 = Tensor::zeros({2}, DType::bf16);
  EXPECT_THROW(ops::rmsnorm_forward(x16, w16, 1e-5, y16, r16), UsageError);  // the statistics stay f32
  Tensor a32 = Tensor::zeros({2, 4}, DType::f32);
  EXPECT_THROW(ops::swiglu_forward(a32, x16, y16), UsageError);  // swiglu: one dtype
  EXPECT_THROW(ops::add(x64, x16, y16), UsageError);
  Tensor logits = Tensor::zeros({2, 4}, DType::bf16), targets = Tensor::zeros({2}, DType::i32);
  Tensor l32 = Tensor::zeros({2}, DType::f32);
  EXPECT_THROW(ops::cross_entropy_forward(logits, targets, r16, l32), UsageError);  // bf16 losses
  EXPECT_THROW(ops::cross_entropy_forward(logits, targets, l32, r16), UsageError);  // bf16 lse
  Tensor d32 = Tensor::zeros({2, 4}, DType::f32);
  EXPECT_THROW(ops::cross_entropy_backward(logits, targets, l32, 1.0, d32), UsageError);  // dlogits: the logits' dtype
}

TEST(OpsNN, SoftmaxUsageErrors) {
  Tensor x = Tensor::zeros({3, 4}, DType::f32);
  Tensor y = Tensor::empty({4, 3}, DType::f32), y64 = Tensor::empty({3, 4}, DType::f64);
  EXPECT_THROW(ops::softmax_forward(x, y), UsageError);
  EXPECT_THROW(ops::log_softmax_forward(x, y64), UsageError);
  Tensor xi = Tensor::zeros({3, 4}, DType::i32);
  EXPECT_THROW(ops::softmax_forward(xi, xi), UsageError);
}

// ---------------------------------------------------------------------------- convolutional nets

struct ConvCase {
  int64_t N, C, H, W, K;
  ops::Window g;
};
// 3x3 stride 1 pad 1 (ResNet's), 3x3 stride 2 pad 1, 1x1 stride 2 (the downsampling shortcut),
// a non-square kernel with unequal strides and padding, a kernel as large as the image.
const ConvCase kConvCases[] = {{2, 3, 5, 6, 4, {3, 3, 1, 1, 1, 1}},
                               {1, 2, 7, 7, 3, {3, 3, 2, 2, 1, 1}},
                               {2, 3, 6, 5, 2, {1, 1, 2, 2, 0, 0}},
                               {1, 2, 6, 7, 3, {2, 3, 2, 1, 1, 2}},
                               {1, 1, 3, 3, 1, {3, 3, 1, 1, 0, 0}}};

// Direct convolution in f64: y[n, k, p, q] = sum over c, i, j of w[k, c, i, j] x[n, c, h, w].
Vec ref_conv(const Vec& x, const Vec& w, const ConvCase& c) {
  const ops::Window& g = c.g;
  const int64_t P = g.out_h(c.H), Q = g.out_w(c.W);
  Vec y(static_cast<size_t>(c.N * c.K * P * Q), 0.0);
  for (int64_t n = 0; n < c.N; ++n)
    for (int64_t k = 0; k < c.K; ++k)
      for (int64_t p = 0; p < P; ++p)
        for (int64_t q = 0; q < Q; ++q) {
          double s = 0;
          for (int64_t ch = 0; ch < c.C; ++ch)
            for (int64_t i = 0; i < g.kh; ++i)
              for (int64_t j = 0; j < g.kw; ++j) {
                const int64_t h = p * g.stride_h - g.pad_h + i, ww = q * g.stride_w - g.pad_w + j;
                if (h >= 0 && h < c.H && ww >= 0 && ww < c.W)
                  s += w[((k * c.C + ch) * g.kh + i) * g.kw + j] * x[((n * c.C + ch) * c.H + h) * c.W + ww];
              }
          y[((n * c.K + k) * P + p) * Q + q] = s;
        }
  return y;
}

TEST(OpsNN, Conv2dForwardMatchesDirectConvolution) {
  for (DType t : kFloats)
    for (const ConvCase& c : kConvCases) {
      const ops::Window& g = c.g;
      const int64_t P = g.out_h(c.H), Q = g.out_w(c.W);
      const Vec x = rounded(randn(c.N * c.C * c.H * c.W, 31), t), w = rounded(randn(c.K * c.C * g.kh * g.kw, 32), t);
      Tensor y = Tensor::empty({c.N, c.K, P, Q}, t), cols = Tensor::empty({c.C * g.kh * g.kw, P * Q}, t);
      ops::conv2d_forward(make(x, {c.N, c.C, c.H, c.W}, t), make(w, {c.K, c.C, g.kh, g.kw}, t), g, cols, y);
      expect_close(y.to_doubles(), ref_conv(x, w, c), tol_of(t) * 10, "conv2d " + std::string(dtype_name(t)));
    }
}

// col2im is im2col's adjoint: <im2col(x), r> = <x, col2im(r)>.
TEST(OpsNN, Col2imIsTheAdjointOfIm2col) {
  for (const ConvCase& c : kConvCases) {
    const ops::Window& g = c.g;
    const Shape cs{c.C * g.kh * g.kw, g.out_h(c.H) * g.out_w(c.W)};
    const Vec x = randn(c.C * c.H * c.W, 33), r = randn(cs[0] * cs[1], 34);
    Tensor cols = Tensor::empty(cs, DType::f64), dx = Tensor::empty({c.C, c.H, c.W}, DType::f64);
    ops::im2col(make(x, {c.C, c.H, c.W}), g, cols);
    ops::col2im(make(r, cs), g, dx);
    EXPECT_NEAR(dotv(cols.to_doubles(), r), dotv(x, dx.to_doubles()), 1e-12 * (1 + std::fabs(dotv(x, dx.to_doubles()))));
  }
}

TEST(OpsNN, Conv2dBackwardFiniteDifferences) {
  for (const ConvCase& c : kConvCases) {
    const ops::Window& g = c.g;
    const int64_t P = g.out_h(c.H), Q = g.out_w(c.W);
    const Shape xs{c.N, c.C, c.H, c.W}, ws{c.K, c.C, g.kh, g.kw}, cs{c.C * g.kh * g.kw, P * Q};
    const Vec x = randn(c.N * c.C * c.H * c.W, 35), w = randn(c.K * c.C * g.kh * g.kw, 36);
    const Vec r = randn(c.N * c.K * P * Q, 37), dw0 = randn(c.K * c.C * g.kh * g.kw, 38);
    Tensor cols = Tensor::empty(cs, DType::f64), dcols = Tensor::empty(cs, DType::f64);
    Tensor dw = make(dw0, ws), dx = Tensor::empty(xs, DType::f64);
    ops::conv2d_backward(make(x, xs), make(w, ws), make(r, {c.N, c.K, P, Q}), g, cols, dcols, dw, &dx);
    const std::string what = "conv2d backward kernel " + std::to_string(g.kh) + "x" + std::to_string(g.kw);
    expect_close(dx.to_doubles(), numeric_grad(x, [&](const Vec& xv) { return dotv(ref_conv(xv, w, c), r); }), kFdTol,
                 what + " dx");
    Vec dw_num = numeric_grad(w, [&](const Vec& wv) { return dotv(ref_conv(x, wv, c), r); });
    for (size_t i = 0; i < dw_num.size(); ++i) dw_num[i] += dw0[i];  // dw accumulates
    expect_close(dw.to_doubles(), dw_num, kFdTol, what + " dw");
    // Without dx: the same dw.
    Tensor dw2 = make(dw0, ws);
    ops::conv2d_backward(make(x, xs), make(w, ws), make(r, {c.N, c.K, P, Q}), g, cols, dcols, dw2, nullptr);
    EXPECT_EQ(dw2.to_doubles(), dw.to_doubles());
  }
}

// Max over each window (padding excluded) in f64; argmax the first winner in row-major order.
Vec ref_maxpool(const Vec& x, int64_t NC, int64_t H, int64_t W, const ops::Window& g, std::vector<int>* arg = nullptr) {
  const int64_t P = g.out_h(H), Q = g.out_w(W);
  Vec y(static_cast<size_t>(NC * P * Q));
  if (arg) arg->assign(y.size(), -1);
  for (int64_t nc = 0; nc < NC; ++nc)
    for (int64_t p = 0; p < P; ++p)
      for (int64_t q = 0; q < Q; ++q) {
        double m = -INFINITY;
        int best = -1;
        for (int64_t i = 0; i < g.kh; ++i)
          for (int64_t j = 0; j < g.kw; ++j) {
            const int64_t h = p * g.stride_h - g.pad_h + i, w = q * g.stride_w - g.pad_w + j;
            if (h < 0 || h >= H || w < 0 || w >= W) continue;
            if (best < 0 || x[(nc * H + h) * W + w] > m) {
              m = x[(nc * H + h) * W + w];
              best = static_cast<int>(h * W + w);
            }
          }
        y[(nc * P + p) * Q + q] = m;
        if (arg) (*arg)[(nc * P + p) * Q + q] = best;
      }
  return y;
}

TEST(OpsNN, MaxPoolForwardAndBackward) {
  // torchvision's 3x3 stride 2 pad 1 (windows overlap), 2x2 stride 2, a non-square window.
  const ops::Window wins[] = {{3, 3, 2, 2, 1, 1}, {2, 2, 2, 2, 0, 0}, {2, 3, 1, 2, 1, 1}};
  for (const ops::Window& g : wins)
    for (DType t : kFloats) {
      const int64_t N = 2, C = 3, H = 7, W = 6, P = g.out_h(H), Q = g.out_w(W);
      const Vec x = rounded(randn(N * C * H * W, 41), t), r = randn(N * C * P * Q, 42);
      Tensor y = Tensor::empty({N, C, P, Q}, t), arg = Tensor::empty({N, C, P, Q}, DType::i32);
      ops::maxpool2d_forward(make(x, {N, C, H, W}, t), g, y, arg);
      std::vector<int> want_arg;
      EXPECT_EQ(y.to_doubles(), ref_maxpool(x, N * C, H, W, g, &want_arg));
      const Vec got_arg = arg.to_doubles();
      for (size_t i = 0; i < want_arg.size(); ++i) ASSERT_EQ(got_arg[i], want_arg[i]) << i;
      if (t != DType::f64) continue;
      Tensor dx = Tensor::empty({N, C, H, W}, t);
      ops::maxpool2d_backward(arg, make(r, {N, C, P, Q}), g, dx);
      expect_close(dx.to_doubles(), numeric_grad(x, [&](const Vec& xv) { return dotv(ref_maxpool(xv, N * C, H, W, g), r); }),
                   kFdTol, "maxpool backward");
    }
  // Ties go to the first in window order; a NaN wins.
  const ops::Window g{2, 2, 2, 2, 0, 0};
  Tensor y = Tensor::empty({1, 1, 1, 1}, DType::f32), arg = Tensor::empty({1, 1, 1, 1}, DType::i32);
  ops::maxpool2d_forward(make({1, 3, 3, 2}, {1, 1, 2, 2}, DType::f32), g, y, arg);
  EXPECT_EQ(arg.to_doubles()[0], 1);
  ops::maxpool2d_forward(make({1, NAN, 3, 2}, {1, 1, 2, 2}, DType::f32), g, y, arg);
  EXPECT_TRUE(std::isnan(y.to_doubles()[0]));
  EXPECT_EQ(arg.to_doubles()[0], 1);
}

// Training-mode batch norm in f64 from scratch: per channel over (n, l), biased variance.
Vec ref_batchnorm(const Vec& x, const Vec& gamma, const Vec& beta, int64_t N, int64_t C, int64_t L, double eps) {
  Vec y(x.size());
  for (int64_t c = 0; c < C; ++c) {
    double m = 0, v = 0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t l = 0; l < L; ++l) m += x[(n * C + c) * L + l];
    m /= static_cast<double>(N * L);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t l = 0; l < L; ++l) v += (x[(n * C + c) * L + l] - m) * (x[(n * C + c) * L + l] - m);
    v /= static_cast<double>(N * L);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t l = 0; l < L; ++l) {
        const size_t i = static_cast<size_t>((n * C + c) * L + l);
        y[i] = (x[i] - m) / std::sqrt(v + eps) * gamma[c] + beta[c];
      }
  }
  return y;
}

// The batch-norm ops composed as a layer does: sums -> mean, invstd -> forward; backward from
// the backward sums. Against the f64 reference and its finite differences.
TEST(OpsNN, BatchnormForwardAndBackward) {
  for (DType t : kFloats)
    for (const Shape& s : {Shape{4, 3, 2, 5}, Shape{5, 2}, Shape{1, 1, 3, 3}}) {
      const int64_t N = s[0], C = s[1], L = shape_numel(s) / (N * C);
      const double eps = 1e-5, M = static_cast<double>(N * L);
      const Vec x = rounded(randn(shape_numel(s), 51, 2.0), t), gamma = rounded(randn(C, 52), t), beta = rounded(randn(C, 53), t);
      auto forward = [&](const Vec& xv, const Vec& gv, const Vec& bv, Tensor& mean, Tensor& invstd) {
        Tensor sums = Tensor::empty({2, C}, DType::f64), y = Tensor::empty(s, t);
        const Tensor xt = make(xv, s, t);
        ops::batchnorm_reduce(xt, sums);
        const Vec sv = sums.to_doubles();
        Vec mv(C), rv(C);
        for (int64_t c = 0; c < C; ++c) {
          mv[c] = sv[c] / M;
          rv[c] = 1 / std::sqrt(sv[C + c] / M - mv[c] * mv[c] + eps);
        }
        mean = make(mv, {C}, t);
        invstd = make(rv, {C}, t);
        ops::batchnorm_forward(xt, mean, invstd, make(gv, {C}, t), make(bv, {C}, t), y);
        return y.to_doubles();
      };
      Tensor mean, invstd;
      const std::string what = "batchnorm " + std::string(dtype_name(t)) + " " + shape_str(s);
      expect_close(forward(x, gamma, beta, mean, invstd), ref_batchnorm(x, gamma, beta, N, C, L, eps),
                   t == DType::f32 ? 1e-4 : 1e-10, what + " forward");
      if (t != DType::f64 || N * L == 1) continue;
      const Vec r = randn(shape_numel(s), 54);
      Tensor sums = Tensor::empty({2, C}, DType::f64), dx = Tensor::empty(s, t);
      const Tensor xt = make(x, s, t), rt = make(r, s, t);
      ops::batchnorm_backward_reduce(rt, xt, mean, invstd, sums);
      ops::batchnorm_backward(rt, xt, mean, invstd, make(gamma, {C}, t), sums, M, dx);
      auto loss = [&](const Vec& xv, const Vec& gv, const Vec& bv) { return dotv(ref_batchnorm(xv, gv, bv, N, C, L, eps), r); };
      expect_close(dx.to_doubles(), numeric_grad(x, [&](const Vec& v) { return loss(v, gamma, beta); }), kFdTol, what + " dx");
      const Vec sv = sums.to_doubles();  // dbeta = sums[0], dgamma = sums[1]
      expect_close(Vec(sv.begin(), sv.begin() + C), numeric_grad(beta, [&](const Vec& v) { return loss(x, gamma, v); }),
                   kFdTol, what + " dbeta");
      expect_close(Vec(sv.begin() + C, sv.end()), numeric_grad(gamma, [&](const Vec& v) { return loss(x, v, beta); }),
                   kFdTol, what + " dgamma");
    }
}

TEST(OpsNN, ConvolutionalUsageErrors) {
  const ops::Window g{3, 3, 1, 1, 1, 1};
  Tensor x = Tensor::zeros({2, 3, 5, 5}, DType::f32), w = Tensor::zeros({4, 3, 3, 3}, DType::f32);
  Tensor y = Tensor::empty({2, 4, 5, 5}, DType::f32), cols = Tensor::empty({27, 25}, DType::f32);
  EXPECT_NO_THROW(ops::conv2d_forward(x, w, g, cols, y));
  Tensor w2 = Tensor::zeros({4, 2, 3, 3}, DType::f32);  // channels differ
  EXPECT_THROW(ops::conv2d_forward(x, w2, g, cols, y), UsageError);
  Tensor ybad = Tensor::empty({2, 4, 3, 3}, DType::f32);
  EXPECT_THROW(ops::conv2d_forward(x, w, g, cols, ybad), UsageError);
  Tensor cbad = Tensor::empty({27, 24}, DType::f32);
  EXPECT_THROW(ops::conv2d_forward(x, w, g, cbad, y), UsageError);
  EXPECT_THROW(ops::conv2d_forward(x, w, ops::Window{3, 3, 0, 1, 1, 1}, cols, y), UsageError);  // stride 0
  EXPECT_THROW(ops::conv2d_forward(x, w, ops::Window{3, 3, 1, 1, 3, 3}, cols, y), UsageError);  // pad >= kernel
  Tensor tiny = Tensor::zeros({1, 1, 2, 2}, DType::f32), tout = Tensor::empty({1, 1, 1, 1}, DType::f32);
  Tensor targ = Tensor::empty({1, 1, 1, 1}, DType::i32);
  EXPECT_THROW(ops::maxpool2d_forward(tiny, ops::Window{5, 5, 1, 1, 1, 1}, tout, targ), UsageError);  // does not fit
  Tensor a64 = Tensor::empty({1, 1, 1, 1}, DType::i64);
  EXPECT_THROW(ops::maxpool2d_forward(tiny, ops::Window{2, 2, 2, 2, 0, 0}, tout, a64), UsageError);
  Tensor sums = Tensor::empty({2, 3}, DType::f64), s32 = Tensor::empty({2, 3}, DType::f32);
  EXPECT_NO_THROW(ops::batchnorm_reduce(x, sums));
  EXPECT_THROW(ops::batchnorm_reduce(x, s32), UsageError);
  Tensor c3 = Tensor::zeros({3}, DType::f32), c4 = Tensor::zeros({4}, DType::f32);
  EXPECT_THROW(ops::batchnorm_forward(x, c3, c3, c4, c3, x), UsageError);
  EXPECT_THROW(ops::batchnorm_backward(x, x, c3, c3, c3, sums, 0.0, x), UsageError);
}

}  // namespace
}  // namespace dtk
