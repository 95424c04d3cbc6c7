// CPU linear algebra (ops.h) against plain f64 references written here: a triple-loop gemm and
// a cyclic Jacobi eigensolver, plus the invariants each operation promises (orthonormal
// columns, preserved span, A V = V diag(w), X^p A = I).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <thread>
#include <vector>

#include "dtk/core/error.h"
#include "dtk/core/half.h"
#include "dtk/core/tensor.h"
#include "dtk/ops/kernels.h"
#include "dtk/ops/ops.h"
#include "../common/test_util.h"

namespace dtk {
namespace {

using Mat = std::vector<double>;  // row-major
using test_util::random_values;
using test_util::rounded;

// C[m, n] = op(A) op(B), A stored [m, k] or [k, m], B [k, n] or [n, k].
Mat ref_matmul(bool ta, bool tb, const double* a, const double* b, int64_t m, int64_t n, int64_t k) {
  Mat c(size_t(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t l = 0; l < k; ++l) s += (ta ? a[l * m + i] : a[i * k + l]) * (tb ? b[j * k + l] : b[l * n + j]);
      c[size_t(i * n + j)] = s;
    }
  return c;
}

Mat matmul(const Mat& a, const Mat& b, int64_t m, int64_t k, int64_t n, bool ta = false, bool tb = false) {
  return ref_matmul(ta, tb, a.data(), b.data(), m, n, k);
}

double max_abs(const Mat& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

double max_diff(const Mat& x, const Mat& y) {
  EXPECT_EQ(x.size(), y.size());
  double e = 0;
  for (size_t i = 0; i < x.size() && i < y.size(); ++i) e = std::max(e, std::fabs(x[i] - y[i]));
  return e;
}

// max |x - y| / max(1, max |y|)
double rel_err(const Mat& x, const Mat& y) {
  EXPECT_EQ(x.size(), y.size());
  double e = 0;
  for (size_t i = 0; i < x.size() && i < y.size(); ++i) e = std::max(e, std::fabs(x[i] - y[i]));
  return e / std::max(1.0, max_abs(y));
}

double tol_for(DType t) { return test_util::tol_of(t, 2e-5, 1e-11); }

Mat identity(int64_t n) {
  Mat i(size_t(n * n), 0.0);
  for (int64_t k = 0; k < n; ++k) i[size_t(k * n + k)] = 1;
  return i;
}

// Cyclic Jacobi eigensolver for a symmetric matrix: eigenvalues ascending, eigenvectors as
// columns. Slow and simple, accurate to f64 rounding.
void ref_eigh(const Mat& a_in, int64_t n, Mat& w, Mat& v) {
  Mat a = a_in;
  v = identity(n);
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j)
        if (i != j) off += a[i * n + j] * a[i * n + j];
    if (off < 1e-30 * std::max(1.0, max_abs(a) * max_abs(a))) break;
    for (int64_t p = 0; p < n; ++p)
      for (int64_t q = p + 1; q < n; ++q) {
        const double apq = a[p * n + q];
        if (apq == 0) continue;
        const double theta = (a[q * n + q] - a[p * n + p]) / (2 * apq);
        const double t = (theta >= 0 ? 1 : -1) / (std::fabs(theta) + std::sqrt(theta * theta + 1));
        const double c = 1 / std::sqrt(t * t + 1), s = t * c;
        for (int64_t k = 0; k < n; ++k) {  // A <- A J (columns p, q)
          const double akp = a[k * n + p], akq = a[k * n + q];
          a[k * n + p] = c * akp - s * akq;
          a[k * n + q] = s * akp + c * akq;
        }
        for (int64_t k = 0; k < n; ++k) {  // A <- J^T A (rows p, q)
          const double apk = a[p * n + k], aqk = a[q * n + k];
          a[p * n + k] = c * apk - s * aqk;
          a[q * n + k] = s * apk + c * aqk;
        }
        for (int64_t k = 0; k < n; ++k) {  // V <- V J
          const double vkp = v[k * n + p], vkq = v[k * n + q];
          v[k * n + p] = c * vkp - s * vkq;
          v[k * n + q] = s * vkp + c * vkq;
        }
      }
  }
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) order[size_t(i)] = i;
  std::sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return a[x * n + x] < a[y * n + y]; });
  w.assign(size_t(n), 0);
  Mat vs(size_t(n * n));
  for (int64_t j = 0; j < n; ++j) {
    w[size_t(j)] = a[order[j] * n + order[j]];
    for (int64_t i = 0; i < n; ++i) vs[size_t(i * n + j)] = v[i * n + order[j]];
  }
  v = vs;
}

// (A + eps I)^(-1/p) from the Jacobi reference; with `shift`, ops.h's eigenvalue rule of the
// eigh method (the newton method computes (A + eps I)^(-1/p) as it is).
Mat ref_inverse_root(const Mat& a, int64_t n, double p, double eps, bool shift = true) {
  Mat s = a;
  for (int64_t i = 0; i < n; ++i) s[i * n + i] += eps;
  Mat w, v;
  ref_eigh(s, n, w, v);
  const double up = shift && w[0] < eps ? eps - w[0] : 0;
  Mat vd = v;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) vd[i * n + j] *= std::pow(w[j] + up, -1 / p);
  return matmul(vd, v, n, n, n, false, true);
}

// A well-conditioned SPD matrix: B B^T / n + I, eigenvalues in about [1, 5].
Mat random_spd(int64_t n, uint64_t seed) {
  const Mat b = random_values(size_t(n * n), seed);
  Mat a = matmul(b, b, n, n, n, false, true);
  for (double& x : a) x /= double(n);
  for (int64_t i = 0; i < n; ++i) a[i * n + i] += 1;
  return a;
}

Mat mat_power(const Mat& x, int64_t n, int p) {
  Mat r = identity(n);
  for (int k = 0; k < p; ++k) r = matmul(r, x, n, n, n);
  return r;
}

const DType kFloatTypes[] = {DType::f32, DType::f64};

// ------------------------------------------------------------------------------------ gemm

TEST(LinalgGemm, MatchesReferenceAllTransposes) {
  struct Size {
    int64_t m, n, k;
  };
  const Size sizes[] = {{1, 1, 1}, {7, 33, 1}, {33, 7, 100}, {100, 33, 7}, {1, 100, 7}, {33, 100, 33}};
  uint64_t seed = 1;
  for (DType t : kFloatTypes)
    for (const Size& s : sizes)
      for (int ta = 0; ta < 2; ++ta)
        for (int tb = 0; tb < 2; ++tb) {
          const Mat av = rounded(random_values(size_t(s.m * s.k), seed++), t);
          const Mat bv = rounded(random_values(size_t(s.k * s.n), seed++), t);
          const Mat cv = rounded(random_values(size_t(s.m * s.n), seed++), t);
          const Shape as = ta ? Shape{s.k, s.m} : Shape{s.m, s.k};
          const Shape bs = tb ? Shape{s.n, s.k} : Shape{s.k, s.n};
          Tensor a = Tensor::from_doubles(av, as, t), b = Tensor::from_doubles(bv, bs, t);
          Tensor c = Tensor::from_doubles(cv, {s.m, s.n}, t);
          const double alpha = 1.5, beta = -0.5;
          ops::gemm(ta, tb, alpha, a, b, beta, c);
          Mat want = ref_matmul(ta, tb, av.data(), bv.data(), s.m, s.n, s.k);
          for (size_t i = 0; i < want.size(); ++i) want[i] = alpha * want[i] + beta * cv[i];
          EXPECT_LT(rel_err(c.to_doubles(), want), tol_for(t) * std::sqrt(double(s.k)))
              << dtype_name(t) << " m=" << s.m << " n=" << s.n << " k=" << s.k << " ta=" << ta << " tb=" << tb;
        }
}

TEST(LinalgGemm, BetaZeroIgnoresNaNInC) {
  const Mat av = random_values(7 * 5, 11), bv = random_values(5 * 3, 12);
  for (DType t : kFloatTypes) {
    Tensor a = Tensor::from_doubles(av, {7, 5}, t), b = Tensor::from_doubles(bv, {5, 3}, t);
    Tensor c = Tensor::from_doubles(Mat(21, std::numeric_limits<double>::quiet_NaN()), {7, 3}, t);
    ops::gemm(false, false, 1.0, a, b, 0.0, c);
    EXPECT_LT(rel_err(c.to_doubles(), matmul(rounded(av, t), rounded(bv, t), 7, 5, 3)), tol_for(t) * 3);
  }
}

TEST(LinalgGemm, EmptyInnerDimensionScalesC) {
  for (DType t : kFloatTypes) {
    Tensor a = Tensor::empty({4, 0}, t), b = Tensor::empty({0, 3}, t);
    Tensor c = Tensor::from_doubles(Mat(12, 2.0), {4, 3}, t);
    ops::gemm(false, false, 1.0, a, b, 0.5, c);
    for (double x : c.to_doubles()) EXPECT_EQ(x, 1.0);
    Tensor d = Tensor::from_doubles(Mat(12, std::numeric_limits<double>::quiet_NaN()), {4, 3}, t);
    ops::gemm(false, false, 1.0, a, b, 0.0, d);
    for (double x : d.to_doubles()) EXPECT_EQ(x, 0.0);
    Tensor e = Tensor::empty({0, 3}, t);  // m = 0: nothing to do
    ops::gemm(false, false, 1.0, Tensor::empty({0, 2}, t), Tensor::empty({2, 3}, t), 0.0, e);
  }
}

