// CUDA linear algebra against the CPU backend on the same inputs. Each comparison prints one
// line "gpu-check: <op> <dtype> max_rel_err=<x> tol=<y> PASS|FAIL" for scripts/gpu-check's log.
// Skipped without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "dtk/core/device.h"
#include "dtk/core/error.h"
#include "dtk/core/tensor.h"
#include "dtk/ops/ops.h"
#include "../common/gpu_check.h"

namespace dtk {
namespace {

using namespace gpu_test;

// Flip the sign of each column j of x (matrices [.., rows, cols]) so that it points the way
// column j of ref does: eigenvectors and Householder Q columns are defined up to sign.
Vec align_columns(Vec x, const Vec& ref, int64_t rows, int64_t cols) {
  const int64_t per = rows * cols;
  for (int64_t b = 0; b * per < int64_t(x.size()); ++b)
    for (int64_t j = 0; j < cols; ++j) {
      double d = 0;
      for (int64_t i = 0; i < rows; ++i) d += x[b * per + i * cols + j] * ref[b * per + i * cols + j];
      if (d < 0)
        for (int64_t i = 0; i < rows; ++i) x[b * per + i * cols + j] = -x[b * per + i * cols + j];
    }
  return x;
}

Vec random_symmetric(int64_t batch, int64_t n, uint64_t seed, bool spd) {
  Vec out;
  for (int64_t b = 0; b < batch; ++b) {
    const Vec r = random_values(size_t(n * n), seed + uint64_t(b));
    Vec a(size_t(n * n), 0.0);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) {
        if (spd) {  // R R^T / n + I
          double s = 0;
          for (int64_t k = 0; k < n; ++k) s += r[i * n + k] * r[j * n + k];
          a[i * n + j] = s / double(n) + (i == j ? 1.0 : 0.0);
        } else {
          a[i * n + j] = r[std::max(i, j) * n + std::min(i, j)];
        }
      }
    out.insert(out.end(), a.begin(), a.end());
  }
  return out;
}


// A gemm case: op(A) [m, k], op(B) [k, n], C [m, n], each with a leading batch dim when batch > 0.
struct GemmCase {
  int64_t batch, m, n, k;
};

// The stored shapes of A, B and C for a case and its transpositions.
std::array<Shape, 3> gemm_shapes(const GemmCase& c, bool ta, bool tb) {
  std::array<Shape, 3> s{ta ? Shape{c.k, c.m} : Shape{c.m, c.k}, tb ? Shape{c.n, c.k} : Shape{c.k, c.n}, Shape{c.m, c.n}};
  if (c.batch)
    for (Shape& x : s) x.insert(x.begin(), c.batch);
  return s;
}

TEST(LinalgGpu, GemmMatchesCpu) {
  SKIP_WITHOUT_GPU();
  const GemmCase cases[] = {{0, 1, 1, 1}, {0, 7, 33, 100}, {0, 100, 7, 33}, {0, 257, 129, 65}, {3, 33, 7, 100}, {4, 1, 5, 9}};
  uint64_t seed = 1;
  for (DType t : kFloatTypes) {
    double worst = 0;
    for (const GemmCase& c : cases)
      for (int ta = 0; ta < 2; ++ta)
        for (int tb = 0; tb < 2; ++tb) {
          const auto [as, bs, cs] = gemm_shapes(c, ta, tb);
          const Vec av = random_values(size_t(shape_numel(as)), seed++);
          const Vec bv = random_values(size_t(shape_numel(bs)), seed++);
          const Vec cv = random_values(size_t(shape_numel(cs)), seed++);
          Tensor a = Tensor::from_doubles(av, as, t), b = Tensor::from_doubles(bv, bs, t);
          Tensor cc = Tensor::from_doubles(cv, cs, t);
          Tensor ag = a.to(kGpu), bg = b.to(kGpu), cg = cc.to(kGpu);
          ops::gemm(ta, tb, 1.5, a, b, -0.5, cc);
          ops::gemm(ta, tb, 1.5, ag, bg, -0.5, cg);
          worst = std::max(worst, max_rel_err(cg.to_doubles(), cc.to_doubles()));
        }
    report("gemm", std::string(dtype_name(t)), worst, tol_for(t));
  }
}

// gemm with Math::tf32 (cuBLAS's CUBLAS_COMPUTE_32F_FAST_TF32) against the CPU's definition (the
// f32 product of operands rounded to TF32, to nearest): how cuBLAS rounds the operands is its
// own, so the bound is TF32's: each product within 2 * 2^-10 of |a||b| (both operands truncated,
// the worse case), k terms of unit scale, 2^-9 sqrt(k) of the largest result. The GPU's product
// must differ from its exact f32 product (the tensor cores ran), and agree with the CPU's tf32
// far better than with exact f32 when cuBLAS rounds as the CPU does: both figures are printed.
TEST(LinalgGpu, GemmTf32MatchesCpu) {
  SKIP_WITHOUT_GPU();
  const GemmCase cases[] = {{0, 7, 33, 100}, {0, 257, 129, 65}, {3, 33, 7, 100}, {0, 512, 512, 512}};
  uint64_t seed = 900;
  double vs_cpu = 0, vs_exact = INFINITY, bound = 0;
  for (const GemmCase& c : cases)
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb) {
        const auto [as, bs, cs] = gemm_shapes(c, ta, tb);
        const Vec av = random_values(size_t(shape_numel(as)), seed++);
        const Vec bv = random_values(size_t(shape_numel(bs)), seed++);
        const Vec cv = random_values(size_t(shape_numel(cs)), seed++);
        Tensor a = Tensor::from_doubles(av, as, DType::f32), b = Tensor::from_doubles(bv, bs, DType::f32);
        Tensor cc = Tensor::from_doubles(cv, cs, DType::f32);
        Tensor ag = a.to(kGpu), bg = b.to(kGpu), cg = cc.to(kGpu), eg = cc.to(kGpu);
        ops::gemm(ta, tb, 1.5, a, b, -0.5, cc, ops::Math::tf32);
        ops::gemm(ta, tb, 1.5, ag, bg, -0.5, cg, ops::Math::tf32);
        ops::gemm(ta, tb, 1.5, ag, bg, -0.5, eg);
        const Vec got = cg.to_doubles();
        vs_cpu = std::max(vs_cpu, max_rel_err(got, cc.to_doubles()));
        vs_exact = std::min(vs_exact, max_rel_err(got, eg.to_doubles()));
        bound = std::max(bound, std::ldexp(1.0, -9) * std::sqrt(double(c.k)));
      }
  report("gemm_tf32_vs_cpu_tf32", "f32", vs_cpu, bound);
  std::printf("gemm tf32: the smallest difference from the exact f32 product %.3g (must be > 0)\n", vs_exact);
  EXPECT_GT(vs_exact, 0) << "the tf32 gemm gave the exact f32 product: no tensor cores";
}

