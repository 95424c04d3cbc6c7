// CPU gemm: OpenBLAS cblas_?gemm in row-major layout, one call per matrix of a batch (OpenBLAS
// threads each call; small batched products are rare in dtk and stay correct this way).
// Math::tf32 and Math::bf16 multiply copies of A and B rounded to TF32 or bf16 (the products of
// two such values are exact in f32, so this is the tensor cores' arithmetic up to the order of the
// f32 sums); bf16 operands are widened to f32 copies (exact) the same way, and a bf16 C is
// computed in an f32 copy rounded once at the end.
#include <cblas.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "dtk/core/half.h"

#include "dtk/ops/backend.h"
#include "dtk/ops/cpu/internal.h"

namespace dtk::ops::cpu {

namespace {

template <typename T>
void gemm_typed(bool trans_a, bool trans_b, double alpha, const Tensor& a, const Tensor& b, double beta, Tensor& c,
                Math math) {
  const int64_t batch = c.ndim() == 3 ? c.dim(0) : 1;
  const int m = static_cast<int>(c.dim(-2));
  const int n = static_cast<int>(c.dim(-1));
  const int k = static_cast<int>(trans_a ? a.dim(-2) : a.dim(-1));
  const int64_t a_stride = a.dim(-2) * a.dim(-1), b_stride = b.dim(-2) * b.dim(-1), c_stride = int64_t(m) * n;
  T* cp = c.ptr<T>();
  if (m == 0 || n == 0) return;
  if (k == 0) {
    // An empty product: C = beta C. BLAS would reject the zero leading dimensions of A and B,
    // and beta == 0 must give zeros even where C held NaN (BLAS semantics: C is not read).
    const int64_t total = batch * c_stride;
    for (int64_t i = 0; i < total; ++i) cp[i] = beta == 0 ? T(0) : static_cast<T>(beta * cp[i]);
    return;
  }
  // Row-major leading dimensions are the stored row lengths (at least 1 for BLAS).
  const int lda = std::max<int>(1, static_cast<int>(a.dim(-1)));
  const int ldb = std::max<int>(1, static_cast<int>(b.dim(-1)));
  const T* ap = a.ptr<T>();
  const T* bp = b.ptr<T>();
  if constexpr (std::is_same_v<T, float>) {
    if (math == Math::tf32 || math == Math::bf16) {
      thread_local std::vector<float> ra, rb;  // the rounded copies, reused between calls
      const auto rounded = [math](const float* p, int64_t n, std::vector<float>& out) {
        out.resize(static_cast<size_t>(n));
        const bool tf32 = math == Math::tf32;
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = tf32 ? round_tf32(p[i]) : round_bf16(p[i]);
        return out.data();
      };
      ap = rounded(ap, a.numel(), ra);
      bp = rounded(bp, b.numel(), rb);
    }
  }
  for (int64_t i = 0; i < batch; ++i)
    blas_gemm(trans_a, trans_b, m, n, k, alpha, ap + i * a_stride, lda, bp + i * b_stride, ldb, beta, cp + i * c_stride, n);
}

inline void blas_syrk(bool trans, int n, int k, double alpha, const float* a, int lda, double beta, float* c) {
  cblas_ssyrk(CblasRowMajor, CblasLower, trans ? CblasTrans : CblasNoTrans, n, k, static_cast<float>(alpha), a, lda,
              static_cast<float>(beta), c, n);
}
inline void blas_syrk(bool trans, int n, int k, double alpha, const double* a, int lda, double beta, double* c) {
  cblas_dsyrk(CblasRowMajor, CblasLower, trans ? CblasTrans : CblasNoTrans, n, k, alpha, a, lda, beta, c, n);
}

template <typename T>
void syrk_typed(bool trans, double alpha, const Tensor& a, double beta, Tensor& c) {
  const int64_t batch = c.ndim() == 3 ? c.dim(0) : 1;
  const int n = static_cast<int>(c.dim(-1));
  const int k = static_cast<int>(trans ? a.dim(-2) : a.dim(-1));
  if (n == 0) return;
  const int64_t a_stride = a.dim(-2) * a.dim(-1), c_stride = int64_t(n) * n;
  T* cp = c.ptr<T>();
  const T* ap = a.ptr<T>();
  const int lda = std::max<int>(1, static_cast<int>(a.dim(-1)));
  for (int64_t i = 0; i < batch; ++i) {
    T* ci = cp + i * c_stride;
    if (k == 0) {  // BLAS would reject the zero leading dimension; beta == 0 gives zeros
      for (int64_t e = 0; e < c_stride; ++e) ci[e] = beta == 0 ? T(0) : static_cast<T>(beta * ci[e]);
      continue;
    }
    blas_syrk(trans, n, k, alpha, ap + i * a_stride, lda, beta, ci);
  }
  symmetrize(c);
}

// The upper triangle from the lower, in 64 x 64 tiles (the transposed reads stay in cache).
template <typename T>
void symmetrize_typed(Tensor& c) {
  const int64_t batch = c.ndim() == 3 ? c.dim(0) : 1, n = c.dim(-1);
  constexpr int64_t kTile = 64;
  for (int64_t i = 0; i < batch; ++i) {
    T* ci = c.ptr<T>() + i * n * n;
#pragma omp parallel for schedule(static)
    for (int64_t r0 = 0; r0 < n; r0 += kTile)
      for (int64_t c0 = r0; c0 < n; c0 += kTile)
        for (int64_t r = r0; r < std::min(n, r0 + kTile); ++r)
          for (int64_t cc = std::max(c0, r + 1); cc < std::min(n, c0 + kTile); ++cc) ci[r * n + cc] = ci[cc * n + r];
  }
}

}  // namespace

void symmetrize(Tensor& c) {
  if (c.dtype() == DType::f32)
    symmetrize_typed<float>(c);
  else
    symmetrize_typed<double>(c);
}

void syrk(bool trans, double alpha, const Tensor& a, double beta, Tensor& c) {
  if (c.dtype() == DType::f32)
    syrk_typed<float>(trans, alpha, a, beta, c);
  else
    syrk_typed<double>(trans, alpha, a, beta, c);
}

void gemm(bool trans_a, bool trans_b, double alpha, const Tensor& a, const Tensor& b, double beta, Tensor& c,
          Math math) {
  if (a.dtype() == DType::bf16) {  // bf16 operands: exact f32 copies, f32 products and sums
    F32Copies f;
    const Tensor af = f.in(a), bf = f.in(b);
    Tensor cf = f.out(c, beta != 0);
    gemm_typed<float>(trans_a, trans_b, alpha, af, bf, beta, cf, Math::exact);
    f.done();
    return;
  }
  if (c.dtype() == DType::f32)
    gemm_typed<float>(trans_a, trans_b, alpha, a, b, beta, c, math);
  else
    gemm_typed<double>(trans_a, trans_b, alpha, a, b, beta, c, math);
}

}  // namespace dtk::ops::cpu
