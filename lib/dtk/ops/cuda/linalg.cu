// CUDA linear algebra: Gram-Schmidt (kernels), Householder QR (cuSOLVER geqrf + orgqr),
// symmetric eigendecomposition (cuSOLVER syevd; syevjBatched for batches of small matrices)
// and matrix inverse roots (eigh + cuBLAS, or the coupled Newton iteration in cuBLAS gemms).
//
// Layout: dtk is row-major, cuBLAS / cuSOLVER column-major. A row-major [rows, cols] matrix is,
// read column-major, its transpose [cols, rows]. Each routine below says how it crosses over.
// Every cuBLAS / cuSOLVER status and every devInfo is checked; a failure is a dtk::Error
// naming the routine. Workspaces are dtk tensors on the device (the caching allocator), used
// in stream order on dtk's current stream.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cusolverDn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "dtk/core/error.h"
#include "dtk/ops/backend.h"
#include "dtk/ops/dispatch.h"
#include "dtk/ops/cuda/lazy.h"

namespace dtk::ops::cuda {

// Defined in blas.cu.
cublasHandle_t cublas_handle();
void check_cublas(cublasStatus_t s, const char* routine);

namespace {

cudaStream_t stream() { return static_cast<cudaStream_t>(dtk::cuda::current_stream().handle); }

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail(std::string(what) + ": " + cudaGetErrorString(e));
}

void check_launch(const char* kernel) { check_cuda(cudaGetLastError(), kernel); }

void check_cusolver(cusolverStatus_t s, const char* routine) {
  if (s != CUSOLVER_STATUS_SUCCESS) fail("{} failed: cusolverStatus {}", routine, int(s));
}

// As cublas_handle(): one per (thread, device), bound to the current stream, never destroyed.
cusolverDnHandle_t cusolver_handle() {
  thread_local std::map<int, cusolverDnHandle_t> handles;
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  auto it = handles.find(device);
  if (it == handles.end()) {
    cusolverDnHandle_t h = nullptr;
    check_cusolver(DTK_CUSOLVER(cusolverDnCreate)(&h), "cusolverDnCreate");
    it = handles.emplace(device, h).first;
  }
  check_cusolver(DTK_CUSOLVER(cusolverDnSetStream)(it->second, stream()), "cusolverDnSetStream");
  return it->second;
}

// Copies device ints to the host after the work queued before them (the host waits, watched).
std::vector<int> read_ints(const Tensor& d) {
  std::vector<int> h(static_cast<size_t>(d.numel()));
  if (h.empty()) return h;
  check_cuda(cudaMemcpyAsync(h.data(), d.data(), d.bytes(), cudaMemcpyDeviceToHost, stream()), "cudaMemcpyAsync");
  dtk::cuda::stream_synchronize(dtk::cuda::current_stream(), "a cuSOLVER status read back");
  return h;
}

void check_infos(const Tensor& info, const char* op, const char* routine) {
  const std::vector<int> h = read_ints(info);
  for (size_t i = 0; i < h.size(); ++i) {
    if (h[i] > 0)
      fail("{}: {} did not converge (devInfo {}) on matrix {}", op, routine, h[i], i);
    if (h[i] < 0) fail("{}: {} rejected argument {}", op, routine, -h[i]);
  }
}

unsigned blocks_for(int64_t n, int threads) {
  const int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(std::clamp<int64_t>(b, 1, 65535 * 16));
}

#define DTK_GRID_STRIDE(i, n) \
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)

// ---------------------------------------------------------------- small kernels

// dst[b][j][i] = src[b][i][j] for src a batch of row-major [rows, cols] matrices, converting
// the element type. Used to move between row-major tensors and column-major workspaces.
template <typename D, typename S>
__global__ void transpose_kernel(const S* src, D* dst, int64_t rows, int64_t cols, int64_t total) {
  DTK_GRID_STRIDE(idx, total) {
    const int64_t per = rows * cols;
    const int64_t b = idx / per, rem = idx % per, i = rem / cols, j = rem % cols;
    dst[b * per + j * rows + i] = static_cast<D>(src[idx]);
  }
}

template <typename D, typename S>
void transpose(const S* src, D* dst, int64_t rows, int64_t cols, int64_t batch) {
  const int64_t total = rows * cols * batch;
  if (!total) return;
  transpose_kernel<D, S><<<blocks_for(total, 256), 256, 0, stream()>>>(src, dst, rows, cols, total);
  check_launch("transpose_kernel");
}