TEST(LinalgGemm, BatchedMatchesPerMatrix) {
  const int64_t B = 3, m = 7, n = 33, k = 5;
  uint64_t seed = 100;
  for (DType t : kFloatTypes)
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb) {
        const Mat av = rounded(random_values(size_t(B * m * k), seed++), t);
        const Mat bv = rounded(random_values(size_t(B * k * n), seed++), t);
        const Mat cv = rounded(random_values(size_t(B * m * n), seed++), t);
        Tensor a = Tensor::from_doubles(av, ta ? Shape{B, k, m} : Shape{B, m, k}, t);
        Tensor b = Tensor::from_doubles(bv, tb ? Shape{B, n, k} : Shape{B, k, n}, t);
        Tensor c = Tensor::from_doubles(cv, {B, m, n}, t);
        ops::gemm(ta, tb, 2.0, a, b, 1.0, c);
        const Mat got = c.to_doubles();
        for (int64_t bi = 0; bi < B; ++bi) {
          Mat want = ref_matmul(ta, tb, av.data() + bi * m * k, bv.data() + bi * k * n, m, n, k);
          Mat g(got.begin() + bi * m * n, got.begin() + (bi + 1) * m * n);
          for (int64_t i = 0; i < m * n; ++i) want[size_t(i)] = 2 * want[size_t(i)] + cv[size_t(bi * m * n + i)];
          EXPECT_LT(rel_err(g, want), tol_for(t) * 3) << dtype_name(t) << " batch " << bi << " ta=" << ta << " tb=" << tb;
        }
      }
}

// TF32 rounding: 10 explicit mantissa bits, to nearest with ties away from zero; NaN, infinity
// kept; past TF32's largest finite, infinity.
TEST(LinalgGemm, RoundTf32) {
  const float ulp = std::ldexp(1.0f, -10);  // TF32's spacing in [1, 2)
  EXPECT_EQ(round_tf32(1.0f), 1.0f);
  EXPECT_EQ(round_tf32(1.0f + ulp), 1.0f + ulp);
  EXPECT_EQ(round_tf32(1.0f + ulp / 2), 1.0f + ulp);      // a tie: away from zero
  EXPECT_EQ(round_tf32(-(1.0f + ulp / 2)), -(1.0f + ulp));
  EXPECT_EQ(round_tf32(1.0f + ulp / 2 - std::ldexp(1.0f, -23)), 1.0f);  // just below the tie
  EXPECT_EQ(round_tf32(1.0f + 3 * ulp / 4), 1.0f + ulp);
  EXPECT_EQ(float_bits(round_tf32(bits_float(0x00001000u))), 0x00002000u);  // subnormals: a tie, away
  EXPECT_EQ(float_bits(round_tf32(bits_float(0x00000fffu))), 0x00000000u);
  EXPECT_TRUE(std::isnan(round_tf32(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_EQ(round_tf32(std::numeric_limits<float>::infinity()), std::numeric_limits<float>::infinity());
  EXPECT_EQ(round_tf32(std::numeric_limits<float>::max()), std::numeric_limits<float>::infinity());
}

// Math::tf32 on f32: exactly the f32 product of the operands rounded to TF32 (the CPU's
// definition, bit for bit), within TF32's bound of the exact product and not equal to it; f64
// ignores it.
TEST(LinalgGemm, Tf32IsTheProductOfRoundedOperands) {
  uint64_t seed = 300;
  for (int batched = 0; batched < 2; ++batched)
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb) {
        const int64_t B = batched ? 3 : 1, m = 19, n = 37, k = 65;
        const Mat av = random_values(size_t(B * m * k), seed++), bv = random_values(size_t(B * k * n), seed++);
        const Mat cv = random_values(size_t(B * m * n), seed++);
        Shape as = ta ? Shape{k, m} : Shape{m, k}, bs = tb ? Shape{n, k} : Shape{k, n}, cs = {m, n};
        if (batched) {
          as.insert(as.begin(), B);
          bs.insert(bs.begin(), B);
          cs.insert(cs.begin(), B);
        }
        const auto tf32 = [](const Mat& v) {
          Mat r(v.size());
          for (size_t i = 0; i < v.size(); ++i) r[i] = round_tf32(static_cast<float>(v[i]));
          return r;
        };
        Tensor a = Tensor::from_doubles(av, as, DType::f32), b = Tensor::from_doubles(bv, bs, DType::f32);
        Tensor ar = Tensor::from_doubles(tf32(av), as, DType::f32), br = Tensor::from_doubles(tf32(bv), bs, DType::f32);
        Tensor c = Tensor::from_doubles(cv, cs, DType::f32), want = c.clone(), exact = c.clone();
        ops::gemm(ta, tb, 1.5, a, b, -0.5, c, ops::Math::tf32);
        ops::gemm(ta, tb, 1.5, ar, br, -0.5, want);
        ops::gemm(ta, tb, 1.5, a, b, -0.5, exact);
        const std::string what = "batched=" + std::to_string(batched) + " ta=" + std::to_string(ta) +
                                 " tb=" + std::to_string(tb);
        EXPECT_EQ(c.to_doubles(), want.to_doubles()) << what;
        // Each product's error is below 2 * 2^-11 of |a||b| (two roundings); sums of k terms of
        // unit-scale values: the difference from the exact product stays near 2^-10 sqrt(k).
        const double err = rel_err(c.to_doubles(), exact.to_doubles());
        EXPECT_GT(err, 0) << what;
        EXPECT_LT(err, std::ldexp(1.0, -10) * std::sqrt(double(k))) << what;
        Tensor a64 = Tensor::from_doubles(av, as, DType::f64), b64 = Tensor::from_doubles(bv, bs, DType::f64);
        Tensor c64 = Tensor::from_doubles(cv, cs, DType::f64), e64 = c64.clone();
        ops::gemm(ta, tb, 1.5, a64, b64, -0.5, c64, ops::Math::tf32);
        ops::gemm(ta, tb, 1.5, a64, b64, -0.5, e64);
        EXPECT_EQ(c64.to_doubles(), e64.to_doubles()) << what << " f64";
      }
}

// bf16 operands with f32 accumulation (ops.h), against an f64 product of the same bf16 values:
// an f32 C within f32 summation error of it; a bf16 C exactly that f32 result rounded once (RNE)
// on the CPU, and so within half a bf16 ulp of it. Math::bf16 on f32 operands is exactly the f32
// product of the operands rounded to bf16; f64 ignores it.
TEST(LinalgGemm, Bf16OperandsAccumulateInF32) {
  uint64_t seed = 400;
  for (int batched = 0; batched < 2; ++batched)
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb) {
        const int64_t B = batched ? 2 : 1, m = 13, n = 29, k = 70;
        const Mat av = rounded(random_values(size_t(B * m * k), seed++), DType::bf16);
        const Mat bv = rounded(random_values(size_t(B * k * n), seed++), DType::bf16);
        const Mat cv = rounded(random_values(size_t(B * m * n), seed++), DType::bf16);
        Shape as = ta ? Shape{k, m} : Shape{m, k}, bs = tb ? Shape{n, k} : Shape{k, n}, cs = {m, n};
        if (batched) {
          as.insert(as.begin(), B);
          bs.insert(bs.begin(), B);
          cs.insert(cs.begin(), B);
        }
        const std::string what = "batched=" + std::to_string(batched) + " ta=" + std::to_string(ta) +
                                 " tb=" + std::to_string(tb);
        Mat want(cv.size());
        for (int64_t i = 0; i < B; ++i) {
          const Mat p = ref_matmul(ta, tb, av.data() + i * m * k, bv.data() + i * k * n, m, n, k);
          for (int64_t e = 0; e < m * n; ++e) want[size_t(i * m * n + e)] = 1.5 * p[size_t(e)] - 0.5 * cv[size_t(i * m * n + e)];
        }
        Tensor a = Tensor::from_doubles(av, as, DType::bf16), b = Tensor::from_doubles(bv, bs, DType::bf16);
        Tensor c32 = Tensor::from_doubles(cv, cs, DType::f32), c16 = Tensor::from_doubles(cv, cs, DType::bf16);
        ops::gemm(ta, tb, 1.5, a, b, -0.5, c32);
        ops::gemm(ta, tb, 1.5, a, b, -0.5, c16);
        const Mat g32 = c32.to_doubles(), g16 = c16.to_doubles();
        EXPECT_LT(rel_err(g32, want), 1e-6) << what;
        EXPECT_EQ(g16, rounded(g32, DType::bf16)) << what;
        for (size_t e = 0; e < want.size(); ++e)
          ASSERT_LE(std::fabs(g16[e] - g32[e]), std::ldexp(std::fabs(g32[e]), -8)) << what << " element " << e;
        // Math::bf16: f32 operands rounded to bf16, then exact products.
        const Mat af = random_values(av.size(), seed++), bf = random_values(bv.size(), seed++);
        Tensor a32 = Tensor::from_doubles(af, as, DType::f32), b32 = Tensor::from_doubles(bf, bs, DType::f32);
        Tensor ar = Tensor::from_doubles(rounded(af, DType::bf16), as, DType::f32);
        Tensor br = Tensor::from_doubles(rounded(bf, DType::bf16), bs, DType::f32);
        Tensor c = Tensor::from_doubles(cv, cs, DType::f32), ref = c.clone(), exact = c.clone();
        ops::gemm(ta, tb, 1.5, a32, b32, -0.5, c, ops::Math::bf16);
        ops::gemm(ta, tb, 1.5, ar, br, -0.5, ref);
        ops::gemm(ta, tb, 1.5, a32, b32, -0.5, exact);
        EXPECT_EQ(c.to_doubles(), ref.to_doubles()) << what;
        EXPECT_GT(rel_err(c.to_doubles(), exact.to_doubles()), 0) << what;
        EXPECT_LT(rel_err(c.to_doubles(), exact.to_doubles()), std::ldexp(1.0, -7) * std::sqrt(double(k))) << what;
        Tensor a64 = Tensor::from_doubles(af, as, DType::f64), b64 = Tensor::from_doubles(bf, bs, DType::f64);
        Tensor c64 = Tensor::from_doubles(cv, cs, DType::f64), e64 = c64.clone();
        ops::gemm(ta, tb, 1.5, a64, b64, -0.5, c64, ops::Math::bf16);
        ops::gemm(ta, tb, 1.5, a64, b64, -0.5, e64);
        EXPECT_EQ(c64.to_doubles(), e64.to_doubles()) << what << " f64";
      }
}

// syrk against A A^T (A^T A) in f64, from a symmetric C, batched, k = 0; exactly symmetric
// (its upper triangle mirrors the lower); usage errors.
TEST(LinalgSyrk, MatchesGemmAndIsSymmetric) {
  const int64_t B = 3;
  uint64_t seed = 300;
  for (DType t : kFloatTypes)
    for (int64_t n : {1, 7, 70, 130})
      for (int64_t k : {0, 1, 5, 64})
        for (int tr = 0; tr < 2; ++tr) {
          const Mat av = rounded(random_values(size_t(B * n * k), seed++), t);
          Mat cv(size_t(B * n * n));
          const Mat r = random_values(cv.size(), seed++);
          for (int64_t bi = 0; bi < B; ++bi)
            for (int64_t i = 0; i < n; ++i)
              for (int64_t j = 0; j < n; ++j)
                cv[size_t((bi * n + i) * n + j)] = r[size_t((bi * n + std::min(i, j)) * n + std::max(i, j))];
          cv = rounded(cv, t);
          Tensor a = Tensor::from_doubles(av, tr ? Shape{B, k, n} : Shape{B, n, k}, t);
          Tensor c = Tensor::from_doubles(cv, {B, n, n}, t);
          ops::syrk(tr, 0.5, a, 0.25, c);
          const Mat got = c.to_doubles();
          for (int64_t bi = 0; bi < B; ++bi) {
            Mat want = k == 0 ? Mat(size_t(n * n), 0.0) : ref_matmul(tr, !tr, av.data() + bi * n * k, av.data() + bi * n * k, n, n, k);
            Mat g(got.begin() + bi * n * n, got.begin() + (bi + 1) * n * n);
            for (int64_t i = 0; i < n * n; ++i) want[size_t(i)] = 0.5 * want[size_t(i)] + 0.25 * cv[size_t(bi * n * n + i)];
            EXPECT_LT(rel_err(g, want), tol_for(t) * 10) << dtype_name(t) << " n=" << n << " k=" << k << " trans=" << tr;
            for (int64_t i = 0; i < n; ++i)
              for (int64_t j = 0; j < i; ++j) ASSERT_EQ(g[size_t(i * n + j)], g[size_t(j * n + i)]) << "n=" << n;
          }
        }
  Tensor a = Tensor::zeros({4, 3}, DType::f32), c = Tensor::zeros({3, 3}, DType::f32), c4 = Tensor::zeros({4, 4}, DType::f32);
  EXPECT_THROW(ops::syrk(false, 1.0, a, 0.0, c), UsageError);  // a a^T is [4, 4]
  ops::syrk(true, 1.0, a, 0.0, c);
  ops::syrk(false, 1.0, a, 0.0, c4);
  Tensor r = Tensor::zeros({4, 5}, DType::f32);
  EXPECT_THROW(ops::syrk(false, 1.0, a, 0.0, r), UsageError);  // not square
  Tensor a64 = Tensor::zeros({4, 3}, DType::f64);
  EXPECT_THROW(ops::syrk(false, 1.0, a64, 0.0, c4), UsageError);  // dtypes differ
}

// symmetrize: the upper triangle takes the lower's values, the lower and diagonal unchanged;
// 2-D and batched; usage errors.
TEST(LinalgSymmetrize, CopiesLowerIntoUpper) {
  for (DType t : kFloatTypes)
    for (int64_t n : {1, 5, 70, 131}) {
      const int64_t B = 2;
      const Mat v = rounded(random_values(size_t(B * n * n), 900 + uint64_t(n)), t);
      Tensor m = Tensor::from_doubles(v, {B, n, n}, t);
      ops::symmetrize(m);
      const Mat got = m.to_doubles();
      for (int64_t bi = 0; bi < B; ++bi)
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < n; ++j)
            ASSERT_EQ(got[size_t((bi * n + i) * n + j)], v[size_t((bi * n + std::max(i, j)) * n + std::min(i, j))])
                << dtype_name(t) << " n=" << n << " (" << i << ", " << j << ")";
      Tensor one = Tensor::from_doubles(Mat(v.begin(), v.begin() + n * n), {n, n}, t);
      ops::symmetrize(one);
      EXPECT_EQ(one.to_doubles(), Mat(got.begin(), got.begin() + n * n));
    }
  Tensor r = Tensor::zeros({4, 5}, DType::f32), v = Tensor::zeros({4}, DType::f32), i = Tensor::zeros({3, 3}, DType::i64);
  EXPECT_THROW(ops::symmetrize(r), UsageError);
  EXPECT_THROW(ops::symmetrize(v), UsageError);
  EXPECT_THROW(ops::symmetrize(i), UsageError);
}

