// The mixed-precision ops (ops.h: "mixes") on the GPU against the CPU (skipped without a GPU):
// tests/common/mixed_ops.h's table, run on both with bf16 tensors. Both compute in f32 and round
// each bf16 output once; their f32 arithmetic differs in the order of sums and in a few ulps of
// exp and sincos, which can move a bf16 rounding by one step: a bf16 output within 2^-7 of the
// CPU's (relative to the largest |x|), an f32 output within 1e-5. Each case runs twice on the GPU,
// bit-identical. The bf16 gemm (bf16 and f32 C, Math::bf16 on f32 operands) likewise.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <string>
#include <vector>

#include "../common/gpu_check.h"
#include "../common/mixed_ops.h"
#include "dtk/core/device.h"
#include "dtk/core/tensor.h"
#include "dtk/ops/ops.h"

namespace dtk::gpu_test {
namespace {

TEST(GpuMixed, MatchesCpu) {
  SKIP_WITHOUT_GPU();
  for (const test_util::MixedCase& c : test_util::mixed_cases()) {
    const std::vector<Tensor> cpu = c.run(DType::bf16, Device::cpu()), gpu = c.run(DType::bf16, kGpu);
    const std::vector<Tensor> again = c.run(DType::bf16, kGpu);
    ASSERT_EQ(cpu.size(), gpu.size()) << c.name;
    for (size_t i = 0; i < cpu.size(); ++i) {
      const bool bf16 = cpu[i].dtype() == DType::bf16;
      report(c.name + " output " + std::to_string(i), bf16 ? "bf16" : "f32",
             max_rel_err(gpu[i].to_doubles(), cpu[i].to_doubles()), bf16 ? std::ldexp(1.0, -7) : 1e-5);
      EXPECT_EQ(exact_err(gpu[i], again[i]), 0) << c.name << " output " << i << ": two GPU runs differ";
    }
  }
}

TEST(GpuMixed, GemmBf16) {
  SKIP_WITHOUT_GPU();
  const std::vector<std::array<int64_t, 3>> shapes = {{7, 33, 100}, {257, 129, 65}, {512, 512, 512}};
  uint64_t seed = 1300;
  double e16 = 0, e32 = 0, emath = 0;
  for (const auto& [m, n, k] : shapes)
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb) {
        const Shape as = ta ? Shape{k, m} : Shape{m, k}, bs = tb ? Shape{n, k} : Shape{k, n}, cs{m, n};
        const auto vals = [&](const Shape& s) { return test_util::randn(shape_numel(s), seed++); };
        const Vec av = vals(as), bv = vals(bs), cv = vals(cs);
        for (DType ct : {DType::bf16, DType::f32}) {
          Tensor a = Tensor::from_doubles(av, as, DType::bf16), b = Tensor::from_doubles(bv, bs, DType::bf16);
          Tensor c = Tensor::from_doubles(cv, cs, ct), cg = c.to(kGpu);
          ops::gemm(ta, tb, 1.5, a, b, -0.5, c);
          ops::gemm(ta, tb, 1.5, a.to(kGpu), b.to(kGpu), -0.5, cg);
          double& e = ct == DType::bf16 ? e16 : e32;
          e = std::max(e, max_rel_err(cg.to_doubles(), c.to_doubles()));
        }
        Tensor a = Tensor::from_doubles(av, as, DType::f32), b = Tensor::from_doubles(bv, bs, DType::f32);
        Tensor c = Tensor::from_doubles(cv, cs, DType::f32), cg = c.to(kGpu);
        ops::gemm(ta, tb, 1.5, a, b, -0.5, c, ops::Math::bf16);
        ops::gemm(ta, tb, 1.5, a.to(kGpu), b.to(kGpu), -0.5, cg, ops::Math::bf16);
        emath = std::max(emath, max_rel_err(cg.to_doubles(), c.to_doubles()));
      }
  // f32 sums of k unit-scale products in another order: 1e-4 of sqrt(k) scale; a bf16 C one
  // rounding step besides.
  report("gemm_bf16_c_vs_cpu", "bf16", e16, std::ldexp(1.0, -7));
  report("gemm_bf16_f32c_vs_cpu", "f32", e32, 1e-4);
  report("gemm_math_bf16_vs_cpu", "f32", emath, 1e-4);
}

}  // namespace
}  // namespace dtk::gpu_test