// gemm with k = 0: the product is empty, so C = beta C whatever alpha (the BLAS rule), and
// beta == 0 (or -0) writes zeros without reading C, so the NaN and Inf that C held are gone; the
// CPU does this in a loop, the GPU by cudaMemsetAsync or cuBLAS ?scal. Every transpose
// combination, 2-D and batched, C a view inside a larger buffer whose other rows must stay as
// they were, bf16 inputs (CUDA only: the CPU's f32 result on the same empty product is the
// reference).
//   tol 0 (the same bits, NaN for NaN): beta 0, or a beta of few significant bits (1, -0.5, 3),
//   whose product with a float needs no rounding in double, so the CPU's rounding of the double
//   product to f32 and cuBLAS's f32 product give the one correctly rounded value; and every f64
//   product (one double multiplication on both sides).
//   beta 0.1 in f32: the GPU multiplies by 0.1 rounded to f32 and rounds once (a relative error
//   below 2 u, u = 2^-24), the CPU rounds the exact double product once to f32 (below u + 2^-53):
//   they differ by at most 3u = 1.8e-7 of the value, so tol 2e-7.
TEST(LinalgGpu, GemmEmptyProductIsBetaC) {
  SKIP_WITHOUT_GPU();
  struct Case {
    int64_t batch, m, n;
  };
  const Case cases[] = {{0, 7, 33}, {0, 1, 1}, {3, 5, 9}, {0, 0, 4}};
  uint64_t seed = 700;
  for (DType t : {DType::f32, DType::f64, DType::bf16}) {
    const DType ct = t == DType::bf16 ? DType::f32 : t;  // c's dtype
    const double round_tol = ct == DType::f32 ? 2e-7 : 0;
    double exact = 0, rounded = 0;
    std::string failed;  // the first case beyond its tolerance
    for (const Case& c : cases)
      for (int ta = 0; ta < 2; ++ta)
        for (int tb = 0; tb < 2; ++tb)
          for (double beta : {0.0, -0.0, 1.0, -0.5, 3.0, 0.1})
            for (double alpha : {1.5, 0.0, -1e30}) {
              Shape as = ta ? Shape{0, c.m} : Shape{c.m, 0};
              Shape bs = tb ? Shape{c.n, 0} : Shape{0, c.n};
              // c is rows 1 .. rows of a buffer of rows + 2 (batches, or matrix rows in 2-D)
              const int64_t rows = c.batch ? c.batch : c.m;
              const Shape full = c.batch ? Shape{rows + 2, c.m, c.n} : Shape{rows + 2, c.n};
              if (c.batch) {
                as.insert(as.begin(), c.batch);
                bs.insert(bs.begin(), c.batch);
              }
              Vec cv = random_values(size_t(shape_numel(full)), seed++);
              for (size_t i = 0; i < cv.size(); i += 5) cv[i] = i % 10 ? INFINITY : std::nan("");
              Tensor cfull = Tensor::from_doubles(cv, full, ct), gfull = cfull.to(kGpu);
              Tensor cc = cfull.slice(1, rows + 1), cg = gfull.slice(1, rows + 1);
              ops::gemm(ta, tb, alpha, Tensor::empty(as, ct), Tensor::empty(bs, ct), beta, cc);
              ops::gemm(ta, tb, alpha, Tensor::empty(as, t, kGpu), Tensor::empty(bs, t, kGpu), beta, cg);
              std::string first;
              const double err = exact_err(gfull, cfull, &first);
              const bool round = beta == 0.1;
              (round ? rounded : exact) = std::max(round ? rounded : exact, err);
              if (err > (round ? round_tol : 0) && failed.empty())
                failed = "batch " + std::to_string(c.batch) + " m " + std::to_string(c.m) + " n " +
                         std::to_string(c.n) + " ta " + std::to_string(ta) + " tb " + std::to_string(tb) + " alpha " +
                         std::to_string(alpha) + " beta " + std::to_string(beta) + ": " + first;
            }
    const std::string name(dtype_name(t));
    report("gemm(k=0)", name, exact, 0);
    report("gemm(k=0,beta=0.1)", name, rounded, round_tol);
    EXPECT_EQ(failed, "") << "gemm k=0 " << name << ", the first case that failed";
  }
}