TEST(LinalgGemm, UsageErrors) {
  Tensor a = Tensor::zeros({4, 3}, DType::f32), b = Tensor::zeros({3, 5}, DType::f32);
  Tensor c = Tensor::zeros({4, 5}, DType::f32);
  EXPECT_NO_THROW(ops::gemm(false, false, 1, a, b, 0, c));
  EXPECT_THROW(ops::gemm(true, false, 1, a, b, 0, c), UsageError);   // inner dims 4 vs 3
  EXPECT_THROW(ops::gemm(false, true, 1, a, b, 0, c), UsageError);   // inner dims 3 vs 5
  Tensor c_wrong = Tensor::zeros({5, 4}, DType::f32);
  EXPECT_THROW(ops::gemm(false, false, 1, a, b, 0, c_wrong), UsageError);
  Tensor b64 = Tensor::zeros({3, 5}, DType::f64);
  EXPECT_THROW(ops::gemm(false, false, 1, a, b64, 0, c), UsageError);  // mixed dtypes
  Tensor abf = Tensor::zeros({4, 3}, DType::bf16), bbf = Tensor::zeros({3, 5}, DType::bf16);
  EXPECT_NO_THROW(ops::gemm(false, false, 1, abf, bbf, 0, c));             // bf16 operands, f32 c
  Tensor c64 = Tensor::zeros({4, 5}, DType::f64);
  EXPECT_THROW(ops::gemm(false, false, 1, abf, bbf, 0, c64), UsageError);  // ... but not an f64 c
  EXPECT_THROW(ops::gemm(false, false, 1, abf, b, 0, c), UsageError);      // one bf16 operand
  Tensor ai = Tensor::zeros({4, 3}, DType::i32), bi = Tensor::zeros({3, 5}, DType::i32);
  Tensor ci = Tensor::zeros({4, 5}, DType::i32);
  EXPECT_THROW(ops::gemm(false, false, 1, ai, bi, 0, ci), UsageError);
  Tensor a3 = Tensor::zeros({2, 4, 3}, DType::f32), b3 = Tensor::zeros({2, 3, 5}, DType::f32);
  Tensor c3 = Tensor::zeros({2, 4, 5}, DType::f32), c3b = Tensor::zeros({3, 4, 5}, DType::f32);
  EXPECT_NO_THROW(ops::gemm(false, false, 1, a3, b3, 0, c3));
  EXPECT_THROW(ops::gemm(false, false, 1, a3, b, 0, c3), UsageError);   // 3-D with 2-D
  EXPECT_THROW(ops::gemm(false, false, 1, a3, b3, 0, c3b), UsageError);  // batch sizes differ
  EXPECT_THROW(ops::gemm(false, false, 1, Tensor::zeros({12}, DType::f32), b, 0, c), UsageError);
  EXPECT_THROW(ops::gemm(false, false, 1, Tensor(), b, 0, c), UsageError);
  Tensor sq = Tensor::zeros({4, 4}, DType::f32);
  EXPECT_THROW(ops::gemm(false, false, 1, sq, sq, 0, sq), UsageError);  // c aliases a and b
  EXPECT_THROW(ops::gemm(false, false, std::nan(""), a, b, 0, c), UsageError);
}

