// Tensor storage and views, allocator statistics, Philox known answers and distributions, fill
// and cast; the formatting error throwers.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <string>
#include <utility>

#include "dtk/core/error.h"
#include "dtk/core/philox.h"
#include "dtk/core/tensor.h"
#include "dtk/ops/ops.h"

// The reference (librandom123-dev); it defines a macro of our function's name.
#include <Random123/philox.h>
#undef philox4x32

namespace dtk {
namespace {

// The message of the Error that f throws, and whether it is a UsageError.
template <class F>
std::pair<std::string, bool> thrown(F f) {
  try {
    f();
  } catch (const UsageError& e) {
    return {e.what(), true};
  } catch (const Error& e) {
    return {e.what(), false};
  }
  return {"(nothing thrown)", false};
}

// fail / fail_usage format their arguments into the message; a single string is the message as
// it is, braces and all.
TEST(Errors, FormatOrPassThrough) {
  EXPECT_EQ(thrown([] { fail_usage("schedule: warmup must be >= 0, got {}", -1); }),
            std::make_pair(std::string("schedule: warmup must be >= 0, got -1"), true));
  EXPECT_EQ(thrown([] { fail("lr {} at step {} of {}", 0.0001, int64_t{3}, std::string("run")); }),
            std::make_pair(std::string("lr 0.0001 at step 3 of run"), false));
  const std::string built = "config {\"a\": 1} has {} in it";
  EXPECT_EQ(thrown([&] { fail_usage(built); }).first, built);
  EXPECT_EQ(thrown([&] { fail(built); }).first, built);
  EXPECT_EQ(thrown([] { fail("a literal {} alone"); }).first, "a literal {} alone");
}

TEST(Tensor, ShapeViewsAndCopies) {
  Tensor t = Tensor::from_doubles({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, {3, 4}, DType::f32);
  EXPECT_EQ(t.numel(), 12);
  EXPECT_EQ(t.ndim(), 2);
  EXPECT_EQ(t.dim(-1), 4);
  EXPECT_EQ(t.bytes(), 48u);
  EXPECT_EQ(t.str(), "f32[3, 4] on cpu");

  Tensor r = t.reshape({2, -1});
  EXPECT_EQ(r.shape(), (Shape{2, 6}));
  EXPECT_TRUE(r.shares_storage(t));
  EXPECT_THROW(t.reshape({5, -1}), UsageError);
  EXPECT_THROW(t.reshape({-1, -1}), UsageError);

  Tensor s = t.slice(1, 3);
  EXPECT_EQ(s.shape(), (Shape{2, 4}));
  EXPECT_EQ(s.to_doubles()[0], 4);
  Tensor row = t.select(2);
  EXPECT_EQ(row.shape(), (Shape{4}));
  EXPECT_EQ(row.to_doubles(), (std::vector<double>{8, 9, 10, 11}));
  EXPECT_THROW(t.slice(2, 4), UsageError);

  // Writes through a view reach the base; a clone is independent.
  Tensor c = t.clone();
  row.ptr<float>()[0] = 100;
  EXPECT_EQ(t.to_doubles()[8], 100);
  EXPECT_EQ(c.to_doubles()[8], 8);
  c.copy_from(t);
  EXPECT_EQ(c.to_doubles()[8], 100);
  EXPECT_THROW(c.copy_from(Tensor::zeros({3}, DType::f32)), UsageError);

  Tensor z = Tensor::zeros({1000}, DType::f64);
  const auto zv = z.to_doubles();
  EXPECT_EQ(std::accumulate(zv.begin(), zv.end(), 0.0), 0.0);
  EXPECT_EQ(Tensor::from_doubles({3.5}, {1}, DType::f64).item(), 3.5);
  EXPECT_THROW(Tensor::empty({2, -1}, DType::f32), UsageError);
}

// Views laid end to end join into one 1-d view (the optimizers' multi-tensor steps); anything
// else does not.
TEST(Tensor, JoinedViews) {
  Tensor t = Tensor::from_doubles({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, {12}, DType::f32);
  const Tensor a = t.slice(0, 4).reshape({2, 2}), b = t.slice(4, 5), c = t.slice(5, 12);
  const Tensor j = Tensor::joined({a, b, c});
  ASSERT_TRUE(j.defined());
  EXPECT_EQ(j.shape(), (Shape{12}));
  EXPECT_EQ(j.data(), t.data());
  EXPECT_TRUE(j.shares_storage(t));
  EXPECT_EQ(Tensor::joined({b, c}).to_doubles()[0], 4);
  EXPECT_EQ(Tensor::joined({a}).shape(), (Shape{4}));
  EXPECT_FALSE(Tensor::joined({a, c}).defined());     // a gap
  EXPECT_FALSE(Tensor::joined({b, a}).defined());     // out of order
  EXPECT_FALSE(Tensor::joined({a, a}).defined());     // overlapping
  EXPECT_FALSE(Tensor::joined({a, b.clone()}).defined());  // another storage
  EXPECT_FALSE(Tensor::joined({t.view(DType::i32).slice(0, 4), b}).defined());  // another dtype
  EXPECT_FALSE(Tensor::joined({}).defined());
  // On the CPU an upload is the tensor itself.
  HostUpload up(Device::cpu());
  EXPECT_EQ(up(t).data(), t.data());
}

TEST(Tensor, HostMemoryIsAlignedAndCounted) {
  const MemoryStats before = memory_stats(Device::cpu());
  {
    Tensor a = Tensor::empty({1001}, DType::f32);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % 64, 0u);
    const MemoryStats during = memory_stats(Device::cpu());
    EXPECT_GE(during.current, before.current + 4004);
    EXPECT_GE(during.peak, during.current);
  }
  EXPECT_EQ(memory_stats(Device::cpu()).current, before.current);
}

// Known answers of Philox-4x32-10 from the Random123 distribution (kat_vectors).
TEST(Philox, KnownAnswers) {
  auto check = [](philox::U4 ctr, uint32_t k0, uint32_t k1, philox::U4 want) {
    const philox::U4 got = philox::philox4x32_10(ctr, k0, k1);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(got.x[i], want.x[i]) << i;
  };
  check({{0, 0, 0, 0}}, 0, 0, {{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}});
  check({{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}}, 0xffffffffu, 0xffffffffu,
        {{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}});
  check({{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}}, 0xa4093822u, 0x299f31d0u,
        {{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}});
}

// The same stream as Random123's own Philox4x32 (librandom123-dev, the authors' reference) over a
// grid of counters and keys. dtk keeps its 30-line copy, usable unchanged in CUDA kernels, and
// holds it to the reference here.
TEST(Philox, MatchesRandom123) {
  int compared = 0;
  for (uint32_t k0 : {0u, 1u, 0x9e3779b9u, 0xffffffffu})
    for (uint32_t k1 : {0u, 42u})
      for (uint32_t c0 : {0u, 7u, 0xffffffffu})
        for (uint32_t c1 : {0u, 1u})
          for (uint32_t c2 : {0u, 5u}) {
            const r123::Philox4x32::ctr_type c = {{c0, c1, c2, 3}};
            const r123::Philox4x32::key_type k = {{k0, k1}};
            const auto want = r123::Philox4x32()(c, k);
            const philox::U4 got = philox::philox4x32_10(philox::U4{{c0, c1, c2, 3}}, k0, k1);
            for (int i = 0; i < 4; ++i, ++compared) ASSERT_EQ(got.x[i], want.v[i]) << "word " << i;
          }
  EXPECT_EQ(compared, 4 * 2 * 3 * 2 * 2 * 4);
}

// Our log and cos (exact-operation versions, for CPU/GPU agreement) against libm.
TEST(Philox, MathMatchesLibm) {
  for (double u : {1e-300, 1e-20, 1e-5, 0.1, 0.3, 0.5, 0.7071, 0.9, 0.999999, 1.0})
    EXPECT_NEAR(philox::log_unit(u), std::log(u), 4e-16 * std::fabs(std::log(u)) + 1e-300) << u;
  for (int i = 0; i < 1000; ++i) {
    const double t = i / 1000.0;
    EXPECT_NEAR(philox::cos_turns(t), std::cos(2 * M_PI * t), 1e-15) << t;
  }
}

TEST(Philox, FillsAreReproducibleAndDistributed) {
  const int64_t n = 200003;
  Tensor u = Tensor::empty({n}, DType::f64), v = Tensor::empty({n}, DType::f64);
  ops::uniform_(u, 42, 7, -1, 3);
  ops::uniform_(v, 42, 7, -1, 3);
  EXPECT_EQ(u.to_doubles(), v.to_doubles());
  const auto x = u.to_doubles();
  double mean = 0, lo = 1e9, hi = -1e9;
  for (double d : x) mean += d, lo = std::min(lo, d), hi = std::max(hi, d);
  mean /= n;
  EXPECT_NEAR(mean, 1.0, 0.02);
  EXPECT_GE(lo, -1);
  EXPECT_LT(hi, 3);

  // Offsets address the same stream: element i of offset 7 is element i+7 of offset 0.
  Tensor w = Tensor::empty({n + 7}, DType::f64);
  ops::uniform_(w, 42, 0, -1, 3);
  EXPECT_EQ(w.to_doubles()[7 + 100], x[100]);

  Tensor g = Tensor::empty({n}, DType::f32);
  ops::normal_(g, 3, 0, 0.5, 2.0);
  const auto y = g.to_doubles();
  double m = 0, s = 0;
  for (double d : y) m += d;
  m /= n;
  for (double d : y) s += (d - m) * (d - m);
  s = std::sqrt(s / n);
  EXPECT_NEAR(m, 0.5, 0.02);
  EXPECT_NEAR(s, 2.0, 0.02);
  int64_t beyond3 = 0;  // two-sided tail beyond 3 sigma: 0.27%
  for (double d : y) beyond3 += std::fabs(d - 0.5) > 6.0;
  EXPECT_NEAR(static_cast<double>(beyond3) / n, 0.0027, 0.0008);

  // A different seed gives different numbers; bf16 and f16 fills round the f32 draw.
  Tensor g2 = Tensor::empty({n}, DType::f32);
  ops::normal_(g2, 4, 0, 0.5, 2.0);
  EXPECT_NE(g2.to_doubles(), y);
  Tensor b = Tensor::empty({n}, DType::bf16);
  ops::normal_(b, 3, 0, 0.5, 2.0);
  const auto bb = b.to_doubles();
  for (int64_t i = 0; i < 1000; ++i) EXPECT_EQ(bb[i], bf16_to_float(float_to_bf16(static_cast<float>(y[i]))));
}

TEST(Ops, FillAndCast) {
  for (DType t : kAllDTypes) {
    Tensor a = Tensor::empty({1003}, t);
    ops::fill(a, 7);
    for (double d : a.to_doubles()) ASSERT_EQ(d, 7) << dtype_name(t);
  }
  Tensor src = Tensor::from_doubles({-2.5, -1, 0, 0.5, 1.5, 300, 1e10, std::nan("")}, {8}, DType::f64);
  Tensor i32 = Tensor::empty({8}, DType::i32);
  ops::cast(src, i32);
  EXPECT_EQ(i32.to_doubles(), (std::vector<double>{-2, -1, 0, 0, 1, 300, 2147483647, 0}));
  Tensor u8 = Tensor::empty({8}, DType::u8);
  ops::cast(src, u8);
  EXPECT_EQ(u8.to_doubles(), (std::vector<double>{0, 0, 0, 0, 1, 255, 255, 0}));
  Tensor bf = Tensor::empty({8}, DType::bf16);
  ops::cast(src, bf);
  EXPECT_EQ(bf.to_doubles()[5], 300);
  EXPECT_EQ(bf.to_doubles()[3], 0.5);
  EXPECT_TRUE(std::isnan(bf.to_doubles()[7]));
  // Round trips: f32 -> bf16 -> f32 keeps the bf16-representable values; f16 likewise.
  Tensor f = Tensor::empty({1000}, DType::f32), h = Tensor::empty({1000}, DType::f16), back = Tensor::empty({1000}, DType::f32);
  ops::normal_(f, 1, 0);
  ops::cast(f, h);
  ops::cast(h, back);
  const auto fv = f.to_doubles(), bv = back.to_doubles();
  for (size_t i = 0; i < fv.size(); ++i) EXPECT_NEAR(bv[i], fv[i], std::fabs(fv[i]) * 0x1p-11 + 0x1p-24);
  EXPECT_THROW(ops::cast(f, i32), UsageError);
  Tensor ints = Tensor::empty({4}, DType::i64);
  EXPECT_THROW(ops::normal_(ints, 1, 0), UsageError);
}

}  // namespace
}  // namespace dtk
