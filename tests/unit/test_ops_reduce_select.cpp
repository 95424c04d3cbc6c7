// Reductions and selection ops (CPU) against plain f64 references written here, on random inputs
// of awkward sizes, in f32 and f64; the empty-input rules; usage errors; random-k properties.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "dtk/core/error.h"
#include "dtk/core/philox.h"
#include "dtk/core/tensor.h"
#include "dtk/ops/dispatch.h"
#include "dtk/ops/ops.h"
#include "../common/test_util.h"

namespace dtk {
namespace {

using test_util::expect_close;
using test_util::randn;
using test_util::rounded;
using test_util::Vec;
using ops::Axis;
using ops::Reduce;

const DType kFloats[] = {DType::f32, DType::f64};
// The result is rounded to the dtype once (sums accumulate in double): f32 within an ulp or two.
double tol_of(DType t) { return test_util::tol_of(t, 1e-6); }

Tensor make(const Vec& v, const Shape& s, DType t = DType::f64) { return Tensor::from_doubles(v, s, t); }

const Reduce kKinds[] = {Reduce::sum, Reduce::mean, Reduce::max, Reduce::min, Reduce::norm2, Reduce::absmax};
const char* kind_name(Reduce k) {
  switch (k) {
    case Reduce::sum: return "sum";
    case Reduce::mean: return "mean";
    case Reduce::max: return "max";
    case Reduce::min: return "min";
    case Reduce::norm2: return "norm2";
    case Reduce::absmax: return "absmax";
  }
  return "?";
}

// The reduction of x[first + i * stride], i < count.
double ref_reduce(Reduce k, const Vec& x, int64_t first, int64_t count, int64_t stride) {
  double s = 0, m = k == Reduce::min ? INFINITY : -INFINITY;
  for (int64_t i = 0; i < count; ++i) {
    const double v = x[first + i * stride];
    switch (k) {
      case Reduce::sum:
      case Reduce::mean: s += v; break;
      case Reduce::norm2: s += v * v; break;
      case Reduce::max: m = std::fmax(m, v); break;
      case Reduce::min: m = std::fmin(m, v); break;
      case Reduce::absmax: m = std::fmax(m, std::fabs(v)); break;
    }
  }
  if (k == Reduce::mean) return s / count;
  if (k == Reduce::norm2) return std::sqrt(s);
  if (k == Reduce::sum) return s;
  return m;
}

TEST(OpsReduce, AllMatchesReference) {
  for (DType t : kFloats)
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{1003}, int64_t{100003}})
      for (Reduce k : kKinds) {
        const Vec x = rounded(randn(n, 5 + n), t);
        Tensor out = Tensor::empty({1}, t);
        ops::reduce(k, Axis::all, make(x, {n}, t), out);
        const std::string what = std::string(kind_name(k)) + " all " + std::string(dtype_name(t)) + " n=" +
                                 std::to_string(n);
        const double want = ref_reduce(k, x, 0, n, 1);
        expect_close(out.to_doubles(), {want}, tol_of(t), what);
        expect_close({ops::reduce_all(k, make(x, {n}, t))}, {want}, tol_of(t), what + " reduce_all");
      }
}

TEST(OpsReduce, RowsAndColsMatchReference) {
  struct S {
    int64_t R, C;
  };
  for (DType t : kFloats)
    for (const S& s : {S{1, 1}, S{7, 13}, S{1003, 7}, S{3, 1000}, S{300, 201}})
      for (Reduce k : kKinds) {
        const Vec x = rounded(randn(s.R * s.C, 7 + s.R), t);
        const Tensor a = make(x, {s.R, s.C}, t);
        Tensor rows = Tensor::empty({s.R}, t), cols = Tensor::empty({s.C}, t);
        ops::reduce(k, Axis::rows, a, rows);
        ops::reduce(k, Axis::cols, a, cols);
        Vec want_rows(static_cast<size_t>(s.R)), want_cols(static_cast<size_t>(s.C));
        for (int64_t r = 0; r < s.R; ++r) want_rows[r] = ref_reduce(k, x, r * s.C, s.C, 1);
        for (int64_t c = 0; c < s.C; ++c) want_cols[c] = ref_reduce(k, x, c, s.R, s.C);
        const std::string what = std::string(kind_name(k)) + " " + std::string(dtype_name(t)) + " " +
                                 std::to_string(s.R) + "x" + std::to_string(s.C);
        expect_close(rows.to_doubles(), want_rows, tol_of(t), what + " rows");
        expect_close(cols.to_doubles(), want_cols, tol_of(t), what + " cols");
      }
}

