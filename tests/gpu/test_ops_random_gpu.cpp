// The GPU's Philox fills, fill and cast against the CPU's: bit for bit.
#include <gtest/gtest.h>

#include <cstdio>

#include "dtk/core/tensor.h"
#include "dtk/ops/ops.h"

namespace dtk {
namespace {

void report(const char* op, DType t, bool same) {
  std::printf("gpu-check: %s %s bit-identical=%s %s\n", op, std::string(dtype_name(t)).c_str(), same ? "yes" : "no",
              same ? "PASS" : "FAIL");
}

TEST(GpuRandom, PhiloxFillsAreBitIdentical) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no GPU";
  for (DType t : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
    for (bool normal : {false, true}) {
      const int64_t n = (1 << 20) + 3;
      Tensor c = Tensor::empty({n}, t), g = Tensor::empty({n}, t, Device::cuda(0));
      if (normal) {
        ops::normal_(c, 1234, 99, 0.1, 0.02);
        ops::normal_(g, 1234, 99, 0.1, 0.02);
      } else {
        ops::uniform_(c, 1234, 99, -0.5, 0.5);
        ops::uniform_(g, 1234, 99, -0.5, 0.5);
      }
      const bool same = c.to_doubles() == g.to_doubles();
      report(normal ? "normal_" : "uniform_", t, same);
      EXPECT_TRUE(same);
    }
  }
}

TEST(GpuRandom, FillAndCastMatchCpu) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no GPU";
  Tensor src = Tensor::empty({100003}, DType::f32);
  ops::normal_(src, 5, 0, 0, 1000);
  const Tensor gsrc = src.to(Device::cuda(0));
  for (DType t : kAllDTypes) {
    Tensor c = Tensor::empty({100003}, t), g = Tensor::empty({100003}, t, Device::cuda(0));
    ops::cast(src, c);
    ops::cast(gsrc, g);
    const bool same = c.to_doubles() == g.to_doubles();
    report("cast", t, same);
    EXPECT_TRUE(same);
    ops::fill(g, 3);
    for (double d : g.to_doubles()) ASSERT_EQ(d, 3);
  }
}

}  // namespace
}  // namespace dtk
