// CUDA selection ops: topk_abs (CUB radix sort), gather, scatter_add, and the deterministic
// index-add that embedding_backward and scatter_add share.
//
// Index-add without float atomics: a stable radix sort of the indices (payload: the position j),
// a run-length encoding of the sorted indices and a scan of the run lengths give, for each distinct
// destination row, the positions that add into it in increasing order. One block per run then adds
// them in that order, column by column. The result is bit-identical run to run, and equal to a
// sequential CPU loop over j (dst += src[j] in increasing j).
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_run_length_encode.cuh>
#include <cub/device/device_scan.cuh>

#include "dtk/ops/cuda/common.cuh"

namespace dtk::ops::cuda {
using namespace kern;

namespace {

// Temporary device bytes through the caching allocator (freed back to its cache on return; later
// work on the same stream is ordered after the kernels that used them).
Tensor scratch_bytes(size_t bytes, Device d) {
  return Tensor::empty({static_cast<int64_t>(bytes > 0 ? bytes : 1)}, DType::u8, d);
}

__global__ void iota_kernel(int64_t* p, int64_t n) {
  for (int64_t i = global_tid(); i < n; i += grid_stride()) p[i] = i;
}

template <typename T>
__global__ void abs_kernel(const T* x, T* y, int64_t n) {
  for (int64_t i = global_tid(); i < n; i += grid_stride()) y[i] = d_abs(x[i]);
}

template <typename T>
__global__ void topk_gather_kernel(const T* x, const int64_t* order, T* values, int64_t* indices, int64_t k) {
  for (int64_t j = global_tid(); j < k; j += grid_stride()) {
    const int64_t i = order[j];
    values[j] = x[i];
    indices[j] = i;
  }
}

// One block per run of equal destination indices; threads across the D columns.
template <typename T, typename Key>
__global__ void run_add_kernel(const Key* unique, const int64_t* offsets, const int64_t* counts,
                               const int64_t* num_runs, const int64_t* order, const T* src, T* dst, int64_t D) {
  const int64_t runs = *num_runs;
  for (int64_t r = blockIdx.x; r < runs; r += gridDim.x) {
    const int64_t row = static_cast<int64_t>(unique[r]), begin = offsets[r], end = begin + counts[r];
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
      T acc = dst[row * D + d];
      for (int64_t j = begin; j < end; ++j) acc += src[order[j] * D + d];
      dst[row * D + d] = acc;
    }
  }
}

template <typename Key, typename T>
void index_add_typed(const char* name, const Key* idx, int64_t N, const T* src, int64_t D, T* dst, Device dev) {
  cudaStream_t s = stream();
  Tensor keys_sorted = Tensor::empty({N}, sizeof(Key) == 4 ? DType::i32 : DType::i64, dev);
  Tensor pos = Tensor::empty({N}, DType::i64, dev), order = Tensor::empty({N}, DType::i64, dev);
  Tensor unique = Tensor::empty({N}, sizeof(Key) == 4 ? DType::i32 : DType::i64, dev);
  Tensor counts = Tensor::empty({N}, DType::i64, dev), offsets = Tensor::empty({N}, DType::i64, dev);
  Tensor num_runs = Tensor::empty({1}, DType::i64, dev);
  Key* ks = static_cast<Key*>(keys_sorted.data());
  Key* uq = static_cast<Key*>(unique.data());
  int64_t* ps = pos.ptr<int64_t>();
  int64_t* od = order.ptr<int64_t>();
  int64_t* ct = counts.ptr<int64_t>();
  int64_t* of = offsets.ptr<int64_t>();
  int64_t* nr = num_runs.ptr<int64_t>();

  iota_kernel<<<grid_for(N, 256), 256, 0, s>>>(ps, N);
  check_launch(name);
  // Stable sort by index: positions with equal indices keep increasing order.
  size_t sort_bytes = 0, rle_bytes = 0, scan_bytes = 0;
  check_cuda(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, idx, ks, ps, od, N, 0, int(sizeof(Key) * 8), s),
             name);
  check_cuda(cub::DeviceRunLengthEncode::Encode(nullptr, rle_bytes, ks, uq, ct, nr, N, s), name);
  check_cuda(cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, ct, of, N, s), name);
  Tensor tmp = scratch_bytes(std::max(sort_bytes, std::max(rle_bytes, scan_bytes)), dev);
  check_cuda(cub::DeviceRadixSort::SortPairs(tmp.data(), sort_bytes, idx, ks, ps, od, N, 0, int(sizeof(Key) * 8), s),
             name);
  // Counts past the number of runs are never read, but zero them so the scan reads defined memory.
  check_cuda(cudaMemsetAsync(ct, 0, sizeof(int64_t) * N, s), name);
  check_cuda(cub::DeviceRunLengthEncode::Encode(tmp.data(), rle_bytes, ks, uq, ct, nr, N, s), name);
  check_cuda(cub::DeviceScan::ExclusiveSum(tmp.data(), scan_bytes, ct, of, N, s), name);
  const unsigned blocks = static_cast<unsigned>(N < 8192 ? N : 8192);
  const int threads = D >= 128 ? 128 : 32;
  run_add_kernel<T, Key><<<blocks, threads, 0, s>>>(uq, of, ct, nr, od, src, dst, D);
  check_launch(name);
}

