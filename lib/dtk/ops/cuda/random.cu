// CUDA fill, cast and Philox fills: one thread per element (grid-stride), the same element
// functions as the CPU (core/philox.h, ops/convert.h), so the results are bit-identical.
#include <cuda_runtime.h>

#include "dtk/core/error.h"
#include "dtk/core/philox.h"
#include "dtk/ops/backend.h"
#include "dtk/ops/convert.h"

namespace dtk::ops::cuda {
using namespace dtk::ops::detail;

namespace {
cudaStream_t stream() { return static_cast<cudaStream_t>(dtk::cuda::current_stream().handle); }

void check_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) fail(std::string("CUDA kernel ") + what + ": " + cudaGetErrorString(e));
}

unsigned blocks_for(int64_t n, int threads) {
  const int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 65535 * 16 ? (b > 0 ? b : 1) : 65535 * 16);
}

template <typename T>
__global__ void fill_kernel(T* p, T v, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = v;
}

template <typename D, typename S>
__global__ void cast_kernel(D* d, const S* s, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    d[i] = convert<D>(s[i]);
}

template <typename T, bool Normal>
__global__ void philox_kernel(T* p, int64_t n, uint64_t seed, uint64_t offset, double a, double b) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t c = offset + static_cast<uint64_t>(i);
    // normal: fma(z, std, mean); uniform: fma(u, hi - lo, lo) — explicit fma as on the host
    const double v = Normal ? fma(philox::normal(seed, c), b, a) : fma(philox::uniform(seed, c), b, a);
    p[i] = from_double<T>(v);
  }
}

template <bool Normal>
void philox_fill(Tensor& out, uint64_t seed, uint64_t offset, double a, double b, const char* name) {
  const int64_t n = out.numel();
  if (!n) return;
  visit_dtype(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, bf16_t> ||
                  std::is_same_v<T, f16_t>) {
      philox_kernel<T, Normal><<<blocks_for(n, 256), 256, 0, stream()>>>(out.ptr<T>(), n, seed, offset, a, b);
    }
  });
  check_launch(name);
}
}  // namespace

void fill(Tensor& out, double v) {
  const int64_t n = out.numel();
  if (!n) return;
  visit_dtype(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    fill_kernel<T><<<blocks_for(n, 256), 256, 0, stream()>>>(out.ptr<T>(), from_double<T>(v), n);
  });
  check_launch("fill");
}

void cast(const Tensor& src, Tensor& dst) {
  const int64_t n = src.numel();
  if (!n) return;
  visit_dtype(src.dtype(), [&](auto stag) {
    using S = decltype(stag);
    visit_dtype(dst.dtype(), [&](auto dtag) {
      using D = decltype(dtag);
      cast_kernel<D, S><<<blocks_for(n, 256), 256, 0, stream()>>>(dst.ptr<D>(), src.ptr<S>(), n);
    });
  });
  check_launch("cast");
}

void uniform_(Tensor& out, uint64_t seed, uint64_t offset, double lo, double hi) {
  philox_fill<false>(out, seed, offset, lo, hi - lo, "uniform_");
}

void normal_(Tensor& out, uint64_t seed, uint64_t offset, double mean, double std) {
  philox_fill<true>(out, seed, offset, mean, std, "normal_");
}

}  // namespace dtk::ops::cuda
