// The CUDA runtime calls of core::cuda, for builds with the CUDA backend.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

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

std::string describe() {
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);  // 0 without a driver
  const auto version = [](int v) { return fmt::format("{}.{}", v / 1000, v % 1000 / 10); };
  std::string s = fmt::format("runtime {}, code for sm_{}, driver {}", version(runtime), DTK_CUDA_ARCHITECTURES,
                              driver ? version(driver) : "none");
  const int n = device_count();
  s += fmt::format("; GPUs visible: {}", n);
  for (int i = 0; i < n; ++i) s += (i ? ", " : " (") + device_name(i) + (i + 1 == n ? ")" : "");
  return s;
}

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
void host_register(void* p, size_t bytes) { check(cudaHostRegister(p, bytes, cudaHostRegisterDefault), "cudaHostRegister"); }
void host_unregister(void* p) { cudaHostUnregister(p); }

std::string device_uuid(int index) {
  cudaDeviceProp p{};
  check(cudaGetDeviceProperties(&p, index), "cudaGetDeviceProperties");
  const auto* b = reinterpret_cast<const unsigned char*>(p.uuid.bytes);
  return fmt::format("GPU-{:02x}{:02x}{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}",
                     b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

namespace {
bool on_device(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();  // not a pointer CUDA knows: host memory
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}
}  // namespace

void memcpy(void* dst, const void* src, size_t bytes) {
  if (!bytes) return;
  // On the current stream, after the work queued there (cudaMemcpy would go on the legacy
  // stream, which a non-blocking current stream does not wait for). With host memory on either
  // side (pageable, perhaps gone after return) the host then waits for the copy, watched:
  // cudaMemcpy's own wait would not be. Device to device stays in stream order.
  const Stream s = current_stream();
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(s.handle)), "cudaMemcpyAsync");
  if (!on_device(dst) || !on_device(src)) stream_synchronize(s, "a copy between host and GPU");
}

// ---- host waits --------------------------------------------------------------------------

bool event_done(void* event) {
  const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (e == cudaErrorNotReady) return false;
  check(e, "cudaEventQuery");
  return true;
}

namespace {
std::atomic<WaitHook> g_wait_hook{nullptr};

// Events for stream_synchronize, per device (an event belongs to the device current when it
// was made), reused: one cudaEventCreate per wait would cost more than the wait. Blocking-sync
// events: a host without a hook sleeps in cudaEventSynchronize instead of spinning. Never
// destroyed (waits may happen during static destruction).
struct WaitEvents {
  std::mutex mu;
  std::map<int, std::vector<cudaEvent_t>> free;
};
WaitEvents& wait_events() {
  static auto* w = new WaitEvents;
  return *w;
}
}  // namespace

void set_wait_hook(WaitHook hook) { g_wait_hook.store(hook); }

namespace {
std::atomic<uint64_t> g_stalls{0};  // wait_event's waits whose event was not complete yet
}  // namespace
uint64_t host_stalls() { return g_stalls.load(); }

void wait_event(void* event, const char* what, size_t bytes) {
  if (!event_done(event)) g_stalls.fetch_add(1);
  if (WaitHook hook = g_wait_hook.load()) {
    hook(what, bytes, &event_done, event);
    return;
  }
  check(cudaEventSynchronize(static_cast<cudaEvent_t>(event)), what);
}

}  // namespace dtk::cuda

// ---- streams and the caching allocator ---------------------------------------------------

