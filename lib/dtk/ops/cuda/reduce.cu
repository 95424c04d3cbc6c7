// CUDA reductions: sum, mean, max, min, norm2, absmax over all elements, per row or per column,
// and count_nonfinite. Deterministic by construction: fixed trees, launch geometry a function of
// the sizes only, no floating-point atomics. Accumulation is in double for f32 as well: the
// kernels are memory-bound, so the wider adds cost nothing and the f32 result is correctly
// rounded far more often (sum of 1M floats, mean, norm2 all stay within an ulp or two).
#include "dtk/ops/cuda/common.cuh"

namespace dtk::ops::cuda {
using namespace kern;

namespace {

template <Reduce K>
using Policy = detail::ReducePolicy<K>;

template <Reduce K>
struct CombineOp {
  __device__ double operator()(double a, double b) const { return Policy<K>::combine(a, b); }
};

constexpr int kAllThreads = 256;
// Blocks of the first pass over n elements: a function of n only (determinism), at most 1024 so
// one block of the second pass takes all partials.
unsigned all_blocks(int64_t n) {
  const int64_t b = (n + kAllThreads * 8 - 1) / (kAllThreads * 8);
  return static_cast<unsigned>(b < 1 ? 1 : (b > 1024 ? 1024 : b));
}

template <Reduce K, typename T>
__global__ void all_partial_kernel(const T* x, int64_t n, double* partial) {
  __shared__ double scratch[32];
  double acc = Policy<K>::identity();
  for (int64_t i = global_tid(); i < n; i += grid_stride()) acc = Policy<K>::combine(acc, Policy<K>::map(double(x[i])));
  acc = block_reduce(acc, CombineOp<K>{}, Policy<K>::identity(), scratch);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

template <Reduce K, typename T>
__global__ void all_finish_kernel(const double* partial, int nparts, int64_t n, T* out) {
  __shared__ double scratch[32];
  double acc = threadIdx.x < nparts ? partial[threadIdx.x] : Policy<K>::identity();
  acc = block_reduce(acc, CombineOp<K>{}, Policy<K>::identity(), scratch);
  if (threadIdx.x == 0) out[0] = T(Policy<K>::finish(acc, n));
}

// Rows of at most kWarpRowMax elements: a warp per row, 8 rows per block.
constexpr int64_t kWarpRowMax = 1024;

template <Reduce K, typename T>
__global__ void rows_warp_kernel(const T* x, int64_t R, int64_t C, T* out) {
  const int64_t row = blockIdx.x * int64_t(blockDim.x >> 5) + (threadIdx.x >> 5);
  if (row >= R) return;  // whole warps leave together: the shuffles below stay full-warp
  const int lane = threadIdx.x & 31;
  const T* xr = x + row * C;
  double acc = Policy<K>::identity();
  for (int64_t c = lane; c < C; c += 32) acc = Policy<K>::combine(acc, Policy<K>::map(double(xr[c])));
  acc = warp_reduce(acc, CombineOp<K>{});
  if (lane == 0) out[row] = T(Policy<K>::finish(acc, C));
}

// Long rows: a block per row.
template <Reduce K, typename T>
__global__ void rows_block_kernel(const T* x, int64_t C, T* out) {
  __shared__ double scratch[32];
  const T* xr = x + blockIdx.x * C;
  double acc = Policy<K>::identity();
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) acc = Policy<K>::combine(acc, Policy<K>::map(double(xr[c])));
  acc = block_reduce(acc, CombineOp<K>{}, Policy<K>::identity(), scratch);
  if (threadIdx.x == 0) out[blockIdx.x] = T(Policy<K>::finish(acc, C));
}

template <Reduce K, typename T>
struct ColLoad {
  const T* x;
  int64_t C;
  __device__ double operator()(int64_t r, int64_t c) const { return Policy<K>::map(double(x[r * C + c])); }
};
template <Reduce K, typename T>
struct ColStore {
  T* out;
  int64_t R;
  __device__ void operator()(int64_t c, double acc) const { out[c] = T(Policy<K>::finish(acc, R)); }
};

template <Reduce K, typename T>
void reduce_typed(Axis axis, const Tensor& a, Tensor& out) {
  const T* x = a.ptr<T>();
  T* o = out.ptr<T>();
  if (axis == Axis::all) {
    const int64_t n = a.numel();
    const unsigned blocks = all_blocks(n);
    Tensor partial = Tensor::empty({static_cast<int64_t>(blocks)}, DType::f64, a.device());
    all_partial_kernel<K, T><<<blocks, kAllThreads, 0, stream()>>>(x, n, partial.ptr<double>());
    check_launch("reduce(all)");
    all_finish_kernel<K, T><<<1, 1024, 0, stream()>>>(partial.ptr<double>(), static_cast<int>(blocks), n, o);
    check_launch("reduce(all)");
    return;
  }
  const int64_t R = a.dim(0), C = a.numel() / (R > 0 ? R : 1);
  if (axis == Axis::rows) {
    if (R == 0) return;
    if (C <= kWarpRowMax) {
      const unsigned blocks = static_cast<unsigned>((R + 7) / 8);
      rows_warp_kernel<K, T><<<blocks, 256, 0, stream()>>>(x, R, C, o);
    } else {
      rows_block_kernel<K, T><<<static_cast<unsigned>(R), 512, 0, stream()>>>(x, C, o);
    }
    check_launch("reduce(rows)");
    return;
  }
  const int64_t Ccols = a.ndim() >= 2 ? a.dim(-1) : C;
  column_reduce<double>("reduce(cols)", R, Ccols, ColLoad<K, T>{x, Ccols}, CombineOp<K>{}, Policy<K>::identity(),
                        ColStore<K, T>{o, R}, a.device());
}

template <typename T>
__global__ void count_nonfinite_kernel(const T* x, int64_t n, unsigned long long* count) {
  __shared__ unsigned long long scratch[32];
  unsigned long long c = 0;
  for (int64_t i = global_tid(); i < n; i += grid_stride()) {
    c += isfinite(x[i]) ? 0 : 1;
  }
  c = block_reduce(c, SumOp{}, 0ull, scratch);
  // An integer atomic: the total is exact whatever the order, so still deterministic.
  if (threadIdx.x == 0 && c) atomicAdd(count, c);
}

// bf16 / f16: NaN or Inf by the exponent bits (detail::exponent_mask16).
__global__ void count_nonfinite16_kernel(const uint16_t* x, int64_t n, uint16_t exp_mask, unsigned long long* count) {
  __shared__ unsigned long long scratch[32];
  unsigned long long c = 0;
  for (int64_t i = global_tid(); i < n; i += grid_stride()) c += (x[i] & exp_mask) == exp_mask ? 1 : 0;
  c = block_reduce(c, SumOp{}, 0ull, scratch);
  if (threadIdx.x == 0 && c) atomicAdd(count, c);
}

}  // namespace

void reduce(Reduce kind, Axis axis, const Tensor& a, Tensor& out) {
  detail::visit_reduce(kind, [&](auto k) {
    visit_float(a.dtype(), [&](auto tag) { reduce_typed<decltype(k)::value, decltype(tag)>(axis, a, out); });
  });
}

int64_t count_nonfinite(const Tensor& a) {
  const int64_t n = a.numel();
  if (n == 0) return 0;
  Tensor count = Tensor::empty({1}, DType::i64, a.device());
  auto* c = static_cast<unsigned long long*>(count.data());
  check_cuda(cudaMemsetAsync(c, 0, sizeof(*c), stream()), "count_nonfinite: cudaMemsetAsync");
  const unsigned blocks = grid_for(n, 256);
  switch (a.dtype()) {
    case DType::f32: count_nonfinite_kernel<float><<<blocks, 256, 0, stream()>>>(a.ptr<float>(), n, c); break;
    case DType::f64: count_nonfinite_kernel<double><<<blocks, 256, 0, stream()>>>(a.ptr<double>(), n, c); break;
    case DType::bf16: count_nonfinite16_kernel<<<blocks, 256, 0, stream()>>>(a.ptr<uint16_t>(), n, detail::exponent_mask16(DType::bf16), c); break;
    case DType::f16: count_nonfinite16_kernel<<<blocks, 256, 0, stream()>>>(a.ptr<uint16_t>(), n, detail::exponent_mask16(DType::f16), c); break;
    default: fail_usage("count_nonfinite: expected a float tensor, got " + a.str());
  }
  check_launch("count_nonfinite");
  unsigned long long host = 0;
  check_cuda(cudaMemcpyAsync(&host, c, sizeof(host), cudaMemcpyDeviceToHost, stream()), "count_nonfinite: copy");
  dtk::cuda::stream_synchronize(dtk::cuda::current_stream(), "count_nonfinite's result");
  return static_cast<int64_t>(host);
}

}  // namespace dtk::ops::cuda