TEST(OpsReduce, BitIdenticalRunToRun) {
  const Vec x = randn(1 << 20, 9);
  const Tensor a = make(x, {1 << 20}, DType::f32);
  const double first = ops::reduce_all(Reduce::sum, a);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(ops::reduce_all(Reduce::sum, a), first);
  // f32 input, double accumulation: the sum of 2^20 floats matches the f64 sum to f32 rounding
  const Vec xr = rounded(x, DType::f32);
  double s = 0;
  for (double v : xr) s += v;
  EXPECT_EQ(first, static_cast<double>(static_cast<float>(s)));
}

TEST(OpsReduce, EmptyInputsAndNaN) {
  const Tensor empty = Tensor::empty({0}, DType::f32);
  EXPECT_EQ(ops::reduce_all(Reduce::sum, empty), 0.0);
  EXPECT_EQ(ops::reduce_all(Reduce::norm2, empty), 0.0);
  EXPECT_TRUE(std::isnan(ops::reduce_all(Reduce::mean, empty)));
  EXPECT_THROW(ops::reduce_all(Reduce::max, empty), UsageError);
  EXPECT_THROW(ops::reduce_all(Reduce::min, empty), UsageError);
  EXPECT_THROW(ops::reduce_all(Reduce::absmax, empty), UsageError);
  Tensor out = Tensor::empty({3}, DType::f32);
  EXPECT_THROW(ops::reduce(Reduce::max, Axis::rows, Tensor::empty({3, 0}, DType::f32), out), UsageError);
  ops::reduce(Reduce::sum, Axis::rows, Tensor::empty({3, 0}, DType::f32), out);
  EXPECT_EQ(out.to_doubles(), Vec(3, 0.0));

  for (DType t : kFloats) {
    const Tensor a = make({1.0, NAN, -5.0, 2.0}, {4}, t);
    EXPECT_TRUE(std::isnan(ops::reduce_all(Reduce::max, a)));
    EXPECT_TRUE(std::isnan(ops::reduce_all(Reduce::min, a)));
    EXPECT_TRUE(std::isnan(ops::reduce_all(Reduce::sum, a)));
    const Tensor first_nan = make({NAN, 1.0}, {2}, t);
    EXPECT_TRUE(std::isnan(ops::reduce_all(Reduce::max, first_nan)));
  }
}

// The dispatch both backends share (ops/dispatch.h): the type each dtype is visited as, a refusal
// for any other dtype (never a bf16 or integer tensor read as float), each kind's rules.
TEST(OpsReduce, SharedDispatch) {
  auto visited = [](DType t) {
    size_t bytes = 0;
    ops::detail::visit_float(t, [&](auto tag) { bytes = sizeof(tag); });
    return bytes;
  };
  EXPECT_EQ(visited(DType::f32), sizeof(float));
  EXPECT_EQ(visited(DType::f64), sizeof(double));
  for (DType t : {DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8}) EXPECT_THROW(visited(t), Error);
  std::vector<Reduce> kinds;
  for (Reduce k : {Reduce::sum, Reduce::mean, Reduce::max, Reduce::min, Reduce::norm2, Reduce::absmax})
    ops::detail::visit_reduce(k, [&](auto kc) { kinds.push_back(decltype(kc)::value); });
  EXPECT_EQ(kinds, (std::vector<Reduce>{Reduce::sum, Reduce::mean, Reduce::max, Reduce::min, Reduce::norm2,
                                        Reduce::absmax}));
  using Max = ops::detail::ReducePolicy<Reduce::max>;
  using Min = ops::detail::ReducePolicy<Reduce::min>;
  using AbsMax = ops::detail::ReducePolicy<Reduce::absmax>;
  EXPECT_TRUE(std::isnan(Max::combine(NAN, 1.0)));  // a NaN accumulator stays NaN
  EXPECT_TRUE(std::isnan(Max::combine(1.0, NAN)));  // a NaN element wins
  EXPECT_TRUE(std::isnan(Min::combine(NAN, 1.0)));
  EXPECT_TRUE(std::isnan(Min::combine(1.0, NAN)));
  EXPECT_EQ(Max::identity(), -HUGE_VAL);
  EXPECT_EQ(Min::identity(), HUGE_VAL);
  EXPECT_EQ(AbsMax::map(-3.0), 3.0);
  EXPECT_FALSE(std::signbit(AbsMax::map(-0.0)));
  EXPECT_EQ(ops::detail::ReducePolicy<Reduce::norm2>::finish(ops::detail::ReducePolicy<Reduce::norm2>::map(-2.0), 1), 2.0);
  EXPECT_EQ(ops::detail::exponent_mask16(DType::bf16), 0x7f80);
  EXPECT_EQ(ops::detail::exponent_mask16(DType::f16), 0x7c00);
}

