// Distributed Shampoo in a world of one: blocking and merging, one step against a direct f64
// computation (L^(-1/4) G R^(-1/4) with grafting), vectors and order-3 blocks, several steps of
// every feature against the f64 reference of tests/common/shampoo_reference.h (and the
// preconditioner family: eigenvalue-corrected, spectral, pseudo-inverse roots, factor updates
// every K, diagonal parameters; the reference's new parts checked on their own first), NaN is an
// error naming the parameter, state names and round trips, configs and bad combinations.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "../common/dion_reference.h"
#include "../common/shampoo_reference.h"
#include "../common/test_util.h"
#include "dtk/comm/comm.h"
#include "dtk/core/error.h"
#include "dtk/ops/ops.h"
#include "dtk/optim/shampoo.h"

namespace dtk::optim {
namespace {

using shampoo_ref::Vec;
using test_util::from_json;

struct Model {
  std::vector<nn::Param> params;
  std::vector<Shape> shapes;
  std::vector<Vec> values;  // the f64 copies of the initial values
};

Model make_model(const std::vector<std::pair<std::string, Shape>>& specs, uint64_t seed = 1) {
  Model m;
  for (const auto& [name, shape] : specs) {
    const Vec v = shampoo_ref::random_values(static_cast<size_t>(shape_numel(shape)), seed++);
    nn::Param& p = m.params.emplace_back();
    p.name = name, p.value = Tensor::from_doubles(v, shape, DType::f32), p.grad = Tensor::zeros(shape, DType::f32);
    m.shapes.push_back(shape);
    m.values.push_back(v);
  }
  return m;
}

std::vector<Vec> grads_at(const std::vector<Shape>& shapes, int step) {
  std::vector<Vec> g;
  for (size_t i = 0; i < shapes.size(); ++i)
    g.push_back(shampoo_ref::random_values(static_cast<size_t>(shape_numel(shapes[i])), 5000 + 100 * step + i, 0.5));
  return g;
}

void set_grads(Model& m, const std::vector<Vec>& g) {
  for (size_t i = 0; i < m.params.size(); ++i)
    m.params[i].grad.copy_from(Tensor::from_doubles(g[i], m.shapes[i], DType::f32));
}

// The state tensor of that name.
Tensor state_of(Optimizer& opt, const std::string& name) {
  for (const PlacedTensor& t : opt.state())
    if (t.name == name) return t.value;
  ADD_FAILURE() << "no state " << name;
  return {};
}

// max |x - ref| over max |ref - start|: the error relative to how far the run moved.
double rel_err(const std::vector<nn::Param>& ps, const std::vector<Vec>& ref, const std::vector<Vec>& start) {
  double err = 0, moved = 0;
  for (size_t i = 0; i < ps.size(); ++i) {
    const Vec x = ps[i].value.to_doubles();
    for (size_t e = 0; e < x.size(); ++e) {
      err = std::max(err, std::fabs(x[e] - ref[i][e]));
      moved = std::max(moved, std::fabs(ref[i][e] - start[i][e]));
    }
  }
  return err / moved;
}

ShampooConfig every_step_config() {
  ShampooConfig c;
  c.precondition_frequency = 1;
  c.start_preconditioning_step = 1;
  return c;
}

// Reading this JSON as a ShampooConfig is a UsageError that mentions word.
void expect_usage(const nlohmann::json& j, const std::string& word) {
  try {
    from_json<ShampooConfig>(j);
    ADD_FAILURE() << "no error for " << j.dump();
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find(word), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------------------- the reference itself

// Checks of the f64 reference's new parts on their own, before the optimizer is compared with it.

// Eigenvalue-corrected before its first basis (Q = I), without grafting: Adam on every block
// (m, v, bias corrections 1 - beta1^t and 1 - ec_beta2^t, ec_epsilon added to sqrt(v / bc2)).
TEST(ShampooReference, EigenvalueCorrectedBeforeTheFirstBasisIsAdam) {
  ShampooConfig c;
  c.preconditioner = Preconditioner::eigenvalue_corrected;
  c.grafting = Grafting::none;
  c.precondition_frequency = 100;  // no basis in these steps
  c.max_preconditioner_dim = 4;
  c.beta1 = 0.9;
  c.ec_beta2 = 0.99;
  c.ec_epsilon = 1e-8;
  const std::vector<Shape> shapes = {{6, 4}, {5}, {1}, {2, 3, 4}};
  shampoo_ref::Reference ref(c, shapes);
  Model m = make_model({{"a", shapes[0]}, {"b", shapes[1]}, {"c", shapes[2]}, {"d", shapes[3]}});
  std::vector<Vec> want = m.values, adam = m.values, mom, var;
  for (const Vec& v : m.values) mom.push_back(Vec(v.size(), 0.0)), var.push_back(Vec(v.size(), 0.0));
  for (int t = 1; t <= 6; ++t) {
    const auto g = grads_at(shapes, t);
    ref.step(want, g, 0.1);
    for (size_t p = 0; p < g.size(); ++p)
      for (size_t e = 0; e < g[p].size(); ++e) {
        mom[p][e] = 0.9 * mom[p][e] + 0.1 * g[p][e];
        var[p][e] = 0.99 * var[p][e] + 0.01 * g[p][e] * g[p][e];
        const double mh = mom[p][e] / (1 - std::pow(0.9, t)), vh = var[p][e] / (1 - std::pow(0.99, t));
        adam[p][e] -= 0.1 * mh / (std::sqrt(vh) + 1e-8);
      }
  }
  for (size_t p = 0; p < want.size(); ++p)
    for (size_t e = 0; e < want[p].size(); ++e) EXPECT_NEAR(want[p][e], adam[p][e], 1e-12) << p << " " << e;
}

// The eigenvalue-corrected bases: at the first root step, the eigenvectors of F / bc (eigh), or
// one QR iteration from the identity, Q = qr(F / bc + eps I) (qr, Meta's SOAP: not converged),
// columns by ascending diag(Q^T F Q) either way; after it the rotated second moment is positional
// in that basis: one step with beta2 = 0 (V = Gr^2) gives V = (Q_0^T G Q_1)^2.
TEST(ShampooReference, EigenvalueCorrectedBases) {
  for (const RootMethod method : {RootMethod::eigh, RootMethod::qr}) {
    ShampooConfig c;
    c.preconditioner = Preconditioner::eigenvalue_corrected;
    c.root_method = method;
    c.precondition_frequency = 3;
    c.max_preconditioner_dim = 8;
    c.ec_beta2 = 0;
    const Shape shape = {5, 7};
    shampoo_ref::Reference ref(c, {shape});
    std::vector<Vec> values = {Vec(35, 0.0)};
    Vec F0(25, 0.0), F1(49, 0.0);
    Vec g;
    for (int t = 1; t <= 3; ++t) {
      g = grads_at({shape}, t)[0];
      ref.step(values, {g}, 0.1);
      const Vec gt = shampoo_ref::transpose(g, 5, 7);
      const Vec l = shampoo_ref::matmul(g, gt, 5, 7, 5), r = shampoo_ref::matmul(gt, g, 7, 5, 7);
      for (size_t i = 0; i < 25; ++i) F0[i] = 0.95 * F0[i] + 0.05 * l[i];
      for (size_t i = 0; i < 49; ++i) F1[i] = 0.95 * F1[i] + 0.05 * r[i];
      if (t < 3) {
        EXPECT_TRUE(std::all_of(ref.basis(0, 0, 0).begin(), ref.basis(0, 0, 0).end(), [](double x) { return x == 0; }));
      }
    }
    for (size_t i = 0; i < 25; ++i) EXPECT_NEAR(ref.factor(0, 0, 0)[i], F0[i], 1e-15);
    for (const auto& [k, F, n] : {std::tuple{0, F0, 5}, std::tuple{1, F1, 7}}) {
      const Vec& Q = ref.basis(0, 0, size_t(k));
      const Vec B = shampoo_ref::matmul(shampoo_ref::matmul(shampoo_ref::transpose(Q, n, n), F, n, n, n), Q, n, n, n);
      double off = 0;
      for (int i = 0; i < n; ++i)
        for (int j = 0; j < n; ++j)
          if (i != j) off = std::max(off, std::fabs(B[size_t(i * n + j)]));
      if (method == RootMethod::eigh) {
        EXPECT_LT(off, 1e-12) << "factor " << k;
      } else {  // Q spans what qr(A) spans column by column: Q^T A's QR factor, up to column signs
        Vec A = F;
        for (int i = 0; i < n; ++i) A[size_t(i * n + i)] += c.epsilon;
        const Vec Qr = shampoo_ref::orthonormal_columns(A, n);  // Gram-Schmidt of A's columns
        for (int j = 0; j < n; ++j) {  // each column of Q is, up to sign, one of qr(A)'s
          double best = 0;
          for (int i = 0; i < n; ++i) {
            double d = 0;
            for (int r = 0; r < n; ++r) d += Q[size_t(r * n + j)] * Qr[size_t(r * n + i)];
            best = std::max(best, std::fabs(d));
          }
          EXPECT_NEAR(best, 1.0, 1e-9) << "factor " << k << " column " << j;
        }
        EXPECT_GT(off, 1e-6) << "factor " << k << ": one QR iteration does not diagonalise F";
      }
      for (int i = 0; i + 1 < n; ++i) {
        const double x = B[size_t(i * n + i)], y = B[size_t((i + 1) * n + i + 1)];
        EXPECT_LT(x, y) << name_of(method) << " factor " << k << " column " << i;
      }
    }
    const Vec Gr = shampoo_ref::matmul(shampoo_ref::matmul(shampoo_ref::transpose(ref.basis(0, 0, 0), 5, 5), g, 5, 5, 7),
                                       ref.basis(0, 0, 1), 5, 7, 7);
    for (size_t e = 0; e < 35; ++e) EXPECT_NEAR(ref.corrected_second_moment(0, 0)[e], Gr[e] * Gr[e], 1e-12) << name_of(method);
  }
}

// Newton-Schulz's output has the input's singular vectors and singular values in about
// [0.7, 1.2] (Muon's coefficients do not converge to 1 by design); exact is U V^T: orthonormal
// columns (or rows), and M = (U V^T) H with H = (U V^T)^T M symmetric positive semi-definite
// (the polar decomposition). Both on tall, wide, square and rank-deficient blocks.
TEST(ShampooReference, OrthogonalisationByNewtonSchulzAndExactly) {
  uint64_t seed = 300;
  for (const auto& [r, c] : std::vector<std::pair<int, int>>{{16, 16}, {16, 8}, {8, 16}, {6, 36}, {2, 4}, {40, 3}}) {
    const Vec M = shampoo_ref::random_values(size_t(r * c), seed++);
    const Vec E = shampoo_ref::orth_exact(M, r, c), N = shampoo_ref::newton_schulz(M, r, c, 5);
    const int k = std::min(r, c);
    const Vec EtE = r >= c ? shampoo_ref::matmul(shampoo_ref::transpose(E, r, c), E, c, r, c)
                           : shampoo_ref::matmul(E, shampoo_ref::transpose(E, r, c), r, c, r);
    for (int i = 0; i < k; ++i)
      for (int j = 0; j < k; ++j) EXPECT_NEAR(EtE[size_t(i * k + j)], i == j ? 1.0 : 0.0, 1e-12) << r << "x" << c;
    const Vec H = shampoo_ref::matmul(shampoo_ref::transpose(E, r, c), M, c, r, c);  // [c, c]
    Vec w, V;
    shampoo_ref::jacobi_eigh(H, c, w, V);
    EXPECT_GT(w.front(), -1e-10) << r << "x" << c;
    for (int i = 0; i < c; ++i)
      for (int j = 0; j < c; ++j) EXPECT_NEAR(H[size_t(i * c + j)], H[size_t(j * c + i)], 1e-10) << r << "x" << c;
    const Vec s = shampoo_ref::singular_values(N, r, c);
    EXPECT_GT(s.back(), 0.68) << r << "x" << c;
    EXPECT_LT(s.front(), 1.2) << r << "x" << c;
    // The same singular vectors: E^T N = V diag(phi(s)) V^T, symmetric.
    const Vec EN = shampoo_ref::matmul(shampoo_ref::transpose(E, r, c), N, c, r, c);
    for (int i = 0; i < c; ++i)
      for (int j = 0; j < c; ++j) EXPECT_NEAR(EN[size_t(i * c + j)], EN[size_t(j * c + i)], 1e-10) << r << "x" << c;
  }
  // Rank 1: exact keeps the one direction, u v^T / (|u| |v|), also from the f32 rounding of u v^T
  // (whose other singular values, about 1e-8 of the first, are cut).
  const Vec u = {1, 2, 2}, v = {3, 0, 4, 0};  // |u| = 3, |v| = 5
  Vec M(12);
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 4; ++j) M[size_t(i * 4 + j)] = u[size_t(i)] * v[size_t(j)];
  const Vec E = shampoo_ref::orth_exact(M, 3, 4);
  for (size_t e = 0; e < 12; ++e) EXPECT_NEAR(E[e], M[e] / 15, 1e-12);
  const Vec a = shampoo_ref::random_values(24, 5), b = shampoo_ref::random_values(16, 6);
  Vec R(24 * 16);
  for (size_t i = 0; i < 24; ++i)
    for (size_t j = 0; j < 16; ++j) R[i * 16 + j] = static_cast<float>(a[i] * b[j]);
  const Vec s1 = shampoo_ref::singular_values(R, 24, 16);
  EXPECT_GT(s1[1], 1e-10 * s1[0]);  // f32 rounding: not exactly rank 1
  const Vec s2 = shampoo_ref::singular_values(shampoo_ref::orth_exact(R, 24, 16), 24, 16);
  EXPECT_NEAR(s2[0], 1.0, 1e-12);
  EXPECT_LT(s2[1], 1e-12);
}

// The pseudo-inverse root of a rank-deficient factor vanishes on its null space and inverts it
// on its range (p = 2: R F R is the projector onto the range); its cutoff follows the factor
// dtype (n eps).
TEST(ShampooReference, PseudoInverseRoot) {
  const int n = 7;
  const Vec g1 = shampoo_ref::random_values(n, 11), g2 = shampoo_ref::random_values(n, 12), z0 = shampoo_ref::random_values(n, 13);
  Vec F(size_t(n * n));
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) F[size_t(i * n + j)] = g1[size_t(i)] * g1[size_t(j)] + g2[size_t(i)] * g2[size_t(j)];
  bool ok = false;
  const Vec R = shampoo_ref::pseudo_inverse_root(F, n, 2, -1, 0, DType::f32, &ok);
  EXPECT_TRUE(ok);
  // z: z0 less its projection on span(g1, g2), the factor's range.
  Vec X(size_t(n * n), 0.0);
  for (int i = 0; i < n; ++i) {
    X[size_t(i * n)] = g1[size_t(i)];
    X[size_t(i * n + 1)] = g2[size_t(i)];
    for (int j = 2; j < n; ++j) X[size_t(i * n + j)] = i == j ? 1.0 : 0.0;
  }
  const Vec range = shampoo_ref::orthonormal_columns(X, n);  // its first two columns span the range
  Vec z = z0;
  for (int col = 0; col < 2; ++col) {
    double d = 0;
    for (int i = 0; i < n; ++i) d += range[size_t(i * n + col)] * z0[size_t(i)];
    for (int i = 0; i < n; ++i) z[size_t(i)] -= d * range[size_t(i * n + col)];
  }
  EXPECT_LT(shampoo_ref::norm(shampoo_ref::matmul(R, z, n, n, 1)), 1e-10 * shampoo_ref::norm(z));
  const Vec P = shampoo_ref::matmul(shampoo_ref::matmul(R, F, n, n, n), R, n, n, n);
  for (const Vec* g : {&g1, &g2}) {
    const Vec Pg = shampoo_ref::matmul(P, *g, n, n, 1);
    for (int i = 0; i < n; ++i) EXPECT_NEAR(Pg[size_t(i)], (*g)[size_t(i)], 1e-9);
  }
  // An eigenvalue 1e-9 of the largest: kept with f64 factors, cut with f32 ones.
  const Vec D = {1, 0, 0, 0, 1e-9, 0, 0, 0, 2};
  EXPECT_NEAR(shampoo_ref::pseudo_inverse_root(D, 3, 2, -1, 0, DType::f64)[4], 1 / std::sqrt(1e-9), 1e-6);
  EXPECT_EQ(shampoo_ref::pseudo_inverse_root(D, 3, 2, -1, 0, DType::f32)[4], 0.0);
}

// factor_update_every K: the factors after 7 steps with K = 3 are those after 3 steps with K = 1
// fed the gradients of steps 1, 4 and 7, and so are the roots (bias correction by the number of
// updates): the last step (beta1 = 0, no grafting: D = G x_k R_k) moves the weights alike. With
// K = 1, the reference is the one every existing test compares against.
TEST(ShampooReference, FactorUpdateEvery) {
  ShampooConfig c;
  c.grafting = Grafting::none;
  c.beta1 = 0;
  c.max_preconditioner_dim = 8;
  c.epsilon = 1e-3;
  ShampooConfig c3 = c, c1 = c;
  c3.factor_update_every = 3;
  c3.precondition_frequency = 7;  // roots at 7 only
  c1.precondition_frequency = 3;  // roots at 3 only
  const std::vector<Shape> shapes = {{5, 6}, {3, 4, 5}};
  shampoo_ref::Reference r3(c3, shapes), r1(c1, shapes);
  std::vector<Vec> v3 = {Vec(30, 0.0), Vec(60, 0.0)}, v1 = v3;
  std::vector<Vec> last3, last1;
  for (int t = 1; t <= 7; ++t) {
    const auto g = grads_at(shapes, t);
    last3 = v3;
    r3.step(v3, g, 1.0);
    if (t % 3 == 1) {
      last1 = v1;
      r1.step(v1, g, 1.0);
    }
  }
  for (size_t p = 0; p < shapes.size(); ++p) {
    for (size_t k = 0; k < shapes[p].size(); ++k) EXPECT_EQ(r3.factor(p, 0, k), r1.factor(p, 0, k)) << p << " " << k;
    for (size_t e = 0; e < v3[p].size(); ++e) EXPECT_NEAR(v3[p][e] - last3[p][e], v1[p][e] - last1[p][e], 1e-12) << p;
  }
}

// The spectral blocking: [d0, the rest], then split; 1-D and scalars as Shampoo's.
TEST(ShampooReference, SpectralBlocking) {
  auto b = shampoo_ref::spectral_blocking({6, 4, 3, 3}, 16);
  EXPECT_EQ(b.merged, (Shape{6, 36}));
  EXPECT_EQ(b.block_shapes, (std::vector<Shape>{{6, 16}, {6, 16}, {6, 4}}));
  EXPECT_EQ(b.offsets[2], (std::vector<int64_t>{0, 32}));
  b = shampoo_ref::spectral_blocking({2, 4}, 32);  // Shampoo would merge it into a vector of 8
  EXPECT_EQ(b.block_shapes, (std::vector<Shape>{{2, 4}}));
  b = shampoo_ref::spectral_blocking({40, 24}, 16);
  EXPECT_EQ(b.block_shapes, (std::vector<Shape>{{16, 16}, {16, 8}, {16, 16}, {16, 8}, {8, 16}, {8, 8}}));
  EXPECT_EQ(shampoo_ref::spectral_blocking({1, 5, 1, 3}, 16).merged, (Shape{5, 3}));
  EXPECT_EQ(shampoo_ref::spectral_blocking({20}, 16).block_shapes, (std::vector<Shape>{{16}, {4}}));
  EXPECT_TRUE(shampoo_ref::spectral_blocking({1}, 16).block_shapes[0].empty());
  // The optimizer's (shampoo_blocking's matrix view) agrees, size-1 dims anywhere.
  for (const Shape& shape : std::vector<Shape>{{1, 6, 4}, {6, 1, 4}, {6, 4, 1}, {3, 1}, {1, 1, 5}, {40, 24}, {6, 4, 3, 3},
                                              {2000, 3}, {5, 1, 7, 1}, {1}, {17}}) {
    const auto want = shampoo_ref::spectral_blocking(shape, 16);
    const auto got = shampoo_blocking(shape, 16, true);
    EXPECT_EQ(got.merged, want.merged) << shape_str(shape);
    EXPECT_EQ(got.block_shapes, want.block_shapes) << shape_str(shape);
    EXPECT_EQ(got.offsets, want.offsets) << shape_str(shape);
  }
}

// ---------------------------------------------------------------------------- blocking

TEST(Shampoo, BlockingMergesAndSplits) {
  // 4096 x 11008: nothing merges (4096 * 11008 > 1024); 4 x 11 blocks, the last column 768 wide.
  auto b = shampoo_blocking({4096, 11008}, 1024);
  EXPECT_EQ(b.merged, (Shape{4096, 11008}));
  ASSERT_EQ(b.block_shapes.size(), 44u);
  EXPECT_EQ(b.block_shapes[0], (Shape{1024, 1024}));
  EXPECT_EQ(b.block_shapes[10], (Shape{1024, 768}));
  EXPECT_EQ(b.offsets[10], (std::vector<int64_t>{0, 10240}));
  EXPECT_EQ(b.block_shapes[11], (Shape{1024, 1024}));
  EXPECT_EQ(b.offsets[11], (std::vector<int64_t>{1024, 0}));
  EXPECT_EQ(b.block_shapes[43], (Shape{1024, 768}));
  EXPECT_EQ(b.offsets[43], (std::vector<int64_t>{3072, 10240}));
  int full = 0;
  for (const auto& s : b.block_shapes) full += s == Shape{1024, 1024};
  EXPECT_EQ(full, 40);
  // A conv weight 64 x 64 x 3 x 3: 3 * 3 * 64 = 576 merges, 64 * 576 does not: one 64 x 576 block.
  b = shampoo_blocking({64, 64, 3, 3}, 1024);
  EXPECT_EQ(b.merged, (Shape{64, 576}));
  ASSERT_EQ(b.block_shapes.size(), 1u);
  EXPECT_EQ(b.block_shapes[0], (Shape{64, 576}));
  // 16 x 32 = 512 <= 1024: one vector block (order 1).
  b = shampoo_blocking({16, 32}, 1024);
  EXPECT_EQ(b.merged, (Shape{512}));
  ASSERT_EQ(b.block_shapes.size(), 1u);
  EXPECT_EQ(b.block_shapes[0], (Shape{512}));
  // Merging runs from the last dim backwards: 256 * 4 first, then 4 stays alone.
  EXPECT_EQ(shampoo_blocking({4, 256, 4}, 1024).merged, (Shape{4, 1024}));
  // Size-1 dims dropped; a parameter of one element has one block of order 0.
  EXPECT_EQ(shampoo_blocking({1, 5, 1, 3}, 1024).merged, (Shape{15}));
  b = shampoo_blocking({1, 1}, 1024);
  EXPECT_TRUE(b.merged.empty());
  ASSERT_EQ(b.block_shapes.size(), 1u);
  EXPECT_TRUE(b.block_shapes[0].empty());
  // A long vector splits; an empty parameter has no block.
  b = shampoo_blocking({2000}, 1024);
  ASSERT_EQ(b.block_shapes.size(), 2u);
  EXPECT_EQ(b.block_shapes[1], (Shape{976}));
  EXPECT_TRUE(shampoo_blocking({3, 0}, 1024).block_shapes.empty());
  EXPECT_THROW(shampoo_blocking({3}, 0), UsageError);
}

TEST(Shampoo, AssignmentIsGreedyLargestFirst) {
  // 9 (item 1) -> r0, 9 (item 2) -> r1, 5 -> r0 (14), 4 -> r1 (13), 1 -> r1 (14).
  EXPECT_EQ(shampoo_assign({5, 9, 9, 1, 4}, 2), (std::vector<int>{0, 0, 1, 1, 1}));
  EXPECT_EQ(shampoo_assign({3, 3, 3}, 1), (std::vector<int>{0, 0, 0}));
  EXPECT_EQ(shampoo_assign({1, 1}, 4), (std::vector<int>{0, 1}));
}

TEST(Shampoo, StateNamesFollowTheBlocks) {
  auto comm = comm::make_local_communicator();
  ShampooConfig c;
  c.max_preconditioner_dim = 10;
  c.momentum = 0.9;
  Model m = make_model({{"w", {40, 107}}, {"conv", {6, 4, 3, 3}}, {"v", {16, 2}}, {"s", {1}}});
  auto opt = make_shampoo(c, m.params, *comm);
  std::map<std::string, Shape> st;
  for (const PlacedTensor& t : opt->state()) st[t.name] = t.value.shape();
  // 40 x 107 with blocks of 10: 4 x 11 blocks, the last column 7 wide.
  EXPECT_EQ(st.at("shampoo/w/block0/factor0"), (Shape{10, 10}));
  EXPECT_EQ(st.at("shampoo/w/block10/factor1"), (Shape{7, 7}));
  EXPECT_EQ(st.at("shampoo/w/block10/root1"), (Shape{7, 7}));
  EXPECT_EQ(st.at("shampoo/w/block43/graft"), (Shape{10, 7}));
  EXPECT_EQ(st.at("shampoo/w/block43/filtered_grad"), (Shape{10, 7}));
  EXPECT_EQ(st.at("shampoo/w/block43/momentum"), (Shape{10, 7}));
  EXPECT_EQ(st.at("shampoo/w/block43/root_failures"), (Shape{1}));
  EXPECT_FALSE(st.count("shampoo/w/block44/factor0"));
  // 6 x 4 x 3 x 3 with 10: 3 * 3 = 9 merges, 4 * 9 does not: [6, 4, 9], one block of order 3.
  EXPECT_EQ(st.at("shampoo/conv/block0/factor2"), (Shape{9, 9}));
  EXPECT_EQ(st.at("shampoo/conv/block0/graft"), (Shape{6, 4, 9}));
  // 16 x 2 = 32 > 10: [16, 2], blocks [10, 2] and [6, 2].
  EXPECT_EQ(st.at("shampoo/v/block1/factor0"), (Shape{6, 6}));
  // A scalar: no factor, per-element state of shape [1].
  EXPECT_FALSE(st.count("shampoo/s/block0/factor0"));
  EXPECT_EQ(st.at("shampoo/s/block0/graft"), (Shape{1}));
  EXPECT_EQ(st.at("step"), (Shape{1}));
  // One rank: every block owned by rank 0, the step replicated; factors and roots symmetric.
  for (const PlacedTensor& t : opt->state()) {
    EXPECT_EQ(t.placement, t.name == "step" ? Placement::replicated : Placement::owned) << t.name;
    EXPECT_EQ(t.owner, t.name == "step" ? -1 : 0) << t.name;
    const bool sym = t.name.find("/factor") != std::string::npos || t.name.find("/root") != std::string::npos;
    EXPECT_EQ(t.symmetric, sym && t.name.find("root_failures") == std::string::npos) << t.name;
  }
  // Over shards (fsdp-train: rows given) the blocks are still the whole parameters': in a world of
  // one (one shard of all the rows) the same names, shapes, placements and owners as without rows
  // (several shards: ShampooMpi.ShardedParametersEqualReplicated).
  std::vector<Rows> rows;
  for (const Shape& s : m.shapes) rows.push_back({s, {0}, {s[0]}, 0});
  std::map<std::string, std::tuple<Shape, Placement, int>> plain, sharded;
  for (const PlacedTensor& t : opt->state()) plain[t.name] = {t.value.shape(), t.placement, t.owner};
  for (const PlacedTensor& t : make_shampoo(c, m.params, *comm, rows)->state()) sharded[t.name] = {t.value.shape(), t.placement, t.owner};
  EXPECT_EQ(sharded, plain);
  EXPECT_EQ(opt->config().at("name"), "shampoo");
}

// ---------------------------------------------------------------------------- one step, direct

// One step on a 5 x 5 matrix (max_preconditioner_dim 5, so that it stays a matrix): W1 = W0 - lr * P * ||D_adagrad|| / ||P||, P = L^(-1/4) G R^(-1/4),
// L = G G^T, R = G^T G (beta2 = 1, beta1 = 0: the raw gradient), computed here directly in f64.
TEST(Shampoo, OneStepMatchesDirectComputation) {
  auto comm = comm::make_local_communicator();
  for (const std::string graft : {"adagrad", "sgd", "none"}) {
    ShampooConfig c = every_step_config();
    c.beta1 = 0;
    c.beta2 = 1;
    c.grafting = parse_enum<Grafting>(graft, "grafting");
    c.grafting_epsilon = 1e-8;
    c.max_preconditioner_dim = 5;  // 5 * 5 <= 1024 would merge into a vector
    Model m = make_model({{"w", {5, 5}}});
    const Vec g = shampoo_ref::random_values(25, 77);
    set_grads(m, {g});
    auto opt = make_shampoo(c, m.params, *comm);
    const double lr = 0.1;
    opt->step(m.params, lr);

    Vec gt(25);
    for (int i = 0; i < 5; ++i)
      for (int j = 0; j < 5; ++j) gt[size_t(j * 5 + i)] = g[size_t(i * 5 + j)];
    const Vec L = shampoo_ref::matmul(g, gt, 5, 5, 5), R = shampoo_ref::matmul(gt, g, 5, 5, 5);
    const Vec Li = shampoo_ref::inverse_root(L, 5, c.epsilon, 4), Ri = shampoo_ref::inverse_root(R, 5, c.epsilon, 4);
    const Vec P = shampoo_ref::matmul(shampoo_ref::matmul(Li, g, 5, 5, 5), Ri, 5, 5, 5);
    Vec D = g;
    if (graft == "adagrad")
      for (size_t e = 0; e < 25; ++e) D[e] = g[e] / (std::fabs(g[e]) + 1e-8);
    const double s = graft == "none" ? 1.0 : shampoo_ref::norm(D) / shampoo_ref::norm(P);
    Vec want(25);
    for (size_t e = 0; e < 25; ++e) want[e] = m.values[0][e] - lr * s * P[e];
    EXPECT_LT(rel_err(m.params, {want}, m.values), 1e-5) << graft;
  }
}

// A vector (order 1: (g g^T + eps I)^(-1/2) g) and an order-3 block over several steps, each
// against the reference; eps large enough that the rank-deficient early factors are well posed
// in f32.
TEST(Shampoo, VectorAndOrder3MatchReference) {
  auto comm = comm::make_local_communicator();
  ShampooConfig c = every_step_config();
  c.epsilon = 1e-3;
  c.max_preconditioner_dim = 6;  // [3, 4, 5]: 4 * 5 = 20 > 6, so nothing merges
  Model m = make_model({{"v", {6}}, {"t", {3, 4, 5}}});
  EXPECT_EQ(shampoo_blocking({3, 4, 5}, 6).merged, (Shape{3, 4, 5}));
  auto opt = make_shampoo(c, m.params, *comm);
  shampoo_ref::Reference ref(c, m.shapes);
  std::vector<Vec> want = m.values;
  for (int s = 0; s < 4; ++s) {
    const auto g = grads_at(m.shapes, s);
    set_grads(m, g);
    opt->step(m.params, 0.05);
    ref.step(want, g, 0.05);
  }
  EXPECT_LT(rel_err(m.params, want, m.values), 2e-5);
}

// ---------------------------------------------------------------------------- every feature

struct Case {
  std::string label;
  void (*tweak)(ShampooConfig&);
  double tol = 1e-5;  // relative to the distance moved; f32 gives about 1e-6
};

TEST(Shampoo, SeveralStepsMatchReference) {
  auto comm = comm::make_local_communicator();
  const std::vector<Case> cases = {
      {"adam grafting, momentum, nesterov, wd", [](ShampooConfig&) {}},
      {"adagrad grafting, beta2 1", [](ShampooConfig& c) { c.grafting = Grafting::adagrad; c.beta2 = 1; }},
      {"rmsprop grafting, no bias correction", [](ShampooConfig& c) { c.grafting = Grafting::rmsprop; c.use_bias_correction = false; }},
      {"sgd grafting, beta1 0", [](ShampooConfig& c) { c.grafting = Grafting::sgd; c.beta1 = 0; }},
      // Without grafting the size of P follows the factors' small eigenvalues, which amplify
      // the f32 rounding of the factors (about 5e-5 here; 5e-7 with f64 factors).
      {"no grafting, plain momentum", [](ShampooConfig& c) { c.grafting = Grafting::none; c.nesterov = false; }, 2e-4},
      {"no grafting, f64 factors", [](ShampooConfig& c) { c.grafting = Grafting::none; c.factor_dtype = DType::f64; }},
      {"f64 factors", [](ShampooConfig& c) { c.factor_dtype = DType::f64; }},
      {"newton roots", [](ShampooConfig& c) { c.root_method = RootMethod::newton; c.newton_tolerance = 1e-10; c.newton_max_iters = 200; }},
      // One Newton iteration converges nowhere: every root fails in f32 and is retried by an f64
      // eigendecomposition (compute_roots' fallback), which gives the reference's roots.
      {"newton roots that fail, retried in f64", [](ShampooConfig& c) {
         c.root_method = RootMethod::newton; c.newton_tolerance = 1e-12; c.newton_max_iters = 1; }},
      {"exponent override 2", [](ShampooConfig& c) { c.exponent_override = 2; }},
      {"no momentum, no wd", [](ShampooConfig& c) { c.momentum = 0; c.nesterov = false; c.weight_decay = 0; }},
      // Weight decay as the reference applies it: decoupled into the direction before momentum
      // (so Nesterov scales it by 1 + mu), or L2 into the gradient before everything.
      {"wd 0.1 with momentum", [](ShampooConfig& c) { c.weight_decay = 0.1; c.nesterov = false; }},
      {"wd 0.1 with nesterov", [](ShampooConfig& c) { c.weight_decay = 0.1; }},
      {"l2 wd 0.1 with nesterov", [](ShampooConfig& c) { c.weight_decay = 0.1; c.weight_decay_type = WeightDecayType::l2; }},
      {"l2 wd 0.1, no momentum, rmsprop", [](ShampooConfig& c) {
         c.weight_decay = 0.1; c.weight_decay_type = WeightDecayType::l2; c.momentum = 0; c.nesterov = false; c.grafting = Grafting::rmsprop; }},
      {"root spread 2", [](ShampooConfig& c) { c.root_spread = 2; }},
      // Warm-started eigendecompositions: a full eigh at step 6 (the first root, when the factors
      // have full rank: a degenerate eigenvalue's eigenvectors are any basis of its space, and the
      // next iteration starts from whichever the solver gave), QR iterations from it at 8 and 10.
      {"qr roots, 1 iteration, tolerance 0.01", [](ShampooConfig& c) { c.root_method = RootMethod::qr; c.start_preconditioning_step = 6; }},
      {"qr roots, 2 iterations, tolerance 0", [](ShampooConfig& c) {
         c.root_method = RootMethod::qr; c.start_preconditioning_step = 6; c.qr_max_iterations = 2; c.qr_tolerance = 0; }},
      {"qr roots, f64 factors", [](ShampooConfig& c) {
         c.root_method = RootMethod::qr; c.start_preconditioning_step = 6; c.factor_dtype = DType::f64; c.qr_tolerance = 0; }},
  };
  for (const Case& k : cases) {
    ShampooConfig c;
    c.max_preconditioner_dim = 5;
    c.precondition_frequency = 2;
    c.start_preconditioning_step = 2;  // step 1: grafting alone; roots at 2, 4, ..., 10
    c.epsilon = 1e-3;
    c.beta1 = 0.9;
    c.beta2 = 0.95;
    c.grafting = Grafting::adam;
    c.grafting_beta2 = 0.9;
    c.momentum = 0.5;
    c.nesterov = true;
    c.weight_decay = 0.01;
    k.tweak(c);
    // [6, 4]: blocks [5, 4], [1, 4]; [8]: [5], [3]; [3, 4, 5]: one order-3 block; [12, 7]: 3 x 2
    // blocks; [1]: order 0.
    Model m = make_model({{"a", {6, 4}}, {"b", {8}}, {"c", {3, 4, 5}}, {"d", {12, 7}}, {"e", {1}}});
    auto opt = make_shampoo(c, m.params, *comm);
    shampoo_ref::Reference ref(c, m.shapes);
    std::vector<Vec> want = m.values;
    for (int s = 0; s < 10; ++s) {
      const auto g = grads_at(m.shapes, s);
      set_grads(m, g);
      opt->step(m.params, 0.05);
      ref.step(want, g, 0.05);
    }
    EXPECT_LT(rel_err(m.params, want, m.values), k.tol) << k.label;
  }
}

// The roots are recomputed at the start step and then at every multiple of the frequency after
// it (the reference's rule), whether or not the start is a multiple: frequency 2 and start 3
// give 3, 4, 6, 8; frequency 3 and start 4 give 4, 6, 9. Checked on the state (a root changes
// exactly on those steps) and on the weights against the float64 reference.
TEST(Shampoo, RootStepsFollowTheReference) {
  auto comm = comm::make_local_communicator();
  struct Rule {
    int64_t frequency, start;
    std::vector<int64_t> roots;  // steps 1..9 that recompute
  };
  for (const Rule& r : std::vector<Rule>{{2, 3, {3, 4, 6, 8}}, {3, 4, {4, 6, 9}}, {2, 2, {2, 4, 6, 8}}, {3, 3, {3, 6, 9}}}) {
    ShampooConfig c;
    c.max_preconditioner_dim = 5;
    c.precondition_frequency = r.frequency;
    c.start_preconditioning_step = r.start;
    c.epsilon = 1e-3;
    Model m = make_model({{"a", {6, 4}}, {"c", {3, 4, 5}}});
    auto opt = make_shampoo(c, m.params, *comm);
    shampoo_ref::Reference ref(c, m.shapes);
    std::vector<Vec> want = m.values;
    std::vector<int64_t> changed;
    auto root = [&] { return state_of(*opt, "shampoo/a/block0/root0").to_doubles(); };
    for (int64_t t = 1; t <= 9; ++t) {
      const auto before = root();
      const auto g = grads_at(m.shapes, static_cast<int>(t));
      set_grads(m, g);
      opt->step(m.params, 0.05);
      ref.step(want, g, 0.05);
      if (root() != before) changed.push_back(t);
    }
    EXPECT_EQ(changed, r.roots) << "frequency " << r.frequency << ", start " << r.start;
    EXPECT_LT(rel_err(m.params, want, m.values), 2e-5) << "frequency " << r.frequency << ", start " << r.start;
  }
  // A start before the frequency is refused, as by the reference.
  ShampooConfig bad;
  bad.precondition_frequency = 4;
  bad.start_preconditioning_step = 2;
  EXPECT_THROW(bad.validate(), UsageError);
}

// root_spread: phase j recomputes at the start step and then at the steps t > start with
// (t - j floor(f / S)) a multiple of f. Frequency 4, spread 2, start 4: phase 0 at 4 and 8,
// phase 1 at 4, 6 and 10; frequency 5, spread 3 (shift 1), start 5: phase 2 at 5, 7 and 12.
TEST(Shampoo, RootSpreadSchedule) {
  auto comm = comm::make_local_communicator();
  struct Rule {
    int64_t frequency, spread;
    std::vector<std::vector<int64_t>> roots;  // per phase: the steps 1..12 that recompute
  };
  for (const Rule& r : std::vector<Rule>{{4, 2, {{4, 8, 12}, {4, 6, 10}}}, {5, 3, {{5, 10}, {5, 6, 11}, {5, 7, 12}}}}) {
    ShampooConfig c;
    c.max_preconditioner_dim = 4;
    c.precondition_frequency = r.frequency;
    c.root_spread = r.spread;
    c.epsilon = 1e-3;
    // Six [4, 4] blocks: equal root costs, so the phases alternate 0, 1, (2,) ... in block order.
    Model m = make_model({{"a", {12, 8}}});
    const std::vector<int> phases = shampoo_root_phases(std::vector<Shape>(6, Shape{4, 4}), r.spread);
    auto opt = make_shampoo(c, m.params, *comm);
    shampoo_ref::Reference ref(c, m.shapes);
    std::vector<Vec> want = m.values;
    auto roots = [&] {
      std::vector<Vec> out;
      for (int i = 0; i < 6; ++i) out.push_back(state_of(*opt, "shampoo/a/block" + std::to_string(i) + "/root0").to_doubles());
      return out;
    };
    std::vector<std::vector<int64_t>> changed(static_cast<size_t>(r.spread));
    for (int64_t t = 1; t <= 12; ++t) {
      const auto before = roots();
      const auto g = grads_at(m.shapes, static_cast<int>(t));
      set_grads(m, g);
      opt->step(m.params, 0.05);
      ref.step(want, g, 0.05);
      const auto after = roots();
      std::vector<char> phase_changed(static_cast<size_t>(r.spread), 0);
      for (size_t i = 0; i < 6; ++i)
        if (after[i] != before[i]) phase_changed[static_cast<size_t>(phases[i])] = 1;
      for (int64_t j = 0; j < r.spread; ++j)
        if (phase_changed[static_cast<size_t>(j)]) changed[static_cast<size_t>(j)].push_back(t);
    }
    EXPECT_EQ(changed, r.roots) << "frequency " << r.frequency << ", spread " << r.spread;
    EXPECT_LT(rel_err(m.params, want, m.values), 2e-5) << "frequency " << r.frequency << ", spread " << r.spread;
  }
  ShampooConfig bad;
  bad.precondition_frequency = 4;
  bad.root_spread = 5;
  EXPECT_THROW(bad.validate(), UsageError);
}

// The warm-started eigendecomposition against the full one, measured on a factor that drifts as
// in training: F = beta2 F + (1 - beta2) G G^T, G = (a fixed matrix with a decaying spectrum) +
// noise, roots every 10 steps. dtk's qr roots (default: 1 iteration, tolerance 0.01) against its
// eigh roots, relative Frobenius error of the inverse root; and, in the float64 reference, the
// columns kept in descending order (dtk) against ascending (the reference implementation).
TEST(Shampoo, QrRootAccuracy) {
  auto comm = comm::make_local_communicator();
  const int64_t m = 24, n = 40;
  ShampooConfig c;
  c.max_preconditioner_dim = 64;
  c.precondition_frequency = 10;
  c.epsilon = 1e-6;
  c.beta2 = 0.95;
  c.grafting = Grafting::none;
  Model a = make_model({{"w", {m, n}}}), b = make_model({{"w", {m, n}}});
  ShampooConfig cq = c;
  cq.root_method = RootMethod::qr;
  auto eigh = make_shampoo(c, a.params, *comm);
  auto qr = make_shampoo(cq, b.params, *comm);
  // base = U diag(s) W^T with s_i = 0.7^i: condition numbers up to 1e7 in G G^T.
  std::mt19937_64 gen(7);
  std::normal_distribution<double> nd(0.0, 1.0);
  Vec base(static_cast<size_t>(m * n), 0.0);
  for (int64_t k = 0; k < m; ++k) {
    Vec u(static_cast<size_t>(m)), w(static_cast<size_t>(n));
    for (double& x : u) x = nd(gen) / std::sqrt(double(m));
    for (double& x : w) x = nd(gen) / std::sqrt(double(n));
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) base[static_cast<size_t>(i * n + j)] += std::pow(0.7, double(k)) * u[size_t(i)] * w[size_t(j)];
  }
  auto rel = [](const Vec& x, const Vec& y) {
    double d = 0, s = 0;
    for (size_t i = 0; i < x.size(); ++i) d += (x[i] - y[i]) * (x[i] - y[i]), s += y[i] * y[i];
    return std::sqrt(d / s);
  };
  // The float64 reference's two orders on the same factors.
  Vec F0(static_cast<size_t>(m * m), 0.0), Qd(F0.size(), 0.0), Qa(F0.size(), 0.0);
  double worst_dtk = 0, worst_desc = 0, worst_asc = 0;
  for (int t = 1; t <= 100; ++t) {
    Vec g = base;
    for (double& x : g) x += 0.02 * nd(gen);
    for (double& x : g) x = static_cast<double>(static_cast<float>(x));
    set_grads(a, {g});
    set_grads(b, {g});
    eigh->step(a.params, 0.0);
    qr->step(b.params, 0.0);
    const Vec gg = shampoo_ref::matmul(g, [&] {
      Vec gt(g.size());
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) gt[size_t(j * m + i)] = g[size_t(i * n + j)];
      return gt;
    }(), int(m), int(n), int(m));
    for (size_t i = 0; i < F0.size(); ++i) F0[i] = 0.95 * F0[i] + 0.05 * gg[i];
    if (t % 10 != 0) continue;
    const std::string r0 = "shampoo/w/block0/root0";
    const double e = rel(state_of(*qr, r0).to_doubles(), state_of(*eigh, r0).to_doubles());
    Vec Fc = F0;
    for (double& x : Fc) x /= 1 - std::pow(0.95, double(t));
    const Vec exact = shampoo_ref::inverse_root(Fc, int(m), c.epsilon, 4.0);
    const double ed = rel(shampoo_ref::qr_root(Fc, int(m), Qd, c.epsilon, 4.0, 1, 0.01, true), exact);
    const double ea = rel(shampoo_ref::qr_root(Fc, int(m), Qa, c.epsilon, 4.0, 1, 0.01, false), exact);
    std::printf("step %3d: root error dtk qr %.2e | f64: descending %.2e, ascending %.2e\n", t, e, ed, ea);
    worst_dtk = std::max(worst_dtk, e);
    worst_desc = std::max(worst_desc, ed);
    worst_asc = std::max(worst_asc, ea);
  }
  // Measured: dtk 2.3e-2 to 3.0e-2 (as the f64 descending order); ascending 0.16 to 0.29.
  EXPECT_LT(worst_dtk, 0.05);
  EXPECT_LT(3 * worst_desc, worst_asc);
}

