// DiLoCo's pieces that need no ranks: the narrow formats of the pseudo-gradients
// (compress/quantize.h), their exchange in a world of one, and the fragments' schedule
// (parallel/diloco.h). The exchange over several ranks: tests/mpi/test_compress_mpi.cpp; the
// outer step end to end: tests/tools/psgd_diloco.sh.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "dtk/comm/comm.h"
#include "dtk/compress/quantize.h"
#include "dtk/core/error.h"
#include "dtk/core/half.h"
#include "dtk/parallel/diloco.h"

using namespace dtk;
using compress::Wire;

namespace {

std::vector<float> round_trip(Wire w, const std::vector<float>& x, std::vector<float>* err = nullptr) {
  std::vector<uint8_t> q(static_cast<size_t>(compress::wire_bytes(w, static_cast<int64_t>(x.size()))));
  if (err) err->assign(x.size(), 0.0f);
  compress::quantize(w, x.data(), static_cast<int64_t>(x.size()), q.data(), err ? err->data() : nullptr);
  std::vector<float> back(x.size());
  compress::dequantize(w, q.data(), static_cast<int64_t>(x.size()), back.data());
  return back;
}

std::vector<float> normal(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(g);
  return v;
}

}  // namespace

TEST(Quantize, WireBytes) {
  EXPECT_EQ(compress::wire_bytes(Wire::f32, 10), 40);
  EXPECT_EQ(compress::wire_bytes(Wire::bf16, 10), 20);
  EXPECT_EQ(compress::wire_bytes(Wire::int8, 256), 256 + 2 * 4);
  EXPECT_EQ(compress::wire_bytes(Wire::int8, 129), 129 + 2 * 4);
  EXPECT_EQ(compress::wire_bytes(Wire::e3m0, 256), 128 + 2 * 4);
  EXPECT_EQ(compress::wire_bytes(Wire::e3m0, 129), 65 + 2 * 4);
}

TEST(Quantize, Bf16IsRoundToNearestEven) {
  const std::vector<float> x = normal(300, 1);
  std::vector<float> err;
  const std::vector<float> back = round_trip(Wire::bf16, x, &err);
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(back[i], round_bf16(x[i]));
    EXPECT_EQ(err[i], x[i] - back[i]);
  }
}