template <typename D, typename S>
__global__ void convert_kernel(const S* src, D* dst, int64_t n) {
  DTK_GRID_STRIDE(i, n) dst[i] = static_cast<D>(src[i]);
}

// Sum (Add) or maximum over the block; every thread gets the same result. blockDim.x must be a
// multiple of 32 (at most 1024); red is a __shared__ array of 32.
struct Add {
  __device__ double operator()(double x, double y) const { return x + y; }
};
struct Max {
  __device__ double operator()(double x, double y) const { return fmax(x, y); }
};
template <typename Op>
__device__ double block_reduce(double v, double* red, Op op) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_down_sync(0xffffffffu, v, o));
  __syncthreads();  // every thread has finished reading red from the previous reduction
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  double total = red[0];
  for (unsigned w = 1; w < blockDim.x / 32; ++w) total = op(total, red[w]);  // same order in every thread
  return total;
}

// ---------------------------------------------------------------- modified Gram-Schmidt
// One block per matrix of q, a batch of column-major [m, r] f64 matrices (column j contiguous).
// The same algorithm as the CPU's (see cpu/linalg.cpp): each column orthogonalised twice against
// the previous ones, one projection at a time against the updated column (modified GS), then
// zeroed if its remaining norm is below eps, else normalised. Thread t owns elements t, t + B,
// t + 2B, ... of every column in every loop, so the only synchronisation needed is inside the
// reductions.
constexpr int kMgsThreads = 512;

__global__ void __launch_bounds__(kMgsThreads) mgs_kernel(double* q, int64_t m, int64_t r, double eps) {
  __shared__ double red[32];
  double* base = q + blockIdx.x * m * r;
  for (int64_t j = 0; j < r; ++j) {
    double* c = base + j * m;
    for (int pass = 0; pass < 2; ++pass) {
      for (int64_t i = 0; i < j; ++i) {
        const double* qi = base + i * m;
        double s = 0;
        for (int64_t t = threadIdx.x; t < m; t += blockDim.x) s += qi[t] * c[t];
        const double d = block_reduce(s, red, Add{});
        for (int64_t t = threadIdx.x; t < m; t += blockDim.x) c[t] -= d * qi[t];
      }
    }
    double s = 0;
    for (int64_t t = threadIdx.x; t < m; t += blockDim.x) s += c[t] * c[t];
    const double norm = ::sqrt(block_reduce(s, red, Add{}));
    // NaN is not below eps: a NaN column stays NaN rather than hiding bad input as zeros.
    const double f = norm < eps ? 0.0 : 1.0 / norm;
    for (int64_t t = threadIdx.x; t < m; t += blockDim.x) c[t] = norm < eps ? 0.0 : c[t] * f;
  }
}

template <typename T>
void mgs_typed(Tensor& a, double eps) {
  const int64_t batch = a.ndim() == 3 ? a.dim(0) : 1, m = a.dim(-2), r = a.dim(-1);
  if (m == 0 || r == 0) return;
  if (batch > INT32_MAX) fail("orthonormalize_mgs: batch too large for one grid");
  // Row-major [m, r] -> column-major [m, r] (each column contiguous, coalesced loads), in f64.
  Tensor q = Tensor::empty({batch, r, m}, DType::f64, a.device());
  transpose(a.ptr<T>(), q.ptr<double>(), m, r, batch);
  mgs_kernel<<<static_cast<unsigned>(batch), kMgsThreads, 0, stream()>>>(q.ptr<double>(), m, r, eps);
  check_launch("mgs_kernel");
  // Column-major [m, r] is row-major [r, m]: transposing it back gives the row-major [m, r].
  transpose(q.ptr<double>(), a.ptr<T>(), r, m, batch);
}