// ------------------------------------------------------------------------- orthonormalisation

// Columns of q [m, r] are each zero or unit, mutually orthogonal, and Q Q^T A = A.
void expect_orthonormal_span(const Mat& q, const Mat& a, int64_t m, int64_t r, double tol, const std::string& what) {
  const Mat g = matmul(q, q, r, m, r, true, false);  // Q^T Q
  for (int64_t i = 0; i < r; ++i) {
    const double d = g[size_t(i * r + i)];
    EXPECT_TRUE(d == 0 || std::fabs(d - 1) < tol) << what << ": column " << i << " has squared norm " << d;
    for (int64_t j = 0; j < r; ++j)
      if (i != j) {
        EXPECT_LT(std::fabs(g[size_t(i * r + j)]), tol) << what << ": columns " << i << ", " << j;
      }
  }
  for (double x : q) EXPECT_TRUE(std::isfinite(x)) << what;
  const Mat qta = matmul(q, a, r, m, r, true, false);  // Q^T A [r, r]
  const Mat proj = matmul(q, qta, m, r, r);            // Q Q^T A [m, r]
  EXPECT_LT(rel_err(proj, a), tol * 10) << what << ": span not preserved";
}

TEST(LinalgOrthonormalize, MgsAndQrGiveOrthonormalColumnsWithTheSameSpan) {
  struct Size {
    int64_t m, r;
  };
  const Size sizes[] = {{1, 1}, {7, 1}, {7, 7}, {33, 7}, {100, 33}, {100, 100}};
  uint64_t seed = 200;
  for (DType t : kFloatTypes)
    for (const Size& s : sizes)
      for (int method = 0; method < 2; ++method) {
        const Mat av = rounded(random_values(size_t(s.m * s.r), seed++), t);
        Tensor a = Tensor::from_doubles(av, {s.m, s.r}, t);
        if (method == 0)
          ops::orthonormalize_mgs(a);
        else
          ops::orthonormalize_qr(a);
        const std::string what = std::string(method ? "qr " : "mgs ") + std::string(dtype_name(t)) + " [" +
                                 std::to_string(s.m) + ", " + std::to_string(s.r) + "]";
        // square 100 x 100 random matrices have condition numbers of a few hundred
        const double tol = t == DType::f64 ? 1e-10 : 2e-4;
        const Mat q = a.to_doubles();
        expect_orthonormal_span(q, av, s.m, s.r, tol, what);
        if (method == 0)  // MGS keeps full-rank columns as unit vectors
          for (int64_t j = 0; j < s.r; ++j) {
            double nn = 0;
            for (int64_t i = 0; i < s.m; ++i) nn += q[size_t(i * s.r + j)] * q[size_t(i * s.r + j)];
            EXPECT_NEAR(nn, 1.0, tol) << what;
          }
      }
}

TEST(LinalgOrthonormalize, MgsIsGramSchmidt) {
  // MGS keeps the triangular structure: column j of Q lies in the span of columns 0..j of A, so
  // Q^T A is upper triangular with a positive diagonal.
  const int64_t m = 33, r = 7;
  const Mat av = random_values(size_t(m * r), 300);
  Tensor a = Tensor::from_doubles(av, {m, r}, DType::f64);
  ops::orthonormalize_mgs(a);
  const Mat rr = matmul(a.to_doubles(), av, r, m, r, true, false);
  for (int64_t i = 0; i < r; ++i) {
    EXPECT_GT(rr[size_t(i * r + i)], 0);
    for (int64_t j = 0; j < i; ++j) EXPECT_NEAR(rr[size_t(i * r + j)], 0, 1e-12);
  }
}

TEST(LinalgOrthonormalize, MgsZeroAndDependentColumnsBecomeZero) {
  const int64_t m = 33, r = 6;
  for (DType t : kFloatTypes) {
    // Small integers, so that the dependent column is exactly dependent in f32 too.
    Mat av = random_values(size_t(m * r), 400);
    for (double& x : av) x = std::round(2 * x);
    for (int64_t i = 0; i < m; ++i) {
      av[size_t(i * r + 1)] = 0;                                                  // an all-zero column
      av[size_t(i * r + 4)] = av[size_t(i * r + 0)] + 2 * av[size_t(i * r + 2)];  // a dependent column
    }
    Tensor a = Tensor::from_doubles(av, {m, r}, t);
    ops::orthonormalize_mgs(a, 1e-6);
    const Mat q = a.to_doubles();
    for (int64_t i = 0; i < m; ++i) {
      EXPECT_EQ(q[size_t(i * r + 1)], 0.0) << dtype_name(t);
      EXPECT_EQ(q[size_t(i * r + 4)], 0.0) << dtype_name(t);
    }
    expect_orthonormal_span(q, av, m, r, t == DType::f64 ? 1e-10 : 1e-5, "mgs rank-deficient");
    // QR of the same rank-deficient input still gives orthonormal columns and the same span.
    Tensor b = Tensor::from_doubles(av, {m, r}, t);
    ops::orthonormalize_qr(b);
    expect_orthonormal_span(b.to_doubles(), av, m, r, t == DType::f64 ? 1e-10 : 1e-5, "qr rank-deficient");
  }
  Tensor z = Tensor::zeros({5, 3}, DType::f32);
  ops::orthonormalize_mgs(z);
  for (double x : z.to_doubles()) EXPECT_EQ(x, 0.0);
}

TEST(LinalgOrthonormalize, QrOfOneMatrixIsItsQrInABatch) {
  // A batch of one runs outside the parallel region, with OpenBLAS held to one thread: the same
  // Q, bit for bit, as the matrix gets among others (each on its own thread), with 2 threads.
  ops::set_cpu_threads(2);
  const int64_t B = 3, m = 300, r = 40;
  for (DType t : {DType::f32, DType::f64}) {
    const Mat av = rounded(random_values(size_t(B * m * r), 700), t);
    Tensor batch = Tensor::from_doubles(av, {B, m, r}, t);
    ops::orthonormalize_qr(batch);
    const Mat q = batch.to_doubles();
    for (int64_t bi = 0; bi < B; ++bi) {
      Tensor one = Tensor::from_doubles(Mat(av.begin() + bi * m * r, av.begin() + (bi + 1) * m * r), {m, r}, t);
      ops::orthonormalize_qr(one);
      EXPECT_EQ(one.to_doubles(), Mat(q.begin() + bi * m * r, q.begin() + (bi + 1) * m * r)) << dtype_name(t) << " " << bi;
    }
  }
  ops::set_cpu_threads(std::max(1, static_cast<int>(std::thread::hardware_concurrency())));  // OpenMP's default
}

TEST(LinalgOrthonormalize, MgsMoreColumnsThanRows) {
  // r > m: only m independent directions exist; the rest are zeroed, never NaN.
  const Mat av = random_values(3 * 5, 500);
  Tensor a = Tensor::from_doubles(av, {3, 5}, DType::f64);
  ops::orthonormalize_mgs(a);
  expect_orthonormal_span(a.to_doubles(), av, 3, 5, 1e-10, "mgs r > m");
}

TEST(LinalgOrthonormalize, Batched) {
  const int64_t B = 3, m = 33, r = 5;
  for (DType t : kFloatTypes)
    for (int method = 0; method < 2; ++method) {
      const Mat av = rounded(random_values(size_t(B * m * r), 600 + method), t);
      Tensor a = Tensor::from_doubles(av, {B, m, r}, t);
      if (method == 0)
        ops::orthonormalize_mgs(a);
      else
        ops::orthonormalize_qr(a);
      const Mat q = a.to_doubles();
      for (int64_t bi = 0; bi < B; ++bi) {
        const Mat qb(q.begin() + bi * m * r, q.begin() + (bi + 1) * m * r);
        const Mat ab(av.begin() + bi * m * r, av.begin() + (bi + 1) * m * r);
        expect_orthonormal_span(qb, ab, m, r, t == DType::f64 ? 1e-10 : 1e-5, "batched");
      }
    }
}

TEST(LinalgOrthonormalize, UsageErrors) {
  Tensor wide = Tensor::zeros({3, 5}, DType::f32);
  EXPECT_THROW(ops::orthonormalize_qr(wide), UsageError);  // r > m
  Tensor ints = Tensor::zeros({5, 3}, DType::i32);
  EXPECT_THROW(ops::orthonormalize_mgs(ints), UsageError);
  EXPECT_THROW(ops::orthonormalize_qr(ints), UsageError);
  Tensor vec = Tensor::zeros({5}, DType::f32);
  EXPECT_THROW(ops::orthonormalize_mgs(vec), UsageError);
  Tensor ok = Tensor::zeros({5, 3}, DType::f32);
  EXPECT_THROW(ops::orthonormalize_mgs(ok, -1), UsageError);
}

// ------------------------------------------------------------------------------------- eigh