TEST(OpsReduce, UsageErrors) {
  const Tensor a = Tensor::zeros({3, 4}, DType::f32);
  Tensor out1 = Tensor::empty({1}, DType::f32), out3 = Tensor::empty({3}, DType::f32);
  Tensor out4 = Tensor::empty({4}, DType::f32), out3_64 = Tensor::empty({3}, DType::f64);
  EXPECT_THROW(ops::reduce(Reduce::sum, Axis::rows, a, out4), UsageError);
  EXPECT_THROW(ops::reduce(Reduce::sum, Axis::cols, a, out3), UsageError);
  EXPECT_THROW(ops::reduce(Reduce::sum, Axis::rows, a, out3_64), UsageError);
  EXPECT_THROW(ops::reduce(Reduce::sum, Axis::all, a, out3), UsageError);
  EXPECT_THROW(ops::reduce(Reduce::sum, Axis::rows, Tensor::zeros({2, 3, 2}, DType::f32), out3), UsageError);
  EXPECT_THROW(ops::reduce(Reduce::sum, Axis::all, Tensor::zeros({3}, DType::i32), out1), UsageError);
  EXPECT_THROW(ops::dot(a, Tensor::zeros({3, 3}, DType::f32)), UsageError);
  EXPECT_THROW(ops::dot(a, Tensor::zeros({3, 4}, DType::f64)), UsageError);
  EXPECT_THROW(ops::count_nonfinite(Tensor::zeros({3}, DType::i64)), UsageError);
  EXPECT_NO_THROW(ops::reduce(Reduce::sum, Axis::rows, a, out3));
}

TEST(OpsReduce, DotMatchesReference) {
  for (DType t : kFloats)
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1003}, int64_t{100003}}) {
      const Vec a = rounded(randn(n, 11), t), b = rounded(randn(n, 12), t);
      double want = 0, mag = 0;
      for (int64_t i = 0; i < n; ++i) {
        want += a[i] * b[i];
        mag += std::fabs(a[i] * b[i]);
      }
      // f32 rounds each product to f32 before the double sum: relative to sum |a b|
      const double tol = t == DType::f32 ? 1e-7 * mag : 1e-12 * std::fmax(1.0, mag);
      EXPECT_NEAR(ops::dot(make(a, {n}, t), make(b, {n}, t)), want, tol) << dtype_name(t) << " n=" << n;
    }
}

TEST(OpsReduce, CountNonfiniteEveryFloatWidth) {
  for (DType t : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
    Vec x = randn(1003, 13);
    x[0] = NAN;
    x[17] = INFINITY;
    x[500] = -INFINITY;
    x[1002] = NAN;
    EXPECT_EQ(ops::count_nonfinite(make(x, {1003}, t)), 4) << dtype_name(t);
    EXPECT_EQ(ops::count_nonfinite(make(randn(7, 14), {7}, t)), 0) << dtype_name(t);
  }
  Vec big = randn(100003, 15);
  for (size_t i = 0; i < big.size(); i += 1000) big[i] = NAN;
  EXPECT_EQ(ops::count_nonfinite(make(big, {100003}, DType::f32)), 101);
  EXPECT_EQ(ops::count_nonfinite(Tensor::empty({0}, DType::f32)), 0);
}

// ---------------------------------------------------------------------------- selection

// Indices by decreasing |x|, ties by lower index.
std::vector<int64_t> ref_topk(const Vec& x, int64_t k) {
  std::vector<int64_t> order(x.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return std::fabs(x[a]) > std::fabs(x[b]); });
  order.resize(static_cast<size_t>(k));
  return order;
}

TEST(OpsSelect, TopkAbsMatchesReference) {
  for (DType t : kFloats)
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{1003}})
      for (int64_t k : {int64_t{0}, int64_t{1}, n / 3, n}) {
        const Vec x = rounded(randn(n, 21 + n), t);
        Tensor values = Tensor::empty({k}, t), indices = Tensor::empty({k}, DType::i64);
        ops::topk_abs(make(x, {n}, t), k, values, indices);
        const std::vector<int64_t> want = ref_topk(x, k);
        const Vec got_i = indices.to_doubles(), got_v = values.to_doubles();
        for (int64_t j = 0; j < k; ++j) {
          ASSERT_EQ(static_cast<int64_t>(got_i[j]), want[j]) << dtype_name(t) << " n=" << n << " k=" << k << " j=" << j;
          ASSERT_EQ(got_v[j], x[want[j]]);
        }
      }
}

