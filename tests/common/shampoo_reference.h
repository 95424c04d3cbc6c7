// A plain f64 reference of Distributed Shampoo and its family as optim/shampoo.h defines them, for
// the tests: one block at a time, Kronecker factors by explicit unfolding, inverse roots and
// eigenbases by a cyclic Jacobi eigensolver, preconditioning by explicit mode products. Besides the
// inverse roots (preconditioner "root", root_method eigh, qr, pseudo-inverse): eigenvalue-corrected
// Shampoo (SOAP; Vyas et al. 2024, Meta's EigenvalueCorrectedShampooPreconditionerList), spectral
// descent (Muon; Jordan et al. 2024, Meta's SpectralDescentPreconditionerList) by Newton-Schulz or
// exactly (one-sided Jacobi SVD), factor updates every K steps, and diagonal parameters. Written
// from the published algorithms and Meta's code (facebookresearch/optimizers,
// distributed_shampoo/preconditioner/), not from dtk's optimizer; where dtk departs from Meta on
// purpose a comment says so. Shared by tests/unit/test_shampoo.cpp and tests/mpi/test_shampoo_mpi.cpp.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "dtk/optim/shampoo.h"

namespace dtk::shampoo_ref {

using Vec = std::vector<double>;

inline Vec random_values(size_t n, uint64_t seed, double scale = 1.0) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> dist(0.0, scale);
  Vec v(n);
  for (double& x : v) x = static_cast<double>(static_cast<float>(dist(gen)));  // f32-representable
  return v;
}

// Symmetric eigendecomposition by cyclic Jacobi: a [n, n] row-major; w ascending, V's columns
// the eigenvectors.
inline void jacobi_eigh(Vec a, int n, Vec& w, Vec& V) {
  V.assign(size_t(n) * n, 0.0);
  for (int i = 0; i < n; ++i) V[size_t(i) * n + i] = 1.0;
  auto A = [&](int i, int j) -> double& { return a[size_t(i) * n + j]; };
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0, total = 0;
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < n; ++j) {
        total += A(i, j) * A(i, j);
        if (i != j) off += A(i, j) * A(i, j);
      }
    if (off <= 1e-30 * total || off == 0) break;
    for (int p = 0; p < n; ++p)
      for (int q = p + 1; q < n; ++q) {
        if (A(p, q) == 0) continue;
        const double theta = (A(q, q) - A(p, p)) / (2 * A(p, q));
        const double t = (theta >= 0 ? 1.0 : -1.0) / (std::fabs(theta) + std::sqrt(theta * theta + 1));
        const double c = 1 / std::sqrt(t * t + 1), s = t * c;
        for (int k = 0; k < n; ++k) {  // columns p, q
          const double akp = A(k, p), akq = A(k, q);
          A(k, p) = c * akp - s * akq;
          A(k, q) = s * akp + c * akq;
        }
        for (int k = 0; k < n; ++k) {  // rows p, q
          const double apk = A(p, k), aqk = A(q, k);
          A(p, k) = c * apk - s * aqk;
          A(q, k) = s * apk + c * aqk;
        }
        for (int k = 0; k < n; ++k) {
          const double vkp = V[size_t(k) * n + p], vkq = V[size_t(k) * n + q];
          V[size_t(k) * n + p] = c * vkp - s * vkq;
          V[size_t(k) * n + q] = s * vkp + c * vkq;
        }
      }
  }
  std::vector<std::pair<double, int>> order;
  for (int i = 0; i < n; ++i) order.push_back({A(i, i), i});
  std::sort(order.begin(), order.end());
  Vec V2(V.size());
  w.assign(size_t(n), 0.0);
  for (int j = 0; j < n; ++j) {
    w[size_t(j)] = order[size_t(j)].first;
    for (int i = 0; i < n; ++i) V2[size_t(i) * n + j] = V[size_t(i) * n + order[size_t(j)].second];
  }
  V = V2;
}

inline Vec identity(int n) {
  Vec I(size_t(n) * n, 0.0);
  for (int i = 0; i < n; ++i) I[size_t(i) * n + i] = 1.0;
  return I;
}

inline Vec matmul(const Vec& a, const Vec& b, int m, int k, int n) {
  Vec c(size_t(m) * n, 0.0);
  for (int i = 0; i < m; ++i)
    for (int l = 0; l < k; ++l)
      for (int j = 0; j < n; ++j) c[size_t(i) * n + j] += a[size_t(i) * k + l] * b[size_t(l) * n + j];
  return c;
}