TEST(Shampoo, Bf16CommunicationStaysClose) {
  auto comm = comm::make_local_communicator();
  ShampooConfig c = every_step_config();
  c.epsilon = 1e-3;
  Model a = make_model({{"w", {7, 9}}}), b = make_model({{"w", {7, 9}}});
  c.communication_dtype = DType::bf16;
  auto oa = make_shampoo(c, a.params, *comm);
  c.communication_dtype = DType::f32;
  auto ob = make_shampoo(c, b.params, *comm);
  for (int s = 0; s < 3; ++s) {
    const auto g = grads_at(a.shapes, s);
    set_grads(a, g);
    set_grads(b, g);
    oa->step(a.params, 0.1);
    ob->step(b.params, 0.1);
  }
  const std::vector<Vec> fb = {b.params[0].value.to_doubles()};
  const double e = rel_err(a.params, fb, a.values);
  EXPECT_LT(e, 1e-2);
  EXPECT_GT(e, 0.0);  // the directions were rounded
}

// ---------------------------------------------------------------------------- failures

TEST(Shampoo, NonFiniteFactorIsAnErrorNamingTheParameter) {
  auto comm = comm::make_local_communicator();
  for (double bad : {NAN, INFINITY}) {
    ShampooConfig c = every_step_config();
    Model m = make_model({{"ok", {3, 3}}, {"layers.3.feed_forward.w2.weight", {4, 6}}});
    auto opt = make_shampoo(c, m.params, *comm);
    auto g = grads_at(m.shapes, 0);
    g[1][5] = bad;
    set_grads(m, g);
    try {
      opt->step(m.params, 0.1);
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("layers.3.feed_forward.w2.weight"), std::string::npos) << e.what();
    }
  }
}

