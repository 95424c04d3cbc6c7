// Public linear algebra (ops.h): gemm, orthonormalisation and symmetric eigendecomposition (the
// inverse roots: roots.cpp). Each function checks its arguments completely (a UsageError naming the op and
// the tensor), then runs the backend of the tensors' device.
#include <cmath>
#include <cstdint>
#include <string>

#include "dtk/ops/backend.h"
#include "dtk/ops/check.h"

namespace dtk::ops {
using namespace dtk::ops::detail;

void gemm(bool trans_a, bool trans_b, double alpha, const Tensor& a, const Tensor& b, double beta, Tensor& c,
          Math math) {
  const char* op = "gemm";
  check_matrix_rank(op, a, "a");
  check_matrix_rank(op, b, "b");
  check_matrix_rank(op, c, "c");
  check_on(op, c, a, "a");
  check_on(op, c, b, "b");
  // a and b share c's dtype (f32 or f64), or are both bf16 with an f32 or bf16 c.
  const bool bf16_inputs = a.dtype() == DType::bf16 && b.dtype() == DType::bf16;
  if (bf16_inputs) {
    if (c.dtype() != DType::f32 && c.dtype() != DType::bf16)
      fail_usage("gemm: with bf16 a and b, c must be f32 or bf16, got " + c.str());
  } else {
    check_float(op, c, "c");
    check_type(op, a, c.dtype(), "a");
    check_type(op, b, c.dtype(), "b");
  }
  if (a.ndim() != c.ndim() || b.ndim() != c.ndim())
    fail_usage("gemm: a, b and c must all be matrices or all be batches, got a " + a.str() + ", b " + b.str() +
               ", c " + c.str());
  if (c.ndim() == 3 && (a.dim(0) != c.dim(0) || b.dim(0) != c.dim(0)))
    fail_usage("gemm: batch sizes differ: a " + a.str() + ", b " + b.str() + ", c " + c.str());
  // op(A) [m, k], op(B) [k, n], C [m, n].
  const int64_t m = trans_a ? a.dim(-1) : a.dim(-2);
  const int64_t k = trans_a ? a.dim(-2) : a.dim(-1);
  const int64_t kb = trans_b ? b.dim(-1) : b.dim(-2);
  const int64_t n = trans_b ? b.dim(-2) : b.dim(-1);
  const auto opname = [](bool t, const char* x) { return std::string(x) + (t ? "^T" : ""); };
  if (k != kb)
    fail_usage("gemm: inner dimensions differ: {} of {} has {} columns, {} of {} has {} rows", opname(trans_a, "a"),
               a.str(), k, opname(trans_b, "b"), b.str(), kb);
  if (c.dim(-2) != m || c.dim(-1) != n)
    fail_usage("gemm: c must be [{}, {}] (per batch) for {} of {} and {} of {}, got {}", m, n, opname(trans_a, "a"),
               a.str(), opname(trans_b, "b"), b.str(), c.str());
  if (m > INT32_MAX || n > INT32_MAX || k > INT32_MAX)
    fail_usage("gemm: dimensions beyond 2^31 - 1 are not supported by BLAS, got a " + a.str() + ", b " + b.str());
  if (overlaps(a, c) || overlaps(b, c)) fail_usage("gemm: c must not overlap a or b in memory");
  if (!std::isfinite(alpha) || !std::isfinite(beta)) fail_usage("gemm: alpha and beta must be finite");
  DTK_DISPATCH(c, gemm(trans_a, trans_b, alpha, a, b, beta, c, math));
}

void symmetrize(Tensor& c) {
  if (c.ndim() < 2 || c.ndim() > 3 || c.dim(-1) != c.dim(-2))
    fail_usage("symmetrize: c must be [n, n] or [B, n, n], got " + c.str());
  if (c.dtype() != DType::f32 && c.dtype() != DType::f64) fail_usage("symmetrize: c must be f32 or f64, got " + c.str());
  DTK_DISPATCH(c, symmetrize(c));
}

void syrk(bool trans, double alpha, const Tensor& a, double beta, Tensor& c) {
  if (a.dtype() == DType::bf16) fail_usage("syrk: a must be f32 or f64, got " + a.str());
  if (c.ndim() >= 2 && c.dim(-1) != c.dim(-2)) fail_usage("syrk: c must be square, got " + c.str());
  const char* op = "syrk";
  check_matrix_rank(op, a, "a");
  check_matrix_rank(op, c, "c");
  check_on(op, c, a, "a");
  check_float(op, c, "c");
  check_type(op, a, c.dtype(), "a");
  if (a.ndim() != c.ndim()) fail_usage("syrk: a and c must both be matrices or both be batches, got a " + a.str() + ", c " + c.str());
  if (c.ndim() == 3 && a.dim(0) != c.dim(0)) fail_usage("syrk: batch sizes differ: a " + a.str() + ", c " + c.str());
  const int64_t n = trans ? a.dim(-1) : a.dim(-2), k = trans ? a.dim(-2) : a.dim(-1);
  if (c.dim(-2) != n)
    fail_usage("syrk: c must be [{}, {}] (per batch) for {} of a {}, got {}", n, n, trans ? "a^T a" : "a a^T", a.str(),
               c.str());
  if (n > INT32_MAX || k > INT32_MAX) fail_usage("syrk: dimensions beyond 2^31 - 1 are not supported by BLAS, got a " + a.str());
  if (overlaps(a, c)) fail_usage("syrk: c must not overlap a in memory");
  if (!std::isfinite(alpha) || !std::isfinite(beta)) fail_usage("syrk: alpha and beta must be finite");
  DTK_DISPATCH(c, syrk(trans, alpha, a, beta, c));
}

void orthonormalize_mgs(Tensor& a, double eps) {
  const char* op = "orthonormalize_mgs";
  check_matrix_rank(op, a, "a");
  check_float(op, a, "a");
  if (!(eps >= 0) || !std::isfinite(eps)) fail_usage("orthonormalize_mgs: eps must be finite and >= 0");
  if (a.dim(-2) > INT32_MAX) fail_usage("orthonormalize_mgs: m beyond 2^31 - 1 is not supported, got " + a.str());
  DTK_DISPATCH(a, orthonormalize_mgs(a, eps));
}

void orthonormalize_qr(Tensor& a) {
  const char* op = "orthonormalize_qr";
  check_matrix_rank(op, a, "a");
  check_float(op, a, "a");
  if (a.dim(-1) > a.dim(-2))
    fail_usage("orthonormalize_qr: a [m, r] needs r <= m for a thin Q, got " + a.str());
  if (a.dim(-2) > INT32_MAX) fail_usage("orthonormalize_qr: m beyond 2^31 - 1 is not supported, got " + a.str());
  DTK_DISPATCH(a, orthonormalize_qr(a));
}

void eigh(const Tensor& a, Tensor& w, Tensor& v) {
  const char* op = "eigh";
  check_square(op, a, "a");
  check_float(op, a, "a");
  if (a.dim(-1) > INT32_MAX) fail_usage("eigh: n beyond 2^31 - 1 is not supported, got " + a.str());
  check_on(op, a, w, "w");
  check_on(op, a, v, "v");
  check_type(op, w, a.dtype(), "w");
  check_type(op, v, a.dtype(), "v");
  Shape ws = a.shape();
  ws.pop_back();  // [n] or [B, n]
  check_shape(op, w, ws, "w");
  check_shape(op, v, a.shape(), "v");
  if (overlaps(a, w) || overlaps(v, w)) fail_usage("eigh: w must not overlap a or v in memory");
  // v may be a itself: the backends copy a into v before the solver overwrites it.
  if (overlaps(a, v) && a.data() != v.data()) fail_usage("eigh: v must be a itself or not overlap it");
  DTK_DISPATCH(a, eigh(a, w, v));
}

}  // namespace dtk::ops
