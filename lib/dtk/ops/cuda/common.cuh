// Shared helpers of the CUDA backend's kernels (internal to ops/cuda): the stream every op runs
// on, launch checks, launch geometry, 16-byte vector packs, float math that picks the f32 or f64
// intrinsic by type, and deterministic warp/block reductions.
//
// Determinism: every reduction here is a fixed tree. Which thread adds which value depends only on
// the problem size and the launch geometry, and the geometry depends only on the problem size
// (never on the device's SM count), so the same input gives bit-identical output on every run.
#pragma once
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "dtk/core/error.h"
#include "dtk/core/tensor.h"
#include "dtk/ops/backend.h"
#include "dtk/ops/convert.h"
#include "dtk/ops/dispatch.h"

namespace dtk::ops::cuda::kern {

inline cudaStream_t stream() { return static_cast<cudaStream_t>(dtk::cuda::current_stream().handle); }

// After each launch: a bad configuration or an earlier asynchronous fault surfaces here, named.
inline void check_launch(const char* kernel) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) fail(std::string("CUDA kernel ") + kernel + ": " + cudaGetErrorString(e));
}

inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail(std::string(what) + ": " + cudaGetErrorString(e));
}

// Blocks for a grid-stride loop over n work items: enough to fill an H100 many times over
// (132 SMs x 2048 threads), capped so huge tensors loop instead of launching millions of blocks.
inline unsigned grid_for(int64_t n, int threads) {
  const int64_t b = (n + threads - 1) / threads;
  constexpr int64_t kMaxBlocks = 132 * 32;
  return static_cast<unsigned>(b < 1 ? 1 : (b > kMaxBlocks ? kMaxBlocks : b));
}

__device__ __forceinline__ int64_t global_tid() { return blockIdx.x * int64_t(blockDim.x) + threadIdx.x; }
__device__ __forceinline__ int64_t grid_stride() { return int64_t(gridDim.x) * blockDim.x; }

using detail::visit_float;  // f32 -> float, f64 -> double, any other dtype refused

// ------------------------------------------------------------------------------- mixed precision
// The mixed-precision ops (ops.h): a kernel computes in C (float, or double for f64) and each of
// its float tensors is stored as S: C itself or, next to float, bf16. ld reads S as C (bf16
// widened exactly), st rounds C to S (to nearest even: core/half.h, the CPU's rounding).
using detail::bf16_t;
template <typename C, typename S>
__device__ __forceinline__ C ld(S v) {
  return detail::convert<C>(v);
}
template <typename S, typename C>
__device__ __forceinline__ S st(C v) {
  return detail::convert<S>(v);
}
// f(C{}) with C the type a mixed-precision kernel computes in for a tensor of dtype t: double for
// f64, float for f32 and bf16.
template <typename F>
void visit_compute(DType t, F&& f) {
  visit_float(t == DType::bf16 ? DType::f32 : t, f);
}
// f(S{}) for a tensor of dtype t in a kernel that computes in C: bf16_t for a bf16 tensor next to
// float, else C itself.
template <typename C, typename F>
void visit_storage(DType t, F&& f) {
  if constexpr (std::is_same_v<C, float>) {
    if (t == DType::bf16) return f(bf16_t{});
  }
  f(C{});
}
// ------------------------------------------------------------------------------- vector packs
// N elements loaded or stored as one 16-byte (or smaller) transaction. Used only when every
// pointer of a kernel is aligned to sizeof(Pack); otherwise kernels run with N = 1.
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename T, int N>
inline bool aligned_for(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % sizeof(Pack<T, N>) == 0;
}

// ------------------------------------------------------------------------------- float math
// Overloads that keep f32 in f32 (no silent promotion to double) and use the precise functions,
// not the fast-math intrinsics: results must stay within a few ulp of the CPU backend.
__device__ __forceinline__ float d_exp(float x) { return expf(x); }
__device__ __forceinline__ double d_exp(double x) { return ::exp(x); }
__device__ __forceinline__ float d_log(float x) { return logf(x); }
__device__ __forceinline__ double d_log(double x) { return ::log(x); }
__device__ __forceinline__ float d_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double d_sqrt(double x) { return ::sqrt(x); }
__device__ __forceinline__ float d_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double d_tanh(double x) { return ::tanh(x); }
__device__ __forceinline__ float d_pow(float x, float p) { return powf(x, p); }
__device__ __forceinline__ double d_pow(double x, double p) { return ::pow(x, p); }
__device__ __forceinline__ float d_abs(float x) { return fabsf(x); }
__device__ __forceinline__ double d_abs(double x) { return ::fabs(x); }
__device__ __forceinline__ bool d_isnan(float x) { return isnan(x); }
__device__ __forceinline__ bool d_isnan(double x) { return isnan(x); }

template <typename T>
__device__ __forceinline__ T d_inf() {
  return static_cast<T>(INFINITY);
}

using detail::max_nan;  // max / min that propagate NaN (ops/dispatch.h)
using detail::min_nan;