// ---------------------------------------------------------------------------- state

// ---------------------------------------------------------------------------- the family

// Every shape class, blocks of at most 16 (Shampoo's blocking; spectral's in brackets):
//   v    [2, 4]        a merged vector [8]                    ([2, 4], one matrix block)
//   w    [40, 24]      split: [16, 16] x 2, [16, 8] x 2, [8, 16], [8, 8]   (the same)
//   sq   [12, 12]      one square block
//   conv [6, 4, 3, 3]  [6, 4, 9], one order-3 block           ([6, 36]: [6, 16] x 2, [6, 4])
//   bias [5]           a vector
//   s    [1]           a scalar (order 0)
const std::vector<std::pair<std::string, Shape>> kFamilySpecs = {
    {"v", {2, 4}}, {"w", {40, 24}}, {"sq", {12, 12}}, {"conv", {6, 4, 3, 3}}, {"bias", {5}}, {"s", {1}}};

struct FamilyCase {
  std::string label;
  void (*tweak)(ShampooConfig&);
  double tol;         // max error over the distance moved (rel_err); each case says why
  int steps = 16;
};

// Runs the optimizer (f32) and the f64 reference side by side; returns rel_err.
double family_error(const ShampooConfig& c, int steps, const std::vector<std::pair<std::string, Shape>>& specs = kFamilySpecs) {
  auto comm = comm::make_local_communicator();
  Model m = make_model(specs);
  std::vector<std::string> names;
  for (const auto& sp : specs) names.push_back(sp.first);
  auto opt = make_shampoo(c, m.params, *comm);
  shampoo_ref::Reference ref(c, m.shapes, names);
  std::vector<Vec> want = m.values;
  for (int s = 0; s < steps; ++s) {
    const auto g = grads_at(m.shapes, s);
    set_grads(m, g);
    opt->step(m.params, 0.05);
    ref.step(want, g, 0.05);
  }
  return rel_err(m.params, want, m.values);
}