template <typename U, typename Idx>
__global__ void gather_kernel(const U* x, const Idx* idx, U* out, int64_t n) {
  for (int64_t j = global_tid(); j < n; j += grid_stride()) out[j] = x[static_cast<int64_t>(idx[j])];
}

}  // namespace

namespace kern {
void index_add_rows(const char* name, const Tensor& idx, const Tensor& src, int64_t D, Tensor& dst) {
  const int64_t N = idx.numel();
  if (N == 0 || D == 0) return;
  visit_float(dst.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if (idx.dtype() == DType::i64)
      index_add_typed<int64_t, T>(name, idx.ptr<int64_t>(), N, src.ptr<T>(), D, dst.ptr<T>(), dst.device());
    else
      index_add_typed<int32_t, T>(name, idx.ptr<int32_t>(), N, src.ptr<T>(), D, dst.ptr<T>(), dst.device());
  });
}
}  // namespace kern

// A stable descending radix sort of |x| with the positions as payload: ties keep increasing
// position, so equal magnitudes go to the lower index, as the contract asks.
void topk_abs(const Tensor& x, int64_t k, Tensor& values, Tensor& indices) {
  const int64_t n = x.numel();
  if (k == 0 || n == 0) return;
  const Device dev = x.device();
  cudaStream_t s = stream();
  visit_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    Tensor keys = Tensor::empty({n}, x.dtype(), dev), keys_sorted = Tensor::empty({n}, x.dtype(), dev);
    Tensor pos = Tensor::empty({n}, DType::i64, dev), order = Tensor::empty({n}, DType::i64, dev);
    abs_kernel<T><<<grid_for(n, 256), 256, 0, s>>>(x.ptr<T>(), keys.ptr<T>(), n);
    check_launch("topk_abs");
    iota_kernel<<<grid_for(n, 256), 256, 0, s>>>(pos.ptr<int64_t>(), n);
    check_launch("topk_abs");
    size_t bytes = 0;
    check_cuda(cub::DeviceRadixSort::SortPairsDescending(nullptr, bytes, keys.ptr<T>(), keys_sorted.ptr<T>(),
                                                         pos.ptr<int64_t>(), order.ptr<int64_t>(), n, 0,
                                                         int(sizeof(T) * 8), s),
               "topk_abs: cub::DeviceRadixSort");
    Tensor tmp = scratch_bytes(bytes, dev);
    check_cuda(cub::DeviceRadixSort::SortPairsDescending(tmp.data(), bytes, keys.ptr<T>(), keys_sorted.ptr<T>(),
                                                         pos.ptr<int64_t>(), order.ptr<int64_t>(), n, 0,
                                                         int(sizeof(T) * 8), s),
               "topk_abs: cub::DeviceRadixSort");
    topk_gather_kernel<T><<<grid_for(k, 256), 256, 0, s>>>(x.ptr<T>(), order.ptr<int64_t>(), values.ptr<T>(),
                                                            indices.ptr<int64_t>(), k);
    check_launch("topk_abs");
  });
}

// Moves elements as raw bits. The public op (ops/select.cpp) takes f32 or f64 x and i64 indices.
void gather(const Tensor& x, const Tensor& indices, Tensor& out) {
  const int64_t n = out.numel();
  if (n == 0) return;
  const int64_t* idx = indices.ptr<int64_t>();
  const unsigned blocks = grid_for(n, 256);
  if (dtype_size(x.dtype()) == 4)
    gather_kernel<<<blocks, 256, 0, stream()>>>(x.ptr<uint32_t>(), idx, out.ptr<uint32_t>(), n);
  else
    gather_kernel<<<blocks, 256, 0, stream()>>>(x.ptr<uint64_t>(), idx, out.ptr<uint64_t>(), n);
  check_launch("gather");
}

// out[idx[j]] += v[j]: the index-add with rows of one element.
void scatter_add(const Tensor& indices, const Tensor& values, Tensor& out) {
  index_add_rows("scatter_add", indices, values, 1, out);
}

}  // namespace dtk::ops::cuda
