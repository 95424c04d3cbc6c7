// CPU gemm: OpenBLAS cblas_?gemm in row-major layout, one call per matrix of a batch (OpenBLAS
// threads each call; small batched products are rare in dtk and stay correct this way).
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "dtk/ops/backend.h"
#include "dtk/ops/cpu/common.h"

namespace dtk::ops::cpu {

namespace {

template <typename T>
void gemm_typed(bool trans_a, bool trans_b, double alpha, const Tensor& a, const Tensor& b, double beta, Tensor& c) {
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
  for (int64_t i = 0; i < batch; ++i)
    blas_gemm(trans_a, trans_b, m, n, k, alpha, ap + i * a_stride, lda, bp + i * b_stride, ldb, beta, cp + i * c_stride, n);
}

}  // namespace

void gemm(bool trans_a, bool trans_b, double alpha, const Tensor& a, const Tensor& b, double beta, Tensor& c) {
  if (c.dtype() == DType::f32)
    gemm_typed<float>(trans_a, trans_b, alpha, a, b, beta, c);
  else
    gemm_typed<double>(trans_a, trans_b, alpha, a, b, beta, c);
}

}  // namespace dtk::ops::cpu

namespace dtk::ops {

void set_cpu_threads(int n) {
  omp_set_num_threads(n);
  openblas_set_num_threads(n);
}

std::string cpu_backend_warning() {
  if (openblas_get_parallel() != 1) return {};  // 0 sequential, 2 OpenMP
  return "OpenBLAS is its pthread build, whose threads compete with dtk's OpenMP threads for the cores "
         "(several times slower on small models); select the OpenMP build: scripts/install-deps does, or "
         "update-alternatives --set libopenblas.so.0-$(gcc -print-multiarch) "
         "/usr/lib/$(gcc -print-multiarch)/openblas-openmp/libopenblas.so.0";
}

}  // namespace dtk::ops