// ---------------------------------------------------------------- cuSOLVER overloads
cusolverStatus_t geqrf_buffer(cusolverDnHandle_t h, int m, int n, float* a, int lda, int* lw) {
  return DTK_CUSOLVER(cusolverDnSgeqrf_bufferSize)(h, m, n, a, lda, lw);
}
cusolverStatus_t geqrf_buffer(cusolverDnHandle_t h, int m, int n, double* a, int lda, int* lw) {
  return DTK_CUSOLVER(cusolverDnDgeqrf_bufferSize)(h, m, n, a, lda, lw);
}
cusolverStatus_t geqrf(cusolverDnHandle_t h, int m, int n, float* a, int lda, float* tau, float* w, int lw, int* info) {
  return DTK_CUSOLVER(cusolverDnSgeqrf)(h, m, n, a, lda, tau, w, lw, info);
}
cusolverStatus_t geqrf(cusolverDnHandle_t h, int m, int n, double* a, int lda, double* tau, double* w, int lw,
                       int* info) {
  return DTK_CUSOLVER(cusolverDnDgeqrf)(h, m, n, a, lda, tau, w, lw, info);
}
cusolverStatus_t orgqr_buffer(cusolverDnHandle_t h, int m, int n, int k, const float* a, int lda, const float* tau,
                              int* lw) {
  return DTK_CUSOLVER(cusolverDnSorgqr_bufferSize)(h, m, n, k, a, lda, tau, lw);
}
cusolverStatus_t orgqr_buffer(cusolverDnHandle_t h, int m, int n, int k, const double* a, int lda,
                              const double* tau, int* lw) {
  return DTK_CUSOLVER(cusolverDnDorgqr_bufferSize)(h, m, n, k, a, lda, tau, lw);
}
cusolverStatus_t orgqr(cusolverDnHandle_t h, int m, int n, int k, float* a, int lda, const float* tau, float* w, int lw,
                       int* info) {
  return DTK_CUSOLVER(cusolverDnSorgqr)(h, m, n, k, a, lda, tau, w, lw, info);
}
cusolverStatus_t orgqr(cusolverDnHandle_t h, int m, int n, int k, double* a, int lda, const double* tau, double* w,
                       int lw, int* info) {
  return DTK_CUSOLVER(cusolverDnDorgqr)(h, m, n, k, a, lda, tau, w, lw, info);
}
cusolverStatus_t syevd_buffer(cusolverDnHandle_t h, int n, const float* a, const float* w, int* lw) {
  return DTK_CUSOLVER(cusolverDnSsyevd_bufferSize)(h, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_UPPER, n, a, n, w, lw);
}
cusolverStatus_t syevd_buffer(cusolverDnHandle_t h, int n, const double* a, const double* w, int* lw) {
  return DTK_CUSOLVER(cusolverDnDsyevd_bufferSize)(h, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_UPPER, n, a, n, w, lw);
}
cusolverStatus_t syevd(cusolverDnHandle_t h, int n, float* a, float* w, float* work, int lw, int* info) {
  return DTK_CUSOLVER(cusolverDnSsyevd)(h, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_UPPER, n, a, n, w, work, lw, info);
}
cusolverStatus_t syevd(cusolverDnHandle_t h, int n, double* a, double* w, double* work, int lw, int* info) {
  return DTK_CUSOLVER(cusolverDnDsyevd)(h, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_UPPER, n, a, n, w, work, lw, info);
}
cusolverStatus_t syevj_batched_buffer(cusolverDnHandle_t h, int n, const float* a, const float* w, int* lw,
                                      syevjInfo_t p, int batch) {
  return DTK_CUSOLVER(cusolverDnSsyevjBatched_bufferSize)(h, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_UPPER, n, a, n, w, lw, p,
                                            batch);
}
cusolverStatus_t syevj_batched_buffer(cusolverDnHandle_t h, int n, const double* a, const double* w, int* lw,
                                      syevjInfo_t p, int batch) {
  return DTK_CUSOLVER(cusolverDnDsyevjBatched_bufferSize)(h, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_UPPER, n, a, n, w, lw, p,
                                            batch);
}
cusolverStatus_t syevj_batched(cusolverDnHandle_t h, int n, float* a, float* w, float* work, int lw, int* info,
                               syevjInfo_t p, int batch) {
  return DTK_CUSOLVER(cusolverDnSsyevjBatched)(h, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_UPPER, n, a, n, w, work, lw, info, p,
                                 batch);
}
cusolverStatus_t syevj_batched(cusolverDnHandle_t h, int n, double* a, double* w, double* work, int lw, int* info,
                               syevjInfo_t p, int batch) {
  return DTK_CUSOLVER(cusolverDnDsyevjBatched)(h, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_UPPER, n, a, n, w, work, lw, info, p,
                                 batch);
}

template <typename T>
constexpr DType dtype_of() {
  return sizeof(T) == 4 ? DType::f32 : DType::f64;
}