TEST(LinalgEigh, EigenpairsAscendingOrthonormal) {
  uint64_t seed = 700;
  for (DType t : kFloatTypes)
    for (int64_t n : {1, 7, 33, 100}) {
      Mat r = random_values(size_t(n * n), seed++);
      Mat a(size_t(n * n));
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < n; ++j) a[size_t(i * n + j)] = r[size_t(std::max(i, j) * n + std::min(i, j))];
      a = rounded(a, t);
      Tensor at = Tensor::from_doubles(a, {n, n}, t), w = Tensor::empty({n}, t), v = Tensor::empty({n, n}, t);
      ops::eigh(at, w, v);
      const Mat wv = w.to_doubles(), vv = v.to_doubles();
      for (int64_t j = 1; j < n; ++j) EXPECT_LE(wv[size_t(j - 1)], wv[size_t(j)]);
      Mat vd = vv;  // V diag(w)
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < n; ++j) vd[size_t(i * n + j)] *= wv[size_t(j)];
      const double scale = std::max(1.0, max_abs(wv));
      const double tol = t == DType::f64 ? 1e-11 : 5e-5;
      EXPECT_LT(max_diff(matmul(a, vv, n, n, n), vd) / scale, tol) << dtype_name(t) << " n=" << n;
      EXPECT_LT(rel_err(matmul(vv, vv, n, n, n, true, false), identity(n)), tol) << dtype_name(t) << " n=" << n;
      Mat wr, vr;
      ref_eigh(a, n, wr, vr);
      EXPECT_LT(rel_err(wv, wr), tol) << "eigenvalues vs Jacobi, " << dtype_name(t) << " n=" << n;
    }
}

TEST(LinalgEigh, ReadsTheLowerTriangleOnly) {
  const int64_t n = 7;
  const Mat a = random_spd(n, 800);
  Mat garbage = a;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = i + 1; j < n; ++j) garbage[size_t(i * n + j)] = 1e6 + double(i + j);
  Tensor w1 = Tensor::empty({n}, DType::f64), v1 = Tensor::empty({n, n}, DType::f64);
  Tensor w2 = Tensor::empty({n}, DType::f64), v2 = Tensor::empty({n, n}, DType::f64);
  ops::eigh(Tensor::from_doubles(a, {n, n}, DType::f64), w1, v1);
  ops::eigh(Tensor::from_doubles(garbage, {n, n}, DType::f64), w2, v2);
  EXPECT_EQ(w1.to_doubles(), w2.to_doubles());
  EXPECT_EQ(v1.to_doubles(), v2.to_doubles());
}

TEST(LinalgEigh, BatchedAndInPlace) {
  const int64_t B = 4, n = 7;
  Mat all;
  for (int64_t bi = 0; bi < B; ++bi) {
    const Mat a = random_spd(n, 900 + uint64_t(bi));
    all.insert(all.end(), a.begin(), a.end());
  }
  Tensor a = Tensor::from_doubles(all, {B, n, n}, DType::f64);
  Tensor w = Tensor::empty({B, n}, DType::f64);
  ops::eigh(a, w, a);  // v may be a itself
  const Mat wv = w.to_doubles(), vv = a.to_doubles();
  for (int64_t bi = 0; bi < B; ++bi) {
    const Mat ab(all.begin() + bi * n * n, all.begin() + (bi + 1) * n * n);
    Mat wr, vr;
    ref_eigh(ab, n, wr, vr);
    const Mat wb(wv.begin() + bi * n, wv.begin() + (bi + 1) * n);
    EXPECT_LT(rel_err(wb, wr), 1e-12);
    const Mat vb(vv.begin() + bi * n * n, vv.begin() + (bi + 1) * n * n);
    Mat vd = vb;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) vd[size_t(i * n + j)] *= wb[size_t(j)];
    EXPECT_LT(rel_err(matmul(ab, vb, n, n, n), vd), 1e-12);
  }
}

TEST(LinalgEigh, ErrorsAndEmpty) {
  Tensor a = Tensor::zeros({4, 4}, DType::f32);
  Tensor w = Tensor::empty({4}, DType::f32), v = Tensor::empty({4, 4}, DType::f32);
  EXPECT_THROW(ops::eigh(Tensor::zeros({4, 3}, DType::f32), w, v), UsageError);
  Tensor w3 = Tensor::empty({3}, DType::f32), w64 = Tensor::empty({4}, DType::f64);
  Tensor v45 = Tensor::empty({4, 5}, DType::f32);
  EXPECT_THROW(ops::eigh(a, w3, v), UsageError);
  EXPECT_THROW(ops::eigh(a, w64, v), UsageError);
  EXPECT_THROW(ops::eigh(a, w, v45), UsageError);
  EXPECT_THROW(ops::eigh(Tensor::zeros({4, 4}, DType::i64), w, v), UsageError);
  Tensor nan = Tensor::from_doubles(Mat(16, std::nan("")), {4, 4}, DType::f32);
  EXPECT_THROW(ops::eigh(nan, w, v), Error);
  Tensor e = Tensor::empty({0, 0}, DType::f64);
  Tensor we = Tensor::empty({0}, DType::f64), ve = Tensor::empty({0, 0}, DType::f64);
  EXPECT_NO_THROW(ops::eigh(e, we, ve));
}

// ----------------------------------------------------------------------------- inverse roots

ops::RootOptions root_opts(ops::RootMethod m, double eps, double tol = 1e-10) {
  ops::RootOptions o;
  o.method = m;
  o.eps = eps;
  o.tolerance = tol;
  return o;
}

const ops::RootMethod kMethods[] = {ops::RootMethod::eigh, ops::RootMethod::newton};
const char* method_name(ops::RootMethod m) { return m == ops::RootMethod::eigh ? "eigh" : "newton"; }

TEST(LinalgInverseRoot, MatchesEigenReferenceOnSpdMatrices) {
  uint64_t seed = 1000;
  for (DType t : kFloatTypes)
    for (int64_t n : {1, 7, 33, 100})
      for (int p : {1, 2, 4}) {
        const Mat a = rounded(random_spd(n, seed++), t);
        const Mat want = ref_inverse_root(a, n, p, 1e-12);
        for (ops::RootMethod m : kMethods) {
          Tensor at = Tensor::from_doubles(a, {n, n}, t), out = Tensor::empty({n, n}, t);
          ASSERT_TRUE(ops::inverse_root(at, p, root_opts(m, 1e-12), out)) << method_name(m);
          const Mat x = out.to_doubles();
          const double tol = t == DType::f64 ? 1e-10 : 1e-6;
          const std::string what = std::string(method_name(m)) + " " + std::string(dtype_name(t)) +
                                   " n=" + std::to_string(n) + " p=" + std::to_string(p);
          EXPECT_LT(rel_err(x, want), tol) << what;
          // X^p A = I
          EXPECT_LT(rel_err(matmul(mat_power(x, n, p), a, n, n, n), identity(n)), tol * 10 * p) << what;
        }
      }
}

TEST(LinalgInverseRoot, NonIntegerRootWithEigh) {
  const int64_t n = 7;
  const Mat a = random_spd(n, 1100);
  Tensor out = Tensor::empty({n, n}, DType::f64);
  ASSERT_TRUE(ops::inverse_root(Tensor::from_doubles(a, {n, n}, DType::f64), 1.5, root_opts(ops::RootMethod::eigh, 0),
                                out));
  EXPECT_LT(rel_err(out.to_doubles(), ref_inverse_root(a, n, 1.5, 0)), 1e-11);
}

TEST(LinalgInverseRoot, SingularPsdWithEps) {
  // A = B B^T with B [n, n/2]: rank n/2, eigenvalues 0 (up to rounding) and positive ones.
  const int64_t n = 33, k = 16;
  const double eps = 1e-2;
  const Mat b = random_values(size_t(n * k), 1200);
  const Mat a = matmul(b, b, n, k, n, false, true);
  for (int p : {2, 4}) {
    for (ops::RootMethod m : kMethods) {
      for (DType t : kFloatTypes) {
        // Rounding A to f32 makes it slightly indefinite: there the two methods differ (see
        // ref_inverse_root); in f64 the eigenvalues stay near 0 and both give the same.
        const Mat want = ref_inverse_root(rounded(a, t), n, p, eps, m == ops::RootMethod::eigh);
        Tensor out = Tensor::empty({n, n}, t);
        ASSERT_TRUE(ops::inverse_root(Tensor::from_doubles(a, {n, n}, t), p, root_opts(m, eps), out))
            << method_name(m);
        EXPECT_LT(rel_err(out.to_doubles(), want), t == DType::f64 ? 1e-9 : 1e-5)
            << method_name(m) << " " << dtype_name(t) << " p=" << p;
      }
    }
  }
}

TEST(LinalgInverseRoot, NegativeRoundingEigenvalueIsShiftedUpToEps) {
  // diag(-1e-3, 1, 4): mu = eig + eps = (-1e-3 + eps, 1 + eps, 4 + eps) is shifted so its
  // smallest is eps: (eps, 1 + 1e-3 + eps, 4 + 1e-3 + eps).
  const double eps = 1e-4;
  Tensor a = Tensor::from_doubles({-1e-3, 0, 0, 0, 1, 0, 0, 0, 4}, {3, 3}, DType::f64);
  Tensor out = Tensor::empty({3, 3}, DType::f64);
  ASSERT_TRUE(ops::inverse_root(a, 2, root_opts(ops::RootMethod::eigh, eps), out));
  const Mat x = out.to_doubles();
  EXPECT_NEAR(x[0], 1 / std::sqrt(eps), 1e-9);
  EXPECT_NEAR(x[4], 1 / std::sqrt(1 + 1e-3 + eps), 1e-12);
  EXPECT_NEAR(x[8], 1 / std::sqrt(4 + 1e-3 + eps), 1e-12);
}

