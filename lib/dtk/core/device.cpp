#include "dtk/core/device.h"

#include <fmt/format.h>

#include <charconv>

#include "dtk/core/error.h"

namespace dtk {

std::string Device::str() const {
  return is_cuda() ? fmt::format("cuda:{}", index) : std::string("cpu");
}

Device parse_device(std::string_view s) {
  if (s == "cpu") return Device::cpu();
  if (s == "cuda" || s == "gpu") return Device::cuda(0);
  if (s.starts_with("cuda:")) {
    int i = -1;
    auto rest = s.substr(5);
    auto [p, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), i);
    if (ec == std::errc() && p == rest.data() + rest.size() && i >= 0) return Device::cuda(i);
  }
  fail_usage("unknown device '" + std::string(s) + "' (expected cpu, cuda or cuda:N)");
}

void cuda::require_gpu() {
  if (device_count() > 0) return;
  fail_usage(compiled() ? "--device cuda: this rank sees no GPU"
                        : "--device cuda: this dtk was built without the CUDA backend");
}

}  // namespace dtk