// The base of the family cases: blocks of 16; bases/roots at 10, 12 and 15 of 16 steps (start 10:
// the eigenvalue-corrected bases need factors of full rank, 8 steps for the vector [8]: the
// eigenvectors of a zero eigenvalue are any basis of its space, and the corrected second moment
// is positional in it); adam grafting, beta1 0.9, momentum 0.5 with Nesterov, decoupled wd 0.01.
ShampooConfig family_config() {
  ShampooConfig c;
  c.max_preconditioner_dim = 16;
  c.precondition_frequency = 3;
  c.start_preconditioning_step = 10;
  c.epsilon = 1e-3;
  c.beta1 = 0.9;
  c.beta2 = 0.95;
  c.grafting = Grafting::adam;
  c.grafting_beta2 = 0.9;
  c.momentum = 0.5;
  c.nesterov = true;
  c.weight_decay = 0.01;
  return c;
}

// Each case's config (family_config, tweaked) run by error(config, steps), printed and held to its tolerance.
void expect_cases(const std::vector<FamilyCase>& cases, const std::function<double(const ShampooConfig&, int)>& error) {
  for (const FamilyCase& k : cases) {
    ShampooConfig c = family_config();
    k.tweak(c);
    const double e = error(c, k.steps);
    std::printf("%-60s %.2e\n", k.label.c_str(), e);
    EXPECT_LT(e, k.tol) << k.label;
  }
}