TEST(LinalgInverseRoot, FailuresReturnFalseAndLeaveOutUntouched) {
  const int64_t n = 7;
  for (ops::RootMethod m : kMethods)
    for (DType t : kFloatTypes) {
      Mat a = random_spd(n, 1300);
      a[3 * n + 2] = std::nan("");
      Tensor out = Tensor::from_doubles(Mat(size_t(n * n), 7.0), {n, n}, t);
      EXPECT_FALSE(ops::inverse_root(Tensor::from_doubles(a, {n, n}, t), 2, root_opts(m, 1e-6), out))
          << method_name(m);
      a[3 * n + 2] = std::numeric_limits<double>::infinity();
      EXPECT_FALSE(ops::inverse_root(Tensor::from_doubles(a, {n, n}, t), 2, root_opts(m, 1e-6), out));
      // The zero matrix without regularisation has no inverse root.
      EXPECT_FALSE(ops::inverse_root(Tensor::zeros({n, n}, t), 2, root_opts(m, 0), out)) << method_name(m);
      for (double x : out.to_doubles()) EXPECT_EQ(x, 7.0);
    }
  // Newton that cannot converge in the iterations it is given.
  const Mat a = random_spd(n, 1301);
  Tensor out = Tensor::from_doubles(Mat(size_t(n * n), 7.0), {n, n}, DType::f64);
  ops::RootOptions o = root_opts(ops::RootMethod::newton, 0, 1e-12);
  o.max_iters = 1;
  EXPECT_FALSE(ops::inverse_root(Tensor::from_doubles(a, {n, n}, DType::f64), 2, o, out));
  for (double x : out.to_doubles()) EXPECT_EQ(x, 7.0);
  // A batch fails as a whole when one matrix fails.
  Mat two = random_spd(n, 1302);
  Mat bad = random_spd(n, 1303);
  bad[0] = std::nan("");
  two.insert(two.end(), bad.begin(), bad.end());
  Tensor outb = Tensor::from_doubles(Mat(size_t(2 * n * n), 7.0), {2, n, n}, DType::f64);
  EXPECT_FALSE(ops::inverse_root(Tensor::from_doubles(two, {2, n, n}, DType::f64), 2, ops::RootOptions{}, outb));
  for (double x : outb.to_doubles()) EXPECT_EQ(x, 7.0);
}

TEST(LinalgInverseRoot, BatchedAndInPlace) {
  const int64_t B = 3, n = 7;
  Mat all;
  for (int64_t bi = 0; bi < B; ++bi) {
    const Mat a = random_spd(n, 1400 + uint64_t(bi));
    all.insert(all.end(), a.begin(), a.end());
  }
  for (ops::RootMethod m : kMethods) {
    Tensor a = Tensor::from_doubles(all, {B, n, n}, DType::f64);
    ASSERT_TRUE(ops::inverse_root(a, 4, root_opts(m, 0), a));  // out may be a
    const Mat x = a.to_doubles();
    for (int64_t bi = 0; bi < B; ++bi) {
      const Mat ab(all.begin() + bi * n * n, all.begin() + (bi + 1) * n * n);
      const Mat xb(x.begin() + bi * n * n, x.begin() + (bi + 1) * n * n);
      EXPECT_LT(rel_err(xb, ref_inverse_root(ab, n, 4, 0)), 1e-10) << method_name(m) << " batch " << bi;
    }
  }
}

TEST(LinalgInverseRoot, UsageErrors) {
  Tensor a = Tensor::zeros({4, 4}, DType::f32), out = Tensor::empty({4, 4}, DType::f32);
  const ops::RootOptions eig = root_opts(ops::RootMethod::eigh, 1e-6), newton = root_opts(ops::RootMethod::newton, 1e-6);
  EXPECT_THROW(ops::inverse_root(Tensor::zeros({4, 3}, DType::f32), 2, eig, out), UsageError);
  Tensor out64 = Tensor::empty({4, 4}, DType::f64), out3 = Tensor::empty({2, 4, 4}, DType::f32);
  EXPECT_THROW(ops::inverse_root(a, 2, eig, out64), UsageError);
  EXPECT_THROW(ops::inverse_root(a, 2, eig, out3), UsageError);
  EXPECT_THROW(ops::inverse_root(Tensor::zeros({4, 4}, DType::i32), 2, eig, out), UsageError);
  EXPECT_THROW(ops::inverse_root(a, 0, eig, out), UsageError);
  EXPECT_THROW(ops::inverse_root(a, -2, eig, out), UsageError);
  EXPECT_THROW(ops::inverse_root(a, 1.5, newton, out), UsageError);  // newton needs an integer p
  EXPECT_THROW(ops::inverse_root(a, 2, root_opts(ops::RootMethod::eigh, -1), out), UsageError);
  ops::RootOptions bad = newton;
  bad.max_iters = 0;
  EXPECT_THROW(ops::inverse_root(a, 2, bad, out), UsageError);
  bad = newton;
  bad.tolerance = 0;
  EXPECT_THROW(ops::inverse_root(a, 2, bad, out), UsageError);
}

TEST(LinalgInverseRoot, EigenvalueRuleInAnyOrderAndInPlace) {
  // w = eig(A) + eps in any order: the smallest, -1e-3 + eps < eps, is lifted to eps, the rest
  // by the same 1e-3.
  const double eps = 1e-4;
  std::vector<double> w = {4 + eps, -1e-3 + eps, 1 + eps};
  ASSERT_TRUE(ops::inverse_root_scales(w.data(), 3, 2, eps, w.data()));  // d may be w
  EXPECT_NEAR(w[0], 1 / std::sqrt(4 + 1e-3 + eps), 1e-12);
  EXPECT_NEAR(w[1], 1 / std::sqrt(eps), 1e-9);
  EXPECT_NEAR(w[2], 1 / std::sqrt(1 + 1e-3 + eps), 1e-12);
  // No eigenvalue below eps: none changes.
  const std::vector<double> pos = {2, 0.5};
  std::vector<double> d(2);
  ASSERT_TRUE(ops::inverse_root_scales(pos.data(), 2, 1, 0.1, d.data()));
  EXPECT_EQ(d[0], 0.5);
  EXPECT_EQ(d[1], 2.0);
  // Not finite: an eigenvalue (NaN, Inf), or a root (eps = 0 on a singular matrix).
  for (double bad : {std::nan(""), std::numeric_limits<double>::infinity()}) {
    const std::vector<double> x = {1, bad};
    EXPECT_FALSE(ops::inverse_root_scales(x.data(), 2, 2, 1e-6, d.data()));
  }
  const std::vector<double> singular = {0, 1};
  EXPECT_FALSE(ops::inverse_root_scales(singular.data(), 2, 2, 0, d.data()));
}

TEST(LinalgInverseRoots, BatchedMethodsInTheInputDtype) {
  const int64_t B = 3, n = 9;
  const double eps = 1e-6;
  for (DType t : kFloatTypes) {
    Mat all;
    std::vector<Mat> each;
    for (int64_t bi = 0; bi < B; ++bi) {
      Mat spd = random_spd(n, 1500 + uint64_t(bi));
      for (int64_t i = 0; i < n; ++i) spd[size_t(i * n + i)] += 0.5;  // well conditioned: computed in t
      each.push_back(rounded(spd, t));
      all.insert(all.end(), each.back().begin(), each.back().end());
    }
    const Tensor a = Tensor::from_doubles(all, {B, n, n}, t);
    const double tol = t == DType::f64 ? 1e-9 : 1e-4;
    Tensor basis = Tensor::zeros({B, n, n}, t);
    for (ops::RootMethod m : {ops::RootMethod::eigh, ops::RootMethod::newton, ops::RootMethod::qr, ops::RootMethod::qr}) {
      // qr twice: from no basis (a full eigh), then from the kept one (QR iterations).
      ops::RootOptions o = root_opts(m, eps, 1e-10);
      o.qr_max_iterations = 3;
      o.qr_tolerance = 0;
      Tensor out = Tensor::empty({B, n, n}, t);
      const std::vector<char> ok = ops::inverse_roots(a, 2, o, out, m == ops::RootMethod::qr ? &basis : nullptr);
      ASSERT_EQ(ok, std::vector<char>(size_t(B), 1)) << name_of(m);
      const Mat x = out.to_doubles();
      for (int64_t bi = 0; bi < B; ++bi) {
        const Mat xb(x.begin() + bi * n * n, x.begin() + (bi + 1) * n * n);
        EXPECT_LT(rel_err(xb, ref_inverse_root(each[size_t(bi)], n, 2, eps)), tol)
            << name_of(m) << " " << dtype_name(t) << " batch " << bi;
      }
    }
    // The kept bases: orthonormal.
    const Mat q = basis.to_doubles();
    for (int64_t bi = 0; bi < B; ++bi) {
      const Mat qb(q.begin() + bi * n * n, q.begin() + (bi + 1) * n * n);
      EXPECT_LT(rel_err(matmul(qb, qb, n, n, n, true, false), identity(n)), t == DType::f64 ? 1e-12 : 1e-5);
    }
  }
}