// syrk on the GPU (a gemm whose lower triangle is mirrored) matches the CPU's and is exactly
// symmetric, as Shampoo's packed checkpoints need; symmetrize is a copy: bit-equal to the CPU's.
TEST(LinalgGpu, SyrkAndSymmetrizeMatchCpu) {
  SKIP_WITHOUT_GPU();
  uint64_t seed = 500;
  for (DType t : kFloatTypes) {
    double worst = 0;
    for (int64_t n : {1, 7, 70, 130})
      for (int tr = 0; tr < 2; ++tr) {
        const int64_t B = 3, k = 33;
        Tensor a = Tensor::from_doubles(random_values(size_t(B * n * k), seed++), tr ? Shape{B, k, n} : Shape{B, n, k}, t);
        Tensor c = Tensor::from_doubles(random_symmetric(B, n, seed++, false), {B, n, n}, t);
        Tensor ag = a.to(kGpu), cg = c.to(kGpu);
        ops::syrk(tr, 0.5, a, 0.25, c);
        ops::syrk(tr, 0.5, ag, 0.25, cg);
        const Vec g = cg.to_doubles();
        worst = std::max(worst, max_rel_err(g, c.to_doubles()));
        for (int64_t bi = 0; bi < B; ++bi)
          for (int64_t i = 0; i < n; ++i)
            for (int64_t j = 0; j < i; ++j)
              ASSERT_EQ(g[size_t((bi * n + i) * n + j)], g[size_t((bi * n + j) * n + i)]) << "syrk n=" << n;
        Tensor m = Tensor::from_doubles(random_values(size_t(B * n * n), seed++), {B, n, n}, t), mg = m.to(kGpu);
        ops::symmetrize(m);
        ops::symmetrize(mg);
        EXPECT_EQ(mg.to_doubles(), m.to_doubles()) << "symmetrize n=" << n;
      }
    report("syrk", std::string(dtype_name(t)), worst, tol_for(t) * 10);
  }
}