// ---------------------------------------------------------------- Householder QR
// The row-major [m, r] matrix is transposed into a column-major [m, r] workspace (lda = m), on
// which geqrf + orgqr form the thin Q in place; Q is transposed back into a.
template <typename T>
void qr_typed(Tensor& a) {
  const int64_t batch = a.ndim() == 3 ? a.dim(0) : 1;
  const int m = static_cast<int>(a.dim(-2)), r = static_cast<int>(a.dim(-1));
  if (m == 0 || r == 0) return;
  cusolverDnHandle_t h = cusolver_handle();
  const Device dev = a.device();
  Tensor ws = Tensor::empty({batch, r, m}, a.dtype(), dev);  // column-major [m, r] per matrix
  Tensor tau = Tensor::empty({r}, a.dtype(), dev);
  Tensor info = Tensor::empty({2 * batch}, DType::i32, dev);
  transpose(a.ptr<T>(), ws.ptr<T>(), m, r, batch);
  int lw_qr = 0, lw_org = 0;
  check_cusolver(geqrf_buffer(h, m, r, ws.ptr<T>(), m, &lw_qr), "cusolverDn?geqrf_bufferSize");
  check_cusolver(orgqr_buffer(h, m, r, r, ws.ptr<T>(), m, tau.ptr<T>(), &lw_org), "cusolverDn?orgqr_bufferSize");
  Tensor work = Tensor::empty({std::max({lw_qr, lw_org, 1})}, a.dtype(), dev);
  const int lwork = static_cast<int>(work.numel());
  for (int64_t bi = 0; bi < batch; ++bi) {
    T* w = ws.ptr<T>() + bi * int64_t(m) * r;
    int* inf = info.ptr<int>() + 2 * bi;
    check_cusolver(geqrf(h, m, r, w, m, tau.ptr<T>(), work.ptr<T>(), lwork, inf), "cusolverDn?geqrf");
    check_cusolver(orgqr(h, m, r, r, w, m, tau.ptr<T>(), work.ptr<T>(), lwork, inf + 1), "cusolverDn?orgqr");
  }
  check_infos(info, "orthonormalize_qr", "cusolverDn?geqrf/?orgqr");
  transpose(ws.ptr<T>(), a.ptr<T>(), r, m, batch);  // column-major [m, r] = row-major [r, m]
}

// ---------------------------------------------------------------- symmetric eigensolver
// Element (i, j) of the row-major a sits where column-major storage keeps (j, i): the lower
// triangle that ops.h says is read is, to cuSOLVER, the UPPER triangle of the same buffer.
// cuSOLVER returns eigenvector j as column j of the column-major result, i.e. at
// [j * n + i]; dtk wants it at v[i * n + j], so the result is transposed into v.

struct SyevjParams {
  syevjInfo_t p = nullptr;
  SyevjParams() {
    check_cusolver(DTK_CUSOLVER(cusolverDnCreateSyevjInfo)(&p), "cusolverDnCreateSyevjInfo");
    check_cusolver(DTK_CUSOLVER(cusolverDnXsyevjSetSortEig)(p, 1), "cusolverDnXsyevjSetSortEig");  // ascending
  }
  ~SyevjParams() { DTK_CUSOLVER(cusolverDnDestroySyevjInfo)(p); }
  SyevjParams(const SyevjParams&) = delete;
  SyevjParams& operator=(const SyevjParams&) = delete;
};

// Eigendecomposition in place of `batch` column-major [n, n] matrices in ws (upper triangle
// read); eigenvalues into w [batch, n]. info gets one devInfo per matrix; the caller checks it.
template <typename T>
void eigh_columns(T* ws, T* w, int n, int64_t batch, Tensor& info, Device dev) {
  cusolverDnHandle_t h = cusolver_handle();
  if (batch > 1 && n <= 32) {
    // Many small matrices: one Jacobi launch for the whole batch beats a loop of syevd calls.
    SyevjParams params;
    int lw = 0;
    check_cusolver(syevj_batched_buffer(h, n, ws, w, &lw, params.p, static_cast<int>(batch)),
                   "cusolverDn?syevjBatched_bufferSize");
    Tensor work = Tensor::empty({std::max(lw, 1)}, dtype_of<T>(), dev);
    check_cusolver(syevj_batched(h, n, ws, w, work.ptr<T>(), static_cast<int>(work.numel()), info.ptr<int>(),
                                 params.p, static_cast<int>(batch)),
                   "cusolverDn?syevjBatched");
    // devInfo is read before params and work go out of scope: syevjBatched is done with them.
    check_infos(info, "eigh", "cusolverDn?syevjBatched");
    return;
  }
  int lw = 0;
  check_cusolver(syevd_buffer(h, n, ws, w, &lw), "cusolverDn?syevd_bufferSize");
  Tensor work = Tensor::empty({std::max(lw, 1)}, dtype_of<T>(), dev);
  for (int64_t bi = 0; bi < batch; ++bi)
    check_cusolver(syevd(h, n, ws + bi * int64_t(n) * n, w + bi * n, work.ptr<T>(), static_cast<int>(work.numel()),
                         info.ptr<int>() + bi),
                   "cusolverDn?syevd");
  check_infos(info, "eigh", "cusolverDn?syevd");
}