inline double norm(const Vec& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return std::sqrt(s);
}

// V diag(d) V^T (V's columns the eigenvectors).
inline Vec v_diag_vt(const Vec& V, const Vec& d, int n) {
  Vec R(static_cast<size_t>(n) * n, 0.0);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) {
      double s = 0;
      for (int k = 0; k < n; ++k) s += V[size_t(i) * n + k] * d[size_t(k)] * V[size_t(j) * n + k];
      R[size_t(i) * n + j] = s;
    }
  return R;
}

// V diag((w + eps + shift)^(-1/p)) V^T from eigenvalue estimates w of F (any order) and V's
// columns, with the shift rule of shampoo.h; ok false when a value is not finite.
inline Vec root_from(const Vec& w, const Vec& V, int n, double eps, double p, bool* ok = nullptr) {
  const double m0 = *std::min_element(w.begin(), w.end()) + eps, shift = m0 < eps ? eps - m0 : 0.0;
  Vec d(static_cast<size_t>(n));
  bool good = true;
  for (int j = 0; j < n; ++j) {
    d[size_t(j)] = std::pow(w[size_t(j)] + eps + shift, -1.0 / p);
    good = good && std::isfinite(d[size_t(j)]);
  }
  if (ok) *ok = good;
  return v_diag_vt(V, d, n);
}

// (F + eps I)^(-1/p) with the shift rule of shampoo.h; ok false when a value is not finite.
inline Vec inverse_root(const Vec& F, int n, double eps, double p, bool* ok = nullptr) {
  Vec w, V;
  jacobi_eigh(F, n, w, V);
  return root_from(w, V, n, eps, p, ok);
}

// The columns of X [rows, cols] (cols <= rows) orthonormalised in order (modified Gram-Schmidt,
// twice; a thin QR's Q up to column signs); a zero column stays zero.
inline Vec orthonormal_columns(Vec X, int rows, int cols) {
  for (int j = 0; j < cols; ++j)
    for (int pass = 0; pass < 2; ++pass) {
      for (int i = 0; i < j; ++i) {
        double d = 0;
        for (int r = 0; r < rows; ++r) d += X[size_t(r) * cols + i] * X[size_t(r) * cols + j];
        for (int r = 0; r < rows; ++r) X[size_t(r) * cols + j] -= d * X[size_t(r) * cols + i];
      }
      double nn = 0;
      for (int r = 0; r < rows; ++r) nn += X[size_t(r) * cols + j] * X[size_t(r) * cols + j];
      nn = std::sqrt(nn);
      if (nn > 0)
        for (int r = 0; r < rows; ++r) X[size_t(r) * cols + j] /= nn;
    }
  return X;
}
inline Vec orthonormal_columns(Vec X, int n) { return orthonormal_columns(std::move(X), n, n); }

// The reference's warm-started eigendecomposition (matrix_functions.py _qr_algorithm) of
// A = F + eps I from the basis Q (columns; all zero: a full eigh), as shampoo.h states it: QR
// iterations Q = qr(A Q) while fewer than max_iter have run and ||B - diag B||_F > tol ||B||_F,
// B = Q^T A Q. Q becomes the new basis, its columns sorted by the estimates, descending (dtk's
// roots) or ascending (the reference; dtk's eigenvalue-corrected bases); returns the estimates of
// F's eigenvalues in Q's order.
inline Vec qr_basis(const Vec& F, int n, Vec& Q, double eps, int max_iter, double tol, bool descending) {
  Vec w(static_cast<size_t>(n));
  const bool fresh = std::all_of(Q.begin(), Q.end(), [](double x) { return x == 0; });
  if (fresh) {
    jacobi_eigh(F, n, w, Q);
  } else {
    Vec A = F;
    for (int i = 0; i < n; ++i) A[size_t(i) * n + i] += eps;
    auto estimate = [&] {
      Vec AQ = matmul(A, Q, n, n, n), B(size_t(n) * n, 0.0);
      for (int i = 0; i < n; ++i)
        for (int j = 0; j < n; ++j)
          for (int r = 0; r < n; ++r) B[size_t(i) * n + j] += Q[size_t(r) * n + i] * AQ[size_t(r) * n + j];
      return B;
    };
    Vec B = estimate();
    for (int it = 0; it < max_iter; ++it) {
      double off = 0, all = 0;
      for (int i = 0; i < n; ++i)
        for (int j = 0; j < n; ++j) {
          all += B[size_t(i) * n + j] * B[size_t(i) * n + j];
          if (i != j) off += B[size_t(i) * n + j] * B[size_t(i) * n + j];
        }
      if (std::sqrt(off) <= tol * std::sqrt(all)) break;
      Q = orthonormal_columns(matmul(A, Q, n, n, n), n);
      B = estimate();
    }
    for (int j = 0; j < n; ++j) w[size_t(j)] = B[size_t(j) * n + j] - eps;
  }
  std::vector<int> order(static_cast<size_t>(n));
  for (int j = 0; j < n; ++j) order[size_t(j)] = j;
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return descending ? w[size_t(a)] > w[size_t(b)] : w[size_t(a)] < w[size_t(b)]; });
  Vec Q2(Q.size()), w2(w.size());
  for (int j = 0; j < n; ++j) {
    w2[size_t(j)] = w[size_t(order[size_t(j)])];
    for (int i = 0; i < n; ++i) Q2[size_t(i) * n + j] = Q[size_t(i) * n + order[size_t(j)]];
  }
  Q = Q2;
  return w2;
}