TEST(OpsSelect, TopkTiesByLowerIndex) {
  const Vec x = {1.0, -3.0, 3.0, 0.5, -1.0, 3.0, 2.0, -2.0};
  Tensor values = Tensor::empty({6}, DType::f64), indices = Tensor::empty({6}, DType::i64);
  ops::topk_abs(make(x, {8}), 6, values, indices);
  EXPECT_EQ(indices.to_doubles(), (Vec{1, 2, 5, 6, 7, 0}));
  EXPECT_EQ(values.to_doubles(), (Vec{-3.0, 3.0, 3.0, 2.0, -2.0, 1.0}));
  // a multi-dimensional x is flattened
  Tensor v2 = Tensor::empty({2}, DType::f64), i2 = Tensor::empty({2}, DType::i64);
  ops::topk_abs(make(x, {2, 4}), 2, v2, i2);
  EXPECT_EQ(i2.to_doubles(), (Vec{1, 2}));
}

TEST(OpsSelect, TopkUsageErrors) {
  const Tensor x = Tensor::zeros({5}, DType::f32);
  Tensor v6 = Tensor::empty({6}, DType::f32), i6 = Tensor::empty({6}, DType::i64);
  EXPECT_THROW(ops::topk_abs(x, 6, v6, i6), UsageError);  // k > n
  Tensor v2 = Tensor::empty({2}, DType::f32), i2_32 = Tensor::empty({2}, DType::i32);
  EXPECT_THROW(ops::topk_abs(x, 2, v2, i2_32), UsageError);
  Tensor v2_64 = Tensor::empty({2}, DType::f64), i2 = Tensor::empty({2}, DType::i64);
  EXPECT_THROW(ops::topk_abs(x, 2, v2_64, i2), UsageError);
  EXPECT_THROW(ops::topk_abs(x, 3, v2, i2), UsageError);
}

void expect_valid_subset(const Tensor& idx, int64_t n, int64_t k) {
  ASSERT_EQ(idx.dtype(), DType::i64);
  ASSERT_EQ(idx.numel(), k);
  const int64_t* p = idx.ptr<int64_t>();
  for (int64_t j = 0; j < k; ++j) {
    ASSERT_GE(p[j], 0);
    ASSERT_LT(p[j], n);
    if (j) {
      ASSERT_LT(p[j - 1], p[j]) << "sorted and distinct";
    }
  }
}

