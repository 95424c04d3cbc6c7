// core::cuda for builds without the CUDA backend (DTK_WITH_CUDA=OFF or no nvcc): no device
// exists, and asking for device memory is an error that says how to get a CUDA build.
#include "dtk/core/device.h"
#include "dtk/core/error.h"

namespace dtk::cuda {
namespace {
[[noreturn]] void no_cuda() {
  fail_usage("this dtk was built without the CUDA backend; rebuild with nvcc present (DTK_WITH_CUDA=AUTO or ON) to use --device cuda");
}
}  // namespace

bool compiled() { return false; }
std::string describe() { return "none (built without the CUDA backend); GPUs visible: 0"; }
int device_count() { return 0; }
void set_device(int) { no_cuda(); }
int current_device() { no_cuda(); }
std::string device_name(int) { no_cuda(); }
void* malloc_device(size_t) { no_cuda(); }
void free_device(void*) {}
void* malloc_pinned(size_t) { no_cuda(); }
void free_pinned(void*) {}
void host_register(void*, size_t) { no_cuda(); }
void host_unregister(void*) {}
std::string device_uuid(int) { no_cuda(); }
void memcpy(void*, const void*, size_t) { no_cuda(); }
void set_wait_hook(WaitHook) {}
void wait_event(void*, const char*, size_t) { no_cuda(); }
uint64_t host_stalls() { return 0; }

}  // namespace dtk::cuda

#include "dtk/core/tensor.h"

namespace dtk::cuda {
Stream current_stream() { return {}; }
void set_current_stream(Stream) {}
Stream create_stream() { no_cuda(); }
void destroy_stream(Stream) {}
void stream_synchronize(Stream, const char*) {}
void* create_timing_event() { no_cuda(); }
void destroy_event(void*) {}
void record_event(void*, Stream) { no_cuda(); }
double elapsed_seconds(void*, void*) { no_cuda(); }
bool event_done(void*) { no_cuda(); }
void memcpy_async(void*, const void*, size_t, Stream) { no_cuda(); }
void memset_async(void*, int, size_t, Stream) { no_cuda(); }
void* cached_malloc(size_t, int, size_t*) { no_cuda(); }
void cached_free(void*, int, size_t) {}
MemoryStats cached_stats() { return {}; }
void cached_reset_peak() {}
void cached_empty() {}
}  // namespace dtk::cuda