// The root of qr_basis's estimates and basis (the shift rule of shampoo.h).
inline Vec qr_root(const Vec& F, int n, Vec& Q, double eps, double p, int max_iter, double tol, bool descending,
                   bool* ok = nullptr) {
  const Vec w = qr_basis(F, n, Q, eps, max_iter, tol, descending);
  return root_from(w, Q, n, eps, p, ok);
}

// The machine epsilon of a factor dtype (f32 or f64).
inline double machine_eps(DType t) { return t == DType::f64 ? 0x1p-52 : 0x1p-23; }

// The pseudo-inverse root of F (Meta's matrix_inverse_root_from_eigendecomposition with
// PseudoInverseConfig, torch.linalg.matrix_rank's cutoff): w = eig(F), no eps, no shift; cutoff
// c = max(atol, rtol max(max w, 0)), rtol < 0: n times the machine epsilon of the factor dtype;
// V diag(d) V^T with d_j = w_j^(-1/p) where w_j > c, else 0.
inline Vec pseudo_inverse_root(const Vec& F, int n, double p, double rtol, double atol, DType factor_dtype,
                               bool* ok = nullptr) {
  Vec w, V;
  jacobi_eigh(F, n, w, V);
  const double rt = rtol >= 0 ? rtol : n * machine_eps(factor_dtype);
  const double cut = std::max(atol, rt * std::max(*std::max_element(w.begin(), w.end()), 0.0));
  Vec d(static_cast<size_t>(n), 0.0);
  bool good = true;
  for (int j = 0; j < n; ++j) {
    d[size_t(j)] = w[size_t(j)] > cut ? std::pow(w[size_t(j)], -1.0 / p) : 0.0;
    good = good && std::isfinite(d[size_t(j)]);
  }
  if (ok) *ok = good;
  return v_diag_vt(V, d, n);
}

// a [r, c] transposed: [c, r].
inline Vec transpose(const Vec& a, int r, int c) {
  Vec t(a.size());
  for (int i = 0; i < r; ++i)
    for (int j = 0; j < c; ++j) t[size_t(j) * r + i] = a[size_t(i) * c + j];
  return t;
}

