// CPU linear algebra: Gram-Schmidt and Householder orthonormalisation, symmetric
// eigendecomposition (LAPACKE, row-major) and matrix inverse roots. A batch [B, ...] is a loop
// over its matrices.
#include <cblas.h>
#include <fmt/format.h>
#include <lapacke.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "dtk/core/error.h"
#include "dtk/ops/backend.h"
#include "dtk/ops/dispatch.h"
#include "dtk/ops/cpu/internal.h"

namespace dtk::ops::cpu {

namespace {

int64_t batch_of(const Tensor& t) { return t.ndim() == 3 ? t.dim(0) : 1; }

// ---------------------------------------------------------------- modified Gram-Schmidt
// One matrix [m, r], row-major. The columns are gathered into a column-major f64 buffer so
// each column is contiguous (the row-major column j has stride r), orthonormalised there in f64
// (also for f32 input: the loss of orthogonality of MGS grows with the condition number times
// the unit roundoff, so f64 arithmetic buys f32 results that are orthonormal to f32 precision),
// then written back.
//
// Each column is orthogonalised twice against the columns before it ("twice is enough",
// Giraud, Langou and Rozloznik 2005): one MGS pass leaves an error of order eps * cond(A) in
// Q^T Q, the second brings it to order eps. A column whose remaining norm (after both passes) is
// below eps is set to zero: it lies in the span of the previous columns (or was zero), and
// normalising it would amplify rounding noise or divide by zero. Zero columns then drop out of
// the later projections by themselves (their dot product is 0).
template <typename T>
void mgs_matrix(T* a, int64_t m, int64_t r, double eps, std::vector<double>& q) {
  q.resize(static_cast<size_t>(m * r));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < r; ++j) q[j * m + i] = static_cast<double>(a[i * r + j]);
  const int mi = static_cast<int>(m);
  for (int64_t j = 0; j < r; ++j) {
    double* c = q.data() + j * m;
    for (int pass = 0; pass < 2; ++pass) {
      for (int64_t i = 0; i < j; ++i) {
        const double* qi = q.data() + i * m;
        const double d = cblas_ddot(mi, qi, 1, c, 1);  // modified: against the updated column
        cblas_daxpy(mi, -d, qi, 1, c, 1);
      }
    }
    const double norm = cblas_dnrm2(mi, c, 1);
    if (norm < eps) {
      std::fill(c, c + m, 0.0);
    } else {
      cblas_dscal(mi, 1.0 / norm, c, 1);  // NaN input stays NaN (it is not "below eps")
    }
  }
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < r; ++j) a[i * r + j] = static_cast<T>(q[j * m + i]);
}

// ---------------------------------------------------------------- LAPACKE overloads
lapack_int geqrf(lapack_int m, lapack_int n, float* a, lapack_int lda, float* tau) {
  return LAPACKE_sgeqrf(LAPACK_ROW_MAJOR, m, n, a, lda, tau);
}
lapack_int geqrf(lapack_int m, lapack_int n, double* a, lapack_int lda, double* tau) {
  return LAPACKE_dgeqrf(LAPACK_ROW_MAJOR, m, n, a, lda, tau);
}
lapack_int orgqr(lapack_int m, lapack_int n, lapack_int k, float* a, lapack_int lda, const float* tau) {
  return LAPACKE_sorgqr(LAPACK_ROW_MAJOR, m, n, k, a, lda, tau);
}
lapack_int orgqr(lapack_int m, lapack_int n, lapack_int k, double* a, lapack_int lda, const double* tau) {
  return LAPACKE_dorgqr(LAPACK_ROW_MAJOR, m, n, k, a, lda, tau);
}
const char* syevd_name(float*) { return "LAPACKE_ssyevd"; }
const char* syevd_name(double*) { return "LAPACKE_dsyevd"; }

