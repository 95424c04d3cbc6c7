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
int device_count();   // 0 without a GPU or without the CUDA backend
void set_device(int index);
int current_device();
std::string device_name(int index);
void* malloc_device(size_t bytes);
void free_device(void* p);
void* malloc_pinned(size_t bytes);
void free_pinned(void* p);
void memcpy(void* dst, const void* src, size_t bytes);  // any direction; synchronous
void synchronize();
}  // namespace cuda

}  // namespace dtk
