// A plain f64 reference of Distributed Shampoo as optim/shampoo.h defines it, for the tests: one
// block at a time, Kronecker factors by explicit unfolding, inverse roots by a cyclic Jacobi
// eigensolver, preconditioning by explicit mode products. Shared by tests/unit/test_shampoo.cpp
// and tests/mpi/test_shampoo_mpi.cpp.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
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

inline Vec matmul(const Vec& a, const Vec& b, int m, int k, int n) {
  Vec c(size_t(m) * n, 0.0);
  for (int i = 0; i < m; ++i)
    for (int l = 0; l < k; ++l)
      for (int j = 0; j < n; ++j) c[size_t(i) * n + j] += a[size_t(i) * k + l] * b[size_t(l) * n + j];
  return c;
}

// V diag((w + eps + shift)^(-1/p)) V^T from eigenvalue estimates w of F (any order) and V's
// columns, with the shift rule of shampoo.h; ok false when a value is not finite.
inline Vec root_from(const Vec& w, const Vec& V, int n, double eps, double p, bool* ok = nullptr) {
  const double m0 = *std::min_element(w.begin(), w.end()) + eps, shift = m0 < eps ? eps - m0 : 0.0;
  Vec d(static_cast<size_t>(n)), R(static_cast<size_t>(n) * n, 0.0);
  bool good = true;
  for (int j = 0; j < n; ++j) {
    d[size_t(j)] = std::pow(w[size_t(j)] + eps + shift, -1.0 / p);
    good = good && std::isfinite(d[size_t(j)]);
  }
  if (ok) *ok = good;
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) {
      double s = 0;
      for (int k = 0; k < n; ++k) s += V[size_t(i) * n + k] * d[size_t(k)] * V[size_t(j) * n + k];
      R[size_t(i) * n + j] = s;
    }
  return R;
}

// (F + eps I)^(-1/p) with the shift rule of shampoo.h; ok false when a value is not finite.
inline Vec inverse_root(const Vec& F, int n, double eps, double p, bool* ok = nullptr) {
  Vec w, V;
  jacobi_eigh(F, n, w, V);
  return root_from(w, V, n, eps, p, ok);
}

// The columns of X [n, n] orthonormalised in order (modified Gram-Schmidt, twice).
inline Vec orthonormal_columns(Vec X, int n) {
  for (int j = 0; j < n; ++j)
    for (int pass = 0; pass < 2; ++pass) {
      for (int i = 0; i < j; ++i) {
        double d = 0;
        for (int r = 0; r < n; ++r) d += X[size_t(r) * n + i] * X[size_t(r) * n + j];
        for (int r = 0; r < n; ++r) X[size_t(r) * n + j] -= d * X[size_t(r) * n + i];
      }
      double nn = 0;
      for (int r = 0; r < n; ++r) nn += X[size_t(r) * n + j] * X[size_t(r) * n + j];
      nn = std::sqrt(nn);
      for (int r = 0; r < n; ++r) X[size_t(r) * n + j] /= nn;
    }
  return X;
}