// The thin SVD M = U diag(s) V^T of M [r, c], r >= c, by one-sided Jacobi (Hestenes): rotate pairs
// of columns of M (and of V = I) until every pair is orthogonal; then s_j = ||column j||,
// U's column j = column j / s_j (0 when s_j = 0). U [r, c], s [c] (any order), V [c, c].
inline void jacobi_svd(Vec A, int r, int c, Vec& U, Vec& s, Vec& V) {
  V.assign(size_t(c) * c, 0.0);
  for (int j = 0; j < c; ++j) V[size_t(j) * c + j] = 1.0;
  auto col_dot = [&](int p, int q) {
    double d = 0;
    for (int i = 0; i < r; ++i) d += A[size_t(i) * c + p] * A[size_t(i) * c + q];
    return d;
  };
  for (int sweep = 0; sweep < 100; ++sweep) {
    bool rotated = false;
    for (int p = 0; p < c; ++p)
      for (int q = p + 1; q < c; ++q) {
        const double alpha = col_dot(p, p), beta = col_dot(q, q), gamma = col_dot(p, q);
        if (gamma == 0 || std::fabs(gamma) <= 1e-15 * std::sqrt(alpha * beta)) continue;
        rotated = true;
        const double zeta = (beta - alpha) / (2 * gamma);
        const double t = (zeta >= 0 ? 1.0 : -1.0) / (std::fabs(zeta) + std::sqrt(1 + zeta * zeta));
        const double cs = 1 / std::sqrt(1 + t * t), sn = cs * t;
        for (int i = 0; i < r; ++i) {
          const double ap = A[size_t(i) * c + p], aq = A[size_t(i) * c + q];
          A[size_t(i) * c + p] = cs * ap - sn * aq;
          A[size_t(i) * c + q] = sn * ap + cs * aq;
        }
        for (int i = 0; i < c; ++i) {
          const double vp = V[size_t(i) * c + p], vq = V[size_t(i) * c + q];
          V[size_t(i) * c + p] = cs * vp - sn * vq;
          V[size_t(i) * c + q] = sn * vp + cs * vq;
        }
      }
    if (!rotated) break;
  }
  s.assign(size_t(c), 0.0);
  U.assign(size_t(r) * c, 0.0);
  for (int j = 0; j < c; ++j) {
    s[size_t(j)] = std::sqrt(col_dot(j, j));
    if (s[size_t(j)] > 0)
      for (int i = 0; i < r; ++i) U[size_t(i) * c + j] = A[size_t(i) * c + j] / s[size_t(j)];
  }
}

// The singular values of M [r, c] (one-sided Jacobi on M or M^T), descending.
inline Vec singular_values(const Vec& M, int r, int c) {
  Vec U, s, V;
  if (r >= c) jacobi_svd(M, r, c, U, s, V);
  else jacobi_svd(transpose(M, r, c), c, r, U, s, V);
  std::sort(s.begin(), s.end(), std::greater<double>());
  return s;
}

// spectral_method exact: U V^T of M's thin SVD [r, c], the singular values at or below
// max(r, c) eps max s dropped, eps the machine epsilon of the block's dtype (f32: the parameters'
// and so the filtered gradient's; Meta's svd_orthogonalization keeps every one). Without the
// cutoff the f32 rounding of a rank-deficient block (a one-example gradient u v^T) would come
// back as singular values 1. By one-sided Jacobi: independent of Newton-Schulz and of an eigh of
// M^T M.
inline Vec orth_exact(const Vec& M, int r, int c, double eps = 0x1p-23) {
  const bool tall = r >= c;
  const int m = tall ? r : c, n = tall ? c : r;  // work on the tall one, [m, n]
  Vec U, s, V;
  jacobi_svd(tall ? M : transpose(M, r, c), m, n, U, s, V);
  const double cut = std::max(r, c) * eps * *std::max_element(s.begin(), s.end());
  Vec O(size_t(m) * n, 0.0);  // U V^T, [m, n]
  for (int j = 0; j < n; ++j) {
    if (!(s[size_t(j)] > cut)) continue;
    for (int i = 0; i < m; ++i)
      for (int k = 0; k < n; ++k) O[size_t(i) * n + k] += U[size_t(i) * n + j] * V[size_t(k) * n + j];
  }
  return tall ? O : transpose(O, m, n);
}

// spectral_method newton-schulz, as Meta's matrix_functions.py newton_schulz (Muon's quintic
// iteration): X = M / max(||M||_F, 1e-8), transposed to tall ([max, min]); steps times
// B = X^T X, B = b B + c B B, X = a X + X B with (a, b, c) = (3.4445, -4.7750, 2.0315); transposed
// back. (shampoo.h states the same iteration on the wide form, A = X X^T, X = a X + B X: the
// same polynomial X p(X^T X) = p(X X^T) X.)
inline Vec newton_schulz(const Vec& M, int r, int c, int steps) {
  const double a = 3.4445, bq = -4.7750, cq = 2.0315;
  const double scale = std::max(norm(M), 1e-8);
  const bool tr = r < c;
  const int m = tr ? c : r, n = tr ? r : c;  // X [m, n], m >= n
  Vec X = tr ? transpose(M, r, c) : M;
  for (double& x : X) x /= scale;
  for (int it = 0; it < steps; ++it) {
    const Vec B0 = matmul(transpose(X, m, n), X, n, m, n);  // X^T X [n, n]
    const Vec BB = matmul(B0, B0, n, n, n);
    Vec B(B0.size());
    for (size_t i = 0; i < B.size(); ++i) B[i] = bq * B0[i] + cq * BB[i];
    const Vec XB = matmul(X, B, m, n, n);
    for (size_t i = 0; i < X.size(); ++i) X[i] = a * X[i] + XB[i];
  }
  return tr ? transpose(X, m, n) : X;
}