TEST(OpsSelect, RandomkDistinctSortedReproducible) {
  struct C {
    int64_t n, k;
  };
  // k * 4 >= n takes the dense permutation, smaller k the sparse one
  for (const C& c : {C{1, 0}, C{1, 1}, C{7, 3}, C{7, 7}, C{1003, 250}, C{1003, 251}, C{1000000, 1000}}) {
    const Tensor a = ops::randomk_indices(c.n, c.k, 42, 7, Device::cpu());
    expect_valid_subset(a, c.n, c.k);
    const Tensor b = ops::randomk_indices(c.n, c.k, 42, 7, Device::cpu());
    EXPECT_EQ(a.to_doubles(), b.to_doubles()) << "same (seed, offset)";
    if (c.k > 0 && c.k < c.n && c.n > 100) {
      EXPECT_NE(a.to_doubles(), ops::randomk_indices(c.n, c.k, 43, 7, Device::cpu()).to_doubles()) << "other seed";
      EXPECT_NE(a.to_doubles(), ops::randomk_indices(c.n, c.k, 42, 8, Device::cpu()).to_doubles()) << "other offset";
    }
  }
  const Tensor all = ops::randomk_indices(10, 10, 1, 0, Device::cpu());
  EXPECT_EQ(all.to_doubles(), (Vec{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
}

// The algorithm the op promises, written out with a dense array: a partial Fisher-Yates shuffle
// with step i drawing philox::uniform(seed, offset + i).
std::vector<int64_t> ref_randomk(int64_t n, int64_t k, uint64_t seed, uint64_t offset) {
  std::vector<int64_t> perm(static_cast<size_t>(n));
  std::iota(perm.begin(), perm.end(), 0);
  for (int64_t i = 0; i < k; ++i) {
    const int64_t m = n - i;
    int64_t j = static_cast<int64_t>(philox::uniform(seed, offset + i) * static_cast<double>(m));
    if (j >= m) j = m - 1;
    std::swap(perm[i], perm[i + j]);
  }
  perm.resize(static_cast<size_t>(k));
  std::sort(perm.begin(), perm.end());
  return perm;
}

TEST(OpsSelect, RandomkSparseAndDensePathsAgreeWithFisherYates) {
  for (int64_t k : {int64_t{1}, int64_t{10}, int64_t{249}, int64_t{250}, int64_t{700}}) {
    const Tensor got = ops::randomk_indices(1000, k, 99, 12345, Device::cpu());
    const std::vector<int64_t> want = ref_randomk(1000, k, 99, 12345);
    ASSERT_EQ(got.numel(), k);
    for (int64_t j = 0; j < k; ++j) ASSERT_EQ(got.ptr<int64_t>()[j], want[j]) << "k=" << k << " j=" << j;
  }
}

TEST(OpsSelect, RandomkRoughlyUniform) {
  const int64_t n = 10, k = 3, trials = 20000;
  std::vector<int64_t> hits(n, 0);
  for (int64_t trial = 0; trial < trials; ++trial) {
    // the offsets of different calls do not overlap: each call uses counters offset .. offset + k - 1
    const Tensor idx = ops::randomk_indices(n, k, 5, static_cast<uint64_t>(trial * k), Device::cpu());
    for (int64_t j = 0; j < k; ++j) ++hits[idx.ptr<int64_t>()[j]];
  }
  // each index is picked with probability k / n; 5 standard deviations
  const double expect = static_cast<double>(trials * k) / n;
  const double sd = std::sqrt(trials * (double(k) / n) * (1 - double(k) / n));
  for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(static_cast<double>(hits[i]), expect, 5 * sd) << "index " << i;
}

TEST(OpsSelect, RandomkUsageErrors) {
  EXPECT_THROW(ops::randomk_indices(5, 6, 0, 0, Device::cpu()), UsageError);
  EXPECT_THROW(ops::randomk_indices(5, -1, 0, 0, Device::cpu()), UsageError);
  EXPECT_THROW(ops::randomk_indices(-1, 0, 0, 0, Device::cpu()), UsageError);
  EXPECT_EQ(ops::randomk_indices(0, 0, 0, 0, Device::cpu()).numel(), 0);
}

TEST(OpsSelect, GatherAndScatterAddWithRepeatedIndices) {
  for (DType t : kFloats)
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1003}, int64_t{100003}}) {
      const int64_t m = n / 2 + 3;
      const Vec x = rounded(randn(n, 31), t);
      Vec idx(static_cast<size_t>(m));
      for (int64_t j = 0; j < m; ++j) idx[j] = std::floor(philox::uniform(32, j) * n);  // repeats likely
      const Tensor it = make(idx, {m}, DType::i64);
      Tensor out = Tensor::empty({m}, t);
      ops::gather(make(x, {n}, t), it, out);
      Vec want(static_cast<size_t>(m));
      for (int64_t j = 0; j < m; ++j) want[j] = x[static_cast<int64_t>(idx[j])];
      expect_close(out.to_doubles(), want, 0, "gather " + std::to_string(n));

      const Vec vals = rounded(randn(m, 33), t), base = rounded(randn(n, 34), t);
      Tensor acc = make(base, {n}, t);
      ops::scatter_add(it, make(vals, {m}, t), acc);
      Vec want_acc = base;
      for (int64_t j = 0; j < m; ++j) want_acc[static_cast<int64_t>(idx[j])] += vals[j];
      expect_close(acc.to_doubles(), want_acc, 10 * tol_of(t), "scatter_add " + std::to_string(n));
    }
}

TEST(OpsSelect, GatherScatterUsageErrors) {
  const Tensor x = Tensor::zeros({5}, DType::f32);
  Tensor out = Tensor::empty({2}, DType::f32);
  EXPECT_THROW(ops::gather(x, make({0, 5}, {2}, DType::i64), out), UsageError);  // out of range
  EXPECT_THROW(ops::gather(x, make({0, -1}, {2}, DType::i64), out), UsageError);
  EXPECT_THROW(ops::gather(x, make({0, 1}, {2}, DType::i32), out), UsageError);
  Tensor out3 = Tensor::empty({3}, DType::f32);
  EXPECT_THROW(ops::gather(x, make({0, 1}, {2}, DType::i64), out3), UsageError);
  Tensor acc = Tensor::zeros({5}, DType::f32);
  EXPECT_THROW(ops::scatter_add(make({0, 9}, {2}, DType::i64), out, acc), UsageError);
  EXPECT_THROW(ops::scatter_add(make({0, 1}, {2}, DType::i64), Tensor::zeros({2}, DType::f64), acc), UsageError);
}

}  // namespace
}  // namespace dtk