TEST(LinalgGpu, GemmBf16MatchesCpuF32) {
  SKIP_WITHOUT_GPU();
  // bf16 inputs are exact in f32, so the CPU f32 product of the same values is the reference;
  // the GPU accumulates in f32 too (in another order).
  double worst = 0;
  uint64_t seed = 50;
  for (int64_t batch : {0, 3})
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb) {
        const int64_t m = 65, n = 33, k = 256;
        Shape as = ta ? Shape{k, m} : Shape{m, k};
        Shape bs = tb ? Shape{n, k} : Shape{k, n};
        Shape cs{m, n};
        if (batch) {
          as.insert(as.begin(), batch);
          bs.insert(bs.begin(), batch);
          cs.insert(cs.begin(), batch);
        }
        Tensor a16 = Tensor::from_doubles(random_values(size_t(shape_numel(as)), seed++), as, DType::bf16);
        Tensor b16 = Tensor::from_doubles(random_values(size_t(shape_numel(bs)), seed++), bs, DType::bf16);
        Tensor a32 = Tensor::from_doubles(a16.to_doubles(), as, DType::f32);
        Tensor b32 = Tensor::from_doubles(b16.to_doubles(), bs, DType::f32);
        Tensor c = Tensor::zeros(cs, DType::f32), cg = Tensor::zeros(cs, DType::f32, kGpu);
        Tensor ag = a16.to(kGpu), bg = b16.to(kGpu);
        ops::gemm(ta, tb, 1.0, a32, b32, 0.0, c);
        ops::gemm(ta, tb, 1.0, ag, bg, 0.0, cg);
        worst = std::max(worst, max_rel_err(cg.to_doubles(), c.to_doubles()));
      }
  report("gemm", "bf16", worst, 1e-4);
}

TEST(LinalgGpu, OrthonormalizeMatchesCpu) {
  SKIP_WITHOUT_GPU();
  struct Case {
    int64_t batch, m, r;
  };
  const Case cases[] = {{0, 1, 1}, {0, 7, 3}, {0, 100, 33}, {0, 1000, 16}, {3, 33, 7}};
  for (int method = 0; method < 2; ++method)
    for (DType t : kFloatTypes) {
      double worst = 0;
      uint64_t seed = 100;
      for (const Case& c : cases) {
        Shape s = c.batch ? Shape{c.batch, c.m, c.r} : Shape{c.m, c.r};
        Vec v = random_values(size_t(shape_numel(s)), seed++);
        if (method == 0 && c.r > 2)  // a zero column: zeros on both backends
          for (int64_t i = 0; i < shape_numel(s) / c.r; ++i) v[size_t(i * c.r + 1)] = 0;
        Tensor a = Tensor::from_doubles(v, s, t);
        Tensor ag = a.to(kGpu);
        if (method == 0) {
          ops::orthonormalize_mgs(a);
          ops::orthonormalize_mgs(ag);
        } else {
          ops::orthonormalize_qr(a);
          ops::orthonormalize_qr(ag);
        }
        const Vec ref = a.to_doubles();
        worst = std::max(worst, max_rel_err(align_columns(ag.to_doubles(), ref, c.m, c.r), ref));
      }
      report(method == 0 ? "orthonormalize_mgs" : "orthonormalize_qr", std::string(dtype_name(t)), worst,
             t == DType::f64 ? 1e-9 : 1e-4);
    }
}

