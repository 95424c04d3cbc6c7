// The CUDA runtime calls of core::cuda, for builds with the CUDA backend.
#include <cuda_runtime.h>

#include <map>
#include <mutex>

#include "dtk/core/device.h"
#include "dtk/core/error.h"
#include "dtk/core/tensor.h"

namespace dtk::cuda {
namespace {
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail(std::string("CUDA ") + what + ": " + cudaGetErrorString(e));
}
}  // namespace

bool compiled() { return true; }

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

void set_device(int index) { check(cudaSetDevice(index), "cudaSetDevice"); }

int current_device() {
  int d = 0;
  check(cudaGetDevice(&d), "cudaGetDevice");
  return d;
}

std::string device_name(int index) {
  cudaDeviceProp p{};
  check(cudaGetDeviceProperties(&p, index), "cudaGetDeviceProperties");
  return p.name;
}

void* malloc_device(size_t bytes) {
  void* p = nullptr;
  check(cudaMalloc(&p, bytes), "cudaMalloc");
  return p;
}
void free_device(void* p) { cudaFree(p); }

void* malloc_pinned(size_t bytes) {
  void* p = nullptr;
  check(cudaMallocHost(&p, bytes), "cudaMallocHost");
  return p;
}
void free_pinned(void* p) { cudaFreeHost(p); }

void memcpy(void* dst, const void* src, size_t bytes) {
  if (bytes) check(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault), "cudaMemcpy");
}

void synchronize() { check(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }

}  // namespace dtk::cuda

// ---- streams and the caching allocator ---------------------------------------------------

namespace dtk::cuda {
namespace {
thread_local cudaStream_t t_stream = nullptr;

// Blocks are rounded (512 B below 1 MiB, 2 MiB above) and kept on free lists by exact rounded
// size when released; a request takes a cached block of its size first. Blocks are used in
// stream order on the current stream, so a block freed and reused on the same stream is safe;
// memory handed to another stream (NCCL's) must be kept alive by its user until that completes.
struct Cache {
  std::mutex mu;
  std::multimap<size_t, void*> free;  // block size -> pointer
  MemoryStats stats;
} g_cache;

size_t round_block(size_t bytes) {
  if (bytes < (1u << 20)) return (bytes + 511) / 512 * 512 + (bytes == 0 ? 512 : 0);
  return (bytes + (2u << 20) - 1) / (2u << 20) * (2u << 20);
}
}  // namespace

Stream current_stream() { return Stream{t_stream}; }
void set_current_stream(Stream s) { t_stream = static_cast<cudaStream_t>(s.handle); }

Stream create_stream() {
  cudaStream_t s = nullptr;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  return Stream{s};
}
void destroy_stream(Stream s) {
  if (s.handle) cudaStreamDestroy(static_cast<cudaStream_t>(s.handle));
}
void stream_synchronize(Stream s) {
  check(cudaStreamSynchronize(static_cast<cudaStream_t>(s.handle)), "cudaStreamSynchronize");
}
void memcpy_async(void* dst, const void* src, size_t bytes, Stream s) {
  if (bytes)
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(s.handle)),
          "cudaMemcpyAsync");
}
void memset_async(void* dst, int value, size_t bytes, Stream s) {
  if (bytes) check(cudaMemsetAsync(dst, value, bytes, static_cast<cudaStream_t>(s.handle)), "cudaMemsetAsync");
}

void* cached_malloc(size_t bytes, size_t* block) {
  const size_t size = round_block(bytes);
  std::lock_guard lock(g_cache.mu);
  void* p = nullptr;
  auto it = g_cache.free.find(size);
  if (it != g_cache.free.end()) {
    p = it->second;
    g_cache.free.erase(it);
  } else {
    cudaError_t e = cudaMalloc(&p, size);
    if (e == cudaErrorMemoryAllocation && !g_cache.free.empty()) {  // give the cache back, retry once
      cudaGetLastError();
      for (auto& [sz, q] : g_cache.free) {
        cudaFree(q);
        g_cache.stats.reserved -= sz;
      }
      g_cache.free.clear();
      e = cudaMalloc(&p, size);
    }
    if (e != cudaSuccess) {
      cudaGetLastError();
      fail("CUDA out of memory allocating {} bytes ({} in use, {} reserved): {}", bytes, g_cache.stats.current,
           g_cache.stats.reserved, cudaGetErrorString(e));
    }
    g_cache.stats.reserved += size;
  }
  g_cache.stats.current += size;
  g_cache.stats.allocations += 1;
  if (g_cache.stats.current > g_cache.stats.peak) g_cache.stats.peak = g_cache.stats.current;
  *block = size;
  return p;
}

void cached_free(void* p, size_t block) {
  std::lock_guard lock(g_cache.mu);
  g_cache.stats.current -= block;
  g_cache.free.emplace(block, p);
}

MemoryStats cached_stats() {
  std::lock_guard lock(g_cache.mu);
  return g_cache.stats;
}
void cached_reset_peak() {
  std::lock_guard lock(g_cache.mu);
  g_cache.stats.peak = g_cache.stats.current;
}
void cached_empty() {
  std::lock_guard lock(g_cache.mu);
  for (auto& [sz, q] : g_cache.free) {
    cudaFree(q);
    g_cache.stats.reserved -= sz;
  }
  g_cache.free.clear();
}

}  // namespace dtk::cuda