TEST(Quantize, Int8StepsOfTheBlockMaximum) {
  // 300 elements: two whole blocks and a partial one, each with its own scale.
  std::vector<float> x = normal(300, 2);
  x[5] = 7.0f;  // block 0's scale
  std::vector<float> err;
  const std::vector<float> back = round_trip(Wire::int8, x, &err);
  for (int64_t b = 0; b < 3; ++b) {
    float s = 0;
    for (int64_t i = b * 128; i < std::min<int64_t>(300, (b + 1) * 128); ++i) s = std::max(s, std::fabs(x[i]));
    for (int64_t i = b * 128; i < std::min<int64_t>(300, (b + 1) * 128); ++i) {
      EXPECT_LE(std::fabs(back[i] - x[i]), s / 254.0f * 1.0001f) << i;
      EXPECT_NEAR(back[i] + err[i], x[i], 1e-6f * s) << i;
    }
  }
  EXPECT_NEAR(back[5], 7.0f, 1e-6f);
  // The codes are multiples of s / 127.
  const std::vector<float> y = {127.0f, -63.0f, 1.0f, 0.0f, 0.49f, -0.51f};
  const std::vector<float> q = round_trip(Wire::int8, y);
  const std::vector<float> want = {127.0f, -63.0f, 1.0f, 0.0f, 0.0f, -1.0f};
  for (size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(q[i], want[i], 1e-5f) << i;
  // A zero block stays zero.
  for (float v : round_trip(Wire::int8, std::vector<float>(200, 0.0f))) EXPECT_EQ(v, 0.0f);
}

TEST(Quantize, E3m0IsPowersOfTwoOfTheBlockMaximum) {
  // Scale 1: the levels are 2^-6 .. 1 and 0; ties (1.5 2^k, and 2^-7 against 0) away from zero.
  const std::vector<float> x = {1.0f, 0.5f, 0.74f, 0.75f, 0.3f, 0.4f, -0.3f, 0x1p-7f, 0.0077f, 0.02f, -1.0f, 0.0f, 0.016f};
  const std::vector<float> want = {1.0f, 0.5f, 0.5f, 1.0f, 0.25f, 0.5f, -0.25f, 0x1p-6f, 0.0f, 0x1p-6f, -1.0f, 0.0f, 0x1p-6f};
  std::vector<float> err;
  const std::vector<float> back = round_trip(Wire::e3m0, x, &err);  // 13 elements: an odd count of codes
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(back[i], want[i]) << "x = " << x[i];
    EXPECT_EQ(err[i], x[i] - want[i]) << i;
  }
  // Scaled blocks: each element within a factor 4/3 of its value (2 between s / 128 and s / 64,
  // which round to s / 64), or flushed below s / 128.
  const std::vector<float> y = normal(1000, 3, 0.01f);
  const std::vector<float> yb = round_trip(Wire::e3m0, y);
  for (int64_t b = 0; b * 128 < 1000; ++b) {
    float s = 0;
    for (int64_t i = b * 128; i < std::min<int64_t>(1000, (b + 1) * 128); ++i) s = std::max(s, std::fabs(y[i]));
    for (int64_t i = b * 128; i < std::min<int64_t>(1000, (b + 1) * 128); ++i) {
      if (std::fabs(y[i]) < s / 128) {
        EXPECT_EQ(yb[i], 0.0f);
      } else {
        EXPECT_EQ(std::signbit(yb[i]), std::signbit(y[i]));
        const float r = std::fabs(yb[i]) / std::fabs(y[i]);
        EXPECT_GE(r, 2.0f / 3.0f * 0.9999f) << i;
        EXPECT_LE(r, (std::fabs(y[i]) < s / 64 ? 2.0f : 4.0f / 3.0f) * 1.0001f) << i;
      }
    }
  }
}

// In a world of one the mean is the quantized value, and what it lost stays in the error buffer:
// x + error before == mean + error after (up to f32 rounding), on every format.
TEST(QuantizedMean, WorldOfOneKeepsWhatItLost) {
  auto comm = comm::make_local_communicator();
  for (Wire w : {Wire::f32, Wire::bf16, Wire::int8, Wire::e3m0}) {
    const std::vector<float> x = normal(1000, 4, 0.1f);
    std::vector<float> e = normal(1000, 5, 0.001f), e0 = e, mean(1000);
    compress::QuantizedMean q(*comm, w);
    q.start(x.data(), w == Wire::f32 ? nullptr : e.data(), 1000);
    EXPECT_TRUE(q.in_flight());
    q.finish(mean.data());
    EXPECT_FALSE(q.in_flight());
    EXPECT_EQ(q.bytes(), w == Wire::f32 ? 4000 : compress::wire_bytes(w, 1024));  // whole blocks
    for (size_t i = 0; i < x.size(); ++i) {
      if (w == Wire::f32) {
        EXPECT_EQ(mean[i], x[i]);
      } else {
        EXPECT_NEAR(mean[i] + e[i], x[i] + e0[i], 1e-6) << name_of(w) << " " << i;
      }
    }
  }
}