// ------------------------------------------------------------------------------- reductions
struct SumOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const {
    return a + b;
  }
};
struct MaxOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const {
    return max_nan(a, b);
  }
};
struct MinOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const {
    return min_nan(a, b);
  }
};

// Butterfly (xor) reduction: every lane ends with the result. Lanes i and i^m add the same two
// values (a + b == b + a exactly), so all lanes hold bit-identical results.
template <typename T, typename Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
  return warp_reduce(v, SumOp{});
}
template <typename T>
__device__ __forceinline__ T warp_max(T v) {
  return warp_reduce(v, MaxOp{});
}

// Block reduction (blockDim.x a multiple of 32, at most 1024): warps reduce, warp 0 reduces the
// warp results; every thread returns the result. `scratch` holds 32 values of T. Safe to call
// repeatedly in one kernel (the leading barrier protects scratch from the previous call).
template <typename T, typename Op>
__device__ T block_reduce(T v, Op op, T identity, T* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_reduce(v, op);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T w = lane < nwarps ? scratch[lane] : identity;
    w = warp_reduce(w, op);
    if (lane == 0) scratch[0] = w;
  }
  __syncthreads();
  return scratch[0];
}

// Threads per block for a kernel that gives one block to a row of n elements: enough threads to
// cover the row in a few passes, a multiple of 32, between 32 and 1024. A function of n only.
inline int threads_for_row(int64_t n) {
  int t = 32;
  while (t < 1024 && t * 4 < n) t *= 2;
  return t;
}


// ------------------------------------------------------------------------------- column reductions
// Deterministic reduction down the columns of an [R, C] matrix, in two passes. Pass 1: blocks of
// 32 columns x 8 row lanes; block row-chunk y (of gridDim.y) combines rows y*8 + ty, stepping by
// gridDim.y * 8, then the 8 row lanes combine through shared memory in a fixed order, giving
// partial[y][c]. Pass 2: one thread per column combines the gridDim.y partials in order and hands
// the result to `finish(c, acc)`. gridDim.y depends only on R. Loads are coalesced along a row.
constexpr int kColRowLanes = 8;

inline unsigned col_chunks(int64_t R) {
  const int64_t g = (R + 63) / 64;
  return static_cast<unsigned>(g < 1 ? 1 : (g > 128 ? 128 : g));
}

template <typename Acc, typename Load, typename Combine>
__global__ void col_partial_kernel(int64_t R, int64_t C, Load load, Combine comb, Acc identity, Acc* partial) {
  __shared__ Acc sm[kColRowLanes][33];
  const int64_t c = blockIdx.x * int64_t(32) + threadIdx.x;
  Acc acc = identity;
  if (c < C)
    for (int64_t r = blockIdx.y * int64_t(kColRowLanes) + threadIdx.y; r < R; r += int64_t(gridDim.y) * kColRowLanes)
      acc = comb(acc, load(r, c));
  sm[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    Acc a = sm[0][threadIdx.x];
#pragma unroll
    for (int y = 1; y < kColRowLanes; ++y) a = comb(a, sm[y][threadIdx.x]);
    partial[blockIdx.y * C + c] = a;
  }
}

template <typename Acc, typename Combine, typename Finish>
__global__ void col_finish_kernel(int64_t C, unsigned chunks, const Acc* partial, Combine comb, Finish finish) {
  for (int64_t c = global_tid(); c < C; c += grid_stride()) {
    Acc a = partial[c];
    for (unsigned y = 1; y < chunks; ++y) a = comb(a, partial[y * C + c]);
    finish(c, a);
  }
}

// Runs both passes; `device` is where the partials live (the tensors' device).
template <typename Acc, typename Load, typename Combine, typename Finish>
void column_reduce(const char* name, int64_t R, int64_t C, Load load, Combine comb, Acc identity, Finish finish,
                   Device device) {
  if (C == 0) return;
  const unsigned chunks = col_chunks(R);
  static_assert(sizeof(Acc) == 8, "partials are stored as 8-byte values");
  Tensor partial = Tensor::empty({static_cast<int64_t>(chunks) * C}, DType::f64, device);
  const dim3 grid(static_cast<unsigned>((C + 31) / 32), chunks), block(32, kColRowLanes);
  col_partial_kernel<Acc><<<grid, block, 0, stream()>>>(R, C, load, comb, identity, partial.ptr<Acc>());
  check_launch(name);
  col_finish_kernel<Acc><<<grid_for(C, 256), 256, 0, stream()>>>(C, chunks, partial.ptr<Acc>(), comb, finish);
  check_launch(name);
}

// dst[idx[j], :] += src[j, :] for j < n (src [n, D], dst [V, D], idx i32 or i64 in [0, V)), in a
// deterministic order whatever the duplicates: a stable sort of idx, then each run of equal
// indices is summed in increasing j. Shared by embedding_backward and scatter_add (select.cu).
void index_add_rows(const char* name, const Tensor& idx, const Tensor& src, int64_t D, Tensor& dst);

}  // namespace dtk::ops::cuda::kern