// The spectral preconditioner's blocking (shampoo.h, "spectral"): size-1 dims dropped; a parameter
// left with >= 2 dims is viewed as [d0, product of the rest] (Muon's view(d0, -1); Meta instead
// blocks as Shampoo does and needs target_parameter_dimensionality 2), every dim then split into
// blocks of at most max_dim (the last one the remainder); 1-D and scalars as Shampoo's blocking.
inline optim::ShampooBlocking spectral_blocking(const Shape& shape, int64_t max_dim) {
  Shape kept;
  for (int64_t d : shape)
    if (d != 1) kept.push_back(d);
  if (kept.size() < 2 || shape_numel(shape) == 0) return optim::shampoo_blocking(shape, max_dim);
  optim::ShampooBlocking bl;
  bl.merged = {kept[0], shape_numel(kept) / kept[0]};
  std::vector<std::vector<int64_t>> starts(2);
  for (size_t d = 0; d < 2; ++d)
    for (int64_t o = 0; o < bl.merged[d]; o += max_dim) starts[d].push_back(o);
  for (int64_t o0 : starts[0])
    for (int64_t o1 : starts[1]) {
      bl.block_shapes.push_back({std::min(max_dim, bl.merged[0] - o0), std::min(max_dim, bl.merged[1] - o1)});
      bl.offsets.push_back({o0, o1});
    }
  return bl;
}

inline Shape strides(const Shape& s) {
  Shape st(s.size(), 1);
  for (size_t i = s.size(); i-- > 1;) st[i - 1] = st[i] * s[i];
  return st;
}

// The multi-index of element e of a row-major tensor of shape s.
inline std::vector<int64_t> unravel(int64_t e, const Shape& s) {
  std::vector<int64_t> idx(s.size());
  for (size_t i = s.size(); i-- > 0;) {
    idx[i] = e % s[i];
    e /= s[i];
  }
  return idx;
}

// G_(k) G_(k)^T: [b_k, b_k].
inline Vec unfold_gram(const Vec& x, const Shape& dims, size_t k) {
  const int64_t b = dims[k], n = static_cast<int64_t>(x.size());
  Vec out(size_t(b * b), 0.0);
  const Shape st = strides(dims);
  for (int64_t e = 0; e < n; ++e) {
    const auto idx = unravel(e, dims);
    const int64_t base = e - idx[k] * st[k];
    for (int64_t j = 0; j < b; ++j) out[size_t(idx[k] * b + j)] += x[size_t(e)] * x[size_t(base + j * st[k])];
  }
  return out;
}

// x times R along dim k: y[.., i, ..] = sum_j R[i, j] x[.., j, ..] (R [b_k, b_k]).
inline Vec mode_product(const Vec& x, const Shape& dims, size_t k, const Vec& R) {
  const int64_t b = dims[k], n = static_cast<int64_t>(x.size());
  Vec y(x.size(), 0.0);
  const Shape st = strides(dims);
  for (int64_t e = 0; e < n; ++e) {
    const auto idx = unravel(e, dims);
    const int64_t base = e - idx[k] * st[k];
    double s = 0;
    for (int64_t j = 0; j < b; ++j) s += R[size_t(idx[k] * b + j)] * x[size_t(base + j * st[k])];
    y[size_t(e)] = s;
  }
  return y;
}