TEST(OuterSchedule, StreamingFragmentsTakeTurns) {
  // H 8, F 4, tau 1: fragment p is applied after steps 2 (p + 1) + 8 k and sent one step before.
  const parallel::OuterSchedule s{8, 1, 4};
  std::vector<int> applied, sent;
  for (int64_t n = 1; n <= 16; ++n) applied.push_back(s.applied_after(n)), sent.push_back(s.sent_after(n));
  EXPECT_EQ(applied, (std::vector<int>{-1, 0, -1, 1, -1, 2, -1, 3, -1, 0, -1, 1, -1, 2, -1, 3}));
  EXPECT_EQ(sent, (std::vector<int>{0, -1, 1, -1, 2, -1, 3, -1, 0, -1, 1, -1, 2, -1, 3, -1}));
  EXPECT_EQ(s.in_flight(1), (std::pair<int, int64_t>{0, 2}));
  EXPECT_EQ(s.in_flight(2), (std::pair<int, int64_t>{-1, 0}));
  EXPECT_EQ(s.in_flight(7), (std::pair<int, int64_t>{3, 8}));
  EXPECT_EQ(s.round(0, 2), 0);
  EXPECT_EQ(s.round(0, 10), 1);
  EXPECT_EQ(s.round(3, 16), 1);
}

TEST(OuterSchedule, DiLoCoSyncsEveryH) {
  const parallel::OuterSchedule s{4, 0, 1};
  for (int64_t n = 1; n <= 12; ++n) {
    EXPECT_EQ(s.applied_after(n), n % 4 == 0 ? 0 : -1) << n;
    EXPECT_EQ(s.sent_after(n), s.applied_after(n)) << n;
    EXPECT_EQ(s.in_flight(n).first, -1) << n;
  }
  const parallel::OuterSchedule d{4, 2, 1};  // overlapped: sent after 2, 6, ..., applied after 4, 8, ...
  EXPECT_EQ(d.sent_after(2), 0);
  EXPECT_EQ(d.in_flight(3), (std::pair<int, int64_t>{0, 4}));
  EXPECT_EQ(d.in_flight(4).first, -1);
}

TEST(OuterConfig, RefusesWhatDoesNotFit) {
  const auto refused = [](parallel::OuterConfig c, int world, const char* what) {
    try {
      c.validate(world);
      ADD_FAILURE() << "accepted: " << what;
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  parallel::OuterConfig d;
  d.sync = parallel::Sync::diloco;
  EXPECT_NO_THROW(d.validate(4));
  parallel::OuterConfig c = d;
  c.fragments = 2;
  refused(c, 4, "fragments need --sync streaming");
  c = d, c.delay = 64;
  refused(c, 4, "--sync-delay 64 must be below --sync-every 64");
  c = d, c.group = 3;
  refused(c, 4, "--sync-groups 3 does not divide");
  c = d, c.momentum = 1;
  refused(c, 4, "--outer-momentum");
  parallel::OuterConfig s = d;
  s.sync = parallel::Sync::streaming;
  s.fragments = 1;
  refused(s, 4, "at least 2");
  s.fragments = 3;
  refused(s, 4, "not a multiple of --fragments 3");
  s.fragments = 4, s.delay = 16;
  refused(s, 4, "must be below --sync-every / --fragments = 16");
  s.delay = 15;
  EXPECT_NO_THROW(s.validate(4));
  s.delay = 1, s.fragments = 0;  // F chosen with H: only by --sync-every auto
  refused(s, 4, "at least 2");
  s.every = 0;
  EXPECT_NO_THROW(s.validate(4));
}

TEST(OuterSchedule, FragmentsBalanceTheElements) {
  // Elements 10, 7, 5, 5, 3 into 2: 10 | 7, then 5 to the 7 (12), 5 to the 10 (15), 3 to the 12.
  std::vector<nn::Param> ps;
  for (int64_t n : {10, 7, 5, 5, 3}) ps.push_back({"p" + std::to_string(n), {}, {}, 0, {n}, nn::Init::by_name, 0, {}});
  const auto f = parallel::balanced_fragments(ps, 2);
  EXPECT_EQ(f, (std::vector<std::vector<size_t>>{{0, 3}, {1, 2, 4}}));
  EXPECT_EQ(parallel::balanced_fragments(ps, 5).size(), 5u);
}