void ec(ShampooConfig& c) { c.preconditioner = Preconditioner::eigenvalue_corrected; }
void dion(ShampooConfig& c) {
  c.preconditioner = Preconditioner::dion;
  c.precondition_frequency = 100;
  c.start_preconditioning_step = -1;
  c.momentum = 0;  // Dion's buffer is its momentum
  c.nesterov = false;
}
void spectral(ShampooConfig& c) {
  c.preconditioner = Preconditioner::spectral;
  c.precondition_frequency = 100;  // spectral takes no root schedule
  c.start_preconditioning_step = -1;
}

// Tolerances: the f32 optimizer follows the f64 reference to about 1e-6 of the distance moved
// (SeveralStepsMatchReference). Eigenvalue-corrected: the bases are eigenvectors of f32 factors,
// off by about eps_f32 ||F|| / gap, and the rotated second moment divides by the smallest
// rotated entries; without grafting the direction's size follows them too: measured 6e-7 to
// 2.2e-6. Spectral: Newton-Schulz is a polynomial (f32 rounding only), exact is U V^T in f64 of
// an f32 block: 4.5e-7 to 1.6e-6. Pseudo-inverse: 4.9e-7 to 1.2e-6; factor updates every K:
// 6e-7 to 3.5e-6; diagonal parameters 6e-7. The tolerance, 1e-5, is about 3x the worst.
TEST(Shampoo, FamilyMatchesReference) {
  const std::vector<FamilyCase> cases = {
      // eigenvalue-corrected
      {"ec eigh, adam grafting, nesterov, wd", [](ShampooConfig& c) { ec(c); }, 1e-5},
      {"ec eigh, no grafting, beta1 0", [](ShampooConfig& c) { ec(c); c.grafting = Grafting::none; c.beta1 = 0; c.ec_epsilon = 1e-6; }, 1e-5},
      {"ec eigh, no grafting, beta1 0.9, plain momentum", [](ShampooConfig& c) {
         ec(c); c.grafting = Grafting::none; c.nesterov = false; }, 1e-5},
      {"ec eigh, l2 wd 0.1, ec_beta2 0.99, ec_epsilon 1e-6", [](ShampooConfig& c) {
         ec(c); c.weight_decay = 0.1; c.weight_decay_type = WeightDecayType::l2; c.ec_beta2 = 0.99; c.ec_epsilon = 1e-6; }, 1e-5},
      {"ec eigh, ec_beta2 1, no bias correction", [](ShampooConfig& c) { ec(c); c.ec_beta2 = 1; c.use_bias_correction = false; }, 1e-5},
      {"ec eigh, beta2 1 (factor sums)", [](ShampooConfig& c) { ec(c); c.beta2 = 1; }, 1e-5},
      {"ec eigh, f64 factors", [](ShampooConfig& c) { ec(c); c.factor_dtype = DType::f64; }, 1e-5},
      {"ec qr (Meta's SOAP: 1 iteration, tolerance 0, from I)", [](ShampooConfig& c) { ec(c); c.root_method = RootMethod::qr; }, 1e-5},
      {"ec qr, f64 factors and bases", [](ShampooConfig& c) {
         ec(c); c.root_method = RootMethod::qr; c.factor_dtype = DType::f64; c.basis_dtype = DType::f64; }, 1e-5},
      {"ec eigh, f64 bases", [](ShampooConfig& c) { ec(c); c.basis_dtype = DType::f64; }, 1e-5},
      {"ec qr, 2 iterations, tolerance 0, no grafting", [](ShampooConfig& c) {
         ec(c); c.root_method = RootMethod::qr; c.qr_max_iterations = 2; c.qr_tolerance = 0; c.grafting = Grafting::none; }, 1e-5},
      {"ec eigh, root spread 2", [](ShampooConfig& c) { ec(c); c.root_spread = 2; }, 1e-5},
      // 8 factor updates (1, 4, ..., 22) before the first basis at 25: full rank.
      {"ec eigh, factor update every 3", [](ShampooConfig& c) { ec(c); c.factor_update_every = 3; c.start_preconditioning_step = 25; }, 1e-5, 31},
      {"ec qr, factor update every 3, root spread 2, f64 bases", [](ShampooConfig& c) {
         ec(c); c.root_method = RootMethod::qr; c.factor_update_every = 3; c.root_spread = 2; c.start_preconditioning_step = 12;
         c.basis_dtype = DType::f64; }, 1e-5, 31},
      // spectral
      {"spectral newton-schulz, adam grafting", [](ShampooConfig& c) { spectral(c); }, 1e-5},
      {"spectral newton-schulz, no grafting, beta1 0", [](ShampooConfig& c) { spectral(c); c.grafting = Grafting::none; c.beta1 = 0; }, 1e-5},
      {"spectral newton-schulz, no grafting, rms scale, l2 wd", [](ShampooConfig& c) {
         spectral(c); c.grafting = Grafting::none; c.spectral_scale = SpectralScale::rms; c.weight_decay = 0.1;
         c.weight_decay_type = WeightDecayType::l2; }, 1e-5},
      {"spectral newton-schulz 3 steps, frequency 1, no scale", [](ShampooConfig& c) {
         spectral(c); c.precondition_frequency = 1; c.newton_schulz_steps = 3; c.spectral_scale = SpectralScale::none; }, 1e-5},
      {"spectral exact, adam grafting", [](ShampooConfig& c) { spectral(c); c.spectral_method = SpectralMethod::exact; }, 1e-5},
      {"spectral exact, no grafting, plain momentum", [](ShampooConfig& c) {
         spectral(c); c.spectral_method = SpectralMethod::exact; c.grafting = Grafting::none; c.nesterov = false; }, 1e-5},
      // pseudo-inverse roots: from step 2 on, of rank-deficient factors (the vectors' rank grows
      // by one a step): the root vanishes on their null spaces, whichever basis a solver picks.
      {"pseudo-inverse, start 3, adam grafting", [](ShampooConfig& c) {
         c.root_method = RootMethod::pseudo_inverse; c.epsilon = 0; c.start_preconditioning_step = 3; }, 1e-5},
      {"pseudo-inverse, rtol 1e-4, atol 1e-6, f64 factors", [](ShampooConfig& c) {
         c.root_method = RootMethod::pseudo_inverse; c.epsilon = 0; c.rank_rtol = 1e-4; c.rank_atol = 1e-6;
         c.factor_dtype = DType::f64; c.start_preconditioning_step = 3; }, 1e-5},
      {"pseudo-inverse, full rank, no grafting", [](ShampooConfig& c) {
         c.root_method = RootMethod::pseudo_inverse; c.epsilon = 1e-12; c.grafting = Grafting::none; }, 1e-5},
      // factor updates every K (root preconditioner)
      {"roots, factor update every 3", [](ShampooConfig& c) { c.factor_update_every = 3; }, 1e-5},
      // Rank-deficient factors at the first root (5 updates of the vector [8] by step 10): the
      // null space's eigenvalues are eps plus the f32 rounding of the sum (beta2 1), amplified
      // by eps^(-1/2): 1.6e-5 (3.7e-7 with f64 factors, 4.7e-7 with K = 1).
      {"roots, factor update every 2, beta2 1, l2 wd", [](ShampooConfig& c) {
         c.factor_update_every = 2; c.beta2 = 1; c.weight_decay = 0.1; c.weight_decay_type = WeightDecayType::l2; }, 5e-5},
      {"roots, factor update every 4, no bias correction, beta1 0", [](ShampooConfig& c) {
         c.factor_update_every = 4; c.use_bias_correction = false; c.beta1 = 0; }, 1e-5},
      // diagonal parameters: the grafting direction (Mh without grafting), no factors
      // root_spread with diagonal parameters: their blocks have no root cost (as scalars).
      {"roots, root spread 3, diagonal conv and w", [](ShampooConfig& c) { c.root_spread = 3; c.diagonal_params = {"conv", "w"}; }, 1e-5},
      {"ec, root spread 3, diagonal v and sq", [](ShampooConfig& c) { ec(c); c.root_spread = 3; c.diagonal_params = {"v", "sq"}; }, 1e-5},
      {"roots, diagonal conv and bias", [](ShampooConfig& c) { c.diagonal_params = {"conv", "bias"}; }, 1e-5},
      {"ec, diagonal w", [](ShampooConfig& c) { ec(c); c.diagonal_params = {"w"}; }, 1e-5},
      {"spectral, diagonal v and sq", [](ShampooConfig& c) { spectral(c); c.diagonal_params = {"v", "sq"}; }, 1e-5},
      {"spectral, diagonal conv, no grafting", [](ShampooConfig& c) {
         spectral(c); c.diagonal_params = {"conv"}; c.grafting = Grafting::none; }, 1e-5},
      // Muon as Dion's paper runs it: the matrices ungrafted (fan scale), Adam on conv and vectors
      {"spectral, grafting scope diagonal, diagonal conv, fan scale", [](ShampooConfig& c) {
         spectral(c); c.diagonal_params = {"conv"}; c.grafting_scope = GraftingScope::diagonal;
         c.spectral_scale = SpectralScale::fan; }, 1e-5},
      {"roots, grafting scope diagonal, diagonal w", [](ShampooConfig& c) {
         c.diagonal_params = {"w"}; c.grafting_scope = GraftingScope::diagonal; }, 1e-5},
  };
  expect_cases(cases, [](const ShampooConfig& c, int steps) { return family_error(c, steps); });
}

