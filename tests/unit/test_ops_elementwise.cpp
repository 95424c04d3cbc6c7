// Elementwise ops and fused optimizer steps (CPU) against plain f64 references written here, on
// random inputs of awkward sizes, in f32 and f64; usage errors.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "dtk/core/error.h"
#include "dtk/core/philox.h"
#include "dtk/core/tensor.h"
#include "dtk/ops/ops.h"
#include "../common/test_util.h"

namespace dtk {
namespace {

using test_util::expect_close;
using test_util::randn;
using test_util::rounded;
using test_util::Vec;

// Sizes that are multiples of nothing, and one past the threshold where the loops go parallel.
const int64_t kSizes[] = {1, 7, 1000, 1003, 40009};
const DType kFloats[] = {DType::f32, DType::f64};

// f32: a few roundings of values of order 1; f64: the same in double precision.
double tol_of(DType t) { return test_util::tol_of(t, 1e-5); }

Tensor make(const Vec& v, DType t) { return Tensor::from_doubles(v, {static_cast<int64_t>(v.size())}, t); }

std::string label(const char* op, DType t, int64_t n) {
  return std::string(op) + " " + std::string(dtype_name(t)) + " n=" + std::to_string(n);
}

using Unary = std::function<void(const Tensor&, Tensor&)>;
using Binary = std::function<void(const Tensor&, const Tensor&, Tensor&)>;

// Checks a unary op against ref on inputs made by `input` from standard normals.
void check_unary(const char* name, const Unary& op, const std::function<double(double)>& ref,
                 const std::function<double(double)>& input = [](double x) { return x; }) {
  for (DType t : kFloats)
    for (int64_t n : kSizes) {
      Vec x = randn(n, 11 + n);
      for (double& v : x) v = input(v);
      x = rounded(x, t);
      const Tensor a = make(x, t);
      Tensor out = Tensor::empty({n}, t);
      op(a, out);
      Vec want(x.size());
      for (size_t i = 0; i < x.size(); ++i) want[i] = ref(x[i]);
      expect_close(out.to_doubles(), want, tol_of(t), label(name, t, n));
    }
}

void check_binary(const char* name, const Binary& op, const std::function<double(double, double)>& ref,
                  const std::function<double(double)>& input_b = [](double x) { return x; }) {
  for (DType t : kFloats)
    for (int64_t n : kSizes) {
      const Vec x = rounded(randn(n, 21 + n), t);
      Vec y = randn(n, 31 + n);
      for (double& v : y) v = input_b(v);
      y = rounded(y, t);
      const Tensor a = make(x, t), b = make(y, t);
      Tensor out = Tensor::empty({n}, t);
      op(a, b, out);
      Vec want(x.size());
      for (size_t i = 0; i < x.size(); ++i) want[i] = ref(x[i], y[i]);
      expect_close(out.to_doubles(), want, tol_of(t), label(name, t, n));
      // in place: out is a
      Tensor a2 = a.clone();
      op(a2, b, a2);
      expect_close(a2.to_doubles(), want, tol_of(t), label(name, t, n) + " in place");
    }
}

TEST(OpsElementwise, BinaryOps) {
  check_binary("add", [](const Tensor& a, const Tensor& b, Tensor& o) { ops::add(a, b, o); },
               [](double x, double y) { return x + y; });
  check_binary("sub", [](const Tensor& a, const Tensor& b, Tensor& o) { ops::sub(a, b, o); },
               [](double x, double y) { return x - y; });
  check_binary("mul", [](const Tensor& a, const Tensor& b, Tensor& o) { ops::mul(a, b, o); },
               [](double x, double y) { return x * y; });
  check_binary("div", [](const Tensor& a, const Tensor& b, Tensor& o) { ops::div(a, b, o); },
               [](double x, double y) { return x / y; },
               [](double y) { return y < 0 ? y - 0.5 : y + 0.5; });  // |b| >= 0.5
  check_binary("lerp", [](const Tensor& a, const Tensor& b, Tensor& o) { ops::lerp(a, b, 0.3, o); },
               [](double x, double y) { return x + 0.3 * (y - x); });
}

TEST(OpsElementwise, ScalarOps) {
  check_unary("add_scalar", [](const Tensor& a, Tensor& o) { ops::add_scalar(a, 1.25, o); },
              [](double x) { return x + 1.25; });
  check_unary("scale", [](const Tensor& a, Tensor& o) { ops::scale(a, -0.75, o); },
              [](double x) { return -0.75 * x; });
  check_unary("clamp", [](const Tensor& a, Tensor& o) { ops::clamp(a, -0.5, 0.25, o); },
              [](double x) { return std::fmin(std::fmax(x, -0.5), 0.25); });
}

TEST(OpsElementwise, UnaryMath) {
  auto positive = [](double x) { return std::fabs(x) + 0.1; };
  check_unary("sqrt", [](const Tensor& a, Tensor& o) { ops::sqrt(a, o); }, [](double x) { return std::sqrt(x); },
              positive);
  check_unary("rsqrt", [](const Tensor& a, Tensor& o) { ops::rsqrt(a, o); },
              [](double x) { return 1 / std::sqrt(x); }, positive);
  check_unary("pow 1.5", [](const Tensor& a, Tensor& o) { ops::pow(a, 1.5, o); },
              [](double x) { return std::pow(x, 1.5); }, positive);
  check_unary("pow -0.25", [](const Tensor& a, Tensor& o) { ops::pow(a, -0.25, o); },
              [](double x) { return std::pow(x, -0.25); }, positive);
  check_unary("pow 2", [](const Tensor& a, Tensor& o) { ops::pow(a, 2, o); }, [](double x) { return x * x; });
  check_unary("abs", [](const Tensor& a, Tensor& o) { ops::abs(a, o); }, [](double x) { return std::fabs(x); });
  // every fifth value exactly 0
  check_unary("sign", [](const Tensor& a, Tensor& o) { ops::sign(a, o); },
              [](double x) { return x > 0 ? 1.0 : (x < 0 ? -1.0 : 0.0); },
              [](double x) { return std::fabs(std::fmod(x * 1000, 5)) < 1 ? 0.0 : x; });
}

TEST(OpsElementwise, SignAndClampKeepNaN) {
  for (DType t : kFloats) {
    const Tensor a = make({NAN, 0.0, -0.0, 2.0, -3.0}, t);
    Tensor out = Tensor::empty({5}, t);
    ops::sign(a, out);
    const Vec s = out.to_doubles();
    EXPECT_TRUE(std::isnan(s[0]));
    EXPECT_EQ(s[1], 0.0);
    EXPECT_EQ(s[2], 0.0);
    EXPECT_EQ(s[3], 1.0);
    EXPECT_EQ(s[4], -1.0);
    ops::clamp(a, -1, 1, out);
    const Vec c = out.to_doubles();
    EXPECT_TRUE(std::isnan(c[0]));
    EXPECT_EQ(c[3], 1.0);
    EXPECT_EQ(c[4], -1.0);
  }
}

TEST(OpsElementwise, AxpyAndWhere) {
  for (DType t : kFloats)
    for (int64_t n : kSizes) {
      const Vec x = rounded(randn(n, 41 + n), t), y = rounded(randn(n, 51 + n), t);
      Tensor yt = make(y, t);
      ops::axpy(-1.5, make(x, t), yt);
      Vec want(x.size());
      for (size_t i = 0; i < x.size(); ++i) want[i] = y[i] - 1.5 * x[i];
      expect_close(yt.to_doubles(), want, tol_of(t), label("axpy", t, n));

      Vec c(x.size());
      for (int64_t i = 0; i < n; ++i) c[i] = philox::uniform(61, i) < 0.5 ? 1 : 0;
      const Tensor cond = Tensor::from_doubles(c, {n}, DType::u8);
      Tensor out = Tensor::empty({n}, t);
      ops::where(cond, make(x, t), make(y, t), out);
      for (size_t i = 0; i < x.size(); ++i) want[i] = c[i] ? x[i] : y[i];
      expect_close(out.to_doubles(), want, 0, label("where", t, n));
    }
}

TEST(OpsElementwise, ShapesOnlyNeedEqualNumel) {
  const Tensor a = Tensor::from_doubles(randn(12, 1), {3, 4}, DType::f64);
  const Tensor b = Tensor::from_doubles(randn(12, 2), {12}, DType::f64);
  Tensor out = Tensor::empty({2, 6}, DType::f64);
  ops::add(a, b, out);
  const Vec av = a.to_doubles(), bv = b.to_doubles();
  Vec want(12);
  for (int i = 0; i < 12; ++i) want[i] = av[i] + bv[i];
  expect_close(out.to_doubles(), want, 1e-15, "add [3,4] + [12]");
}

TEST(OpsElementwise, UsageErrors) {
  const Tensor a = Tensor::zeros({5}, DType::f32);
  Tensor out = Tensor::empty({5}, DType::f32);
  EXPECT_THROW(ops::add(a, Tensor::zeros({6}, DType::f32), out), UsageError);
  EXPECT_THROW(ops::add(a, Tensor::zeros({5}, DType::f64), out), UsageError);
  Tensor out64 = Tensor::empty({5}, DType::f64);
  EXPECT_THROW(ops::add(a, a, out64), UsageError);
  Tensor i32 = Tensor::zeros({5}, DType::i32);
  EXPECT_THROW(ops::sqrt(i32, i32), UsageError);
  EXPECT_THROW(ops::scale(Tensor(), 2, out), UsageError);
  EXPECT_THROW(ops::clamp(a, 1, -1, out), UsageError);
  Tensor y = Tensor::zeros({4}, DType::f32);
  EXPECT_THROW(ops::axpy(1, a, y), UsageError);
  EXPECT_THROW(ops::where(Tensor::zeros({5}, DType::f32), a, a, out), UsageError);
  EXPECT_THROW(ops::where(Tensor::zeros({4}, DType::u8), a, a, out), UsageError);
  try {
    ops::mul(a, Tensor::zeros({6}, DType::f32), out);
    FAIL() << "no UsageError";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("mul"), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------------------- optimizers

// SGD as PyTorch defines it, step by step in double.
void sgd_ref(Vec& p, const Vec& g, Vec& buf, double lr, double mom, double wd, bool nesterov, bool first) {
  for (size_t i = 0; i < p.size(); ++i) {
    double d = g[i] + wd * p[i];
    if (mom != 0) {
      buf[i] = first ? d : mom * buf[i] + d;
      d = nesterov ? d + mom * buf[i] : buf[i];
    }
    p[i] -= lr * d;
  }
}

TEST(OpsOptim, SgdMatchesFormulaOverSteps) {
  struct Case {
    double mom, wd;
    bool nesterov;
  };
  const Case cases[] = {{0, 0, false}, {0, 0.01, false}, {0.9, 0, false}, {0.9, 0.01, false},
                        {0.9, 0, true}, {0.9, 0.05, true}};
  for (DType t : kFloats)
    for (int64_t n : {int64_t{1}, int64_t{1003}, int64_t{40009}})
      for (const Case& c : cases) {
        Vec p = rounded(randn(n, 71), t), buf(static_cast<size_t>(n), 0.0);
        Tensor pt = make(p, t);
        // the buffer starts at zero, so buf = 0 * mom + g on the first step, as PyTorch's clone
        Tensor bt = c.mom != 0 ? Tensor::zeros({n}, t) : Tensor();
        for (int step = 0; step < 5; ++step) {
          const Vec g = rounded(randn(n, 100 + step), t);
          ops::sgd_step(pt, make(g, t), bt, 0.1, c.mom, c.wd, c.nesterov);
          sgd_ref(p, g, buf, 0.1, c.mom, c.wd, c.nesterov, step == 0);
        }
        expect_close(pt.to_doubles(), p, 10 * tol_of(t),
                     label("sgd", t, n) + " mom=" + std::to_string(c.mom) + " wd=" + std::to_string(c.wd) +
                         (c.nesterov ? " nesterov" : ""));
        if (c.mom != 0) expect_close(bt.to_doubles(), buf, 10 * tol_of(t), label("sgd buf", t, n));
      }
}

TEST(OpsOptim, AdamwMatchesFormulaOverSteps) {
  const double lr = 1e-2, b1 = 0.9, b2 = 0.999, eps = 1e-8;
  for (DType t : kFloats)
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{40009}})
      for (double wd : {0.0, 0.1}) {
        Vec p = rounded(randn(n, 81), t), m(static_cast<size_t>(n), 0.0), v(static_cast<size_t>(n), 0.0);
        Tensor pt = make(p, t), mt = Tensor::zeros({n}, t), vt = Tensor::zeros({n}, t);
        for (int64_t step = 1; step <= 6; ++step) {
          const Vec g = rounded(randn(n, 200 + step), t);
          ops::adamw_step(pt, make(g, t), mt, vt, lr, b1, b2, eps, wd, step);
          for (int64_t i = 0; i < n; ++i) {
            p[i] -= lr * wd * p[i];
            m[i] = b1 * m[i] + (1 - b1) * g[i];
            v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
            const double mhat = m[i] / (1 - std::pow(b1, step)), vhat = v[i] / (1 - std::pow(b2, step));
            p[i] -= lr * mhat / (std::sqrt(vhat) + eps);
          }
        }
        const std::string what = label("adamw", t, n) + " wd=" + std::to_string(wd);
        expect_close(pt.to_doubles(), p, 10 * tol_of(t), what);
        expect_close(mt.to_doubles(), m, 10 * tol_of(t), what + " m");
        expect_close(vt.to_doubles(), v, 10 * tol_of(t), what + " v");
      }
}

TEST(OpsOptim, UsageErrors) {
  Tensor p = Tensor::zeros({4}, DType::f32), g = Tensor::zeros({4}, DType::f32);
  Tensor none;
  EXPECT_THROW(ops::sgd_step(p, g, none, 0.1, 0.9, 0, false), UsageError);  // momentum without a buffer
  Tensor small = Tensor::zeros({3}, DType::f32);
  EXPECT_THROW(ops::sgd_step(p, small, none, 0.1, 0, 0, false), UsageError);
  Tensor g64 = Tensor::zeros({4}, DType::f64);
  EXPECT_THROW(ops::sgd_step(p, g64, none, 0.1, 0, 0, false), UsageError);
  Tensor m = Tensor::zeros({4}, DType::f32), v = Tensor::zeros({4}, DType::f32);
  EXPECT_THROW(ops::adamw_step(p, g, m, v, 1e-3, 0.9, 0.999, 1e-8, 0, 0), UsageError);  // step from 1
  EXPECT_THROW(ops::adamw_step(p, g, small, v, 1e-3, 0.9, 0.999, 1e-8, 0, 1), UsageError);
  EXPECT_NO_THROW(ops::sgd_step(p, g, none, 0.1, 0, 0, false));
}

}  // namespace
}  // namespace dtk