namespace dtk::cuda {
namespace {
thread_local cudaStream_t t_stream = nullptr;

// Blocks are rounded (512 B below 1 MiB, 2 MiB above) and kept on free lists by device and exact
// rounded size when released; a request takes a cached block of its device and size first.
// Blocks are used in stream order on the current stream, so a block freed and reused on the
// same stream is safe; memory handed to another stream (NCCL's) must be kept alive by its user
// until that completes. The statistics count every device together.
struct Cache {
  std::mutex mu;
  std::multimap<std::pair<int, size_t>, void*> free;  // (device, block size) -> pointer
  MemoryStats stats;
} g_cache;

// Makes `device` current for a scope (cudaMalloc allocates on the current device).
struct OnDevice {
  int previous = 0;
  explicit OnDevice(int device) {
    check(cudaGetDevice(&previous), "cudaGetDevice");
    if (previous != device) check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~OnDevice() { cudaSetDevice(previous); }
};

// Gives every cached block back to the driver (the lock held). cudaFree waits for the whole
// device, every stream included (NCCL's, whose collective may be stuck on a peer that died,
// and which the current stream need not wait on), and nothing bounds that wait. So the frees
// run on a thread of their own while this one waits for them through the wait hook, as for any
// wait for the GPU: watched, a stuck collective ends the job with its line instead of hanging it
// here. If the wait fails (the hook found NCCL failed), the thread keeps the blocks.
void release_cached() {
  if (g_cache.free.empty()) return;
  struct Frees {
    std::vector<std::pair<int, void*>> blocks;  // (device, pointer)
    std::atomic<bool> done{false};
  };
  auto f = std::make_shared<Frees>();
  size_t bytes = 0;
  for (auto& [key, q] : g_cache.free) {
    f->blocks.emplace_back(key.first, q);
    bytes += key.second;
  }
  g_cache.free.clear();
  g_cache.stats.reserved -= bytes;
  const auto free_all = [f] {
    for (auto [device, q] : f->blocks) {
      cudaSetDevice(device);
      cudaFree(q);
    }
    f->done.store(true, std::memory_order_release);
  };
  if (WaitHook hook = g_wait_hook.load()) {
    std::thread(free_all).detach();
    hook("the GPU's work before cached memory is freed", bytes,
         [](void* d) { return static_cast<std::atomic<bool>*>(d)->load(std::memory_order_acquire); }, &f->done);
  } else {
    const OnDevice keep(current_device());  // free_all switches devices
    free_all();
  }
}

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
void stream_synchronize(Stream s, const char* what) {
  const int device = current_device();
  cudaEvent_t e = nullptr;
  {
    WaitEvents& w = wait_events();
    std::lock_guard lock(w.mu);
    auto& free = w.free[device];
    if (!free.empty()) {
      e = free.back();
      free.pop_back();
    }
  }
  if (!e) check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventBlockingSync), "cudaEventCreate");
  struct Return {  // the event goes back to the pool however the wait ends
    int device;
    cudaEvent_t e;
    ~Return() {
      WaitEvents& w = wait_events();
      std::lock_guard lock(w.mu);
      w.free[device].push_back(e);
    }
  } back{device, e};
  check(cudaEventRecord(e, static_cast<cudaStream_t>(s.handle)), "cudaEventRecord");
  wait_event(e, what);
}

void* create_timing_event() {
  cudaEvent_t e = nullptr;
  check(cudaEventCreateWithFlags(&e, cudaEventBlockingSync), "cudaEventCreate");
  return e;
}
void destroy_event(void* event) {
  if (event) cudaEventDestroy(static_cast<cudaEvent_t>(event));
}
void record_event(void* event, Stream s) {
  check(cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(s.handle)), "cudaEventRecord");
}
double elapsed_seconds(void* start, void* stop) {
  float ms = 0;
  check(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start), static_cast<cudaEvent_t>(stop)),
        "cudaEventElapsedTime");
  return ms * 1e-3;
}
void memcpy_async(void* dst, const void* src, size_t bytes, Stream s) {
  if (bytes)
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(s.handle)),
          "cudaMemcpyAsync");
}
void memset_async(void* dst, int value, size_t bytes, Stream s) {
  if (bytes) check(cudaMemsetAsync(dst, value, bytes, static_cast<cudaStream_t>(s.handle)), "cudaMemsetAsync");
}

void* cached_malloc(size_t bytes, int device, size_t* block) {
  const size_t size = round_block(bytes);
  std::lock_guard lock(g_cache.mu);
  void* p = nullptr;
  auto it = g_cache.free.find({device, size});
  if (it != g_cache.free.end()) {
    p = it->second;
    g_cache.free.erase(it);
  } else {
    OnDevice on(device);
    cudaError_t e = cudaMalloc(&p, size);
    if (e == cudaErrorMemoryAllocation && !g_cache.free.empty()) {  // give the cache back, retry once
      cudaGetLastError();
      release_cached();
      e = cudaMalloc(&p, size);
    }
    if (e != cudaSuccess) {
      cudaGetLastError();
      fail("CUDA out of memory allocating {} bytes on GPU {} ({} in use, {} reserved): {}", bytes, device,
           g_cache.stats.current, g_cache.stats.reserved, cudaGetErrorString(e));
    }
    g_cache.stats.reserved += size;
  }
  g_cache.stats.current += size;
  g_cache.stats.allocations += 1;
  if (g_cache.stats.current > g_cache.stats.peak) g_cache.stats.peak = g_cache.stats.current;
  *block = size;
  return p;
}

void cached_free(void* p, int device, size_t block) {
  std::lock_guard lock(g_cache.mu);
  g_cache.stats.current -= block;
  g_cache.free.emplace(std::pair{device, block}, p);
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
  release_cached();
}

}  // namespace dtk::cuda
