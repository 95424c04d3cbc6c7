// The CUDA runtime calls of core::cuda, for builds with the CUDA backend.
#include <cuda_runtime.h>

#include "dtk/core/device.h"
#include "dtk/core/error.h"

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