// The optimizer of shampoo.h over parameters of these shapes (and names: diagonal_params), one
// block at a time. Per block, by its kind:
//   roots:     today's Shampoo (root_method eigh, qr, pseudo-inverse; newton is checked as eigh);
//   corrected: eigenvalue-corrected Shampoo (SOAP): Adam in the factors' eigenbases;
//   spectral:  the orthogonalised filtered gradient of an order-2 block (Muon);
//   diagonal:  the grafting direction alone (diagonal_params; spectral's blocks of order != 2).
class Reference {
 public:
  Reference(const optim::ShampooConfig& cfg, const std::vector<Shape>& shapes, const std::vector<std::string>& names = {})
      : cfg_(cfg) {
    const std::string pre(name_of(cfg.preconditioner));
    for (size_t pi = 0; pi < shapes.size(); ++pi) {
      const Shape& s = shapes[pi];
      bool diagonal = false;
      for (const std::string& d : cfg.diagonal_params)
        diagonal = diagonal || (pi < names.size() && names[pi].find(d) != std::string::npos);
      const auto bl = pre == "spectral" ? spectral_blocking(s, cfg.max_preconditioner_dim)
                                        : optim::shampoo_blocking(s, cfg.max_preconditioner_dim);
      std::vector<Block> blocks;
      const Shape st = strides(bl.merged);
      for (size_t i = 0; i < bl.block_shapes.size(); ++i) {
        Block b;
        b.dims = bl.block_shapes[i];
        b.kind = diagonal || pre == "dion" ? Kind::diagonal  // dion: its matrices are dion_reference.h's
                 : pre == "spectral"     ? (b.dims.size() == 2 ? Kind::spectral : Kind::diagonal)
                 : pre == "root"         ? Kind::roots
                                         : Kind::corrected;
        const int64_t n = shape_numel(b.dims);
        for (int64_t e = 0; e < n; ++e) {
          const auto idx = unravel(e, b.dims);
          int64_t flat = 0;
          for (size_t d = 0; d < idx.size(); ++d) flat += (bl.offsets[i][d] + idx[d]) * st[d];
          b.elems.push_back(flat);
        }
        for (int64_t d : b.dims) {
          b.F.push_back(Vec(size_t(d * d), 0.0));
          Vec I(size_t(d * d), 0.0);
          for (int64_t j = 0; j < d; ++j) I[size_t(j * d + j)] = 1.0;
          b.R.push_back(I);
        }
        b.Q.assign(b.dims.size(), Vec());
        for (size_t k = 0; k < b.dims.size(); ++k) b.Q[k].assign(size_t(b.dims[k] * b.dims[k]), 0.0);
        b.M.assign(size_t(n), 0.0);
        b.A.assign(size_t(n), 0.0);
        b.Mom.assign(size_t(n), 0.0);
        b.V.assign(size_t(n), 0.0);
        blocks.push_back(std::move(b));
      }
      params_.push_back(std::move(blocks));
    }
    // Root phases (root_spread): by the blocks' root costs, in parameter order; a block without
    // factors (diagonal, spectral) costs nothing, as a scalar.
    std::vector<Shape> dims;
    for (const auto& blocks : params_)
      for (const Block& b : blocks) dims.push_back(b.kind == Kind::roots || b.kind == Kind::corrected ? b.dims : Shape{});
    const std::vector<int> phases = optim::shampoo_root_phases(dims, cfg.root_spread);
    size_t i = 0;
    for (auto& blocks : params_)
      for (Block& b : blocks) b.phase = phases[i++];
  }