template <typename T>
void eigh_typed(const Tensor& a, Tensor& w, Tensor& v) {
  const int64_t batch = a.ndim() == 3 ? a.dim(0) : 1;
  const int n = static_cast<int>(a.dim(-1));
  if (n == 0) return;
  if (batch > INT32_MAX) fail("eigh: batch too large for cuSOLVER");
  Tensor ws = a.clone();  // the solver overwrites its input; a stays intact (v may be a)
  Tensor info = Tensor::empty({batch}, DType::i32, a.device());
  eigh_columns<T>(ws.ptr<T>(), w.ptr<T>(), n, batch, info, a.device());
  transpose(ws.ptr<T>(), v.ptr<T>(), n, n, batch);
}

// ---------------------------------------------------------------- inverse roots
// Computed in f64 for f32 input as well (as on the CPU). The matrix worked on is built from the
// lower triangle of a (mirrored, as eigh reads it), so it is exactly symmetric; every matrix of
// both methods is then a polynomial in it or a function of it: symmetric, so its row-major and
// column-major readings agree (up to rounding) and no transposes are needed.

// s = sym(lower(a)) + eps I; raises *bad on a NaN / Inf element of the lower triangle.
template <typename T>
__global__ void symmetrize_kernel(const T* a, double* s, int64_t n, double eps, int* bad) {
  DTK_GRID_STRIDE(idx, n * n) {
    const int64_t i = idx / n, j = idx % n;
    const double x = static_cast<double>(i >= j ? a[i * n + j] : a[j * n + i]);
    if (!isfinite(x)) *bad = 1;
    s[idx] = x + (i == j ? eps : 0.0);
  }
}

__global__ void nonfinite_kernel(const double* x, int64_t n, int* bad) {
  DTK_GRID_STRIDE(i, n) if (!isfinite(x[i])) *bad = 1;
}

__global__ void scaled_identity_kernel(double* x, int64_t n, double diag) {
  DTK_GRID_STRIDE(idx, n * n) x[idx] = (idx / n == idx % n) ? diag : 0.0;
}

// mp = ((p + 1) I - m) / p
__global__ void newton_step_kernel(const double* m, double* mp, int64_t n, double p) {
  DTK_GRID_STRIDE(idx, n * n) mp[idx] = ((idx / n == idx % n ? p + 1.0 : 0.0) - m[idx]) / p;
}

// *err = max |m - I| over the matrix, one block; NaN counts as +Inf so it cannot be lost.
constexpr int kReduceThreads = 1024;
__global__ void __launch_bounds__(kReduceThreads) identity_error_kernel(const double* m, int64_t n, double* err) {
  __shared__ double red[32];
  double v = 0;
  for (int64_t idx = threadIdx.x; idx < n * n; idx += blockDim.x) {
    double e = fabs(m[idx] - (idx / n == idx % n ? 1.0 : 0.0));
    if (!(e == e)) e = INFINITY;
    v = fmax(v, e);
  }
  v = block_reduce(v, red, Max{});
  if (threadIdx.x == 0) *err = v;
}

// Device scratch for one inverse root: the matrices and small buffers both methods use.
struct RootWork {
  Tensor s, x, t, u, d, flag, info, scalar;
  RootWork(int64_t n, Device dev)
      : s(Tensor::empty({n, n}, DType::f64, dev)),
        x(Tensor::empty({n, n}, DType::f64, dev)),
        t(Tensor::empty({n, n}, DType::f64, dev)),
        u(Tensor::empty({n, n}, DType::f64, dev)),
        d(Tensor::empty({n}, DType::f64, dev)),
        flag(Tensor::zeros({1}, DType::i32, dev)),
        info(Tensor::empty({1}, DType::i32, dev)),
        scalar(Tensor::empty({1}, DType::f64, dev)) {}
};