TEST(LinalgInverseRoots, FailuresAndUsage) {
  const int64_t B = 2, n = 5;
  Mat all = random_spd(n, 1600);
  Mat bad = random_spd(n, 1601);
  bad[0] = std::nan("");
  all.insert(all.end(), bad.begin(), bad.end());
  const Tensor a = Tensor::from_doubles(all, {B, n, n}, DType::f64);
  Tensor out = Tensor::empty({B, n, n}, DType::f64);
  // The batched eigh fails as a whole: every matrix fails.
  EXPECT_EQ(ops::inverse_roots(a, 2, ops::RootOptions{}, out), std::vector<char>(size_t(B), 0));
  // newton retries one matrix at a time: only the bad one fails.
  EXPECT_EQ(ops::inverse_roots(a, 2, root_opts(ops::RootMethod::newton, 1e-6), out), (std::vector<char>{1, 0}));
  // qr: a failed matrix's basis is zeroed (its next root starts from a full eigh).
  Tensor basis = Tensor::from_doubles(Mat(size_t(B * n * n), 0.5), {B, n, n}, DType::f64);
  ops::RootOptions qr = root_opts(ops::RootMethod::qr, 1e-6);
  const std::vector<char> ok = ops::inverse_roots(a, 2, qr, out, &basis);
  EXPECT_EQ(ok[1], 0);
  for (double x : basis.select(1).to_doubles()) EXPECT_EQ(x, 0.0);
  EXPECT_THROW(ops::inverse_roots(a, 2, qr, out), UsageError);  // qr needs the bases
  Tensor a2 = Tensor::zeros({n, n}, DType::f64), o2 = Tensor::empty({n, n}, DType::f64);
  EXPECT_THROW(ops::inverse_roots(a2, 2, ops::RootOptions{}, o2), UsageError);  // not a batch
  EXPECT_THROW(ops::inverse_root(a2, 2, qr, o2), UsageError);  // inverse_root has no qr
}

// ---------------------------------------------------------------------------- pseudo-inverse

// The pseudo-inverse root (Meta's PseudoInverseConfig) of Jacobi's eigendecomposition in f64:
// w = eig(A), cutoff max(atol, rtol max(max w, 0)) (rtol < 0: n eps(t)), w_j^(-1/p) above it, 0
// at or below it.
Mat ref_pseudo_root(const Mat& a, int64_t n, double p, double rtol, double atol, DType t) {
  Mat w, v;
  ref_eigh(a, n, w, v);
  const double rt = rtol >= 0 ? rtol : double(n) * (t == DType::f64 ? 0x1p-52 : 0x1p-23);
  const double cut = std::max(atol, rt * std::max(w[size_t(n - 1)], 0.0));
  Mat vd = v;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) vd[size_t(i * n + j)] *= w[size_t(j)] > cut ? std::pow(w[size_t(j)], -1 / p) : 0.0;
  return matmul(vd, v, n, n, n, false, true);
}

ops::RootOptions pseudo_opts(double rtol = -1, double atol = 0) {
  ops::RootOptions o = root_opts(ops::RootMethod::pseudo_inverse, 0);
  o.rank_rtol = rtol;
  o.rank_atol = atol;
  return o;
}

// A = B B^T of rank k < n: the root vanishes on A's null space, and for p = 2 it is A^(+1/2):
// R A R is the projector onto A's range; equal to the f64 reference in either dtype.
TEST(LinalgInverseRoots, PseudoInverseOfRankDeficientMatrices) {
  const int64_t B = 2, n = 9, k = 4;
  for (DType t : kFloatTypes) {
    Mat all;
    std::vector<Mat> each;
    for (int64_t bi = 0; bi < B; ++bi) {
      const Mat b = random_values(size_t(n * k), 1700 + uint64_t(bi));
      each.push_back(rounded(matmul(b, b, n, k, n, false, true), t));
      all.insert(all.end(), each.back().begin(), each.back().end());
    }
    Tensor out = Tensor::empty({B, n, n}, t);
    ASSERT_EQ(ops::inverse_roots(Tensor::from_doubles(all, {B, n, n}, t), 2, pseudo_opts(), out), std::vector<char>(size_t(B), 1));
    const Mat x = out.to_doubles();
    const double tol = t == DType::f64 ? 1e-9 : 2e-4;
    for (int64_t bi = 0; bi < B; ++bi) {
      const Mat& a = each[size_t(bi)];
      const Mat r(x.begin() + bi * n * n, x.begin() + (bi + 1) * n * n);
      EXPECT_LT(rel_err(r, ref_pseudo_root(a, n, 2, -1, 0, t)), tol) << dtype_name(t) << " batch " << bi;
      Mat w, v;
      ref_eigh(a, n, w, v);
      Mat proj(size_t(n * n), 0.0);  // the projector onto the range: the k largest eigenvectors
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < n; ++j)
          for (int64_t c = n - k; c < n; ++c) proj[size_t(i * n + j)] += v[size_t(i * n + c)] * v[size_t(j * n + c)];
      EXPECT_LT(rel_err(matmul(matmul(r, a, n, n, n), r, n, n, n), proj), tol * 10) << dtype_name(t);
      for (int64_t c = 0; c < n - k; ++c) {  // a null vector z: R z = 0
        Mat z(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) z[size_t(i)] = v[size_t(i * n + c)];
        EXPECT_LT(max_abs(matmul(r, z, n, n, 1)), tol * 10) << dtype_name(t) << " null vector " << c;
      }
    }
  }
}

// The cutoff: eigenvalues at or below max(atol, rtol max w) get 0 (no eps, no shift: a negative
// rounding eigenvalue is cut too); rtol < 0 is n times the dtype's machine epsilon; the zero
// matrix's pseudo-inverse root is 0 (not a failure).
TEST(LinalgInverseRoots, PseudoInverseCutoff) {
  auto diag_root = [](const std::vector<double>& d, DType t, const ops::RootOptions& o) {
    const int64_t n = static_cast<int64_t>(d.size());
    Mat a(size_t(n * n), 0.0);
    for (int64_t i = 0; i < n; ++i) a[size_t(i * n + i)] = d[size_t(i)];
    Tensor out = Tensor::empty({1, n, n}, t);
    EXPECT_EQ(ops::inverse_roots(Tensor::from_doubles(a, {1, n, n}, t), 2, o, out), std::vector<char>{1});
    const Mat x = out.to_doubles();
    std::vector<double> diag(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) diag[size_t(i)] = x[size_t(i * n + i)];
    return diag;
  };
  auto near = [](const std::vector<double>& got, const std::vector<double>& want, const std::string& what) {
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-6 * std::max(1.0, std::fabs(want[i]))) << what << " " << i;
  };
  const double s2 = 1 / std::sqrt(2.0), s05 = 1 / std::sqrt(0.5);
  near(diag_root({4, 1e-3, 0.5}, DType::f64, pseudo_opts(-1, 1e-2)), {0.5, 0, s05}, "atol 1e-2");
  near(diag_root({4, 1e-3, 0.5}, DType::f64, pseudo_opts(0.1, 0)), {0.5, 0, s05}, "rtol 0.1: cut 0.4");
  near(diag_root({4, 1e-3, 0.5}, DType::f64, pseudo_opts(0.2, 0)), {0.5, 0, 0}, "rtol 0.2: cut 0.8");
  near(diag_root({4, 1, 2}, DType::f64, pseudo_opts(-1, 1.0)), {0.5, 0, s2}, "at the cutoff: 0");
  near(diag_root({-1e-3, 1, 4}, DType::f64, pseudo_opts()), {0, 1, 0.5}, "negative: cut, no shift");
  // 1e-9 relative: above n eps(f64) (7e-16 * 2), below n eps(f32) (3.6e-7 * 2).
  near(diag_root({1, 1e-9, 2}, DType::f64, pseudo_opts()), {1, 1 / std::sqrt(1e-9), s2}, "f64 default rtol");
  near(diag_root({1, 1e-9, 2}, DType::f32, pseudo_opts()), {1, 0, s2}, "f32 default rtol");
  near(diag_root({0, 0, 0}, DType::f64, pseudo_opts()), {0, 0, 0}, "zero matrix");
  // Usage: no eps with the pseudo-inverse, atol >= 0; inverse_root has no pseudo-inverse.
  Tensor a = Tensor::zeros({1, 3, 3}, DType::f64), out = Tensor::empty({1, 3, 3}, DType::f64);
  ops::RootOptions bad = pseudo_opts();
  bad.eps = 1e-6;
  EXPECT_THROW(ops::inverse_roots(a, 2, bad, out), UsageError);
  EXPECT_THROW(ops::inverse_roots(a, 2, pseudo_opts(-1, -1), out), UsageError);
  Tensor a1 = Tensor::zeros({3, 3}, DType::f64), o1 = Tensor::empty({3, 3}, DType::f64);
  EXPECT_THROW(ops::inverse_root(a1, 2, pseudo_opts(), o1), UsageError);
}

// ---------------------------------------------------------------------------- eigenbases

// |Q1^T Q2| = I: the same columns up to sign.
double basis_diff(const Mat& q1, const Mat& q2, int64_t n) {
  Mat c = matmul(q1, q2, n, n, n, true, false);
  for (double& x : c) x = std::fabs(x);
  return max_diff(c, identity(n));
}