// The reference's warm-started eigendecomposition (matrix_functions.py _qr_algorithm) of
// A = F + eps I from the basis Q (columns; all zero: a full eigh), as shampoo.h states it: QR
// iterations Q = qr(A Q) while fewer than max_iter have run and ||B - diag B||_F > tol ||B||_F,
// B = Q^T A Q. Returns the root; Q becomes the new basis, its columns sorted by the estimates,
// descending (dtk) or ascending (the reference).
inline Vec qr_root(const Vec& F, int n, Vec& Q, double eps, double p, int max_iter, double tol, bool descending,
                   bool* ok = nullptr) {
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
  return root_from(w2, Q, n, eps, p, ok);
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

// x times R along dim k (R symmetric [b_k, b_k]).
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

inline double norm(const Vec& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return std::sqrt(s);
}

class Reference {
 public:
  Reference(const optim::ShampooConfig& cfg, const std::vector<Shape>& shapes) : cfg_(cfg) {
    for (const Shape& s : shapes) {
      const auto bl = optim::shampoo_blocking(s, cfg.max_preconditioner_dim);
      std::vector<Block> blocks;
      const Shape st = strides(bl.merged);
      for (size_t i = 0; i < bl.block_shapes.size(); ++i) {
        Block b;
        b.dims = bl.block_shapes[i];
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
        blocks.push_back(std::move(b));
      }
      params_.push_back(std::move(blocks));
    }
    // Root phases (root_spread): by the blocks' root costs, in parameter order.
    std::vector<Shape> dims;
    for (const auto& blocks : params_)
      for (const Block& b : blocks) dims.push_back(b.dims);
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
    for (size_t p = 0; p < params_.size(); ++p) {
      Vec dir(values[p].size(), 0.0);
      for (Block& b : params_[p]) {
        const size_t n = b.elems.size(), K = b.dims.size();
        Vec g(n), w(n);
        for (size_t e = 0; e < n; ++e) g[e] = grads[p][size_t(b.elems[e])], w[e] = values[p][size_t(b.elems[e])];
        const bool l2 = name_of(cfg_.weight_decay_type) == "l2";
        if (l2)  // L2: G += wd W before the statistics, grafting and filtering
          for (size_t e = 0; e < n; ++e) g[e] += cfg_.weight_decay * w[e];
        for (size_t k = 0; k < K; ++k) {
          const Vec gk = unfold_gram(g, b.dims, k);
          for (size_t i = 0; i < gk.size(); ++i)
            b.F[k][i] = cfg_.beta2 == 1 ? b.F[k][i] + gk[i] : cfg_.beta2 * b.F[k][i] + (1 - cfg_.beta2) * gk[i];
        }
        // The reference's rule, phase j shifted by j floor(f / root_spread).
        if (t == start || (t > start && (t - b.phase * shift) % f == 0)) {
          const double pe = cfg_.exponent_override > 0 ? cfg_.exponent_override : 2.0 * K;
          const double corr = cfg_.use_bias_correction && cfg_.beta2 < 1 ? 1 / (1 - std::pow(cfg_.beta2, double(t))) : 1.0;
          for (size_t k = 0; k < K; ++k) {
            Vec Fc = b.F[k];
            for (double& x : Fc) x *= corr;
            bool ok = true;
            const int bk = static_cast<int>(b.dims[k]);
            Vec Qk = b.Q[k];
            Vec R = name_of(cfg_.root_method) == "qr"
                        ? qr_root(Fc, bk, Qk, cfg_.epsilon, pe, cfg_.qr_max_iterations, cfg_.qr_tolerance, true, &ok)
                        : inverse_root(Fc, bk, cfg_.epsilon, pe, &ok);
            b.Q[k] = ok ? Qk : Vec(Qk.size(), 0.0);  // a failed block restarts from a full eigh
            if (ok) b.R[k] = R;
          }
        }
        Vec Mh = g;
        if (cfg_.beta1 > 0) {
          for (size_t e = 0; e < n; ++e) b.M[e] = cfg_.beta1 * b.M[e] + (1 - cfg_.beta1) * g[e];
          Mh = b.M;
          if (cfg_.use_bias_correction)
            for (double& x : Mh) x /= 1 - std::pow(cfg_.beta1, double(t));
        }
        Vec Dg = Mh;
        const std::string gm(name_of(cfg_.grafting));
        if (gm == "adagrad" || gm == "rmsprop" || gm == "adam") {
          const double bg = cfg_.grafting_beta2;
          for (size_t e = 0; e < n; ++e) {
            b.A[e] = gm == "adagrad" ? b.A[e] + g[e] * g[e] : bg * b.A[e] + (1 - bg) * g[e] * g[e];
            const double a = gm == "adam" ? b.A[e] / (1 - std::pow(bg, double(t))) : b.A[e];
            Dg[e] = Mh[e] / (std::sqrt(a) + cfg_.grafting_epsilon);
          }
        }
        Vec D = Dg;
        if (precond) {
          Vec P = Mh;
          for (size_t k = 0; k < K; ++k) P = mode_product(P, b.dims, k, b.R[k]);
          if (gm == "none") {
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

 private:
  struct Block {
    Shape dims;
    std::vector<int64_t> elems;
    std::vector<Vec> F, R, Q;  // Q: the eigenbases (root_method qr)
    Vec M, A, Mom;
    int phase = 0;
  };
  optim::ShampooConfig cfg_;
  std::vector<std::vector<Block>> params_;
  int64_t t_ = 0;
};

}  // namespace dtk::shampoo_ref
