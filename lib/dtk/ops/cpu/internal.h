// What the CPU backend's files share: the float-type dispatch, the size below which a loop stays
// on one thread, and vectorisable math.
//
// Vectorised kernels. The build targets baseline x86-64 (SSE2), so a hot row kernel is marked
// DTK_SIMD_CLONES: GCC compiles it for x86-64-v4 (AVX-512), x86-64-v3 (AVX2) and the baseline,
// and the loader picks the best the CPU has (an ifunc, resolved once). Its loops are written for
// `#pragma omp simd`, with exp_f32 below in place of libm's scalar expf. The build keeps
// -ffp-contract=off, so every clone does the same IEEE operations per element: results differ
// between clones only in the order of the sums a simd reduction splits into lanes, never with the
// number of threads.
#pragma once
#include <cblas.h>
#include <lapacke.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>

#include <vector>

#include "dtk/core/dtype.h"
#include "dtk/core/tensor.h"
#include "dtk/ops/backend.h"
#include "dtk/ops/dispatch.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__)
#define DTK_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define DTK_SIMD_CLONES
#endif

namespace dtk::ops::cpu {

// Loops below this many elements stay on one thread: forking costs more than the work.
constexpr int64_t kParallelMin = 1 << 15;

using detail::visit_float;

// exp(x) in f32 without a libm call, so that a loop over it vectorises. Cody-Waite reduction
// x = n ln2 + r, |r| <= ln2 / 2, with ln2 split in two (n * kLn2Hi is exact); exp(r) by Cephes'
// degree-7 minimax polynomial; 2^n applied as two exact powers of two so that n = 128 and
// gradual underflow come out right. Relative error below 2 ulp over the whole float range
// (tests/unit/test_ops_nn.cpp checks it against double exp); exp(-inf) = 0, exp(inf) = inf,
// NaN stays NaN.
#pragma omp declare simd notinbranch
inline float exp_f32(float x) {
  constexpr float kHi = 88.72283935546875f;     // above: inf
  constexpr float kLo = -103.972084045410156f;  // below: 0
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const float xc = x > kHi ? kHi : (x < kLo ? kLo : x);
  const float fn = (xc * kLog2e + kRound) - kRound;
  const float r = (xc - fn * kLn2Hi) - fn * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const int32_t n = static_cast<int32_t>(fn);
  const int32_t n1 = n / 2, n2 = n - n1;  // each in [-75, 64]: 2^n1 and 2^n2 are normal floats
  const int32_t b1 = (n1 + 127) << 23, b2 = (n2 + 127) << 23;
  float s1, s2;
  std::memcpy(&s1, &b1, sizeof s1);
  std::memcpy(&s2, &b2, sizeof s2);
  const float y = p * s1 * s2;
  return x != x ? x : x > kHi ? std::numeric_limits<float>::infinity() : x < kLo ? 0.0f : y;
}

// exp for row kernels written once in T: the vectorisable exp_f32 for f32, libm for f64.
inline float vexp(float x) { return exp_f32(x); }
inline double vexp(double x) { return std::exp(x); }

// C = alpha op(A) op(B) + beta C, row-major, with explicit leading dimensions (OpenBLAS).
inline void blas_gemm(bool ta, bool tb, int m, int n, int k, double alpha, const float* a, int lda, const float* b,
                      int ldb, double beta, float* c, int ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n, k,
              static_cast<float>(alpha), a, lda, b, ldb, static_cast<float>(beta), c, ldc);
}
inline void blas_gemm(bool ta, bool tb, int m, int n, int k, double alpha, const double* a, int lda, const double* b,
                      int ldb, double beta, double* c, int ldc) {
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, lda,
              b, ldb, beta, c, ldc);
}

// The symmetric eigendecomposition of a [n, n] (row-major, overwritten by the eigenvectors, as
// columns) with ascending eigenvalues w, by LAPACKE. uplo 'L' names the lower triangle of the
// matrix as LAPACKE's row-major caller sees it (LAPACKE transposes the triangle it hands to the
// column-major solver accordingly).
inline lapack_int syevd(lapack_int n, float* a, float* w) { return LAPACKE_ssyevd(LAPACK_ROW_MAJOR, 'V', 'L', n, a, n, w); }
inline lapack_int syevd(lapack_int n, double* a, double* w) {
  return LAPACKE_dsyevd(LAPACK_ROW_MAJOR, 'V', 'L', n, a, n, w);
}

// y[0, n) = scale * softmax(x[0, n)) in one exp pass (y may be x); returns the row's log-sum-exp.
// f32: vectorised (nn.cpp); f64: libm.
float softmax_row(const float* x, float* y, int64_t n, float scale);
double softmax_row(const double* x, double* y, int64_t n, double scale);

// The mixed-precision ops (ops.h) on the CPU: each bf16 argument is worked on as an f32 copy,
// exact when it is read, and each output copy is rounded back to bf16 once, by done(): the
// rounding points of the CUDA kernels, which read bf16 into f32 registers and round when they
// store. Speed is not the point here (the CPU's bf16 runs are the GPU's reference). Ops test
// for bf16 arguments with any_bf16 (backend.h).
class F32Copies {
 public:
  // t itself, or an f32 copy of it.
  Tensor in(const Tensor& t) {
    if (t.dtype() != DType::bf16) return t;
    Tensor c = Tensor::empty(t.shape(), DType::f32);
    cast(t, c);
    return c;
  }
  // t itself, or an f32 copy (holding t's values when read: an accumulating output) that done()
  // rounds back into t.
  Tensor out(Tensor& t, bool read = false) {
    if (t.dtype() != DType::bf16) return t;
    Tensor c = read ? in(t) : Tensor::empty(t.shape(), DType::f32);
    outs_.emplace_back(c, &t);
    return c;
  }
  void done() {
    for (auto& [c, t] : outs_) cast(c, *t);
    outs_.clear();
  }

 private:
  std::vector<std::pair<Tensor, Tensor*>> outs_;
};

}  // namespace dtk::ops::cpu