// Q^T A Q: diagonal (relative to max |A|), its diagonal in the given order.
void expect_diagonalises(const Mat& q, const Mat& a, int64_t n, bool ascending, double tol, const std::string& what) {
  const Mat b = matmul(matmul(q, a, n, n, n, true, false), q, n, n, n);
  double off = 0;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j)
      if (i != j) off = std::max(off, std::fabs(b[size_t(i * n + j)]));
  EXPECT_LT(off, tol * max_abs(a)) << what;
  for (int64_t i = 0; i + 1 < n; ++i) {
    const double x = b[size_t(i * n + i)], y = b[size_t((i + 1) * n + i + 1)];
    EXPECT_TRUE(ascending ? x <= y : x >= y) << what << ": diagonal " << i << " " << x << " " << y;
  }
  EXPECT_LT(rel_err(matmul(q, q, n, n, n, true, false), identity(n)), tol) << what << ": not orthonormal";
}

// eigh: Jacobi's eigenvectors, ascending; qr from a zero basis: a full eigh, columns by
// ascending eigenvalue; qr from a kept basis: qr_max_iterations QR iterations on A + eps I
// (here one, against one Gram-Schmidt step in f64), then sorted by ascending estimate (Meta's
// SOAP order; inverse_roots' qr keeps them descending); no
// iteration once ||B - diag B||_F <= qr_tolerance ||B||_F (the basis stays as it is).
TEST(LinalgEigenbases, EighAndWarmStartedQr) {
  const int64_t B = 3, n = 8;
  const double eps = 1e-3;
  for (DType t : kFloatTypes) {
    const double tol = t == DType::f64 ? 1e-10 : 2e-4;
    Mat all, moved;
    std::vector<Mat> each, each_moved;
    for (int64_t bi = 0; bi < B; ++bi) {
      each.push_back(rounded(random_spd(n, 1800 + uint64_t(bi)), t));
      all.insert(all.end(), each.back().begin(), each.back().end());
      Mat m = each.back();
      const Mat d = random_values(size_t(n * n), 1900 + uint64_t(bi));
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < n; ++j) m[size_t(i * n + j)] += 0.05 * (d[size_t(i * n + j)] + d[size_t(j * n + i)]);
      each_moved.push_back(rounded(m, t));
      moved.insert(moved.end(), each_moved.back().begin(), each_moved.back().end());
    }
    const Tensor a = Tensor::from_doubles(all, {B, n, n}, t), a2 = Tensor::from_doubles(moved, {B, n, n}, t);
    ops::RootOptions o = root_opts(ops::RootMethod::eigh, eps);
    Tensor basis = Tensor::empty({B, n, n}, t);
    ASSERT_EQ(ops::eigenbases(a, o, basis), std::vector<char>(size_t(B), 1));
    Mat q = basis.to_doubles();
    for (int64_t bi = 0; bi < B; ++bi) {
      const Mat qb(q.begin() + bi * n * n, q.begin() + (bi + 1) * n * n);
      expect_diagonalises(qb, each[size_t(bi)], n, true, tol, "eigh " + std::string(dtype_name(t)));
      Mat w, v;
      ref_eigh(each[size_t(bi)], n, w, v);
      EXPECT_LT(basis_diff(qb, v, n), tol * 10) << "eigh " << dtype_name(t);
    }
    // qr from a zero basis: a full eigh, ascending.
    o.method = ops::RootMethod::qr;
    o.qr_max_iterations = 1;
    o.qr_tolerance = 0;
    Tensor kept = Tensor::zeros({B, n, n}, t);
    ASSERT_EQ(ops::eigenbases(a, o, kept), std::vector<char>(size_t(B), 1));
    const Mat q0 = kept.to_doubles();
    for (int64_t bi = 0; bi < B; ++bi)
      expect_diagonalises(Mat(q0.begin() + bi * n * n, q0.begin() + (bi + 1) * n * n), each[size_t(bi)], n, true, tol,
                          "qr fresh " + std::string(dtype_name(t)));
    // From it, on the moved matrices: one QR iteration.
    ASSERT_EQ(ops::eigenbases(a2, o, kept), std::vector<char>(size_t(B), 1));
    const Mat q1 = kept.to_doubles();
    for (int64_t bi = 0; bi < B; ++bi) {
      Mat am = each_moved[size_t(bi)];
      for (int64_t i = 0; i < n; ++i) am[size_t(i * n + i)] += eps;
      const Mat prev(q0.begin() + bi * n * n, q0.begin() + (bi + 1) * n * n);
      Mat z = matmul(am, prev, n, n, n);  // Gram-Schmidt of the columns of (A + eps I) Q, in order
      for (int64_t c = 0; c < n; ++c) {
        for (int pass = 0; pass < 2; ++pass)
          for (int64_t c2 = 0; c2 < c; ++c2) {
            double d = 0;
            for (int64_t i = 0; i < n; ++i) d += z[size_t(i * n + c2)] * z[size_t(i * n + c)];
            for (int64_t i = 0; i < n; ++i) z[size_t(i * n + c)] -= d * z[size_t(i * n + c2)];
          }
        double nn = 0;
        for (int64_t i = 0; i < n; ++i) nn += z[size_t(i * n + c)] * z[size_t(i * n + c)];
        for (int64_t i = 0; i < n; ++i) z[size_t(i * n + c)] /= std::sqrt(nn);
      }
      // Sorted by ascending diag(Z^T A Z) (stable).
      const Mat bz = matmul(matmul(z, am, n, n, n, true, false), z, n, n, n);
      std::vector<int64_t> order(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) order[size_t(i)] = i;
      std::stable_sort(order.begin(), order.end(),
                       [&](int64_t x, int64_t y) { return bz[size_t(x * n + x)] < bz[size_t(y * n + y)]; });
      Mat want(size_t(n * n));
      for (int64_t i = 0; i < n; ++i)
        for (int64_t c = 0; c < n; ++c) want[size_t(i * n + c)] = z[size_t(i * n + order[size_t(c)])];
      const Mat got(q1.begin() + bi * n * n, q1.begin() + (bi + 1) * n * n);
      EXPECT_LT(basis_diff(got, want, n), tol * 10) << "qr warm " << dtype_name(t) << " batch " << bi;
      EXPECT_GT(basis_diff(got, prev, n), 1e-3) << "the iteration moved nothing";
    }
    // A basis that already diagonalises its matrix: no iteration under a tolerance.
    Tensor exact = Tensor::zeros({B, n, n}, t);
    ASSERT_EQ(ops::eigenbases(a2, o, exact), std::vector<char>(size_t(B), 1));  // full eigh of a2
    const Mat before = exact.to_doubles();
    o.qr_tolerance = 0.01;
    o.qr_max_iterations = 5;
    ASSERT_EQ(ops::eigenbases(a2, o, exact), std::vector<char>(size_t(B), 1));
    EXPECT_EQ(exact.to_doubles(), before) << dtype_name(t);
  }
}

// A matrix that fails (NaN) gets ok 0 and a zero basis (qr: its next call starts from a full
// eigh); the others, where the solver runs them one at a time, keep theirs. Usage errors.
TEST(LinalgEigenbases, FailuresAndUsage) {
  const int64_t n = 5;
  Mat all = random_spd(n, 2000);
  Mat bad = random_spd(n, 2001);
  bad[0] = std::nan("");
  all.insert(all.end(), bad.begin(), bad.end());
  const Tensor a = Tensor::from_doubles(all, {2, n, n}, DType::f64);
  for (ops::RootMethod m : {ops::RootMethod::eigh, ops::RootMethod::qr}) {
    Tensor basis = Tensor::zeros({2, n, n}, DType::f64);
    const std::vector<char> ok = ops::eigenbases(a, root_opts(m, 1e-6), basis);
    ASSERT_EQ(ok.size(), 2u);
    EXPECT_EQ(ok[1], 0) << name_of(m);
    for (int64_t bi = 0; bi < 2; ++bi)
      if (!ok[size_t(bi)]) {
        EXPECT_EQ(max_abs(basis.select(bi).to_doubles()), 0.0) << name_of(m) << " batch " << bi << " failed, not zeroed";
      }
  }
  Tensor basis = Tensor::zeros({2, n, n}, DType::f64);
  EXPECT_THROW(ops::eigenbases(a, root_opts(ops::RootMethod::newton, 1e-6), basis), UsageError);
  EXPECT_THROW(ops::eigenbases(a, pseudo_opts(), basis), UsageError);
  EXPECT_THROW(ops::eigenbases(a, root_opts(ops::RootMethod::eigh, -1), basis), UsageError);
  Tensor b32 = Tensor::zeros({2, n, n}, DType::f32), b3 = Tensor::zeros({3, n, n}, DType::f64);
  EXPECT_THROW(ops::eigenbases(a, root_opts(ops::RootMethod::eigh, 0), b32), UsageError);
  EXPECT_THROW(ops::eigenbases(a, root_opts(ops::RootMethod::eigh, 0), b3), UsageError);
  Tensor a2 = Tensor::zeros({n, n}, DType::f64), q2 = Tensor::zeros({n, n}, DType::f64);
  EXPECT_THROW(ops::eigenbases(a2, root_opts(ops::RootMethod::eigh, 0), q2), UsageError);  // not a batch
}

}  // namespace
}  // namespace dtk
