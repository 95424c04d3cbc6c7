// bf16 attention on the GPU (flash_attention.cu: tensor cores) against the CPU's bf16 path. Both
// implement ops.h's rounding points, but the GPU takes a row's softmax in 64-key tiles (a running
// max) and sums in another order, so a P or dS element may round to the neighbouring bf16 value:
// the results agree to well under 2^-8 in norm, and each tensor is compared by
// ||gpu - cpu|| / max(||cpu||, 1e-3 sqrt(n)) <= 1e-2 (the floor: a gradient that is zero but for
// f32 noise, as at T = 1, compares as small). The backward gets the CPU forward's out and lse on
// both sides, so that it is compared alone. Two runs of each GPU op must be bit-identical. Each
// comparison prints scripts/gpu-check's "gpu-check:" line.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "dtk/core/tensor.h"
#include "dtk/ops/ops.h"
#include "../common/gpu_check.h"

namespace dtk {
namespace {

using namespace gpu_test;

constexpr double kTol = 1e-2;

struct Case {
  int64_t B, T, H, Hkv, hd;
};

Tensor normal_bf16(const Shape& s, uint64_t seed, double std) {
  Tensor x = Tensor::empty(s, DType::bf16);
  ops::normal_(x, seed, 0, 0.0, std);
  return x;
}

// ||got - want|| / max(||want||, 1e-3 sqrt(n)), infinite for a NaN or a size mismatch.
double norm_err(const Tensor& got, const Tensor& want) {
  const Vec g = got.to_doubles(), w = want.to_doubles();
  if (g.size() != w.size()) return INFINITY;
  double e = 0, n = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    if (!std::isfinite(g[i])) return INFINITY;
    e += (g[i] - w[i]) * (g[i] - w[i]);
    n += w[i] * w[i];
  }
  return std::sqrt(e) / std::max(std::sqrt(n), 1e-3 * std::sqrt(static_cast<double>(g.size())));
}

bool same_bits(const Tensor& a, const Tensor& b) {
  const Tensor x = a.to(Device::cpu()), y = b.to(Device::cpu());
  return x.bytes() == y.bytes() && std::memcmp(x.data(), y.data(), x.bytes()) == 0;
}

struct Errors {
  double out = 0, lse = 0, dq = 0, dk = 0, dv = 0;
  bool deterministic = true;
};

std::string name_of(const Case& c) {
  return "B=" + std::to_string(c.B) + " T=" + std::to_string(c.T) + " H=" + std::to_string(c.H) +
         " Hkv=" + std::to_string(c.Hkv) + " hd=" + std::to_string(c.hd);
}

// One shape: the CPU and the GPU forward and backward on the same inputs; the GPU twice.
Errors compare(const Case& c, uint64_t seed) {
  const Shape qs{c.B, c.T, c.H, c.hd}, ks{c.B, c.T, c.Hkv, c.hd}, ls{c.B, c.H, c.T};
  const Tensor q = normal_bf16(qs, seed, 1.5), k = normal_bf16(ks, seed + 1, 1.5), v = normal_bf16(ks, seed + 2, 1.0);
  const Tensor dout = normal_bf16(qs, seed + 3, 1.0);
  Tensor out = Tensor::empty(qs, DType::bf16), lse = Tensor::empty(ls, DType::f32);
  ops::attention_forward(q, k, v, out, lse);
  Tensor dq = Tensor::empty(qs, DType::bf16), dk = Tensor::empty(ks, DType::bf16), dv = Tensor::empty(ks, DType::bf16);
  ops::attention_backward(q, k, v, out, lse, dout, dq, dk, dv);

  const Tensor gq = q.to(kGpu), gk = k.to(kGpu), gv = v.to(kGpu), gdout = dout.to(kGpu);
  const Tensor gout_cpu = out.to(kGpu), glse_cpu = lse.to(kGpu);
  Errors e;
  Tensor go[2], gl[2], gdq[2], gdk[2], gdv[2];
  for (int run = 0; run < 2; ++run) {
    go[run] = Tensor::empty(qs, DType::bf16, kGpu);
    gl[run] = Tensor::empty(ls, DType::f32, kGpu);
    ops::attention_forward(gq, gk, gv, go[run], gl[run]);
    gdq[run] = Tensor::empty(qs, DType::bf16, kGpu);
    gdk[run] = Tensor::empty(ks, DType::bf16, kGpu);
    gdv[run] = Tensor::empty(ks, DType::bf16, kGpu);
    ops::attention_backward(gq, gk, gv, gout_cpu, glse_cpu, gdout, gdq[run], gdk[run], gdv[run]);
  }
  e.out = norm_err(go[0], out);
  e.lse = norm_err(gl[0], lse);
  e.dq = norm_err(gdq[0], dq);
  e.dk = norm_err(gdk[0], dk);
  e.dv = norm_err(gdv[0], dv);
  e.deterministic = same_bits(go[0], go[1]) && same_bits(gl[0], gl[1]) && same_bits(gdq[0], gdq[1]) &&
                    same_bits(gdk[0], gdk[1]) && same_bits(gdv[0], gdv[1]);
  return e;
}

// B = 2, H = 4: every T around the 64-row tiles, every group size, both head dims.
TEST(GpuAttentionBf16, AgainstCpu) {
  SKIP_WITHOUT_GPU();
  for (int64_t hd : {64, 128}) {
    Errors worst;
    uint64_t seed = 300;
    for (int64_t T : {1, 63, 64, 130, 257})
      for (int64_t Hkv : {4, 2, 1}) {
        const Case c{2, T, 4, Hkv, hd};
        const Errors e = compare(c, seed += 4);
        EXPECT_TRUE(e.deterministic) << name_of(c);
        worst.out = std::max(worst.out, e.out);
        worst.lse = std::max(worst.lse, e.lse);
        worst.dq = std::max(worst.dq, e.dq);
        worst.dk = std::max(worst.dk, e.dk);
        worst.dv = std::max(worst.dv, e.dv);
        worst.deterministic = worst.deterministic && e.deterministic;
        if (std::max({e.out, e.lse, e.dq, e.dk, e.dv}) > kTol)
          ADD_FAILURE() << name_of(c) << ": out " << e.out << " lse " << e.lse << " dq " << e.dq << " dk " << e.dk
                        << " dv " << e.dv;
      }
    const std::string tag = "(hd " + std::to_string(hd) + ")";
    report("attention_forward" + tag, "bf16", std::max(worst.out, worst.lse), kTol);
    report("attention_backward(dq)" + tag, "bf16", worst.dq, kTol);
    report("attention_backward(dk)" + tag, "bf16", worst.dk, kTol);
    report("attention_backward(dv)" + tag, "bf16", worst.dv, kTol);
    report("attention-determinism" + tag, "bf16", worst.deterministic ? 0.0 : 1.0, 0);
  }
}

// Many tiles per row and per key tile, a group of two query heads per kv head.
TEST(GpuAttentionBf16, Long) {
  SKIP_WITHOUT_GPU();
  const Case c{2, 1024, 4, 2, 128};
  const Errors e = compare(c, 400);
  report("attention_forward(T=1024)", "bf16", std::max(e.out, e.lse), kTol);
  report("attention_backward(T=1024)", "bf16", std::max({e.dq, e.dk, e.dv}), kTol);
  report("attention-determinism(T=1024)", "bf16", e.deterministic ? 0.0 : 1.0, 0);
}

// A view whose data is not 16-byte aligned goes through aligned copies: the same results.
TEST(GpuAttentionBf16, UnalignedViews) {
  SKIP_WITHOUT_GPU();
  const Shape qs{1, 70, 2, 64}, ks{1, 70, 1, 64}, ls{1, 2, 70};
  const int64_t nq = shape_numel(qs), nk = shape_numel(ks);
  // one buffer holding q, k, v one element past a 16-byte boundary each
  Tensor buf = Tensor::empty({1 + nq + nk + nk}, DType::bf16);
  ops::normal_(buf, 410, 0, 0.0, 1.0);
  const Tensor gbuf = buf.to(kGpu);
  auto part = [](const Tensor& b, int64_t at, int64_t n, const Shape& s) { return b.slice(at, at + n).reshape(s); };
  const Tensor q = part(gbuf, 1, nq, qs), k = part(gbuf, 1 + nq, nk, ks), v = part(gbuf, 1 + nq + nk, nk, ks);
  ASSERT_NE(reinterpret_cast<uintptr_t>(q.data()) % 16, 0u);
  Tensor out_buf = Tensor::empty({1 + nq}, DType::bf16, kGpu), lse = Tensor::empty(ls, DType::f32, kGpu);
  Tensor out = part(out_buf, 1, nq, qs);
  ops::attention_forward(q, k, v, out, lse);
  const Tensor qa = q.to(kGpu), ka = k.to(kGpu), va = v.to(kGpu);  // fresh, aligned
  Tensor out_a = Tensor::empty(qs, DType::bf16, kGpu), lse_a = Tensor::empty(ls, DType::f32, kGpu);
  ops::attention_forward(qa, ka, va, out_a, lse_a);
  Tensor dq_buf = Tensor::empty({1 + nq}, DType::bf16, kGpu);
  Tensor dq = part(dq_buf, 1, nq, qs);
  Tensor dk = Tensor::empty(ks, DType::bf16, kGpu), dv = Tensor::empty(ks, DType::bf16, kGpu);
  ops::attention_backward(q, k, v, out, lse, q, dq, dk, dv);
  Tensor dq_a = Tensor::empty(qs, DType::bf16, kGpu), dk_a = Tensor::empty(ks, DType::bf16, kGpu);
  Tensor dv_a = Tensor::empty(ks, DType::bf16, kGpu);
  ops::attention_backward(qa, ka, va, out_a, lse_a, qa, dq_a, dk_a, dv_a);
  const bool same = same_bits(out, out_a) && same_bits(lse, lse_a) && same_bits(dq, dq_a) && same_bits(dk, dk_a) &&
                    same_bits(dv, dv_a);
  report("attention(unaligned views)", "bf16", same ? 0.0 : 1.0, 0);
}

}  // namespace
}  // namespace dtk