  void step(std::vector<Vec>& values, const std::vector<Vec>& grads, double lr) {
    const int64_t t = ++t_;
    const int64_t start = cfg_.start_preconditioning_step == -1 ? cfg_.precondition_frequency : cfg_.start_preconditioning_step;
    // distributed_shampoo.py: (step % frequency == 0 and step > start) or step == start.
    const int64_t f = cfg_.precondition_frequency, shift = f / cfg_.root_spread;
    const bool precond = t >= start;
    // factor_update_every K (Google's statistics_compute_steps; a departure from Meta): the factors
    // take the gradients of steps 1, K + 1, 2K + 1, ... only; their bias correction counts those.
    const int64_t K_every = cfg_.factor_update_every;
    const bool update_factors = (t - 1) % K_every == 0;
    const double u = double((t - 1) / K_every + 1);
    const double corr = cfg_.use_bias_correction && cfg_.beta2 < 1 ? 1 / (1 - std::pow(cfg_.beta2, u)) : 1.0;
    const std::string gm(name_of(cfg_.grafting)), method(name_of(cfg_.root_method));
    for (size_t p = 0; p < params_.size(); ++p) {
      Vec dir(values[p].size(), 0.0);
      for (Block& b : params_[p]) {
        const size_t n = b.elems.size(), K = b.dims.size();
        Vec g(n), w(n);
        for (size_t e = 0; e < n; ++e) g[e] = grads[p][size_t(b.elems[e])], w[e] = values[p][size_t(b.elems[e])];
        const bool l2 = name_of(cfg_.weight_decay_type) == "l2";
        if (l2)  // L2: G += wd W before the statistics, grafting and filtering
          for (size_t e = 0; e < n; ++e) g[e] += cfg_.weight_decay * w[e];
        const bool factored = b.kind == Kind::roots || b.kind == Kind::corrected;
        if (factored && update_factors)
          for (size_t k = 0; k < K; ++k) {
            const Vec gk = unfold_gram(g, b.dims, k);
            for (size_t i = 0; i < gk.size(); ++i)
              b.F[k][i] = cfg_.beta2 == 1 ? b.F[k][i] + gk[i] : cfg_.beta2 * b.F[k][i] + (1 - cfg_.beta2) * gk[i];
          }
        // The reference's rule, phase j shifted by j floor(f / root_spread).
        const bool root_step = t == start || (t > start && (t - b.phase * shift) % f == 0);
        if (factored && root_step) {
          const double pe = cfg_.exponent_override > 0 ? cfg_.exponent_override : 2.0 * K;
          for (size_t k = 0; k < K; ++k) {
            Vec Fc = b.F[k];
            for (double& x : Fc) x *= corr;
            const int bk = static_cast<int>(b.dims[k]);
            if (b.kind == Kind::corrected) {
              // The eigenbasis of F / bc (of F / bc + eps I: the same vectors), as Meta's
              // EigenvalueCorrectedShampooKroneckerFactorsUnwrapped._amortized_computation: eigh
              // (columns by ascending eigenvalue, Meta's order), or qr (DefaultSOAPConfig): QR
              // iterations warm-started from the stored basis, the identity the first time
              // (shampoo_preconditioner_list.py: factor_matrix_eigenvectors start as I), columns
              // by ascending estimate, stable (matrix_functions.py _compute_orthogonal_iterations).
              if (method == "qr") {
                if (!b.has_basis) b.Q[k] = identity(bk);
                qr_basis(Fc, bk, b.Q[k], cfg_.epsilon, cfg_.qr_max_iterations, cfg_.qr_tolerance, false);
              } else {
                Vec ev;
                jacobi_eigh(Fc, bk, ev, b.Q[k]);
              }
              continue;
            }
            bool ok = true;
            Vec Qk = b.Q[k];
            Vec R = method == "qr" ? qr_root(Fc, bk, Qk, cfg_.epsilon, pe, cfg_.qr_max_iterations, cfg_.qr_tolerance, true, &ok)
                    : method == "pseudo-inverse"
                        ? pseudo_inverse_root(Fc, bk, pe, cfg_.rank_rtol, cfg_.rank_atol, cfg_.factor_dtype, &ok)
                        : inverse_root(Fc, bk, cfg_.epsilon, pe, &ok);
            b.Q[k] = ok ? Qk : Vec(Qk.size(), 0.0);  // a failed block restarts from a full eigh
            if (ok) b.R[k] = R;
          }
          if (b.kind == Kind::corrected) b.has_basis = true;
        }
        Vec Mh = g;
        if (cfg_.beta1 > 0) {
          for (size_t e = 0; e < n; ++e) b.M[e] = cfg_.beta1 * b.M[e] + (1 - cfg_.beta1) * g[e];
          Mh = b.M;
          if (cfg_.use_bias_correction)
            for (double& x : Mh) x /= 1 - std::pow(cfg_.beta1, double(t));
        }
        Vec Dg = Mh;
        if (gm == "adagrad" || gm == "rmsprop" || gm == "adam") {
          const double bg = cfg_.grafting_beta2;
          for (size_t e = 0; e < n; ++e) {
            b.A[e] = gm == "adagrad" ? b.A[e] + g[e] * g[e] : bg * b.A[e] + (1 - bg) * g[e] * g[e];
            const double a = gm == "adam" ? b.A[e] / (1 - std::pow(bg, double(t))) : b.A[e];
            Dg[e] = Mh[e] / (std::sqrt(a) + cfg_.grafting_epsilon);
          }
        }
        // P, the block's ungrafted direction, where it has one.
        bool has_p = false;
        Vec P;
        if (b.kind == Kind::roots && precond) {
          P = Mh;
          for (size_t k = 0; k < K; ++k) P = mode_product(P, b.dims, k, b.R[k]);
          has_p = true;
        } else if (b.kind == Kind::corrected) {
          // SOAP: the corrected second moment of the raw gradient rotated into the bases (Q^T on
          // every mode; I before the first basis), every step, with this step's bases (Meta's
          // EigenvalueCorrectedShampooPreconditionerList.update_preconditioners).
          const double b2 = cfg_.ec_beta2 < 0 ? cfg_.beta2 : cfg_.ec_beta2;
          const Vec Gr = rotate(g, b, false);
          for (size_t e = 0; e < n; ++e)
            b.V[e] = b2 == 1 ? b.V[e] + Gr[e] * Gr[e] : b2 * b.V[e] + (1 - b2) * Gr[e] * Gr[e];
          if (precond || gm == "none") {  // before the start: the grafting direction, if any
            const double bc2 = cfg_.use_bias_correction && b2 < 1 ? 1 - std::pow(b2, double(t)) : 1.0;
            const double e2 = cfg_.ec_epsilon < 0 ? cfg_.epsilon : cfg_.ec_epsilon;
            Vec Pr = rotate(Mh, b, false);
            for (size_t e = 0; e < n; ++e) Pr[e] /= std::sqrt(b.V[e] / bc2) + e2;
            P = rotate(Pr, b, true);
            has_p = true;
          }
        } else if (b.kind == Kind::spectral) {
          // Muon: the orthogonalised block, scaled by its shape (Meta's scale_by_dims_fn(d_in = c,
          // d_out = r)); dtk's default scale is Muon's max(1, r/c)^(1/2) (Meta's default: 1).
          const int r = static_cast<int>(b.dims[0]), c = static_cast<int>(b.dims[1]);
          P = name_of(cfg_.spectral_method) == "exact" ? orth_exact(Mh, r, c) : newton_schulz(Mh, r, c, cfg_.newton_schulz_steps);
          const std::string sc(name_of(cfg_.spectral_scale));
          const double scale = sc == "muon" || sc == "auto" ? std::sqrt(std::max(1.0, double(r) / double(c)))
                               : sc == "rms" ? 0.2 * std::sqrt(double(std::max(r, c)))
                               : sc == "fan" ? std::sqrt(double(r) / double(c))
                                             : 1.0;
          for (double& x : P) x *= scale;
          has_p = true;
        }
        Vec D = Dg;
        if (has_p) {
          if (gm == "none" || name_of(cfg_.grafting_scope) == std::string("diagonal")) {  // ungrafted
            D = P;
          } else {
            const double np = norm(P), s = np > 0 ? norm(Dg) / np : 0.0;
            for (size_t e = 0; e < n; ++e) D[e] = P[e] * s;
          }
        }
        if (!l2)  // decoupled: P += wd W, before momentum (it enters the momentum buffer)
          for (size_t e = 0; e < n; ++e) D[e] += cfg_.weight_decay * w[e];
        if (cfg_.momentum > 0)
          for (size_t e = 0; e < n; ++e) {
            b.Mom[e] = cfg_.momentum * b.Mom[e] + D[e];
            D[e] = cfg_.nesterov ? D[e] + cfg_.momentum * b.Mom[e] : b.Mom[e];
          }
        for (size_t e = 0; e < n; ++e) dir[size_t(b.elems[e])] = D[e];
      }
      for (size_t e = 0; e < values[p].size(); ++e)
        values[p][e] -= lr * dir[e];
    }
  }