// The matrices of a batch in parallel, one per OpenMP thread, OpenBLAS single-threaded inside,
// always (as eigh below): a matrix's Q does not depend on how many share its batch. A batch of one
// (PowerSGD's P, every step) opens no parallel region, whose start costs milliseconds on a loaded
// machine for microseconds of work: it runs here with OpenBLAS held to one thread instead.
template <typename T>
void qr_typed(Tensor& a) {
  const int64_t m = a.dim(-2), r = a.dim(-1), batch = batch_of(a);
  if (m == 0 || r == 0) return;
  std::vector<std::string> errors(static_cast<size_t>(batch));
  const auto one = [&](int64_t bi) {
    std::vector<T> tau(static_cast<size_t>(r));
    T* p = a.ptr<T>() + bi * m * r;
    const auto mm = static_cast<lapack_int>(m), rr = static_cast<lapack_int>(r);
    lapack_int info = geqrf(mm, rr, p, rr, tau.data());
    if (info == 0) info = orgqr(mm, rr, rr, p, rr, tau.data());
    if (info != 0)
      errors[static_cast<size_t>(bi)] = fmt::format("orthonormalize_qr: LAPACKE ?geqrf / ?orgqr failed (info {})", info);
  };
  if (batch == 1) {
    const int threads = openblas_get_num_threads();
    openblas_set_num_threads(1);
    one(0);
    openblas_set_num_threads(threads);
  } else {
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t bi = 0; bi < batch; ++bi) one(bi);
  }
  for (const std::string& e : errors)
    if (!e.empty()) fail(e);
}

template <typename T>
bool all_finite(const T* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(p[i])) return false;
  return true;
}

template <typename T>
void eigh_typed(const Tensor& a, Tensor& w, Tensor& v) {
  const int64_t n = a.dim(-1), batch = batch_of(a);
  if (n == 0) return;
  // The matrices are independent: one per thread. OpenBLAS runs single-threaded inside the
  // parallel region, always (a lone matrix too), so that a matrix's result does not depend on
  // how many share its batch: Shampoo's blocks come out bit-identical on any world size.
  // Errors are collected and the first, in batch order, is raised after.
  std::vector<std::string> errors(static_cast<size_t>(batch));
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t bi = 0; bi < batch; ++bi) {
    const T* ap = a.ptr<T>() + bi * n * n;
    T* vp = v.ptr<T>() + bi * n * n;
    T* wp = w.ptr<T>() + bi * n;
    std::string& err = errors[static_cast<size_t>(bi)];
    // The solver works in place on v. Only the lower triangle is read (ops.h): check that one
    // for NaN / Inf, on which LAPACK's iterations may fail or return garbage.
    bool finite = true;
    for (int64_t i = 0; i < n && finite; ++i)
      for (int64_t j = 0; j <= i; ++j)
        if (!std::isfinite(ap[i * n + j])) {
          finite = false;
          break;
        }
    if (!finite) {
      err = fmt::format("eigh: the lower triangle of matrix {} of {} holds NaN or Inf", bi, a.str());
      continue;
    }
    if (vp != ap) std::copy(ap, ap + n * n, vp);
    const lapack_int info = syevd(static_cast<lapack_int>(n), vp, wp);
    if (info > 0)
      err = fmt::format("eigh: {} did not converge (info {}) on matrix {} of {}", syevd_name(vp), info, bi, a.str());
    else if (info < 0)
      err = fmt::format("eigh: {} failed (info {})", syevd_name(vp), info);
  }
  for (const std::string& e : errors)
    if (!e.empty()) fail(e);
}

// ---------------------------------------------------------------- inverse roots
// Both methods run in f64 whatever the input dtype; they read the lower triangle of a (as eigh
// does) and mirror it, so the matrix they work on is exactly symmetric.

// X = V diag(d) V^T for V [n, n] row-major with the eigenvectors as columns.
void reconstruct(int n, const std::vector<double>& v, const std::vector<double>& d, double* x) {
  std::vector<double> vd(v);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) vd[size_t(i) * n + j] *= d[j];
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, n, 1.0, vd.data(), n, v.data(), n, 0.0, x, n);
}

// (A + eps I)^(-1/p) by eigendecomposition: X = V diag(d) V^T with d from the eigenvalues of
// A + eps I by the one eigenvalue rule (ops.h, inverse_root_scales).
bool root_eigh(int n, const std::vector<double>& a, double p, double eps, double* x) {
  std::vector<double> v(a);
  std::vector<double> w(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) v[size_t(i) * n + i] += eps;
  if (syevd(n, v.data(), w.data()) != 0) return false;
  std::vector<double> d(static_cast<size_t>(n));
  if (!inverse_root_scales(w.data(), n, p, eps, d.data())) return false;
  reconstruct(n, v, d, x);
  return true;
}