// Dion against the f64 re-derivation (tests/common/dion_reference.h) over the family's
// parameters: the matrices v [2, 4] and conv [6, 36] transposed (m < n), w [40, 24] and sq
// [12, 12] not; bias and s, and the parameters diagonal_params names, take the grafting direction
// (shampoo_reference.h). The reference starts from dtk's initial Q (a random draw). Measured: 2.0e-6
// to 9.7e-6 of the distance moved (absolute 2.5e-7 to 3.5e-6 on weights of about 1 to 3: the f32
// rounding of the weights themselves over the steps; Dion's steps, of norm sqrt(r) lr s per matrix,
// move each weight less than grafted Adam's do, so the ratio is larger than the family's).
double dion_error(const ShampooConfig& c, int steps, bool zero_w = false) {
  auto comm = comm::make_local_communicator();
  Model m = make_model(kFamilySpecs);
  std::vector<std::string> names;
  for (const auto& sp : kFamilySpecs) names.push_back(sp.first);
  auto opt = make_shampoo(c, m.params, *comm);
  shampoo_ref::Reference ref(c, m.shapes, names);  // dion: every block diagonal
  std::map<size_t, dion_ref::Matrix> mats;
  for (size_t i = 0; i < names.size(); ++i) {
    const Shape& s = m.shapes[i];
    bool diagonal = false;
    for (const std::string& d : c.diagonal_params) diagonal = diagonal || names[i].find(d) != std::string::npos;
    int big = 0;
    for (int64_t d : s) big += d > 1;
    if (diagonal || big < 2) continue;
    const int rows = int(s[0]), cols = int(shape_numel(s) / s[0]);
    const int k = std::min(rows, cols);
    const int r = c.dion_rank > 0 ? std::min<int>(int(c.dion_rank), k) : std::min(k, int(std::ceil(c.dion_rank_fraction * k - 1e-9)));
    const double scale = c.spectral_scale == SpectralScale::muon ? std::sqrt(std::max(1.0, double(rows) / cols))
                         : c.spectral_scale == SpectralScale::none ? 1.0
                                                                     : std::sqrt(double(rows) / cols);
    mats.emplace(i, dion_ref::Matrix(rows, cols, r, state_of(*opt, "dion/" + names[i] + "/q").to_doubles(), c.beta1, scale));
  }
  EXPECT_FALSE(mats.empty());
  std::vector<Vec> want = m.values;
  for (int s = 0; s < steps; ++s) {
    auto g = grads_at(m.shapes, s);
    if (zero_w) std::fill(g[1].begin(), g[1].end(), 0.0);
    set_grads(m, g);
    opt->step(m.params, 0.05);
    std::vector<Vec> before = want;
    ref.step(want, g, 0.05);
    for (auto& [i, mat] : mats) {
      want[i] = before[i];
      mat.step(want[i], {g[i]}, 0.05, c.weight_decay, c.weight_decay_type == WeightDecayType::decoupled);
    }
  }
  for (auto& [i, mat] : mats) {  // the buffer too
    const Vec got = state_of(*opt, "dion/" + names[i] + "/momentum").to_doubles(), w = mat.momentum();
    double e = 0, big = 0;
    for (size_t j = 0; j < w.size(); ++j) e = std::max(e, std::fabs(got[j] - w[j])), big = std::max(big, std::fabs(w[j]));
    EXPECT_LT(e, 1e-5 * std::max(big, 1.0)) << names[i];  // full rank, beta1 0: M is rounding alone
  }
  return rel_err(m.params, want, m.values);
}

TEST(Shampoo, DionMatchesReference) {
  const std::vector<FamilyCase> cases = {
      {"dion 1/4, adam grafting, decoupled wd", [](ShampooConfig& c) { dion(c); }, 1e-5},
      {"dion rank 1, beta1 0.5, l2 wd 0.1, muon scale", [](ShampooConfig& c) {
         dion(c); c.dion_rank = 1; c.beta1 = 0.5; c.weight_decay = 0.1; c.weight_decay_type = WeightDecayType::l2;
         c.spectral_scale = SpectralScale::muon; }, 1e-5},
      {"dion full rank, no grafting, beta1 0", [](ShampooConfig& c) {
         dion(c); c.dion_rank_fraction = 1; c.grafting = Grafting::none; c.beta1 = 0; }, 2e-5},
      {"dion 1/2, diagonal conv, gradients sync", [](ShampooConfig& c) {
         dion(c); c.dion_rank_fraction = 0.5; c.diagonal_params = {"conv"}; c.dion_sync = DionSync::gradients; }, 1e-5},
      {"dion 1/4, 40 steps", [](ShampooConfig& c) { dion(c); }, 2e-5, 40},
  };
  expect_cases(cases, [](const ShampooConfig& c, int steps) { return dion_error(c, steps); });
}

// A matrix whose gradient stays zero: its buffer stays zero, the update is zero (P Q^T never
// NaN), the weights only decay, and Q keeps its draw, as the reference's guard does.
TEST(Shampoo, DionZeroGradientOnlyDecays) {
  ShampooConfig c = family_config();
  dion(c);
  auto comm = comm::make_local_communicator();
  Model m = make_model(kFamilySpecs);
  auto opt = make_shampoo(c, m.params, *comm);
  const Vec q0 = state_of(*opt, "dion/w/q").to_doubles();
  for (int s = 0; s < 5; ++s) {
    auto g = grads_at(m.shapes, s);
    std::fill(g[1].begin(), g[1].end(), 0.0);
    set_grads(m, g);
    opt->step(m.params, 0.05);
  }
  const Vec w = m.params[1].value.to_doubles();
  for (size_t j = 0; j < w.size(); ++j)
    ASSERT_NEAR(w[j], m.values[1][j] * std::pow(1.0 - 0.05 * c.weight_decay, 5), 1e-6 * std::fabs(m.values[1][j]) + 1e-12);
  EXPECT_EQ(state_of(*opt, "dion/w/q").to_doubles(), q0);
  for (double v : state_of(*opt, "dion/w/momentum").to_doubles()) ASSERT_EQ(v, 0.0);
  EXPECT_LT(dion_error(c, 8, true), 1e-5);
}

// Dion's plan and state: its matrices are not blocks (no shampoo/<param>/ names), each holds
// dion/<param>/momentum (the parameter's rows, per rank with dion_sync factors, else replicated)
// and dion/<param>/q ([n, r], or [m, r] when m < n); the rank follows the fraction or --dion-rank.
TEST(Shampoo, DionStateAndPlan) {
  ShampooConfig c = family_config();
  dion(c);
  auto comm = comm::make_local_communicator();
  Model m = make_model(kFamilySpecs);
  for (auto [rank, sync] : {std::pair<int64_t, DionSync>{0, DionSync::factors}, {3, DionSync::gradients}}) {
    c.dion_rank = rank;
    c.dion_sync = sync;
    auto opt = make_shampoo(c, m.params, *comm);
    std::map<std::string, PlacedTensor> st;
    for (const PlacedTensor& t : opt->state()) st.emplace(t.name, t);
    for (const std::string p : {"v", "w", "sq", "conv"}) {
      EXPECT_FALSE(st.count("shampoo/" + p + "/block0/graft")) << p;
      ASSERT_TRUE(st.count("dion/" + p + "/momentum")) << p;
      EXPECT_EQ(st.at("dion/" + p + "/momentum").placement, sync == DionSync::factors ? Placement::per_rank : Placement::replicated);
      if (sync == DionSync::factors) {
        EXPECT_EQ(st.at("dion/" + p + "/momentum").resize, Resize::mean);
      }
    }
    EXPECT_TRUE(st.count("shampoo/bias/block0/graft"));
    auto shape = [&](const std::string& n) { return st.at(n).value.shape(); };
    EXPECT_EQ(shape("dion/w/momentum"), (Shape{40, 24}));
    EXPECT_EQ(shape("dion/conv/momentum"), (Shape{6, 36}));
    EXPECT_EQ(shape("dion/w/q"), (Shape{24, rank ? 3 : 6}));     // 40 x 24: P [40, r], Q [24, r]
    EXPECT_EQ(shape("dion/conv/q"), (Shape{6, rank ? 3 : 2}));   // 6 x 36, transposed: Q [6, r]
    EXPECT_EQ(shape("dion/v/q"), (Shape{2, rank ? 2 : 1}));  // 2 x 4: the rank at most 2
    const nlohmann::json plan = opt->plan();
    ASSERT_EQ(plan["dion"]["matrices"].size(), 4u);
    EXPECT_EQ(plan["dion"]["matrices"][3]["param"], "conv");
    EXPECT_EQ(plan["dion"]["matrices"][3]["transposed"], true);
    EXPECT_EQ(plan["dion"]["sync"], name_of(sync));
  }
}

// A checkpoint of dtk before the ascending eigenvalue-corrected bases (qr: columns by descending
// estimate; its optimizer config without "eigenbasis_order"), emulated by reversing a run's
// bases' columns and second moments, is put back by restored(): the state equals the run's bit
// for bit, and both continue alike. A current config, or eigh bases, are left as they are.
TEST(Shampoo, RestoredDescendingQrBasesAreReversed) {
  auto comm = comm::make_local_communicator();
  ShampooConfig c = family_config();
  ec(c);
  c.root_method = RootMethod::qr;
  c.start_preconditioning_step = 3;
  const std::vector<std::pair<std::string, Shape>> specs = {{"w", {6, 5}}, {"c", {3, 4, 5}}, {"v", {7}}};
  Model a = make_model(specs), b = make_model(specs);
  auto oa = make_shampoo(c, a.params, *comm), ob = make_shampoo(c, b.params, *comm);
  for (int t = 1; t <= 5; ++t) {
    set_grads(a, grads_at(a.shapes, t));
    oa->step(a.params, 0.1);
  }
  for (size_t i = 0; i < a.params.size(); ++i) b.params[i].value.copy_from(a.params[i].value);
  // b takes a's state as an older dtk would have written it.
  const std::vector<PlacedTensor> sa = oa->state(), sb = ob->state();
  int reversed = 0;
  for (size_t i = 0; i < sa.size(); ++i) {
    ASSERT_EQ(sa[i].name, sb[i].name);
    Vec v = sa[i].value.to_doubles();
    const bool basis = sa[i].name.find("/eigvecs") != std::string::npos;
    if (basis || sa[i].name.find("/corrected_second_moment") != std::string::npos) {
      const int64_t cols = basis ? sa[i].value.dim(-1) : sa[i].value.numel();
      for (size_t r = 0; r < v.size(); r += size_t(cols)) std::reverse(v.begin() + r, v.begin() + r + size_t(cols));
      ++reversed;
    }
    Tensor dst = sb[i].value;
    dst.copy_from(Tensor::from_doubles(v, dst.shape(), dst.dtype()));
  }
  EXPECT_GT(reversed, 4);
  nlohmann::json old = oa->config();
  ASSERT_EQ(old.value("eigenbasis_order", ""), "ascending");
  EXPECT_EQ(ob->restored(old), "");  // a current checkpoint: nothing to do
  old.erase("eigenbasis_order");
  EXPECT_NE(ob->restored(old), "");
  for (const PlacedTensor& t : oa->state())
    EXPECT_EQ(state_of(*ob, t.name).to_doubles(), t.value.to_doubles()) << t.name;
  for (int t = 6; t <= 9; ++t) {
    set_grads(a, grads_at(a.shapes, t));
    set_grads(b, grads_at(b.shapes, t));
    oa->step(a.params, 0.1);
    ob->step(b.params, 0.1);
  }
  for (size_t i = 0; i < a.params.size(); ++i)
    EXPECT_EQ(a.params[i].value.to_doubles(), b.params[i].value.to_doubles()) << a.params[i].name;
  ShampooConfig e = c;
  e.root_method = RootMethod::eigh;
  Model m = make_model(specs);
  auto oe = make_shampoo(e, m.params, *comm);
  nlohmann::json eo = oe->config();
  eo.erase("eigenbasis_order");
  EXPECT_EQ(oe->restored(eo), "");  // eigh bases were ascending already
}