  // The state of block i of parameter p: its factor k, its eigenbasis k (eigenvalue-corrected;
  // zero before the first), its corrected second moment.
  const Vec& factor(size_t p, size_t i, size_t k) const { return params_[p][i].F[k]; }
  const Vec& basis(size_t p, size_t i, size_t k) const { return params_[p][i].Q[k]; }
  const Vec& corrected_second_moment(size_t p, size_t i) const { return params_[p][i].V; }
  size_t blocks(size_t p) const { return params_[p].size(); }
  const Shape& block_dims(size_t p, size_t i) const { return params_[p][i].dims; }

 private:
  enum class Kind { roots, corrected, spectral, diagonal };
  struct Block {
    Shape dims;
    Kind kind = Kind::roots;
    std::vector<int64_t> elems;
    std::vector<Vec> F, R, Q;  // Q: the eigenbases (root_method qr; eigenvalue-corrected)
    bool has_basis = false;    // eigenvalue-corrected: Q computed (else the rotations use I)
    Vec M, A, Mom, V;          // V: the corrected second moment
    int phase = 0;
  };
  // x rotated into the block's eigenbases (x times Q_k^T along every dim k) or back (times Q_k).
  static Vec rotate(Vec x, const Block& b, bool back) {
    if (!b.has_basis) return x;
    for (size_t k = 0; k < b.dims.size(); ++k) {
      const int bk = static_cast<int>(b.dims[k]);
      x = mode_product(x, b.dims, k, back ? b.Q[k] : transpose(b.Q[k], bk, bk));
    }
    return x;
  }
  optim::ShampooConfig cfg_;
  std::vector<std::vector<Block>> params_;
  int64_t t_ = 0;
};

}  // namespace dtk::shampoo_ref