// Coupled Newton iteration for A^(-1/p), A = a + eps I (Guo and Higham 2006; the form used by
// Distributed Shampoo). With z = (p + 1) / (2 ||A||_F): X_0 = z^(1/p) I, M_0 = z A, and
//   M'_k = ((p + 1) I - M_k) / p,  X_{k+1} = X_k M'_k,  M_{k+1} = (M'_k)^p M_k,
// which keeps M_k = X_k^p A, so M_k -> I gives X_k -> A^(-1/p). ||A||_F bounds the largest
// eigenvalue from above, so the eigenvalues of M_0 lie in (0, (p + 1) / 2], inside the region
// of convergence (0, p + 1). Stops when max |M - I| < tolerance; fails on NaN / Inf or after
// max_iters updates.
bool root_newton(int n, const std::vector<double>& a, int p, const RootOptions& opts, double* x) {
  const size_t nn = size_t(n) * n;
  std::vector<double> m(a);
  for (int i = 0; i < n; ++i) m[size_t(i) * n + i] += opts.eps;
  const double fro = cblas_dnrm2(static_cast<int>(nn), m.data(), 1);
  if (!(fro > 0) || !std::isfinite(fro)) return false;
  const double z = (p + 1.0) / (2.0 * fro);
  cblas_dscal(static_cast<int>(nn), z, m.data(), 1);
  std::fill(x, x + nn, 0.0);
  for (int i = 0; i < n; ++i) x[size_t(i) * n + i] = std::pow(z, 1.0 / p);
  std::vector<double> mp(nn), t(nn), pw(nn);
  for (int it = 0;; ++it) {
    double err = 0;
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < n; ++j) {
        const double e = std::fabs(m[size_t(i) * n + j] - (i == j ? 1.0 : 0.0));
        if (std::isnan(e)) return false;
        err = std::max(err, e);
      }
    if (!std::isfinite(err)) return false;
    if (err < opts.tolerance) break;
    if (it >= opts.max_iters) return false;
    for (size_t k = 0; k < nn; ++k) mp[k] = -m[k] / p;
    for (int i = 0; i < n; ++i) mp[size_t(i) * n + i] += (p + 1.0) / p;
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0, x, n, mp.data(), n, 0.0, t.data(), n);
    std::copy(t.begin(), t.end(), x);
    for (int k = 0; k < p; ++k) {  // m = mp^p m, one factor at a time
      cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0, mp.data(), n, m.data(), n, 0.0,
                  pw.data(), n);
      m.swap(pw);
    }
  }
  return all_finite(x, static_cast<int64_t>(nn));
}

template <typename T>
bool inverse_root_typed(const Tensor& a, double p, const RootOptions& opts, Tensor& out) {
  const int64_t n = a.dim(-1), batch = batch_of(a);
  const size_t nn = size_t(n) * size_t(n);
  if (n == 0) return true;
  // All matrices are computed before out is written, so a failure leaves out untouched.
  std::vector<double> result(nn * size_t(batch));
  std::vector<double> sym(nn);
  for (int64_t bi = 0; bi < batch; ++bi) {
    const T* ap = a.ptr<T>() + bi * int64_t(nn);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j <= i; ++j) {
        const double e = static_cast<double>(ap[i * n + j]);
        if (!std::isfinite(e)) return false;
        sym[i * n + j] = sym[j * n + i] = e;
      }
    double* x = result.data() + bi * int64_t(nn);
    const bool ok = opts.method == RootMethod::newton
                        ? root_newton(static_cast<int>(n), sym, static_cast<int>(p), opts, x)
                        : root_eigh(static_cast<int>(n), sym, p, opts.eps, x);
    if (!ok) return false;
  }
  T* op = out.ptr<T>();
  for (size_t i = 0; i < result.size(); ++i) op[i] = static_cast<T>(result[i]);
  return true;
}

}  // namespace

void orthonormalize_mgs(Tensor& a, double eps) {
  const int64_t m = a.dim(-2), r = a.dim(-1);
  if (m == 0 || r == 0) return;
  std::vector<double> q;
  for (int64_t bi = 0; bi < batch_of(a); ++bi) {
    detail::visit_float(a.dtype(), [&](auto t) { mgs_matrix(a.ptr<decltype(t)>() + bi * m * r, m, r, eps, q); });
  }
}

void orthonormalize_qr(Tensor& a) {
  detail::visit_float(a.dtype(), [&](auto t) { qr_typed<decltype(t)>(a); });
}

void eigh(const Tensor& a, Tensor& w, Tensor& v) {
  detail::visit_float(a.dtype(), [&](auto t) { eigh_typed<decltype(t)>(a, w, v); });
}

bool inverse_root(const Tensor& a, double p, const RootOptions& opts, Tensor& out) {
  bool ok = false;
  detail::visit_float(a.dtype(), [&](auto t) { ok = inverse_root_typed<decltype(t)>(a, p, opts, out); });
  return ok;
}

}  // namespace dtk::ops::cpu
