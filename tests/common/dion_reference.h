// An independent float64 Dion (Ahn et al. 2025, Algorithm 1; microsoft/dion's
// dion_reference.py, dion_update with power_iters 1), written from the paper and the reference
// code, not from dtk: one matrix X [m, n] with its buffer M and right factor Q, run on M^T when
// m < n (the reference's transposition: P on the longer side). The orthonormalisation is thin QR
// by modified Gram-Schmidt (twice; shampoo_reference.h): its columns differ from a Householder QR's or the
// reference's randomized Cholesky QR only in sign, which the update P Q^T, the error feedback
// P R^T and the next step's product M Q do not see.
#pragma once
#include <cmath>
#include <vector>

#include "shampoo_reference.h"  // orthonormal_columns

namespace dion_ref {

using Vec = std::vector<double>;

class Matrix {
 public:
  // q0: the initial right factor, [b, r] row-major (b = n, or m when m < n).
  Matrix(int m, int n, int r, Vec q0, double mu, double scale) : m_(m), n_(n), r_(r), mu_(mu), scale_(scale), q_(std::move(q0)) {
    t_ = m < n;
    a_ = t_ ? n : m;
    b_ = t_ ? m : n;
    M_.assign(size_t(a_) * size_t(b_), 0.0);
  }

  // One step. grads: each replica's own estimate of the mean gradient ([m, n] each; one for a
  // single process); wd with decoupled: X (1 - lr wd); l2: wd X added to every M_i.
  void step(Vec& X, const std::vector<Vec>& grads, double lr, double wd, bool decoupled) {
    const size_t W = grads.size();
    if (Mi_.size() != W) Mi_.assign(W, M_);
    // M_i += G_i (+ wd X), oriented.
    for (size_t w = 0; w < W; ++w)
      for (int i = 0; i < m_; ++i)
        for (int j = 0; j < n_; ++j) {
          const double g = grads[w][size_t(i) * n_ + j] + (decoupled ? 0.0 : wd * X[size_t(i) * n_ + j]);
          Mi_[w][at(i, j)] += g;
        }
    // P = mean_i(M_i Q) [a, r], orthonormalised.
    Vec P = mean_product(q_, false);
    bool zero = true;
    for (double v : P) zero = zero && v == 0.0;
    P = dtk::shampoo_ref::orthonormal_columns(P, a_, r_);
    // R = mean_i(M_i^T P) [b, r].
    Vec R = mean_product(P, true);
    if (zero) {  // the reference's guard: M all zero gives P = 0, and R = the old Q
      for (double& v : P) v = 0.0;
      R = q_;
    }
    // Error feedback on every M_i: M_i -= (1 - mu) P R^T.
    for (auto& Mi : Mi_)
      for (int i = 0; i < a_; ++i)
        for (int j = 0; j < b_; ++j) {
          double s = 0;
          for (int k = 0; k < r_; ++k) s += P[size_t(i) * r_ + k] * R[size_t(j) * r_ + k];
          Mi[size_t(i) * b_ + j] -= (1.0 - mu_) * s;
        }
    // Q = R / (||R_k|| + 1e-8) per column.
    for (int k = 0; k < r_; ++k) {
      double s = 0;
      for (int j = 0; j < b_; ++j) s += R[size_t(j) * r_ + k] * R[size_t(j) * r_ + k];
      const double d = std::sqrt(s) + 1e-8;
      for (int j = 0; j < b_; ++j) q_[size_t(j) * r_ + k] = R[size_t(j) * r_ + k] / d;
    }
    // X = X (1 - lr wd) - lr scale (P Q^T), oriented back.
    for (int i = 0; i < m_; ++i)
      for (int j = 0; j < n_; ++j) {
        const int pi = t_ ? j : i, qi = t_ ? i : j;
        double s = 0;
        for (int k = 0; k < r_; ++k) s += P[size_t(pi) * r_ + k] * q_[size_t(qi) * r_ + k];
        double& x = X[size_t(i) * n_ + j];
        if (decoupled) x *= 1.0 - lr * wd;
        x -= lr * scale_ * s;
      }
  }

  // The mean of the replicas' buffers, in X's orientation [m, n].
  Vec momentum() const {
    Vec out(size_t(m_) * n_, 0.0);
    for (const auto& Mi : Mi_)
      for (int i = 0; i < m_; ++i)
        for (int j = 0; j < n_; ++j) out[size_t(i) * n_ + j] += Mi[at(i, j)] / double(Mi_.size());
    return out;
  }

 private:
  size_t at(int i, int j) const { return t_ ? size_t(j) * b_ + i : size_t(i) * b_ + j; }

  // mean_i(M_i B) [a, r] for B [b, r], or mean_i(M_i^T B) [b, r] for B [a, r] (M_i [a, b]).
  Vec mean_product(const Vec& B, bool transposed) const {
    const int out = transposed ? b_ : a_, in = transposed ? a_ : b_;
    Vec C(size_t(out) * r_, 0.0);
    for (const Vec& Mi : Mi_)
      for (int o = 0; o < out; ++o)
        for (int k = 0; k < r_; ++k) {
          double s = 0;
          for (int l = 0; l < in; ++l)
            s += (transposed ? Mi[size_t(l) * b_ + o] : Mi[size_t(o) * b_ + l]) * B[size_t(l) * r_ + k];
          C[size_t(o) * r_ + k] += s / double(Mi_.size());
        }
    return C;
  }

  int m_, n_, r_, a_ = 0, b_ = 0;
  bool t_ = false;
  double mu_, scale_;
  Vec q_, M_;
  std::vector<Vec> Mi_;
};

}  // namespace dion_ref