double read_double(const Tensor& d) {
  double h = 0;
  check_cuda(cudaMemcpyAsync(&h, d.data(), sizeof(double), cudaMemcpyDeviceToHost, stream()), "cudaMemcpyAsync");
  dtk::cuda::stream_synchronize(dtk::cuda::current_stream(), "a Newton iteration's error read back");
  return h;
}

// X = (S)^(-1/p) into w.x by eigendecomposition of S = sym(a) + eps I (in w.s), with the one
// eigenvalue rule of both backends (ops.h, inverse_root_scales).
bool root_eigh(int n, double p, double eps, RootWork& w) {
  cublasHandle_t cb = cublas_handle();
  cusolverDnHandle_t h = cusolver_handle();
  int lw = 0;
  check_cusolver(syevd_buffer(h, n, w.s.ptr<double>(), w.d.ptr<double>(), &lw), "cusolverDnDsyevd_bufferSize");
  Tensor work = Tensor::empty({std::max(lw, 1)}, DType::f64, w.s.device());
  check_cusolver(syevd(h, n, w.s.ptr<double>(), w.d.ptr<double>(), work.ptr<double>(), static_cast<int>(work.numel()),
                       w.info.ptr<int>()),
                 "cusolverDnDsyevd");
  if (read_ints(w.info)[0] != 0) return false;  // no convergence: the method failed
  // The eigenvalues are few (n): the rule is applied on the host, exactly as on the CPU.
  std::vector<double> mu(static_cast<size_t>(n));
  check_cuda(cudaMemcpyAsync(mu.data(), w.d.data(), n * sizeof(double), cudaMemcpyDeviceToHost, stream()),
             "cudaMemcpyAsync");
  dtk::cuda::stream_synchronize(dtk::cuda::current_stream(), "the eigenvalues read back");
  if (!inverse_root_scales(mu.data(), n, p, eps, mu.data())) return false;
  // mu is pageable and dies with this function: the copy completes before it returns (a copy
  // queued with cudaMemcpyAsync might still read it after, whatever staging the driver does).
  check_cuda(cudaMemcpyAsync(w.d.data(), mu.data(), n * sizeof(double), cudaMemcpyHostToDevice, stream()),
             "cudaMemcpyAsync");
  dtk::cuda::stream_synchronize(dtk::cuda::current_stream(), "the eigenvalue roots copied to the GPU");
  // Column-major: V (eigenvectors as columns) in s; t = V diag(d); x = t V^T = V diag(d) V^T.
  check_cublas(DTK_CUBLAS(cublasDdgmm)(cb, CUBLAS_SIDE_RIGHT, n, n, w.s.ptr<double>(), n, w.d.ptr<double>(), 1,
                           w.t.ptr<double>(), n),
               "cublasDdgmm");
  const double one = 1, zero = 0;
  check_cublas(DTK_CUBLAS(cublasDgemm)(cb, CUBLAS_OP_N, CUBLAS_OP_T, n, n, n, &one, w.t.ptr<double>(), n, w.s.ptr<double>(), n,
                           &zero, w.x.ptr<double>(), n),
               "cublasDgemm");
  return true;
}