// A block whose f32 solve fails (a solver that does not converge, injected through
// ops::testing::FailF32Solves) is solved again alone in f64, and the run still follows the f64
// reference: the retry path of roots (eigh, qr, pseudo-inverse) and of the eigenbases (eigh,
// qr). Without the retry the failed blocks would keep their previous (identity or zero) result
// and the error would be of order 1.
TEST(Shampoo, FailedSolvesAreRetriedInF64) {
  const std::vector<FamilyCase> cases = {
      {"roots eigh", [](ShampooConfig&) {}, 1e-5},
      {"roots qr", [](ShampooConfig& c) { c.root_method = RootMethod::qr; }, 1e-5},
      {"pseudo-inverse, full rank", [](ShampooConfig& c) {
         c.root_method = RootMethod::pseudo_inverse; c.epsilon = 1e-12; c.grafting = Grafting::none; }, 1e-5},
      {"ec eigh", [](ShampooConfig& c) { ec(c); }, 1e-5},
      {"ec qr", [](ShampooConfig& c) { ec(c); c.root_method = RootMethod::qr; }, 1e-5},
  };
  for (const FamilyCase& k : cases) {
    ShampooConfig c = family_config();
    k.tweak(c);
    const ops::testing::FailF32Solves fail(3);  // the first root or basis computation's first 3 blocks
    const double e = family_error(c, k.steps);
    std::printf("%-60s %.2e\n", k.label.c_str(), e);
    EXPECT_EQ(fail.remaining(), 0) << k.label << ": no f32 solve ran";
    EXPECT_LT(e, k.tol) << k.label;
  }
}

// Spectral descent on rank-deficient blocks (a one-example gradient of a linear layer is u v^T):
// exact gives U V^T of the block's rank (the f32 rounding's singular values cut), Newton-Schulz
// its polynomial (singular values p(s) of the normalised block, about 0.7 for the top one). Two
// steps, beta1 0 and 0.5, no grafting, no scale: the weights move by lr O.
TEST(Shampoo, SpectralOfRankDeficientBlocks) {
  auto comm = comm::make_local_communicator();
  for (const SpectralMethod method : {SpectralMethod::exact, SpectralMethod::newton_schulz})
    for (const double beta1 : {0.0, 0.5}) {
      ShampooConfig c;
      spectral(c);
      c.spectral_method = method;
      c.spectral_scale = SpectralScale::none;
      c.grafting = Grafting::none;
      c.beta1 = beta1;
      c.max_preconditioner_dim = 64;
      const std::vector<std::pair<std::string, Shape>> specs = {{"w", {24, 16}}, {"t", {10, 30}}};
      Model m = make_model(specs);
      auto opt = make_shampoo(c, m.params, *comm);
      shampoo_ref::Reference ref(c, m.shapes, {"w", "t"});
      std::vector<Vec> want = m.values;
      for (int s = 0; s < 2; ++s) {
        std::vector<Vec> g;
        for (size_t p = 0; p < specs.size(); ++p) {  // rank 1 (w), rank 2 (t)
          const int64_t r = specs[p].second[0], k = specs[p].second[1];
          Vec x(size_t(r * k), 0.0);
          for (int term = 0; term <= int(p); ++term) {
            const Vec a = shampoo_ref::random_values(size_t(r), 900 + 10 * s + 3 * p + term);
            const Vec b = shampoo_ref::random_values(size_t(k), 950 + 10 * s + 3 * p + term);
            for (int64_t i = 0; i < r; ++i)
              for (int64_t j = 0; j < k; ++j) x[size_t(i * k + j)] += a[size_t(i)] * b[size_t(j)];
          }
          for (double& e : x) e = static_cast<double>(static_cast<float>(e));
          g.push_back(x);
        }
        set_grads(m, g);
        opt->step(m.params, 0.05);
        ref.step(want, g, 0.05);
      }
      // Newton-Schulz multiplies small singular directions by about a = 3.4445 a step, the f32
      // rounding of each step's products with them (a^5 = 480 times 6e-8): 2.7e-5 measured;
      // exact 1e-6.
      const double tol = method == SpectralMethod::exact ? 1e-5 : 1e-4;
      EXPECT_LT(rel_err(m.params, want, m.values), tol) << name_of(method) << " beta1 " << beta1;
    }
}

// Before its first basis, eigenvalue-corrected Shampoo without grafting is Adam on every block
// (Q = I), the corrected second moment accumulating from step 1; with grafting it takes the
// grafting direction. Here start 100: no basis in 6 steps, on blocks of every shape.
TEST(Shampoo, EigenvalueCorrectedBeforeItsFirstBasis) {
  for (const Grafting g : {Grafting::none, Grafting::adam}) {
    ShampooConfig c = family_config();
    ec(c);
    c.grafting = g;
    c.precondition_frequency = 100;
    c.start_preconditioning_step = -1;
    const double e = family_error(c, 6);
    EXPECT_LT(e, 1e-5) << name_of(g);
  }
}

// Options that do not fit: validate() throws UsageError naming both options (as the config
// field or as the program option).
TEST(Shampoo, FamilyBadCombinations) {
  struct Bad {
    std::string a, b;  // the two options the message names
    void (*tweak)(ShampooConfig&);
  };
  const std::vector<Bad> bad = {
      {"exponent_override", "preconditioner", [](ShampooConfig& c) { ec(c); c.exponent_override = 2; }},
      {"root_method", "preconditioner", [](ShampooConfig& c) { ec(c); c.root_method = RootMethod::newton; }},
      {"root_method", "preconditioner", [](ShampooConfig& c) { ec(c); c.root_method = RootMethod::pseudo_inverse; }},
      // rank_*: they need root_method pseudo-inverse, which neither eigenvalue-corrected nor
      // spectral takes: the message may name the root method instead of the preconditioner.
      {"rank_rtol", "preconditioner|root_method", [](ShampooConfig& c) { ec(c); c.rank_rtol = 1e-3; }},
      {"rank_atol", "preconditioner|root_method", [](ShampooConfig& c) { ec(c); c.rank_atol = 1e-3; }},
      {"epsilon", "root_method", [](ShampooConfig& c) { c.root_method = RootMethod::pseudo_inverse; c.epsilon = 1e-3; }},
      // eps 0 leaves the roots of singular factors infinite: only the pseudo-inverse takes it.
      {"epsilon", "root_method", [](ShampooConfig& c) { c.epsilon = 0; }},
      {"root_method", "preconditioner", [](ShampooConfig& c) { spectral(c); c.root_method = RootMethod::qr; }},
      {"root_method", "preconditioner", [](ShampooConfig& c) { spectral(c); c.root_method = RootMethod::newton; }},
      {"root_method", "preconditioner", [](ShampooConfig& c) { spectral(c); c.root_method = RootMethod::pseudo_inverse; }},
      {"exponent_override", "preconditioner", [](ShampooConfig& c) { spectral(c); c.exponent_override = 2; }},
      {"factor_update_every", "preconditioner", [](ShampooConfig& c) { spectral(c); c.factor_update_every = 2; }},
      {"start_preconditioning_step", "preconditioner", [](ShampooConfig& c) { spectral(c); c.start_preconditioning_step = 100; }},
      {"precondition_frequency", "preconditioner", [](ShampooConfig& c) { spectral(c); c.precondition_frequency = 10; }},
      {"root_spread", "preconditioner", [](ShampooConfig& c) { spectral(c); c.root_spread = 2; }},
      {"factor_dtype", "preconditioner", [](ShampooConfig& c) { spectral(c); c.factor_dtype = DType::f64; }},
      {"ec_beta2", "preconditioner", [](ShampooConfig& c) { spectral(c); c.ec_beta2 = 0.9; }},
      {"ec_epsilon", "preconditioner", [](ShampooConfig& c) { spectral(c); c.ec_epsilon = 1e-8; }},
      {"rank_rtol", "preconditioner|root_method", [](ShampooConfig& c) { spectral(c); c.rank_rtol = 1e-3; }},
      {"rank_atol", "preconditioner|root_method", [](ShampooConfig& c) { spectral(c); c.rank_atol = 1e-3; }},
      {"rank_rtol", "root_method", [](ShampooConfig& c) { c.rank_rtol = 1e-3; }},  // root eigh
      // The other preconditioners' own options.
      {"ec_beta2", "preconditioner", [](ShampooConfig& c) { c.ec_beta2 = 0.9; }},
      {"ec_epsilon", "preconditioner", [](ShampooConfig& c) { c.ec_epsilon = 1e-8; }},
      {"spectral_method", "preconditioner", [](ShampooConfig& c) { c.spectral_method = SpectralMethod::exact; }},
      {"newton_schulz_steps", "preconditioner", [](ShampooConfig& c) { ec(c); c.newton_schulz_steps = 3; }},
      {"spectral_scale", "preconditioner", [](ShampooConfig& c) { ec(c); c.spectral_scale = SpectralScale::rms; }},
      // Dion's own options, and what does not fit it.
      {"dion_rank", "preconditioner", [](ShampooConfig& c) { spectral(c); c.dion_rank = 4; }},
      {"dion_rank_fraction", "preconditioner", [](ShampooConfig& c) { c.dion_rank_fraction = 0.5; }},
      {"dion_sync", "preconditioner", [](ShampooConfig& c) { ec(c); c.dion_sync = DionSync::gradients; }},
      {"momentum", "preconditioner", [](ShampooConfig& c) { dion(c); c.momentum = 0.9; }},
      {"root_method", "preconditioner", [](ShampooConfig& c) { dion(c); c.root_method = RootMethod::qr; }},
      {"newton_schulz_steps", "preconditioner", [](ShampooConfig& c) { dion(c); c.newton_schulz_steps = 3; }},
      {"factor_dtype", "preconditioner", [](ShampooConfig& c) { dion(c); c.factor_dtype = DType::f64; }},
      {"dion_rank_fraction", "(0, 1]", [](ShampooConfig& c) { dion(c); c.dion_rank_fraction = 0; }},
      {"dion_rank", ">= 0", [](ShampooConfig& c) { dion(c); c.dion_rank = -1; }},
      {"grafting_scope", "preconditioner", [](ShampooConfig& c) { dion(c); c.grafting_scope = GraftingScope::diagonal; }},
      {"grafting_scope", "grafting", [](ShampooConfig& c) {
         spectral(c); c.grafting_scope = GraftingScope::diagonal; c.grafting = Grafting::none; }},
  };
  // The message names an option as its config field (root_method) or its program option
  // (--root-method).
  auto names = [](const std::string& what, const std::string& fields) {  // fields: a|b, either
    for (size_t from = 0; from <= fields.size();) {
      const size_t bar = std::min(fields.find('|', from), fields.size());
      const std::string field = fields.substr(from, bar - from);
      std::string dashed = field;
      std::replace(dashed.begin(), dashed.end(), '_', '-');
      if (what.find(field) != std::string::npos || what.find(dashed) != std::string::npos) return true;
      from = bar + 1;
    }
    return false;
  };
  for (const Bad& b : bad) {
    ShampooConfig c;
    b.tweak(c);
    try {
      c.validate();
      ADD_FAILURE() << "no error: " << b.a << " with " << b.b << " " << nlohmann::json(c).dump();
    } catch (const UsageError& e) {
      EXPECT_TRUE(names(e.what(), b.a) && names(e.what(), b.b)) << e.what() << " (wants " << b.a << " and " << b.b << ")";
    }
  }
  // What fits: the defaults of each preconditioner; spectral with frequency 1; pseudo-inverse
  // with eps 0 or its default; eigenvalue-corrected with qr; rank options with pseudo-inverse.
  for (void (*ok)(ShampooConfig&) : std::vector<void (*)(ShampooConfig&)>{
           [](ShampooConfig&) {}, [](ShampooConfig& c) { ec(c); }, [](ShampooConfig& c) { spectral(c); },
           [](ShampooConfig& c) { spectral(c); c.precondition_frequency = 1; },
           [](ShampooConfig& c) { spectral(c); c.spectral_method = SpectralMethod::exact; c.diagonal_params = {"emb"}; },
           [](ShampooConfig& c) { c.root_method = RootMethod::pseudo_inverse; c.epsilon = 0; c.rank_rtol = 1e-3; c.rank_atol = 1e-6; },
           [](ShampooConfig& c) { c.root_method = RootMethod::pseudo_inverse; },
           [](ShampooConfig& c) { ec(c); c.root_method = RootMethod::qr; c.ec_beta2 = 0.99; c.ec_epsilon = 1e-8; },
           [](ShampooConfig& c) { c.factor_update_every = 10; },
           [](ShampooConfig& c) { spectral(c); c.grafting_scope = GraftingScope::diagonal; c.diagonal_params = {"emb"}; },
           [](ShampooConfig& c) { dion(c); c.dion_rank = 8; c.dion_sync = DionSync::gradients; c.spectral_scale = SpectralScale::muon; }}) {
    ShampooConfig c;
    ok(c);
    EXPECT_NO_THROW(c.validate()) << nlohmann::json(c).dump();
  }
  // And through the JSON reader, as the other options are.
  expect_usage({{"preconditioner", "soap"}}, "preconditioner");
  expect_usage({{"spectral_method", "svd"}}, "spectral_method");
  expect_usage({{"spectral_scale", "max"}}, "spectral_scale");
  expect_usage({{"root_method", "pinv"}}, "root_method");
  expect_usage({{"grafting_scope", "some"}}, "grafting_scope");
}