TEST(LinalgGpu, EighMatchesCpu) {
  SKIP_WITHOUT_GPU();
  struct Case {
    int64_t batch, n;
  };
  // batch > 1 with n <= 32 runs syevjBatched, the others syevd.
  const Case cases[] = {{0, 1}, {0, 7}, {0, 100}, {8, 16}, {5, 32}, {2, 40}};
  for (DType t : kFloatTypes) {
    double worst_w = 0, worst_v = 0;
    uint64_t seed = 200;
    for (const Case& c : cases) {
      const int64_t b = std::max<int64_t>(c.batch, 1);
      Shape s = c.batch ? Shape{c.batch, c.n, c.n} : Shape{c.n, c.n};
      Shape ws = c.batch ? Shape{c.batch, c.n} : Shape{c.n};
      Tensor a = Tensor::from_doubles(random_symmetric(b, c.n, seed, false), s, t);
      seed += 16;
      Tensor w = Tensor::empty(ws, t), v = Tensor::empty(s, t);
      Tensor ag = a.to(kGpu), wg = Tensor::empty(ws, t, kGpu), vg = Tensor::empty(s, t, kGpu);
      ops::eigh(a, w, v);
      ops::eigh(ag, wg, vg);
      const Vec wr = w.to_doubles(), vr = v.to_doubles();
      worst_w = std::max(worst_w, max_rel_err(wg.to_doubles(), wr));
      // Eigenvectors of random symmetric matrices: distinct eigenvalues, defined up to sign.
      worst_v = std::max(worst_v, max_rel_err(align_columns(vg.to_doubles(), vr, c.n, c.n), vr));
    }
    report("eigh_values", std::string(dtype_name(t)), worst_w, t == DType::f64 ? 1e-10 : 1e-4);
    report("eigh_vectors", std::string(dtype_name(t)), worst_v, t == DType::f64 ? 1e-7 : 1e-2);
  }
}

// Eigenvalues w and vectors v of the symmetric matrix s, checked in f64 on the host:
// max |v diag(w) v^T - s| / max |s| (the reconstruction) and max |v^T v - I| (orthonormality),
// the worse of the two, over a batch [B, n, n].
double eigh_residual(const Vec& s, const Vec& w, const Vec& v, int64_t batch, int64_t n) {
  double worst = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const double* sb = s.data() + b * n * n;
    const double* vb = v.data() + b * n * n;
    const double* wb = w.data() + b * n;
    double smax = 0, rec = 0, orth = 0;
    for (int64_t i = 0; i < n * n; ++i) smax = std::max(smax, std::fabs(sb[i]));
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double r = 0, o = 0;
        for (int64_t k = 0; k < n; ++k) {
          r += vb[i * n + k] * wb[k] * vb[j * n + k];
          o += vb[k * n + i] * vb[k * n + j];
        }
        rec = std::max(rec, std::fabs(r - sb[i * n + j]));
        orth = std::max(orth, std::fabs(o - (i == j ? 1.0 : 0.0)));
      }
    worst = std::max({worst, rec / std::max(smax, 1e-300), orth});
  }
  return worst;
}