// Coupled Newton iteration (see cpu/linalg.cpp for the derivation): X_0 = z^(1/p) I,
// M_0 = z S with z = (p + 1) / (2 ||S||_F); M' = ((p + 1) I - M) / p, X <- X M', M <- M'^p M,
// until max |M - I| < tolerance. w.t holds M'; the result ends in w.x.
bool root_newton(int n, int p, const RootOptions& opts, RootWork& w) {
  cublasHandle_t cb = cublas_handle();
  const int64_t nn = int64_t(n) * n;
  double fro = 0;
  // A host result: cuBLAS waits for the stream itself, unwatched; the watched wait goes first.
  dtk::cuda::stream_synchronize(dtk::cuda::current_stream(), "the factor before its Newton iteration");
  check_cublas(DTK_CUBLAS(cublasDnrm2_64)(cb, nn, w.s.ptr<double>(), 1, &fro), "cublasDnrm2");
  if (!(fro > 0) || !std::isfinite(fro)) return false;
  const double z = (p + 1.0) / (2.0 * fro);
  check_cublas(DTK_CUBLAS(cublasDscal_64)(cb, nn, &z, w.s.ptr<double>(), 1), "cublasDscal");
  scaled_identity_kernel<<<blocks_for(nn, 256), 256, 0, stream()>>>(w.x.ptr<double>(), n, std::pow(z, 1.0 / p));
  check_launch("scaled_identity_kernel");
  const double one = 1, zero = 0;
  // Ping-pong buffers: M lives in mb[mi], X in xb[xi]; each product writes the other one.
  Tensor mb[2] = {w.s, Tensor::empty({n, n}, DType::f64, w.s.device())};
  Tensor xb[2] = {w.x, w.u};
  int mi = 0, xi = 0;
  for (int it = 0;; ++it) {
    identity_error_kernel<<<1, kReduceThreads, 0, stream()>>>(mb[mi].ptr<double>(), n, w.scalar.ptr<double>());
    check_launch("identity_error_kernel");
    const double err = read_double(w.scalar);
    if (!std::isfinite(err)) return false;
    if (err < opts.tolerance) break;
    if (it >= opts.max_iters) return false;
    newton_step_kernel<<<blocks_for(nn, 256), 256, 0, stream()>>>(mb[mi].ptr<double>(), w.t.ptr<double>(), n,
                                                                  double(p));
    check_launch("newton_step_kernel");
    check_cublas(DTK_CUBLAS(cublasDgemm)(cb, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, xb[xi].ptr<double>(), n, w.t.ptr<double>(),
                             n, &zero, xb[1 - xi].ptr<double>(), n),
                 "cublasDgemm");  // X <- X M'
    xi = 1 - xi;
    for (int k = 0; k < p; ++k) {  // M <- M'^p M, one factor at a time
      check_cublas(DTK_CUBLAS(cublasDgemm)(cb, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, w.t.ptr<double>(), n,
                               mb[mi].ptr<double>(), n, &zero, mb[1 - mi].ptr<double>(), n),
                   "cublasDgemm");
      mi = 1 - mi;
    }
  }
  if (xi != 0) w.x.copy_from_async(xb[xi], dtk::cuda::current_stream());
  return true;
}

template <typename T>
bool inverse_root_typed(const Tensor& a, double p, const RootOptions& opts, Tensor& out) {
  const int64_t batch = a.ndim() == 3 ? a.dim(0) : 1;
  const int n = static_cast<int>(a.dim(-1));
  if (n == 0) return true;
  const int64_t nn = int64_t(n) * n;
  const Device dev = a.device();
  RootWork w(n, dev);
  // All matrices are computed before out is written, so a failure leaves out untouched.
  Tensor result = Tensor::empty({batch, n, n}, DType::f64, dev);
  for (int64_t bi = 0; bi < batch; ++bi) {
    symmetrize_kernel<T><<<blocks_for(nn, 256), 256, 0, stream()>>>(a.ptr<T>() + bi * nn, w.s.ptr<double>(), n,
                                                                    opts.eps, w.flag.ptr<int>());
    check_launch("symmetrize_kernel");
    if (read_ints(w.flag)[0] != 0) return false;  // NaN / Inf input: not handed to the solver
    const bool ok = opts.method == RootMethod::newton ? root_newton(n, static_cast<int>(p), opts, w)
                                                      : root_eigh(n, p, opts.eps, w);
    if (!ok) return false;
    check_cuda(cudaMemcpyAsync(result.ptr<double>() + bi * nn, w.x.data(), nn * sizeof(double),
                               cudaMemcpyDeviceToDevice, stream()),
               "cudaMemcpyAsync");
  }
  nonfinite_kernel<<<blocks_for(result.numel(), 256), 256, 0, stream()>>>(result.ptr<double>(), result.numel(),
                                                                          w.flag.ptr<int>());
  check_launch("nonfinite_kernel");
  if (read_ints(w.flag)[0] != 0) return false;
  convert_kernel<T, double><<<blocks_for(result.numel(), 256), 256, 0, stream()>>>(result.ptr<double>(), out.ptr<T>(),
                                                                                  result.numel());
  check_launch("convert_kernel");
  return true;
}

}  // namespace

void orthonormalize_mgs(Tensor& a, double eps) {
  detail::visit_float(a.dtype(), [&](auto t) { mgs_typed<decltype(t)>(a, eps); });
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

}  // namespace dtk::ops::cuda
