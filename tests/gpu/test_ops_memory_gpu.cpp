// The CUDA caching allocator (core/cuda/runtime.cpp), reached as the programs reach it: tensors
// on the GPU, memory_stats and empty_cache. Blocks are rounded (512 B below 1 MiB, 2 MiB above) and
// kept, when freed, on free lists by size; empty_cache gives them back to the driver; a cudaMalloc
// that fails for want of memory gives the cache back and tries once more; a failure after that is
// a dtk::Error "CUDA out of memory ...", which leaves the process able to allocate and compute.
//
// Sizes come from cudaMemGetInfo at run time, so the tests hold on any card. Each starts and ends
// with an empty cache, and checks the statistics as differences from its start (other tests may
// hold tensors of their own). The driver's free memory is exact to the byte for what these tests
// do (whole 2 MiB pages, nothing else running), but only the direction and a coarse size of its
// changes are asserted: its own bookkeeping is not dtk's to predict.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "dtk/core/error.h"
#include "dtk/core/tensor.h"
#include "dtk/ops/ops.h"
#include "../common/gpu_check.h"

namespace dtk {
namespace {

using namespace gpu_test;

constexpr size_t kMiB = size_t(1) << 20;
constexpr size_t kGiB = size_t(1) << 30;

// The driver's free and total memory of the current device.
std::pair<size_t, size_t> device_memory() {
  size_t free = 0, total = 0;
  const cudaError_t e = cudaMemGetInfo(&free, &total);
  EXPECT_EQ(e, cudaSuccess) << cudaGetErrorString(e);
  return {free, total};
}

Tensor device_bytes(size_t n) { return Tensor::empty({static_cast<int64_t>(n)}, DType::u8, kGpu); }

// Empties the cache when it goes out of scope: declared before a test's tensors, it runs after they
// are freed, also when an ASSERT returns early, so that no test leaves the card full of cached
// blocks for the next.
struct EmptyCacheAtExit {
  ~EmptyCacheAtExit() { empty_cache(kGpu); }
};

// Every byte of a u8 tensor equals v (read back to the host).
bool all_bytes_are(const Tensor& t, double v) {
  for (double x : t.to_doubles())
    if (x != v) return false;
  return true;
}

// empty_cache frees every cached block (reserved falls to what live tensors hold, and the driver's
// free memory rises by about what was cached) and nothing in use: a live tensor keeps its contents.
TEST(GpuMemory, EmptyCacheReturnsEveryCachedBlock) {
  SKIP_WITHOUT_GPU();
  constexpr int kBlocks = 8;
  constexpr size_t kSize = 64 * kMiB;
  const EmptyCacheAtExit at_exit;
  empty_cache(kGpu);
  const MemoryStats s0 = memory_stats(kGpu);
  ASSERT_EQ(s0.reserved, s0.current) << "empty_cache left free blocks in the cache";
  if (device_memory().first < kBlocks * kSize + kGiB) GTEST_SKIP() << "needs 1.5 GiB of free device memory";

  Tensor live = device_bytes(2 * kMiB + 1);  // 2 MiB + 1 byte: a block of 4 MiB
  ops::fill(live, 7);
  EXPECT_EQ(memory_stats(kGpu).current, s0.current + 4 * kMiB) << "the block of 2 MiB + 1 byte";
  {
    std::vector<Tensor> held;
    for (int i = 0; i < kBlocks; ++i) held.push_back(device_bytes(kSize));
    const MemoryStats s = memory_stats(kGpu);
    EXPECT_EQ(s.current, s0.current + 4 * kMiB + kBlocks * kSize);
    EXPECT_EQ(s.reserved, s.current);
  }
  const MemoryStats cached = memory_stats(kGpu);
  EXPECT_EQ(cached.current, s0.current + 4 * kMiB);
  EXPECT_EQ(cached.reserved - cached.current, kBlocks * kSize) << "freed blocks stay in the cache";
  {
    Tensor again = device_bytes(kSize);  // a cached size: served from the cache, nothing new reserved
    EXPECT_EQ(memory_stats(kGpu).reserved, cached.reserved);
  }

  const size_t free_before = device_memory().first;
  empty_cache(kGpu);
  const size_t free_after = device_memory().first;
  const MemoryStats s1 = memory_stats(kGpu);
  EXPECT_EQ(s1.reserved, s1.current) << "empty_cache kept cached blocks";
  EXPECT_EQ(s1.current, s0.current + 4 * kMiB) << "empty_cache changed what is in use";
  EXPECT_TRUE(all_bytes_are(live, 7)) << "empty_cache freed a live block";
  // The driver's free memory rises by what was cached: asserted to 10% (see the top).
  const double cached_bytes = double(kBlocks * kSize);
  const double shortfall =
      free_after > free_before ? std::max(0.0, 1 - double(free_after - free_before) / cached_bytes) : 1.0;
  report("empty_cache(freed)", "bytes", shortfall, 0.1);

  live = Tensor();
  empty_cache(kGpu);
  EXPECT_EQ(memory_stats(kGpu).reserved, s0.reserved);
}

// A request that the driver cannot meet while the cache holds free blocks of another size is met
// after giving the cache back. The card is filled by a live ballast down to 1 GiB free plus 1 GiB
// of cached blocks of 256 MiB; the request is 512 MiB more than the driver's free memory: too
// large without the cached GiB, 512 MiB short of it with. The peak is the ballast plus the
// request, half a GiB below the free memory at the start.
TEST(GpuMemory, OutOfMemoryRetryGivesTheCacheBack) {
  SKIP_WITHOUT_GPU();
  constexpr size_t kBlock = 256 * kMiB, kCached = 4 * kBlock, kMargin = kGiB, kPage = 2 * kMiB;
  const EmptyCacheAtExit at_exit;
  empty_cache(kGpu);
  const MemoryStats s0 = memory_stats(kGpu);
  const size_t free0 = device_memory().first;
  if (free0 < kMargin + kCached + kGiB) GTEST_SKIP() << "needs 3 GiB of free device memory";

  Tensor ballast = device_bytes((free0 - kMargin - kCached) / kPage * kPage);
  {
    std::vector<Tensor> blocks;
    for (size_t i = 0; i < kCached / kBlock; ++i) blocks.push_back(device_bytes(kBlock));
  }
  const MemoryStats s1 = memory_stats(kGpu);
  ASSERT_EQ(s1.reserved - s1.current, kCached) << "the freed blocks are cached";
  const size_t free1 = device_memory().first;
  // Whole pages, half the cache more than the driver has (it cannot be met without the cache, and
  // can with it, with half the cache to spare), and of a size the cache does not hold (a cached
  // block of that size would be taken without a retry): at least 512 MiB more than kBlock.
  const size_t request = (free1 + kCached / 2 + kPage - 1) / kPage * kPage;

  Tensor big;
  try {
    big = device_bytes(request);
  } catch (const Error& e) {
    ADD_FAILURE() << "the retry did not free the cache: " << e.what();
  }
  const MemoryStats s2 = memory_stats(kGpu);
  const bool given_back = big.defined() && s2.reserved == s2.current;
  EXPECT_TRUE(given_back) << "reserved " << s2.reserved << ", in use " << s2.current;
  if (big.defined()) {
    EXPECT_EQ(s2.current, s1.current + request);
    ops::fill(big, 3);  // the block is real memory: written at both ends, read back
    EXPECT_EQ(big.slice(0, 1).item(), 3);
    EXPECT_EQ(big.slice(static_cast<int64_t>(request) - 1, static_cast<int64_t>(request)).item(), 3);
  }
  std::printf("gpu-check: cached_malloc(retry) bytes max_rel_err=%d tol=0 %s\n", given_back ? 0 : 1,
              given_back ? "PASS" : "FAIL");

  big = Tensor();
  ballast = Tensor();
  empty_cache(kGpu);
  const MemoryStats s3 = memory_stats(kGpu);
  EXPECT_EQ(s3.current, s0.current);
  EXPECT_EQ(s3.reserved, s0.reserved);
}

// A request beyond the whole card fails with a dtk::Error (not a UsageError: exit 1, a failure
// while running) that says CUDA out of memory; it gives the cache back on the way (the retry),
// leaks nothing, and leaves no error behind: the process allocates and computes as before (a gemm
// through cuBLAS, whose handle may be created only now, and an add, exact on both devices: one
// rounding of the same sum).
TEST(GpuMemory, RequestBeyondTheCardFailsAndIsNotSticky) {
  SKIP_WITHOUT_GPU();
  const EmptyCacheAtExit at_exit;
  empty_cache(kGpu);
  const size_t total = device_memory().second;
  { Tensor t = device_bytes(64 * kMiB); }  // one cached block
  const MemoryStats s0 = memory_stats(kGpu);
  ASSERT_EQ(s0.reserved - s0.current, 64 * kMiB);

  std::string message;
  try {
    const Tensor huge = device_bytes(2 * total);
    ADD_FAILURE() << "allocated " << huge.str() << " on a card of " << total << " bytes";
  } catch (const UsageError& e) {
    ADD_FAILURE() << "a UsageError (bad input, exit 2) for running out of memory: " << e.what();
  } catch (const Error& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("CUDA out of memory"), std::string::npos) << message;
  const MemoryStats s1 = memory_stats(kGpu);
  EXPECT_EQ(s1.current, s0.current) << "the failed request left bytes in use";
  EXPECT_EQ(s1.reserved, s1.current) << "the cache was not given back before failing";
  const cudaError_t sticky = cudaGetLastError();
  EXPECT_EQ(sticky, cudaSuccess) << cudaGetErrorString(sticky);

  const int64_t m = 257, k = 129, n = 65;
  Tensor a = Tensor::empty({m, k}, DType::f32), b = Tensor::empty({k, n}, DType::f32);
  ops::uniform_(a, 70, 0, -1, 1);
  ops::uniform_(b, 71, 0, -1, 1);
  Tensor c = Tensor::zeros({m, n}, DType::f32), cg = Tensor::zeros({m, n}, DType::f32, kGpu);
  ops::gemm(false, false, 1.0, a, b, 0.0, c);
  ops::gemm(false, false, 1.0, a.to(kGpu), b.to(kGpu), 0.0, cg);
  report("gemm(after out of memory)", "f32", max_rel_err(cg.to_doubles(), c.to_doubles()), tol_for(DType::f32));
  Tensor a2 = Tensor::empty({m, k}, DType::f32);
  ops::uniform_(a2, 72, 0, -1, 1);
  Tensor sum = Tensor::empty({m, k}, DType::f32), sumg = Tensor::empty({m, k}, DType::f32, kGpu);
  ops::add(a, a2, sum);
  ops::add(a.to(kGpu), a2.to(kGpu), sumg);
  report("add(after out of memory)", "f32", exact_err(sumg, sum), 0);
}

}  // namespace
}  // namespace dtk
