// Inverse roots (ops.h): the eigenvalue rule every eigendecomposition-based root uses (the CPU
// and CUDA backends' inverse_root, inverse_roots' eigh and qr); inverse_root, one matrix (or a
// batch) in f64 on the backend; inverse_roots, the batched roots in the matrices' own dtype, and
// eigenbases and newton_schulz, all composed of the public ops (so the same on every backend).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "dtk/core/error.h"
#include "dtk/ops/backend.h"
#include "dtk/ops/check.h"
#include "dtk/ops/ops.h"

namespace dtk::ops {
using namespace dtk::ops::detail;

bool inverse_root_scales(const double* w, int64_t n, double p, double eps, double* d) {
  if (n <= 0) return true;
  const double w0 = *std::min_element(w, w + n);
  const double shift = w0 < eps ? eps - w0 : 0.0;
  for (int64_t j = 0; j < n; ++j) {
    const double wj = w[j];  // d may be w
    d[j] = std::pow(wj + shift, -1.0 / p);
    if (!std::isfinite(wj) || !std::isfinite(d[j])) return false;  // eps = 0 on a singular matrix
  }
  return true;
}

namespace {

// Runs a batched solver (eigh, QR); false, with every block marked failed, when it fails. Usage
// errors propagate.
template <typename F>
bool solved(F&& solve, std::vector<char>& ok) {
  try {
    solve();
    return true;
  } catch (const UsageError&) {
    throw;
  } catch (const Error&) {
    std::fill(ok.begin(), ok.end(), 0);
    return false;
  }
}

// The root's eigenvalues d = (mu + eps + shift)^(-1/p) (inverse_root_scales) from the
// eigenvalues mu of the matrices without eps (host, [nb, b], any order); a block whose rule
// fails gets ok 0 (and d 0).
std::vector<double> root_scales(const std::vector<double>& mu, int64_t b, double p, double eps, std::vector<char>& ok) {
  const int64_t nb = static_cast<int64_t>(ok.size());
  std::vector<double> d(static_cast<size_t>(nb * b), 0.0), w(static_cast<size_t>(b));
  for (int64_t i = 0; i < nb; ++i) {
    const double* m = mu.data() + i * b;
    double* di = d.data() + i * b;
    for (int64_t j = 0; j < b; ++j) w[static_cast<size_t>(j)] = m[j] + eps;
    if (!inverse_root_scales(w.data(), b, p, eps, di)) {
      ok[static_cast<size_t>(i)] = 0;
      std::fill(di, di + b, 0.0);
    }
  }
  return d;
}

// out = V diag(d) V^T for the batch (V's columns the eigenvectors); blocks whose result is
// not finite get ok 0.
void form_root(const Tensor& V, const std::vector<double>& d, Tensor& out, std::vector<char>& ok) {
  const int64_t nb = V.dim(0), b = V.dim(1);
  const DType t = V.dtype();
  const Device dev = V.device();
  // V diag(d): the columns of V scaled by d, through Dexp[i] = ones [b, 1] x d_i [1, b] (exact:
  // one product per element), then R = (V diag(d)) V^T.
  const Tensor D1 = Tensor::from_doubles(d, {nb, 1, b}, t, dev);
  Tensor ones = Tensor::empty({nb, b, 1}, t, dev);
  fill(ones, 1.0);
  Tensor Dexp = Tensor::empty({nb, b, b}, t, dev);
  gemm(false, false, 1.0, ones, D1, 0.0, Dexp);
  Tensor VD = Tensor::empty({nb, b, b}, t, dev);
  mul(V, Dexp, VD);
  gemm(false, true, 1.0, VD, V, 0.0, out);
  if (count_nonfinite(out) > 0)
    for (int64_t i = 0; i < nb; ++i)
      if (count_nonfinite(out.select(i)) > 0) ok[static_cast<size_t>(i)] = 0;
}

// The pseudo-inverse root's eigenvalues (ops.h, RootMethod::pseudo_inverse) from the
// eigenvalues w of the matrices (host, [nb, b]): w_j^(-1/p) above the cutoff, 0 at or below it.
std::vector<double> pseudo_scales(const std::vector<double>& w, int64_t b, double p, const RootOptions& o, DType t,
                                  std::vector<char>& ok) {
  const int64_t nb = static_cast<int64_t>(ok.size());
  const double rtol = o.rank_rtol >= 0 ? o.rank_rtol : static_cast<double>(b) * (t == DType::f64 ? 0x1p-52 : 0x1p-23);
  std::vector<double> d(static_cast<size_t>(nb * b), 0.0);
  for (int64_t i = 0; i < nb; ++i) {
    const double* wi = w.data() + i * b;
    double* di = d.data() + i * b;
    const double cut = std::max(o.rank_atol, rtol * std::max(0.0, *std::max_element(wi, wi + b)));
    for (int64_t j = 0; j < b; ++j) {
      if (!std::isfinite(wi[j])) ok[static_cast<size_t>(i)] = 0;
      di[j] = wi[j] > cut ? std::pow(wi[j], -1.0 / p) : 0.0;
    }
  }
  return d;
}

// V diag(d) V^T with V, d from a batched eigh of a, in a's dtype (eps or the pseudo-inverse rule).
void roots_eigh(const Tensor& a, double p, const RootOptions& o, Tensor& out, std::vector<char>& ok) {
  const int64_t nb = a.dim(0), b = a.dim(1);
  Tensor w = Tensor::empty({nb, b}, a.dtype(), a.device()), V = Tensor::empty({nb, b, b}, a.dtype(), a.device());
  if (!solved([&] { eigh(a, w, V); }, ok)) return;
  const std::vector<double> wd = w.to_doubles();
  form_root(V, o.method == RootMethod::pseudo_inverse ? pseudo_scales(wd, b, p, o, a.dtype(), ok)
                                                      : root_scales(wd, b, p, o.eps, ok),
            out, ok);
}

// The warm-started eigendecomposition (ops.h, RootMethod::qr) of the batch a, from and into the
// bases Q, whose columns it leaves by descending (the roots') or ascending (the eigenbases')
// estimate; returns the estimates of a's eigenvalues in Q's order ([nb, b]; empty when the solver
// failed: every ok 0).
std::vector<double> qr_basis(const Tensor& a, Tensor& Q, const RootOptions& opts, std::vector<char>& ok,
                             bool descending) {
  const int64_t nb = a.dim(0), b = a.dim(1);
  const DType dt = a.dtype();
  const Device dev = a.device();
  Tensor qn = Tensor::empty({nb}, dt, dev);
  reduce(Reduce::norm2, Axis::rows, Q.reshape({nb, b * b}), qn);
  const std::vector<double> qnorm = qn.to_doubles();
  const auto fresh = std::count(qnorm.begin(), qnorm.end(), 0.0);
  if (fresh > 0 && fresh < nb) {  // some blocks without a basis (after a failure): one at a time
    std::vector<double> all(static_cast<size_t>(nb * b), 0.0);
    for (int64_t i = 0; i < nb; ++i) {
      std::vector<char> oki(1, 1);
      Tensor Qi = Q.slice(i, i + 1);
      const std::vector<double> mi = qr_basis(a.slice(i, i + 1), Qi, opts, oki, descending);
      ok[static_cast<size_t>(i)] = oki[0];
      if (oki[0]) std::copy(mi.begin(), mi.end(), all.begin() + i * b);
    }
    return all;
  }
  Tensor V = Tensor::empty({nb, b, b}, dt, dev);
  std::vector<double> mu(static_cast<size_t>(nb * b));
  if (fresh == nb) {  // no basis yet: a full eigh
    Tensor w = Tensor::empty({nb, b}, dt, dev);
    if (!solved([&] { eigh(a, w, V); }, ok)) return {};
    mu = w.to_doubles();
  } else {
    const double eps = opts.eps;
    V.copy_from(Q);
    // B = Q^T A Q (A = a + eps I) through T = A Q alone: diag B_jj = q_j . (A q_j) and, Q being
    // orthonormal, ||B||_F = ||A Q||_F; T is also the next power iteration.
    Tensor T = Tensor::empty({nb, b, b}, dt, dev), P = Tensor::empty({nb, b, b}, dt, dev);
    Tensor ones = Tensor::empty({nb, 1, b}, dt, dev), dg = Tensor::empty({nb, 1, b}, dt, dev);
    Tensor fr = Tensor::empty({nb}, dt, dev);
    fill(ones, 1.0);
    std::vector<double> diag, frob;
    const auto estimate = [&] {
      gemm(false, false, 1.0, a, V, 0.0, T);
      axpy(eps, V, T);
      mul(V, T, P);
      gemm(false, false, 1.0, ones, P, 0.0, dg);  // column sums: q_j . (A q_j)
      reduce(Reduce::norm2, Axis::rows, T.reshape({nb, b * b}), fr);
      diag = dg.to_doubles();
      frob = fr.to_doubles();
    };
    const auto converged = [&](int64_t i) {
      double d2 = 0;
      for (int64_t j = 0; j < b; ++j) d2 += diag[static_cast<size_t>(i * b + j)] * diag[static_cast<size_t>(i * b + j)];
      const double f2 = frob[static_cast<size_t>(i)] * frob[static_cast<size_t>(i)];
      return std::sqrt(std::max(0.0, f2 - d2)) <= opts.qr_tolerance * std::sqrt(f2);
    };
    estimate();
    for (int it = 0; it < opts.qr_max_iterations; ++it) {
      std::vector<int64_t> todo;
      for (int64_t i = 0; i < nb; ++i)
        if (!converged(i)) todo.push_back(i);
      if (todo.empty()) break;
      if (!solved([&] { orthonormalize_qr(T); }, ok)) return {};  // Q = qr(A Q)
      if (static_cast<int64_t>(todo.size()) == nb) {
        V.copy_from(T);
      } else {
        for (int64_t i : todo) V.select(i).copy_from(T.select(i));
      }
      estimate();
    }
    for (size_t e = 0; e < mu.size(); ++e) mu[e] = diag[e] - eps;  // estimates of a's eigenvalues
  }
  // The basis kept for the next root step: columns sorted by estimate (stable).
  for (int64_t i = 0; i < nb; ++i) {
    std::vector<int64_t> order(static_cast<size_t>(b));
    std::iota(order.begin(), order.end(), int64_t{0});
    const double* m = mu.data() + i * b;
    std::stable_sort(order.begin(), order.end(), [m, descending](int64_t x, int64_t y) {
      return descending ? m[x] > m[y] : m[x] < m[y];
    });
    const std::vector<double> v = V.select(i).to_doubles();
    std::vector<double> sorted(v.size());
    for (int64_t r = 0; r < b; ++r)
      for (int64_t c = 0; c < b; ++c) sorted[static_cast<size_t>(r * b + c)] = v[static_cast<size_t>(r * b + order[static_cast<size_t>(c)])];
    Q.select(i).copy_from(Tensor::from_doubles(sorted, {b, b}, dt, dev));
    std::vector<double> ms(static_cast<size_t>(b));
    for (int64_t c = 0; c < b; ++c) ms[static_cast<size_t>(c)] = m[order[static_cast<size_t>(c)]];
    std::copy(ms.begin(), ms.end(), mu.begin() + i * b);
  }
  return mu;
}

// The root from qr_basis's basis and estimates, formed as roots_eigh forms it.
void roots_qr(const Tensor& a, Tensor& Q, double p, const RootOptions& opts, Tensor& out, std::vector<char>& ok) {
  const std::vector<double> mu = qr_basis(a, Q, opts, ok, true);
  if (mu.empty()) return;
  form_root(Q, root_scales(mu, a.dim(1), p, opts.eps, ok), out, ok);
}

// inverse_root on the whole batch; when that fails, one matrix at a time.
void roots_newton(const Tensor& a, double p, const RootOptions& opts, Tensor& out, std::vector<char>& ok) {
  if (inverse_root(a, p, opts, out)) return;
  for (int64_t i = 0; i < a.dim(0); ++i) {
    Tensor oi = out.select(i);
    ok[static_cast<size_t>(i)] = inverse_root(a.select(i), p, opts, oi) ? 1 : 0;
  }
}

// What inverse_root and inverse_roots both check: out like a, p, eps, and the Newton
// iteration's own options.
void check_root_args(const char* op, const Tensor& a, double p, const RootOptions& opts, const Tensor& out) {
  check_on(op, a, out, "out");
  check_type(op, out, a.dtype(), "out");
  check_shape(op, out, a.shape(), "out");
  if (!(p > 0) || !std::isfinite(p)) fail_usage("{}: p must be finite and > 0, got {}", op, p);
  if (!(opts.eps >= 0) || !std::isfinite(opts.eps)) fail_usage("{}: eps must be finite and >= 0, got {}", op, opts.eps);
  if (opts.method == RootMethod::newton) {
    // The coupled iteration raises M to the p-th power by repeated products.
    if (p != std::floor(p) || p > 64) fail_usage("{}: the newton method needs an integer p in [1, 64], got {}", op, p);
    if (opts.max_iters < 1) fail_usage("{}: max_iters must be >= 1", op);
    if (!(opts.tolerance > 0)) fail_usage("{}: tolerance must be > 0", op);
  }
  if (opts.method == RootMethod::pseudo_inverse) {
    if (opts.eps != 0) fail_usage("{}: the pseudo-inverse takes no eps (its rank cutoff replaces it), got {}", op, opts.eps);
    if (!(opts.rank_atol >= 0) || !std::isfinite(opts.rank_atol) || !std::isfinite(opts.rank_rtol))
      fail_usage("{}: rank_atol must be finite and >= 0 and rank_rtol finite", op);
  }
}

}  // namespace

bool inverse_root(const Tensor& a, double p, const RootOptions& opts, Tensor& out) {
  const char* op = "inverse_root";
  check_square(op, a, "a");
  check_float(op, a, "a");
  if (a.dim(-1) > INT32_MAX) fail_usage("inverse_root: n beyond 2^31 - 1 is not supported, got " + a.str());
  check_root_args(op, a, p, opts, out);
  if (opts.method == RootMethod::qr) fail_usage("inverse_root: the qr method needs a kept basis (inverse_roots)");
  if (opts.method != RootMethod::eigh && opts.method != RootMethod::newton)
    fail_usage("inverse_root: the {} method needs inverse_roots", name_of(opts.method));
  // out may be a itself: the backends write out only after the whole computation succeeded.
  if (overlaps(a, out) && a.data() != out.data()) fail_usage("inverse_root: out must be a itself or not overlap it");
  return DTK_DISPATCH(a, inverse_root(a, p, opts, out));
}

namespace {

// testing::FailF32Solves: the f32 solves still to report as failed.
std::atomic<int> g_fail_f32_solves{0};

// Marks blocks of an f32 batch as failed while testing::FailF32Solves asks for it.
void inject_failures(const Tensor& a, std::vector<char>& ok) {
  if (a.dtype() != DType::f32) return;
  for (char& v : ok) {
    int left = g_fail_f32_solves.load();
    while (left > 0 && !g_fail_f32_solves.compare_exchange_weak(left, left - 1)) {
    }
    if (left <= 0) return;
    v = 0;
  }
}

}  // namespace

namespace testing {
FailF32Solves::FailF32Solves(int blocks) { g_fail_f32_solves.store(blocks); }
FailF32Solves::~FailF32Solves() { g_fail_f32_solves.store(0); }
int FailF32Solves::remaining() const { return g_fail_f32_solves.load(); }
}  // namespace testing

std::vector<char> eigenbases(const Tensor& a, const RootOptions& opts, Tensor& basis) {
  const char* op = "eigenbases";
  check_float(op, a, "a");
  if (a.ndim() != 3 || a.dim(1) != a.dim(2)) fail_usage("eigenbases: a must be a batch [B, n, n], got " + a.str());
  check_on(op, a, basis, "basis");
  check_type(op, basis, a.dtype(), "basis");
  check_shape(op, basis, a.shape(), "basis");
  if (opts.method != RootMethod::eigh && opts.method != RootMethod::qr)
    fail_usage("eigenbases: the method must be eigh or qr, got {}", name_of(opts.method));
  if (!(opts.eps >= 0) || !std::isfinite(opts.eps)) fail_usage("eigenbases: eps must be finite and >= 0, got {}", opts.eps);
  std::vector<char> ok(static_cast<size_t>(a.dim(0)), 1);
  const int64_t nb = a.dim(0), b = a.dim(1);
  if (nb == 0 || b == 0) return ok;
  if (opts.method == RootMethod::qr) {
    if (qr_basis(a, basis, opts, ok, false).empty()) fill(basis, 0.0);
  } else {
    // eigh(a): a + eps I has the same eigenvectors in the same (ascending) order.
    Tensor w = Tensor::empty({nb, b}, a.dtype(), a.device());
    if (!solved([&] { eigh(a, w, basis); }, ok)) fill(basis, 0.0);
  }
  if (count_nonfinite(basis) > 0)
    for (int64_t i = 0; i < nb; ++i)
      if (count_nonfinite(basis.select(i)) > 0) ok[static_cast<size_t>(i)] = 0;
  inject_failures(a, ok);
  for (int64_t i = 0; i < nb; ++i)  // a failed block restarts from a full eigh (qr) / keeps nothing
    if (!ok[static_cast<size_t>(i)]) {
      Tensor Qi = basis.select(i);
      fill(Qi, 0.0);
    }
  return ok;
}

std::vector<char> inverse_roots(const Tensor& a, double p, const RootOptions& opts, Tensor& out, Tensor* basis) {
  const char* op = "inverse_roots";
  check_float(op, a, "a");
  if (a.ndim() != 3 || a.dim(1) != a.dim(2)) fail_usage("inverse_roots: a must be a batch [B, n, n], got " + a.str());
  check_root_args(op, a, p, opts, out);
  if (opts.method == RootMethod::qr) {
    if (!basis) fail_usage("inverse_roots: the qr method needs the bases");
    check_on(op, a, *basis, "basis");
    check_type(op, *basis, a.dtype(), "basis");
    check_shape(op, *basis, a.shape(), "basis");
    if (opts.qr_max_iterations < 0) fail_usage("inverse_roots: qr_max_iterations must be >= 0");
    if (!(opts.qr_tolerance >= 0 && opts.qr_tolerance <= 1)) fail_usage("inverse_roots: qr_tolerance must be in [0, 1]");
  }
  std::vector<char> ok(static_cast<size_t>(a.dim(0)), 1);
  if (a.dim(0) == 0 || a.dim(1) == 0) return ok;
  switch (opts.method) {
    case RootMethod::eigh:
    case RootMethod::pseudo_inverse:
      roots_eigh(a, p, opts, out, ok);
      inject_failures(a, ok);
      break;
    case RootMethod::newton:
      roots_newton(a, p, opts, out, ok);
      break;
    case RootMethod::qr:
      roots_qr(a, *basis, p, opts, out, ok);
      inject_failures(a, ok);
      for (int64_t i = 0; i < a.dim(0); ++i)  // a failed block restarts from a full eigh
        if (!ok[static_cast<size_t>(i)]) {
          Tensor Qi = basis->select(i);
          fill(Qi, 0.0);
        }
      break;
  }
  return ok;
}

Tensor newton_schulz(Tensor x, Tensor y, Tensor a, Tensor b, int steps) {
  const bool tall = x.dim(1) > x.dim(2);
  constexpr double ka = 3.4445, kb = -4.7750, kc = 2.0315;  // Jordan et al.'s quintic
  for (int i = 0; i < steps; ++i) {
    gemm(tall, !tall, 1.0, x, x, 0.0, a);
    gemm(false, false, kc, a, a, 0.0, b);
    axpy(kb, a, b);
    scale(x, ka, y);
    if (tall)
      gemm(false, false, 1.0, x, b, 1.0, y);
    else
      gemm(false, false, 1.0, b, x, 1.0, y);
    std::swap(x, y);
  }
  return x;
}

}  // namespace dtk::ops
