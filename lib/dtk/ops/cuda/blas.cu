// CUDA gemm through cuBLAS, and the cuBLAS handle that the CUDA linear algebra (linalg.cu)
// shares. cuBLAS is column-major, dtk row-major: see gemm below for how the two meet.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>

#include "dtk/core/error.h"
#include "dtk/ops/backend.h"
#include "dtk/ops/cuda/common.cuh"
#include "dtk/ops/cuda/lazy.h"

// The C symbols of the two GEMMs that cublas_api.h also overloads for C++ (compute type as cudaDataType).
using GemmEx = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*,
                                  const void*, cudaDataType, int, const void*, cudaDataType, int, const void*, void*,
                                  cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t);
using GemmStridedBatchedEx = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                                                const void*, const void*, cudaDataType, int, long long int, const void*,
                                                cudaDataType, int, long long int, const void*, void*, cudaDataType, int,
                                                long long int, int, cublasComputeType_t, cublasGemmAlgo_t);
// Each names exactly one of the overloads (a compile error otherwise).
static_assert(static_cast<GemmEx>(&cublasGemmEx) != nullptr);
static_assert(static_cast<GemmStridedBatchedEx>(&cublasGemmStridedBatchedEx) != nullptr);

namespace dtk::ops::cuda {

// Used by linalg.cu as well (declared there): not in an anonymous namespace.
void check_cublas(cublasStatus_t s, const char* routine) {
  if (s != CUBLAS_STATUS_SUCCESS) fail(std::string(routine) + " failed: " + DTK_CUBLAS(cublasGetStatusString)(s));
}

// The cuBLAS handle of the calling thread for the current device, bound to dtk's current stream.
// One handle per (thread, device): a handle belongs to the device current when it was created,
// and sharing one between threads would race on its stream. Handles are created on first use
// and deliberately never destroyed: thread_local destructors run at exit, possibly after the
// CUDA runtime has been torn down, and a handle per thread is a bounded cost.
cublasHandle_t cublas_handle() {
  thread_local std::map<int, cublasHandle_t> handles;
  int device = 0;
  const cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) fail(std::string("cudaGetDevice: ") + cudaGetErrorString(e));
  auto it = handles.find(device);
  if (it == handles.end()) {
    cublasHandle_t h = nullptr;
    check_cublas(DTK_CUBLAS(cublasCreate)(&h), "cublasCreate");
    it = handles.emplace(device, h).first;
  }
  check_cublas(DTK_CUBLAS(cublasSetStream)(it->second, static_cast<cudaStream_t>(dtk::cuda::current_stream().handle)),
               "cublasSetStream");
  return it->second;
}

namespace {

// Element (r, c) above the diagonal of each matrix takes (c, r): the upper triangle from the lower.
template <typename T>
__global__ void symmetrize_kernel(T* m, int64_t n, int64_t total) {
  for (int64_t e = kern::global_tid(); e < total; e += kern::grid_stride()) {
    const int64_t within = e % (n * n), r = within / n, c = within % n;
    if (c > r) m[e - within + r * n + c] = m[e - within + c * n + r];
  }
}

}  // namespace

void symmetrize(Tensor& c) {
  const int64_t n = c.dim(-1), total = c.numel();
  if (total == 0) return;
  constexpr int kThreads = 256;
  kern::visit_float(c.dtype(), [&](auto t) {
    using T = decltype(t);
    symmetrize_kernel<T><<<kern::grid_for(total, kThreads), kThreads, 0, kern::stream()>>>(c.ptr<T>(), n, total);
  });
  kern::check_launch("symmetrize");
}

// cuBLAS's ?syrk is not batched: one strided-batched gemm of A with itself, whose lower triangle
// is then mirrored into the upper (exactly symmetric, like the CPU's).
void syrk(bool trans, double alpha, const Tensor& a, double beta, Tensor& c) {
  cuda::gemm(trans, !trans, alpha, a, a, beta, c, Math::exact);
  symmetrize(c);
}