// eigh with v = a (ops.h allows v to be a itself: the backends copy a before the solver
// overwrites it) against the CPU doing the same, on both solvers of the GPU: syevjBatched (batch > 1,
// n <= 32) and syevd. Each matrix twice: symmetric, then with other values in its strict upper
// triangle, which must change nothing (ops.h: the lower triangle is read). One line per solver and
// variant, so that a failure says which.
// Tolerances: eigenvalues as in EighMatchesCpu (both solvers backward stable: each eigenvalue
// within c n u ||S||_2 of the exact one, u the unit roundoff, and max |w| = ||S||_2); the
// reconstruction and orthonormality errors of a backward-stable solver are c n u ||S||_2 and
// c n u: with n <= 100 and ||S||_2 / max |S| about 2 sqrt(n) / 3.5 (Wigner's semicircle for
// N(0, 1) entries) that is 3.4e-5 in f32 and 6e-14 in f64 for c = 1, so 1e-4 and 1e-11 (the CPU
// gives below 2e-6 and 3e-15 on these matrices); the eigenvectors, after the sign of each column
// is matched, as in EighMatchesCpu.
TEST(LinalgGpu, EighInPlaceMatchesCpu) {
  SKIP_WITHOUT_GPU();
  struct Case {
    int64_t batch, n;
  };
  const Case cases[] = {{0, 1}, {0, 7}, {0, 100}, {8, 16}, {5, 32}, {2, 40}};
  for (DType t : kFloatTypes) {
    const std::string name(dtype_name(t));
    const double res_tol = t == DType::f64 ? 1e-11 : 1e-4;
    for (bool jacobi : {false, true})
      for (bool junk_upper : {false, true}) {
        double worst_w = 0, worst_v = 0, worst_res = 0, worst_cpu_res = 0;
        uint64_t seed = 800;
        for (const Case& c : cases) {
          if ((c.batch > 1 && c.n <= 32) != jacobi) continue;
          const int64_t b = std::max<int64_t>(c.batch, 1), n = c.n;
          const Shape s = c.batch ? Shape{c.batch, n, n} : Shape{n, n};
          const Shape ws = c.batch ? Shape{c.batch, n} : Shape{n};
          // sym: the matrix the lower triangle defines, rounded to t as the solvers see it
          const Vec sym = Tensor::from_doubles(random_symmetric(b, n, seed, false), s, t).to_doubles();
          const Vec junk = random_values(size_t(b * n * n), seed + 100);
          seed += 16;
          Vec av = sym;
          if (junk_upper)
            for (int64_t m = 0; m < b; ++m)
              for (int64_t i = 0; i < n; ++i)
                for (int64_t j = i + 1; j < n; ++j) {
                  const auto at = size_t((m * n + i) * n + j);
                  av[at] = 10 * junk[at];
                }
          Tensor ac = Tensor::from_doubles(av, s, t), wc = Tensor::empty(ws, t);
          Tensor ag = ac.to(kGpu), wg = Tensor::empty(ws, t, kGpu);
          ops::eigh(ac, wc, ac);
          ops::eigh(ag, wg, ag);
          const Vec wr = wc.to_doubles(), vr = ac.to_doubles(), wgv = wg.to_doubles(), vgv = ag.to_doubles();
          worst_w = std::max(worst_w, max_rel_err(wgv, wr));
          worst_v = std::max(worst_v, max_rel_err(align_columns(vgv, vr, n, n), vr));
          worst_res = std::max(worst_res, eigh_residual(sym, wgv, vgv, b, n));
          worst_cpu_res = std::max(worst_cpu_res, eigh_residual(sym, wr, vr, b, n));
        }
        const std::string op = std::string(junk_upper ? "eigh_in_place_lower_only" : "eigh_in_place") + "(" +
                               (jacobi ? "syevjBatched" : "syevd") + ")";
        report(op + "_values", name, worst_w, t == DType::f64 ? 1e-10 : 1e-4);
        report(op + "_vectors", name, worst_v, t == DType::f64 ? 1e-7 : 1e-2);
        report(op + "_residual", name, worst_res, res_tol);
        EXPECT_LE(worst_cpu_res, res_tol) << "the CPU reference itself, " << op << " " << name;
      }
  }
}