// The state of each preconditioner: eigenvalue-corrected blocks hold factor<k>, eigvecs<k>
// [b_k, b_k] and corrected_second_moment (block shape), no root<k>; spectral and diagonal blocks
// no factor, root or eigvecs, but graft, filtered_grad and momentum as today (spectral: over its
// own blocking).
TEST(Shampoo, FamilyStateNames) {
  auto comm = comm::make_local_communicator();
  std::vector<std::pair<std::string, Shape>> specs = kFamilySpecs;
  Model m = make_model(specs);
  auto names_of = [&](const ShampooConfig& c) {
    std::map<std::string, Shape> st;
    for (const PlacedTensor& t : make_shampoo(c, m.params, *comm)->state()) st[t.name] = t.value.shape();
    return st;
  };
  auto count = [](const std::map<std::string, Shape>& st, const std::string& part) {
    int n = 0;
    for (const auto& [name, shape] : st) n += name.find(part) != std::string::npos;
    return n;
  };
  ShampooConfig c = family_config();
  ec(c);
  auto st = names_of(c);
  EXPECT_EQ(st.at("shampoo/w/block1/factor1"), (Shape{8, 8}));
  EXPECT_EQ(st.at("shampoo/w/block1/eigvecs0"), (Shape{16, 16}));
  EXPECT_EQ(st.at("shampoo/w/block1/eigvecs1"), (Shape{8, 8}));
  EXPECT_EQ(st.at("shampoo/w/block1/corrected_second_moment"), (Shape{16, 8}));
  EXPECT_EQ(st.at("shampoo/conv/block0/eigvecs2"), (Shape{9, 9}));
  EXPECT_EQ(st.at("shampoo/conv/block0/corrected_second_moment"), (Shape{6, 4, 9}));
  EXPECT_EQ(st.at("shampoo/v/block0/eigvecs0"), (Shape{8, 8}));
  EXPECT_EQ(shape_numel(st.at("shampoo/s/block0/corrected_second_moment")), 1);
  EXPECT_FALSE(st.count("shampoo/s/block0/eigvecs0"));
  EXPECT_EQ(count(st, "/root"), count(st, "/root_failures"));  // no root<k>
  EXPECT_EQ(count(st, "/eigvecs"), count(st, "/factor"));
  for (const PlacedTensor& t : make_shampoo(c, m.params, *comm)->state())
    if (t.name.find("/eigvecs") != std::string::npos || t.name.find("corrected_second_moment") != std::string::npos) {
      EXPECT_FALSE(t.symmetric) << t.name;
      EXPECT_EQ(t.placement, Placement::owned) << t.name;
    }
  // Spectral: conv is [6, 36]: [6, 16], [6, 16], [6, 4]; v is one [2, 4] block.
  c = family_config();
  spectral(c);
  st = names_of(c);
  EXPECT_EQ(count(st, "/factor") + count(st, "/eigvecs") + count(st, "/corrected"), 0);
  EXPECT_EQ(count(st, "/root"), count(st, "/root_failures"));
  EXPECT_EQ(st.at("shampoo/conv/block2/graft"), (Shape{6, 4}));
  EXPECT_EQ(st.at("shampoo/conv/block1/momentum"), (Shape{6, 16}));
  EXPECT_FALSE(st.count("shampoo/conv/block3/graft"));
  EXPECT_EQ(st.at("shampoo/v/block0/filtered_grad"), (Shape{2, 4}));
  EXPECT_EQ(st.at("shampoo/w/block5/graft"), (Shape{8, 8}));
  EXPECT_EQ(st.at("shampoo/bias/block0/graft"), (Shape{5}));
  // Diagonal parameters: no factors, the rest as today; the others unchanged.
  c = family_config();
  c.diagonal_params = {"conv", "w"};
  st = names_of(c);
  EXPECT_EQ(count(st, "shampoo/conv/block0/factor") + count(st, "shampoo/w/block0/factor") + count(st, "shampoo/w/block0/root0"), 0);
  EXPECT_EQ(st.at("shampoo/conv/block0/graft"), (Shape{6, 4, 9}));
  EXPECT_EQ(st.at("shampoo/w/block3/momentum"), (Shape{16, 8}));
  EXPECT_EQ(st.at("shampoo/sq/block0/root1"), (Shape{12, 12}));
  // Pseudo-inverse: roots as eigh's.
  c = family_config();
  c.root_method = RootMethod::pseudo_inverse;
  c.epsilon = 0;
  st = names_of(c);
  EXPECT_EQ(st.at("shampoo/sq/block0/root0"), (Shape{12, 12}));
  EXPECT_FALSE(st.count("shampoo/sq/block0/eigvecs0"));
}

// Save every state tensor after `at` steps, restore into a fresh optimizer, continue: bit-identical
// to the run that never stopped.
void expect_round_trip(const ShampooConfig& c, const std::vector<std::pair<std::string, Shape>>& specs, int at, int steps,
                       const std::string& label) {
  auto comm = comm::make_local_communicator();
  Model full = make_model(specs);
  auto of = make_shampoo(c, full.params, *comm);
  for (int s = 0; s < steps; ++s) {
    set_grads(full, grads_at(full.shapes, s));
    of->step(full.params, 0.05);
  }
  Model part = make_model(specs);
  auto op = make_shampoo(c, part.params, *comm);
  for (int s = 0; s < at; ++s) {
    set_grads(part, grads_at(part.shapes, s));
    op->step(part.params, 0.05);
  }
  std::map<std::string, Tensor> saved;
  for (const PlacedTensor& t : op->state()) saved[t.name] = t.value.clone();
  Model resumed = make_model(specs, 99);  // other values: the restore must bring everything
  for (size_t i = 0; i < resumed.params.size(); ++i) resumed.params[i].value.copy_from(part.params[i].value);
  auto orr = make_shampoo(c, resumed.params, *comm);
  size_t restored = 0;
  for (PlacedTensor& t : orr->state()) {
    ASSERT_TRUE(saved.count(t.name)) << t.name << " " << label;
    t.value.copy_from(saved.at(t.name));
    ++restored;
  }
  EXPECT_EQ(restored, saved.size()) << label;
  for (int s = at; s < steps; ++s) {
    set_grads(resumed, grads_at(resumed.shapes, s));
    orr->step(resumed.params, 0.05);
  }
  for (size_t i = 0; i < full.params.size(); ++i)
    EXPECT_EQ(resumed.params[i].value.to_doubles(), full.params[i].value.to_doubles()) << specs[i].first << " " << label;
}

// Save every state tensor after 4 steps, build a fresh optimizer, copy the state in, continue:
// bit-identical to the run that never stopped (roots at 2, 4, 6: step 5 uses restored roots).
TEST(Shampoo, StateRoundTripIsBitIdentical) {
  ShampooConfig c;
  c.max_preconditioner_dim = 5;
  c.precondition_frequency = 2;
  c.start_preconditioning_step = 2;
  c.epsilon = 1e-3;
  c.momentum = 0.5;
  c.weight_decay = 0.01;
  expect_round_trip(c, {{"a", {6, 4}}, {"b", {8}}, {"c", {3, 4, 5}}}, 4, 7, "roots");
}

// The same for the family: eigenvalue-corrected (eigh; qr saved before its first basis, which
// must then still be a full eigh, and after it, warm-started from the restored eigvecs),
// spectral, pseudo-inverse roots, factor updates every 3 (restored between two updates) and
// diagonal parameters.
TEST(Shampoo, FamilyStateRoundTripIsBitIdentical) {
  ShampooConfig base = family_config();
  base.precondition_frequency = 2;
  base.start_preconditioning_step = 4;  // bases/roots at 4, 6, 8
  struct Trip {
    std::string label;
    void (*tweak)(ShampooConfig&);
    int at;
  };
  const std::vector<Trip> trips = {
      {"ec eigh", [](ShampooConfig& c) { ec(c); }, 5},
      {"ec qr, saved before the first basis", [](ShampooConfig& c) { ec(c); c.root_method = RootMethod::qr; }, 3},
      {"ec qr, saved after it", [](ShampooConfig& c) { ec(c); c.root_method = RootMethod::qr; }, 5},
      {"spectral newton-schulz", [](ShampooConfig& c) { spectral(c); }, 4},
      {"spectral exact, no grafting", [](ShampooConfig& c) { spectral(c); c.spectral_method = SpectralMethod::exact; c.grafting = Grafting::none; }, 4},
      {"pseudo-inverse", [](ShampooConfig& c) { c.root_method = RootMethod::pseudo_inverse; c.epsilon = 0; }, 5},
      {"factor update every 3", [](ShampooConfig& c) { c.factor_update_every = 3; }, 5},
      {"ec, factor update every 3", [](ShampooConfig& c) { ec(c); c.factor_update_every = 3; }, 5},
      {"diagonal w, conv", [](ShampooConfig& c) { c.diagonal_params = {"w", "conv"}; }, 5},
  };
  for (const Trip& k : trips) {
    ShampooConfig c = base;
    k.tweak(c);
    expect_round_trip(c, kFamilySpecs, k.at, 10, k.label);
  }
}

TEST(Shampoo, ConfigJsonAndValidation) {
  ShampooConfig c;
  c.grafting = Grafting::rmsprop;
  c.max_preconditioner_dim = 256;
  c.trainers_per_group = 2;
  c.communication_dtype = DType::bf16;
  const ShampooConfig d = from_json<ShampooConfig>(nlohmann::json(c));
  EXPECT_EQ(nlohmann::json(d), nlohmann::json(c));
  expect_usage({{"grafting", "lion"}}, "grafting");
  expect_usage({{"beta2", 1.5}}, "beta2");
  expect_usage({{"factor_dtype", "bf16"}}, "factor_dtype");
  expect_usage({{"precondition_frequency", 0}}, "precondition_frequency");
  expect_usage({{"max_preconditioner_dim", 2.5}}, "max_preconditioner_dim");
  expect_usage({{"root_method", "newton"}, {"exponent_override", 2.5}}, "exponent_override");
  expect_usage({{"communication_dtype", "f16"}}, "communication_dtype");
  expect_usage({{"nesterov", true}, {"momentum", 0}}, "nesterov");
  expect_usage({{"name", "adamw"}}, "name");
  expect_usage({{"max_precond_dim", 3}}, "max_precond_dim");
  // trainers_per_group must divide the world.
  auto comm = comm::make_local_communicator();
  Model m = make_model({{"w", {3, 3}}});
  ShampooConfig g;
  g.trainers_per_group = 2;
  EXPECT_THROW(make_shampoo(g, m.params, *comm), UsageError);
  // Parameters other than those it was built for.
  auto opt = make_shampoo({}, m.params, *comm);
  Model other = make_model({{"w", {3, 4}}});
  EXPECT_THROW(opt->step(other.params, 0.1), UsageError);
}

}  // namespace
}  // namespace dtk::optim