void gemm(bool trans_a, bool trans_b, double alpha, const Tensor& a, const Tensor& b, double beta, Tensor& c,
          Math math) {
  const int64_t batch = c.ndim() == 3 ? c.dim(0) : 1;
  const int m = static_cast<int>(c.dim(-2));
  const int n = static_cast<int>(c.dim(-1));
  const int k = static_cast<int>(trans_a ? a.dim(-2) : a.dim(-1));
  if (m == 0 || n == 0) return;
  if (math == Math::bf16 && a.dtype() == DType::f32) {
    // bf16 products of f32 operands (ops.h): the operands rounded to bf16 copies (RNE, the CPU's
    // rounding), then the bf16 gemm into the f32 C.
    Tensor a16 = Tensor::empty(a.shape(), DType::bf16, a.device()), b16 = Tensor::empty(b.shape(), DType::bf16, b.device());
    cuda::cast(a, a16);
    cuda::cast(b, b16);
    return cuda::gemm(trans_a, trans_b, alpha, a16, b16, beta, c, Math::exact);
  }
  cublasHandle_t h = cublas_handle();
  const bool f64 = c.dtype() == DType::f64;
  if (k == 0 && c.dtype() == DType::bf16 && beta != 0) {  // C = beta C, in f32 and rounded back
    Tensor cf = Tensor::empty(c.shape(), DType::f32, c.device());
    cuda::cast(c, cf);
    cuda::scale(cf, beta, cf);
    cuda::cast(cf, c);
    return;
  }
  if (k == 0) {
    // An empty product: C = beta C (beta == 0 writes zeros without reading C, as BLAS does).
    const int64_t total = c.numel();
    if (beta == 0) {
      dtk::cuda::memset_async(c.data(), 0, c.bytes(), dtk::cuda::current_stream());
    } else if (f64) {
      check_cublas(DTK_CUBLAS(cublasDscal_64)(h, total, &beta, c.ptr<double>(), 1), "cublasDscal");
    } else {
      const float bf = static_cast<float>(beta);
      check_cublas(DTK_CUBLAS(cublasSscal_64)(h, total, &bf, c.ptr<float>(), 1), "cublasSscal");
    }
    return;
  }
  // Row-major meets column-major: a row-major [rows, cols] matrix with row length ld is, to
  // cuBLAS, the column-major [cols, rows] matrix with leading dimension ld: its transpose. So
  // dtk's C [m, n] is cuBLAS's C^T [n, m] (ldc = n), and we ask cuBLAS for
  //     C^T = (op(A) op(B))^T = op(B)^T op(A)^T.
  // cuBLAS sees the row-major B as B^T; op(B)^T is then B^T itself when trans_b is false (no
  // transpose for cuBLAS) and B when trans_b is true (transpose the B^T cuBLAS sees). The same
  // holds for A. Hence: first operand B with op trans_b, second A with op trans_a, and the
  // dimensions (n, m, k) of the column-major product.
  const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int lda = std::max<int>(1, static_cast<int>(a.dim(-1)));  // stored row lengths
  const int ldb = std::max<int>(1, static_cast<int>(b.dim(-1)));
  const int ldc = n;
  const long long stride_a = a.dim(-2) * a.dim(-1), stride_b = b.dim(-2) * b.dim(-1);
  const long long stride_c = static_cast<long long>(m) * n;
  const int count = static_cast<int>(batch);

  if (a.dtype() == DType::bf16) {
    // bf16 inputs, f32 or bf16 output, f32 accumulation on tensor cores: alpha AB + beta C in f32,
    // rounded once into a bf16 C.
    const float af = static_cast<float>(alpha), bf = static_cast<float>(beta);
    const cudaDataType ct = c.dtype() == DType::bf16 ? CUDA_R_16BF : CUDA_R_32F;
    if (c.ndim() == 2) {
      check_cublas(DTK_CUBLAS_AS(GemmEx, cublasGemmEx)(h, op_b, op_a, n, m, k, &af, b.data(), CUDA_R_16BF, ldb, a.data(), CUDA_R_16BF, lda,
                                &bf, c.data(), ct, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                   "cublasGemmEx");
    } else {
      check_cublas(DTK_CUBLAS_AS(GemmStridedBatchedEx, cublasGemmStridedBatchedEx)(h, op_b, op_a, n, m, k, &af, b.data(), CUDA_R_16BF, ldb, stride_b,
                                              a.data(), CUDA_R_16BF, lda, stride_a, &bf, c.data(), ct, ldc,
                                              stride_c, count, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                   "cublasGemmStridedBatchedEx");
    }
  } else if (f64) {
    const double* ap = a.ptr<double>();
    const double* bp = b.ptr<double>();
    double* cp = c.ptr<double>();
    if (c.ndim() == 2)
      check_cublas(DTK_CUBLAS(cublasDgemm)(h, op_b, op_a, n, m, k, &alpha, bp, ldb, ap, lda, &beta, cp, ldc), "cublasDgemm");
    else
      check_cublas(DTK_CUBLAS(cublasDgemmStridedBatched)(h, op_b, op_a, n, m, k, &alpha, bp, ldb, stride_b, ap, lda, stride_a,
                                             &beta, cp, ldc, stride_c, count),
                   "cublasDgemmStridedBatched");
  } else if (math == Math::tf32) {
    // f32 in and out on tensor cores: the operands rounded to TF32, f32 accumulation (ops.h).
    const float af = static_cast<float>(alpha), bf = static_cast<float>(beta);
    if (c.ndim() == 2) {
      check_cublas(DTK_CUBLAS_AS(GemmEx, cublasGemmEx)(h, op_b, op_a, n, m, k, &af, b.data(), CUDA_R_32F, ldb, a.data(),
                                                       CUDA_R_32F, lda, &bf, c.data(), CUDA_R_32F, ldc,
                                                       CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_GEMM_DEFAULT),
                   "cublasGemmEx (tf32)");
    } else {
      check_cublas(DTK_CUBLAS_AS(GemmStridedBatchedEx, cublasGemmStridedBatchedEx)(
                       h, op_b, op_a, n, m, k, &af, b.data(), CUDA_R_32F, ldb, stride_b, a.data(), CUDA_R_32F, lda,
                       stride_a, &bf, c.data(), CUDA_R_32F, ldc, stride_c, count, CUBLAS_COMPUTE_32F_FAST_TF32,
                       CUBLAS_GEMM_DEFAULT),
                   "cublasGemmStridedBatchedEx (tf32)");
    }
  } else {
    // f32 in the handle's default math mode: true f32 products, no TF32 down-conversion.
    const float af = static_cast<float>(alpha), bf = static_cast<float>(beta);
    const float* ap = a.ptr<float>();
    const float* bp = b.ptr<float>();
    float* cp = c.ptr<float>();
    if (c.ndim() == 2)
      check_cublas(DTK_CUBLAS(cublasSgemm)(h, op_b, op_a, n, m, k, &af, bp, ldb, ap, lda, &bf, cp, ldc), "cublasSgemm");
    else
      check_cublas(DTK_CUBLAS(cublasSgemmStridedBatched)(h, op_b, op_a, n, m, k, &af, bp, ldb, stride_b, ap, lda, stride_a, &bf,
                                             cp, ldc, stride_c, count),
                   "cublasSgemmStridedBatched");
  }
}

}  // namespace dtk::ops::cuda
