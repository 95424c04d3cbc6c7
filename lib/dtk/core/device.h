// Where memory lives, and the few CUDA runtime calls that modules below ops need (comm stages
// device buffers through pinned host memory). Built without CUDA, the cuda:: functions report
// that the build has no CUDA backend; cuda::device_count() is then 0.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace dtk {

enum class DeviceType : uint8_t { cpu, cuda };

struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;

  static Device cpu() { return {}; }
  static Device cuda(int i = 0) { return {DeviceType::cuda, i}; }
  bool is_cuda() const { return type == DeviceType::cuda; }
  bool operator==(const Device&) const = default;
  std::string str() const;  // "cpu", "cuda:0"
};

Device parse_device(std::string_view s);  // "cpu", "cuda", "cuda:N"

namespace cuda {
bool compiled();      // this build has the CUDA backend
// What this build and machine offer, for --version: "runtime 13.0, code for sm_90, driver 13.0;
// GPUs visible: 1 (NVIDIA H100 80GB HBM3)", or "none (built without the CUDA backend); GPUs
// visible: 0".
std::string describe();
int device_count();   // 0 without a GPU or without the CUDA backend
// For --device cuda: a UsageError saying why this process has no GPU to use (no CUDA backend in
// the build, or none visible), else nothing.
void require_gpu();
void set_device(int index);
int current_device();
std::string device_name(int index);
void* malloc_device(size_t bytes);
void free_device(void* p);
void* malloc_pinned(size_t bytes);
void free_pinned(void* p);
// Pins (page-locks) existing host memory for fast copies from the device, and unpins it.
void host_register(void* p, size_t bytes);
void host_unregister(void* p);
// "GPU-<uuid>", as nvidia-smi -L prints it: tells apart two indices that name one physical GPU
// (each rank of a host may see its own CUDA_VISIBLE_DEVICES).
std::string device_uuid(int index);
// Any direction, in the current stream's order (after the work queued there). Synchronous
// when host memory is involved: the host waits (wait_event) for the copy; device to device, the
// stream's later work sees the copy.
void memcpy(void* dst, const void* src, size_t bytes);

// The host's waits for the GPU. Every place where the host blocks on device work goes through
// wait_event (stream_synchronize, memcpy and the ops' reads of device results use it), and
// wait_event through one hook that comm::Runtime installs: it waits under the collective
// watchdog and polls NCCL's asynchronous errors meanwhile, so that a collective stuck on the GPU
// ends the job as one stuck on the host does. Without a hook: a blocking wait. The hook calls
// done(event) until it returns true (done throws on a CUDA error).
using WaitHook = void (*)(const char* what, size_t bytes, bool (*done)(void* event), void* event);
void set_wait_hook(WaitHook hook);  // nullptr: the blocking wait
// Blocks the host until a CUDA event (a cudaEvent_t) has completed; `what` and `bytes` name
// the wait in the watchdog's message.
void wait_event(void* event, const char* what, size_t bytes = 0);
// How many of wait_event's waits found their event not yet complete (the host stalled on the
// GPU), in this process so far: the trainer logs the stalls inside each step (--log-level debug).
uint64_t host_stalls();
}  // namespace cuda

}  // namespace dtk