// The aliasing eigh refuses, on the GPU as on the CPU (checked before either backend runs): v
// overlapping a without being a, and w overlapping a. a is left as it was.
TEST(LinalgGpu, EighRejectsPartialOverlap) {
  SKIP_WITHOUT_GPU();
  const int64_t n = 6;
  for (Device d : {Device::cpu(), kGpu}) {
    const Tensor buf = Tensor::from_doubles(random_symmetric(1, n + 1, 900, false), {n + 1, n + 1}, DType::f32, d);
    Tensor flat = buf.flatten();
    Tensor a = flat.slice(0, n * n).reshape({n, n}), v = flat.slice(n, n + n * n).reshape({n, n});
    Tensor w = Tensor::empty({n}, DType::f32, d), w_in_a = flat.slice(0, n);
    const Vec before = buf.to_doubles();
    EXPECT_THROW(ops::eigh(a, w, v), UsageError) << d.str();
    EXPECT_THROW(ops::eigh(a, w_in_a, a), UsageError) << d.str();
    EXPECT_EQ(buf.to_doubles(), before) << d.str();
  }
}

TEST(LinalgGpu, InverseRootMatchesCpu) {
  SKIP_WITHOUT_GPU();
  struct Case {
    int64_t batch, n;
    int p;
  };
  const Case cases[] = {{0, 1, 2}, {0, 7, 1}, {0, 33, 2}, {0, 100, 4}, {3, 16, 4}};
  for (ops::RootMethod m : {ops::RootMethod::eigh, ops::RootMethod::newton})
    for (DType t : kFloatTypes) {
      double worst = 0;
      uint64_t seed = 300;
      for (const Case& c : cases) {
        const int64_t b = std::max<int64_t>(c.batch, 1);
        Shape s = c.batch ? Shape{c.batch, c.n, c.n} : Shape{c.n, c.n};
        Tensor a = Tensor::from_doubles(random_symmetric(b, c.n, seed, true), s, t);
        seed += 8;
        ops::RootOptions o;
        o.method = m;
        o.eps = 1e-6;
        o.tolerance = 1e-10;
        Tensor out = Tensor::empty(s, t), outg = Tensor::empty(s, t, kGpu);
        const bool ok = ops::inverse_root(a, c.p, o, out);
        const bool okg = ops::inverse_root(a.to(kGpu), c.p, o, outg);
        EXPECT_TRUE(ok && okg);
        worst = std::max(worst, max_rel_err(outg.to_doubles(), out.to_doubles()));
      }
      report(m == ops::RootMethod::eigh ? "inverse_root_eigh" : "inverse_root_newton", std::string(dtype_name(t)),
             worst, t == DType::f64 ? 1e-9 : 1e-5);
    }
}

TEST(LinalgGpu, InverseRootFailuresMatchCpu) {
  SKIP_WITHOUT_GPU();
  const int64_t n = 7;
  for (ops::RootMethod m : {ops::RootMethod::eigh, ops::RootMethod::newton}) {
    // Both backends read the lower triangle: the NaN goes at (3, 1).
    Vec v = random_symmetric(1, n, 400, true);
    v[3 * n + 1] = std::nan("");
    Tensor a = Tensor::from_doubles(v, {n, n}, DType::f32, kGpu);
    Tensor out = Tensor::from_doubles(Vec(size_t(n * n), 7.0), {n, n}, DType::f32, kGpu);
    ops::RootOptions o;
    o.method = m;
    Tensor out_cpu = Tensor::empty({n, n}, DType::f32);
    EXPECT_FALSE(ops::inverse_root(a.to(Device::cpu()), 2, o, out_cpu));
    EXPECT_FALSE(ops::inverse_root(a, 2, o, out));
    o.eps = 0;
    EXPECT_FALSE(ops::inverse_root(Tensor::zeros({n, n}, DType::f32, kGpu), 2, o, out));
    for (double x : out.to_doubles()) EXPECT_EQ(x, 7.0);
  }
  std::printf("gpu-check: inverse_root_failures f32 max_rel_err=0 tol=0 %s\n",
              ::testing::Test::HasFailure() ? "FAIL" : "PASS");
}

}  // namespace
}  // namespace dtk
